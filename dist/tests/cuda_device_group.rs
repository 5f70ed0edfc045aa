//! GPU conformance of the device-threads process group on `cuda:0`: every collective, reduce
//! op and dtype (f32, f64, f16, bf16, i64, u8; hard values first) on 1, 2, 3, 4 and 8 ranks
//! against the threads backend on the same inputs, bit for bit; collectives in flight complete
//! in issue order; mismatched collectives and a dropped rank are named; CPU tensors still work
//! and a rank on the CPU beside a rank on the GPU is named; and issuing a collective never waits
//! for the device (the compute stream held by a host function). The suite is
//! `device_suite/collectives.rs`, which `suites_cpu.rs` runs on the CPU group in every test
//! run. Every test runs on the CUDA emulator without a GPU.

mod ddp_common;
mod device_suite;

use device_suite::collectives;
use tandem_core::Device;

const GPU: Device = Device::Cuda(0);

#[test]
fn device_group_collectives_on_the_gpu_match_the_threads_backend_bit_for_bit() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::every_collective_matches_the_cpu_backend_bit_for_bit(GPU);
}

#[test]
fn device_group_collectives_in_flight_on_the_gpu_complete_in_issue_order() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::collectives_in_flight_complete_in_issue_order(GPU);
}

#[test]
fn device_group_mismatched_collectives_on_the_gpu_are_named_and_break_the_group() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::mismatched_collectives_are_named_and_break_the_group(GPU);
}

#[test]
fn device_group_on_the_gpu_names_a_dropped_rank() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::a_dropped_rank_is_named(GPU);
}

#[test]
fn device_group_on_the_gpu_reduces_cpu_tensors_and_names_mixed_placements() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::cpu_tensors_work_and_mixed_placements_are_named(GPU);
}

#[test]
fn device_group_issues_a_collective_without_waiting_for_a_held_compute_stream() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    collectives::issuing_does_not_wait_for_the_device(GPU);
}
