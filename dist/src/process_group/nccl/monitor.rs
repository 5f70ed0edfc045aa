//! Heartbeats through the rendezvous store: how an NCCL rank learns that another rank died,
//! stopped, failed, left, or issued different collectives — none of which NCCL itself reports
//! (a collective whose peer is gone simply never finishes).
//!
//! Each rank runs one heartbeat thread with its own store connection. Every
//! [`Timing::interval`] it publishes its heartbeat (`<prefix>/hb/<rank>`: a counter, the
//! sequence numbers of its last collective issued, seen starting and seen finishing, and the
//! chain hash of its collectives, see `record`), its last 64 collective descriptors when they
//! changed (`<prefix>/hist/<rank>`), and reads every other rank's heartbeat plus the history of
//! its *neighbour* (rank + 1) in one `get_many`. When it starts it leaves a *will* with the
//! store: if its connection closes without the rank leaving — the process exited or was killed
//! — the store itself sets the heartbeat to "gone", so a dead process is noticed at the next
//! read instead of after a timeout.
//!
//! [`Monitor::assess`] turns what was read into a verdict for the watchdog, naming a rank:
//!
//! * a rank whose heartbeat says it **failed**: this rank fails too, with its message;
//! * a rank that is **gone** (will fired) or has **left**, while this rank has a collective in
//!   flight that the other did not finish: fails (after [`Timing::gone_grace`] for a gone rank,
//!   whose last published progress may lag its real progress by one interval);
//! * a rank whose heartbeat counter has not moved for [`Timing::stale_after`]: stopped, hung or
//!   unreachable;
//! * the **neighbour**'s collectives differ from this rank's: the first differing sequence
//!   number, with both descriptors (checking only the neighbour keeps the cost per rank
//!   constant: if any two ranks differ, some pair of neighbours around the ring differs, and
//!   that rank's failure reaches every other rank through its heartbeat);
//! * this rank's oldest collective in flight has run longer than the group's timeout since it
//!   started on the comm stream: waiting for the ranks that have not issued it (or not started
//!   it);
//! * the store has been unreachable for [`Timing::stale_after`] (or three exchanges in a row
//!   failed): when rank 0 serves the store, that is rank 0 gone.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::record::{
    chain_hash, decode_history, encode_desc, encode_history, Beat, HistoryEntry, PeerState,
    MAX_BEAT_BYTES, MAX_HISTORY_BYTES,
};
use crate::error::fmt_ranks;
use crate::process_group::progress::Progress;
use crate::process_group::CollectiveDesc;
use crate::store::{TcpStore, MAX_REQUEST_KEY_BYTES};
use crate::{DistError, Result};

/// How many of its own collectives a rank remembers for comparison with its neighbour's.
const LOCAL_HISTORY: usize = 1024;
/// Keys per `get_many` request (the store's limit).
const KEYS_PER_REQUEST: usize = 4096;
/// Consecutive failed exchanges after which the store counts as lost.
const FAILED_EXCHANGES: u32 = 3;

/// The heartbeat's periods, all derived from the group's failure timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
    /// How often a rank publishes its heartbeat and reads the others'.
    pub interval: Duration,
    /// A running rank whose heartbeat has not changed for this long is stopped or hung.
    pub stale_after: Duration,
    /// How long a gone rank's last published progress is given to catch up with this rank's
    /// collective in flight before that collective is declared lost.
    pub gone_grace: Duration,
}

impl Timing {
    /// Periods for a group of `world` ranks that must notice a failure within
    /// `failure_timeout`: staleness after half of it; a publication every 1/40 of it (at
    /// least 10 ms and 1 ms per rank, so the store's load stays bounded in large groups, and
    /// at most a quarter of the staleness); a gone rank's grace of 1/10 of it.
    pub(crate) fn new(failure_timeout: Duration, world: usize) -> Timing {
        let stale_after = (failure_timeout / 2).max(Duration::from_millis(40));
        let per_rank = Duration::from_millis(world.min(1 << 20) as u64);
        let interval = (failure_timeout / 40)
            .max(Duration::from_millis(10))
            .max(per_rank)
            .min(stale_after / 4);
        let gone_grace = (failure_timeout / 10).max(interval * 2);
        Timing {
            interval,
            stale_after,
            gone_grace,
        }
    }
}

/// A collective in flight on this rank, as the watchdog sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InFlight {
    /// Its sequence number.
    pub seq: u64,
    /// What it is.
    pub desc: CollectiveDesc,
    /// When the watchdog first saw it start on the comm stream (`None`: not yet).
    pub started_at: Option<Instant>,
}

/// This rank's own state, published in its heartbeat.
struct Local {
    state: PeerState,
    beat: u64,
    issued: u64,
    started: u64,
    done: u64,
    hash: u64,
    history: VecDeque<HistoryEntry>,
    /// `issued` when the history was last published.
    history_published: u64,
}

