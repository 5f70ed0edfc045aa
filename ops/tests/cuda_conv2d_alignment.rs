//! GPU check of conv2d's cuDNN plan cache on misaligned buffers: an input that starts inside an
//! allocation (a view one element in, as an offset `narrow` of a batch gives) after the same
//! geometry ran on aligned buffers. The plan cache keys on the buffers' alignment, so the view
//! gets its own plan instead of replaying an algorithm chosen for aligned memory (which cuDNN may
//! refuse with NOT_SUPPORTED); a refusal that still happens makes a fresh choice, then im2col.
//! Results must match the CPU either way.
//!
//! Runs on the GPU, or on the CUDA emulator (whose cuDNN refuses some algorithms on buffers that
//! are not 16-byte aligned, as cuDNN does), and prints `skipped: …` where cuDNN does not load. In
//! its own
//! test binary, so the process-wide conv2d settings it changes touch no other test.

use tandem_autograd::{backward, BackwardOptions};
use tandem_core::cuda::blas::set_allow_tf32_conv;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::conv2d::{
    cudnn_available, cudnn_cache_stats, set_cuda_conv_backend, set_cudnn_algorithm_search,
    CudaConvBackend, CudnnAlgorithmSearch,
};
use tandem_ops::{conv2d, Conv2dParams};

const GPU: Device = Device::Cuda(0);

/// `[N, C, H, W]` values starting `offset` elements into a flat allocation (on `device`).
fn batch_at(values: &Tensor, offset: usize, dims: [usize; 4], device: Device) -> Tensor {
    // A fresh allocation per call (`to_device` to the CPU would share `values`).
    let flat = values.copy_detached().unwrap().to_device(device).unwrap();
    let numel: usize = dims.iter().product();
    let layout = flat
        .layout()
        .narrow("test", 0, offset, numel)
        .unwrap()
        .reshape(&dims)
        .expect("a narrowed flat tensor reshapes");
    let view = flat.view_detached(layout).unwrap();
    assert!(view.is_contiguous(), "test setup: a dense view");
    view.with_requires_grad().unwrap()
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    assert_eq!(g.len(), w.len(), "{what}: sizes");
    let scale = w.iter().fold(0.0f64, |m, v| m.max(v.abs())) + 1.0;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        // f32 with TF32 off: rounding of the dtype (as in cuda_conv2d.rs).
        let allowed = 2e-4 * b.abs() + 5e-5 * scale;
        assert!(
            (a - b).abs() <= allowed,
            "{what}: element {i} is {a:e} on CUDA, {b:e} on the CPU"
        );
    }
}

/// Forward and backward at element `offset` of the input allocation, on the GPU and the CPU.
fn run_at(offset: usize, values: &Tensor, w: &Tensor, gy_seed: u64, what: &str) {
    let dims = [8, 16, 12, 12];
    let p = Conv2dParams {
        stride: (1, 1),
        padding: (1, 1),
        dilation: (1, 1),
    };
    let (xc, xg) = (
        batch_at(values, offset, dims, Device::Cpu),
        batch_at(values, offset, dims, GPU),
    );
    let wc = w.copy_detached().unwrap().with_requires_grad().unwrap();
    let wg = w
        .copy_detached()
        .unwrap()
        .to_device(GPU)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let yc = conv2d(&xc, &wc, None, &p).unwrap();
    let yg = conv2d(&xg, &wg, None, &p).unwrap_or_else(|e| panic!("{what}: forward: {e}"));
    assert_close(&yg, &yc, &format!("{what}: output"));
    let gy = randn(yc.dims(), gy_seed);
    backward(&yc, Some(&gy), &BackwardOptions::default()).unwrap();
    backward(
        &yg,
        Some(&gy.to_device(GPU).unwrap()),
        &BackwardOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{what}: backward: {e}"));
    assert_close(
        &xg.grad().unwrap(),
        &xc.grad().unwrap(),
        &format!("{what}: input gradient"),
    );
    assert_close(
        &wg.grad().unwrap(),
        &wc.grad().unwrap(),
        &format!("{what}: weight gradient"),
    );
}

#[test]
fn a_misaligned_view_after_aligned_calls_gets_its_own_plan_and_matches_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    if !cudnn_available(GPU) {
        println!("skipped: cuDNN does not load on this machine");
        return;
    }
    set_cuda_conv_backend(CudaConvBackend::Cudnn);
    set_allow_tf32_conv(false);
    let numel = 8 * 16 * 12 * 12;
    // One element more than a batch, so the batch can start at element 0 or 1.
    let values = randn(&[numel + 1], 1);
    let w = randn(&[32, 16, 3, 3], 2);
    for search in [
        CudnnAlgorithmSearch::Heuristic,
        CudnnAlgorithmSearch::Measured,
    ] {
        set_cudnn_algorithm_search(search);
        run_at(0, &values, &w, 3, &format!("{search:?}, aligned"));
        let aligned = cudnn_cache_stats(GPU).expect("cuDNN ran on this thread");
        // One float in: 4-byte aligned, where the aligned plan's algorithm may need 16.
        run_at(
            1,
            &values,
            &w,
            4,
            &format!("{search:?}, 4-byte aligned view"),
        );
        let misaligned = cudnn_cache_stats(GPU).unwrap();
        assert!(
            misaligned.plans > aligned.plans,
            "{search:?}: the misaligned input reused the aligned plan: {aligned:?} then \
             {misaligned:?}"
        );
        println!("{search:?}: {aligned:?} then {misaligned:?}");
        // The same offsets again find their plans: no new choice.
        run_at(1, &values, &w, 5, &format!("{search:?}, the view again"));
        let again = cudnn_cache_stats(GPU).unwrap();
        assert_eq!(again.plans, misaligned.plans, "{again:?}");
        assert_eq!(again.searches, misaligned.searches, "{again:?}");
    }
    set_cudnn_algorithm_search(CudnnAlgorithmSearch::Measured);
    set_allow_tf32_conv(true);
}
