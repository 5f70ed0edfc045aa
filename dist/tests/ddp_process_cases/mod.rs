//! The DDP suite's cases (`device_suite/`) with two ranks as real processes: each case is what a
//! rank does in its process ([`run_case`], which prints its results as tagged lines) and what
//! the test does with them (the functions named after the cases: start the job, compute the
//! single-process reference on the same device while it runs, read the ranks' results and
//! check them with the suite's checks). `cuda_ddp_nccl.rs` runs them on CUDA over NCCL,
//! `ddp_processes.rs` on the CPU over TCP.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_core::Device;
use tandem_dist::{DdpConfig, ProcessGroup};

use crate::common::Job;
use crate::ddp_common::{parse_snapshot, print_snapshot, tagged_lines, Model, Outcome, Snapshot};
use crate::device_suite::ddp::{
    check_compression, check_equivalence, check_no_sync, check_rebuild, compression_hooks,
    compression_rank, no_sync_rank, rebuild_rank, reference_checked_on, reference_on, tolerance,
    train_ddp_with, RebuildOutcome, REBUILD_STEPS, STEPS,
};
use crate::device_suite::ddp_unused::{
    check_unused, check_unused_errors, unused_rank, unused_reference,
    unused_without_the_option_rank, UnusedOutcome,
};

/// Ranks of every job.
pub const WORLD: usize = 2;

/// How long a job may take before the test fails instead of waiting (the emulator runs one in
/// well under a minute; a hang must fail the test, not CI's clock).
pub const JOB_LIMIT: Duration = Duration::from_secs(300);

/// Small buckets, so that each backward all-reduces several buckets on the comm stream while
/// the rest of the backward runs, as a real model's does.
pub fn small_buckets() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 0.002,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    }
}

/// The backend a job on `device` uses: NCCL on CUDA, TCP on the CPU.
pub fn backend(device: Device) -> &'static str {
    match device {
        Device::Cpu => "tcp",
        Device::Cuda(_) => "nccl",
    }
}

/// What the runs are called in failures.
pub fn label(device: Device, what: &str) -> String {
    format!("{what}, {WORLD} {} processes on {device}", backend(device))
}

/// Starts the job of `case` on `device`: on CUDA both ranks on `cuda:0`
/// ([`Job::start_on_one_gpu`]).
pub fn start(device: Device, case: &str) -> (Job, Instant) {
    let started = Instant::now();
    let job = match device {
        Device::Cpu => Job::start(WORLD, case),
        Device::Cuda(_) => Job::start_on_one_gpu(WORLD, case),
    };
    (job, started)
}

/// In a rank process: prints the line by which the test checks where the rank trained.
pub fn announce(group: &dyn ProcessGroup) {
    println!(
        "rank {}: a {} group on {}",
        group.rank(),
        group.backend(),
        group.comm_stream().device()
    );
}

/// Waits for `job` and returns each rank's output, failing the test (with the output) if a
/// rank failed or did not train on `device` over its backend.
pub fn outputs(job: Job, started: Instant, device: Device, case: &str) -> Vec<String> {
    let results = job.wait(JOB_LIMIT);
    println!(
        "{case} on {device}: the ranks finished {:.1} s after they started",
        started.elapsed().as_secs_f64()
    );
    results
        .into_iter()
        .enumerate()
        .map(|(rank, (status, output))| {
            assert!(
                status.success(),
                "{case}: rank {rank} of {WORLD} failed with {status}:\n{output}"
            );
            let banner = format!("rank {rank}: a {} group on {device}", backend(device));
            assert!(
                output.contains(&banner),
                "{case}: rank {rank} did not print {banner:?}:\n{output}"
            );
            output
        })
        .collect()
}

/// The tensors rank `rank` printed under `tag`; fails if it printed none.
fn parsed(tag: &str, rank: usize, output: &str) -> Snapshot {
    let snapshot = parse_snapshot(tag, output);
    assert!(
        !snapshot.is_empty(),
        "rank {rank} printed no `{tag}` lines:\n{output}"
    );
    snapshot
}

/// The lists a rank printed as lines `<tag> <index> <item>,<item>,…`, in order.
fn lists(tag: &str, output: &str) -> Vec<Vec<String>> {
    tagged_lines(tag, output)
        .map(|l| {
            let items = l.split_once(' ').map_or("", |(_, items)| items);
            items
                .split(',')
                .filter(|i| !i.is_empty())
                .map(str::to_string)
                .collect()
        })
        .collect()
}

// ---- the checks, in the test process -------------------------------------------------------

/// `model` (case `mlp`, `cnn`, or `sync-batch-norm` for the Cnn with BatchNorm turned into
/// SyncBatchNorm) trained for [`STEPS`] steps by two rank processes against one process on the
/// full batch: first-step gradients and final parameters, and replicas bit-identical.
pub fn equivalence(device: Device, case: &str, model: Model) {
    let (job, started) = start(device, case);
    // The reference runs while the ranks train.
    let want = reference_checked_on(device, model);
    let outputs = outputs(job, started, device, case);
    let outcomes: Vec<Outcome> = outputs
        .iter()
        .enumerate()
        .map(|(rank, output)| Outcome {
            first_grads: parsed("first-grads", rank, output),
            final_params: parsed("final-params", rank, output),
        })
        .collect();
    if let Some(layout) = tagged_lines("buckets", &outputs[0]).next() {
        println!("{case} on {device}: rank 0's buckets {layout}");
    }
    check_equivalence(
        &label(device, &format!("{case} ({model:?}), {STEPS} steps")),
        &outcomes,
        &want,
        tolerance(device),
    );
}

