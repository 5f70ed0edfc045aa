//! The checks of the f16/bf16 paths of the ops (`tests/low_precision.rs` on the CPU,
//! `tests/cuda_low_precision.rs` on a CUDA device): an op on half inputs against the same op in
//! f32 on the rounded inputs, forward and backward, on one device.
//!
//! The tolerance comes from the format. An op on half inputs widens them to f32 (exact), runs
//! the f32 computation — every accumulation in f32 — and rounds its result once to the half
//! dtype. The f32 op on the rounded inputs performs that very computation, so the two differ by
//! that one rounding only: `|half − f32| ≤ u·|f32|` with `u` the unit roundoff (2⁻⁸ for bf16,
//! 2⁻¹¹ for f16), plus half an ulp of the smallest subnormal (2⁻²⁵, f16's) below the normal
//! range. The bound does not grow with the length of a sum or a reduction: a kernel that
//! accumulated in the half dtype would be off by about `n·u` and fail. Gradients are the same:
//! the incoming gradient is a half (widened exactly), the f32 backward runs, and the input's
//! gradient is rounded once to the input's dtype; f32 parameters' gradients (batch norm) come
//! from the same f32 computation and agree to f32 rounding.

#![allow(dead_code)]

use tandem_autograd::{backward, BackwardOptions};
use tandem_core::{DType, Device, Generator, Result, Tensor};

/// The unit roundoff (half an ulp of 1) of a half dtype.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        DType::F32 => 2f64.powi(-24),
        other => panic!("no unit roundoff for {other}"),
    }
}

/// Every element of `t` as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// Asserts `got` (of dtype `dtype`) is `want` (f32) rounded once: within `u·|want| + 2⁻²⁵`,
/// NaN matching NaN and infinities equal.
pub fn assert_rounded(got: &Tensor, want: &Tensor, dtype: DType, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    let u = unit_roundoff(dtype);
    let (g, w) = (values(got), values(want));
    let bad: Vec<String> = g
        .iter()
        .zip(&w)
        .enumerate()
        .filter(|&(_, (&g, &w))| {
            !((g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= u * w.abs() + 2f64.powi(-25))
        })
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] {g} vs {w}"))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} ({dtype}, shape {:?}, device {}): not within one rounding of the f32 op: {}",
        got.dims(),
        got.device(),
        bad.join(", ")
    );
}

