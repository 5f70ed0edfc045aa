//! GPU conformance of autocast's low-precision products on CUDA: `matmul`, `linear` and
//! `conv2d` with bf16 and f16 operands (cuBLAS `GemmEx` with f32 compute; cuDNN with
//! `CUDNN_DATA_BFLOAT16`/`HALF` tensors, an f32 compute type and tensor-op math; im2col through
//! f32 copies), forward and backward, and channels-last (NHWC) convolutions, against the CPU.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one
//! (`tandem_test_support::select_cuda`, stream sanitizer on there).
//!
//! **Reference.** The inputs are drawn in f32 and rounded to the low dtype; the reference is the
//! f32 CPU op on those rounded values (the CPU ops' own bf16/f16 path lands separately and
//! computes the same way: f32 arithmetic, one rounding). The GPU accumulates in f32 and rounds
//! once, so element `i` must lie within `u·|ref_i| + 2·k·2⁻²⁴·abs_i` of the reference, where
//! `u` is the low dtype's unit roundoff (2⁻⁸ for bf16, 2⁻¹¹ for f16), `k` the longest sum and
//! `abs_i` the same op on the absolute values (the bound of both f32 summation orders). A
//! convolution's bias is added after the convolution's own rounding, as cuDNN's callers do, so
//! its output allows `u·(|ref_i| + abs_i)`. An accumulation in the low dtype would exceed these
//! bounds by about `k` times.

mod common;

use common::GPU;

use std::sync::Mutex;

use tandem_autograd::{backward, BackwardOptions};
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::conv2d::{cudnn_cache_stats, set_cuda_conv_backend, CudaConvBackend};
use tandem_ops::{conv2d, linear, matmul, Conv2dParams};

/// Held by the tests that change conv2d's process-wide engine setting.
static SETTINGS: Mutex<()> = Mutex::new(());

const LOW: [DType; 2] = [DType::BF16, DType::F16];

/// Half the distance from 1 to the next value of `dtype`: the largest relative rounding error.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
        other => panic!("no unit roundoff for {other}"),
    }
}

/// The smallest positive subnormal of `dtype`, halved: the absolute rounding error near 0.
fn underflow(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-25),
        _ => 0.0,
    }
}

/// Normal values of `shape` on the CPU, rounded to `dtype`, as f32.
fn rounded(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

fn abs(t: &Tensor) -> Tensor {
    let v: Vec<f32> = t
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(Device::Cpu)
        .unwrap()
        .contiguous_detached()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::abs)
        .collect();
    Tensor::from_vec(v, t.dims(), Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .to_device(Device::Cpu)
        .unwrap()
        .contiguous_detached()
        .unwrap()
        .to_vec::<f64>()
        .unwrap()
}

/// The output and the gradients of every input of `f` at `inputs`, for the output gradient `g`.
fn run(f: &dyn Fn(&[Tensor]) -> Tensor, inputs: &[Tensor], g: &Tensor) -> (Tensor, Vec<Tensor>) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.copy_detached().unwrap().with_requires_grad().unwrap())
        .collect();
    let y = f(&leaves);
    backward(&y, Some(g), &BackwardOptions::default()).unwrap();
    let grads = leaves
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.grad()
                .unwrap_or_else(|| panic!("no gradient for input {i}"))
        })
        .collect();
    (y.detach(), grads)
}

/// Asserts that `got` (any device) has `want`'s shape, the dtype `dtype` and every element
/// within `u·(|want| + extra·abs) + 2·k·2⁻²⁴·abs` of `want` (see the module doc).
fn assert_bounded(got: &Tensor, want: &Tensor, abs: &Tensor, k: usize, extra: f64, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let dtype = got.dtype();
    let u = unit_roundoff(dtype);
    let (g, w, a) = (values(got), values(want), values(abs));
    let mut outside = Vec::new();
    for i in 0..w.len() {
        let f32_sums = 2.0 * k as f64 * 2f64.powi(-24) * a[i];
        let bound = u * (w[i].abs() + extra * a[i] + f32_sums) + f32_sums + underflow(dtype);
        // NaN differences fall outside too.
        let inside = (g[i] - w[i]).abs() <= bound;
        if !inside {
            outside.push(format!("[{i}] {} vs {} (bound {bound:e})", g[i], w[i]));
        }
    }
    assert!(
        outside.is_empty(),
        "{what} ({dtype}): {} of {} elements outside the bound, first: {:?}",
        outside.len(),
        w.len(),
        &outside[..outside.len().min(5)]
    );
}

