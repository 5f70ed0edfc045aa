//! GPU conformance of the reductions and of softmax/log_softmax: `sum`, `mean`, `max`,
//! `argmax`, `softmax`, `log_softmax` on CUDA against the same ops on the CPU with the same
//! inputs, forward and backward (f32, within rounding), over every kernel plan (warp rows,
//! block rows, column sums, the two-pass sum, softmax over rows and over columns) and strided
//! inputs; `gradcheck` in f64 on the GPU; and the CPU's errors for bad arguments.
//!
//! Each test prints runs on the CUDA emulator without a GPU. Failure messages name the op, the
//! case, the dtype and the first differing element.
//!
//! Tolerances (see `common/tolerance.rs`): a sum (and a mean) adds its terms in another order on
//! each device, so it is compared within the bound for two orders of its number of terms and
//! their Σ|x|; its backward broadcasts the output gradient times the scale (exact for a sum, two
//! ulp for a mean: the GPU multiplies by the scale rounded to the dtype, the CPU rounds the f64
//! product once); the maximum and its backward select and copy values and agree bit for bit;
//! softmax and log_softmax go through exp, a sum and log, and are compared within 1e-4 relative
//! (at least 1e-4 absolute), far above the few ulp of each step for these sizes.

mod common;

use common::tolerance::scaled_sum_bound;
use common::{assert_ulps, assert_within, epsilon, values, GPU};
use tandem_autograd::{gradcheck, BackwardOptions, GradcheckOptions, TensorBackward};
use tandem_core::{DType, Device, Generator, Tensor};

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn(shape, 0.0, 2.0, dtype, Device::Cpu, &mut g).unwrap()
}

/// A CPU tensor and its copy on the GPU (a transposed view of both when `transpose`), leaves
/// that require grad.
fn pair(shape: &[usize], dtype: DType, seed: u64, transpose: bool) -> (Tensor, Tensor) {
    let base = randn(shape, dtype, seed);
    let cpu = base.copy_detached().unwrap();
    let gpu = base.to_device(GPU).unwrap();
    let view = |t: Tensor| {
        let t = if transpose && t.rank() >= 2 {
            let r = t.rank();
            t.view_detached(t.layout().transpose("test", 0, r - 1).unwrap())
                .unwrap()
        } else {
            t
        };
        t.with_requires_grad().unwrap()
    };
    (view(cpu), view(gpu))
}

/// How a case's results may differ between the devices.
#[derive(Clone, Copy)]
enum Tolerance<'a> {
    /// Selection and copies: bit for bit.
    Exact,
    /// `scale ·` a sum over `dims`.
    Sum { dims: &'a [isize], scale: f64 },
    /// exp, sums and log: 1e-4 relative, at least 1e-4 absolute.
    Loose,
}

fn assert_loose(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: the result stays on the GPU");
    let bounds: Vec<f64> = values(want)
        .iter()
        .map(|b| 1e-4 * b.abs().max(1.0))
        .collect();
    assert_within(got, want, &bounds, what);
}

/// The bound of each output of `scale · sum(x, dims, keepdim)` (`x` the CPU input, `y` the
/// CPU's output): the terms' Σ|x| comes from the same sum over |x| in f64.
fn sum_bounds(x: &Tensor, dims: &[isize], scale: f64, y: &Tensor) -> Vec<f64> {
    let eps = epsilon(x.dtype());
    // A fresh copy: the input is a leaf the test still uses.
    let abs = x.copy_detached().unwrap().to_dtype(DType::F64).unwrap();
    abs.map_inplace_f64("test", f64::abs).unwrap();
    let keepdim = y.rank() == x.rank();
    let abs_sums = values(&tandem_ops::sum(&abs, dims, keepdim).unwrap());
    let len = x.numel().checked_div(y.numel()).unwrap_or(0);
    abs_sums
        .iter()
        .zip(values(y))
        .map(|(&s, r)| scaled_sum_bound(len, s, scale, r, eps))
        .collect()
}

/// Runs `f` on both devices, compares outputs, then backward with the same output gradient
/// and compares the input gradients, within `tolerance`.
fn compare(
    what: &str,
    shape: &[usize],
    transpose: bool,
    tolerance: Tolerance,
    f: impl Fn(&Tensor) -> tandem_core::Result<Tensor>,
) {
    for dtype in [DType::F32, DType::F64] {
        let what = format!("{what} {dtype} {shape:?} transposed {transpose}");
        let (c, g) = pair(shape, dtype, 5, transpose);
        let (yc, yg) = (f(&c).unwrap(), f(&g).unwrap());
        assert_eq!(yg.device(), GPU, "{what}: the result stays on the GPU");
        match tolerance {
            Tolerance::Exact => assert_ulps(&yg, &yc, 0.0, &what),
            Tolerance::Sum { dims, scale } => {
                assert_within(&yg, &yc, &sum_bounds(&c, dims, scale, &yc), &what)
            }
            Tolerance::Loose => assert_loose(&yg, &yc, &what),
        }
        let grad = randn(yc.dims(), dtype, 9);
        yc.backward_with(Some(&grad), &BackwardOptions::default())
            .unwrap();
        yg.backward_with(
            Some(&grad.to_device(GPU).unwrap()),
            &BackwardOptions::default(),
        )
        .unwrap();
        let (gg, gc) = (g.grad().unwrap(), c.grad().unwrap());
        let what = format!("{what}: input gradient");
        match tolerance {
            Tolerance::Exact => assert_ulps(&gg, &gc, 0.0, &what),
            Tolerance::Sum { scale, .. } => {
                assert_ulps(&gg, &gc, if scale == 1.0 { 0.0 } else { 2.0 }, &what)
            }
            Tolerance::Loose => assert_loose(&gg, &gc, &what),
        }
    }
}

