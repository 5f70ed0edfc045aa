//! GPU conformance of `conv2d`: the CUDA op against the CPU op on the same inputs, forward and
//! backward (input, weight and bias gradients), on both CUDA engines — cuDNN (the default) and
//! im2col + cuBLAS (the fallback, forced with `set_cuda_conv_backend`) — for the geometries the
//! example models use (LeNet's 5×5, ResNet's 3×3 with padding, the stride-2 3×3 and 1×1
//! downsampling layers, ResNet-50's 7×7 stride-2 stem, at 224×224 with batch 1 as well) and
//! awkward ones (odd sizes, uneven strides and padding, dilation, a kernel as large as the
//! input, a batch the fallback must split into chunks); strided inputs and output gradients;
//! f64 gradcheck on the GPU; only the requested gradients; empty batches; cuDNN's plan cache;
//! heuristic algorithm choice; TF32; and bad arguments, which must give the CPU's errors.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! Where cuDNN does not load, the cuDNN arm runs im2col (conv2d prints a notice) and the tests
//! say so. The engine, TF32 and algorithm-search settings are process-wide, so every test holds
//! one lock while it sets and uses them.
//!
//! Tolerances: f32 with TF32 off (`set_allow_tf32_conv(false)`) must agree with the CPU to f32
//! rounding (`2e-4·|cpu| + 5e-5·scale`, `scale` the largest magnitude of the compared tensor
//! plus one: summation order and algorithms differ, e.g. Winograd on the CPU, implicit GEMM or
//! FFT in cuDNN); f64 to `1e-10·|cpu| + 1e-12·scale`; f32 with TF32 on (the default) to TF32
//! rounding, `3e-3·scale`. A failure names the geometry, engine, dtype, tensor, element (as
//! coordinates) and both values.

mod common;

use common::GPU;

use std::sync::Mutex;

use tandem_autograd::{backward, gradcheck, BackwardOptions, GradcheckOptions};
use tandem_core::cuda::blas::{allow_tf32_conv, set_allow_tf32_conv};
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::conv2d::{
    cuda_conv_backend, cudnn_available, cudnn_cache_stats, set_cuda_conv_backend,
    set_cudnn_algorithm_search, CudaConvBackend, CudnnAlgorithmSearch,
};
use tandem_ops::{conv2d, Conv2dParams};

/// Held by every test while it sets and uses the process-wide settings.
static SETTINGS: Mutex<()> = Mutex::new(());

/// Runs `f` with conv2d's engine, TF32 and search settings as given, then restores the
/// defaults (cuDNN, TF32 on, measured search).
fn with_settings<R>(
    backend: CudaConvBackend,
    tf32: bool,
    search: CudnnAlgorithmSearch,
    f: impl FnOnce() -> R,
) -> R {
    let _guard = SETTINGS.lock().unwrap_or_else(|p| p.into_inner());
    set_cuda_conv_backend(backend);
    set_allow_tf32_conv(tf32);
    set_cudnn_algorithm_search(search);
    let result = f();
    set_cuda_conv_backend(CudaConvBackend::Cudnn);
    set_allow_tf32_conv(true);
    set_cudnn_algorithm_search(CudnnAlgorithmSearch::Measured);
    result
}

const BACKENDS: [CudaConvBackend; 2] = [CudaConvBackend::Cudnn, CudaConvBackend::Im2col];

/// The engine's name in messages, saying when the cuDNN arm in fact runs im2col.
fn engine(backend: CudaConvBackend) -> String {
    match backend {
        CudaConvBackend::Im2col => "im2col + cuBLAS (forced)".into(),
        CudaConvBackend::Cudnn if cudnn_available(GPU) => "cuDNN".into(),
        CudaConvBackend::Cudnn => "cuDNN arm, but cuDNN does not load: im2col + cuBLAS".into(),
    }
}

/// One geometry: input `[N, C, H, W]`, weight `[O, C, kh, kw]`, parameters, and whether a bias
/// is added.
#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    p: Conv2dParams,
    bias: bool,
}

fn case(
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    (stride, padding, dilation): ((usize, usize), (usize, usize), (usize, usize)),
    bias: bool,
) -> Case {
    Case {
        name,
        x,
        w,
        p: Conv2dParams {
            stride,
            padding,
            dilation,
        },
        bias,
    }
}