impl Local {
    fn beat(&self) -> Beat {
        Beat {
            state: self.state.clone(),
            beat: self.beat,
            issued: self.issued,
            started: self.started,
            done: self.done,
            hash: self.hash,
        }
    }

    fn entry(&self, seq: u64) -> Option<&HistoryEntry> {
        let first = self.history.front()?.seq;
        self.history.get(seq.checked_sub(first)? as usize)
    }
}

/// What this rank last read about one peer.
#[derive(Clone, Debug)]
struct PeerView {
    /// The last record read (a gone rank keeps the progress of its last live record).
    beat: Option<Beat>,
    /// When its counter last changed, on this rank's clock.
    changed_at: Instant,
    /// When it was first seen gone.
    gone_since: Option<Instant>,
    /// Why its last record could not be decoded.
    malformed: Option<String>,
}

/// The heartbeat thread's link to the store.
struct Link {
    last_ok: Instant,
    failures: u32,
    error: Option<String>,
}

struct Inner {
    rank: usize,
    world: usize,
    prefix: String,
    timing: Timing,
    /// This monitor's own connection (so heartbeats never wait behind the application).
    store: TcpStore,
    /// The rank whose process serves the store, if a rank does.
    store_owner: Option<usize>,
    local: Mutex<Local>,
    /// The labels and descriptors of this rank's recent collectives, for hang diagnoses.
    progress: Progress,
    peers: Mutex<Vec<PeerView>>,
    neighbour_history: Mutex<Option<std::result::Result<Vec<HistoryEntry>, String>>>,
    link: Mutex<Link>,
    stop: AtomicBool,
    wake: Mutex<bool>,
    woken: Condvar,
    /// Faults the tests inject.
    #[cfg(test)]
    faults: tests::Faults,
}

/// A rank's heartbeat publisher and reader. See the module docs.
pub(crate) struct Monitor {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Monitor(rank {} of {}, {})",
            self.inner.rank, self.inner.world, self.inner.prefix
        )
    }
}

fn hb_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/hb/{rank}")
}

fn hist_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/hist/{rank}")
}

/// Where a monitor meets the others.
pub(crate) struct MonitorSetup<'a> {
    /// The job's store (its address and secret are used for the monitor's own connection).
    pub store: &'a TcpStore,
    /// Key prefix of this group instance.
    pub prefix: String,
    pub rank: usize,
    pub world: usize,
    pub timing: Timing,
    pub store_owner: Option<usize>,
    /// Longest wait for every rank's first heartbeat.
    pub connect_timeout: Duration,
    /// How often a rank still waiting names the ranks it waits for (on stderr).
    pub wait_log_interval: Duration,
}

