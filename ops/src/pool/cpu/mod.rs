//! CPU kernels of the 2-D pools. Every pool is described by its [`Windows`]: for each output
//! row and column, the (already clipped) range of input rows and columns it covers. Planes (one
//! per sample and channel) are independent and run in parallel when the input is large (and the
//! rayon pool has more than one thread). Max pooling over 2×2 windows with stride 2 and no
//! padding goes to the branch-free kernels of [`max2x2`]. Channels-last inputs go to the NHWC
//! kernels of `nhwc.rs` and give channels-last outputs and input gradients.

mod max2x2;
mod nhwc;

use rayon::prelude::*;
use tandem_core::{with_float_type, FloatElement, MemoryFormat, Result, Tensor};

use super::shape::Windows;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// Where each window's maximum came from (its index within the plane), kept by the forward of
/// a max pool for its backward, and whether the forward ran channels-last (the indices are
/// then in NHWC order and the input gradient is channels-last).
pub(crate) struct MaxIndices(Vec<u32>, bool);

/// The channel count of a channels-last 4-D `x`, when the pools take their NHWC path for it.
fn channels_last(x: &Tensor) -> Option<usize> {
    x.layout().is_channels_last().then(|| x.dims()[1])
}

/// Max pooling of `x` (`[.., H, W]`, `hw = (H, W)`) into a tensor of `shape`, with the indices
/// of the maxima when `keep_indices` (the backward needs them).
pub(crate) fn max_pool(
    op: &'static str,
    x: &Tensor,
    hw: (usize, usize),
    win: &Windows,
    keep_indices: bool,
    shape: &[usize],
) -> Result<(Tensor, MaxIndices)> {
    if let Some(c) = channels_last(x) {
        return with_float_type!(op, x.dtype(), T => {
            let (values, indices) = nhwc::max_forward::<T>(op, &x.read_dense_slice::<T>()?, hw, c, win, keep_indices)?;
            Ok((Tensor::from_vec_in(values, shape, x.device(), MemoryFormat::ChannelsLast)?, MaxIndices(indices, true)))
        });
    }
    with_float_type!(op, x.dtype(), T => {
        let xc = memory::contiguous(op, x)?;
        let (values, indices) = max_forward::<T>(op, &xc.read_slice::<T>()?, hw, win, keep_indices)?;
        Ok((Tensor::from_vec(values, shape, x.device())?, MaxIndices(indices, false)))
    })
}

/// The backward of [`max_pool`]: each output gradient routed to the input element its window's
/// maximum came from, as a tensor of `in_shape`.
pub(crate) fn max_pool_backward(
    op: &'static str,
    g: &Tensor,
    indices: &MaxIndices,
    hw: (usize, usize),
    win: &Windows,
    in_shape: &[usize],
) -> Result<Tensor> {
    if indices.1 {
        let cl = MemoryFormat::ChannelsLast;
        return with_float_type!(op, g.dtype(), T => {
            let gc = memory::dense_in(g, cl)?;
            let gx = nhwc::max_backward::<T>(op, &gc.read_dense_slice::<T>()?, &indices.0, hw, in_shape[1], win)?;
            Tensor::from_vec_in(gx, in_shape, g.device(), cl)
        });
    }
    with_float_type!(op, g.dtype(), T => {
        let gc = memory::contiguous(op, g)?;
        let gx = max_backward::<T>(op, &gc.read_slice::<T>()?, &indices.0, hw, win)?;
        Tensor::from_vec(gx, in_shape, g.device())
    })
}

/// Average pooling of `x` into a tensor of `shape`.
pub(crate) fn avg_pool(
    op: &'static str,
    x: &Tensor,
    hw: (usize, usize),
    win: &Windows,
    shape: &[usize],
) -> Result<Tensor> {
    if let Some(c) = channels_last(x) {
        return with_float_type!(op, x.dtype(), T => {
            let values = nhwc::avg_forward::<T>(op, &x.read_dense_slice::<T>()?, hw, c, win)?;
            Tensor::from_vec_in(values, shape, x.device(), MemoryFormat::ChannelsLast)
        });
    }
    with_float_type!(op, x.dtype(), T => {
        let xc = memory::contiguous(op, x)?;
        let values = avg_forward::<T>(op, &xc.read_slice::<T>()?, hw, win)?;
        Tensor::from_vec(values, shape, x.device())
    })
}