/// The bf16 and f16 compression hooks against the full-batch gradients.
pub fn compression(device: Device) {
    let (job, started) = start(device, "hooks");
    let want = reference_on(device, Model::Mlp, 1, 1);
    let outputs = outputs(job, started, device, "hooks");
    for (i, (hook, tol)) in compression_hooks().into_iter().enumerate() {
        let grads: Vec<_> = outputs
            .iter()
            .enumerate()
            .map(|(rank, output)| parsed(&format!("hook-{i}-grads"), rank, output))
            .collect();
        check_compression(&label(device, "compression"), &hook, &grads, &want, tol);
    }
}

/// A micro-batch under `no_sync`, then a synchronised one, against one batch of both.
pub fn no_sync(device: Device) {
    let (job, started) = start(device, "no-sync");
    let want = reference_on(device, Model::Mlp, 1, 1);
    let grads: Vec<_> = outputs(job, started, device, "no-sync")
        .iter()
        .enumerate()
        .map(|(rank, output)| parsed("grads", rank, output))
        .collect();
    check_no_sync(&label(device, "no_sync"), &grads, &want, tolerance(device));
}

/// Under `find_unused_parameters` a layer no rank uses stays bit-unchanged; without the option
/// the next forward names it.
pub fn unused(device: Device) {
    let (job, started) = start(device, "unused");
    let reference = unused_reference(device);
    let outputs = outputs(job, started, device, "unused");
    let results: Vec<UnusedOutcome> = outputs
        .iter()
        .enumerate()
        .map(|(rank, output)| UnusedOutcome {
            params: parsed("params", rank, output),
            has_grad: parsed("has-grad", rank, output),
        })
        .collect();
    check_unused(
        &label(device, "find_unused_parameters"),
        &results,
        &reference,
        tolerance(device),
    );
    let errors: Vec<Option<String>> = outputs
        .iter()
        .map(|output| {
            tagged_lines("unused-error", output)
                .next()
                .map(str::to_string)
        })
        .collect();
    check_unused_errors(&label(device, "without find_unused_parameters"), &errors);
}

/// Tiny buckets, rebuilt after the first step in the order each process saw its gradients
/// become ready: both processes must rebuild the same buckets (else their collectives would not
/// match), and training still matches the full batch.
pub fn rebuild(device: Device) {
    let (job, started) = start(device, "rebuild");
    let want = reference_on(device, Model::Cnn, REBUILD_STEPS, 1);
    let results: Vec<RebuildOutcome> = outputs(job, started, device, "rebuild")
        .iter()
        .enumerate()
        .map(|(rank, output)| RebuildOutcome {
            outcome: Outcome {
                first_grads: Vec::new(),
                final_params: parsed("final-params", rank, output),
            },
            layout: lists("rebuilt-bucket", output),
            launches: lists("launch-order", output)
                .into_iter()
                .map(|l| {
                    l.iter()
                        .map(|b| b.parse().expect("a bucket index"))
                        .collect()
                })
                .collect(),
        })
        .collect();
    check_rebuild(
        &label(device, "bucket rebuild"),
        &results,
        &want,
        tolerance(device),
    );
}

// ---- the ranks -----------------------------------------------------------------------------

/// In a rank process: runs `case` on `group` and prints its results; `Ok(false)` when `case`
/// is none of this module's.
pub fn run_case(case: &str, group: Arc<dyn ProcessGroup>) -> Result<bool, String> {
    let rank = group.rank();
    let device = group.comm_stream().device();
    match case {
        "mlp" | "cnn" | "sync-batch-norm" => {
            let (model, sync_bn) = match case {
                "mlp" => (Model::Mlp, false),
                "cnn" => (Model::Cnn, false),
                _ => (Model::CnnBatchNorm, true),
            };
            let (outcome, ddp) =
                train_ddp_with(model, rank, group, STEPS, small_buckets(), sync_bn);
            print_snapshot("first-grads", &outcome.first_grads);
            print_snapshot("final-params", &outcome.final_params);
            println!("buckets {:?}", ddp.bucket_layout());
        }
        "hooks" => {
            for (i, (hook, _)) in compression_hooks().into_iter().enumerate() {
                let grads = compression_rank(hook, rank, group.clone());
                print_snapshot(&format!("hook-{i}-grads"), &grads);
            }
        }
        "no-sync" => print_snapshot(
            "grads",
            &no_sync_rank(&label(device, "no_sync"), rank, group),
        ),
        "unused" => {
            let outcome = unused_rank(rank, group.clone());
            print_snapshot("params", &outcome.params);
            print_snapshot("has-grad", &outcome.has_grad);
            match unused_without_the_option_rank(rank, group) {
                Some(e) => println!("unused-error {}", e.replace('\n', " ")),
                None => println!("the forward after an unused parameter succeeded"),
            }
        }
        "rebuild" => {
            let result = rebuild_rank(rank, group);
            print_snapshot("final-params", &result.outcome.final_params);
            for (b, names) in result.layout.iter().enumerate() {
                println!("rebuilt-bucket {b} {}", names.join(","));
            }
            for (backward, order) in result.launches.iter().enumerate() {
                let order: Vec<String> = order.iter().map(|b| b.to_string()).collect();
                println!("launch-order {backward} {}", order.join(","));
            }
        }
        _ => return Ok(false),
    }
    Ok(true)
}
