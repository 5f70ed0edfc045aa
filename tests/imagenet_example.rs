//! The `imagenet` example end to end on the CPU: `mnist_to_folder` writes the first images of
//! the shipped MNIST as an ImageFolder of JPEGs, and the example trains a ResNet-20 on 16×16
//! crops of it for a few steps — alone, and data-parallel on two ranks under the built-in
//! launcher (`tandem-run`'s). Each run must finish, print its epoch, and write a metrics file
//! whose accuracy, count of correct answers, number of classes and world size agree with the
//! run. (Whether the recipe learns is the README's 1-epoch run on all 70 000 images; a few
//! steps here only show the pipeline — decoding, augmentation, normalisation, DDP — works.)
//!
//! Then the same example runs a few steps with `--device cuda` on the CUDA emulator (`cuda-emu/`,
//! stream sanitizer on) and once more on the CPU with the same settings: the u8 batches are
//! copied to the device on the loader's copy stream and normalised there, and the two runs'
//! training losses must agree to f32 rounding (1e-3 relative, as `mnist_cuda` allows; an emulator
//! result, not a GPU's).
//!
//! This test binary *is* the example when `TANDEM_IMAGENET_EXAMPLE_WORKER` is set, and so are
//! the ranks the example's launcher starts (they inherit the variable).

#[path = "../examples/imagenet.rs"]
#[allow(dead_code)]
mod imagenet;
#[path = "../examples/mnist_to_folder.rs"]
#[allow(dead_code)]
mod mnist_to_folder;
#[path = "support/example_run.rs"]
mod support;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use support::run_example;

/// Set in the environment of a re-executed binary: run the example instead of the test.
const WORKER: &str = "TANDEM_IMAGENET_EXAMPLE_WORKER";

/// Images written of each split (the first of each): ImageFolder orders samples by class, so
/// the whole small folder is used rather than a `--train-limit`/`--test-limit` prefix (which
/// would hold the first classes only).
const IMAGES: usize = 128;

fn main() -> ExitCode {
    support::example_or_test(
        WORKER,
        imagenet::main,
        "imagenet_example_trains_on_a_jpeg_folder_alone_and_on_two_ranks",
        imagenet_example_trains_on_a_jpeg_folder_alone_and_on_two_ranks,
    )
}

/// The example's arguments for a run in `dir` on the folder `data`: ResNet-20 on 16×16 crops,
/// one epoch of 4 steps (global batch 32) on 128 training images, evaluated on 128, one compute thread and one decoding worker a rank.
fn example_args(data: &Path, dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "--model",
        "resnet20",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--warmup-epochs",
        "0.5",
        "--crop-scale",
        "0.35",
        "--no-flip",
        "--threads",
        "1",
        "--workers",
        "1",
    ]
    .map(String::from)
    .to_vec();
    args.push("--data-dir".into());
    args.push(data.display().to_string());
    args.push("--checkpoint-dir".into());
    args.push(dir.join("checkpoints").display().to_string());
    args
}

/// Runs the example with `extra` arguments in a folder of its own below `dir` and returns its
/// metrics file, after checking the run's epoch and the file's consistency.
fn run_and_check(data: &Path, dir: &Path, name: &str, extra: &[&str]) -> serde_json::Value {
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).expect("a folder for the run");
    let mut args = example_args(data, &dir);
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = run_example(
        WORKER,
        &args,
        "cpu",
        None,
        &[],
        &dir,
        Duration::from_secs(300),
    );
    println!("{name}: {:.1} s", run.seconds);
    assert_eq!(run.epochs.len(), 1, "{name}: epochs {:?}", run.epochs);
    let epoch = &run.epochs[0];
    assert!(
        epoch.train_loss.is_finite() && epoch.train_loss > 0.0,
        "{name}: training loss {}",
        epoch.train_loss
    );
    let metrics: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("metrics-cpu.json")).expect("the metrics file"),
    )
    .expect("metrics JSON");
    let accuracy = metrics["test_accuracy"].as_f64().expect("test_accuracy");
    let correct = metrics["test_correct"].as_u64().expect("test_correct");
    assert_eq!(metrics["test_samples"], IMAGES, "{name}: {metrics}");
    assert_eq!(metrics["classes"], 10, "{name}: {metrics}");
    assert!((0.0..=1.0).contains(&accuracy), "{name}: {metrics}");
    assert_eq!(epoch.test_accuracy, accuracy, "{name}: {metrics}");
    let world = metrics["world_size"].as_u64().expect("world_size");
    let ranks = if world == 1 { "1 rank," } else { "2 ranks," };
    assert!(
        run.output.contains(ranks),
        "{name}: the run did not train on {ranks}\n{}",
        run.output
    );
    assert_eq!(
        correct,
        (accuracy * IMAGES as f64).round() as u64,
        "{name}: {metrics}"
    );
    assert!(
        metrics["images_per_sec"].as_f64().is_some_and(|r| r > 0.0),
        "{name}: {metrics}"
    );
    metrics
}

fn imagenet_example_trains_on_a_jpeg_folder_alone_and_on_two_ranks() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let data = dir.path().join("mnist-jpeg");
    let mnist = tandem::locate::mnist_dir(None).expect("the shipped MNIST");
    let written = mnist_to_folder::write_mnist_folder(&mnist, &data, Some(IMAGES), 90)
        .expect("write MNIST as JPEGs");
    assert_eq!(written, (IMAGES, IMAGES));
    let alone = run_and_check(&data, dir.path(), "alone", &[]);
    assert_eq!(alone["world_size"], 1, "{alone}");
    let ddp = run_and_check(&data, dir.path(), "two-ranks", &["--nproc-per-node", "2"]);
    assert_eq!(ddp["world_size"], 2, "{ddp}");
    cuda_matches_cpu(&data, dir.path());
}

/// Two steps of 8 images (and an evaluation of 16) on the emulated GPU and on the CPU: the
/// training losses agree to f32 rounding.
fn cuda_matches_cpu(data: &Path, dir: &Path) {
    let libs = tandem_test_support::emulator_folder();
    let data = data.display().to_string();
    let args = [
        "--model",
        "resnet20",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--train-limit",
        "16",
        "--test-limit",
        "16",
        "--warmup-epochs",
        "0",
        "--crop-scale",
        "0.35",
        "--threads",
        "1",
        "--workers",
        "1",
        "--data-dir",
        &data,
    ];
    let mut losses = Vec::new();
    for (device, cuda_libs) in [("cpu", None), ("cuda", Some(libs.as_path()))] {
        let run_dir = dir.join(format!("short-{device}"));
        std::fs::create_dir_all(&run_dir).expect("a folder for the run");
        let checkpoints = run_dir.join("checkpoints").display().to_string();
        let mut args = args.to_vec();
        args.extend(["--checkpoint-dir", &checkpoints]);
        let run = run_example(
            WORKER,
            &args,
            device,
            cuda_libs,
            &[],
            &run_dir,
            Duration::from_secs(600),
        );
        println!("{device}: {:.1} s", run.seconds);
        assert_eq!(run.epochs.len(), 1, "{device}: epochs {:?}", run.epochs);
        losses.push(run.epochs[0].train_loss);
    }
    let _ = std::fs::remove_dir_all(&libs);
    let (cpu, gpu) = (losses[0], losses[1]);
    let relative = (gpu - cpu).abs() / cpu;
    println!("training loss: cpu {cpu:.6}, emulated cuda {gpu:.6} (relative {relative:.2e})");
    assert!(
        cpu.is_finite() && relative < 1e-3,
        "the emulated GPU's training loss {gpu} is not the CPU's {cpu}"
    );
}
