//! The heartbeat monitor on the CPU: several ranks' monitors in one process, meeting at a real
//! store, with failures injected (a rank that vanishes, stops beating, fails, leaves, issues
//! different collectives, or loses the store) and the verdicts checked word for word.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::*;
use crate::process_group::{describe_barrier, CollectiveKind, ReduceOp};
use crate::store::StoreServer;
use tandem_core::DType;

/// Faults injected into a monitor's heartbeat thread.
#[derive(Default)]
pub(super) struct Faults {
    /// Stop publishing and reading (the process is stopped).
    paused: AtomicBool,
    /// Exit without a last heartbeat (the process is killed; its connection then closes).
    vanish: AtomicBool,
}

impl Faults {
    /// Whether the thread skips this exchange.
    pub(super) fn skip_exchange(&self, _stopping: bool) -> bool {
        self.vanish.load(Ordering::SeqCst) || self.paused.load(Ordering::SeqCst)
    }
}

/// 2 s to notice a failure: stale after 1 s, beats every 50 ms, 200 ms grace (short, but long
/// enough that a loaded test machine does not starve a heartbeat thread into staleness).
const FAILURE_TIMEOUT: Duration = Duration::from_secs(2);

fn group(world: usize, owner: Option<usize>) -> (StoreServer, Vec<Monitor>) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    let monitors = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
                    Monitor::start(MonitorSetup {
                        store: &store,
                        prefix: "tandem/test/nccl/1".into(),
                        rank,
                        world,
                        timing: Timing::new(FAILURE_TIMEOUT, world),
                        store_owner: owner,
                        connect_timeout: Duration::from_secs(10),
                        wait_log_interval: Duration::from_secs(30),
                    })
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (server, monitors)
}

fn all_reduce(numel: u64) -> CollectiveDesc {
    CollectiveDesc {
        kind: CollectiveKind::AllReduce,
        dtype: Some(DType::F32),
        numel,
        op: Some(ReduceOp::Sum),
        root: None,
    }
}

fn all_gather(numel: u64) -> CollectiveDesc {
    CollectiveDesc {
        kind: CollectiveKind::AllGather,
        dtype: Some(DType::F32),
        numel,
        op: None,
        root: None,
    }
}

fn in_flight(seq: u64, desc: CollectiveDesc) -> Option<InFlight> {
    Some(InFlight {
        seq,
        desc,
        started_at: Some(Instant::now()),
    })
}

