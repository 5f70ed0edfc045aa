//! The MNIST example under faults, run for real: this test binary *is* the example when
//! `EXAMPLE_WORKER` is set (it includes `examples/mnist.rs` and runs its `main`), so the
//! example's built-in launcher re-executes it as the ranks.
//!
//! - A rank SIGKILLed mid-epoch, with `--max-restarts 1`, is brought back with the others
//!   from the newest checkpoint, and the run ends with the same parameters, optimizer state
//!   and random-number state, bit for bit, as a run that was never interrupted.
//! - A torn newest checkpoint is skipped for the one before it.
//! - Killing the built-in launcher (SIGKILL) kills its ranks; SIGTERM is forwarded to them.
//! - A run whose stdout is a closed pipe exits quietly with status 141, not by a panic.
//! - On a training set that 3 ranks do not divide evenly, the ranks train their exact shares
//!   inside `join` (every sample once per epoch, the ranks' batch counts differing) and end
//!   with the same parameters; `--no-join` pads the shares as before. Resumed across an epoch
//!   boundary, such a run ends bit-identical to an uninterrupted one.
//! - A checkpoint written by 2 ranks, evaluated with `--eval-only` on 1, 2, 3 and 4 ranks
//!   (101 test images: uneven parts), gives the identical correct count, the one the training
//!   run recorded.
//!
//! Built without libtest's harness (`harness = false`), so the worker's output is the
//! example's alone. Every wait is bounded; every process started is killed on the way out.

#[path = "../examples/mnist.rs"]
#[allow(dead_code)]
mod mnist;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tandem::nn::checkpoint::load_checkpoint;

/// Set in the environment of a re-executed binary: run the example instead of the tests.
const WORKER: &str = "TANDEM_EXAMPLE_SUPERVISION_WORKER";

fn main() -> ExitCode {
    if std::env::var_os(WORKER).is_some() {
        return mnist::main();
    }
    let tests: [(&str, fn()); 8] = [
        (
            "a_rank_killed_mid_epoch_is_restarted_and_the_run_ends_bit_identical",
            a_rank_killed_mid_epoch_is_restarted_and_the_run_ends_bit_identical,
        ),
        (
            "a_torn_newest_checkpoint_is_skipped_for_the_one_before",
            a_torn_newest_checkpoint_is_skipped_for_the_one_before,
        ),
        (
            "killing_the_built_in_launcher_kills_its_ranks",
            killing_the_built_in_launcher_kills_its_ranks,
        ),
        (
            "terminating_the_built_in_launcher_is_forwarded_to_its_ranks",
            terminating_the_built_in_launcher_is_forwarded_to_its_ranks,
        ),
        (
            "a_run_whose_stdout_is_closed_exits_quietly",
            a_run_whose_stdout_is_closed_exits_quietly,
        ),
        (
            "a_checkpoint_evaluated_on_1_to_4_ranks_gives_the_identical_correct_count",
            a_checkpoint_evaluated_on_1_to_4_ranks_gives_the_identical_correct_count,
        ),
        (
            "uneven_data_is_trained_inside_join_once_per_epoch_and_no_join_pads",
            uneven_data_is_trained_inside_join_once_per_epoch_and_no_join_pads,
        ),
        (
            "a_joined_run_resumed_at_an_epoch_boundary_ends_bit_identical",
            a_joined_run_resumed_at_an_epoch_boundary_ends_bit_identical,
        ),
    ];
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut failed = Vec::new();
    for (name, test) in tests {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        println!("test {name} ...");
        match std::panic::catch_unwind(test) {
            Ok(()) => println!("test {name} ... ok"),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed.push(name);
            }
        }
    }
    if failed.is_empty() {
        println!("test result: ok");
        ExitCode::SUCCESS
    } else {
        println!("test result: FAILED: {failed:?}");
        ExitCode::FAILURE
    }
}