/// Normal values (mean 0, std `std`) of `shape` in f32 on `device`.
pub fn randn(shape: &[usize], std: f64, seed: u64, device: Device) -> Tensor {
    Tensor::randn(
        shape,
        0.0,
        std,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
    .to_device(device)
    .unwrap()
}

/// Uniform values in `[lo, hi)` of `shape` in f32 on `device`.
pub fn uniform(shape: &[usize], lo: f64, hi: f64, seed: u64, device: Device) -> Tensor {
    Tensor::rand(
        shape,
        lo,
        hi,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
    .to_device(device)
    .unwrap()
}

/// One input of a checked op: its f32 values and whether the op gets it in the half dtype
/// (else in f32, as the f32 parameters of batch norm), and whether it requires grad.
pub struct Input {
    pub values: Tensor,
    pub half: bool,
    pub grad: bool,
}

/// A half input that requires grad.
pub fn low(values: Tensor) -> Input {
    Input {
        values,
        half: true,
        grad: true,
    }
}

/// An f32 input that requires grad.
pub fn full(values: Tensor) -> Input {
    Input {
        values,
        half: false,
        grad: true,
    }
}

/// An input without gradient (targets, labels), passed as it is.
pub fn constant(values: Tensor) -> Input {
    Input {
        values,
        half: false,
        grad: false,
    }
}

/// Runs `f` on `inputs` in `dtype` (the half ones) and in f32 on the rounded values, and
/// checks the output (dtype `dtype`, within one rounding), then runs both backward with the
/// same half output gradient and checks each input's gradient (its own dtype; half gradients
/// within one rounding, f32 ones within f32 rounding of the reference's).
pub fn check_op(
    what: &str,
    dtype: DType,
    inputs: &[Input],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let make = |i: &Input, half_dtype: DType| -> Tensor {
        let t = if i.half {
            // The reference gets the rounded values, in f32.
            i.values
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(half_dtype)
                .unwrap()
        } else {
            i.values.copy_detached().unwrap()
        };
        if i.grad {
            t.with_requires_grad().unwrap()
        } else {
            t
        }
    };
    let lows: Vec<Tensor> = inputs.iter().map(|i| make(i, dtype)).collect();
    let refs: Vec<Tensor> = inputs.iter().map(|i| make(i, DType::F32)).collect();
    let y = f(&lows).unwrap_or_else(|e| panic!("{what} ({dtype}): {e}"));
    let y_ref = f(&refs).unwrap();
    assert_rounded(&y, &y_ref, dtype, &format!("{what} forward"));
    if !inputs.iter().any(|i| i.grad) {
        return;
    }
    let g = randn(y.dims(), 1.0, 99, y.device())
        .to_dtype(dtype)
        .unwrap();
    backward(&y, Some(&g), &BackwardOptions::default()).unwrap();
    backward(
        &y_ref,
        Some(&g.to_dtype(DType::F32).unwrap()),
        &BackwardOptions::default(),
    )
    .unwrap();
    for (k, ((i, l), r)) in inputs.iter().zip(&lows).zip(&refs).enumerate() {
        if !i.grad {
            continue;
        }
        let (gl, gr) = (l.grad(), r.grad());
        let (gl, gr) = match (gl, gr) {
            (Some(a), Some(b)) => (a, b),
            (None, None) => continue,
            (a, b) => panic!(
                "{what}: input {k} gradient {:?} vs {:?}",
                a.is_some(),
                b.is_some()
            ),
        };
        let own = if i.half { dtype } else { DType::F32 };
        assert_rounded(&gl, &gr, own, &format!("{what} gradient of input {k}"));
    }
}

/// The unary ops (inputs in their domains, away from relu's kink).
pub fn unary_ops(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let shape = [3, 37];
    let x = randn(&shape, 1.0, 1, device);
    let pos = uniform(&shape, 0.1, 3.0, 2, device);
    type F = fn(&Tensor) -> Result<Tensor>;
    let any: [(&str, F); 5] = [
        ("neg", ops::neg),
        ("exp", ops::exp),
        ("sigmoid", ops::sigmoid),
        ("tanh", ops::tanh),
        ("relu", ops::relu),
    ];
    for (name, f) in any {
        check_op(name, dtype, &[low(x.clone())], |t| f(&t[0]));
    }
    for (name, f) in [("log", ops::log as F), ("sqrt", ops::sqrt)] {
        check_op(name, dtype, &[low(pos.clone())], |t| f(&t[0]));
    }
    check_op("pow_scalar", dtype, &[low(pos)], |t| {
        ops::pow_scalar(&t[0], 1.5)
    });
    // A transposed (strided) input.
    let xt = ops::transpose(&x, 0, 1).unwrap();
    check_op("relu of a transposed input", dtype, &[low(xt)], |t| {
        ops::relu(&t[0])
    });
}

/// The binary ops, same-dtype and broadcasting, and the scalar forms.
pub fn binary_ops(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let a = randn(&[4, 3, 5], 1.0, 3, device);
    let b = randn(&[4, 3, 5], 1.0, 4, device);
    let row = uniform(&[1, 5], 0.5, 2.0, 5, device);
    type F = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let all: [(&str, F); 5] = [
        ("add", ops::add),
        ("sub", ops::sub),
        ("mul", ops::mul),
        ("div", ops::div),
        ("add_relu", ops::add_relu),
    ];
    for (name, f) in all {
        let b = if name == "div" { &row } else { &b };
        check_op(name, dtype, &[low(a.clone()), low(b.clone())], |t| {
            f(&t[0], &t[1])
        });
        check_op(name, dtype, &[low(a.clone()), low(row.clone())], |t| {
            f(&t[0], &t[1])
        });
    }
    check_op("add_scalar", dtype, &[low(a.clone())], |t| {
        ops::add_scalar(&t[0], 0.3)
    });
    check_op("mul_scalar", dtype, &[low(a)], |t| {
        ops::mul_scalar(&t[0], -1.7)
    });
}

/// Mixed float dtypes promote as in PyTorch, and each input's gradient keeps its dtype.
pub fn promotion(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let a = randn(&[2, 6], 1.0, 6, device).to_dtype(dtype).unwrap();
    let other = if dtype == DType::BF16 {
        DType::F16
    } else {
        DType::BF16
    };
    let cases = [
        (DType::F32, DType::F32),
        (other, DType::F32),
        (DType::F64, DType::F64),
        (dtype, dtype),
    ];
    for (k, (b_dtype, want)) in cases.into_iter().enumerate() {
        let a = a.copy_detached().unwrap().with_requires_grad().unwrap();
        let b = randn(&[2, 6], 1.0, 7, device)
            .to_dtype(b_dtype)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        for (y, order) in [
            (ops::mul(&a, &b).unwrap(), "a·b"),
            (ops::add(&b, &a).unwrap(), "b+a"),
        ] {
            assert_eq!(y.dtype(), want, "case {k} {order}: {dtype} with {b_dtype}");
            let want_values = values(&a)
                .iter()
                .zip(values(&b))
                .map(|(x, y)| if order == "a·b" { x * y } else { x + y })
                .collect::<Vec<_>>();
            for (g, w) in values(&y).iter().zip(&want_values) {
                let u = unit_roundoff(if want == DType::F64 { DType::F32 } else { want });
                assert!((g - w).abs() <= u * w.abs() + 1e-30, "case {k}: {g} vs {w}");
            }
            let s = ops::sum_all(&y).unwrap();
            backward(&s, None, &BackwardOptions::default()).unwrap();
        }
        assert_eq!(a.grad().unwrap().dtype(), dtype, "case {k}: a's gradient");
        assert_eq!(b.grad().unwrap().dtype(), b_dtype, "case {k}: b's gradient");
    }
}

/// Sums, means and max over dims, argmax, softmax and log_softmax.
pub fn reductions(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let x = randn(&[4, 6, 5], 1.0, 8, device);
    check_op("sum", dtype, &[low(x.clone())], |t| {
        ops::sum(&t[0], &[1], false)
    });
    check_op("sum_all", dtype, &[low(x.clone())], |t| ops::sum_all(&t[0]));
    check_op("mean", dtype, &[low(x.clone())], |t| {
        ops::mean(&t[0], &[0, 2], true)
    });
    check_op("max", dtype, &[low(x.clone())], |t| {
        ops::max(&t[0], &[2], false)
    });
    check_op("softmax", dtype, &[low(x.clone())], |t| {
        ops::softmax(&t[0], 1)
    });
    check_op("log_softmax", dtype, &[low(x.clone())], |t| {
        ops::log_softmax(&t[0], -1)
    });
    let xl = x.to_dtype(dtype).unwrap();
    let got = ops::argmax(&xl, 1, false).unwrap();
    let want = ops::argmax(&xl.to_dtype(DType::F32).unwrap(), 1, false).unwrap();
    assert_eq!(got.dtype(), DType::I64);
    assert_eq!(
        got.to_device(Device::Cpu).unwrap().to_vec::<i64>().unwrap(),
        want.to_device(Device::Cpu)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        "argmax ({dtype})"
    );
}

/// A long sum: one rounding of the f32 sum, however many terms (the accumulation is f32).
pub fn long_sum(device: Device, dtype: DType, n: usize) {
    use tandem_ops as ops;
    // Positive terms, so that the sum is large and a half accumulator would lose most of them.
    let x = uniform(&[n], 0.5, 1.5, 9, device);
    check_op("sum of a long vector", dtype, &[low(x.clone())], |t| {
        ops::sum_all(&t[0])
    });
    check_op("mean of a long vector", dtype, &[low(x)], |t| {
        ops::mean_all(&t[0])
    });
}

/// cross_entropy, nll_loss and mse_loss on half scores: computed in f32, returned in the
/// scores' dtype.
pub fn losses(device: Device, dtype: DType) {
    use tandem_ops as ops;
    use tandem_ops::Reduction;
    let logits = randn(&[6, 5], 2.0, 10, device);
    let targets = Tensor::from_vec(vec![0i64, 4, 2, 1, 3, 2], &[6], Device::Cpu)
        .unwrap()
        .to_device(device)
        .unwrap();
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        check_op(
            "cross_entropy",
            dtype,
            &[low(logits.clone()), constant(targets.clone())],
            |t| ops::cross_entropy(&t[0], &t[1], reduction),
        );
        check_op(
            "nll_loss",
            dtype,
            &[low(logits.clone()), constant(targets.clone())],
            |t| ops::nll_loss(&t[0], &t[1], reduction),
        );
        let target = randn(&[6, 5], 1.0, 11, device);
        check_op(
            "mse_loss",
            dtype,
            &[low(logits.clone()), low(target)],
            |t| ops::mse_loss(&t[0], &t[1], reduction),
        );
    }
}

/// The three pools.
pub fn pools(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let x = randn(&[2, 3, 7, 6], 1.0, 12, device);
    check_op("max_pool2d", dtype, &[low(x.clone())], |t| {
        ops::max_pool2d(&t[0], (3, 3), (2, 2), (1, 1))
    });
    check_op("avg_pool2d", dtype, &[low(x.clone())], |t| {
        ops::avg_pool2d(&t[0], (2, 2), (2, 2), (0, 0))
    });
    check_op("adaptive_avg_pool2d", dtype, &[low(x)], |t| {
        ops::adaptive_avg_pool2d(&t[0], (1, 1))
    });
}

/// Batch norm, batch_norm_relu and batch_norm_add_relu with a half x (and residual) and f32
/// weight, bias and running statistics, training and evaluation; the running statistics stay
/// f32 and get the f32 op's update.
pub fn batch_norms(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let x = randn(&[4, 3, 5, 5], 2.0, 13, device);
    let residual = randn(&[4, 3, 5, 5], 1.0, 14, device);
    let weight = uniform(&[3], 0.5, 1.5, 15, device);
    let bias = randn(&[3], 0.5, 16, device);
    for training in [true, false] {
        for epilogue in 0..3 {
            let stats = |seed| {
                (
                    randn(&[3], 0.1, seed, device),
                    uniform(&[3], 0.5, 2.0, seed + 1, device),
                )
            };
            let (mean_l, var_l) = stats(17);
            let (mean_r, var_r) = stats(17);
            let mut inputs = vec![low(x.clone()), full(weight.clone()), full(bias.clone())];
            if epilogue == 2 {
                inputs.push(low(residual.clone()));
            }
            let calls = std::cell::Cell::new(0);
            check_op(
                &format!("batch norm epilogue {epilogue} training {training}"),
                dtype,
                &inputs,
                |t| {
                    // The first call is the half one, the second the f32 reference.
                    let (m, v) = if calls.replace(calls.get() + 1) == 0 {
                        (&mean_l, &var_l)
                    } else {
                        (&mean_r, &var_r)
                    };
                    let (w, b) = (Some(&t[1]), Some(&t[2]));
                    match epilogue {
                        0 => ops::batch_norm(&t[0], Some(m), Some(v), w, b, training, 0.1, 1e-5),
                        1 => {
                            ops::batch_norm_relu(&t[0], Some(m), Some(v), w, b, training, 0.1, 1e-5)
                        }
                        _ => ops::batch_norm_add_relu(
                            &t[0],
                            &t[3],
                            Some(m),
                            Some(v),
                            w,
                            b,
                            training,
                            0.1,
                            1e-5,
                        ),
                    }
                },
            );
            for (l, r, name) in [
                (&mean_l, &mean_r, "running_mean"),
                (&var_l, &var_r, "running_var"),
            ] {
                assert_rounded(l, r, DType::F32, &format!("{name} after a {dtype} step"));
            }
        }
    }
}

/// Batch norm, batch_norm_relu and batch_norm_add_relu on the CPU's native half passes (f32
/// parameters and running statistics): row-major and channels-last, training and evaluation,
/// odd channel counts and sizes (vector tails), a 2-D input, and an input large enough to
/// split into several units and run in parallel. Checks that the half output is the op's own
/// node (no f32 detour through casts) and keeps the input's memory format.
pub fn batch_norms_native(dtype: DType) {
    use tandem_core::MemoryFormat;
    use tandem_ops as ops;
    let device = Device::Cpu;
    let shapes: [&[usize]; 4] = [&[4, 3, 5, 5], &[3, 5, 7, 3], &[4, 3, 70, 70], &[6, 5]];
    for (s, &shape) in shapes.iter().enumerate() {
        let c = shape[1];
        let seed = 40 + 10 * s as u64;
        let x = randn(shape, 2.0, seed, device);
        let residual = randn(shape, 1.0, seed + 1, device);
        let weight = uniform(&[c], 0.5, 1.5, seed + 2, device);
        let bias = randn(&[c], 0.5, seed + 3, device);
        let formats: &[MemoryFormat] = if shape.len() == 4 {
            &[MemoryFormat::Contiguous, MemoryFormat::ChannelsLast]
        } else {
            &[MemoryFormat::Contiguous]
        };
        for (&format, training, epilogue) in formats
            .iter()
            .flat_map(|f| [true, false].map(move |t| (f, t)))
            .flat_map(|(f, t)| [0, 1, 2].map(move |e| (f, t, e)))
        {
            let stats = || {
                (
                    randn(&[c], 0.1, seed + 4, device),
                    uniform(&[c], 0.5, 2.0, seed + 5, device),
                )
            };
            let ((mean_l, var_l), (mean_r, var_r)) = (stats(), stats());
            let mut inputs = vec![low(x.clone()), full(weight.clone()), full(bias.clone())];
            if epilogue == 2 {
                inputs.push(low(residual.clone()));
            }
            let calls = std::cell::Cell::new(0);
            let what = format!("{shape:?} {format:?} epilogue {epilogue} training {training}");
            check_op(&what, dtype, &inputs, |t| {
                let half_call = calls.replace(calls.get() + 1) == 0;
                let (m, v) = if half_call {
                    (&mean_l, &var_l)
                } else {
                    (&mean_r, &var_r)
                };
                let (w, b) = (Some(&t[1]), Some(&t[2]));
                let x = ops::to_memory_format(&t[0], format)?;
                let (y, name) = match epilogue {
                    0 => (
                        ops::batch_norm(&x, Some(m), Some(v), w, b, training, 0.1, 1e-5)?,
                        "batch_norm",
                    ),
                    1 => (
                        ops::batch_norm_relu(&x, Some(m), Some(v), w, b, training, 0.1, 1e-5)?,
                        "batch_norm_relu",
                    ),
                    _ => {
                        let r = ops::to_memory_format(&t[3], format)?;
                        let y = ops::batch_norm_add_relu(
                            &x,
                            &r,
                            Some(m),
                            Some(v),
                            w,
                            b,
                            training,
                            0.1,
                            1e-5,
                        )?;
                        (y, "batch_norm_add_relu")
                    }
                };
                if half_call {
                    assert_eq!(
                        y.grad_fn().map(|n| n.name()),
                        Some(name),
                        "{what}: native node"
                    );
                    assert!(y.is_contiguous_in(format), "{what}: output format");
                }
                Ok(y)
            });
            for (l, r, name) in [
                (&mean_l, &mean_r, "running_mean"),
                (&var_l, &var_r, "running_var"),
            ] {
                assert_rounded(
                    l,
                    r,
                    DType::F32,
                    &format!("{what}: {name} after a {dtype} step"),
                );
            }
        }
    }
}

/// Dropout (the same seed drops the same elements), cat, contiguous and the views.
pub fn data_movement(device: Device, dtype: DType) {
    use tandem_ops as ops;
    let x = randn(&[4, 6], 1.0, 18, device);
    let y = randn(&[2, 6], 1.0, 19, device);
    check_op("dropout", dtype, &[low(x.clone())], |t| {
        ops::dropout(&t[0], 0.3, true, &mut Generator::new(5))
    });
    check_op("cat", dtype, &[low(x.clone()), low(y)], |t| {
        ops::cat(&[&t[0], &t[1]], 0)
    });
    check_op("contiguous of a transpose", dtype, &[low(x.clone())], |t| {
        ops::contiguous(&ops::transpose(&t[0], 0, 1)?)
    });
    check_op("views", dtype, &[low(x)], |t| {
        let v = ops::reshape(&t[0], &[2, 2, 6])?;
        let v = ops::permute(&v, &[2, 0, 1])?;
        let v = ops::narrow(&v, 0, 1, 4)?;
        ops::contiguous(&ops::flatten(&ops::unsqueeze(&v, 0)?, 1, -1)?)
    });
}
