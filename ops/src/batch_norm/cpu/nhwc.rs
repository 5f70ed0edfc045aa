//! The batch-norm passes for channels-last (NHWC) inputs: the same phases as `passes.rs`, but
//! over `[rows, C]` with the channel innermost (a row is one pixel of one sample), so every
//! pass reads and writes the storage in order and the statistics of channel `c` gather column
//! `c` of the rows.
//!
//! Per-channel sums are f64. Large inputs split their rows into contiguous blocks, one rayon
//! task each with its own partial sums, added in block order (the result does not depend on
//! scheduling); maps split into blocks the same way.

use rayon::prelude::*;
use tandem_core::{FloatElement, Result};

use super::passes::Epilogue;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// Rows per task of the parallel passes.
const ROWS_PER_TASK: usize = 256;

/// Sums `K` per-channel quantities over all rows: `f(first_row, rows, acc)` adds the rows
/// `first_row..first_row + rows` into `acc` (`K·C` values, laid out as `f` chooses; blocks
/// are added element by element).
fn channel_sums<const K: usize>(
    rows: usize,
    c: usize,
    f: impl Fn(usize, usize, &mut [f64]) + Sync,
) -> Vec<f64> {
    if parallel(rows * c) && rows > ROWS_PER_TASK {
        let blocks: Vec<Vec<f64>> = (0..rows.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .map(|b| {
                let mut acc = vec![0.0; K * c];
                let first = b * ROWS_PER_TASK;
                f(first, ROWS_PER_TASK.min(rows - first), &mut acc);
                acc
            })
            .collect();
        let mut total = vec![0.0; K * c];
        for b in blocks {
            total.iter_mut().zip(&b).for_each(|(t, v)| *t += v);
        }
        total
    } else {
        let mut acc = vec![0.0; K * c];
        f(0, rows, &mut acc);
        acc
    }
}

/// Writes `out[r, c] = f(r, c)` row block by row block (in parallel when large): `f(first,
/// block)` fills the block of rows starting at row `first`.
fn map_rows<T: FloatElement>(
    op: &'static str,
    len: usize,
    c: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Result<Vec<T>> {
    // Every element is written.
    let mut out = memory::uninit::<T>(op, len)?;
    if c == 0 || len == 0 {
        return Ok(out);
    }
    if parallel(len) {
        out.par_chunks_mut(ROWS_PER_TASK * c)
            .enumerate()
            .for_each(|(b, block)| f(b * ROWS_PER_TASK, block));
    } else {
        f(0, &mut out);
    }
    Ok(out)
}

/// Per-channel mean and biased variance of `x` `[rows, c]`, two passes in f64.
pub(crate) fn moments<T: FloatElement>(x: &[T], c: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len().checked_div(c).unwrap_or(0);
    if rows == 0 {
        return (vec![0.0; c], vec![0.0; c]);
    }
    let sums = channel_sums::<1>(rows, c, |first, n, acc| {
        for row in x[first * c..(first + n) * c].chunks_exact(c) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v.to_f64());
        }
    });
    let mean: Vec<f64> = sums.iter().map(|s| s / rows as f64).collect();
    let squares = channel_sums::<1>(rows, c, |first, n, acc| {
        for row in x[first * c..(first + n) * c].chunks_exact(c) {
            for ((a, &v), m) in acc.iter_mut().zip(row).zip(&mean) {
                let d = v.to_f64() - m;
                *a += d * d;
            }
        }
    });
    let var = squares.iter().map(|s| s / rows as f64).collect();
    (mean, var)
}

/// `y = x·scale[c] + shift[c]` and then the [`Epilogue`] (its residual laid out like `x`).
pub(crate) fn normalize<T: FloatElement>(
    op: &'static str,
    x: &[T],
    c: usize,
    scale: &[f64],
    shift: &[f64],
    epilogue: Epilogue<'_, T>,
) -> Result<Vec<T>> {
    let coefs = super::passes::affine_coefs::<T>(scale, shift);
    let relu = |v: T| if v < T::ZERO { T::ZERO } else { v };
    map_rows(op, x.len(), c, |first, block| {
        let (start, len) = (first * c, block.len());
        let xs = &x[start..start + len];
        // Row by row, channel by channel: the coefficients line up with each row (no index
        // arithmetic per element), so the loops vectorise.
        let rows = block.chunks_exact_mut(c).zip(xs.chunks_exact(c));
        match epilogue {
            Epilogue::Plain => rows.for_each(|(o, xr)| {
                for ((o, &v), &(a, b)) in o.iter_mut().zip(xr).zip(&coefs) {
                    *o = v * a + b;
                }
            }),
            Epilogue::Relu => rows.for_each(|(o, xr)| {
                for ((o, &v), &(a, b)) in o.iter_mut().zip(xr).zip(&coefs) {
                    *o = relu(v * a + b);
                }
            }),
            Epilogue::AddRelu(r) => {
                let rs = r[start..start + len].chunks_exact(c);
                rows.zip(rs).for_each(|((o, xr), rr)| {
                    for (((o, &v), &(a, b)), &rv) in o.iter_mut().zip(xr).zip(&coefs).zip(rr) {
                        *o = relu(v * a + b + rv);
                    }
                })
            }
        }
    })
}

