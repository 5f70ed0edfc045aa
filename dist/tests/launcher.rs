//! `tandem-run` end to end: a 4-rank tandem program runs to completion, output is labelled by
//! rank, a failing rank stops the job and is named, and termination is forwarded to the ranks.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[test]
fn worker() {
    common::worker_main();
}

fn tandem_run(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let started = Instant::now();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-run"));
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run tandem-run");
    (out, started.elapsed())
}

#[test]
fn launcher_runs_a_four_rank_program_to_completion() {
    let exe = std::env::current_exe().unwrap();
    let mut args = vec!["--nproc-per-node", "4", "--"];
    args.push(exe.to_str().unwrap());
    let worker_args = common::worker_args();
    args.extend(worker_args.iter().map(String::as_str));
    let (out, _) = tandem_run(&args, &[(common::WORKER_VAR, "sum")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..4 {
        // (libtest's own "test worker ... " may precede the worker's words on the line.)
        let prefix = format!("[rank {rank}] ");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&prefix) && l.ends_with("all_reduce ok: sum of ranks = 6")),
            "{stdout}"
        );
    }
}

#[test]
fn launcher_prefixes_every_line_with_its_rank() {
    let script = "echo hello from $RANK of $WORLD_SIZE; echo local $LOCAL_RANK >&2";
    let (out, _) = tandem_run(&["--nproc-per-node", "3", "sh", "-c", script], &[]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for rank in 0..3 {
        assert!(
            stdout
                .lines()
                .any(|l| l == format!("[rank {rank}] hello from {rank} of 3")),
            "{stdout}"
        );
        assert!(
            stderr
                .lines()
                .any(|l| l == format!("[rank {rank}] local {rank}")),
            "{stderr}"
        );
    }
}

#[test]
fn launcher_stops_the_job_and_names_the_rank_that_failed() {
    let script = r#"if [ "$RANK" = 2 ]; then exit 3; fi; exec sleep 60"#;
    let (out, elapsed) = tandem_run(&["--nproc-per-node", "4", "--", "sh", "-c", script], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("rank 2 failed with exit status 3"),
        "{stderr}"
    );
    assert!(
        elapsed < Duration::from_secs(20),
        "the other ranks were not stopped: {elapsed:?}"
    );
}

#[test]
fn launcher_forwards_termination_to_the_ranks() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem-run"))
        .args([
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "echo up; exec sleep 60",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks run, then terminate the launcher only.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen.matches("up").count() < 2 && Instant::now() < deadline {
        let mut buf = [0u8; 256];
        let n = std::io::Read::read(&mut stdout, &mut buf).unwrap();
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let started = Instant::now();
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our running child.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let status = child.wait().unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "launcher exit status {status}"
    );
}

#[test]
fn launcher_names_the_rank_the_others_were_waiting_for() {
    // The last of 3 ranks stops itself (SIGSTOP) after one all-reduce; the others time out
    // after 3 s and exit first. The launcher must name the stopped rank, not them.
    let exe = std::env::current_exe().unwrap();
    let mut args = vec!["--nproc-per-node", "3", "--kill-grace", "1", "--"];
    args.push(exe.to_str().unwrap());
    let worker_args = common::worker_args();
    args.extend(worker_args.iter().map(String::as_str));
    let (out, elapsed) = tandem_run(&args, &[(common::WORKER_VAR, "stall")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("was waiting for rank 2, which did not respond"),
        "{stderr}"
    );
    // The summary carries the diagnosis: where the stopped rank is and where the others wait
    // (both waiting ranks, or — on a loaded machine, where the second may time out after the
    // first rank's bounded gather of positions — the first alone).
    let summary = summary(&stderr);
    assert!(
        summary
            .contains("Diagnosis: rank 2 did not report and never joined all_reduce #2 (f32 × 16)")
            && summary.contains("while rank")
            && summary.matches("all_reduce #2 (f32 × 16)").count() == 2,
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
}

#[test]
fn a_rank_told_of_a_timeout_exits_only_after_the_report_of_the_rank_that_timed_out() {
    // Rank 0 waits 20 s, the others 3 s: rank 1 times out first (waiting for the stopped rank 2)
    // and tells rank 0, which exits at once, so the launcher stops rank 1 right away. Rank 1's
    // report and diagnosis must be in the store before rank 0 hears of the failure, or the
    // launcher would blame rank 1 (seen in CI on a loaded machine, where the same order arose).
    let exe = std::env::current_exe().unwrap();
    let mut args = vec!["--nproc-per-node", "3", "--kill-grace", "1", "--"];
    args.push(exe.to_str().unwrap());
    let worker_args = common::worker_args();
    args.extend(worker_args.iter().map(String::as_str));
    let (out, elapsed) = tandem_run(&args, &[(common::WORKER_VAR, "stall-staggered")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let summary = summary(&stderr);
    assert!(
        summary.contains("rank 2 did not respond (stopped or hung?)")
            && summary.contains("rank 2 did not report and never joined all_reduce #2 (f32 × 16)"),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(15), "{elapsed:?}");
}

/// The launcher's summary line (`tandem-run: rank …; stopped the other ranks`).
fn summary(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|l| l.starts_with("tandem-run: ") && l.contains("stopped the other ranks"))
        .unwrap_or_default()
}

/// Runs a 2-rank job of worker `mode`, in which rank 1 stops itself (SIGSTOP) for good, and
/// checks that the summary names rank 1, not rank 0 (which fails first, waiting for it).
fn the_summary_names_the_stopped_rank(mode: &str) {
    let exe = std::env::current_exe().unwrap();
    let mut args = vec!["--nproc-per-node", "2", "--kill-grace", "1", "--"];
    args.push(exe.to_str().unwrap());
    let worker_args = common::worker_args();
    args.extend(worker_args.iter().map(String::as_str));
    let (out, elapsed) = tandem_run(&args, &[(common::WORKER_VAR, mode)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let summary = summary(&stderr);
    assert!(
        summary.starts_with(
            "tandem-run: rank 1 did not respond (stopped or hung?); rank 0, which \
             was waiting for it, failed with exit status 1"
        ),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
}

#[test]
fn the_summary_names_a_rank_stopped_during_a_collective() {
    the_summary_names_the_stopped_rank("stall");
}

#[test]
fn the_summary_names_a_rank_stopped_before_it_joined_the_group() {
    the_summary_names_the_stopped_rank("stall-setup");
}

#[test]
fn a_single_node_job_gets_a_secret_and_a_loopback_store() {
    let script = "test ${#TANDEM_JOB_SECRET} -ge 32 && echo secret ok; echo addr $MASTER_ADDR";
    let (out, _) = tandem_run(&["--nproc-per-node", "2", "sh", "-c", script], &[]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("secret ok").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("addr 127.0.0.1").count(), 2, "{stdout}");
}
