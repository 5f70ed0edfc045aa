//! Reductions over dims: sum and mean (and `max` in `max.rs`).
//!
//! # Shapes
//! `dims` lists the dims to reduce (negative count from the end; empty means all). With
//! `keepdim` the reduced dims stay with size 1, otherwise they are removed.
//! Backward broadcasts the output gradient back over the reduced dims.

mod cpu;
pub mod cuda;
mod max;

use tandem_autograd::record_fn;
use tandem_core::{normalize_dim, Device, Error, Result, Tensor};

use crate::checks::float_dtype;
use crate::views::{expand, reshape};

pub use max::{argmax, max};

/// Resolves the dims to reduce: sorted, unique, non-negative. Empty means every dim.
pub(crate) fn resolve_dims(op: &'static str, x: &Tensor, dims: &[isize]) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..x.rank()).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let d = normalize_dim(op, d, x.rank())?;
        if out.contains(&d) {
            return Err(Error::invalid(
                op,
                format!("dim {d} listed twice in {dims:?}"),
            ));
        }
        out.push(d);
    }
    out.sort_unstable();
    Ok(out)
}

/// The output shape with reduced dims kept as size 1.
pub(crate) fn keepdim_shape(x: &Tensor, dims: &[usize]) -> Vec<usize> {
    x.dims()
        .iter()
        .enumerate()
        .map(|(i, &n)| if dims.contains(&i) { 1 } else { n })
        .collect()
}

fn squeeze_shape(x: &Tensor, dims: &[usize]) -> Vec<isize> {
    x.dims()
        .iter()
        .enumerate()
        .filter(|(i, _)| !dims.contains(i))
        .map(|(_, &n)| n as isize)
        .collect()
}

/// Sum over `dims` (all dims when empty).
pub fn sum(x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("sum", tandem_core::profile::Phase::Forward);
    let x = &crate::autocast::to_f32(x)?; // autocast's f32 list
    scaled_sum("sum", x, dims, keepdim, 1.0)
}

/// `scale ·` the sum over `dims`: `sum` (scale 1) and `mean` (1 / count) in one kernel, with
/// one backward (the output gradient broadcast back, times `scale`).
fn scaled_sum(
    op: &'static str,
    x: &Tensor,
    dims: &[isize],
    keepdim: bool,
    scale: f64,
) -> Result<Tensor> {
    float_dtype(op, x)?;
    let dims = resolve_dims(op, x, dims)?;
    let kept = keepdim_shape(x, &dims);
    let out = match x.device() {
        Device::Cpu => cpu::sum_kept(x, &dims, &kept, scale)?,
        Device::Cuda(_) => cuda::sum(op, x, &dims, &kept, scale)?,
    };
    let out = if keepdim {
        out
    } else {
        out.view_detached(tandem_core::Layout::contiguous(&squeeze_to_usize(x, &dims)))?
    };
    let in_shape = x.dims().to_vec();
    let kept_i: Vec<isize> = kept.iter().map(|&d| d as isize).collect();
    Ok(record_fn(out, &[x], op, move || {
        move |g: &Tensor| {
            let grad = match g.device() {
                Device::Cpu => {
                    let spread =
                        crate::views::contiguous(&expand(&reshape(g, &kept_i)?, &in_shape)?)?;
                    if scale == 1.0 {
                        spread
                    } else {
                        crate::binary::mul_scalar(&spread, scale)?
                    }
                }
                Device::Cuda(_) => cuda::sum_backward(op, g, &in_shape, &dims, scale)?,
            };
            Ok(vec![Some(grad)])
        }
    }))
}

fn squeeze_to_usize(x: &Tensor, dims: &[usize]) -> Vec<usize> {
    squeeze_shape(x, dims)
        .into_iter()
        .map(|d| d as usize)
        .collect()
}

/// Sum of every element, as a 0-dim tensor.
pub fn sum_all(x: &Tensor) -> Result<Tensor> {
    sum(x, &[], false)
}

/// The dims of `from` that were broadcast to reach it from `to` (leading dims that `to` lacks,
/// and dims where `to` has size 1), as indices into `from`.
pub(crate) fn broadcast_dims(from: &[usize], to: &[usize]) -> Vec<usize> {
    let lead = from.len() - to.len();
    (0..from.len())
        .filter(|&d| d < lead || (to[d - lead] == 1 && from[d] != 1))
        .collect()
}

/// Sums a gradient of a broadcast shape down to `target` (the shape of the input that was
/// broadcast): the backward of every broadcasting op.
pub(crate) fn sum_to_shape(grad: &Tensor, target: &[usize]) -> Result<Tensor> {
    if grad.dims() == target {
        return Ok(grad.clone());
    }
    let dims: Vec<isize> = broadcast_dims(grad.dims(), target)
        .into_iter()
        .map(|d| d as isize)
        .collect();
    let summed = sum(grad, &dims, true)?;
    let shape: Vec<isize> = target.iter().map(|&d| d as isize).collect();
    reshape(&summed, &shape)
}

/// Mean over `dims` (all dims when empty).
pub fn mean(x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("mean", tandem_core::profile::Phase::Forward);
    let resolved = resolve_dims("mean", x, dims)?;
    let count: usize = resolved.iter().map(|&d| x.dims()[d]).product();
    if count == 0 {
        return Err(Error::invalid(
            "mean",
            format!("mean over an empty set of elements (shape {:?})", x.dims()),
        ));
    }
    scaled_sum("mean", x, dims, keepdim, 1.0 / count as f64)
}

/// Mean of every element, as a 0-dim tensor.
pub fn mean_all(x: &Tensor) -> Result<Tensor> {
    mean(x, &[], false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::Device;

    #[test]
    fn gradcheck_sum_and_mean() {
        let x = rand_f64(&[2, 3, 4], 3);
        check(|t| sum(&t[0], &[1], false), std::slice::from_ref(&x));
        check(|t| sum(&t[0], &[0, 2], true), std::slice::from_ref(&x));
        check(|t| sum_all(&t[0]), std::slice::from_ref(&x));
        check(|t| mean(&t[0], &[-1], true), std::slice::from_ref(&x));
        check(
            |t| mean(&t[0], &[0, 2], false),
            &[rand_f64_noncontiguous(&[3, 4, 5], 4)],
        );
    }

    #[test]
    fn sum_matches_a_direct_loop() {
        let x =
            Tensor::from_vec((0..24).map(|v| v as f64).collect(), &[2, 3, 4], Device::Cpu).unwrap();
        let s = sum(&x, &[0, 2], false).unwrap();
        let expect: Vec<f64> = (0..3)
            .map(|j| {
                (0..2)
                    .flat_map(|i| (0..4).map(move |k| (i * 12 + j * 4 + k) as f64))
                    .sum()
            })
            .collect();
        assert_eq!(s.dims(), &[3]);
        assert_eq!(s.to_vec::<f64>().unwrap(), expect);
        assert!(sum(&x, &[3], false)
            .unwrap_err()
            .to_string()
            .contains("out of range"));
    }
}