/// The backward of [`avg_pool`], as a tensor of `in_shape` in the forward input's `format`.
pub(crate) fn avg_pool_backward(
    op: &'static str,
    g: &Tensor,
    hw: (usize, usize),
    win: &Windows,
    in_shape: &[usize],
    format: MemoryFormat,
) -> Result<Tensor> {
    if format == MemoryFormat::ChannelsLast && in_shape.len() == 4 {
        let cl = MemoryFormat::ChannelsLast;
        return with_float_type!(op, g.dtype(), T => {
            let gc = memory::dense_in(g, cl)?;
            let gx = nhwc::avg_backward::<T>(op, &gc.read_dense_slice::<T>()?, hw, in_shape[1], win)?;
            Tensor::from_vec_in(gx, in_shape, g.device(), cl)
        });
    }
    with_float_type!(op, g.dtype(), T => {
        let gc = memory::contiguous(op, g)?;
        let gx = avg_backward::<T>(op, &gc.read_slice::<T>()?, hw, win)?;
        Tensor::from_vec(gx, in_shape, g.device())
    })
}

/// Runs `f(plane_index, out_plane)` over chunks of `out_per` elements, in parallel when
/// `work` (elements touched) is large.
fn for_each_plane<T: Send>(
    out: &mut [T],
    out_per: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if out_per == 0 {
        return;
    }
    if parallel(work) {
        out.par_chunks_mut(out_per)
            .enumerate()
            .for_each(|(p, o)| f(p, o));
    } else {
        out.chunks_mut(out_per)
            .enumerate()
            .for_each(|(p, o)| f(p, o));
    }
}

/// Max over each window of each `[h, w]` plane of `x`. Returns the maxima and, when
/// `keep_indices`, the index within its plane of the first maximal element of each window
/// (NaN counts as maximal, as in PyTorch).
fn max_forward<T: FloatElement>(
    op: &'static str,
    x: &[T],
    (h, w): (usize, usize),
    win: &Windows,
    keep_indices: bool,
) -> Result<(Vec<T>, Vec<u32>)> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = x.len().checked_div(in_per).unwrap_or(0);
    // Both paths write every value (the cache holds only tensor element types, so the
    // indices come from the system).
    let mut values = memory::uninit::<T>(op, planes * out_per)?;
    let mut indices = index_buffer(op, if keep_indices { planes * out_per } else { 0 })?;
    if out_per == 0 {
        return Ok((values, indices));
    }
    if win.is_two_by_two() {
        let (vals, idx) = (&mut values[..], &mut indices[..]);
        if parallel(x.len()) {
            // Tasks of whole planes, a few per thread.
            let per_task = planes.div_ceil(rayon::current_num_threads() * 4);
            let idx_per_task = if keep_indices { per_task * out_per } else { 0 };
            let idx_chunks: Vec<&mut [u32]> = if keep_indices {
                idx.chunks_mut(idx_per_task).collect()
            } else {
                (0..planes.div_ceil(per_task))
                    .map(|_| &mut [][..])
                    .collect()
            };
            vals.par_chunks_mut(per_task * out_per)
                .zip(x.par_chunks(per_task * in_per))
                .zip(idx_chunks)
                .for_each(|((v, xs), i)| max2x2::forward(xs, (h, w), v, i));
        } else {
            max2x2::forward(x, (h, w), vals, idx);
        }
        return Ok((values, indices));
    }
    let plane_max = |p: usize, vals: &mut [T], mut idx: Option<&mut [u32]>| {
        let plane = &x[p * in_per..(p + 1) * in_per];
        let mut k = 0;
        for &(r0, r1) in &win.rows {
            for &(c0, c1) in &win.cols {
                let (best, at) = window_max(plane, w, (r0, r1), (c0, c1));
                vals[k] = best;
                if let Some(idx) = idx.as_deref_mut() {
                    idx[k] = at as u32;
                }
                k += 1;
            }
        }
    };
    match (keep_indices, parallel(x.len())) {
        (true, true) => values
            .par_chunks_mut(out_per)
            .zip(indices.par_chunks_mut(out_per))
            .enumerate()
            .for_each(|(p, (v, i))| plane_max(p, v, Some(i))),
        (true, false) => values
            .chunks_mut(out_per)
            .zip(indices.chunks_mut(out_per))
            .enumerate()
            .for_each(|(p, (v, i))| plane_max(p, v, Some(i))),
        (false, _) => for_each_plane(&mut values, out_per, x.len(), |p, v| plane_max(p, v, None)),
    }
    Ok((values, indices))
}

