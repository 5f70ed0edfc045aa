//! Clipping on the CPU: the norm by host loops in f64, then each gradient scaled in place.

use tandem_core::{DType, Tensor};

use super::non_finite;
use crate::Result;

/// Measures and, when needed, scales `grads` (all in host memory, at least one).
pub(super) fn clip(grads: &[Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    let total = total_norm(grads, norm_type)?;
    if !total.is_finite() {
        return Err(non_finite(total, norm_type, grads.len()));
    }
    let coefficient = max_norm / (total + 1e-6);
    if coefficient < 1.0 {
        for g in grads {
            g.scale_(coefficient)?;
        }
    }
    Ok(total)
}

/// The norm of order `p` of all elements of `grads` together.
fn total_norm(grads: &[Tensor], p: f64) -> Result<f64> {
    if p == f64::INFINITY {
        let mut max = 0.0f64;
        for g in grads {
            for_each_value(g, |x| {
                let a = x.abs();
                // NaN must win, so that a NaN gradient is reported rather than hidden.
                if a > max || a.is_nan() {
                    max = a;
                }
            })?;
        }
        return Ok(max);
    }
    let mut sum = 0.0f64;
    for g in grads {
        if p == 2.0 {
            for_each_value(g, |x| sum += x * x)?;
        } else if p == 1.0 {
            for_each_value(g, |x| sum += x.abs())?;
        } else {
            for_each_value(g, |x| sum += x.abs().powf(p))?;
        }
    }
    Ok(sum.powf(1.0 / p))
}

/// Calls `f` on every element of `t` as f64, reading contiguous f32 / f64 tensors in place.
fn for_each_value(t: &Tensor, mut f: impl FnMut(f64)) -> Result<()> {
    if t.is_contiguous() {
        match t.dtype() {
            DType::F32 => {
                t.read_slice::<f32>()?.iter().for_each(|&x| f(x as f64));
                return Ok(());
            }
            DType::F64 => {
                t.read_slice::<f64>()?.iter().for_each(|&x| f(x));
                return Ok(());
            }
            _ => {}
        }
    }
    t.to_vec_f64()?.into_iter().for_each(f);
    Ok(())
}
