//! Differentiable views: reshape, transpose, permute, narrow, expand, squeeze, unsqueeze,
//! flatten — and `contiguous` and `to_memory_format`, the ones that may copy.
//!
//! A view shares storage with its input and only computes a new layout (see
//! `tandem_core::Layout`); reshape copies only when the input is not contiguous. The backward
//! of a view maps the gradient back to the input's shape: reshape back, permute back, pad a
//! narrowed gradient with zeros, sum over expanded dims.
//!
//! # Shapes
//! * `reshape(x, shape)`: same element count; one `-1` is inferred.
//! * `transpose(x, d0, d1)`, `permute(x, perm)`: dims reordered.
//! * `narrow(x, dim, start, len)`: `dim` shrinks to `len`.
//! * `expand(x, shape)`: size-1 (or missing leading) dims stretch to `shape` without a copy.
//! * `flatten(x, start, end)`: dims `start..=end` merge into one.

use tandem_autograd::record_fn;
use tandem_core::{normalize_dim, Layout, MemoryFormat, Result, Tensor};

use crate::reduce::sum_to_shape;

fn to_isize(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

/// A tensor with the same elements and a new shape (`-1` infers one dim).
pub fn reshape(x: &Tensor, shape: &[isize]) -> Result<Tensor> {
    let new_shape = x.layout().infer_shape("reshape", shape)?;
    let out = match x.layout().reshape(&new_shape) {
        Some(layout) => x.view_detached(layout)?,
        None => {
            let c = x.copy_detached()?;
            c.view_detached(Layout::contiguous(&new_shape))?
        }
    };
    let in_shape = to_isize(x.dims());
    Ok(record_fn(out, &[x], "reshape", move || {
        move |g: &Tensor| Ok(vec![Some(reshape(g, &in_shape)?)])
    }))
}

/// Swaps dims `d0` and `d1` (negative dims count from the end).
pub fn transpose(x: &Tensor, d0: isize, d1: isize) -> Result<Tensor> {
    let a = normalize_dim("transpose", d0, x.rank())?;
    let b = normalize_dim("transpose", d1, x.rank())?;
    let out = x.view_detached(x.layout().transpose("transpose", a, b)?)?;
    Ok(record_fn(out, &[x], "transpose", move || {
        move |g: &Tensor| Ok(vec![Some(transpose(g, a as isize, b as isize)?)])
    }))
}

/// Reorders dims: output dim `i` is input dim `perm[i]`.
pub fn permute(x: &Tensor, perm: &[usize]) -> Result<Tensor> {
    let out = x.view_detached(x.layout().permute("permute", perm)?)?;
    let mut inverse = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inverse[p] = i;
    }
    Ok(record_fn(out, &[x], "permute", move || {
        move |g: &Tensor| Ok(vec![Some(permute(g, &inverse)?)])
    }))
}

/// Elements `start..start+len` along `dim`.
pub fn narrow(x: &Tensor, dim: isize, start: usize, len: usize) -> Result<Tensor> {
    let d = normalize_dim("narrow", dim, x.rank())?;
    let out = x.view_detached(x.layout().narrow("narrow", d, start, len)?)?;
    let in_shape = x.dims().to_vec();
    Ok(record_fn(out, &[x], "narrow", move || {
        move |g: &Tensor| {
            let full = Tensor::zeros(&in_shape, g.dtype(), g.device())?;
            let window =
                full.view_detached(full.layout().narrow("narrow backward", d, start, len)?)?;
            window.copy_(g)?;
            Ok(vec![Some(full)])
        }
    }))
}

/// Broadcasts `x` to `shape` without copying (stride 0 along stretched dims).
pub fn expand(x: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let out = x.view_detached(x.layout().expand("expand", shape)?)?;
    let in_shape = x.dims().to_vec();
    Ok(record_fn(out, &[x], "expand", move || {
        move |g: &Tensor| Ok(vec![Some(sum_to_shape(g, &in_shape)?)])
    }))
}

/// Removes dim `dim`, which must have size 1.
pub fn squeeze(x: &Tensor, dim: isize) -> Result<Tensor> {
    let d = normalize_dim("squeeze", dim, x.rank())?;
    let out = x.view_detached(x.layout().squeeze("squeeze", d)?)?;
    Ok(record_fn(out, &[x], "squeeze", move || {
        move |g: &Tensor| Ok(vec![Some(unsqueeze(g, d as isize)?)])
    }))
}

