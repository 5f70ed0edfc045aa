//! The pools on channels-last (NHWC) inputs: each window is a set of input pixels, each pixel a
//! run of `C` contiguous channels, so a window reduces whole channel runs at once and the
//! output pixel's `C` values are written in storage order. Samples run in parallel when the
//! input is large. The indices a max pool keeps are, as for NCHW, the position of the maximum
//! within its `[H, W]` plane, stored in the output's (NHWC) order.

use rayon::prelude::*;
use tandem_core::{FloatElement, Result};

use super::super::shape::Windows;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// Runs `f(sample, out_sample)` over chunks of `per` elements of `out`, in parallel when
/// `work` is large.
fn per_sample<T: Send>(out: &mut [T], per: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if per == 0 {
        return;
    }
    if parallel(work) {
        out.par_chunks_mut(per)
            .enumerate()
            .for_each(|(n, o)| f(n, o));
    } else {
        out.chunks_mut(per).enumerate().for_each(|(n, o)| f(n, o));
    }
}

/// Max over each window of `x` `[N, H, W, C]`: the maxima `[N, OH, OW, C]` and, when
/// `keep_indices`, the in-plane index of each maximum (NaN wins, as in PyTorch; the first
/// maximum is kept).
pub(crate) fn max_forward<T: FloatElement>(
    op: &'static str,
    x: &[T],
    (h, w): (usize, usize),
    c: usize,
    win: &Windows,
    keep_indices: bool,
) -> Result<(Vec<T>, Vec<u32>)> {
    let (in_per, out_per) = (h * w * c, win.out_pixels() * c);
    let samples = x.len().checked_div(in_per).unwrap_or(0);
    // Every value is written.
    let mut values = memory::uninit::<T>(op, samples * out_per)?;
    // Filled in below whether or not they are kept (the loop writes both); dropped at the end
    // when not wanted.
    let mut indices = super::index_buffer(op, samples * out_per)?;
    if out_per == 0 {
        return Ok((values, Vec::new()));
    }
    let body = |n: usize, vals: &mut [T], idx: &mut [u32]| {
        let xs = &x[n * in_per..(n + 1) * in_per];
        let mut k = 0;
        for &(r0, r1) in &win.rows {
            for &(c0, c1) in &win.cols {
                let (best, at) = (&mut vals[k * c..(k + 1) * c], &mut idx[k * c..(k + 1) * c]);
                best.fill(T::neg_infinity());
                at.fill((r0 * w + c0) as u32);
                for r in r0..r1 {
                    for col in c0..c1 {
                        let pixel = r * w + col;
                        let run = &xs[pixel * c..(pixel + 1) * c];
                        for ((b, a), &v) in best.iter_mut().zip(at.iter_mut()).zip(run) {
                            // A NaN wins for good: nothing compares above it.
                            if !b.is_nan() && (v > *b || v.is_nan()) {
                                (*b, *a) = (v, pixel as u32);
                            }
                        }
                    }
                }
                k += 1;
            }
        }
    };
    if parallel(x.len()) {
        values
            .par_chunks_mut(out_per)
            .zip(indices.par_chunks_mut(out_per))
            .enumerate()
            .for_each(|(n, (v, i))| body(n, v, i));
    } else {
        values
            .chunks_mut(out_per)
            .zip(indices.chunks_mut(out_per))
            .enumerate()
            .for_each(|(n, (v, i))| body(n, v, i));
    }
    if !keep_indices {
        indices = Vec::new();
    }
    Ok((values, indices))
}

/// Routes each output gradient (`[N, OH, OW, C]`) to the input pixel its maximum came from:
/// `[N, H, W, C]`.
pub(crate) fn max_backward<T: FloatElement>(
    op: &'static str,
    g: &[T],
    indices: &[u32],
    (h, w): (usize, usize),
    c: usize,
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w * c, win.out_pixels() * c);
    let samples = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = memory::zeroed::<T>(op, samples * in_per)?;
    per_sample(&mut gx, in_per, g.len(), |n, plane| {
        let range = n * out_per..(n + 1) * out_per;
        for (j, (&gv, &i)) in g[range.clone()].iter().zip(&indices[range]).enumerate() {
            plane[i as usize * c + j % c] += gv;
        }
    });
    Ok(gx)
}

/// Mean over each window of `x` `[N, H, W, C]` (divided by the window's divisor):
/// `[N, OH, OW, C]`.
pub(crate) fn avg_forward<T: FloatElement>(
    op: &'static str,
    x: &[T],
    (h, w): (usize, usize),
    c: usize,
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w * c, win.out_pixels() * c);
    let samples = x.len().checked_div(in_per).unwrap_or(0);
    // Every element is written.
    let mut out = memory::uninit::<T>(op, samples * out_per)?;
    per_sample(&mut out, out_per, x.len(), |n, o| {
        let xs = &x[n * in_per..(n + 1) * in_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let acc = &mut o[k * c..(k + 1) * c];
                acc.fill(T::ZERO);
                for r in rows.0..rows.1 {
                    for col in cols.0..cols.1 {
                        let run = &xs[(r * w + col) * c..(r * w + col + 1) * c];
                        acc.iter_mut().zip(run).for_each(|(a, &v)| *a += v);
                    }
                }
                let divisor = T::from_f64(win.divisor_of(rows, cols) as f64);
                acc.iter_mut().for_each(|a| *a = *a / divisor);
                k += 1;
            }
        }
    });
    Ok(out)
}

/// Spreads each output gradient (`[N, OH, OW, C]`) evenly over its window: `[N, H, W, C]`.
pub(crate) fn avg_backward<T: FloatElement>(
    op: &'static str,
    g: &[T],
    (h, w): (usize, usize),
    c: usize,
    win: &Windows,
) -> Result<Vec<T>> {
    let (in_per, out_per) = (h * w * c, win.out_pixels() * c);
    let samples = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = memory::zeroed::<T>(op, samples * in_per)?;
    per_sample(&mut gx, in_per, g.len() + samples * in_per, |n, plane| {
        let gs = &g[n * out_per..(n + 1) * out_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let divisor = T::from_f64(win.divisor_of(rows, cols) as f64);
                let share = &gs[k * c..(k + 1) * c];
                for r in rows.0..rows.1 {
                    for col in cols.0..cols.1 {
                        let run = &mut plane[(r * w + col) * c..(r * w + col + 1) * c];
                        run.iter_mut()
                            .zip(share)
                            .for_each(|(v, &s)| *v += s / divisor);
                    }
                }
                k += 1;
            }
        }
    });
    Ok(gx)
}