/// Runs `f` on the CPU in f32 (signed and absolute values) and on the GPU in `dtype` from the
/// same rounded inputs, and compares the output and every gradient; `k` is the longest sum,
/// `extra` the output's allowance for a second rounding (see the module doc). Returns the GPU
/// output and gradients.
fn compare(
    f: &dyn Fn(&[Tensor]) -> Tensor,
    shapes: &[&[usize]],
    out_shape: &[usize],
    dtype: DType,
    k: usize,
    extra: f64,
    what: &str,
) -> (Tensor, Vec<Tensor>) {
    let inputs: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| rounded(s, dtype, 10 + i as u64))
        .collect();
    let g = rounded(out_shape, dtype, 99);
    let (want, want_grads) = run(f, &inputs, &g);
    let abs_inputs: Vec<Tensor> = inputs.iter().map(abs).collect();
    let (abs_out, abs_grads) = run(f, &abs_inputs, &abs(&g));
    let on_gpu = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
    let gpu_inputs: Vec<Tensor> = inputs.iter().map(on_gpu).collect();
    let (got, got_grads) = run(f, &gpu_inputs, &on_gpu(&g));
    assert_eq!(got.dtype(), dtype, "{what}: output dtype");
    assert_bounded(&got, &want, &abs_out, k, extra, &format!("{what}: output"));
    for (i, (gg, wg)) in got_grads.iter().zip(&want_grads).enumerate() {
        assert_eq!(gg.dtype(), dtype, "{what}: gradient {i} dtype");
        let what = format!("{what}: gradient of input {i}");
        assert_bounded(gg, wg, &abs_grads[i], k, 0.0, &what);
    }
    (got, got_grads)
}

/// (a's shape, b's shape, the output's shape, whether b is used transposed).
type MatmulCase = (&'static [usize], &'static [usize], &'static [usize], bool);

#[test]
fn low_precision_matmul_matches_the_f32_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // (a, b, output): a plain product, a batch times a shared matrix (its gradient sums over
    // the batch), a batched product with a transposed right operand, a vector.
    let cases: [MatmulCase; 4] = [
        (&[5, 7], &[7, 4], &[5, 4], false),
        (&[3, 5, 7], &[7, 4], &[3, 5, 4], false),
        (&[2, 3, 6], &[2, 5, 6], &[2, 3, 5], true),
        (&[7], &[7, 3], &[3], false),
    ];
    for dtype in LOW {
        for (a, b, out, transpose_b) in cases {
            let f = move |t: &[Tensor]| {
                let b = if transpose_b {
                    tandem_ops::transpose(&t[1], -1, -2).unwrap()
                } else {
                    t[1].clone()
                };
                matmul(&t[0], &b).unwrap()
            };
            let what = format!("matmul {a:?}·{b:?}{}", if transpose_b { "ᵀ" } else { "" });
            compare(&f, &[a, b], out, dtype, 64, 0.0, &what);
        }
    }
}

#[test]
fn low_precision_linear_with_bias_matches_the_f32_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in LOW {
        let f = |t: &[Tensor]| linear(&t[0], &t[1], Some(&t[2])).unwrap();
        compare(
            &f,
            &[&[2, 3, 6], &[5, 6], &[5]],
            &[2, 3, 5],
            dtype,
            16,
            0.0,
            "linear [2, 3, 6]·[5, 6]ᵀ + [5]",
        );
    }
}

fn conv_params() -> Conv2dParams {
    Conv2dParams {
        stride: (1, 2),
        padding: (1, 1),
        ..Default::default()
    }
}

#[test]
fn low_precision_conv2d_matches_the_f32_cpu_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let _guard = SETTINGS.lock().unwrap_or_else(|p| p.into_inner());
    let p = conv_params();
    for backend in [CudaConvBackend::Cudnn, CudaConvBackend::Im2col] {
        set_cuda_conv_backend(backend);
        for dtype in LOW {
            let f = |t: &[Tensor]| conv2d(&t[0], &t[1], Some(&t[2]), &p).unwrap();
            compare(
                &f,
                &[&[2, 3, 7, 6], &[4, 3, 3, 3], &[4]],
                &[2, 4, 7, 3],
                dtype,
                64,
                1.0,
                &format!("conv2d {backend:?}"),
            );
        }
    }
    set_cuda_conv_backend(CudaConvBackend::Cudnn);
}

