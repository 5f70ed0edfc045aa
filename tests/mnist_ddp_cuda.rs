//! `mnist --nproc-per-node 2 --device cuda` under the built-in launcher (`tandem-run`'s), on the
//! CUDA emulator (`cuda-emu/`) with its emulated NCCL: two rank processes, each on the emulated
//! `cuda:0`, train LeNet-5 data-parallel over NCCL on a small subset of MNIST. The run must end
//! with both ranks' parameters identical (each rank prints a digest of its parameters,
//! `--print-param-digest`), the training loss falling from the first epoch to the second, and
//! the losses those of the same job on the CPU over TCP (`--device cpu`), which also ends with
//! identical replicas.
//!
//! This test binary *is* the example when `TANDEM_MNIST_DDP_CUDA_WORKER` is set, and so are
//! the ranks the example's launcher starts (they inherit the variable). Only the CUDA run gets
//! the emulator's folder in its `TANDEM_CUDA_LIBS`; `CUDA_VISIBLE_DEVICES=0` tells the ranks
//! that the one device the emulator shows is the GPU of each (rank 1 would otherwise look for
//! `cuda:1`). The test always runs on the emulator, as `mnist_cuda.rs` does, even on a machine
//! with a GPU: the real NCCL refuses two ranks of a communicator on one GPU, and under the
//! launcher both ranks share one environment, so the per-rank `NCCL_HOSTID` with which
//! `dist/tests/cuda_nccl.rs` works around that cannot be given.
//!
//! # Tolerance
//!
//! The two jobs differ in f32 rounding only (the devices' kernels, and the order in which NCCL
//! and the TCP ring sum the two ranks' gradients); over 40 steps at lr 0.02 that stays far below
//! the 1e-3 relative the test allows on the epochs' losses (see `mnist_cuda.rs`), while a
//! gradient summed instead of averaged, a missed bucket or a race is far above it.

#[path = "../examples/mnist.rs"]
#[allow(dead_code)]
mod mnist;
#[path = "support/example_run.rs"]
mod support;

use std::process::ExitCode;
use std::time::Duration;

use support::{run_example, ExampleRun};

/// Set in the environment of a re-executed binary: run the example instead of the test.
const WORKER: &str = "TANDEM_MNIST_DDP_CUDA_WORKER";

/// Two epochs of 20 steps (global batch 16, 8 per rank), one thread per rank: the emulator
/// runs a LeNet-5 step in seconds on a loaded 2-core machine. At the default lr 0.02, held
/// constant, the loss falls clearly (on the CPU: 2.29 in the first epoch, 2.01 in the second).
const EXAMPLE_ARGS: [&str; 19] = [
    "--nproc-per-node",
    "2",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--train-limit",
    "320",
    "--test-limit",
    "100",
    "--seed",
    "5",
    "--lr",
    "0.02",
    "--lr-decay",
    "1",
    "--threads",
    "1",
    "--print-param-digest",
];

fn main() -> ExitCode {
    support::example_or_test(
        WORKER,
        mnist::main,
        "mnist_on_two_nccl_ranks_on_the_emulated_gpu_ends_with_identical_replicas",
        mnist_on_two_nccl_ranks_on_the_emulated_gpu,
    )
}

/// Each rank's parameter digest, in rank order; fails unless both ranks printed one.
fn digests(device: &str, run: &ExampleRun) -> Vec<String> {
    (0..2)
        .map(|rank| {
            let marker = format!("[rank {rank}] parameter digest ");
            run.output
                .lines()
                .find_map(|l| l.split_once(&marker).map(|(_, d)| d.trim().to_string()))
                .unwrap_or_else(|| {
                    panic!(
                        "--device {device}: rank {rank} printed no parameter digest:\n{}",
                        run.output
                    )
                })
        })
        .collect()
}

fn mnist_on_two_nccl_ranks_on_the_emulated_gpu() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let limit = Duration::from_secs(600);
    let cpu = run_example(WORKER, &EXAMPLE_ARGS, "cpu", None, &[], dir.path(), limit);
    let libs = tandem_test_support::emulator_folder();
    let gpu = run_example(
        WORKER,
        &EXAMPLE_ARGS,
        "cuda",
        Some(&libs),
        &[("CUDA_VISIBLE_DEVICES", "0")],
        dir.path(),
        limit,
    );
    let _ = std::fs::remove_dir_all(&libs);
    println!(
        "2 ranks on the cpu {:.1} s, on the emulated cuda {:.1} s",
        cpu.seconds, gpu.seconds
    );
    assert!(
        gpu.output.contains("2 ranks") && gpu.output.contains("on cuda:0"),
        "the CUDA job did not train on 2 ranks on cuda:0:\n{}",
        gpu.output
    );
    for (device, run) in [("cpu", &cpu), ("cuda", &gpu)] {
        let digests = digests(device, run);
        println!("--device {device}: parameter digests {digests:?}");
        assert_eq!(
            digests[0], digests[1],
            "--device {device}: the two ranks' parameters differ at the end"
        );
    }
    assert_eq!(cpu.epochs.len(), 2, "cpu epochs: {:?}", cpu.epochs);
    assert_eq!(gpu.epochs.len(), 2, "cuda epochs: {:?}", gpu.epochs);
    for (i, (c, g)) in cpu.epochs.iter().zip(&gpu.epochs).enumerate() {
        let relative = (g.train_loss - c.train_loss).abs() / c.train_loss;
        println!(
            "epoch {}: train loss cpu {:.6}, cuda {:.6} (relative difference {relative:.2e}); \
             test accuracy cpu {:.2}%, cuda {:.2}%",
            i + 1,
            c.train_loss,
            g.train_loss,
            100.0 * c.test_accuracy,
            100.0 * g.test_accuracy
        );
        assert!(
            relative < 1e-3,
            "epoch {}: the emulated GPU job's training loss {} is not the CPU job's {}",
            i + 1,
            g.train_loss,
            c.train_loss
        );
    }
    assert!(
        gpu.epochs[1].train_loss < gpu.epochs[0].train_loss,
        "the training loss did not fall from the first epoch to the second: {:?}",
        gpu.epochs
    );
}