/// Inserts a dim of size 1 at `dim` (`-1` appends).
pub fn unsqueeze(x: &Tensor, dim: isize) -> Result<Tensor> {
    let d = normalize_dim("unsqueeze", dim, x.rank() + 1)?;
    let out = x.view_detached(x.layout().unsqueeze("unsqueeze", d)?)?;
    Ok(record_fn(out, &[x], "unsqueeze", move || {
        move |g: &Tensor| Ok(vec![Some(squeeze(g, d as isize)?)])
    }))
}

/// Merges dims `start_dim..=end_dim` into one (`flatten(x, 1, -1)` turns `[N, C, H, W]` into
/// `[N, C·H·W]`).
pub fn flatten(x: &Tensor, start_dim: isize, end_dim: isize) -> Result<Tensor> {
    if x.rank() == 0 {
        return reshape(x, &[1]);
    }
    let s = normalize_dim("flatten", start_dim, x.rank())?;
    let e = normalize_dim("flatten", end_dim, x.rank())?;
    if s > e {
        return Err(tandem_core::Error::invalid(
            "flatten",
            format!("start dim {s} is after end dim {e}"),
        ));
    }
    let mut shape: Vec<isize> = to_isize(&x.dims()[..s]);
    shape.push(x.dims()[s..=e].iter().product::<usize>() as isize);
    shape.extend(to_isize(&x.dims()[e + 1..]));
    reshape(x, &shape)
}

/// The same elements in a dense row-major layout; returns `x` itself when it already is.
pub fn contiguous(x: &Tensor) -> Result<Tensor> {
    if x.is_contiguous() {
        return Ok(x.clone());
    }
    let out = x.copy_detached()?;
    Ok(record_fn(out, &[x], "contiguous", || {
        |g: &Tensor| Ok(vec![Some(g.clone())])
    }))
}

/// The same elements dense in memory format `format` (PyTorch's
/// `x.contiguous(memory_format=...)`); returns `x` itself when it already is. Channels-last
/// keeps the logical shape `[N, C, H, W]` and stores NHWC (strides `[H·W·C, 1, W·C, C]`); the
/// ops that know the format (conv2d, batch norm, pooling, elementwise) then keep it. The
/// gradient passes through unchanged (in whatever layout it arrives).
///
/// # Shapes
/// `x`: any shape for [`MemoryFormat::Contiguous`]; `[N, C, H, W]` for
/// [`MemoryFormat::ChannelsLast`] (an error naming the shape otherwise). Output: `x`'s shape.
pub fn to_memory_format(x: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    let out = x.contiguous_in(format)?;
    if out.storage().same_buffer(x.storage()) && out.layout() == x.layout() {
        return Ok(x.clone());
    }
    Ok(record_fn(out, &[x], "to_memory_format", || {
        |g: &Tensor| Ok(vec![Some(g.clone())])
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64};

    #[test]
    fn gradcheck_views() {
        let x = rand_f64(&[2, 3, 4], 1);
        check(|t| reshape(&t[0], &[4, -1]), std::slice::from_ref(&x));
        check(|t| transpose(&t[0], 0, 2), std::slice::from_ref(&x));
        check(|t| permute(&t[0], &[1, 2, 0]), std::slice::from_ref(&x));
        check(|t| narrow(&t[0], 1, 1, 2), std::slice::from_ref(&x));
        check(
            |t| contiguous(&transpose(&t[0], 1, 2)?),
            std::slice::from_ref(&x),
        );
        check(|t| flatten(&t[0], 1, -1), std::slice::from_ref(&x));
        check(|t| squeeze(&unsqueeze(&t[0], 1)?, 1), &[x]);
        check(|t| expand(&t[0], &[2, 3, 4]), &[rand_f64(&[3, 1], 2)]);
    }

    #[test]
    fn reshape_of_a_transposed_tensor_copies_and_keeps_order() {
        let x = Tensor::from_vec(
            (0..6).map(|v| v as f32).collect(),
            &[2, 3],
            tandem_core::Device::Cpu,
        )
        .unwrap();
        let t = transpose(&x, 0, 1).unwrap();
        assert_eq!(
            reshape(&t, &[6]).unwrap().to_vec::<f32>().unwrap(),
            vec![0., 3., 1., 4., 2., 5.]
        );
        let err = reshape(&x, &[4, 2]).unwrap_err().to_string();
        assert!(err.contains("reshape"), "{err}");
    }
}
