//! The passes of batch normalization over host slices. The input is viewed as `[N, C, L]` (L = product of the
//! dims after the channel), so each `(n, c)` pair owns one contiguous run of `L` elements.
//!
//! Reductions sum each run in the element type with [`LANES`] independent accumulators (so
//! they vectorise), over blocks of at most [`BLOCK`] elements whose totals are added in f64:
//! the float error of a block stays that of a short sum, whatever `L` is. The moments take
//! one pass over memory: each run's sum and its squared deviations from its own mean (the
//! second sweep hits the cache), merged per channel in f64 by the parallel-variance formula
//! (the run sums are kept, so that the between-run term needs no cancelling subtraction).
//! Elementwise passes are one `a·x + b (+ k·y)` sweep with per-channel constants. A ReLU fused
//! onto the output is applied in the forward sweep, and its backward mask (`z > 0` for the
//! normalised `z = scale·x + shift`) is recomputed from the input inside the gradient
//! reduction and the input-gradient sweep, so it costs no pass of its own. A residual added
//! before the ReLU (`max(0, z + r)`) joins the forward sweep too; its mask cannot be recomputed
//! from the input, so the backward reads the saved output instead: the gradient reduction
//! writes the masked gradient (the residual's gradient) run by run as it sums it, and the
//! input-gradient sweep reads that. Every loop
//! is compiled for the widest vector instructions the CPU has, and samples are split across
//! rayon threads, in small tasks of whole samples, only when the pool has more than one and
//! the input is large.

use rayon::prelude::*;
use tandem_core::{FloatElement, Result};

use crate::batch_norm::shape::Dims;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;
use crate::cpu::simd::wide_simd_fn;

/// Independent accumulators of a run sum: two AVX-512 registers of f32, enough to hide the
/// latency of the vector add.
const LANES: usize = 32;

/// Elements summed in the element type before the partial total moves to f64.
const BLOCK: usize = 1024;

/// `Σ f(a[i], b[i])` over two equally long runs, in blocks of [`BLOCK`] with [`LANES`]
/// accumulators each, block totals in f64.
#[inline(always)]
fn lane_sum<T: FloatElement>(a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> f64 {
    let mut total = 0.0f64;
    for (block_a, block_b) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        let mut acc = [T::ZERO; LANES];
        let (ca, cb) = (block_a.chunks_exact(LANES), block_b.chunks_exact(LANES));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (xa, xb) in ca.zip(cb) {
            for k in 0..LANES {
                acc[k] += f(xa[k], xb[k]);
            }
        }
        // pairwise fold of the lanes
        let mut width = LANES;
        while width > 1 {
            width /= 2;
            for k in 0..width {
                acc[k] += acc[k + width];
            }
        }
        let mut block = acc[0];
        for (&va, &vb) in ra.iter().zip(rb) {
            block += f(va, vb);
        }
        total += block.to_f64();
    }
    total
}

/// For samples `first..` (as many as `run_sums` holds, `c` a sample): each run's sum into
/// `run_sums[(n − first)·c + c]`, and per channel `Σ(x − run mean)²` added into `squares`.
#[inline(always)]
fn moment_runs<T: FloatElement>(
    x: &[T],
    d: Dims,
    first: usize,
    run_sums: &mut [f64],
    squares: &mut [f64],
) {
    let l = d.l as f64;
    for (i, sums) in run_sums.chunks_exact_mut(d.c).enumerate() {
        let n = first + i;
        for (c, (sum, square)) in sums.iter_mut().zip(squares.iter_mut()).enumerate() {
            let at = (n * d.c + c) * d.l;
            let run = &x[at..at + d.l];
            let s = lane_sum(run, run, |v, _| v);
            let m = T::from_f64(s / l);
            *square += lane_sum(run, run, |v, _| (v - m) * (v - m));
            *sum = s;
        }
    }
}

wide_simd_fn!(
    /// [`moment_runs`] in the widest vector instructions the CPU has.
    fn moment_runs_wide[T: FloatElement](
        x: &[T],
        d: Dims,
        first: usize,
        run_sums: &mut [f64],
        squares: &mut [f64]
    ) = moment_runs
);

/// ReLU of a normalised value: `z` where it is not negative, else 0 (NaN stays NaN, as in
/// the unfused `relu`).
#[inline(always)]
fn relu_value<T: FloatElement>(z: T) -> T {
    if z < T::ZERO {
        T::ZERO
    } else {
        z
    }
}