const PLAIN: ((usize, usize), (usize, usize), (usize, usize)) = ((1, 1), (0, 0), (1, 1));

fn cases() -> Vec<Case> {
    vec![
        case("LeNet 5x5", [16, 1, 28, 28], [6, 1, 5, 5], PLAIN, true),
        case(
            "ResNet 3x3 padding 1",
            [8, 16, 32, 32],
            [16, 16, 3, 3],
            ((1, 1), (1, 1), (1, 1)),
            false,
        ),
        case(
            "3x3 stride 2 padding 1 (downsampling)",
            [8, 16, 32, 32],
            [32, 16, 3, 3],
            ((2, 2), (1, 1), (1, 1)),
            false,
        ),
        case(
            "1x1 stride 2 (projection shortcut)",
            [8, 16, 32, 32],
            [32, 16, 1, 1],
            ((2, 2), (0, 0), (1, 1)),
            false,
        ),
        case(
            "1x1 stride 1 with bias",
            [4, 24, 9, 7],
            [12, 24, 1, 1],
            PLAIN,
            true,
        ),
        case(
            "7x7 stride 2 padding 3 (ResNet-50 stem)",
            [2, 3, 64, 64],
            [16, 3, 7, 7],
            ((2, 2), (3, 3), (1, 1)),
            true,
        ),
        case(
            "batch 1, odd sizes, uneven kernel and padding",
            [1, 3, 13, 11],
            [5, 3, 3, 2],
            ((1, 1), (1, 0), (1, 1)),
            true,
        ),
        case(
            "dilation 2 padding 2",
            [2, 4, 15, 17],
            [6, 4, 3, 3],
            ((1, 1), (2, 2), (2, 2)),
            false,
        ),
        case(
            "stride (2, 1) padding (0, 2), kernel 2x3",
            [3, 5, 10, 9],
            [4, 5, 2, 3],
            ((2, 1), (0, 2), (1, 1)),
            true,
        ),
        case(
            "kernel as large as the input (one output pixel)",
            [4, 8, 5, 5],
            [10, 8, 5, 5],
            PLAIN,
            true,
        ),
        case(
            "stride 3 larger than the kernel",
            [2, 3, 11, 11],
            [4, 3, 2, 2],
            ((3, 3), (0, 0), (1, 1)),
            false,
        ),
    ]
}

/// Two geometries too large to repeat in every test: the ResNet-50 stem at 224×224 (batch 1)
/// and a batch whose im2col columns (37.7 MB per sample in f32) exceed the fallback's 256 MiB
/// budget, so that it runs in two chunks.
fn large_cases() -> Vec<Case> {
    vec![
        case(
            "ResNet-50 stem at 224x224, batch 1",
            [1, 3, 224, 224],
            [64, 3, 7, 7],
            ((2, 2), (3, 3), (1, 1)),
            false,
        ),
        case(
            "batch over the im2col column budget (two chunks)",
            [10, 64, 128, 128],
            [8, 64, 3, 3],
            ((1, 1), (1, 1), (1, 1)),
            true,
        ),
    ]
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, 0.0, 1.0, DType::F64, Device::Cpu, &mut gen)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The largest magnitude of `v`, plus one.
fn scale(v: &[f64]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs())) + 1.0
}

/// `index` of a tensor of `dims` as coordinates.
fn coordinates(mut index: usize, dims: &[usize]) -> Vec<usize> {
    let mut out = vec![0; dims.len()];
    for (o, &d) in out.iter_mut().zip(dims).rev() {
        *o = index % d.max(1);
        index /= d.max(1);
    }
    out
}

/// The comparison a test makes.
#[derive(Clone, Copy, Debug)]
enum Tolerance {
    /// f32 without TF32, or f64: rounding of the dtype.
    Exact,
    /// f32 with TF32 allowed.
    Tf32,
}