const SHAPES: [&[usize]; 6] = [
    &[37],
    &[5, 1300],
    &[7, 33],
    &[3, 4, 5],
    &[2, 3, 4, 5],
    &[0, 4],
];

#[test]
fn sum_and_mean_match_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for shape in SHAPES {
        let rank = shape.len() as isize;
        let mut dim_sets: Vec<Vec<isize>> = vec![vec![], vec![0], vec![-1]];
        if rank >= 3 {
            dim_sets.extend([vec![1], vec![0, 2], vec![0, 1]]);
        }
        for dims in &dim_sets {
            for keepdim in [false, true] {
                for transpose in [false, true] {
                    let what = format!("sum over {dims:?} keepdim {keepdim}");
                    let sum = Tolerance::Sum { dims, scale: 1.0 };
                    compare(&what, shape, transpose, sum, |x| {
                        tandem_ops::sum(x, dims, keepdim)
                    });
                    let what = format!("mean over {dims:?} keepdim {keepdim}");
                    let count = reduced_count(shape, transpose, dims);
                    if count > 0 {
                        // Of an empty input too when each group has elements: an empty output.
                        let scale = 1.0 / count as f64;
                        let mean = Tolerance::Sum { dims, scale };
                        compare(&what, shape, transpose, mean, |x| {
                            tandem_ops::mean(x, dims, keepdim)
                        });
                    } else {
                        // A mean over no elements is the CPU's error on both devices.
                        let (c, g) = pair(shape, DType::F32, 5, transpose);
                        assert_eq!(
                            tandem_ops::mean(&g, dims, keepdim).unwrap_err().to_string(),
                            tandem_ops::mean(&c, dims, keepdim).unwrap_err().to_string(),
                            "{what} {shape:?} transposed {transpose}"
                        );
                    }
                }
            }
        }
    }
    // One long row: the two-pass sum.
    let all = Tolerance::Sum {
        dims: &[],
        scale: 1.0,
    };
    compare(
        "sum of everything",
        &[300, 700],
        false,
        all,
        tandem_ops::sum_all,
    );
    let mean_all = Tolerance::Sum {
        dims: &[],
        scale: 1.0 / 210_000.0,
    };
    compare(
        "mean of everything",
        &[300, 700],
        true,
        mean_all,
        tandem_ops::mean_all,
    );
}

/// The number of elements each group of a reduction over `dims` holds, for the input `pair`
/// makes of `shape` (its first and last dims swapped when `transpose`).
fn reduced_count(shape: &[usize], transpose: bool, dims: &[isize]) -> usize {
    let mut seen = shape.to_vec();
    if transpose && seen.len() >= 2 {
        let r = seen.len();
        seen.swap(0, r - 1);
    }
    if dims.is_empty() {
        return seen.iter().product();
    }
    dims.iter()
        .map(|&d| seen[d.rem_euclid(seen.len() as isize) as usize])
        .product()
}

#[test]
fn max_and_argmax_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for shape in [&[37][..], &[5, 1300], &[7, 33], &[3, 4, 5]] {
        for dims in [vec![0isize], vec![-1], vec![]] {
            for transpose in [false, true] {
                let what = format!("max over {dims:?}");
                compare(&what, shape, transpose, Tolerance::Exact, |x| {
                    tandem_ops::max(x, &dims, false)
                });
            }
        }
        let (c, g) = pair(shape, DType::F32, 3, false);
        let a = tandem_ops::argmax(&g, -1, false).unwrap();
        assert_eq!(a.dtype(), DType::I64);
        assert_eq!(
            a.to_vec::<i64>().unwrap(),
            tandem_ops::argmax(&c, -1, false)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            "argmax {shape:?}"
        );
    }
    // No groups: empty outputs and gradients, an empty argmax.
    for (shape, dim) in [(&[0, 5][..], -1isize), (&[3, 0], 0)] {
        for transpose in [false, true] {
            let what = format!("max over [{dim}] (no groups)");
            let shape: Vec<usize> = if transpose {
                shape.iter().rev().copied().collect()
            } else {
                shape.to_vec()
            };
            compare(&what, &shape, transpose, Tolerance::Exact, |x| {
                tandem_ops::max(x, &[dim], false)
            });
        }
        let (c, g) = pair(shape, DType::F32, 4, false);
        let a = tandem_ops::argmax(&g, dim, false).unwrap();
        let want = tandem_ops::argmax(&c, dim, false).unwrap();
        assert_eq!(a.dims(), want.dims(), "argmax of {shape:?} over {dim}");
        assert_eq!(a.to_vec::<i64>().unwrap(), Vec::<i64>::new());
    }
    // Ties go to the first maximum, NaN wins, on both devices.
    let x = Tensor::from_vec(
        vec![1.0f32, 3.0, 3.0, f32::NAN, 2.0, 5.0],
        &[2, 3],
        Device::Cpu,
    )
    .unwrap()
    .to_device(GPU)
    .unwrap();
    let x = x.with_requires_grad().unwrap();
    let m = tandem_ops::max(&x, &[1], false).unwrap();
    let v = m.to_vec::<f32>().unwrap();
    assert_eq!(v[0], 3.0);
    assert!(v[1].is_nan());
    tandem_ops::sum_all(&m).unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    );
}

