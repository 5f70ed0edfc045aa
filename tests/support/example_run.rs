//! Running a training example as a child process and reading its results: shared by the tests
//! whose binary *is* the example when a worker variable is set (`mnist_cuda.rs`,
//! `mnist_ddp_cuda.rs`). Only a child the test points at the emulator's folder (its
//! `TANDEM_CUDA_LIBS`) runs on the emulator: a program never picks the emulator by itself.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// One epoch's results from the metrics file.
#[derive(Debug)]
pub struct Epoch {
    pub train_loss: f64,
    pub test_accuracy: f64,
}

/// What a run of the example left: its epochs, its output (stdout then stderr) and how long it
/// took.
pub struct ExampleRun {
    pub epochs: Vec<Epoch>,
    pub output: String,
    pub seconds: f64,
}

/// Runs this test binary as the example (`worker` set in its environment) with `args`, on
/// `device`, writing its metrics into `dir`. With `cuda_libs`, the child runs on the CUDA
/// emulator in that folder, with the stream sanitizer on and a kernel cache of its own
/// (tandem's cache key covers the NVRTC version, not the emulation's headers, so the user's
/// cache may hold images of an older emulator). `env` adds variables. Fails the test if the
/// example fails or runs longer than `limit` (a hang on the emulator must fail the test, not
/// CI's clock).
pub fn run_example(
    worker: &str,
    args: &[&str],
    device: &str,
    cuda_libs: Option<&Path>,
    env: &[(&str, &str)],
    dir: &Path,
    limit: Duration,
) -> ExampleRun {
    let metrics = dir.join(format!("metrics-{device}.json"));
    let mut command = Command::new(std::env::current_exe().expect("the test binary"));
    command
        .env(worker, "1")
        .args(args)
        .args(["--device", device, "--metrics-out"])
        .arg(&metrics)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match cuda_libs {
        Some(folder) => command
            .env("TANDEM_CUDA_LIBS", folder)
            .env("TANDEM_CUDA_SANITIZER", "1")
            .env("TANDEM_KERNEL_CACHE", folder.join("kernel-cache")),
        None => command.env_remove("TANDEM_CUDA_LIBS"),
    };
    command.envs(env.iter().copied());
    let started = Instant::now();
    let mut child = command.spawn().expect("start the example");
    // The pipes are read only after the child exits: a child that filled one would block, so
    // keep the output small (no progress bar: it draws only on a terminal).
    loop {
        if child.try_wait().expect("wait for the example").is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example on {device} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("the example's output");
    let seconds = started.elapsed().as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "the example on {device} failed ({}):\n{text}",
        output.status
    );
    println!(
        "--- the example on {device} ({seconds:.1} s):\n{}",
        text.trim_end()
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&metrics).expect("the metrics file"))
            .expect("metrics JSON");
    let epochs = json["history"]
        .as_array()
        .expect("a history of epochs")
        .iter()
        .map(|e| Epoch {
            train_loss: e["train_loss"].as_f64().expect("train_loss"),
            test_accuracy: e["test_accuracy"].as_f64().expect("test_accuracy"),
        })
        .collect();
    ExampleRun {
        epochs,
        output: text,
        seconds,
    }
}

/// The `main` of a test binary that is also the example: with `worker` set in its environment
/// it runs `example`; otherwise it runs `test` and reports it as the test harness does (the
/// binary has `harness = false`, so that a child can be the example).
pub fn example_or_test(
    worker: &str,
    example: fn() -> ExitCode,
    name: &str,
    test: fn(),
) -> ExitCode {
    if std::env::var_os(worker).is_some() {
        return example();
    }
    println!("test {name} ...");
    match std::panic::catch_unwind(test) {
        Ok(()) => {
            println!("test {name} ... ok");
            println!("test result: ok");
            ExitCode::SUCCESS
        }
        Err(_) => {
            println!("test {name} ... FAILED");
            println!("test result: FAILED");
            ExitCode::FAILURE
        }
    }
}