/// Polls `monitor.assess` until it gives a verdict or `within` passes.
fn verdict(
    monitor: &Monitor,
    flight: Option<InFlight>,
    timeout: Duration,
    within: Duration,
) -> Option<DistError> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = monitor.assess(Instant::now(), flight, timeout) {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

const LONG: Duration = Duration::from_secs(600);

/// Waits (at most 5 s) until `monitor` has read a heartbeat of `peer` that reports at least
/// `issued` collectives issued and `done` finished: a fixed sleep races the heartbeat threads
/// on a loaded machine.
fn until_seen(monitor: &Monitor, peer: usize, issued: u64, done: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = monitor.inner.peers.lock()[peer]
            .beat
            .as_ref()
            .is_some_and(|b| b.issued >= issued && b.done >= done);
        if seen {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "rank {} never saw rank {peer} report {issued} issued and {done} done",
            monitor.inner.rank
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn timing_follows_the_failure_timeout() {
    let t = Timing::new(Duration::from_secs(10), 2);
    assert_eq!(t.stale_after, Duration::from_secs(5));
    assert_eq!(t.interval, Duration::from_millis(250));
    assert_eq!(t.gone_grace, Duration::from_secs(1));
    // Large groups beat less often, but still several times before a rank counts as stale.
    let big = Timing::new(Duration::from_secs(10), 4096);
    assert!(big.interval <= big.stale_after / 4, "{big:?}");
    assert!(big.interval > t.interval);
}

#[test]
fn a_healthy_group_has_no_verdict() {
    let (_server, monitors) = group(3, None);
    for m in &monitors {
        m.record_issue(1, &all_reduce(8));
        m.record_progress(1, 1);
    }
    std::thread::sleep(FAILURE_TIMEOUT);
    for m in &monitors {
        assert!(
            m.assess(Instant::now(), in_flight(2, all_reduce(8)), LONG)
                .is_none(),
            "{:?}",
            m.assess(Instant::now(), in_flight(2, all_reduce(8)), LONG)
        );
    }
}

#[test]
fn rendezvous_names_the_ranks_that_never_came() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let store =
        TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    let started = Instant::now();
    let err = Monitor::start(MonitorSetup {
        store: &store,
        prefix: "tandem/test/nccl/1".into(),
        rank: 0,
        world: 3,
        timing: Timing::new(FAILURE_TIMEOUT, 3),
        store_owner: None,
        connect_timeout: Duration::from_millis(300),
        wait_log_interval: Duration::from_secs(30),
    })
    .unwrap_err()
    .to_string();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        err.contains("ranks 1, 2") && err.contains("timed out"),
        "{err}"
    );
}

#[test]
fn a_rank_whose_process_dies_is_named_once_a_collective_needs_it() {
    let (_server, mut monitors) = group(2, None);
    for m in &monitors {
        m.record_issue(1, &all_reduce(8));
        m.record_progress(1, 1);
    }
    until_seen(&monitors[0], 1, 1, 1);
    let dead = monitors.pop().unwrap();
    dead.inner.faults.vanish.store(true, Ordering::SeqCst);
    let killed_at = Instant::now();
    drop(dead); // its store connection closes: the store sets its will
    let alive = &monitors[0];
    // Nothing in flight that needs rank 1: no verdict.
    assert!(verdict(alive, None, LONG, Duration::from_millis(300)).is_none());
    let err = verdict(
        alive,
        in_flight(2, all_reduce(8)),
        LONG,
        Duration::from_secs(5),
    )
    .expect("a verdict")
    .to_string();
    assert!(
        killed_at.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed_at.elapsed()
    );
    assert_eq!(
        err,
        "rank 0: all_reduce(f32, 8, sum) (collective #2) failed: rank 1's process exited (its \
         connection to the rendezvous store closed) after collective #1"
    );
}

#[test]
fn a_rank_that_stops_beating_is_named_after_the_stale_period() {
    let (_server, monitors) = group(2, None);
    std::thread::sleep(Duration::from_millis(100));
    monitors[1]
        .inner
        .faults
        .paused
        .store(true, Ordering::SeqCst);
    let paused_at = Instant::now();
    let err = verdict(&monitors[0], None, LONG, Duration::from_secs(5))
        .expect("a verdict")
        .to_string();
    let took = paused_at.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert!(
        err.starts_with(
            "rank 0: the next collective (collective #1) failed: no heartbeat from rank 1 for"
        ),
        "{err}"
    );
    monitors[1]
        .inner
        .faults
        .paused
        .store(false, Ordering::SeqCst);
}

#[test]
fn a_failed_rank_fails_the_others_with_its_own_message() {
    let (_server, monitors) = group(3, None);
    let cause = DistError::Timeout {
        rank: 2,
        collective: "all_reduce(f32, 8, sum)".into(),
        seq: 4,
        timeout: Duration::from_secs(3),
        waiting_for: vec![1],
        diagnosis: None,
    };
    monitors[2].publish_failure(&cause);
    for (rank, monitor) in monitors.iter().enumerate().take(2) {
        let err = verdict(
            monitor,
            in_flight(4, all_reduce(8)),
            LONG,
            Duration::from_secs(5),
        )
        .expect("a verdict");
        assert_eq!(err.blamed_ranks(), vec![2]);
        let text = err.to_string();
        assert!(
            text.contains(&format!("rank {rank}: all_reduce(f32, 8, sum) (collective #4) aborted because rank 2 failed"))
                && text.contains("waiting for rank 1"),
            "{text}"
        );
    }
    // The failed rank itself has nothing more to say.
    assert!(monitors[2].assess(Instant::now(), None, LONG).is_none());
}

#[test]
fn a_rank_that_left_fails_only_collectives_it_did_not_finish() {
    let (_server, monitors) = group(2, None);
    for m in &monitors {
        m.record_issue(1, &describe_barrier());
        m.record_progress(1, 1);
    }
    until_seen(&monitors[0], 1, 1, 1);
    monitors[1].leave();
    std::thread::sleep(Duration::from_millis(200));
    assert!(monitors[0]
        .assess(Instant::now(), in_flight(1, describe_barrier()), LONG)
        .is_none());
    let err = verdict(
        &monitors[0],
        in_flight(2, all_reduce(3)),
        LONG,
        Duration::from_secs(1),
    )
    .expect("a verdict")
    .to_string();
    assert_eq!(
        err,
        "rank 0: all_reduce(f32, 3, sum) (collective #2) failed: rank 1 left the group after \
         collective #1"
    );
}

#[test]
fn different_collectives_are_named_with_both_descriptors_on_both_sides() {
    let (_server, monitors) = group(2, None);
    for m in &monitors {
        m.record_issue(1, &describe_barrier());
    }
    monitors[0].record_issue(2, &all_reduce(100));
    monitors[1].record_issue(2, &all_gather(100));
    let zero = verdict(
        &monitors[0],
        in_flight(2, all_reduce(100)),
        LONG,
        Duration::from_secs(5),
    )
    .expect("rank 0's verdict")
    .to_string();
    assert_eq!(
        zero,
        "rank 1 issued all_gather(f32, 100 per rank) as collective #2 but rank 0 issued \
         all_reduce(f32, 100, sum)"
    );
    let one = verdict(
        &monitors[1],
        in_flight(2, all_gather(100)),
        LONG,
        Duration::from_secs(5),
    )
    .expect("rank 1's verdict")
    .to_string();
    assert_eq!(
        one,
        "rank 0 issued all_reduce(f32, 100, sum) as collective #2 but rank 1 issued \
         all_gather(f32, 100 per rank)"
    );
}

#[test]
fn a_mismatch_is_found_even_after_many_more_collectives() {
    let (_server, monitors) = group(2, None);
    monitors[0].record_issue(1, &all_reduce(10));
    monitors[1].record_issue(1, &all_reduce(11));
    for seq in 2..=40 {
        for m in &monitors {
            m.record_issue(seq, &describe_barrier());
        }
    }
    let err = verdict(&monitors[0], None, LONG, Duration::from_secs(5))
        .expect("a verdict")
        .to_string();
    assert_eq!(
        err,
        "rank 1 issued all_reduce(f32, 11, sum) as collective #1 but rank 0 issued \
         all_reduce(f32, 10, sum)"
    );
}

#[test]
fn a_mismatch_older_than_the_published_window_is_still_reported() {
    let (_server, monitors) = group(2, None);
    for m in &monitors {
        m.inner.faults.paused.store(true, Ordering::SeqCst);
    }
    monitors[0].record_issue(1, &all_reduce(10));
    monitors[1].record_issue(1, &all_reduce(11));
    for seq in 2..=300 {
        for m in &monitors {
            m.record_issue(seq, &describe_barrier());
        }
    }
    for m in &monitors {
        m.inner.faults.paused.store(false, Ordering::SeqCst);
    }
    let err = verdict(&monitors[0], None, LONG, Duration::from_secs(5))
        .expect("a verdict")
        .to_string();
    assert!(
        err.starts_with(
            "rank 1 issued barrier() (their collectives already differed from this \
                         rank's before #237) as collective #237 but rank 0 issued barrier()"
        ),
        "{err}"
    );
}

#[test]
fn a_stuck_collective_times_out_naming_the_ranks_that_did_not_issue_it() {
    let (_server, monitors) = group(3, None);
    monitors[0].record_issue(1, &all_reduce(5));
    monitors[1].record_issue(1, &all_reduce(5));
    until_seen(&monitors[0], 1, 1, 0);
    until_seen(&monitors[0], 2, 0, 0);
    let started_long_ago = Some(InFlight {
        seq: 1,
        desc: all_reduce(5),
        started_at: Some(Instant::now() - Duration::from_secs(2)),
    });
    let err = monitors[0]
        .assess(Instant::now(), started_long_ago, Duration::from_secs(1))
        .expect("a verdict");
    assert_eq!(err.blamed_ranks(), vec![2]);
    assert_eq!(
        err.to_string(),
        "rank 0: all_reduce(f32, 5, sum) (collective #1) timed out after 1s waiting for rank 2. \
         Diagnosis: rank 2 has issued no collective yet, while ranks 0, 1 wait at all_reduce #1 \
         (f32 × 5)",
        "the diagnosis comes from every rank's heartbeat"
    );
    // Not started on the comm stream yet: compute still running, no timeout.
    let not_started = Some(InFlight {
        seq: 1,
        desc: all_reduce(5),
        started_at: None,
    });
    assert!(monitors[0]
        .assess(Instant::now(), not_started, Duration::from_secs(1))
        .is_none());
}

#[test]
fn losing_the_store_names_the_rank_that_serves_it() {
    let (server, monitors) = group(2, Some(0));
    std::thread::sleep(Duration::from_millis(100));
    drop(server);
    let err = verdict(&monitors[1], None, LONG, Duration::from_secs(5)).expect("a verdict");
    assert_eq!(err.blamed_ranks(), vec![0]);
    let text = err.to_string();
    assert!(
        text.contains("lost the rendezvous store, which rank 0 serves"),
        "{text}"
    );
}

#[test]
fn a_malformed_heartbeat_is_a_protocol_error_naming_its_rank() {
    let (server, monitors) = group(2, None);
    monitors[1]
        .inner
        .faults
        .paused
        .store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    let vandal =
        TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
    vandal
        .set(&hb_key("tandem/test/nccl/1", 1), b"TNHB\x01\x07garbage")
        .unwrap();
    let err = verdict(&monitors[0], None, LONG, Duration::from_secs(5))
        .expect("a verdict")
        .to_string();
    assert!(
        err.contains("malformed data from rank 1") && err.contains("heartbeat"),
        "{err}"
    );
}

#[test]
fn the_rank_serving_the_store_waits_for_the_others_to_leave_but_not_for_ever() {
    let (_server, mut monitors) = group(2, Some(0));
    let other = monitors.pop().unwrap();
    let server_rank = monitors.pop().unwrap();
    server_rank.leave();
    let leaver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        other.leave();
        other
    });
    let started = Instant::now();
    server_rank.wait_for_others(Duration::from_secs(5));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    let other = leaver.join().unwrap();
    drop(other);
    // A rank that stops beating is not waited for beyond the stale period.
    let (_server, mut monitors) = group(2, Some(0));
    let stuck = monitors.pop().unwrap();
    stuck.inner.faults.paused.store(true, Ordering::SeqCst);
    let server_rank = monitors.pop().unwrap();
    server_rank.leave();
    let started = Instant::now();
    server_rank.wait_for_others(Duration::from_secs(30));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}