/// A run of the example: this binary in worker mode with `args`.
struct Run {
    child: Child,
}

impl Run {
    fn start(args: &[&str], stdout: Stdio) -> Run {
        let child = Command::new(std::env::current_exe().unwrap())
            .args(args)
            .env(WORKER, "1")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the example");
        Run { child }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits up to `timeout` for the run to end; returns its status and stderr.
    fn finish(&mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        let (status, _, stderr) = self.finish_with_output(timeout);
        (status, stderr)
    }

    /// Waits up to `timeout` for the run to end (it must print little: stdout, when piped, is
    /// read at the end); returns its status, stdout and stderr.
    fn finish_with_output(
        &mut self,
        timeout: Duration,
    ) -> (std::process::ExitStatus, String, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("the example did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        use std::io::Read;
        let (mut stdout, mut stderr) = (String::new(), String::new());
        if let Some(mut out) = self.child.stdout.take() {
            let _ = out.read_to_string(&mut stdout);
        }
        if let Some(mut err) = self.child.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        (status, stdout, stderr)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("example_supervision")
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Small, quick settings: 2 ranks × 16 images a step, 32 steps per epoch, 2 epochs, a
/// checkpoint every 4 steps.
fn quick_args(dir: &Path) -> Vec<String> {
    [
        "--nproc-per-node",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--train-limit",
        "1024",
        "--test-limit",
        "100",
        "--threads",
        "1",
        "--checkpoint-every",
        "4",
        "--checkpoint-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.to_str().unwrap().to_string()])
    .collect()
}

fn signal(pid: i32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// The children of `parent`, with the `RANK` of their environment.
fn ranks_of(parent: i32) -> Vec<(i32, Option<usize>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| parent_of(pid) == Some(parent))
        .map(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let rank = environ
                .split(|&b| b == 0)
                .filter_map(|kv| std::str::from_utf8(kv).ok())
                .find_map(|kv| kv.strip_prefix("RANK="))
                .and_then(|r| r.parse().ok());
            (pid, rank)
        })
        .collect()
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is gone: no such process, or a zombie nobody reaped.
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('Z' | 'X'))),
    }
}

/// Waits up to `timeout` for `done`.
fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    done()
}

/// Every tensor of a checkpoint (module state and extras) as raw bytes, by name.
fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let checkpoint = load_checkpoint(path).unwrap();
    checkpoint
        .module_state()
        .iter()
        .chain(checkpoint.extras())
        .map(|(name, t)| {
            let bytes = match t.dtype() {
                tandem::core::DType::F32 => t
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                tandem::core::DType::F64 => t
                    .to_vec::<f64>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                tandem::core::DType::I64 => t
                    .to_vec::<i64>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                tandem::core::DType::U8 => t.to_vec::<u8>().unwrap(),
                other => panic!("unexpected dtype {other} of `{name}`"),
            };
            (name.clone(), bytes)
        })
        .collect()
}