impl Monitor {
    /// Connects to the store, publishes this rank's first heartbeat and its will, waits until
    /// every rank has published one (the group's rendezvous), then starts the heartbeat
    /// thread.
    pub(crate) fn start(setup: MonitorSetup<'_>) -> Result<Monitor> {
        let MonitorSetup {
            store,
            prefix,
            rank,
            world,
            timing,
            store_owner,
            connect_timeout,
            wait_log_interval,
        } = setup;
        let own =
            TcpStore::connect_with_secret(store.addr(), connect_timeout, store.secret().cloned())?;
        let local = Local {
            state: PeerState::Running,
            beat: 1,
            issued: 0,
            started: 0,
            done: 0,
            hash: 0,
            history: VecDeque::new(),
            history_published: 0,
        };
        let gone = Beat {
            state: PeerState::Gone,
            ..local.beat()
        };
        own.set_will(&hb_key(&prefix, rank), &gone.encode())?;
        own.set(&hb_key(&prefix, rank), &local.beat().encode())?;
        own.set(&hist_key(&prefix, rank), &encode_history(&[]))?;
        wait_for_everyone(
            &own,
            &prefix,
            rank,
            world,
            connect_timeout,
            wait_log_interval,
        )?;
        let now = Instant::now();
        let inner = Arc::new(Inner {
            rank,
            world,
            prefix,
            timing,
            store: own,
            store_owner,
            local: Mutex::new(local),
            progress: Progress::default(),
            peers: Mutex::new(vec![
                PeerView {
                    beat: None,
                    changed_at: now,
                    gone_since: None,
                    malformed: None,
                };
                world
            ]),
            neighbour_history: Mutex::new(None),
            link: Mutex::new(Link {
                last_ok: now,
                failures: 0,
                error: None,
            }),
            stop: AtomicBool::new(false),
            wake: Mutex::new(false),
            woken: Condvar::new(),
            #[cfg(test)]
            faults: Default::default(),
        });
        let worker = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("tandem-nccl-heartbeat-{rank}"))
            .spawn(move || worker.run())
            .map_err(|e| DistError::io("starting the NCCL heartbeat thread", e))?;
        Ok(Monitor {
            inner,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The periods in use.
    pub(crate) fn timing(&self) -> Timing {
        self.inner.timing
    }

    /// Notes that collective `seq` (the next in order) was issued.
    pub(crate) fn record_issue(&self, seq: u64, desc: &CollectiveDesc) {
        self.inner.progress.issued(seq, *desc);
        let mut local = self.inner.local.lock();
        let code = encode_desc(desc);
        local.hash = chain_hash(local.hash, seq, &code);
        local.issued = seq;
        let hash = local.hash;
        local.history.push_back(HistoryEntry {
            seq,
            hash,
            desc: code,
        });
        if local.history.len() > LOCAL_HISTORY {
            local.history.pop_front();
        }
    }

    /// Notes how far the comm stream has got: the last collective seen starting and the last
    /// seen finishing (which has started, too). Progress never goes back.
    pub(crate) fn record_progress(&self, started: u64, done: u64) {
        let mut local = self.inner.local.lock();
        local.started = local.started.max(started).max(done).min(local.issued);
        local.done = local.done.max(done).min(local.started);
        self.inner.progress.completed(local.done);
    }

    /// Publishes that this rank failed with `err` (at once, not at the next interval).
    pub(crate) fn publish_failure(&self, err: &DistError) {
        {
            let mut local = self.inner.local.lock();
            if matches!(local.state, PeerState::Running) {
                local.state = PeerState::Failed(err.to_string());
            }
        }
        self.inner.wake();
    }

    /// Leaves the group: stops the heartbeat thread, which publishes a last heartbeat saying
    /// "left" (unless this rank failed) and makes that the will too. Idempotent.
    pub(crate) fn leave(&self) {
        {
            let mut local = self.inner.local.lock();
            if matches!(local.state, PeerState::Running) {
                local.state = PeerState::Left;
            }
        }
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.wake();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }

    /// After [`Monitor::leave`], waits (at most `limit`) until no other rank is still running
    /// and beating: used by a rank that serves the store, so that it does not take the store
    /// away from ranks that still need it.
    pub(crate) fn wait_for_others(&self, limit: Duration) {
        let inner = &self.inner;
        let keys: Vec<String> = (0..inner.world)
            .filter(|&r| r != inner.rank)
            .map(|r| hb_key(&inner.prefix, r))
            .collect();
        let deadline = Instant::now() + limit;
        let mut last: Vec<Option<(u64, Instant)>> = vec![None; keys.len()];
        while Instant::now() < deadline {
            let Ok(values) = get_all(&inner.store, &keys, MAX_BEAT_BYTES) else {
                return;
            };
            let now = Instant::now();
            let mut waiting = false;
            for (slot, value) in last.iter_mut().zip(values) {
                let Some(beat) = value.and_then(|v| Beat::decode(&v).ok()) else {
                    continue;
                };
                if beat.state != PeerState::Running {
                    continue;
                }
                match slot {
                    Some((b, at)) if *b == beat.beat => {
                        if now.duration_since(*at) < inner.timing.stale_after {
                            waiting = true;
                        }
                    }
                    _ => {
                        *slot = Some((beat.beat, now));
                        waiting = true;
                    }
                }
            }
            if !waiting {
                return;
            }
            std::thread::sleep(inner.timing.interval);
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Reads `keys` in requests within the store's limits on keys and key bytes per request.
fn get_all(store: &TcpStore, keys: &[String], max_value: usize) -> Result<Vec<Option<Vec<u8>>>> {
    let mut out = Vec::with_capacity(keys.len());
    let mut rest = keys;
    while !rest.is_empty() {
        let mut bytes = 0;
        let n = rest
            .iter()
            .take(KEYS_PER_REQUEST)
            .take_while(|k| {
                bytes += k.len();
                bytes <= MAX_REQUEST_KEY_BYTES
            })
            .count()
            .max(1);
        let refs: Vec<&str> = rest[..n].iter().map(String::as_str).collect();
        out.extend(store.get_many(&refs, max_value)?);
        rest = &rest[n..];
    }
    Ok(out)
}

/// Waits until every rank has published its first heartbeat, naming the missing ones on stderr
/// every `log_every` and in the error after `timeout`.
fn wait_for_everyone(
    store: &TcpStore,
    prefix: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
    log_every: Duration,
) -> Result<()> {
    let keys: Vec<String> = (0..world).map(|r| hb_key(prefix, r)).collect();
    let started = Instant::now();
    let mut next_log = started + log_every;
    loop {
        let values = get_all(store, &keys, MAX_BEAT_BYTES)?;
        let missing: Vec<usize> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_none())
            .map(|(r, _)| r)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        if now.duration_since(started) >= timeout {
            return Err(DistError::Connect {
                rank,
                detail: format!(
                    "the NCCL group's rendezvous timed out after {timeout:?} waiting for {} (are \
                     they started, on CUDA, with the same WORLD_SIZE and group name?)",
                    fmt_ranks(&missing)
                ),
            });
        }
        if now >= next_log {
            eprintln!(
                "tandem: rank {rank}: still waiting for {} to join the NCCL group ({:.0} s so far)",
                fmt_ranks(&missing),
                now.duration_since(started).as_secs_f64()
            );
            next_log = now + log_every;
        }
        // Short naps at first (ranks usually arrive together), longer ones later.
        let nap = if now.duration_since(started) < Duration::from_secs(1) {
            Duration::from_millis(2)
        } else {
            Duration::from_millis(50)
        };
        std::thread::sleep(nap);
    }
}

impl Inner {
    fn wake(&self) {
        *self.wake.lock() = true;
        self.woken.notify_all();
    }

    fn run(&self) {
        loop {
            let stopping = self.stop.load(Ordering::SeqCst);
            #[cfg(test)]
            if self.faults.skip_exchange(stopping) {
                if stopping {
                    return;
                }
                std::thread::sleep(self.timing.interval);
                continue;
            }
            let result = self.exchange(stopping);
            {
                let mut link = self.link.lock();
                match result {
                    Ok(()) => {
                        link.last_ok = Instant::now();
                        link.failures = 0;
                        link.error = None;
                    }
                    Err(e) => {
                        link.failures = link.failures.saturating_add(1);
                        link.error = Some(e.to_string());
                    }
                }
            }
            if stopping {
                return;
            }
            let mut woken = self.wake.lock();
            if !*woken {
                self.woken.wait_for(&mut woken, self.timing.interval);
            }
            *woken = false;
        }
    }

    /// Publishes this rank's heartbeat (and history when it changed), then reads the others'.
    /// On the last exchange (`last`), the final heartbeat becomes the will as well.
    fn exchange(&self, last: bool) -> Result<()> {
        let (beat, history) = {
            let mut local = self.local.lock();
            local.beat += 1;
            let history = (local.history_published != local.issued).then(|| {
                local.history_published = local.issued;
                let entries: Vec<HistoryEntry> = local.history.iter().copied().collect();
                encode_history(&entries)
            });
            (local.beat().encode(), history)
        };
        let me = hb_key(&self.prefix, self.rank);
        if let Some(history) = history {
            self.store
                .set(&hist_key(&self.prefix, self.rank), &history)?;
        }
        self.store.set(&me, &beat)?;
        if last {
            self.store.set_will(&me, &beat)?;
            return Ok(());
        }
        if self.world < 2 {
            return Ok(());
        }
        let mut keys: Vec<String> = (0..self.world)
            .filter(|&r| r != self.rank)
            .map(|r| hb_key(&self.prefix, r))
            .collect();
        let neighbour = (self.rank + 1) % self.world;
        keys.push(hist_key(&self.prefix, neighbour));
        let mut values = get_all(&self.store, &keys, MAX_BEAT_BYTES.max(MAX_HISTORY_BYTES))?;
        let history = values.pop().flatten();
        let now = Instant::now();
        {
            let mut peers = self.peers.lock();
            let others = (0..self.world).filter(|&r| r != self.rank);
            for (peer, value) in others.zip(values) {
                update(&mut peers[peer], value, now);
            }
        }
        *self.neighbour_history.lock() = history.map(|bytes| decode_history(&bytes));
        Ok(())
    }
}

/// Folds one read of a peer's heartbeat into what this rank knows of it.
fn update(view: &mut PeerView, value: Option<Vec<u8>>, now: Instant) {
    let Some(bytes) = value else {
        if view.beat.is_some() {
            view.malformed = Some("its heartbeat disappeared from the store".into());
        }
        return;
    };
    match Beat::decode(&bytes) {
        Err(problem) => view.malformed = Some(problem),
        Ok(beat) => {
            view.malformed = None;
            match (&beat.state, view.beat.as_mut()) {
                (PeerState::Gone, Some(known)) => {
                    // The will carries no progress: keep what the rank last said.
                    known.state = PeerState::Gone;
                    view.gone_since.get_or_insert(now);
                }
                (PeerState::Gone, None) => {
                    view.gone_since.get_or_insert(now);
                    view.beat = Some(beat);
                }
                _ => {
                    if view.beat.as_ref().is_none_or(|b| b.beat != beat.beat) {
                        view.changed_at = now;
                    }
                    view.beat = Some(beat);
                }
            }
        }
    }
}

mod verdict;

#[cfg(test)]
mod tests;