/// Asserts that `got` (from CUDA) agrees with `want` (from the CPU), naming the first element
/// that does not.
fn assert_close(got: &Tensor, want: &Tensor, tolerance: Tolerance, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: the result is not on the GPU");
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes differ");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let s = scale(&w);
    let (rtol, stol) = match (tolerance, want.dtype()) {
        (_, DType::F64) => (1e-10, 1e-12),
        (Tolerance::Exact, _) => (2e-4, 5e-5),
        (Tolerance::Tf32, _) => (0.0, 3e-3),
    };
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a - b).abs() <= rtol * b.abs() + stol * s;
        assert!(
            ok,
            "{what} ({:?}, {}): element {i} {:?} is {a:.9e} on CUDA, {b:.9e} on the CPU \
             (difference {:.3e}, allowed {:.3e} with the tensor's scale {s:.3e})",
            want.dims(),
            want.dtype(),
            coordinates(i, want.dims()),
            (a - b).abs(),
            rtol * b.abs() + stol * s
        );
    }
}

/// `t` on the GPU; with `strided`, as a view whose two last dimensions are swapped in memory
/// (same values, non-contiguous).
fn to_gpu(t: &Tensor, strided: bool) -> Tensor {
    let r = t.rank();
    // Transposing a pair of dims with a 1 among them changes no stride that matters: such a
    // tensor (a 1×1 kernel, a one-pixel image) goes over dense.
    if !strided || r < 2 || t.dims()[r - 2] < 2 || t.dims()[r - 1] < 2 {
        return t.to_device(GPU).unwrap();
    }
    let swapped = t
        .view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap()
        .copy_detached()
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let view = swapped
        .view_detached(swapped.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap();
    assert!(!view.is_contiguous(), "test setup: a strided view");
    view
}

/// Runs `c` on the CPU and on the GPU (under the settings in force) from the same inputs and
/// output gradient, and compares the output and the three gradients.
fn compare(c: &Case, dtype: DType, tolerance: Tolerance, strided: bool, what: &str, seed: u64) {
    let what = format!(
        "conv2d {} (input {:?}, weight {:?}, {:?}, bias {}){}, {what}",
        c.name,
        c.x,
        c.w,
        c.p,
        c.bias,
        if strided {
            ", strided inputs and output gradient"
        } else {
            ""
        }
    );
    let x = randn(&c.x, dtype, seed);
    let w = randn(&c.w, dtype, seed + 1);
    let b = randn(&[c.w[0]], dtype, seed + 2);
    let leaf = |t: &Tensor| t.copy_detached().unwrap().with_requires_grad().unwrap();
    let (xc, wc, bc) = (leaf(&x), leaf(&w), leaf(&b));
    let yc = conv2d(&xc, &wc, c.bias.then_some(&bc), &c.p).unwrap();
    let gy = randn(yc.dims(), dtype, seed + 3);
    backward(&yc, Some(&gy), &BackwardOptions::default()).unwrap();

    let declined_before = declined_calls();
    let gpu_leaf = |t: &Tensor| to_gpu(t, strided).with_requires_grad().unwrap();
    let (xg, wg, bg) = (
        gpu_leaf(&x),
        gpu_leaf(&w),
        b.to_device(GPU).unwrap().with_requires_grad().unwrap(),
    );
    let yg = conv2d(&xg, &wg, c.bias.then_some(&bg), &c.p)
        .unwrap_or_else(|e| panic!("{what}: forward failed: {e}"));
    assert_close(&yg, &yc, tolerance, &format!("{what}: output"));
    let gyg = to_gpu(&gy, strided);
    backward(&yg, Some(&gyg), &BackwardOptions::default())
        .unwrap_or_else(|e| panic!("{what}: backward failed: {e}"));
    let grad = |t: &Tensor, name: &str| {
        t.grad()
            .unwrap_or_else(|| panic!("{what}: no {name} gradient"))
    };
    assert_close(
        &grad(&xg, "input"),
        &grad(&xc, "input"),
        tolerance,
        &format!("{what}: input gradient"),
    );
    assert_close(
        &grad(&wg, "weight"),
        &grad(&wc, "weight"),
        tolerance,
        &format!("{what}: weight gradient"),
    );
    if c.bias {
        assert_close(
            &grad(&bg, "bias"),
            &grad(&bc, "bias"),
            tolerance,
            &format!("{what}: bias gradient"),
        );
    }
    check_cudnn_took_every_pass(declined_before, &what);
}

/// How many passes cuDNN declined on this thread so far (im2col + cuBLAS ran them); 0 when
/// cuDNN is not the engine or has not run here.
fn declined_calls() -> u64 {
    if cuda_conv_backend() != CudaConvBackend::Cudnn {
        return 0;
    }
    cudnn_cache_stats(GPU).map_or(0, |s| s.declined_calls)
}

/// With cuDNN as the engine, every pass of a case ran on cuDNN: a decline falls back to
/// im2col, which computes the right values, so comparing values alone would not see cuDNN being
/// handed a wrong descriptor (a swapped padding makes cuDNN decline the output's size). On the
/// emulator, whose cuDNN takes every geometry these cases use, a decline fails the test; on a
/// GPU, where real cuDNN may decline a geometry for its own reasons, it is printed.
fn check_cudnn_took_every_pass(declined_before: u64, what: &str) {
    let declined = declined_calls().saturating_sub(declined_before);
    if declined == 0 {
        return;
    }
    assert!(
        !tandem_test_support::on_emulator(),
        "{what}: cuDNN declined {declined} pass(es) and im2col ran them (see the emulator's \
         message above)"
    );
    println!("note: {what}: cuDNN declined {declined} pass(es); im2col + cuBLAS ran them");
}

#[test]
fn forward_and_backward_match_the_cpu_in_f32_with_tf32_off_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            assert!(!allow_tf32_conv());
            let what = format!("{}, TF32 off", engine(backend));
            for (i, c) in cases().iter().enumerate() {
                compare(
                    c,
                    DType::F32,
                    Tolerance::Exact,
                    false,
                    &what,
                    100 + i as u64,
                );
            }
        });
    }
}