/// `len` zeroed indices (the caching allocator holds only tensor element types, so these come
/// from the system), or an error naming `op`.
fn index_buffer(op: &'static str, len: usize) -> Result<Vec<u32>> {
    let mut buffer = Vec::new();
    buffer
        .try_reserve_exact(len)
        .map_err(|_| tandem_core::Error::OutOfMemory {
            op,
            device: tandem_core::Device::Cpu,
            bytes: len.saturating_mul(4),
        })?;
    buffer.resize(len, 0);
    Ok(buffer)
}

/// The first maximal element of one window of a `w`-wide plane and its index in the plane
/// (a NaN wins and ends the search, as in PyTorch).
#[inline(always)]
fn window_max<T: FloatElement>(
    plane: &[T],
    w: usize,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) -> (T, usize) {
    let (mut best, mut at) = (T::neg_infinity(), r0 * w + c0);
    for r in r0..r1 {
        let row = &plane[r * w..(r + 1) * w];
        for (c, &v) in row.iter().enumerate().take(c1).skip(c0) {
            // A NaN wins for good, as in PyTorch.
            if v > best || v.is_nan() {
                (best, at) = (v, r * w + c);
                if v.is_nan() {
                    return (best, at);
                }
            }
        }
    }
    (best, at)
}

/// Routes each output gradient to the input element its window's maximum came from.
fn max_backward<T: FloatElement>(
    op: &'static str,
    g: &[T],
    indices: &[u32],
    (h, w): (usize, usize),
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = memory::zeroed::<T>(op, planes * in_per)?;
    for_each_plane(&mut gx, in_per, g.len(), |p, plane| {
        let range = p * out_per..(p + 1) * out_per;
        for (&gv, &i) in g[range.clone()].iter().zip(&indices[range]) {
            plane[i as usize] += gv;
        }
    });
    Ok(gx)
}

/// Mean over each window of each `[h, w]` plane of `x` (divided by `win.divisor`).
fn avg_forward<T: FloatElement>(
    op: &'static str,
    x: &[T],
    (h, w): (usize, usize),
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = x.len().checked_div(in_per).unwrap_or(0);
    // Every element is written.
    let mut out = memory::uninit::<T>(op, planes * out_per)?;
    for_each_plane(&mut out, out_per, x.len(), |p, o| {
        let plane = &x[p * in_per..(p + 1) * in_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let mut acc = T::ZERO;
                for r in rows.0..rows.1 {
                    acc = plane[r * w + cols.0..r * w + cols.1]
                        .iter()
                        .fold(acc, |a, &v| a + v);
                }
                o[k] = acc / T::from_f64(win.divisor_of(rows, cols) as f64);
                k += 1;
            }
        }
    });
    Ok(out)
}

/// Spreads each output gradient evenly (by the same divisor) over its window.
fn avg_backward<T: FloatElement>(
    op: &'static str,
    g: &[T],
    (h, w): (usize, usize),
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = memory::zeroed::<T>(op, planes * in_per)?;
    for_each_plane(&mut gx, in_per, g.len() + planes * in_per, |p, plane| {
        let gp = &g[p * out_per..(p + 1) * out_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let share = gp[k] / T::from_f64(win.divisor_of(rows, cols) as f64);
                for r in rows.0..rows.1 {
                    plane[r * w + cols.0..r * w + cols.1]
                        .iter_mut()
                        .for_each(|v| *v += share);
                }
                k += 1;
            }
        }
    });
    Ok(gx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_keeps_the_first_maximum_and_propagates_nan() {
        let win = Windows {
            rows: vec![(0, 2)],
            cols: vec![(0, 2)],
            divisor: None,
        };
        let (v, i) = max_forward("test", &[1.0f64, 3.0, 3.0, 0.0], (2, 2), &win, true).unwrap();
        assert_eq!((v, i), (vec![3.0], vec![1]));
        let (v, i) =
            max_forward("test", &[1.0f64, f64::NAN, 3.0, 0.0], (2, 2), &win, true).unwrap();
        assert!(v[0].is_nan());
        assert_eq!(i, vec![1]);
    }
}