/// `g` where the normalised value `z` is positive, else 0: ReLU's backward mask.
#[inline(always)]
fn keep_where_positive<T: FloatElement>(g: T, z: T) -> T {
    if z > T::ZERO {
        g
    } else {
        T::ZERO
    }
}

/// Per-channel `[Σg, Σg·(x − mean[c])]` of `samples` (`mean` in the element type). With
/// `mask` (per-channel `(scale, shift)`), `g` counts only where `scale·x + shift > 0`: the
/// gradient of a ReLU applied to the normalised output.
#[inline(always)]
fn grad_runs<T: FloatElement>(
    g: &[T],
    x: &[T],
    d: Dims,
    mean: &[T],
    mask: Option<&[(T, T)]>,
    samples: std::ops::Range<usize>,
    acc: &mut [[f64; 2]],
) {
    // Written out rather than through a closure: a closure body may not be inlined into the
    // wide-vector caller, and would then run in baseline instructions.
    let per_sample = d.c * d.l;
    for n in samples {
        for (c, (a, &m)) in acc.iter_mut().zip(mean).enumerate() {
            let at = n * per_sample + c * d.l;
            let (gs, xs) = (&g[at..at + d.l], &x[at..at + d.l]);
            match mask {
                None => {
                    a[0] += lane_sum(gs, gs, |gv, _| gv);
                    a[1] += lane_sum(gs, xs, |gv, xv| gv * (xv - m));
                }
                Some(mask) => {
                    let (s, t) = mask[c];
                    a[0] += lane_sum(gs, xs, |gv, xv| keep_where_positive(gv, s * xv + t));
                    a[1] += lane_sum(gs, xs, |gv, xv| {
                        keep_where_positive(gv, s * xv + t) * (xv - m)
                    });
                }
            }
        }
    }
}

wide_simd_fn!(
    /// [`grad_runs`] in the widest vector instructions the CPU has.
    fn grad_runs_wide[T: FloatElement](
        g: &[T],
        x: &[T],
        d: Dims,
        mean: &[T],
        mask: Option<&[(T, T)]>,
        samples: std::ops::Range<usize>,
        acc: &mut [[f64; 2]]
    ) = grad_runs
);

/// The inputs of the masked gradient reduction: output gradient `g`, saved output `y` and
/// input `x`, all laid out alike.
#[derive(Clone, Copy)]
struct MaskInputs<'a, T> {
    g: &'a [T],
    y: &'a [T],
    x: &'a [T],
}

/// For samples `first..` (`out` holding whole samples): `out = g` where the saved output `y`
/// is positive, else 0 (ReLU's backward through the output), and per channel that masked
/// gradient's `[Σg', Σg'·(x − mean[c])]` added into `acc`. Each run is masked into `out` and
/// then summed from there while it is still in the cache.
#[inline(always)]
fn mask_runs<T: FloatElement>(
    MaskInputs { g, y, x }: MaskInputs<'_, T>,
    d: Dims,
    mean: &[T],
    first: usize,
    out: &mut [T],
    acc: &mut [[f64; 2]],
) {
    let per_sample = d.c * d.l;
    for (i, o) in out.chunks_exact_mut(per_sample).enumerate() {
        let n = first + i;
        for (c, (a, &m)) in acc.iter_mut().zip(mean).enumerate() {
            let at = n * per_sample + c * d.l;
            let dst = &mut o[c * d.l..(c + 1) * d.l];
            let (gs, ys, xs) = (&g[at..at + d.l], &y[at..at + d.l], &x[at..at + d.l]);
            dst.iter_mut()
                .zip(gs)
                .zip(ys)
                .for_each(|((o, &gv), &yv)| *o = keep_where_positive(gv, yv));
            let dst = &*dst;
            a[0] += lane_sum(dst, dst, |gv, _| gv);
            a[1] += lane_sum(dst, xs, |gv, xv| gv * (xv - m));
        }
    }
}

wide_simd_fn!(
    /// [`mask_runs`] in the widest vector instructions the CPU has.
    fn mask_runs_wide[T: FloatElement](
        inputs: MaskInputs<'_, T>,
        d: Dims,
        mean: &[T],
        first: usize,
        out: &mut [T],
        acc: &mut [[f64; 2]]
    ) = mask_runs
);

/// Elements a parallel task takes at least (whole samples, so usually more).
const TASK_ELEMENTS: usize = 4096;