#[test]
fn large_geometries_match_the_cpu_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            let what = format!("{}, TF32 off", engine(backend));
            for (i, c) in large_cases().iter().enumerate() {
                compare(
                    c,
                    DType::F32,
                    Tolerance::Exact,
                    false,
                    &what,
                    200 + i as u64,
                );
            }
        });
    }
}

#[test]
fn forward_and_backward_match_the_cpu_in_f64_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, true, CudnnAlgorithmSearch::Measured, || {
            let what = engine(backend);
            for (i, c) in cases().iter().enumerate() {
                compare(
                    c,
                    DType::F64,
                    Tolerance::Exact,
                    false,
                    &what,
                    300 + i as u64,
                );
            }
        });
    }
}

#[test]
fn tf32_on_by_default_stays_within_tf32_rounding_of_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    {
        // Nothing has changed the settings while the lock is held and they were restored:
        // the defaults are PyTorch's.
        let _guard = SETTINGS.lock().unwrap_or_else(|p| p.into_inner());
        assert!(allow_tf32_conv(), "TF32 for convolutions is on by default");
        assert_eq!(
            cuda_conv_backend(),
            CudaConvBackend::Cudnn,
            "cuDNN is the default engine"
        );
    }
    for backend in BACKENDS {
        with_settings(backend, true, CudnnAlgorithmSearch::Measured, || {
            let what = format!("{}, TF32 on", engine(backend));
            for (i, c) in cases().iter().enumerate() {
                compare(c, DType::F32, Tolerance::Tf32, false, &what, 400 + i as u64);
            }
        });
    }
}

#[test]
fn strided_inputs_and_output_gradients_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            let what = format!("{}, TF32 off", engine(backend));
            for (i, c) in cases().iter().enumerate().step_by(2) {
                compare(c, DType::F32, Tolerance::Exact, true, &what, 500 + i as u64);
            }
        });
    }
}

#[test]
fn heuristic_algorithm_choice_matches_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    with_settings(
        CudaConvBackend::Cudnn,
        false,
        CudnnAlgorithmSearch::Heuristic,
        || {
            let what = format!(
                "{}, heuristic algorithm choice, TF32 off",
                engine(CudaConvBackend::Cudnn)
            );
            for (i, c) in cases().iter().enumerate() {
                compare(
                    c,
                    DType::F32,
                    Tolerance::Exact,
                    false,
                    &what,
                    600 + i as u64,
                );
                compare(
                    c,
                    DType::F64,
                    Tolerance::Exact,
                    false,
                    &what,
                    650 + i as u64,
                );
            }
        },
    );
}