/// Per-channel `Σ g` and `Σ g·(x − mean)`; with `mask` (from `affine_coefs`) `g` counts only
/// where the forward's normalised value was positive.
pub(crate) fn grad_sums<T: FloatElement>(
    g: &[T],
    x: &[T],
    c: usize,
    mean: &[f64],
    mask: Option<&[(T, T)]>,
) -> (Vec<f64>, Vec<f64>) {
    let rows = g.len().checked_div(c).unwrap_or(0);
    let sums = channel_sums::<2>(rows, c, |first, n, acc| {
        let (gs, xs) = (
            &g[first * c..(first + n) * c],
            &x[first * c..(first + n) * c],
        );
        // Σg in acc[..c], Σg·(x − mean) in acc[c..]; the mask is a select, not a branch.
        let (sum_g, sum_gc) = acc.split_at_mut(c);
        for (gr, xr) in gs.chunks_exact(c).zip(xs.chunks_exact(c)) {
            match mask {
                Some(m) => {
                    let lanes = sum_g
                        .iter_mut()
                        .zip(sum_gc.iter_mut())
                        .zip(gr.iter().zip(xr));
                    for ((((sg, sgc), (&gv, &xv)), &(a, b)), &mu) in lanes.zip(m).zip(mean) {
                        let gv = if xv * a + b > T::ZERO {
                            gv.to_f64()
                        } else {
                            0.0
                        };
                        *sg += gv;
                        *sgc += gv * (xv.to_f64() - mu);
                    }
                }
                None => {
                    let lanes = sum_g
                        .iter_mut()
                        .zip(sum_gc.iter_mut())
                        .zip(gr.iter().zip(xr));
                    for (((sg, sgc), (&gv, &xv)), &mu) in lanes.zip(mean) {
                        let gv = gv.to_f64();
                        *sg += gv;
                        *sgc += gv * (xv.to_f64() - mu);
                    }
                }
            }
        }
    });
    (0..c).map(|ch| (sums[ch], sums[c + ch])).unzip()
}

/// The output gradient masked where the saved output `y` is positive, with its per-channel
/// `Σ g'` and `Σ g'·(x − mean)`.
pub(crate) fn masked_grad_sums<T: FloatElement>(
    op: &'static str,
    g: &[T],
    y: &[T],
    x: &[T],
    c: usize,
    mean: &[f64],
) -> Result<(Vec<T>, Vec<f64>, Vec<f64>)> {
    let masked = map_rows(op, g.len(), c, |first, block| {
        let start = first * c;
        let (gs, ys) = (
            &g[start..start + block.len()],
            &y[start..start + block.len()],
        );
        for ((o, &gv), &yv) in block.iter_mut().zip(gs).zip(ys) {
            *o = if yv > T::ZERO { gv } else { T::ZERO };
        }
    })?;
    let (sum_g, sum_gc) = grad_sums(&masked, x, c, mean, None);
    Ok((masked, sum_g, sum_gc))
}

/// `grad_x = g·a[c] + x·b[c] + k[c]`; with `mask` `g` is zeroed where the forward's
/// normalised value was not positive.
#[allow(clippy::too_many_arguments)]
pub(crate) fn grad_input<T: FloatElement>(
    op: &'static str,
    g: &[T],
    x: &[T],
    c: usize,
    a: &[f64],
    b: &[f64],
    k: &[f64],
    mask: Option<&[(T, T)]>,
) -> Result<Vec<T>> {
    let coefs: Vec<(T, T, T)> = (0..c)
        .map(|ch| (T::from_f64(a[ch]), T::from_f64(b[ch]), T::from_f64(k[ch])))
        .collect();
    map_rows(op, g.len(), c, |first, block| {
        let start = first * c;
        let (gs, xs) = (
            &g[start..start + block.len()],
            &x[start..start + block.len()],
        );
        let rows = block
            .chunks_exact_mut(c)
            .zip(gs.chunks_exact(c).zip(xs.chunks_exact(c)));
        for (o, (gr, xr)) in rows {
            let lanes = o.iter_mut().zip(gr.iter().zip(xr)).zip(&coefs);
            match mask {
                Some(m) => {
                    for (((o, (&gv, &xv)), &(ac, bc, kc)), &(ma, mb)) in lanes.zip(m) {
                        let gv = if xv * ma + mb > T::ZERO { gv } else { T::ZERO };
                        *o = gv * ac + xv * bc + kc;
                    }
                }
                None => {
                    for ((o, (&gv, &xv)), &(ac, bc, kc)) in lanes {
                        *o = gv * ac + xv * bc + kc;
                    }
                }
            }
        }
    })
}