#[test]
fn softmax_and_log_softmax_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for shape in [
        &[4, 10][..],
        &[3, 1500],
        &[3, 4, 5],
        &[64, 10],
        &[0, 3],
        &[2, 0, 3],
    ] {
        for dim in [0isize, -1] {
            for transpose in [false, true] {
                let what = format!("softmax dim {dim}");
                compare(&what, shape, transpose, Tolerance::Loose, |x| {
                    tandem_ops::softmax(x, dim)
                });
                let what = format!("log_softmax dim {dim}");
                compare(&what, shape, transpose, Tolerance::Loose, |x| {
                    tandem_ops::log_softmax(x, dim)
                });
            }
        }
    }
    // Large logits stay finite.
    let x = Tensor::from_vec(
        vec![1000.0f32, 1001.0, 1002.0, -1000.0],
        &[2, 2],
        Device::Cpu,
    )
    .unwrap()
    .to_device(GPU)
    .unwrap();
    let y = tandem_ops::log_softmax(&x, 1)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
}

/// A function of the gradcheck inputs.
type OpOfInputs = dyn Fn(&[Tensor]) -> tandem_core::Result<Tensor>;

#[test]
fn gradcheck_in_f64_on_the_gpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let opts = GradcheckOptions::default();
    let x = randn(&[3, 4, 5], DType::F64, 1)
        .to_device(GPU)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let checks: Vec<(&str, Box<OpOfInputs>)> = vec![
        ("sum [1]", Box::new(|t| tandem_ops::sum(&t[0], &[1], false))),
        (
            "sum [0, 2]",
            Box::new(|t| tandem_ops::sum(&t[0], &[0, 2], true)),
        ),
        (
            "mean [-1]",
            Box::new(|t| tandem_ops::mean(&t[0], &[-1], false)),
        ),
        ("max [1]", Box::new(|t| tandem_ops::max(&t[0], &[1], false))),
        ("softmax 1", Box::new(|t| tandem_ops::softmax(&t[0], 1))),
        ("softmax -1", Box::new(|t| tandem_ops::softmax(&t[0], -1))),
        (
            "log_softmax 0",
            Box::new(|t| tandem_ops::log_softmax(&t[0], 0)),
        ),
        (
            "log_softmax -1",
            Box::new(|t| tandem_ops::log_softmax(&t[0], -1)),
        ),
    ];
    for (name, f) in checks {
        gradcheck(f, std::slice::from_ref(&x), &opts)
            .unwrap_or_else(|e| panic!("gradcheck of {name} on the GPU: {e}"));
    }
}

#[test]
fn bad_arguments_give_the_cpu_errors() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let (c, g) = pair(&[2, 3], DType::F32, 1, false);
    for (what, cpu, gpu) in [
        (
            "sum dim",
            tandem_ops::sum(&c, &[2], false),
            tandem_ops::sum(&g, &[2], false),
        ),
        (
            "sum twice",
            tandem_ops::sum(&c, &[0, 0], false),
            tandem_ops::sum(&g, &[0, 0], false),
        ),
        (
            "max dim",
            tandem_ops::max(&c, &[5], false),
            tandem_ops::max(&g, &[5], false),
        ),
        (
            "softmax dim",
            tandem_ops::softmax(&c, 2),
            tandem_ops::softmax(&g, 2),
        ),
    ] {
        assert_eq!(
            gpu.unwrap_err().to_string(),
            cpu.unwrap_err().to_string(),
            "{what}"
        );
    }
    let empty = Tensor::zeros(&[3, 0], DType::F32, GPU).unwrap();
    let err = tandem_ops::max(&empty, &[1], false)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("max:") && err.contains("[3, 0]"), "{err}");
    let labels = Tensor::zeros(&[3], DType::I64, GPU).unwrap();
    assert!(tandem_ops::sum(&labels, &[0], false).is_err());
}