#[test]
fn gradcheck_in_f64_on_the_gpu_passes_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let geometries = [
        case(
            "stride 2 padding 1 with bias",
            [2, 2, 5, 6],
            [3, 2, 3, 3],
            ((2, 2), (1, 1), (1, 1)),
            true,
        ),
        case(
            "dilation 2, uneven padding",
            [1, 3, 7, 6],
            [2, 3, 2, 3],
            ((1, 2), (2, 1), (2, 2)),
            true,
        ),
        case("1x1", [2, 4, 3, 3], [3, 4, 1, 1], PLAIN, false),
    ];
    for backend in BACKENDS {
        with_settings(backend, true, CudnnAlgorithmSearch::Measured, || {
            for (i, c) in geometries.iter().enumerate() {
                let seed = 700 + 3 * i as u64;
                let on_gpu = |shape: &[usize], seed| {
                    randn(shape, DType::F64, seed)
                        .to_device(GPU)
                        .unwrap()
                        .with_requires_grad()
                        .unwrap()
                };
                let mut inputs = vec![on_gpu(&c.x, seed), on_gpu(&c.w, seed + 1)];
                if c.bias {
                    inputs.push(on_gpu(&[c.w[0]], seed + 2));
                }
                let p = c.p;
                gradcheck(
                    |t: &[Tensor]| conv2d(&t[0], &t[1], t.get(2), &p),
                    &inputs,
                    &GradcheckOptions::default(),
                )
                .unwrap_or_else(|e| panic!("conv2d {} on {}: {e}", c.name, engine(backend)));
            }
        });
    }
}

#[test]
fn only_the_gradients_asked_for_are_computed() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            let what = engine(backend);
            let p = Conv2dParams {
                stride: (2, 2),
                padding: (1, 1),
                dilation: (1, 1),
            };
            let x = randn(&[2, 3, 9, 9], DType::F32, 800);
            let w = randn(&[4, 3, 3, 3], DType::F32, 801);
            let (xc, wc) = (
                x.copy_detached().unwrap(),
                w.copy_detached().unwrap().with_requires_grad().unwrap(),
            );
            let (xg, wg) = (
                x.to_device(GPU).unwrap(),
                w.to_device(GPU).unwrap().with_requires_grad().unwrap(),
            );
            let yc = conv2d(&xc, &wc, None, &p).unwrap();
            let yg = conv2d(&xg, &wg, None, &p).unwrap();
            let gy = randn(yc.dims(), DType::F32, 802);
            backward(&yc, Some(&gy), &BackwardOptions::default()).unwrap();
            backward(
                &yg,
                Some(&gy.to_device(GPU).unwrap()),
                &BackwardOptions::default(),
            )
            .unwrap();
            assert!(
                xg.grad().is_none(),
                "{what}: an input without requires_grad got a gradient"
            );
            assert_close(
                &wg.grad().unwrap(),
                &wc.grad().unwrap(),
                Tolerance::Exact,
                &format!("{what}: weight gradient only"),
            );
        });
    }
}

#[test]
fn empty_batches_give_empty_outputs_and_zero_parameter_gradients() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            let what = engine(backend);
            let p = Conv2dParams::default();
            let x = Tensor::zeros(&[0, 3, 5, 5], DType::F32, GPU)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let w = randn(&[2, 3, 3, 3], DType::F32, 900)
                .to_device(GPU)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let b = randn(&[2], DType::F32, 901)
                .to_device(GPU)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let y = conv2d(&x, &w, Some(&b), &p).unwrap();
            assert_eq!(y.dims(), [0, 2, 3, 3], "{what}: output shape");
            let gy = Tensor::zeros(&[0, 2, 3, 3], DType::F32, GPU).unwrap();
            backward(&y, Some(&gy), &BackwardOptions::default()).unwrap();
            assert_eq!(
                x.grad().unwrap().dims(),
                [0, 3, 5, 5],
                "{what}: input gradient shape"
            );
            let zeros = |t: &Tensor| {
                t.grad()
                    .unwrap()
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .all(|&v| v == 0.0)
            };
            assert!(
                zeros(&w),
                "{what}: weight gradient of an empty batch is not zero"
            );
            assert!(
                zeros(&b),
                "{what}: bias gradient of an empty batch is not zero"
            );
        });
    }
}

