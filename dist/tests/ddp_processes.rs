//! DistributedDataParallel with ranks as real processes over TCP on loopback: after five SGD
//! steps every rank's parameters match one process trained on the full batch, for 2, 4 and 8
//! processes, with plain all-reduce buckets and with SyncBatchNorm; and, with 2 processes, the
//! cases of `ddp_process_cases/` that `cuda_ddp_nccl.rs` runs over NCCL: compression hooks,
//! `no_sync`, unused parameters and bucket rebuild.

mod common;
mod ddp_common;
mod ddp_process_cases;
mod device_suite;

use std::sync::Arc;
use std::time::Duration;

use common::{Job, WORKER_VAR};
use ddp_common::*;
use tandem_core::Device;
use tandem_dist::{init_process_group, DdpConfig, GroupConfig, LaunchEnv, ProcessGroup};

const STEPS: usize = 5;

/// In a re-executed worker process: trains and prints its final parameters.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER_VAR) else {
        return;
    };
    let code = match ddp_worker(&mode) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn model_of(mode: &str) -> Option<(Model, bool)> {
    match mode {
        "ddp-mlp" => Some((Model::Mlp, false)),
        "ddp-cnn-syncbn" => Some((Model::CnnBatchNorm, true)),
        _ => None,
    }
}

fn ddp_worker(mode: &str) -> Result<(), String> {
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let config = GroupConfig {
        timeout: Duration::from_secs(60),
        ..GroupConfig::default()
    };
    let group: Arc<dyn ProcessGroup> =
        Arc::new(init_process_group(&env, config).map_err(|e| e.to_string())?);
    let Some((model, sync_bn)) = model_of(mode) else {
        ddp_process_cases::announce(group.as_ref());
        if ddp_process_cases::run_case(mode, group)? {
            return Ok(());
        }
        return Err(format!("unknown worker mode {mode}"));
    };
    let rank = group.rank();
    let config = DdpConfig {
        bucket_cap_mb: 0.002,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let (outcome, ddp) = train_ddp(model, rank, group, STEPS, config, sync_bn);
    print_snapshot("param", &outcome.final_params);
    println!("buckets {}", ddp.bucket_layout().len());
    Ok(())
}

fn check(mode: &str, model: Model) {
    let want = reference(model, STEPS, 1);
    for world in [2, 4, 8] {
        let results = Job::start(world, mode).wait(Duration::from_secs(180));
        for (rank, (status, output)) in results.iter().enumerate() {
            assert!(
                status.success(),
                "{mode}, {world} processes: rank {rank} failed with {status}:\n{output}"
            );
            let got = parse_snapshot("param", output);
            assert_close(
                &format!("{mode}, {world} processes, rank {rank}"),
                &got,
                &want.final_params,
                1e-5,
            );
        }
    }
}

#[test]
fn ddp_over_tcp_processes_matches_single_process_full_batch() {
    check("ddp-mlp", Model::Mlp);
}

#[test]
fn ddp_with_sync_batch_norm_over_tcp_processes_matches_single_process_full_batch() {
    check("ddp-cnn-syncbn", Model::CnnBatchNorm);
}

#[test]
fn ddp_compression_hooks_over_tcp_processes_agree_within_half_precision() {
    ddp_process_cases::compression(Device::Cpu);
}

#[test]
fn ddp_no_sync_over_tcp_processes_accumulates_locally_then_synchronises() {
    ddp_process_cases::no_sync(Device::Cpu);
}

#[test]
fn ddp_over_tcp_processes_leaves_a_parameter_no_rank_used_bit_unchanged() {
    ddp_process_cases::unused(Device::Cpu);
}

#[test]
fn ddp_over_tcp_processes_rebuilds_buckets_identically_and_still_matches() {
    ddp_process_cases::rebuild(Device::Cpu);
}
