//! The scaler's unscale and check on the CPU: one pass over each gradient, parallel over
//! chunks of it, multiplying by `1 / scale` and noting any infinity or NaN.
//!
//! Gradients are processed one after another (each in parallel): gradients that are views into
//! one communication bucket share a storage lock, so they cannot be borrowed all at once.

use std::ops::Mul;

use rayon::prelude::*;
use tandem_core::{DType, Element, Tensor};

use super::{copy_back, dense_gradients};
use crate::Result;

/// Elements per parallel task (as the CUDA path's chunks).
const CHUNK: usize = crate::multi_tensor::CHUNK_ELEMENTS as usize;

/// Multiplies every element of `grads` (f32 or f64, in host memory) by `inv_scale` converted
/// to its dtype, and returns whether any element was infinite or NaN before that.
pub(super) fn unscale(grads: &[Tensor], inv_scale: f64) -> Result<bool> {
    let dense = dense_gradients(grads)?;
    let mut found = false;
    for g in &dense {
        found |= match g.dtype() {
            DType::F32 => unscale_slice(&mut g.write_slice::<f32>()?, inv_scale, f32::is_finite),
            DType::F64 => unscale_slice(&mut g.write_slice::<f64>()?, inv_scale, f64::is_finite),
            other => unreachable!("the scaler checked the dtype, got {other}"),
        };
    }
    copy_back(grads, &dense)?;
    Ok(found)
}

/// One gradient's pass; the check is on the value before the multiplication, as on the device.
fn unscale_slice<T: Element + Mul<Output = T>>(
    values: &mut [T],
    inv_scale: f64,
    finite: fn(T) -> bool,
) -> bool {
    let inv = T::from_f64(inv_scale);
    values
        .par_chunks_mut(CHUNK)
        .map(|chunk| {
            let mut found = false;
            for x in chunk {
                found |= !finite(*x);
                *x = *x * inv;
            }
            found
        })
        .reduce(|| false, |a, b| a || b)
}
