//! DistributedDataParallel on CUDA with two real rank processes over the NCCL backend — the way
//! GPU training runs — checked by the suite that `cuda_ddp.rs` runs on the device-threads group
//! (`device_suite/`), split into what each rank does in its process and what the test checks
//! against one process on the full batch on the same device (`ddp_process_cases/`, which
//! `ddp_processes.rs` runs over TCP on the CPU): the Mlp and the Cnn after five steps,
//! SyncBatchNorm against BatchNorm on the full batch, the bf16 and f16 compression hooks,
//! `no_sync`, a parameter no rank uses under `find_unused_parameters`, and buckets rebuilt
//! identically by both processes. One test counts, in each rank process, the host
//! synchronisations inside backward (`device_suite/host_syncs.rs`): there must be none, NCCL's
//! watchdog and heartbeat threads included. Two last tests kill one rank (SIGKILL) or stop it (SIGSTOP)
//! during training: the other must fail within the NCCL group's failure timeout with an error
//! naming it, not hang.
//!
//! Both ranks run on `cuda:0` (see `Job::start_on_one_gpu` in `common/`). Without a GPU they
//! run on the CUDA emulator with its emulated NCCL (`cuda-emu/`), with the stream sanitizer on.
//! On a GPU without NCCL the tests print `skipped: NCCL not found (…)`; `TANDEM_REQUIRE_NCCL=1`
//! makes that a failure. On the emulator, whose NCCL is part of the emulator, a missing NCCL
//! fails. The tests run one at a time: each job's two ranks already keep a small machine busy,
//! and the failure tests measure how long the failure takes.

mod common;
mod ddp_common;
mod ddp_process_cases;
mod device_suite;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::WORKER_VAR;
use ddp_common::{tagged_lines, Model};
use ddp_process_cases::{announce, run_case, small_buckets, start, JOB_LIMIT};
use device_suite::host_syncs::{self, assert_no_host_sync_in_backward, count_backward, Meeting};
use tandem_autograd::TensorBackward;
use tandem_core::Device;
use tandem_dist::process_group::nccl;
use tandem_dist::{
    init_with_options, DistributedDataParallel, GroupConfig, InitOptions, LaunchEnv, NcclConfig,
    ProcessGroup,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_optim::Optimizer;

const GPU: Device = Device::Cuda(0);

/// How long the killed rank's peer may take to fail: the NCCL group's failure timeout.
const FAILURE_TIMEOUT: Duration = Duration::from_secs(10);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `None` (after printing why) when the tests do not run: no CUDA at all, or a GPU without
/// NCCL (a failure under `TANDEM_REQUIRE_NCCL=1`). Else the lock that runs them one at a time.
fn gpu_with_nccl() -> Option<MutexGuard<'static, ()>> {
    let target = tandem_test_support::select_cuda()?;
    if let Err(e) = nccl::version() {
        assert!(
            target != tandem_test_support::CudaTarget::Emulator,
            "the CUDA emulator's NCCL cannot be used: {e} (TANDEM_CUDA_LIBS={:?})",
            std::env::var_os("TANDEM_CUDA_LIBS").unwrap_or_default()
        );
        assert!(
            std::env::var("TANDEM_REQUIRE_NCCL").as_deref() != Ok("1"),
            "TANDEM_REQUIRE_NCCL=1 and this machine has a CUDA device, but NCCL cannot be used: \
             {e}. Put the folder of libnccl.so.2 (<site-packages>/nvidia/nccl/lib of the pip \
             package nvidia-nccl-cu13) in TANDEM_CUDA_LIBS"
        );
        println!("skipped: NCCL not found ({e})");
        return None;
    }
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()))
}

// ---- the tests -----------------------------------------------------------------------------

#[test]
fn ddp_over_nccl_processes_matches_one_process_on_the_full_batch_mlp() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::equivalence(GPU, "mlp", Model::Mlp);
}

#[test]
fn ddp_over_nccl_processes_matches_one_process_on_the_full_batch_cnn() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::equivalence(GPU, "cnn", Model::Cnn);
}

/// SyncBatchNorm's statistics all-reduced over NCCL: DDP with SyncBatchNorm equals one process
/// with plain BatchNorm on the full batch.
#[test]
fn ddp_with_sync_batch_norm_over_nccl_processes_matches_batch_norm_on_the_full_batch() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::equivalence(GPU, "sync-batch-norm", Model::CnnBatchNorm);
}

