//! The GPU bundle's runner is loud: `scripts/gpu-run.sh` (the bundle's `run.sh`) runs in a fake
//! bundle whose test binaries and programs are small shell scripts that pass, crash, skip for
//! want of a GPU, or run without their PyTorch peer, and every such failure must reach the
//! report and the exit status. Needs bash, coreutils' `timeout` and python3, as the runner does.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fake repository holding a fake bundle (`gpu-bundle/` with the real runner); removed on
/// drop.
struct FakeBundle {
    root: PathBuf,
}

impl FakeBundle {
    fn new(test: &str) -> FakeBundle {
        let root = std::env::temp_dir().join(format!(
            "tandem-bundle-scripts-{test}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let bundle = root.join("repo/gpu-bundle");
        std::fs::create_dir_all(bundle.join("tests")).unwrap();
        std::fs::create_dir_all(bundle.join("bin")).unwrap();
        let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
        for (from, to) in [("gpu-run.sh", "run.sh"), ("gpu-checks.sh", "checks.sh")] {
            let to = bundle.join(to);
            std::fs::copy(scripts.join(from), &to).unwrap();
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::write(bundle.join("tests/MANIFEST"), "").unwrap();
        FakeBundle { root }
    }

    fn bundle(&self) -> PathBuf {
        self.root.join("repo/gpu-bundle")
    }

    /// Writes an executable shell script at `relative` (in the bundle).
    fn program(&self, relative: &str, body: &str) {
        let path = self.bundle().join(relative);
        std::fs::write(&path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A GPU test binary `name` listed in the manifest.
    fn test_binary(&self, name: &str, body: &str) {
        self.program(&format!("tests/{name}"), body);
        let manifest = self.bundle().join("tests/MANIFEST");
        let mut text = std::fs::read_to_string(&manifest).unwrap();
        text.push_str(&format!("{name} .\n"));
        std::fs::write(manifest, text).unwrap();
    }

    /// Runs `script` (run.sh or checks.sh) with `args` from a folder outside the repository;
    /// returns the exit status and the report.
    fn run(&self, script: &str, args: &[&str]) -> (i32, String) {
        let report = self.root.join("out/report.md");
        let _ = std::fs::remove_file(&report);
        let elsewhere = self.root.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let output = Command::new(self.bundle().join(script))
            .args(["--report", report.to_str().unwrap()])
            .args(["--out", self.root.join("out").to_str().unwrap()])
            .args(args)
            .current_dir(&elsewhere)
            .env("TANDEM_SCRATCH_DIR", self.root.join("scratch"))
            .env_remove("OUT")
            .env_remove("TANDEM_BUNDLE_BUDGET")
            .env_remove("TANDEM_BUNDLE_DEVICE")
            .env_remove("TANDEM_TEST_CUDA")
            .output()
            .unwrap();
        let code = output.status.code().expect("the runner exited by itself");
        let report = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!(
                "no report ({e}); stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        });
        (code, report)
    }
}

impl Drop for FakeBundle {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The summary row of check `name` in `report`.
fn row<'a>(report: &'a str, name: &str) -> &'a str {
    report
        .lines()
        .find(|l| l.starts_with('|') && l.contains(&format!(" {name} |")))
        .unwrap_or_else(|| panic!("no row for {name} in:\n{report}"))
}

/// A program that writes a metrics file (the argument after --metrics-out) with `accuracy`.
fn trains_to(accuracy: f64) -> String {
    format!(
        r#"while [ $# -gt 0 ]; do [ "$1" = --metrics-out ] && out=$2; shift; done
echo "epoch 1/1: test accuracy {accuracy}"
echo '{{"test_accuracy": {accuracy}, "images_per_sec": 1000, "seconds": 1}}' > "$out""#
    )
}

#[test]
fn the_scripts_parse() {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
    for script in ["gpu-run.sh", "gpu-checks.sh", "gpu-bundle.sh"] {
        let status = Command::new("bash")
            .arg("-n")
            .arg(scripts.join(script))
            .status()
            .unwrap();
        assert!(status.success(), "bash -n {script}");
    }
}

#[test]
fn a_crashed_training_run_fails_the_run_and_is_in_the_report() {
    let fake = FakeBundle::new("crash");
    fake.program(
        "bin/mnist",
        "echo 'epoch 1/1: …'; echo \"thread 'main' panicked at the loss\" >&2; exit 101",
    );
    fake.program("bin/cifar_resnet", &trains_to(0.99));
    let (code, report) = fake.run("run.sh", &["--device", "cpu", "train"]);
    assert_eq!(code, 1, "{report}");
    assert!(row(&report, "mnist_1rank").contains("| FAIL |"), "{report}");
    assert!(row(&report, "mnist_1rank").contains("exit status 101"));
    assert!(row(&report, "mnist_1rank").contains("panicked at the loss"));
    // One crashed rank fails the 2-rank job.
    assert!(
        row(&report, "mnist_2ranks").contains("| FAIL |"),
        "{report}"
    );
    assert!(
        row(&report, "resnet20_mnist32").contains("| PASS |"),
        "{report}"
    );
    assert!(
        report.contains("panicked at the loss"),
        "the output tail: {report}"
    );
    assert!(report.contains("- result: FAILED"), "{report}");
    // The old name for the training checks is as loud.
    let (code, _) = fake.run("checks.sh", &["--device", "cpu", "train"]);
    assert_eq!(code, 1);
}

#[test]
fn a_training_run_that_learns_too_little_fails() {
    let fake = FakeBundle::new("accuracy");
    fake.program("bin/mnist", &trains_to(0.11));
    fake.program("bin/cifar_resnet", &trains_to(0.99));
    let (code, report) = fake.run("run.sh", &["--device", "cpu", "train"]);
    assert_eq!(code, 1, "{report}");
    assert!(row(&report, "mnist_1rank").contains("| FAIL |"), "{report}");
    assert!(row(&report, "mnist_1rank").contains("test accuracy 11.00%"));
}

#[test]
fn failed_tests_and_gpu_tests_that_saw_no_gpu_fail_on_a_gpu_run() {
    let fake = FakeBundle::new("tests");
    fake.test_binary(
        "cuda_good",
        "echo 'test result: ok. 3 passed; 0 failed; 0 ignored'",
    );
    fake.test_binary(
        "cuda_bad",
        "echo 'test result: FAILED. 2 passed; 1 failed; 0 ignored'; exit 101",
    );
    fake.test_binary(
        "cuda_blind",
        "echo 'skipped: no CUDA device'; echo 'test result: ok. 1 passed; 0 failed'",
    );
    // The runner tells the GPU tests to use the real GPU (never the emulator) on a GPU run, and
    // to skip on a CPU run (the bundle has no emulator).
    fake.test_binary(
        "cuda_target",
        "echo \"target $TANDEM_TEST_CUDA\"; [ \"$TANDEM_TEST_CUDA\" != emulator ] || exit 1; \
         echo 'test result: ok. 1 passed; 0 failed'",
    );
    fake.test_binary(
        "cuda_emulated",
        "echo 'skipped on the CUDA emulator: needs NCCL'; echo 'test result: ok. 1 passed; 0 failed'",
    );
    let (code, report) = fake.run("run.sh", &["tests"]);
    assert_eq!(code, 1, "{report}");
    assert!(row(&report, "cuda_good").contains("| PASS |"), "{report}");
    assert!(row(&report, "cuda_good").contains("3 passed, 0 failed"));
    assert!(row(&report, "cuda_bad").contains("| FAIL |"), "{report}");
    assert!(row(&report, "cuda_bad").contains("2 passed, 1 failed"));
    assert!(row(&report, "cuda_blind").contains("| FAIL |"), "{report}");
    assert!(row(&report, "cuda_blind").contains("no GPU was seen"));
    assert!(
        row(&report, "cuda_emulated").contains("| FAIL |"),
        "{report}"
    );
    assert!(
        row(&report, "cuda_emulated").contains("needs NCCL"),
        "{report}"
    );
    assert!(row(&report, "cuda_target").contains("| PASS |"), "{report}");
    assert!(report.contains("target gpu"), "{report}");
    // On the CPU, skipping for want of a GPU is what a GPU test does.
    let (_, report) = fake.run("run.sh", &["--device", "cpu", "tests"]);
    assert!(row(&report, "cuda_blind").contains("| PASS |"), "{report}");
    assert!(report.contains("target skip"), "{report}");
}

#[test]
fn a_benchmark_whose_pytorch_peer_did_not_run_fails() {
    let fake = FakeBundle::new("peer");
    // Exits 0 but says its peer did not run (as a benchmark without --require-peer would).
    fake.program(
        "bin/train_step",
        "echo 'tandem 1.0'; echo 'pytorch: not run: cannot find the PyTorch peer script'",
    );
    fake.program(
        "bin/ddp_step",
        "[ \"$TANDEM_REQUIRE_PEER\" = 1 ] || exit 9; echo 'ddp / torch_ddp:         0.95 (torch 2.11)'",
    );
    let (code, report) = fake.run("run.sh", &["--device", "cpu", "bench"]);
    assert_eq!(code, 1, "{report}");
    assert!(
        row(&report, "train_step_lenet").contains("| FAIL |"),
        "{report}"
    );
    assert!(row(&report, "train_step_lenet").contains("not run: cannot find"));
    // The bundle asks the benchmarks to fail by themselves too (TANDEM_REQUIRE_PEER=1).
    assert!(
        row(&report, "ddp_step_lenet_2ranks").contains("| PASS |"),
        "{report}"
    );
}

#[test]
fn checks_past_the_time_budget_are_skipped_and_the_run_is_not_a_pass() {
    let fake = FakeBundle::new("budget");
    fake.test_binary("cuda_a", "echo 'test result: ok. 1 passed; 0 failed'");
    fake.test_binary("cuda_b", "echo 'test result: ok. 1 passed; 0 failed'");
    let (code, report) = fake.run("run.sh", &["--budget", "5", "--device", "cpu", "tests"]);
    assert_eq!(code, 3, "{report}");
    assert!(row(&report, "cuda_a").contains("| SKIPPED |"), "{report}");
    assert!(row(&report, "cuda_b").contains("budget"), "{report}");
    assert!(report.contains("- result: INCOMPLETE"), "{report}");

    let (code, report) = fake.run("run.sh", &["--device", "cpu", "tests"]);
    assert_eq!(code, 0, "{report}");
    assert!(report.contains("- result: PASSED"), "{report}");
}

#[test]
fn a_check_past_the_budget_is_stopped_with_its_children() {
    let fake = FakeBundle::new("timeout");
    // A run that hangs, in a child process: the budget stops it, child included (or the
    // child, holding the log open, would keep this test waiting for 300 s).
    fake.program("bin/mnist", "sleep 300");
    fake.program("bin/cifar_resnet", &trains_to(0.99));
    let (code, report) = fake.run("run.sh", &["--budget", "14", "--device", "cpu", "train"]);
    assert_eq!(code, 1, "{report}");
    assert!(
        row(&report, "mnist_1rank").contains("| TIMEOUT |"),
        "{report}"
    );
    assert!(
        row(&report, "resnet20_mnist32").contains("| SKIPPED |"),
        "{report}"
    );
}
