//! What a rank says when rendezvous goes wrong: ranks started with different WORLD_SIZEs name
//! both sizes, a missing rank is named while the others wait, and an unresolvable MASTER_ADDR
//! fails at once. The ranks are real processes talking over loopback.

mod common;

use std::time::{Duration, Instant};

use common::Job;

#[test]
fn worker() {
    common::worker_main();
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn ranks_with_different_world_sizes_both_name_the_two_sizes() {
    let job = Job::start_ranks(2, "rendezvous", &[0, 1], |rank| {
        if rank == 1 {
            env(&[("WORLD_SIZE", "3"), ("LOCAL_WORLD_SIZE", "3")])
        } else {
            Vec::new()
        }
    });
    for (rank, (status, output)) in job.wait(Duration::from_secs(60)).iter().enumerate() {
        assert!(!status.success(), "rank {rank}: {output}");
        let error = output
            .lines()
            .find(|l| l.contains("worker error"))
            .unwrap_or_default();
        assert!(
            error.contains("WORLD_SIZE 2") && error.contains("WORLD_SIZE 3"),
            "rank {rank}: {output}"
        );
    }
}

#[test]
fn ranks_waiting_for_a_missing_rank_say_so_and_name_it() {
    // Rank 2 of 3 is never started; the others log while they wait, then time out naming it.
    let job = Job::start_ranks(3, "rendezvous", &[0, 1], |_| Vec::new());
    for (rank, (status, output)) in job.wait(Duration::from_secs(60)).iter().enumerate() {
        assert!(!status.success(), "rank {rank}: {output}");
        assert!(
            output.matches("still waiting for rank 2").count() >= 2,
            "rank {rank}: {output}"
        );
        let error = output
            .lines()
            .find(|l| l.contains("worker error"))
            .unwrap_or_default();
        assert!(error.contains("rank 2"), "rank {rank}: {output}");
    }
}

#[test]
fn an_unresolvable_master_addr_fails_at_once_naming_it() {
    let started = Instant::now();
    let job = Job::start_ranks(2, "rendezvous", &[1], |_| {
        env(&[("MASTER_ADDR", "no-such-host.invalid")])
    });
    let results = job.wait(Duration::from_secs(60));
    let (status, output) = &results[0];
    assert!(!status.success(), "{output}");
    assert!(
        output.contains("no-such-host.invalid") && output.contains("MASTER_ADDR"),
        "{output}"
    );
    // The connect timeout of this mode is 4 s; resolution failure must not wait for it.
    assert!(started.elapsed() < Duration::from_secs(30), "{output}");
}

#[test]
fn a_rank_whose_store_never_answers_says_what_it_waits_for_and_where() {
    // TANDEM_STORE_HOSTED=1 but nothing listens at MASTER_PORT: the rank logs while it retries
    // (every 500 ms in this mode), then fails after its 4 s connect timeout.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let job = Job::start_ranks(2, "rendezvous", &[1], |_| env(&[("MASTER_PORT", &port)]));
    let results = job.wait(Duration::from_secs(60));
    let (status, output) = &results[0];
    assert!(!status.success(), "{output}");
    let progress =
        format!("tandem: rank 1: still waiting for the rendezvous store at 127.0.0.1:{port}");
    assert!(output.matches(&progress).count() >= 2, "{output}");
    assert!(output.contains("timeout 4s"), "{output}");
}