#[test]
fn ddp_compression_hooks_over_nccl_processes_agree_within_half_precision() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::compression(GPU);
}

#[test]
fn ddp_no_sync_over_nccl_processes_accumulates_locally_then_synchronises() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::no_sync(GPU);
}

#[test]
fn ddp_over_nccl_processes_leaves_a_parameter_no_rank_used_bit_unchanged() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::unused(GPU);
}

#[test]
fn ddp_over_nccl_processes_rebuilds_buckets_identically_and_still_matches() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    ddp_process_cases::rebuild(GPU);
}

/// DDP over NCCL never makes the host wait for the device inside backward (issue 21, item 4):
/// each rank process counts its own backwards with the emulator's counters, which are per
/// process and so see everything the process did meanwhile — this rank's backward, and the
/// NCCL group's watchdog and heartbeat threads — and nothing of the other rank's. Each rank
/// checks its counts ([`assert_no_host_sync_in_backward`]: no host synchronisation, collectives
/// launched, the read after backward synchronised) and prints `host-syncs counted`; a rank
/// that finds a host synchronisation fails with the counts. On a real GPU there are no
/// counters: the ranks say so and the test passes.
#[test]
fn ddp_backward_over_nccl_processes_never_makes_the_host_wait_for_the_device() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    let (job, started) = start(GPU, "host-syncs");
    for (rank, output) in ddp_process_cases::outputs(job, started, GPU, "host-syncs")
        .iter()
        .enumerate()
    {
        if tandem_test_support::on_emulator() {
            assert!(
                output.contains(&format!("host-syncs counted on rank {rank}")),
                "rank {rank} did not count its host synchronisations on the emulator:\n{output}"
            );
        }
        println!("---- rank {rank}\n{output}");
    }
}

/// SIGKILL one of two ranks during CUDA DDP training: the other fails within the failure
/// timeout with an error naming the dead rank.
#[test]
fn a_rank_killed_during_ddp_over_nccl_is_named_by_the_other_within_the_failure_timeout() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    let (mut job, _) = start(GPU, "kill");
    job.wait_for_all("ready", JOB_LIMIT);
    let killed_at = Instant::now();
    job.kill(1);
    let failed = job.wait_for(0, "worker error", FAILURE_TIMEOUT + Duration::from_secs(30));
    let took = killed_at.elapsed();
    let results = job.wait(Duration::from_secs(30));
    let (status, output) = &results[0];
    assert!(
        failed && !status.success(),
        "rank 0 did not fail {took:?} after rank 1 was killed:\n{output}"
    );
    let error = tagged_lines("worker error:", output)
        .next()
        .unwrap_or_default();
    println!("rank 0 failed {took:?} after rank 1 was killed: {error}");
    assert!(
        took < FAILURE_TIMEOUT,
        "rank 0 took {took:?} to fail, more than the failure timeout {FAILURE_TIMEOUT:?}:\n{output}"
    );
    assert!(
        error.contains("rank 1's process exited"),
        "rank 0's error does not name the killed rank 1:\n{output}"
    );
}

/// A rank that stops (SIGSTOP: alive, its connections open, but silent) during CUDA DDP
/// training: the other fails within the failure timeout, naming it, instead of waiting forever
/// in the collective the stopped rank never joins.
#[test]
fn a_rank_stopped_during_ddp_over_nccl_is_named_by_the_other_within_the_failure_timeout() {
    let Some(_gpu) = gpu_with_nccl() else { return };
    let (mut job, _) = start(GPU, "stop");
    assert!(
        job.wait_for(1, "stopping now", JOB_LIMIT),
        "rank 1 did not stop: {}",
        job.output(1)
    );
    let stopped_at = Instant::now();
    let failed = job.wait_for(0, "worker error", FAILURE_TIMEOUT + Duration::from_secs(30));
    let took = stopped_at.elapsed();
    job.kill(1);
    let results = job.wait(Duration::from_secs(30));
    let (status, output) = &results[0];
    assert!(
        failed && !status.success(),
        "rank 0 did not fail {took:?} after rank 1 stopped:\n{output}"
    );
    let error = tagged_lines("worker error:", output)
        .next()
        .unwrap_or_default();
    println!("rank 0 failed {took:?} after rank 1 stopped: {error}");
    assert!(
        took < FAILURE_TIMEOUT,
        "rank 0 took {took:?} to fail, more than the failure timeout {FAILURE_TIMEOUT:?}:\n{output}"
    );
    assert!(
        error.contains("no heartbeat from rank 1"),
        "rank 0's error does not name the stopped rank 1:\n{output}"
    );
}