/// Every dimension that can be 0, forward and backward against the CPU on both engines: no
/// samples, no input channels (outputs are the bias; a weight without elements), no output
/// channels (an empty output, a weight and a bias without elements). None reaches cuDNN or
/// cuBLAS with a zero size.
#[test]
fn empty_geometries_match_the_cpu_forward_and_backward_on_both_engines() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let cases = [
        case("no samples", [0, 3, 5, 5], [2, 3, 3, 3], PLAIN, true),
        case("no input channels", [2, 0, 5, 5], [4, 0, 3, 3], PLAIN, true),
        case(
            "no output channels",
            [2, 3, 5, 5],
            [0, 3, 3, 3],
            PLAIN,
            true,
        ),
        case(
            "no samples, padded and strided",
            [0, 2, 6, 7],
            [3, 2, 3, 3],
            ((2, 2), (1, 1), (1, 1)),
            false,
        ),
    ];
    for backend in BACKENDS {
        with_settings(backend, false, CudnnAlgorithmSearch::Measured, || {
            for c in &cases {
                for dtype in [DType::F32, DType::F64] {
                    compare(c, dtype, Tolerance::Exact, false, &engine(backend), 950);
                }
            }
        });
    }
}

#[test]
fn cudnn_chooses_each_algorithm_once_per_geometry_and_then_reuses_its_plan() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    if !cudnn_available(GPU) {
        println!("skipped: cuDNN does not load on this machine");
        return;
    }
    with_settings(
        CudaConvBackend::Cudnn,
        false,
        CudnnAlgorithmSearch::Measured,
        || {
            // A geometry no other test uses.
            let c = case(
                "plan cache",
                [3, 7, 12, 10],
                [5, 7, 3, 3],
                ((1, 1), (1, 1), (1, 1)),
                false,
            );
            // This thread's cuDNN state may come from the pool of ended threads, with their
            // plans: make sure it exists before counting.
            let warm = case("warm-up", [1, 2, 5, 5], [1, 2, 3, 3], PLAIN, false);
            compare(&warm, DType::F32, Tolerance::Exact, false, "warm-up", 999);
            let before = cudnn_cache_stats(GPU).expect("cuDNN ran on this thread");
            compare(&c, DType::F32, Tolerance::Exact, false, "first call", 1000);
            let first = cudnn_cache_stats(GPU).expect("cuDNN ran on this thread");
            assert_eq!(
                first.plans,
                before.plans + 1,
                "one plan for the new geometry: {first:?}"
            );
            assert_eq!(
                first.searches,
                before.searches + 3,
                "three passes chosen once each: {first:?}"
            );
            compare(&c, DType::F32, Tolerance::Exact, false, "second call", 1001);
            let second = cudnn_cache_stats(GPU).unwrap();
            assert_eq!(second.plans, first.plans, "no new plan: {second:?}");
            assert_eq!(second.searches, first.searches, "no new search: {second:?}");
            assert!(
                second.plan_hits >= first.plan_hits + 3,
                "three passes found their plan: {second:?}"
            );
            assert_eq!(
                second.declined_calls, before.declined_calls,
                "cuDNN declined a pass: {second:?}"
            );
        },
    );
}

/// Padding that differs between height and width reaches cuDNN's convolution descriptor in the
/// right order: forward and backward match the CPU, and cuDNN (not the im2col fallback) ran every
/// pass. With the two paddings swapped, the first case keeps its output size (stride 4 absorbs
/// the difference) and computes wrong values; the second gets an output size cuDNN rejects
/// (NOT_SUPPORTED), so the pass would quietly fall back to im2col — which the statistics catch.
#[test]
fn asymmetric_padding_runs_on_cudnn_and_matches_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    if !cudnn_available(GPU) {
        println!("skipped: cuDNN does not load on this machine");
        return;
    }
    let cases = [
        case(
            "padding (1, 0), stride 4: swapped, the output keeps its size",
            [2, 3, 8, 8],
            [4, 3, 3, 3],
            ((4, 4), (1, 0), (1, 1)),
            true,
        ),
        case(
            "padding (2, 0) on a 6x9 input: swapped, the output changes size",
            [2, 3, 6, 9],
            [4, 3, 3, 3],
            ((1, 1), (2, 0), (1, 1)),
            false,
        ),
    ];
    for search in [
        CudnnAlgorithmSearch::Measured,
        CudnnAlgorithmSearch::Heuristic,
    ] {
        with_settings(CudaConvBackend::Cudnn, false, search, || {
            for (i, c) in cases.iter().enumerate() {
                let before = cudnn_cache_stats(GPU).unwrap_or_default();
                let what = format!("cuDNN, {search:?} search, TF32 off");
                compare(
                    c,
                    DType::F32,
                    Tolerance::Exact,
                    false,
                    &what,
                    1200 + i as u64,
                );
                let after = cudnn_cache_stats(GPU).expect("cuDNN ran on this thread");
                assert_eq!(
                    (after.declined_calls, after.not_supported),
                    (before.declined_calls, before.not_supported),
                    "conv2d {} ({search:?}): cuDNN declined or refused a pass, so im2col ran it: \
                     {before:?} then {after:?}",
                    c.name
                );
            }
        });
    }
}

