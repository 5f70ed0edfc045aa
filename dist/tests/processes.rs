//! Ranks as real processes talking TCP over loopback: every collective against the serial
//! reference, a rank killed in the middle of an all-reduce, and mismatched collectives.

mod common;

use std::time::{Duration, Instant};

use common::Job;

#[test]
fn worker() {
    common::worker_main();
}

fn assert_all_succeed(results: &[(std::process::ExitStatus, String)]) {
    for (rank, (status, output)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {rank} failed with {status}:\n{output}"
        );
    }
}

#[test]
fn collectives_match_the_reference_across_2_3_4_and_8_processes() {
    for (world, mode) in [
        (2, "conformance-small-chunks"),
        (3, "conformance-small-chunks"),
        (4, "conformance"),
        (8, "conformance"),
    ] {
        let results = Job::start(world, mode).wait(Duration::from_secs(120));
        assert_all_succeed(&results);
        for (rank, (_, output)) in results.iter().enumerate() {
            assert!(
                output.contains(&format!("rank {rank} conformance ok")),
                "{output}"
            );
        }
    }
}

#[test]
fn killing_a_rank_mid_all_reduce_fails_every_other_rank_within_seconds_naming_it() {
    // Both large-message paths: the TCP ring, and same-host copies synchronised over TCP.
    for mode in ["kill-ring", "kill"] {
        kill_rank_2_of_4(mode);
    }
}

fn kill_rank_2_of_4(mode: &str) {
    let mut job = Job::start(4, mode);
    job.wait_for_all("ready", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(100));
    let killed_at = Instant::now();
    job.kill(2);
    let results = job.wait(Duration::from_secs(30));
    let elapsed = killed_at.elapsed();
    assert!(
        elapsed < Duration::from_secs(10),
        "the other ranks took {elapsed:?} to fail"
    );
    for (rank, (status, output)) in results.iter().enumerate() {
        if rank == 2 {
            continue;
        }
        assert!(
            !status.success(),
            "rank {rank} should have failed:\n{output}"
        );
        let error = output
            .lines()
            .find(|l| l.contains("worker error"))
            .unwrap_or_default();
        println!("{error}");
        assert!(
            error.contains("rank 2"),
            "rank {rank}'s error does not name rank 2: {output}"
        );
        assert!(
            error.contains("all_reduce(f32, 1048576, avg)") && error.contains("(collective #"),
            "{error}"
        );
    }
}

#[test]
fn a_process_that_skips_a_collective_is_named_with_its_position_in_the_diagnosis() {
    // Rank 2 of 3 skips bucket 1: its #2 is the others' #3's bucket, and they wait at #3.
    let results = Job::start(3, "skip").wait(Duration::from_secs(60));
    let mut diagnosed = 0;
    for (rank, (status, output)) in results.iter().enumerate().take(2) {
        assert!(
            !status.success(),
            "rank {rank} should have failed:\n{output}"
        );
        assert!(output.contains("rank 2"), "rank {rank}: {output}");
        // A rank that timed out prints the diagnosis. On a loaded machine the other may be
        // stopped first by that rank's abort (naming it and rank 2) before its own timeout.
        if output.contains(
            "Diagnosis: rank 2 did not report and never joined all_reduce #3 (bucket 2; f32 × 16)",
        ) {
            assert!(
                output.contains("while rank")
                    && output.matches("all_reduce #3 (bucket 2; f32 × 16)").count() >= 2,
                "rank {rank}: {output}"
            );
            diagnosed += 1;
        } else {
            assert!(
                output.contains("aborted because rank"),
                "rank {rank}: {output}"
            );
        }
    }
    assert!(diagnosed >= 1, "no rank printed the diagnosis: {results:?}");
}

#[test]
fn processes_issuing_different_collectives_get_an_error_naming_both() {
    let results = Job::start(2, "mismatch").wait(Duration::from_secs(60));
    for (rank, (status, output)) in results.iter().enumerate() {
        println!(
            "{}",
            output
                .lines()
                .find(|l| l.contains("worker error"))
                .unwrap_or_default()
        );
        assert!(!status.success(), "rank {rank}: {output}");
        assert!(
            output.contains("all_reduce(f32, 100, sum)")
                && output.contains("all_gather(f32, 100 per rank)"),
            "rank {rank}: {output}"
        );
        assert!(
            output.contains("as collective #2 but rank"),
            "rank {rank}: {output}"
        );
    }
}