// ---- the ranks -----------------------------------------------------------------------------

/// In a re-executed rank process: runs the mode and exits with its status.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER_VAR) else {
        return;
    };
    let code = match rank_main(&mode) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn rank_main(mode: &str) -> Result<(), String> {
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let options = InitOptions {
        device: GPU,
        group: GroupConfig {
            name: format!("cuda-ddp-nccl-{mode}"),
            timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(120),
            ..GroupConfig::default()
        },
        nccl: NcclConfig {
            failure_timeout: FAILURE_TIMEOUT,
            ..NcclConfig::default()
        },
        ..InitOptions::default()
    };
    let group = init_with_options(&env, options).map_err(|e| e.to_string())?;
    announce(group.as_ref());
    println!("NCCL {}", nccl::version().map_err(|e| e.to_string())?);
    if run_case(mode, group.clone())? {
        return Ok(());
    }
    let rank = group.rank();
    match mode {
        "host-syncs" => count_host_syncs(rank, group),
        "kill" => train_until_failure(rank, group, None),
        // Rank 1 stops in its seventh step, after its forward, with its peer in the step's
        // collectives.
        "stop" => train_until_failure(rank, group, (rank == 1).then_some(6)),
        other => Err(format!("unknown worker mode {other}")),
    }
}

/// Counts this process's host synchronisations inside DDP's backward of the Mlp and the Cnn
/// (several buckets each) and checks them; see the test.
fn count_host_syncs(rank: usize, group: Arc<dyn ProcessGroup>) -> Result<(), String> {
    let world = group.world_size();
    for model in [Model::Mlp, Model::Cnn] {
        let what = format!("DDP {model:?} over NCCL, rank {rank} of {world} processes on {GPU}");
        let counted = count_backward(
            model,
            rank,
            group.clone(),
            host_syncs::config(),
            host_syncs::STEPS,
            &Meeting::Process,
        );
        match counted {
            Some(steps) => assert_no_host_sync_in_backward(&what, &steps),
            None => {
                println!("skipped: {what}: the host synchronisations are counted by the emulator")
            }
        }
    }
    if tandem_test_support::on_emulator() {
        println!("host-syncs counted on rank {rank}");
    }
    Ok(())
}

/// DDP training of the Cnn on this rank's shards, reading the loss every step as a training
/// loop's progress line does, until a step fails (or, bounded, 10 000 steps pass). With
/// `stop_at`, the process stops itself (SIGSTOP) after that step's forward.
fn train_until_failure(
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    stop_at: Option<usize>,
) -> Result<(), String> {
    use ddp_common::{batch, sgd, shard};
    use device_suite::ddp::{build_on, on};
    let world = group.world_size();
    let ddp = DistributedDataParallel::new(build_on(Model::Cnn, 7, GPU), group, small_buckets())
        .map_err(|e| format!("DistributedDataParallel::new: {e}"))?;
    let mut optimizer = sgd(ddp.module().parameters());
    for step in 0..10_000 {
        let (x, y) = batch(Model::Cnn, step % 8);
        let (x, y) = (
            on(GPU, &shard(&x, rank, world)),
            on(GPU, &shard(&y, rank, world)),
        );
        let failed = |what: &str, e: String| format!("step {step}: {what}: {e}");
        optimizer
            .zero_grad()
            .map_err(|e| failed("zero_grad", e.to_string()))?;
        let out = ddp
            .forward(&x)
            .map_err(|e| failed("forward", e.to_string()))?;
        if stop_at == Some(step) {
            println!("stopping now");
            // SAFETY: raise(2) has no memory-safety preconditions; the process stops here
            // until the test kills it.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
        }
        let loss = cross_entropy(&out, &y, Reduction::Mean)
            .map_err(|e| failed("cross_entropy", e.to_string()))?;
        loss.backward()
            .map_err(|e| failed("backward", e.to_string()))?;
        optimizer.step().map_err(|e| failed("SGD", e.to_string()))?;
        let loss = loss
            .to_vec::<f32>()
            .map_err(|e| failed("reading the loss", e.to_string()))?;
        if step == 3 {
            println!("ready (loss {})", loss[0]);
        }
    }
    Err("10 000 steps passed without the peer's death being noticed".into())
}
