//! `mnist --device cuda` trains on the CUDA emulator (`cuda-emu/`) to the loss it reaches on the
//! CPU: the same subset of MNIST, seed, batch and schedule, once with `--device cpu` and once
//! with `--device cuda` on the emulated driver, NVRTC, cuBLAS and cuDNN, and the two runs'
//! training losses and test accuracies compared. The whole GPU path of a real training program
//! runs: the data loader's pinned staging and copies, every op's kernels, cuDNN convolutions
//! (descriptors, the measured algorithm search, workspaces), SGD's fused update, the running
//! loss sum read every few steps, evaluation.
//!
//! This test binary *is* the example when `TANDEM_MNIST_CUDA_WORKER` is set (it includes
//! `examples/mnist.rs`, as `example_supervision.rs` does). Only the CUDA child gets the
//! emulator's folder in its `TANDEM_CUDA_LIBS`: a program never picks the emulator by itself.
//!
//! # Tolerance
//!
//! The two runs differ only in f32 rounding: cuBLAS's and cuDNN's reference loops and the CUDA
//! reductions sum in other orders than the CPU's `gemm` crate and kernels, about 1e-7 relative
//! per value.
//! SGD at a stable learning rate amplifies such differences only slowly: over 200 steps at lr
//! 0.01 (`EXAMPLE_ARGS`), measured, the epoch's mean training loss agreed to 3.7e-9 relative and
//! the test accuracy exactly (92.00%; 2-core machine, 2026-11-26, about 6 minutes on the
//! emulator) with convolutions through im2col; through the emulated cuDNN (its own summation
//! order), to 1.3e-6 relative, the accuracy again exactly. At lr 0.05 the same 200 steps are unstable (the CPU's own test accuracy falls to
//! 49.5%) and the two devices' rounding differences grow to 2% of the loss, so the test keeps a
//! learning rate at which training, not chaos, decides the result. It allows 1e-3 relative on
//! the loss — room for other summation orders and still far below what a wrong gradient, a
//! missed update or a race does — and 1 point of test accuracy (2 of the 200 test images
//! flipping). The emulated child runs with the stream sanitizer on.

#[path = "../examples/mnist.rs"]
#[allow(dead_code)]
mod mnist;
#[path = "support/example_run.rs"]
#[allow(dead_code)] // The run's output is printed, not read.
mod support;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use support::{run_example, Epoch};

/// Set in the environment of a re-executed binary: run the example instead of the test.
const WORKER: &str = "TANDEM_MNIST_CUDA_WORKER";

/// The run: as many steps as fit CI on the emulator, whose launches cost milliseconds each (a
/// block's threads are OS threads), about 1.5–3 s per LeNet-5 step on a loaded 2-core machine.
const EXAMPLE_ARGS: [&str; 14] = [
    "--epochs",
    "1",
    "--batch-size",
    "16",
    "--train-limit",
    "3200",
    "--test-limit",
    "200",
    "--seed",
    "3",
    "--lr",
    "0.01",
    "--threads",
    "2",
];

fn main() -> ExitCode {
    support::example_or_test(
        WORKER,
        mnist::main,
        "mnist_on_the_emulated_gpu_reaches_the_cpu_loss",
        mnist_on_the_emulated_gpu_reaches_the_cpu_loss,
    )
}

/// Runs the example on `device`, on the emulator in `cuda_libs` when set; returns its epochs
/// and how long it took.
fn run(device: &str, cuda_libs: Option<&Path>, dir: &Path) -> (Vec<Epoch>, f64) {
    let run = run_example(
        WORKER,
        &EXAMPLE_ARGS,
        device,
        cuda_libs,
        &[],
        dir,
        Duration::from_secs(900),
    );
    (run.epochs, run.seconds)
}

fn mnist_on_the_emulated_gpu_reaches_the_cpu_loss() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let libs = tandem_test_support::emulator_folder();
    let (cpu, cpu_seconds) = run("cpu", None, dir.path());
    let (gpu, gpu_seconds) = run("cuda", Some(&libs), dir.path());
    let _ = std::fs::remove_dir_all(&libs);
    println!("cpu {cpu_seconds:.1} s, emulated cuda {gpu_seconds:.1} s");
    assert_eq!(cpu.len(), gpu.len(), "epochs: cpu {cpu:?}, cuda {gpu:?}");
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        let relative = (g.train_loss - c.train_loss).abs() / c.train_loss;
        let points = 100.0 * (g.test_accuracy - c.test_accuracy).abs();
        println!(
            "epoch {}: train loss cpu {:.6}, cuda {:.6} (relative difference {relative:.2e}); \
             test accuracy cpu {:.2}%, cuda {:.2}% ({points:.2} points)",
            i + 1,
            c.train_loss,
            g.train_loss,
            100.0 * c.test_accuracy,
            100.0 * g.test_accuracy
        );
        assert!(
            relative < 1e-3,
            "epoch {}: the emulated GPU's training loss {} is not the CPU's {}",
            i + 1,
            g.train_loss,
            c.train_loss
        );
        assert!(
            points <= 1.0,
            "epoch {}: test accuracy {} on the emulated GPU, {} on the CPU",
            i + 1,
            g.test_accuracy,
            c.test_accuracy
        );
    }
    // Training happened: the epoch's loss is below chance (ln 10 ≈ 2.30).
    assert!(cpu[0].train_loss < 2.2, "{cpu:?}");
}