fn error_of(r: tandem_core::Result<Tensor>) -> String {
    match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_arguments_give_the_cpus_errors() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let p = Conv2dParams::default();
    let t = |shape: &[usize], dtype: DType, device: Device| {
        randn(shape, dtype, 1100).to_device(device).unwrap()
    };
    type Build = fn(Device) -> (Tensor, Tensor, Option<Tensor>, Conv2dParams);
    let cases: Vec<(&str, Build)> = vec![
        ("channel counts differ", |d| {
            (
                randn(&[2, 3, 8, 8], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 2, 3, 3], DType::F32, 2).to_device(d).unwrap(),
                None,
                Conv2dParams::default(),
            )
        }),
        ("input of rank 3", |d| {
            (
                randn(&[3, 8, 8], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 3, 3, 3], DType::F32, 2).to_device(d).unwrap(),
                None,
                Conv2dParams::default(),
            )
        }),
        ("kernel larger than the padded input", |d| {
            (
                randn(&[1, 3, 4, 4], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 3, 7, 7], DType::F32, 2).to_device(d).unwrap(),
                None,
                Conv2dParams::default(),
            )
        }),
        ("bias of the wrong length", |d| {
            (
                randn(&[1, 3, 8, 8], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 3, 3, 3], DType::F32, 2).to_device(d).unwrap(),
                Some(randn(&[3], DType::F32, 3).to_device(d).unwrap()),
                Conv2dParams::default(),
            )
        }),
        ("dtypes differ", |d| {
            (
                randn(&[1, 3, 8, 8], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 3, 3, 3], DType::F64, 2).to_device(d).unwrap(),
                None,
                Conv2dParams::default(),
            )
        }),
        ("integer input", |d| {
            (
                randn(&[1, 3, 8, 8], DType::I64, 1).to_device(d).unwrap(),
                randn(&[4, 3, 3, 3], DType::I64, 2).to_device(d).unwrap(),
                None,
                Conv2dParams::default(),
            )
        }),
        ("stride 0", |d| {
            (
                randn(&[1, 3, 8, 8], DType::F32, 1).to_device(d).unwrap(),
                randn(&[4, 3, 3, 3], DType::F32, 2).to_device(d).unwrap(),
                None,
                Conv2dParams {
                    stride: (0, 1),
                    ..Conv2dParams::default()
                },
            )
        }),
    ];
    for (name, build) in cases {
        let (xc, wc, bc, pc) = build(Device::Cpu);
        let (xg, wg, bg, pg) = build(GPU);
        let cpu = error_of(conv2d(&xc, &wc, bc.as_ref(), &pc));
        let gpu = error_of(conv2d(&xg, &wg, bg.as_ref(), &pg));
        assert_eq!(
            gpu,
            cpu.replace("cpu", "cuda:0"),
            "{name}: the CUDA error differs from the CPU's"
        );
    }
    // Mixed devices: an error naming the op and both devices, whichever side is on the GPU.
    let (xc, wc) = (
        t(&[1, 3, 8, 8], DType::F32, Device::Cpu),
        t(&[4, 3, 3, 3], DType::F32, Device::Cpu),
    );
    let (xg, wg) = (xc.to_device(GPU).unwrap(), wc.to_device(GPU).unwrap());
    for (name, r) in [
        (
            "input on the GPU, weight on the CPU",
            conv2d(&xg, &wc, None, &p),
        ),
        (
            "input on the CPU, weight on the GPU",
            conv2d(&xc, &wg, None, &p),
        ),
        (
            "bias on the CPU",
            conv2d(&xg, &wg, Some(&randn(&[4], DType::F32, 5)), &p),
        ),
    ] {
        let e = error_of(r);
        assert!(
            e.contains("conv2d") && e.contains("cuda:0") && e.contains("cpu"),
            "{name}: {e}"
        );
    }
}
