//! CPU kernels of the reductions: sum, and the maximum over dims with the position of the first
//! maximum of each group (for `max`, its backward and `argmax`).
//!
//! The reduced dims are moved last (a copy only when they are not already trailing dims of a
//! contiguous input), then each output element reduces one contiguous block.

use rayon::prelude::*;
use tandem_core::{with_float_type, Element, FloatElement, Layout, Result, Tensor};

use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// `x` with the dims in `dims` moved last, contiguous: each group of reduced elements is then
/// one block of `inner` elements. Returns the copy and `(outer, inner)`.
fn grouped(op: &'static str, x: &Tensor, dims: &[usize]) -> Result<(Tensor, usize, usize)> {
    let keep: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = keep.iter().chain(dims.iter()).copied().collect();
    let permuted = x.view_detached(x.layout().permute(op, &perm)?)?;
    let inner: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let outer: usize = keep.iter().map(|&d| x.dims()[d]).product();
    Ok((memory::contiguous(op, &permuted)?, outer, inner))
}

/// `scale ·` the sum over `dims`, returning a tensor of shape `kept` (reduced dims of size 1).
pub(crate) fn sum_kept(x: &Tensor, dims: &[usize], kept: &[usize], scale: f64) -> Result<Tensor> {
    const OP: &str = "sum";
    let (c, outer, inner) = grouped(OP, x, dims)?;
    with_float_type!(OP, x.dtype(), T => {
        let mut out = memory::uninit::<T>(OP, outer)?;
        if inner == 0 {
            out.fill(T::ZERO);
        } else {
            let data = c.read_slice::<T>()?;
            if parallel(outer * inner) && outer > 1 {
                out.par_iter_mut().zip(data.par_chunks(inner)).for_each(|(o, b)| *o = block_sum(b));
            } else {
                out.iter_mut().zip(data.chunks(inner)).for_each(|(o, b)| *o = block_sum(b));
            }
        }
        if scale != 1.0 {
            let s = T::from_f64(scale);
            out.iter_mut().for_each(|o| *o *= s);
        }
        Tensor::from_vec(out, kept, x.device())
    })
}

/// Pairwise-ish summation in 8 lanes: vectorises, and loses less precision than one running
/// sum over long blocks.
fn block_sum<T: FloatElement>(block: &[T]) -> T {
    let mut lanes = [T::ZERO; 8];
    let chunks = block.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    let mut total = T::ZERO;
    for l in lanes {
        total += l;
    }
    for &r in rest {
        total += r;
    }
    total
}

/// For each group of `x` over `dims` (the caller has checked that no group is empty): its
/// maximum and the position of its first maximum within the group (row-major over the
/// reduced dims), as a tensor of `x`'s dtype and an i64 tensor, both of shape `kept`.
pub(crate) fn max(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
    kept: &[usize],
) -> Result<(Tensor, Tensor)> {
    with_float_type!(op, x.dtype(), T => {
        let (values, positions) = reduce_max::<T>(op, x, dims)?;
        Ok((Tensor::from_vec(values, kept, x.device())?, Tensor::from_vec(positions, kept, x.device())?))
    })
}

fn reduce_max<T: FloatElement>(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
) -> Result<(Vec<T>, Vec<i64>)> {
    let (c, outer, inner) = grouped(op, x, dims)?;
    let mut values = memory::uninit::<T>(op, outer)?;
    let mut positions = memory::uninit::<i64>(op, outer)?;
    if outer == 0 {
        return Ok((values, positions));
    }
    let data = c.read_slice::<T>()?;
    let each = |((v, p), block): ((&mut T, &mut i64), &[T])| {
        let (best, at) = first_max(block);
        (*v, *p) = (best, at as i64);
    };
    if parallel(outer * inner) && outer > 1 {
        values
            .par_iter_mut()
            .zip(positions.par_iter_mut())
            .zip(data.par_chunks(inner))
            .for_each(each);
    } else {
        values
            .iter_mut()
            .zip(positions.iter_mut())
            .zip(data.chunks(inner))
            .for_each(each);
    }
    drop(data);
    Ok((values, positions))
}

/// The first maximum of a non-empty block and its index (NaN beats every number).
fn first_max<T: FloatElement>(block: &[T]) -> (T, usize) {
    let mut best = block[0];
    let mut at = 0;
    for (i, &v) in block.iter().enumerate().skip(1) {
        if v > best || (v.is_nan() && !best.is_nan()) {
            best = v;
            at = i;
        }
    }
    (best, at)
}

/// The backward of `max`: a zero tensor of `shape` with each element of `g` (one per group,
/// row-major over the kept dims) written at its group's first maximum, given by `positions`
/// (as returned by [`max`]).
pub(crate) fn max_backward(
    g: &Tensor,
    positions: &Tensor,
    shape: &[usize],
    dims: &[usize],
) -> Result<Tensor> {
    const OP: &str = "max backward";
    let flat = flat_positions(shape, dims, &memory::gather::<i64>(OP, positions)?);
    with_float_type!(OP, g.dtype(), T => {
        let mut grad = memory::zeroed::<T>(OP, tandem_core::checked_numel(OP, shape)?)?;
        if !flat.is_empty() {
            let src = memory::gather::<T>(OP, g)?;
            for (&p, &v) in flat.iter().zip(src.iter()) {
                grad[p] = v;
            }
        }
        Tensor::from_vec(grad, shape, g.device())
    })
}

/// Turns per-group positions into row-major indices into the input of `shape`.
fn flat_positions(shape: &[usize], dims: &[usize], positions: &[i64]) -> Vec<usize> {
    let strides = Layout::contiguous(shape).strides().clone();
    let keep: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
    // row-major decomposition of a position within a group (or of a group number) into the
    // reduced (or kept) dims, weighted by the input's strides
    let offset_of = |mut k: usize, axes: &[usize]| -> usize {
        let mut off = 0;
        for &d in axes.iter().rev() {
            off += (k % shape[d]) * strides[d];
            k /= shape[d];
        }
        off
    };
    positions
        .iter()
        .enumerate()
        .map(|(o, &k)| offset_of(o, &keep) + offset_of(k as usize, dims))
        .collect()
}