/// Samples per parallel task: as few as make [`TASK_ELEMENTS`], so there are many small
/// tasks for the threads to share out. Inside a ResNet-20 training step at 2 threads, tasks
/// of one sample took these passes about 13% less time than 4 tasks per thread, and one
/// contiguous range per thread (matching conv2d's split) was no faster than 4 per thread:
/// the passes stream from beyond L2 either way, and what fine tasks win is balance between
/// the cores.
fn samples_per_task(d: Dims) -> usize {
    TASK_ELEMENTS.div_ceil((d.c * d.l).max(1)).max(1)
}

/// Per-channel sums over all samples: `partial(samples, acc)` adds those of a range of
/// samples into `acc`; ranges run in parallel (and are then added up) when worth it.
fn channel_sums<const K: usize>(
    d: Dims,
    work: usize,
    partial: impl Fn(std::ops::Range<usize>, &mut [[f64; K]]) + Sync,
) -> Vec<[f64; K]> {
    if !parallel(work) || d.n < 2 {
        let mut acc = vec![[0.0; K]; d.c];
        partial(0..d.n, &mut acc);
        return acc;
    }
    let chunk = samples_per_task(d);
    (0..d.n.div_ceil(chunk))
        .into_par_iter()
        .map(|i| {
            let mut acc = vec![[0.0; K]; d.c];
            partial(i * chunk..((i + 1) * chunk).min(d.n), &mut acc);
            acc
        })
        .reduce(|| vec![[0.0; K]; d.c], add_channel_sums)
}

/// `a + b` for per-channel partial sums: the reduction of parallel tasks' totals.
fn add_channel_sums<const K: usize>(mut a: Vec<[f64; K]>, b: Vec<[f64; K]>) -> Vec<[f64; K]> {
    for (a, b) in a.iter_mut().zip(&b) {
        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
    }
    a
}

/// Per-channel mean and biased variance of `x`.
pub(crate) fn moments<T: FloatElement>(x: &[T], d: Dims) -> (Vec<f64>, Vec<f64>) {
    let count = (d.n * d.l) as f64;
    let mut run_sums = vec![0.0f64; d.n * d.c];
    let squares = if parallel(x.len()) && d.n >= 2 && d.c > 0 {
        let per_task = samples_per_task(d);
        run_sums
            .par_chunks_mut(per_task * d.c)
            .enumerate()
            .map(|(i, sums)| {
                let mut squares = vec![0.0; d.c];
                moment_runs_wide(x, d, i * per_task, sums, &mut squares);
                squares
            })
            .reduce(
                || vec![0.0; d.c],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            )
    } else {
        let mut squares = vec![0.0; d.c];
        moment_runs_wide(x, d, 0, &mut run_sums, &mut squares);
        squares
    };
    let l = d.l as f64;
    (0..d.c)
        .map(|c| {
            let run_sum = |n: usize| run_sums[n * d.c + c];
            let mean = (0..d.n).map(run_sum).sum::<f64>() / count;
            // Σ(x − mean)² = Σ over runs of (their own squared deviations + l·(run mean − mean)²)
            let between: f64 = (0..d.n)
                .map(|n| {
                    let off = run_sum(n) / l - mean;
                    l * off * off
                })
                .sum();
            (mean, (squares[c] + between) / count)
        })
        .unzip()
}

