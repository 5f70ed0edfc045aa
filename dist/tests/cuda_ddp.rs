//! GPU conformance of DistributedDataParallel on `cuda:0`, with the ranks as threads of this
//! process sharing the device through a [`tandem_dist::DeviceThreadGroup`] (issue 15, item 7:
//! the multi-rank paths on a machine with one GPU). The suite is `device_suite/ddp.rs`, the same
//! one `suites_cpu.rs` runs on the CPU process groups in every test run: N = 1, 2, 4 and 8 ranks
//! with B/N samples each against one process with the full batch B on the same GPU (which is
//! itself first checked against the CPU, so that an op's kernel that is off is reported as
//! such), plus SyncBatchNorm, no_sync, unused parameters, bucket rebuild, compression hooks,
//! gradients as views into device buckets, and event-based telemetry. Every test runs on the
//! CUDA emulator without a GPU.

mod ddp_common;
mod device_suite;

use ddp_common::Model;
use device_suite::{ddp, ddp_unused, Backend, WORLDS};
use tandem_core::Device;

const BACKEND: Backend = Backend::DeviceThreads(Device::Cuda(0));

/// Mlp equivalence, N = 1, 2, 4, 8.
#[test]
fn ddp_on_the_device_group_matches_one_process_on_the_full_batch_mlp() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::equivalence(BACKEND, Model::Mlp, &WORLDS);
}

/// Cnn equivalence, N = 1, 2, 4, 8.
#[test]
fn ddp_on_the_device_group_matches_one_process_on_the_full_batch_cnn() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::equivalence(BACKEND, Model::Cnn, &WORLDS);
}

/// SyncBatchNorm (per-channel statistics all-reduced on the device) equivalence, N = 1, 2, 4, 8.
#[test]
fn ddp_with_sync_batch_norm_on_the_device_group_matches_batch_norm_on_the_full_batch() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::sync_batch_norm_matches_the_full_batch(BACKEND, &WORLDS);
}

#[test]
fn ddp_with_plain_batch_norm_on_the_device_group_matches_a_reference_normalising_each_chunk_apart()
{
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::plain_batch_norm_matches_the_chunked_reference(BACKEND);
}

#[test]
fn ddp_sum_on_the_device_group_is_world_size_times_mean() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::sum_is_world_size_times_mean(BACKEND);
}

#[test]
fn ddp_no_sync_on_the_device_group_accumulates_locally_and_launches_nothing() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::no_sync_accumulates_locally(BACKEND);
}

/// Bf16 and f16 casts on the comm stream.
#[test]
fn ddp_compression_hooks_on_the_device_group_agree_within_half_precision() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::compression_hooks_agree_within_half_precision(BACKEND);
}

#[test]
fn ddp_on_the_device_group_rebuilds_buckets_identically_and_still_matches() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::buckets_rebuild_identically_and_training_still_matches(BACKEND);
}

#[test]
fn ddp_gradients_on_the_device_group_are_views_into_device_buckets() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::gradients_are_views_into_device_buckets(BACKEND);
}

/// Find_unused_parameters; without it the next forward names the parameter.
#[test]
fn ddp_on_the_device_group_leaves_a_parameter_no_rank_used_bit_unchanged() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp_unused::an_unused_parameter_is_left_untouched(BACKEND);
}

#[test]
fn ddp_telemetry_on_the_device_group_times_every_bucket_from_device_events() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    ddp::telemetry_times_every_bucket(BACKEND);
}
