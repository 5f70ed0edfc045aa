//! The batch-norm passes for channels-last (NHWC) inputs: the same phases as `passes.rs`, but
//! over `[rows, C]` with the channel innermost (a row is one pixel of one sample), so every
//! pass reads and writes the storage in order and the statistics of channel `c` gather column
//! `c` of the rows.
//!
//! The loops run over periods: `k` whole rows with `k·C ≥ 64` elements, against per-channel
//! constants tiled to the period's length, so the inner loop is a full run of vectors whatever
//! `C` is (no per-element `i % C`), compiled for the widest vector instructions the CPU has.
//! Per-channel sums accumulate per tiled position in the element type over blocks of
//! [`FOLD_ROWS`] rows, then fold into f64 per channel. The blocks start at multiples of
//! [`FOLD_ROWS`] rows from each task's start, and tasks at multiples of [`ROWS_PER_TASK`], so
//! that a caller summing whole tasks on its own (the half passes) gets the same block sums. Large inputs split their rows
//! into contiguous blocks, one rayon task each with its own partial sums, added in block order
//! (the result does not depend on scheduling); maps split into blocks the same way.

use rayon::prelude::*;
use tandem_core::{Element, FloatElement, Result};

use super::passes::Epilogue;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;
use crate::cpu::simd::wide_simd_fn;

/// Rows per task of the parallel passes.
pub(super) const ROWS_PER_TASK: usize = 256;

/// Rows a tiled accumulator sums in the element type before folding into f64 (a divisor of
/// [`ROWS_PER_TASK`]).
pub(super) const FOLD_ROWS: usize = 64;

/// Elements of one period for `c` channels: whole rows, at least 64 elements.
fn period(c: usize) -> usize {
    c * 64usize.div_ceil(c.max(1))
}

/// Per-channel values repeated over one period (see [`period`]).
fn tile<T: Copy>(per_channel: &[T]) -> Vec<T> {
    let c = per_channel.len();
    per_channel
        .iter()
        .copied()
        .cycle()
        .take(period(c))
        .collect()
}

/// Adds a tiled accumulator into per-channel f64 sums.
fn fold<T: FloatElement>(tiled: &[T], acc: &mut [f64]) {
    let c = acc.len();
    for (j, &v) in tiled.iter().enumerate() {
        acc[j % c] += v.to_f64();
    }
}

/// `acc[j] += x[j]` (`sq` absent) or `acc[j] += (x[j] − m[j])²` over the periods of `x`.
#[inline(always)]
fn sum_periods<T: FloatElement>(x: &[T], m: Option<&[T]>, acc: &mut [T]) {
    let p = acc.len();
    match m {
        None => {
            for xs in x.chunks(p) {
                acc.iter_mut().zip(xs).for_each(|(a, &v)| *a += v);
            }
        }
        Some(m) => {
            for xs in x.chunks(p) {
                for ((a, &v), &mv) in acc.iter_mut().zip(xs).zip(m) {
                    let d = v - mv;
                    *a += d * d;
                }
            }
        }
    }
}

wide_simd_fn!(
    /// [`sum_periods`] in the widest vector instructions the CPU has.
    fn sum_periods_wide[T: FloatElement](x: &[T], m: Option<&[T]>, acc: &mut [T]) = sum_periods
);

/// Over the periods of `g` and `x`: `sg[j] += g'` and `sgc[j] += g'·(x − m[j])`, with
/// `g' = g` where `mask`'s `s[j]·x + t[j] > 0` (or everywhere without a mask), else 0.
#[inline(always)]
fn grad_periods<T: FloatElement>(
    g: &[T],
    x: &[T],
    m: &[T],
    mask: Option<(&[T], &[T])>,
    sg: &mut [T],
    sgc: &mut [T],
) {
    let p = sg.len();
    for (gs, xs) in g.chunks(p).zip(x.chunks(p)) {
        // Every operand cut to the period's length: no bounds checks in the loops.
        let n = gs.len();
        let (xs, m, sg, sgc) = (&xs[..n], &m[..n], &mut sg[..n], &mut sgc[..n]);
        match mask {
            None => {
                for j in 0..n {
                    sg[j] += gs[j];
                    sgc[j] += gs[j] * (xs[j] - m[j]);
                }
            }
            Some((s, t)) => {
                let (s, t) = (&s[..n], &t[..n]);
                for j in 0..n {
                    let gv = if xs[j] * s[j] + t[j] > T::ZERO {
                        gs[j]
                    } else {
                        T::ZERO
                    };
                    sg[j] += gv;
                    sgc[j] += gv * (xs[j] - m[j]);
                }
            }
        }
    }
}