/// `t` (NCHW values on the CPU) as a channels-last `dtype` tensor on the GPU: an
/// `[N, C, H, W]` view of an `[N, H, W, C]` buffer.
fn channels_last(t: &Tensor, dtype: DType) -> Tensor {
    let nhwc = tandem_ops::permute(&t.to_dtype(DType::F32).unwrap(), &[0, 2, 3, 1])
        .unwrap()
        .contiguous_detached()
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let view = tandem_ops::permute(&nhwc, &[0, 3, 1, 2]).unwrap();
    assert!(is_channels_last(&view), "test setup");
    view.detach()
}

fn is_channels_last(t: &Tensor) -> bool {
    let d = t.dims();
    t.layout().strides().as_slice() == [d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]]
}

#[test]
fn channels_last_conv2d_gives_channels_last_results_equal_to_nchw() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let _guard = SETTINGS.lock().unwrap_or_else(|p| p.into_inner());
    set_cuda_conv_backend(CudaConvBackend::Cudnn);
    let p = conv_params();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = rounded(&[2, 3, 7, 6], dtype, 1);
        let w = rounded(&[4, 3, 3, 3], dtype, 2);
        let b = rounded(&[4], dtype, 3);
        let gy = rounded(&[2, 4, 7, 3], dtype, 4);
        let leaf = |t: Tensor| t.to_dtype(dtype).unwrap().with_requires_grad().unwrap();
        // NCHW on the GPU.
        let gpu = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
        let (xn, wn, bn) = (leaf(gpu(&x)), leaf(gpu(&w)), leaf(gpu(&b)));
        let yn = conv2d(&xn, &wn, Some(&bn), &p).unwrap();
        backward(&yn, Some(&gpu(&gy)), &BackwardOptions::default()).unwrap();
        // NHWC input, NCHW weight; the output gradient channels last too.
        let declined = cudnn_cache_stats(GPU).map_or(0, |s| s.declined_calls);
        let xl = channels_last(&x, dtype).with_requires_grad().unwrap();
        let (wl, bl) = (leaf(gpu(&w)), leaf(gpu(&b)));
        let yl = conv2d(&xl, &wl, Some(&bl), &p).unwrap();
        assert!(
            is_channels_last(&yl),
            "{dtype}: output strides {:?}",
            yl.layout().strides()
        );
        let gyl = channels_last(&gy, dtype);
        backward(&yl, Some(&gyl), &BackwardOptions::default()).unwrap();
        // The op returns a channels-last input gradient, but the autograd engine stores a leaf's
        // first gradient as an owned contiguous copy (autograd/src/engine.rs), so only the
        // values are compared here.
        let (dx, dw) = (xl.grad().unwrap(), wl.grad().unwrap());
        if let Some(stats) = cudnn_cache_stats(GPU) {
            assert_eq!(
                stats.declined_calls, declined,
                "{dtype}: cuDNN declined an NHWC pass"
            );
        }
        // Same sums in another memory order: equal to a few roundings of the low dtype.
        let tol = 4.0 * unit_roundoff(dtype) + 1e-5;
        for (got, want, what) in [
            (&yl, &yn, "output"),
            (&dx, &xn.grad().unwrap(), "input gradient"),
            (&dw, &wn.grad().unwrap(), "weight gradient"),
            (&bl.grad().unwrap(), &bn.grad().unwrap(), "bias gradient"),
        ] {
            assert_eq!(got.dtype(), dtype);
            let (g, w) = (values(got), values(want));
            let scale = w.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (a - b).abs() <= tol * scale,
                    "{dtype} {what}[{i}]: NHWC {a}, NCHW {b}"
                );
            }
        }
    }
}

#[test]
fn channels_last_conv2d_falls_back_to_im2col_with_channels_last_results() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let _guard = SETTINGS.lock().unwrap_or_else(|p| p.into_inner());
    set_cuda_conv_backend(CudaConvBackend::Im2col);
    let p = conv_params();
    for dtype in [DType::F32, DType::BF16] {
        let x = rounded(&[2, 3, 7, 6], dtype, 5);
        let w = rounded(&[4, 3, 3, 3], dtype, 6);
        let want = conv2d(&x, &w, None, &p).unwrap();
        let abs_out = conv2d(&abs(&x), &abs(&w), None, &p).unwrap();
        let wg = w.to_dtype(dtype).unwrap().to_device(GPU).unwrap();
        let got = conv2d(&channels_last(&x, dtype), &wg, None, &p).unwrap();
        assert!(
            is_channels_last(&got),
            "{dtype}: im2col output strides {:?}",
            got.layout().strides()
        );
        let what = format!("im2col channels-last conv2d {dtype}");
        assert_bounded(&got, &want, &abs_out, 64, 0.0, &what);
    }
    set_cuda_conv_backend(CudaConvBackend::Cudnn);
}
