//! GPU conformance of the f16 and bf16 paths of every float op other than the autocast ops
//! (matmul, linear, conv2d): each op on a CUDA device, forward and backward, against the f32
//! op on the same device on the rounded inputs, within one rounding of the half format (the
//! derivation is in `common/half.rs`); mixed-dtype promotion; batch norm with a half input and
//! f32 parameters and running statistics. Small inputs: the emulator runs every kernel on the
//! host.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).

mod common;

use common::{half, GPU};
use tandem_core::DType;

const DTYPES: [DType; 2] = [DType::BF16, DType::F16];

#[test]
fn elementwise_ops_on_cuda_compute_in_f32_and_round_once() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        half::unary_ops(GPU, dtype);
        half::binary_ops(GPU, dtype);
        half::promotion(GPU, dtype);
        half::data_movement(GPU, dtype);
    }
}

#[test]
fn reductions_losses_and_pools_on_cuda_compute_in_f32() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        half::reductions(GPU, dtype);
        half::long_sum(GPU, dtype, 1 << 12);
        half::losses(GPU, dtype);
        half::pools(GPU, dtype);
    }
}

#[test]
fn batch_norm_on_cuda_takes_a_half_input_with_f32_parameters() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        half::batch_norms(GPU, dtype);
    }
}