wide_simd_fn!(
    /// [`grad_periods`] in the widest vector instructions the CPU has.
    fn grad_periods_wide[T: FloatElement](
        g: &[T],
        x: &[T],
        m: &[T],
        mask: Option<(&[T], &[T])>,
        sg: &mut [T],
        sgc: &mut [T]
    ) = grad_periods
);

/// What a per-element map computes from its first operand `u` and second `v` with the
/// tiled constants `a`, `b`, `k` (and a mask's `s`, `t`).
#[derive(Clone, Copy)]
enum Map<'a, T> {
    /// `a·u + b`, then a ReLU when `relu`.
    Affine { relu: bool },
    /// `max(0, a·u + b + v)`: the normalisation plus a residual `v`.
    AffineAddRelu(&'a [T]),
    /// `a·u' + b·v + k` with `u' = u` where `s·v + t > 0` (or everywhere without a mask):
    /// the input gradient (`u` = output gradient, `v` = input).
    Gradient(&'a [T], Option<(&'a [T], &'a [T])>),
    /// `u` where `v > 0`, else 0: ReLU's backward through the saved output `v`.
    KeepPositive(&'a [T]),
}

/// The tiled constants of a [`Map`].
#[derive(Clone, Copy)]
struct Tiled<'a, T> {
    a: &'a [T],
    b: &'a [T],
    k: &'a [T],
}

/// `out` = the [`Map`] of `u` (and its second operand, read from element `start` on),
/// period by period.
#[inline(always)]
fn map_periods<T: FloatElement>(
    u: &[T],
    map: Map<'_, T>,
    c: Tiled<'_, T>,
    start: usize,
    out: &mut [T],
) {
    let p = c.a.len();
    let relu = |z: T| if z < T::ZERO { T::ZERO } else { z };
    let v = match map {
        Map::AffineAddRelu(v) | Map::Gradient(v, _) | Map::KeepPositive(v) => {
            &v[start..start + out.len()]
        }
        Map::Affine { .. } => u,
    };
    if let Map::KeepPositive(_) = map {
        for ((o, &uv), &vv) in out.iter_mut().zip(u).zip(v) {
            *o = if vv > T::ZERO { uv } else { T::ZERO };
        }
        return;
    }
    for ((o, us), vs) in out.chunks_mut(p).zip(u.chunks(p)).zip(v.chunks(p)) {
        // Every operand cut to the period's length, so the loops below run without bounds
        // checks (and vectorise).
        let n = o.len();
        let (us, vs, a, b, k) = (&us[..n], &vs[..n], &c.a[..n], &c.b[..n], &c.k[..n]);
        match map {
            Map::Affine { relu: false } => {
                for j in 0..n {
                    o[j] = us[j] * a[j] + b[j];
                }
            }
            Map::Affine { relu: true } => {
                for j in 0..n {
                    o[j] = relu(us[j] * a[j] + b[j]);
                }
            }
            Map::AffineAddRelu(_) => {
                for j in 0..n {
                    o[j] = relu(us[j] * a[j] + b[j] + vs[j]);
                }
            }
            Map::Gradient(_, None) => {
                for j in 0..n {
                    o[j] = us[j] * a[j] + vs[j] * b[j] + k[j];
                }
            }
            Map::Gradient(_, Some((s, t))) => {
                let (s, t) = (&s[..n], &t[..n]);
                for j in 0..n {
                    let keep = vs[j] * s[j] + t[j] > T::ZERO;
                    let g = if keep { us[j] } else { T::ZERO };
                    o[j] = g * a[j] + vs[j] * b[j] + k[j];
                }
            }
            Map::KeepPositive(_) => {}
        }
    }
}

wide_simd_fn!(
    /// [`map_periods`] in the widest vector instructions the CPU has.
    fn map_periods_wide[T: FloatElement](
        u: &[T],
        map: Map<'_, T>,
        c: Tiled<'_, T>,
        start: usize,
        out: &mut [T]
    ) = map_periods
);

/// Per-channel sums of `K` quantities over all rows: `f(first_row, rows, acc)` adds the rows
/// `first_row..first_row + rows` into `acc` (`K` blocks of `C`: `acc[q * C + c]`).
pub(super) fn channel_sums<const K: usize>(
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

/// Writes `out` block by block (in parallel when large): `f(first, block)` fills the block
/// of rows starting at row `first`.
pub(super) fn map_rows<T: Element>(
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

/// `Σ x` (or `Σ (x − m)²` with tiled `m`) per channel of the rows of `x`, into `acc` (`[C]`):
/// in the element type over [`FOLD_ROWS`] rows at a time, then in f64.
fn fold_sums<T: FloatElement>(x: &[T], m: Option<&[T]>, acc: &mut [f64]) {
    let p = period(acc.len());
    let mut tiled = vec![T::ZERO; p];
    for block in x.chunks(acc.len() * FOLD_ROWS) {
        tiled.iter_mut().for_each(|t| *t = T::ZERO);
        sum_periods_wide(block, m, &mut tiled);
        fold(&tiled, acc);
    }
}

/// Per-channel mean and biased variance of `x` `[rows, c]`: the sums, then the squared
/// deviations from the mean (two passes), each in blocks folded into f64.
pub(crate) fn moments<T: FloatElement>(x: &[T], c: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len().checked_div(c).unwrap_or(0);
    if rows == 0 {
        return (vec![0.0; c], vec![0.0; c]);
    }
    let sums = channel_sums::<1>(rows, c, |first, n, acc| {
        fold_sums(&x[first * c..(first + n) * c], None, acc)
    });
    let mean: Vec<f64> = sums.iter().map(|s| s / rows as f64).collect();
    let mean_t = tile(&mean.iter().map(|&m| T::from_f64(m)).collect::<Vec<T>>());
    let squares = channel_sums::<1>(rows, c, |first, n, acc| {
        fold_sums(&x[first * c..(first + n) * c], Some(&mean_t), acc)
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
    let a = tile(&coefs.iter().map(|p| p.0).collect::<Vec<T>>());
    let b = tile(&coefs.iter().map(|p| p.1).collect::<Vec<T>>());
    let tiled = Tiled {
        a: &a,
        b: &b,
        k: &b,
    };
    let map = match epilogue {
        Epilogue::Plain => Map::Affine { relu: false },
        Epilogue::Relu => Map::Affine { relu: true },
        Epilogue::AddRelu(r) => Map::AffineAddRelu(r),
    };
    map_rows(op, x.len(), c, |first, block| {
        let start = first * c;
        map_periods_wide(&x[start..start + block.len()], map, tiled, start, block)
    })
}

/// The tiled `(scale, shift)` of a ReLU mask.
type TiledMask<T> = Option<(Vec<T>, Vec<T>)>;

/// Tiles a mask's per-channel `(scale, shift)`.
fn tile_mask<T: FloatElement>(mask: Option<&[(T, T)]>) -> TiledMask<T> {
    mask.map(|m| {
        (
            tile(&m.iter().map(|p| p.0).collect::<Vec<T>>()),
            tile(&m.iter().map(|p| p.1).collect::<Vec<T>>()),
        )
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
    let m = tile(&mean.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>());
    let mask = tile_mask(mask);
    let mask = mask.as_ref().map(|(s, t)| (&s[..], &t[..]));
    let p = period(c);
    let sums = channel_sums::<2>(rows, c, |first, n, acc| {
        let (sum_g, sum_gc) = acc.split_at_mut(c);
        let range = first * c..(first + n) * c;
        let (mut sg, mut sgc) = (vec![T::ZERO; p], vec![T::ZERO; p]);
        for (gs, xs) in g[range.clone()]
            .chunks(c * FOLD_ROWS)
            .zip(x[range].chunks(c * FOLD_ROWS))
        {
            sg.iter_mut()
                .chain(sgc.iter_mut())
                .for_each(|v| *v = T::ZERO);
            grad_periods_wide(gs, xs, &m, mask, &mut sg, &mut sgc);
            fold(&sg, sum_g);
            fold(&sgc, sum_gc);
        }
    });
    let (sum_g, sum_gc) = sums.split_at(c);
    (sum_g.to_vec(), sum_gc.to_vec())
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
    let none = [T::ZERO; 0];
    let tiled = Tiled {
        a: &none,
        b: &none,
        k: &none,
    };
    let masked = map_rows(op, g.len(), c, |first, block| {
        let start = first * c;
        map_periods_wide(
            &g[start..start + block.len()],
            Map::KeepPositive(y),
            tiled,
            start,
            block,
        )
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
    let tiled_of = |v: &[f64]| tile(&v.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>());
    let (at, bt, kt) = (tiled_of(a), tiled_of(b), tiled_of(k));
    let tiled = Tiled {
        a: &at,
        b: &bt,
        k: &kt,
    };
    let mask = tile_mask(mask);
    let map = Map::Gradient(x, mask.as_ref().map(|(s, t)| (&s[..], &t[..])));
    map_rows(op, g.len(), c, |first, block| {
        let start = first * c;
        map_periods_wide(&g[start..start + block.len()], map, tiled, start, block)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct per-element loops over `[rows, c]`, the reference of the period loops.
    #[test]
    fn period_loops_match_direct_loops_for_any_channel_count() {
        for c in [1usize, 3, 16, 17, 64, 100] {
            let rows = 301;
            let x: Vec<f64> = (0..rows * c)
                .map(|i| ((i * 37) % 23) as f64 * 0.5 - 3.0)
                .collect();
            let g: Vec<f64> = (0..rows * c).map(|i| ((i * 11) % 7) as f64 - 2.5).collect();
            let (mean, var) = moments(&x, c);
            let scale: Vec<f64> = (0..c).map(|ch| 0.5 + ch as f64 * 0.1).collect();
            let shift: Vec<f64> = (0..c).map(|ch| 0.25 - ch as f64 * 0.05).collect();
            let mask = super::super::passes::affine_coefs::<f64>(&scale, &shift);
            let (sg, sgc) = grad_sums(&g, &x, c, &mean, Some(&mask));
            let y = normalize("t", &x, c, &scale, &shift, Epilogue::AddRelu(&g)).unwrap();
            let gx = grad_input("t", &g, &x, c, &scale, &shift, &mean, Some(&mask)).unwrap();
            for ch in 0..c {
                let col: Vec<usize> = (0..rows).map(|r| r * c + ch).collect();
                let m = col.iter().map(|&i| x[i]).sum::<f64>() / rows as f64;
                let v = col.iter().map(|&i| (x[i] - m).powi(2)).sum::<f64>() / rows as f64;
                assert!(
                    (mean[ch] - m).abs() < 1e-9 && (var[ch] - v).abs() < 1e-9,
                    "c {c}"
                );
                let keep = |i: usize| x[i] * scale[ch] + shift[ch] > 0.0;
                let want_g: f64 = col.iter().filter(|&&i| keep(i)).map(|&i| g[i]).sum();
                let want_gc: f64 = col
                    .iter()
                    .filter(|&&i| keep(i))
                    .map(|&i| g[i] * (x[i] - m))
                    .sum();
                assert!((sg[ch] - want_g).abs() < 1e-9 && (sgc[ch] - want_gc).abs() < 1e-9);
                for &i in &col {
                    let z = (x[i] * scale[ch] + shift[ch] + g[i]).max(0.0);
                    assert!((y[i] - z).abs() < 1e-12, "c {c} [{i}]");
                    let gk = if keep(i) { g[i] } else { 0.0 };
                    let want = gk * scale[ch] + x[i] * shift[ch] + mean[ch];
                    assert!((gx[i] - want).abs() < 1e-12, "c {c} [{i}]");
                }
            }
        }
    }
}
