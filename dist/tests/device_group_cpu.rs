//! The device-threads group's suites on the CPU: DDP against one process on the full batch, and
//! every collective against the threads backend. A CPU group runs collectives on the calling
//! thread, so this checks the group's host path under DDP, and the suites themselves, in every
//! test run; `cuda_ddp.rs` and `cuda_device_group.rs` run the same suites on a GPU.

mod ddp_common;
mod device_suite;

use ddp_common::Model;
use device_suite::{collectives, ddp};
use tandem_core::Device;

const CPU: Device = Device::Cpu;

#[test]
fn ddp_on_a_device_group_matches_one_process_mlp() {
    ddp::equivalence(CPU, Model::Mlp, &[1, 2, 4, 8]);
}

#[test]
fn ddp_on_a_device_group_matches_one_process_cnn() {
    ddp::equivalence(CPU, Model::Cnn, &[1, 2, 4, 8]);
}

#[test]
fn ddp_on_a_device_group_with_plain_batch_norm_matches_the_chunked_reference() {
    ddp::plain_batch_norm_matches_the_chunked_reference(CPU);
}

#[test]
fn ddp_on_a_device_group_sum_is_world_times_mean() {
    ddp::sum_is_world_size_times_mean(CPU);
}

#[test]
fn ddp_on_a_device_group_no_sync_accumulates() {
    ddp::no_sync_accumulates_locally(CPU);
}

#[test]
fn ddp_on_a_device_group_compression_hooks() {
    ddp::compression_hooks_agree_within_half_precision(CPU);
}

#[test]
fn ddp_on_a_device_group_rebuilds_buckets() {
    ddp::buckets_rebuild_identically_and_training_still_matches(CPU);
}

#[test]
fn ddp_on_a_device_group_keeps_gradients_as_bucket_views() {
    ddp::gradients_are_views_into_device_buckets(CPU);
}

#[test]
fn ddp_on_a_device_group_leaves_an_unused_parameter_untouched() {
    ddp::an_unused_parameter_is_left_untouched(CPU);
}

#[test]
fn ddp_on_a_device_group_times_every_bucket() {
    ddp::telemetry_times_every_bucket(CPU);
}

#[test]
fn device_group_collectives_match_the_threads_backend() {
    collectives::every_collective_matches_the_cpu_backend_bit_for_bit(CPU);
}

#[test]
fn device_group_collectives_in_flight_complete_in_order() {
    collectives::collectives_in_flight_complete_in_issue_order(CPU);
}

#[test]
fn device_group_mismatches_are_named() {
    collectives::mismatched_collectives_are_named_and_break_the_group(CPU);
}

#[test]
fn device_group_dropped_rank_is_named() {
    collectives::a_dropped_rank_is_named(CPU);
}

#[test]
fn device_group_cpu_tensors() {
    collectives::cpu_tensors_work_and_mixed_placements_are_named(CPU);
}
