//! softmax and log_softmax along one dim, numerically stable.
//!
//! Both subtract each group's maximum before exponentiating, so logits of any magnitude
//! (1000, −1000) give finite results; log_softmax is computed as `(x − max) − ln Σ e^(x − max)`
//! rather than as the log of a softmax, so it stays accurate where softmax underflows to 0.
//! Both save only their output for backward.
//!
//! # Shapes
//! `x`: any shape of rank ≥ 1, f32 or f64 → output: the same shape; every slice along `dim`
//! is normalised independently.

mod cpu;
pub mod cuda;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{normalize_dim, with_float_type, Device, Result, Tensor};

use crate::checks::float_dtype;
use shape::Split;

fn softmax_impl(op: &'static str, x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    float_dtype(op, x)?;
    let d = normalize_dim(op, dim, x.rank())?;
    let split = Split::around(x.dims(), d);
    let out = match x.device() {
        Device::Cpu => with_float_type!(op, x.dtype(), T => cpu::forward::<T>(x, split, log))?,
        Device::Cuda(_) => cuda::forward(op, x, split, log)?,
    };
    let y = out.detach();
    Ok(record_fn(out, &[x], op, move || {
        move |g: &Tensor| {
            let dx = match g.device() {
                Device::Cpu => {
                    with_float_type!(op, g.dtype(), T => cpu::backward::<T>(g, &y, split, log))?
                }
                Device::Cuda(_) => cuda::backward(op, g, &y, split, log)?,
            };
            Ok(vec![Some(dx)])
        }
    }))
}

/// `e^(x_i) / Σ_j e^(x_j)` over `dim` (negative counts from the end).
///
/// # Shapes
/// `x`: `[d0, …, dn]` (rank ≥ 1) → output: the same shape; each slice along `dim` sums to 1.
pub fn softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("softmax", tandem_core::profile::Phase::Forward);
    let x = &crate::autocast::to_f32(x)?; // autocast's f32 list
    softmax_impl("softmax", x, dim, false)
}

/// `x_i − ln Σ_j e^(x_j)` over `dim` (negative counts from the end): the log of softmax,
/// computed without forming softmax.
///
/// # Shapes
/// `x`: `[d0, …, dn]` (rank ≥ 1) → output: the same shape.
pub fn log_softmax(x: &Tensor, dim: isize) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("log_softmax", tandem_core::profile::Phase::Forward);
    let x = &crate::autocast::to_f32(x)?; // autocast's f32 list
    softmax_impl("log_softmax", x, dim, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device, Generator};

    /// softmax along `dim` of a row-major f64 array of `shape`, straight from the definition.
    fn reference(values: &[f64], shape: &[usize], dim: usize, log: bool) -> Vec<f64> {
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let n = shape[dim];
        let mut out = vec![0.0; values.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| o * n * inner + k * inner + i;
                let denom: f64 = (0..n).map(|k| values[at(k)].exp()).sum();
                for k in 0..n {
                    let p = values[at(k)].exp() / denom;
                    out[at(k)] = if log { p.ln() } else { p };
                }
            }
        }
        out
    }

    #[test]
    fn gradcheck_softmax_and_log_softmax_along_every_dim() {
        let x = rand_f64(&[3, 4, 5], 1);
        for dim in [0, 1, 2, -1] {
            check(|t| softmax(&t[0], dim), std::slice::from_ref(&x));
            check(|t| log_softmax(&t[0], dim), std::slice::from_ref(&x));
        }
        check(|t| softmax(&t[0], 0), &[rand_f64(&[6], 2)]);
        for dim in [0, 1] {
            let nc = rand_f64_noncontiguous(&[4, 5], 3);
            check(|t| softmax(&t[0], dim), std::slice::from_ref(&nc));
            check(|t| log_softmax(&t[0], dim), &[nc]);
        }
    }

    #[test]
    fn values_match_the_definition_and_rows_sum_to_one() {
        let mut g = Generator::new(4);
        // large enough for the parallel path; dims 1 (strided columns) and 2 (rows)
        let x = Tensor::randn(&[8, 64, 90], 0.0, 3.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let values: Vec<f64> = x.to_vec_f64().unwrap();
        for dim in [1usize, 2] {
            for log in [false, true] {
                let y = if log {
                    log_softmax(&x, dim as isize)
                } else {
                    softmax(&x, dim as isize)
                };
                let y = y.unwrap().to_vec_f64().unwrap();
                let want = reference(&values, x.dims(), dim, log);
                for (k, (a, b)) in y.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 2e-6 * b.abs().max(1.0), "{k}: {a} vs {b}");
                }
            }
            let sums =
                crate::reduce::sum(&softmax(&x, dim as isize).unwrap(), &[dim as isize], false)
                    .unwrap()
                    .to_vec_f64()
                    .unwrap();
            assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
        }
    }

    #[test]
    fn large_logits_stay_finite_and_match_shifted_ones() {
        let x = Tensor::from_vec(
            vec![1000.0f32, 1001.0, 1002.0, -1000.0, -1001.0, -1002.0],
            &[2, 3],
            Device::Cpu,
        )
        .unwrap();
        let p = softmax(&x, 1).unwrap().to_vec_f64().unwrap();
        let lp = log_softmax(&x, 1).unwrap().to_vec_f64().unwrap();
        let small = reference(&[0.0, 1.0, 2.0, 0.0, -1.0, -2.0], &[2, 3], 1, false);
        let log_small = reference(&[0.0, 1.0, 2.0, 0.0, -1.0, -2.0], &[2, 3], 1, true);
        for k in 0..6 {
            assert!(p[k].is_finite() && lp[k].is_finite());
            assert!((p[k] - small[k]).abs() < 1e-6, "{p:?}");
            assert!((lp[k] - log_small[k]).abs() < 1e-5, "{lp:?}");
        }
        // one huge logit: softmax saturates to one-hot, log_softmax keeps the exact gap
        let y = Tensor::from_vec(vec![0.0f32, 1000.0], &[1, 2], Device::Cpu).unwrap();
        assert_eq!(
            softmax(&y, -1).unwrap().to_vec::<f32>().unwrap(),
            vec![0.0, 1.0]
        );
        assert_eq!(
            log_softmax(&y, -1).unwrap().to_vec::<f32>().unwrap(),
            vec![-1000.0, 0.0]
        );
    }

    #[test]
    fn bad_input_is_an_error_naming_the_op() {
        let labels = Tensor::zeros(&[2, 3], DType::I64, Device::Cpu).unwrap();
        let err = softmax(&labels, 1).unwrap_err().to_string();
        assert!(err.starts_with("softmax:") && err.contains("i64"), "{err}");
        let x = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let err = log_softmax(&x, 2).unwrap_err().to_string();
        assert!(
            err.contains("log_softmax") && err.contains("out of range"),
            "{err}"
        );
        let empty = Tensor::zeros(&[0, 3], DType::F32, Device::Cpu).unwrap();
        assert_eq!(softmax(&empty, 1).unwrap().dims(), &[0, 3]);
        let empty = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu).unwrap();
        assert_eq!(log_softmax(&empty, 0).unwrap().dims(), &[2, 0]);
    }
}
