//! Elementwise unary ops: neg, exp, log, sqrt, pow_scalar, relu, sigmoid, tanh.
//!
//! # Shapes
//! The output has the input's shape, dense in the input's memory format when the input is
//! dense in one (channels-last in, channels-last out, on both devices), row-major otherwise. Inputs are f32 or f64,
//! or f16/bf16, which compute in f32 and round the output once (relu on the CPU in one pass
//! over the halves, the others through the f32 kernels). Ops whose derivative is cheapest from
//! the output (exp, sqrt, relu, sigmoid, tanh) save the output for backward; the others save
//! the input. Out-of-domain inputs (log or sqrt of a negative number) give NaN, as in IEEE
//! arithmetic, rather than an error.

mod cpu;
pub mod cuda;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{Device, Result, Tensor};

use crate::checks::float_dtype;

pub use shape::UnaryKind;

fn unary(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    if x.dtype().is_half() {
        if matches!((kind, x.device()), (UnaryKind::Relu, Device::Cpu)) {
            return relu_half_cpu(x);
        }
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| unary(kind, &w[0]));
    }
    let name = kind.name();
    let _profile = tandem_core::profile::scope(name, tandem_core::profile::Phase::Forward);
    float_dtype(name, x)?;
    let out = match x.device() {
        Device::Cpu => cpu::forward(kind, x)?,
        Device::Cuda(_) => cuda::forward(kind, x)?,
    };
    let saved = if kind.saves_output() {
        out.detach()
    } else {
        x.detach()
    };
    Ok(record_fn(out, &[x], name, move || {
        move |g: &Tensor| Ok(vec![Some(backward(kind, g, &saved)?)])
    }))
}

/// relu of a half tensor on the CPU in one pass (loaded as halves, compared in f32, stored as
/// halves), with the backward's mask in the same style: no widened copies.
fn relu_half_cpu(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "relu";
    let _profile = tandem_core::profile::scope(OP, tandem_core::profile::Phase::Forward);
    let out = crate::cpu::half::relu(OP, x)?;
    let saved = out.detach();
    Ok(record_fn(out, &[x], OP, move || {
        move |g: &Tensor| Ok(vec![Some(relu_backward(g, &saved)?)])
    }))
}

/// The gradient of `kind`'s input from the output gradient `g` and what the forward saved.
fn backward(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    if matches!((kind, g.device()), (UnaryKind::Relu, Device::Cpu)) && g.dtype().is_half() {
        return crate::cpu::half::relu_backward("relu backward", g, saved);
    }
    match g.device() {
        Device::Cpu => cpu::backward(kind, g, saved),
        Device::Cuda(_) => cuda::backward(kind, g, saved),
    }
}

/// `−x`, elementwise.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn neg(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Neg, x)
}

/// `eˣ`, elementwise.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn exp(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Exp, &crate::autocast::to_f32(x)?) // autocast's f32 list
}

/// The natural logarithm, elementwise (NaN for negative inputs, −∞ at 0).
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn log(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Log, &crate::autocast::to_f32(x)?) // autocast's f32 list
}

/// The square root, elementwise (NaN for negative inputs).
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn sqrt(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Sqrt, x)
}

/// `xᵖ` for a scalar exponent `p`, elementwise. Integer exponents use repeated
/// multiplication (`powi`), so negative bases are fine for them; a fractional power of a
/// negative number is NaN. `p` must be finite.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn pow_scalar(x: &Tensor, p: f64) -> Result<Tensor> {
    if !p.is_finite() {
        return Err(tandem_core::Error::invalid(
            "pow_scalar",
            format!("exponent must be finite, got {p}"),
        ));
    }
    unary(UnaryKind::Pow(p), &crate::autocast::to_f32(x)?) // autocast's f32 list
}

/// `max(x, 0)`, elementwise (NaN stays NaN). The gradient at exactly 0 is taken as 0.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Relu, x)
}

