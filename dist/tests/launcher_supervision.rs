//! `tandem-run` as a supervisor: its ranks die with it (even by SIGKILL), their output is
//! passed on as it comes with bounded memory (progress bars redraw with `\r`), and
//! `--max-restarts` restarts a failed job, telling ranks the restart count, then gives up.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Starts `tandem-run ARGS` with stdout and stderr collected in the background.
struct Launcher {
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// The threads collecting stdout and stderr (they end at end of file).
    collectors: Vec<std::thread::JoinHandle<()>>,
}

fn collect(
    mut from: impl Read + Send + 'static,
    into: Arc<Mutex<Vec<u8>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 64 << 10];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            into.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    })
}

impl Launcher {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Launcher {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-run"));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start tandem-run");
        let (stdout, stderr) = (Arc::default(), Arc::default());
        let collectors = vec![
            collect(child.stdout.take().unwrap(), Arc::clone(&stdout)),
            collect(child.stderr.take().unwrap(), Arc::clone(&stderr)),
        ];
        Launcher {
            child,
            stdout,
            stderr,
            collectors,
        }
    }

    fn stdout(&self) -> Vec<u8> {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// Waits up to `timeout` for stdout to satisfy `done`.
    fn wait_for_stdout(&self, timeout: Duration, done: impl Fn(&[u8]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if done(&self.stdout.lock().unwrap()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Waits for the launcher to exit, up to `timeout` (then kills it), and for what it wrote
    /// to be collected (on a loaded machine the collectors may lag behind the exit).
    fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The ranks die with the launcher, so the pipes reach their end; bounded all
                // the same.
                while Instant::now() < deadline && !self.collectors.iter().all(|c| c.is_finished())
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "tandem-run did not exit within {timeout:?}; stderr: {}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is our child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("launcher_supervision")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Whether `pid` is gone: no such process, or a zombie nobody reaped yet.
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
    }
}

#[test]
fn ranks_die_when_the_launcher_is_killed_with_sigkill() {
    let dir = scratch("sigkill");
    let script = r#"echo $$ > "$PID_DIR/pid.$RANK.tmp" && mv "$PID_DIR/pid.$RANK.tmp" "$PID_DIR/pid.$RANK"; exec sleep 60"#;
    let mut launcher = Launcher::start(
        &["--nproc-per-node", "2", "--", "sh", "-c", script],
        &[("PID_DIR", dir.to_str().unwrap())],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let pids: Vec<i32> = loop {
        let read: Vec<Option<i32>> = (0..2)
            .map(|r| {
                std::fs::read_to_string(dir.join(format!("pid.{r}")))
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
            })
            .collect();
        if read.iter().all(Option::is_some) {
            break read.into_iter().flatten().collect();
        }
        assert!(Instant::now() < deadline, "the ranks did not start");
        std::thread::sleep(Duration::from_millis(10));
    };
    launcher.signal(libc::SIGKILL);
    launcher.wait(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pids.iter().all(|&p| process_gone(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let orphans: Vec<i32> = pids.iter().copied().filter(|&p| !process_gone(p)).collect();
    for &p in &orphans {
        // SAFETY: kill(2) has no memory-safety preconditions; clean up what the test started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(
        orphans.is_empty(),
        "ranks {orphans:?} outlived their launcher"
    );
}

#[test]
fn a_progress_line_without_newline_is_passed_on_before_the_rank_exits() {
    let mut launcher = Launcher::start(
        &[
            "--nproc-per-node",
            "1",
            "--kill-grace",
            "1",
            "--",
            "sh",
            "-c",
            r#"printf 'step 1/9\r'; printf 'step 2/9\r'; exec sleep 60"#,
        ],
        &[],
    );
    let seen = launcher.wait_for_stdout(Duration::from_secs(20), |out| {
        out.ends_with(b"[rank 0] step 2/9\r")
    });
    let stdout = String::from_utf8_lossy(&launcher.stdout()).into_owned();
    launcher.signal(libc::SIGTERM);
    launcher.wait(Duration::from_secs(10));
    assert!(seen, "nothing passed on while the rank ran: {stdout:?}");
    assert_eq!(stdout, "[rank 0] step 1/9\r[rank 0] step 2/9\r");
}

/// The launcher's peak resident memory, from `/proc`.
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn output_without_line_ends_is_passed_on_with_bounded_launcher_memory() {
    const BYTES: usize = 64 << 20;
    let script = format!("head -c {BYTES} /dev/zero | tr '\\000' x; exec sleep 60");
    let mut launcher = Launcher::start(
        &[
            "--nproc-per-node",
            "1",
            "--kill-grace",
            "1",
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[],
    );
    let all_through =
        launcher.wait_for_stdout(Duration::from_secs(60), |out| out.len() >= BYTES + 9);
    let peak = peak_rss_bytes(launcher.child.id());
    let got = launcher.stdout().len();
    launcher.signal(libc::SIGTERM);
    launcher.wait(Duration::from_secs(10));
    assert!(
        all_through,
        "only {got} of {BYTES} bytes passed on while the rank ran"
    );
    assert!(
        peak < 32 << 20,
        "the launcher's peak memory was {} MiB relaying {} MiB",
        peak >> 20,
        BYTES >> 20
    );
}

#[test]
fn a_failed_job_is_restarted_and_its_ranks_see_the_restart_count() {
    let script = r#"
        if [ "$TANDEM_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 7; fi
        echo "attempt $TANDEM_RESTART_COUNT of $TANDEM_MAX_RESTARTS""#;
    let mut launcher = Launcher::start(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--kill-grace",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        &[],
    );
    let status = launcher.wait(Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&launcher.stdout()).into_owned();
    let stderr = launcher.stderr();
    assert!(status.success(), "{status}: {stdout}\n{stderr}");
    for rank in 0..2 {
        assert!(
            stdout
                .lines()
                .any(|l| l == format!("[rank {rank}] attempt 1 of 2")),
            "{stdout}"
        );
    }
    assert!(
        stderr.contains("rank 1 failed with exit status 7")
            && stderr.contains("restarting the job (restart 1 of 2)"),
        "{stderr}"
    );
    assert!(!stderr.contains("restart 2 of 2"), "{stderr}");
}

#[test]
fn the_launcher_gives_up_after_max_restarts_and_names_the_failed_rank() {
    let script =
        r#"echo "start $TANDEM_RESTART_COUNT"; if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 60"#;
    let mut launcher = Launcher::start(
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--kill-grace",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        &[],
    );
    let status = launcher.wait(Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&launcher.stdout()).into_owned();
    let stderr = launcher.stderr();
    assert_eq!(status.code(), Some(3), "{stderr}");
    // (Rank 0 may be stopped before it prints; rank 1 prints before it fails.)
    for attempt in 0..3 {
        assert!(
            stdout.contains(&format!("[rank 1] start {attempt}")),
            "{stdout}"
        );
    }
    assert!(!stdout.contains("start 3"), "{stdout}");
    assert!(
        stderr.contains("restart 1 of 2") && stderr.contains("restart 2 of 2"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "tandem-run: rank 1 failed with exit status 3; stopped the other ranks (after 2 \
             restarts)"
        ),
        "{stderr}"
    );
}