fn a_rank_killed_mid_epoch_is_restarted_and_the_run_ends_bit_identical() {
    let unfaulted = scratch("unfaulted");
    let args = quick_args(&unfaulted);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, stderr) = Run::start(&args, Stdio::null()).finish(Duration::from_secs(300));
    assert!(status.success(), "unfaulted run: {status}\n{stderr}");

    let faulted = scratch("faulted");
    let mut args = quick_args(&faulted);
    args.extend(["--max-restarts".to_string(), "1".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut run = Run::start(&args, Stdio::piped());
    // Kill rank 1 as soon as the first checkpoint inside an epoch is complete.
    let checkpointed = wait_until(Duration::from_secs(120), || {
        std::fs::read_dir(&faulted).is_ok_and(|d| {
            d.flatten().any(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("lenet5-step") && n.ends_with(".safetensors")
            })
        })
    });
    assert!(checkpointed, "no checkpoint appeared");
    let rank1 = ranks_of(run.pid())
        .into_iter()
        .find(|&(_, r)| r == Some(1))
        .map(|(pid, _)| pid)
        .expect("rank 1 is running");
    signal(rank1, libc::SIGKILL);
    let (status, stdout, stderr) = run.finish_with_output(Duration::from_secs(300));
    assert!(status.success(), "faulted run: {status}\n{stderr}");
    // The launcher names the first rank it saw fail: rank 1, or rank 0 when it noticed its
    // peer's death and exited first.
    assert!(
        stderr.contains("failed with") && stderr.contains("restart 1 of 1"),
        "the job was not restarted: {stderr}"
    );
    assert!(
        stdout.contains("[rank 0] resuming from") && stdout.contains("lenet5-step"),
        "the restarted job did not resume mid-epoch: {stdout}"
    );

    let last = "lenet5-epoch2.safetensors";
    let (want, got) = (tensors(&unfaulted.join(last)), tensors(&faulted.join(last)));
    assert_eq!(
        got.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        want.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    assert!(want.iter().any(|(n, _)| n.starts_with("optimizer.")));
    assert!(want.iter().any(|(n, _)| n.starts_with("rng.rank1.")));
    for ((name, got), (_, want)) in got.iter().zip(&want) {
        assert!(got == want, "`{name}` differs from the unfaulted run");
    }
}

fn a_torn_newest_checkpoint_is_skipped_for_the_one_before() {
    let dir = scratch("torn");
    let mut args = quick_args(&dir);
    args[1] = "1".to_string(); // one process
    args[3] = "1".to_string(); // one epoch
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, stderr) = Run::start(&args, Stdio::null()).finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{stderr}");
    let complete = dir.join("lenet5-epoch1.safetensors");
    let before = std::fs::read(&complete).unwrap();
    // A newer checkpoint, cut short.
    let torn = dir.join("lenet5-step999.safetensors");
    std::fs::write(&torn, &before[..before.len() / 2]).unwrap();
    let mut args = args.clone();
    args[3] = "2";
    let (status, stderr) = Run::start(&args, Stdio::null()).finish(Duration::from_secs(300));
    assert!(status.success(), "{status}\n{stderr}");
    assert!(
        stderr.contains("skipping checkpoint") && stderr.contains("lenet5-step999"),
        "{stderr}"
    );
    // It resumed from epoch 1 (second epoch trained) and replaced the torn file's place.
    assert!(dir.join("lenet5-epoch2.safetensors").exists());
    assert_eq!(std::fs::read(&complete).unwrap(), before);
}

/// Starts a long 2-rank run (a whole MNIST epoch, which prints nothing for many seconds, so
/// only their launcher's death can end the ranks early) and waits until both ranks train;
/// returns it and their pids.
fn long_run(dir: &Path) -> (Run, Vec<i32>) {
    let dir = dir.to_str().unwrap();
    let args = [
        "--nproc-per-node",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--threads",
        "1",
        "--checkpoint-every",
        "4",
        "--checkpoint-dir",
        dir,
    ];
    let run = Run::start(&args, Stdio::null());
    let mut ranks = Vec::new();
    let up = wait_until(Duration::from_secs(120), || {
        ranks = ranks_of(run.pid());
        ranks.len() == 2
            && std::fs::read_dir(dir).is_ok_and(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("lenet5-"))
            })
    });
    assert!(up, "the ranks did not start training");
    (run, ranks.into_iter().map(|(pid, _)| pid).collect())
}

fn assert_ranks_end(ranks: &[i32], what: &str) {
    let gone = wait_until(Duration::from_secs(5), || {
        ranks.iter().all(|&p| process_gone(p))
    });
    let left: Vec<i32> = ranks
        .iter()
        .copied()
        .filter(|&p| !process_gone(p))
        .collect();
    for &p in &left {
        signal(p, libc::SIGKILL);
    }
    assert!(gone, "ranks {left:?} outlived {what}");
}