/// The gradient of [`relu`]'s input from the output gradient `g` and its output `y`: `g` where
/// `y > 0`, else 0 (for fused ops that end in a ReLU).
pub(crate) fn relu_backward(g: &Tensor, y: &Tensor) -> Result<Tensor> {
    backward(UnaryKind::Relu, g, y)
}

/// The logistic function `1 / (1 + e⁻ˣ)`, elementwise.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Sigmoid, x)
}

/// The hyperbolic tangent, elementwise.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn tanh(x: &Tensor) -> Result<Tensor> {
    unary(UnaryKind::Tanh, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device, Generator};

    type UnaryFn = fn(&Tensor) -> Result<Tensor>;
    type Reference = fn(f64) -> f64;

    /// Moves the values of a leaf into `[lo, lo + 2)` (they start in `[-1, 1)`), in place.
    fn shift_into(t: Tensor, lo: f64) -> Tensor {
        t.map_inplace_f64("test", |v| v + 1.0 + lo).unwrap();
        t
    }

    /// Pushes the values of a leaf at least `gap` away from 0, in place.
    fn away_from_zero(t: Tensor, gap: f64) -> Tensor {
        t.map_inplace_f64("test", |v| if v < 0.0 { v - gap } else { v + gap })
            .unwrap();
        t
    }

    #[test]
    fn gradcheck_every_unary_op_on_contiguous_and_strided_inputs() {
        let all_reals: [(&str, UnaryFn); 4] = [
            ("neg", neg),
            ("exp", exp),
            ("sigmoid", sigmoid),
            ("tanh", tanh),
        ];
        let positive_only: [(&str, UnaryFn); 2] = [("log", log), ("sqrt", sqrt)];
        for (seed, shape) in [&[7][..], &[3, 4], &[2, 3, 5]].iter().enumerate() {
            let seed = seed as u64;
            for (_, f) in all_reals {
                check(|t| f(&t[0]), &[rand_f64(shape, seed)]);
            }
            for (_, f) in positive_only {
                check(|t| f(&t[0]), &[shift_into(rand_f64(shape, seed), 0.2)]);
            }
            check(
                |t| relu(&t[0]),
                &[away_from_zero(rand_f64(shape, seed), 0.05)],
            );
        }
        for (_, f) in all_reals {
            check(|t| f(&t[0]), &[rand_f64_noncontiguous(&[3, 4], 11)]);
        }
        for (_, f) in positive_only {
            let x = shift_into(rand_f64_noncontiguous(&[2, 3, 4], 12), 0.2);
            check(|t| f(&t[0]), &[x]);
        }
        let x = away_from_zero(rand_f64_noncontiguous(&[4, 5], 13), 0.05);
        check(|t| relu(&t[0]), &[x]);
    }

    #[test]
    fn gradcheck_pow_scalar_for_integer_fractional_and_negative_exponents() {
        for (i, p) in [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 1.7, -0.3]
            .iter()
            .enumerate()
        {
            let x = shift_into(rand_f64(&[3, 4], i as u64), 0.3);
            check(|t| pow_scalar(&t[0], *p), &[x]);
        }
        // integer powers of negative bases are well defined
        check(
            |t| pow_scalar(&t[0], 3.0),
            &[rand_f64_noncontiguous(&[3, 4], 5)],
        );
    }

    /// Each op on f32 against the f64 formula, on a tensor large enough to take the parallel
    /// path and on a strided one.
    #[test]
    fn f32_values_match_the_f64_formulas() {
        let refs: [(UnaryFn, Reference); 7] = [
            (neg, |v| -v),
            (exp, f64::exp),
            (log, |v| v.abs().ln()),
            (sqrt, |v| v.abs().sqrt()),
            (relu, |v| v.max(0.0)),
            (sigmoid, |v| 1.0 / (1.0 + (-v).exp())),
            (tanh, f64::tanh),
        ];
        let mut g = Generator::new(3);
        let x = Tensor::randn(&[200, 300], 0.0, 2.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let xs = x.to_vec::<f32>().unwrap();
        let abs_x =
            Tensor::from_vec(xs.iter().map(|v| v.abs()).collect(), x.dims(), Device::Cpu).unwrap();
        let strided = x
            .view_detached(x.layout().transpose("test", 0, 1).unwrap())
            .unwrap();
        for (i, (f, reference)) in refs.iter().enumerate() {
            // log and sqrt get |x|
            let input = if i == 2 || i == 3 { &abs_x } else { &x };
            let got = f(input).unwrap().to_vec::<f32>().unwrap();
            for (k, (&v, &xv)) in got.iter().zip(&xs).enumerate() {
                let want = reference(xv as f64);
                let tol = 1e-6 * want.abs().max(1.0);
                assert!(
                    ((v as f64) - want).abs() <= tol,
                    "op {i} element {k}: {v} vs {want}"
                );
            }
            if i != 2 && i != 3 {
                let got_t = f(&strided).unwrap();
                assert_eq!(got_t.dims(), &[300, 200]);
                let got_t = got_t.to_vec::<f32>().unwrap();
                let want_t: Vec<f64> = strided
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|&v| reference(v as f64))
                    .collect();
                for (v, w) in got_t.iter().zip(&want_t) {
                    assert!(((*v as f64) - w).abs() <= 1e-6 * w.abs().max(1.0));
                }
            }
        }
        let p = pow_scalar(&x, 3.0).unwrap().to_vec::<f32>().unwrap();
        for (v, &xv) in p.iter().zip(&xs) {
            let want = (xv as f64).powi(3);
            assert!(((*v as f64) - want).abs() <= 1e-6 * want.abs().max(1.0));
        }
    }

    #[test]
    fn sigmoid_and_tanh_saturate_without_nan_for_large_inputs() {
        let x = Tensor::from_vec(
            vec![-1000.0f32, -50.0, 0.0, 50.0, 1000.0],
            &[5],
            Device::Cpu,
        )
        .unwrap();
        let s = sigmoid(&x).unwrap().to_vec::<f32>().unwrap();
        assert_eq!([s[0], s[2], s[3], s[4]], [0.0, 0.5, 1.0, 1.0]);
        let want = 1.0 / (1.0 + 50f64.exp());
        assert!(
            ((s[1] as f64) - want).abs() <= 1e-6 * want,
            "{} vs {want}",
            s[1]
        );
        assert_eq!(
            tanh(&x).unwrap().to_vec::<f32>().unwrap(),
            vec![-1.0, -1.0, 0.0, 1.0, 1.0]
        );
    }

    #[test]
    fn relu_zeroes_negatives_and_keeps_nan() {
        let x = Tensor::from_vec(vec![-2.0f32, -0.0, 0.5, f32::NAN], &[4], Device::Cpu).unwrap();
        let y = relu(&x).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(&y[..3], &[0.0, 0.0, 0.5]);
        assert!(y[3].is_nan());
    }

    #[test]
    fn zero_size_inputs_give_zero_size_outputs() {
        let empty = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        for f in [neg, exp, log, sqrt, relu, sigmoid, tanh] {
            let y = f(&empty).unwrap();
            assert_eq!(y.dims(), &[2, 0]);
            tandem_autograd::backward(&y, Some(&y.zeros_like().unwrap()), &Default::default())
                .unwrap();
        }
    }

    #[test]
    fn integer_inputs_and_infinite_exponents_are_errors_naming_the_op() {
        let labels = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
        let err = relu(&labels).unwrap_err().to_string();
        assert!(err.starts_with("relu:") && err.contains("i64"), "{err}");
        let err = exp(&labels).unwrap_err().to_string();
        assert!(err.starts_with("exp:"), "{err}");
        let x = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
        let err = pow_scalar(&x, f64::INFINITY).unwrap_err().to_string();
        assert!(
            err.starts_with("pow_scalar:") && err.contains("inf"),
            "{err}"
        );
    }
}
