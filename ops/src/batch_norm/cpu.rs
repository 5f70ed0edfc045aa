//! CPU kernels of batch normalization. The input is viewed as `[N, C, L]` (L = product of the
//! dims after the channel), so each `(n, c)` pair owns one contiguous run of `L` elements.
//! Reductions accumulate in f64 with several independent lanes (so they vectorise) and run in
//! parallel over chunks of samples, each producing per-channel partial sums; elementwise passes
//! are fused into one `a·g + b·x + c`-style sweep with per-channel constants.

use rayon::prelude::*;
use tandem_core::FloatElement;

use crate::util::PARALLEL_THRESHOLD;

/// The input viewed as `[n, c, l]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub n: usize,
    pub c: usize,
    pub l: usize,
}

const LANES: usize = 8;

/// `Σ f(a[i], b[i])` over two equally long runs, with independent lanes so the additions
/// vectorise (a single running sum would serialise on the add latency).
#[inline(always)]
fn lane_sum<T: FloatElement>(a: &[T], b: &[T], f: impl Fn(T, T) -> f64) -> f64 {
    let mut acc = [0.0f64; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for k in 0..LANES {
            acc[k] += f(xa[k], xb[k]);
        }
    }
    let mut total: f64 = acc.iter().sum();
    for (&va, &vb) in ra.iter().zip(rb) {
        total += f(va, vb);
    }
    total
}

/// Sums, per channel, `k` values produced by `f(run_of_x, run_of_y, channel) -> [f64; K]`
/// over every `(n, c)` run of two same-shaped arrays, in parallel over samples when large.
fn channel_sums<T: FloatElement, const K: usize>(
    x: &[T],
    y: &[T],
    d: Dims,
    f: impl Fn(&[T], &[T], usize) -> [f64; K] + Sync,
) -> Vec<[f64; K]> {
    let per_sample = d.c * d.l;
    let partial = |samples: std::ops::Range<usize>| {
        let mut acc = vec![[0.0; K]; d.c];
        for n in samples {
            for (c, a) in acc.iter_mut().enumerate() {
                let at = n * per_sample + c * d.l;
                let v = f(&x[at..at + d.l], &y[at..at + d.l], c);
                a.iter_mut().zip(v).for_each(|(a, v)| *a += v);
            }
        }
        acc
    };
    if x.len() < PARALLEL_THRESHOLD || d.n < 2 {
        return partial(0..d.n);
    }
    let chunk = d.n.div_ceil(rayon::current_num_threads() * 4).max(1);
    (0..d.n.div_ceil(chunk))
        .into_par_iter()
        .map(|i| partial(i * chunk..((i + 1) * chunk).min(d.n)))
        .reduce(
            || vec![[0.0; K]; d.c],
            |mut a, b| {
                for (a, b) in a.iter_mut().zip(&b) {
                    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                }
                a
            },
        )
}

/// Per-channel mean and biased variance of `x` (two passes, for accuracy).
pub(crate) fn moments<T: FloatElement>(x: &[T], d: Dims) -> (Vec<f64>, Vec<f64>) {
    let count = (d.n * d.l) as f64;
    let sums = channel_sums(x, x, d, |run, _, _| [lane_sum(run, run, |v, _| v.to_f64())]);
    let mean: Vec<f64> = sums.iter().map(|s| s[0] / count).collect();
    let sq = channel_sums(x, x, d, |run, _, c| {
        let m = mean[c];
        [lane_sum(run, run, |v, _| {
            let v = v.to_f64() - m;
            v * v
        })]
    });
    let var = sq.iter().map(|s| s[0] / count).collect();
    (mean, var)
}

/// Applies per-channel `out = a[c]·x + b[c] (+ y·k[c] when given)` over every `(n, c)` run.
fn per_channel_map<T: FloatElement>(
    x: &[T],
    y: Option<&[T]>,
    d: Dims,
    coef: impl Fn(usize) -> (T, T, T) + Sync,
) -> Vec<T> {
    let mut out = vec![T::ZERO; x.len()];
    let per_sample = d.c * d.l;
    if per_sample == 0 {
        return out;
    }
    let coefs: Vec<(T, T, T)> = (0..d.c).map(coef).collect();
    let run = |n: usize, o: &mut [T]| {
        for (c, &(a, b, k)) in coefs.iter().enumerate() {
            let at = n * per_sample + c * d.l;
            let dst = &mut o[c * d.l..(c + 1) * d.l];
            let xs = &x[at..at + d.l];
            match y {
                Some(y) => {
                    let ys = &y[at..at + d.l];
                    dst.iter_mut()
                        .zip(xs)
                        .zip(ys)
                        .for_each(|((o, &xv), &yv)| *o = a * xv + b + k * yv);
                }
                None => dst.iter_mut().zip(xs).for_each(|(o, &xv)| *o = a * xv + b),
            }
        }
    };
    if x.len() < PARALLEL_THRESHOLD {
        out.chunks_mut(per_sample)
            .enumerate()
            .for_each(|(n, o)| run(n, o));
    } else {
        out.par_chunks_mut(per_sample)
            .enumerate()
            .for_each(|(n, o)| run(n, o));
    }
    out
}

/// `y = x·scale[c] + shift[c]`: the normalisation and affine map in one pass.
pub(crate) fn normalize<T: FloatElement>(x: &[T], d: Dims, scale: &[f64], shift: &[f64]) -> Vec<T> {
    per_channel_map(x, None, d, |c| {
        (T::from_f64(scale[c]), T::from_f64(shift[c]), T::ZERO)
    })
}

/// Per-channel `Σ g` and `Σ g·(x − mean)`.
pub(crate) fn grad_sums<T: FloatElement>(
    g: &[T],
    x: &[T],
    d: Dims,
    mean: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let sums = channel_sums(g, x, d, |gs, xs, c| {
        let m = mean[c];
        [
            lane_sum(gs, gs, |gv, _| gv.to_f64()),
            lane_sum(gs, xs, |gv, xv| gv.to_f64() * (xv.to_f64() - m)),
        ]
    });
    sums.iter().map(|s| (s[0], s[1])).unzip()
}

/// `grad_x = g·a[c] + x·b[c] + k[c]` (the closed form of the normalisation's backward,
/// expanded into per-channel constants by the caller).
pub(crate) fn grad_input<T: FloatElement>(
    g: &[T],
    x: &[T],
    d: Dims,
    a: &[f64],
    b: &[f64],
    k: &[f64],
) -> Vec<T> {
    // per_channel_map computes `a'·first + b' + k'·second`: first = g, second = x.
    per_channel_map(g, Some(x), d, |c| {
        (T::from_f64(a[c]), T::from_f64(k[c]), T::from_f64(b[c]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_adds_every_term_including_the_tail() {
        for len in [0usize, 1, 7, 8, 9, 23] {
            let v: Vec<f64> = (0..len).map(|i| i as f64).collect();
            let got = lane_sum(&v, &v, |a, _| a);
            assert_eq!(got, (len * len.saturating_sub(1) / 2) as f64, "len {len}");
        }
    }
}
