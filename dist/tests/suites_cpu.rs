//! The suites of `device_suite/` on the CPU, in every test run: the DDP suite on both CPU
//! process groups whose ranks are threads (the threads backend, and the device-threads group on
//! the CPU, whose collectives run on the calling thread), and the device-threads group's
//! collectives against the threads backend. This checks the suites themselves and the group's
//! host path; `cuda_ddp.rs` and `cuda_device_group.rs` run the same suites on a GPU.

mod ddp_common;
mod device_suite;

use device_suite::{collectives, ddp, ddp_unused, Backend, WORLDS};
use tandem_core::Device;

/// The DDP suite's tests on one backend, in a module of their own.
macro_rules! ddp_suite_on {
    ($module:ident, $backend:expr) => {
        mod $module {
            use super::*;
            use ddp_common::Model;

            const BACKEND: Backend = $backend;

            #[test]
            fn ddp_matches_one_process_on_the_full_batch_mlp() {
                ddp::equivalence(BACKEND, Model::Mlp, &WORLDS);
            }

            #[test]
            fn ddp_matches_one_process_on_the_full_batch_cnn() {
                ddp::equivalence(BACKEND, Model::Cnn, &WORLDS);
            }

            #[test]
            fn ddp_with_sync_batch_norm_matches_one_process_with_batch_norm_on_the_full_batch() {
                ddp::sync_batch_norm_matches_the_full_batch(BACKEND, &WORLDS);
            }

            #[test]
            fn ddp_with_plain_batch_norm_matches_a_reference_normalising_each_chunk_apart() {
                ddp::plain_batch_norm_matches_the_chunked_reference(BACKEND);
            }

            #[test]
            fn ddp_sum_is_world_size_times_mean() {
                ddp::sum_is_world_size_times_mean(BACKEND);
            }

            #[test]
            fn ddp_no_sync_accumulates_locally_and_launches_nothing() {
                ddp::no_sync_accumulates_locally(BACKEND);
            }

            #[test]
            fn ddp_compression_hooks_agree_within_half_precision() {
                ddp::compression_hooks_agree_within_half_precision(BACKEND);
            }

            #[test]
            fn ddp_rebuilds_buckets_identically_and_still_matches() {
                ddp::buckets_rebuild_identically_and_training_still_matches(BACKEND);
            }

            #[test]
            fn ddp_gradients_are_views_into_their_buckets() {
                ddp::gradients_are_views_into_device_buckets(BACKEND);
            }

            #[test]
            fn ddp_leaves_a_parameter_no_rank_used_bit_unchanged() {
                ddp_unused::an_unused_parameter_is_left_untouched(BACKEND);
            }

            #[test]
            fn ddp_telemetry_times_every_bucket() {
                ddp::telemetry_times_every_bucket(BACKEND);
            }
        }
    };
}

ddp_suite_on!(threads_backend, Backend::Threads);
ddp_suite_on!(device_threads_on_cpu, Backend::DeviceThreads(Device::Cpu));

const CPU: Device = Device::Cpu;

#[test]
fn device_group_collectives_match_the_threads_backend_bit_for_bit() {
    collectives::every_collective_matches_the_cpu_backend_bit_for_bit(CPU);
}

#[test]
fn device_group_collectives_in_flight_complete_in_issue_order() {
    collectives::collectives_in_flight_complete_in_issue_order(CPU);
}

#[test]
fn device_group_mismatched_collectives_are_named_and_break_the_group() {
    collectives::mismatched_collectives_are_named_and_break_the_group(CPU);
}

#[test]
fn device_group_names_a_dropped_rank() {
    collectives::a_dropped_rank_is_named(CPU);
}

#[test]
fn device_group_reduces_cpu_tensors() {
    collectives::cpu_tensors_work_and_mixed_placements_are_named(CPU);
}