/// What a per-channel map computes from `x` (and maybe a second input `y`) with the channel's
/// `(a, b, k)`.
#[derive(Clone, Copy)]
enum Form<'a, T> {
    /// `a·x + b`.
    Affine,
    /// `max(0, a·x + b)`: the normalisation with a ReLU on its output.
    AffineRelu,
    /// `a·x + b + k·y`.
    Plus(&'a [T]),
    /// `max(0, a·x + b + k·y)`: the normalisation plus a residual `y`, then a ReLU.
    PlusRelu(&'a [T]),
    /// `a·x' + b + k·y` with `x' = x` where the channel's `s·y + t > 0` and 0 elsewhere: the
    /// input gradient (`x` = output gradient, `y` = input) behind a fused ReLU whose mask is
    /// recomputed from the input with the forward's own `(s, t)`.
    MaskedPlus(&'a [T], &'a [(T, T)]),
}

/// `out` = the [`Form`] with per-channel `(a, b, k)` for samples `first..`, `out` holding
/// whole samples.
#[inline(always)]
fn map_runs<T: FloatElement>(
    x: &[T],
    form: Form<'_, T>,
    d: Dims,
    coefs: &[(T, T, T)],
    first: usize,
    out: &mut [T],
) {
    let per_sample = d.c * d.l;
    for (i, o) in out.chunks_exact_mut(per_sample).enumerate() {
        let n = first + i;
        for (c, &(a, b, k)) in coefs.iter().enumerate() {
            let at = n * per_sample + c * d.l;
            let dst = &mut o[c * d.l..(c + 1) * d.l];
            let xs = &x[at..at + d.l];
            match form {
                Form::Affine => dst.iter_mut().zip(xs).for_each(|(o, &xv)| *o = a * xv + b),
                Form::AffineRelu => dst
                    .iter_mut()
                    .zip(xs)
                    .for_each(|(o, &xv)| *o = relu_value(a * xv + b)),
                Form::Plus(y) => {
                    let ys = &y[at..at + d.l];
                    dst.iter_mut()
                        .zip(xs)
                        .zip(ys)
                        .for_each(|((o, &xv), &yv)| *o = a * xv + b + k * yv);
                }
                Form::PlusRelu(y) => {
                    let ys = &y[at..at + d.l];
                    dst.iter_mut()
                        .zip(xs)
                        .zip(ys)
                        .for_each(|((o, &xv), &yv)| *o = relu_value(a * xv + b + k * yv));
                }
                Form::MaskedPlus(y, mask) => {
                    let ys = &y[at..at + d.l];
                    let (s, t) = mask[c];
                    dst.iter_mut().zip(xs).zip(ys).for_each(|((o, &xv), &yv)| {
                        *o = a * keep_where_positive(xv, s * yv + t) + b + k * yv
                    });
                }
            }
        }
    }
}

wide_simd_fn!(
    /// [`map_runs`] in the widest vector instructions the CPU has.
    fn map_runs_wide[T: FloatElement](
        x: &[T],
        form: Form<'_, T>,
        d: Dims,
        coefs: &[(T, T, T)],
        first: usize,
        out: &mut [T]
    ) = map_runs
);

/// Applies the per-channel [`Form`] with `(a[c], b[c], k[c])` over every `(n, c)` run.
fn per_channel_map<T: FloatElement>(
    op: &'static str,
    x: &[T],
    form: Form<'_, T>,
    d: Dims,
    coef: impl Fn(usize) -> (T, T, T),
) -> Result<Vec<T>> {
    // Every element is written.
    let mut out = memory::uninit::<T>(op, x.len())?;
    let per_sample = d.c * d.l;
    if per_sample == 0 {
        return Ok(out);
    }
    let coefs: Vec<(T, T, T)> = (0..d.c).map(coef).collect();
    if parallel(x.len()) {
        let per_task = samples_per_task(d);
        out.par_chunks_mut(per_task * per_sample)
            .enumerate()
            .for_each(|(i, o)| map_runs_wide(x, form, d, &coefs, i * per_task, o));
    } else {
        map_runs_wide(x, form, d, &coefs, 0, &mut out);
    }
    Ok(out)
}

/// The per-channel `(scale, shift)` in the element type: the forward normalises with exactly
/// these, so the fused backward recomputes the very `z = scale·x + shift` whose sign the
/// forward's ReLU saw.
pub(crate) fn affine_coefs<T: FloatElement>(scale: &[f64], shift: &[f64]) -> Vec<(T, T)> {
    scale
        .iter()
        .zip(shift)
        .map(|(&a, &b)| (T::from_f64(a), T::from_f64(b)))
        .collect()
}

/// What the forward sweep does after the normalisation `z = x·scale[c] + shift[c]`.
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a, T> {
    /// Nothing: `y = z`.
    Plain,
    /// `y = max(0, z)`.
    Relu,
    /// `y = max(0, z + r)` for a residual `r` laid out like the input.
    AddRelu(&'a [T]),
}

/// `y = x·scale[c] + shift[c]` and then the [`Epilogue`], in one pass.
pub(crate) fn normalize<T: FloatElement>(
    op: &'static str,
    x: &[T],
    d: Dims,
    scale: &[f64],
    shift: &[f64],
    epilogue: Epilogue<'_, T>,
) -> Result<Vec<T>> {
    let coefs = affine_coefs::<T>(scale, shift);
    let (form, k) = match epilogue {
        Epilogue::Plain => (Form::Affine, T::ZERO),
        Epilogue::Relu => (Form::AffineRelu, T::ZERO),
        Epilogue::AddRelu(r) => (Form::PlusRelu(r), T::from_f64(1.0)),
    };
    per_channel_map(op, x, form, d, |c| (coefs[c].0, coefs[c].1, k))
}

/// Per-channel `Σ g` and `Σ g·(x − mean)`; with `mask` (from [`affine_coefs`]) `g` counts
/// only where the forward's normalised value was positive.
pub(crate) fn grad_sums<T: FloatElement>(
    g: &[T],
    x: &[T],
    d: Dims,
    mean: &[f64],
    mask: Option<&[(T, T)]>,
) -> (Vec<f64>, Vec<f64>) {
    let mean_t: Vec<T> = mean.iter().map(|&m| T::from_f64(m)).collect();
    let sums = channel_sums(d, g.len(), |samples, acc| {
        grad_runs_wide(g, x, d, &mean_t, mask, samples, acc)
    });
    sums.iter().map(|s| (s[0], s[1])).unzip()
}

/// The output gradient `g` masked where the saved output `y` is positive (the gradient
/// behind `max(0, z + r)`, for the input side and the residual alike), with the per-channel
/// `Σ g'` and `Σ g'·(x − mean)` of that masked gradient, all in one pass.
pub(crate) fn masked_grad_sums<T: FloatElement>(
    op: &'static str,
    g: &[T],
    y: &[T],
    x: &[T],
    d: Dims,
    mean: &[f64],
) -> Result<(Vec<T>, Vec<f64>, Vec<f64>)> {
    // Every element is written.
    let mut out = memory::uninit::<T>(op, g.len())?;
    let per_sample = d.c * d.l;
    if per_sample == 0 {
        return Ok((out, vec![0.0; d.c], vec![0.0; d.c]));
    }
    let mean_t: Vec<T> = mean.iter().map(|&m| T::from_f64(m)).collect();
    let inputs = MaskInputs { g, y, x };
    let sums = if parallel(g.len()) && d.n >= 2 {
        let per_task = samples_per_task(d);
        out.par_chunks_mut(per_task * per_sample)
            .enumerate()
            .map(|(i, o)| {
                let mut acc = vec![[0.0; 2]; d.c];
                mask_runs_wide(inputs, d, &mean_t, i * per_task, o, &mut acc);
                acc
            })
            .reduce(|| vec![[0.0; 2]; d.c], add_channel_sums)
    } else {
        let mut acc = vec![[0.0; 2]; d.c];
        mask_runs_wide(inputs, d, &mean_t, 0, &mut out, &mut acc);
        acc
    };
    let (sum_g, sum_g_centered) = sums.iter().map(|s| (s[0], s[1])).unzip();
    Ok((out, sum_g, sum_g_centered))
}

/// `grad_x = g·a[c] + x·b[c] + k[c]` (the closed form of the normalisation's backward,
/// expanded into per-channel constants by the caller); with `mask` (from [`affine_coefs`])
/// `g` is zeroed where the forward's normalised value was not positive.
#[allow(clippy::too_many_arguments)]
pub(crate) fn grad_input<T: FloatElement>(
    op: &'static str,
    g: &[T],
    x: &[T],
    d: Dims,
    a: &[f64],
    b: &[f64],
    k: &[f64],
    mask: Option<&[(T, T)]>,
) -> Result<Vec<T>> {
    // per_channel_map computes `a'·first + b' + k'·second`: first = g, second = x.
    let form = match mask {
        Some(mask) => Form::MaskedPlus(x, mask),
        None => Form::Plus(x),
    };
    per_channel_map(op, g, form, d, |c| {
        (T::from_f64(a[c]), T::from_f64(k[c]), T::from_f64(b[c]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_adds_every_term_including_the_tail_and_across_blocks() {
        for len in [0usize, 1, 7, 32, 33, 100, 1024, 1025, 3000] {
            let v: Vec<f64> = (0..len).map(|i| i as f64).collect();
            let got = lane_sum(&v, &v, |a, _| a);
            assert_eq!(got, (len * len.saturating_sub(1) / 2) as f64, "len {len}");
        }
    }

    #[test]
    fn moments_match_two_pass_f64_formulas_for_offset_data() {
        // a large common offset: a one-pass Σx² − (Σx)²/n would lose the variance
        let d = Dims { n: 3, c: 2, l: 50 };
        let x: Vec<f64> = (0..d.n * d.c * d.l)
            .map(|i| 1e4 + ((i * 37) % 11) as f64 * 0.25)
            .collect();
        let (mean, var) = moments(&x, d);
        for c in 0..d.c {
            let vals: Vec<f64> = (0..d.n)
                .flat_map(|n| x[(n * d.c + c) * d.l..][..d.l].to_vec())
                .collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / vals.len() as f64;
            assert!((mean[c] - m).abs() < 1e-9, "{} vs {m}", mean[c]);
            assert!((var[c] - v).abs() < 1e-9 * v.max(1.0), "{} vs {v}", var[c]);
        }
    }
}