fn killing_the_built_in_launcher_kills_its_ranks() {
    let (mut run, ranks) = long_run(&scratch("sigkill"));
    signal(run.pid(), libc::SIGKILL);
    let _ = run.finish(Duration::from_secs(20));
    assert_ranks_end(&ranks, "their launcher (SIGKILL)");
}

fn terminating_the_built_in_launcher_is_forwarded_to_its_ranks() {
    let (mut run, ranks) = long_run(&scratch("sigterm"));
    signal(run.pid(), libc::SIGTERM);
    let (status, stderr) = run.finish(Duration::from_secs(30));
    assert_ranks_end(&ranks, "their launcher (SIGTERM)");
    assert_eq!(status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("received signal 15"), "{stderr}");
}

fn a_run_whose_stdout_is_closed_exits_quietly() {
    let dir = scratch("epipe");
    let mut args = quick_args(&dir);
    args[1] = "1".to_string();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut run = Run::start(&args, Stdio::piped());
    drop(run.child.stdout.take());
    let (status, stderr) = run.finish(Duration::from_secs(300));
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(141), "{status}: {stderr}");
}

/// The JSON object a `--metrics-out` file holds.
fn read_metrics(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn a_checkpoint_evaluated_on_1_to_4_ranks_gives_the_identical_correct_count() {
    let dir = scratch("eval_only");
    let arg = |p: &Path| p.to_str().unwrap().to_string();
    let common = ["--test-limit", "101", "--threads", "1"].map(String::from);
    let mut train: Vec<String> = [
        "--nproc-per-node",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--train-limit",
        "256",
        "--checkpoint-dir",
    ]
    .map(String::from)
    .to_vec();
    train.push(arg(&dir));
    train.extend(common.clone());
    train.extend(["--metrics-out".to_string(), arg(&dir.join("train.json"))]);
    let train: Vec<&str> = train.iter().map(String::as_str).collect();
    let (status, stderr) = Run::start(&train, Stdio::null()).finish(Duration::from_secs(300));
    assert!(status.success(), "training failed: {stderr}");
    let trained = read_metrics(&dir.join("train.json"));
    let correct = trained["test_correct"].as_u64().expect("test_correct");
    assert!(correct > 0 && correct < 101, "{trained}");
    let checkpoint = dir.join("lenet5-epoch1.safetensors");
    for world in 1..=4 {
        let out = dir.join(format!("eval{world}.json"));
        let mut args = vec![
            "--eval-only".to_string(),
            "--resume".to_string(),
            arg(&checkpoint),
            "--nproc-per-node".to_string(),
            world.to_string(),
            "--metrics-out".to_string(),
            arg(&out),
        ];
        args.extend(common.clone());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, stderr) = Run::start(&args, Stdio::null()).finish(Duration::from_secs(120));
        assert!(
            status.success(),
            "evaluation on {world} ranks failed: {stderr}"
        );
        let metrics = read_metrics(&out);
        assert_eq!(
            metrics["test_correct"].as_u64(),
            Some(correct),
            "{world} ranks: {metrics}"
        );
        assert_eq!(
            metrics["test_total"].as_u64(),
            Some(101),
            "{world} ranks: {metrics}"
        );
        assert_eq!(
            metrics["world_size"].as_u64(),
            Some(world as u64),
            "{metrics}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// 3 ranks × 8 images a step on 97 images: shares of 33, 32 and 32 images, so 5, 4 and 4
/// steps an epoch (rank 0's last step has one image); a checkpoint every 2 steps.
fn uneven_args(dir: &Path, epochs: usize) -> Vec<String> {
    let epochs = epochs.to_string();
    [
        "--nproc-per-node",
        "3",
        "--epochs",
        epochs.as_str(),
        "--batch-size",
        "24",
        "--train-limit",
        "97",
        "--test-limit",
        "30",
        "--threads",
        "1",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        dir.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// Each epoch's `train_samples` (per rank) in a `--metrics-out` file.
fn samples_per_epoch(metrics: &serde_json::Value) -> Vec<Vec<u64>> {
    metrics["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|e| {
            e["train_samples"]
                .as_array()
                .unwrap_or_else(|| panic!("no train_samples in {e}"))
                .iter()
                .map(|n| n.as_u64().unwrap())
                .collect()
        })
        .collect()
}

/// The digests the ranks printed (`--print-param-digest`).
fn digests(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter_map(|l| l.split_once("parameter digest ").map(|(_, d)| d))
        .collect()
}

fn uneven_data_is_trained_inside_join_once_per_epoch_and_no_join_pads() {
    let dir = scratch("uneven");
    for (mode, want) in [("join", [33, 32, 32]), ("no-join", [33, 33, 33])] {
        let out = dir.join(format!("{mode}.json"));
        let mut args = uneven_args(&dir.join(mode), 2);
        args.extend(["--print-param-digest", "--metrics-out"].map(String::from));
        args.push(out.to_str().unwrap().to_string());
        if mode == "no-join" {
            args.push("--no-join".to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, stdout, stderr) =
            Run::start(&args, Stdio::piped()).finish_with_output(Duration::from_secs(300));
        assert!(status.success(), "{mode}: {status}\n{stdout}\n{stderr}");
        let announced = if mode == "join" {
            "samples per rank [33, 32, 32], epochs inside join"
        } else {
            "padded to 33 per rank by repeating 2 (--no-join)"
        };
        assert!(stdout.contains(announced), "{mode}: {stdout}");
        // Every epoch: with join, each of the 97 images on exactly one rank (the sampler's
        // tests show the shares are disjoint); padded, 2 images twice.
        let metrics = read_metrics(&out);
        assert_eq!(
            samples_per_epoch(&metrics),
            vec![want.to_vec(); 2],
            "{mode}"
        );
        let digests = digests(&stdout);
        assert_eq!(digests.len(), 3, "{mode}: {stdout}");
        assert!(
            digests.iter().all(|d| *d == digests[0]),
            "{mode}: the replicas differ: {stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn a_joined_run_resumed_at_an_epoch_boundary_ends_bit_identical() {
    let whole = scratch("joined_whole");
    let args = uneven_args(&whole, 2);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (status, stderr) = Run::start(&args, Stdio::null()).finish(Duration::from_secs(300));
    assert!(status.success(), "uninterrupted run: {status}\n{stderr}");

    let parts = scratch("joined_parts");
    for epochs in [1, 2] {
        let args = uneven_args(&parts, epochs);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (status, stdout, stderr) =
            Run::start(&args, Stdio::piped()).finish_with_output(Duration::from_secs(300));
        assert!(status.success(), "{epochs} epochs: {status}\n{stderr}");
        if epochs == 2 {
            assert!(
                stdout.contains("resuming from") && stdout.contains("lenet5-epoch1"),
                "the second run did not resume at the epoch's end: {stdout}"
            );
        }
    }
    // Epoch 1 of 5 steps: global step 5 on every rank, then steps 6 and 8 inside epoch 2.
    let epoch1 = load_checkpoint(parts.join("lenet5-epoch1.safetensors")).unwrap();
    assert_eq!(
        epoch1.metadata().get("global_step").map(String::as_str),
        Some("5")
    );
    let last = "lenet5-epoch2.safetensors";
    let (want, got) = (tensors(&whole.join(last)), tensors(&parts.join(last)));
    assert_eq!(
        got.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        want.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for ((name, got), (_, want)) in got.iter().zip(&want) {
        assert!(got == want, "`{name}` differs from the uninterrupted run");
    }
    let _ = std::fs::remove_dir_all(&whole);
    let _ = std::fs::remove_dir_all(&parts);
}
