//! CPU kernels of the losses: per-sample negative log-likelihood, fused log-softmax +
//! negative log-likelihood (cross entropy), the sum of squared differences, and their
//! gradients.
//!
//! Cross entropy keeps, per row, the maximum `m` and `ls = ln Σ e^(x − m)`: the loss is
//! `ls − (x_t − m)` and the gradient `e^((x − m) − ls) − onehot(t)`, both free of overflow for
//! any logits and without the rounding of subtracting two large numbers.

use rayon::prelude::*;
use tandem_core::{FloatElement, Result, Tensor};

use crate::softmax::cpu::{lanes_max, lanes_sum, lanes_sum_exp};
use crate::unary::ExpFloat;
use crate::util::parallel;

const CHUNK: usize = 1 << 13;

/// The per-sample (or single, broadcast) factor applied to a loss gradient.
fn scale_at<T: Copy>(scales: &[T], i: usize) -> T {
    if scales.len() == 1 {
        scales[0]
    } else {
        scales[i]
    }
}

/// `−log_probs[i, labels[i]]` for every row, read in place from any layout.
pub(crate) fn nll_forward<T: FloatElement>(log_probs: &Tensor, labels: &[usize]) -> Result<Vec<T>> {
    let layout = log_probs.layout();
    let (s0, s1, off) = (layout.strides()[0], layout.strides()[1], layout.offset());
    let guard = log_probs.storage().read_host("nll_loss")?;
    let data = T::slice(&guard).expect("dtype checked by the caller");
    Ok(labels
        .iter()
        .enumerate()
        .map(|(i, &t)| -data[off + i * s0 + t * s1])
        .collect())
}

/// The `[n, c]` gradient of nll: `−scale_i` at `(i, labels[i])`, zero elsewhere.
pub(crate) fn nll_backward<T: FloatElement>(labels: &[usize], c: usize, scales: &[T]) -> Vec<T> {
    let mut grad = tandem_core::alloc::zeroed::<T>(labels.len() * c);
    for (i, &t) in labels.iter().enumerate() {
        grad[i * c + t] = -scale_at(scales, i);
    }
    grad
}

/// Per-row results of the fused cross-entropy forward.
pub(crate) struct CrossEntropyRows<T> {
    /// The loss of each row.
    pub losses: Vec<T>,
    /// The maximum logit of each row.
    pub max: Vec<T>,
    /// `ln Σ e^(x − max)` of each row.
    pub log_sum: Vec<T>,
}

/// Cross entropy of each row of the contiguous `[n, c]` logits.
pub(crate) fn cross_entropy_forward<T: ExpFloat>(
    logits: &[T],
    c: usize,
    labels: &[usize],
) -> CrossEntropyRows<T> {
    if labels.is_empty() {
        // also covers c == 0, which `chunks` would reject
        return CrossEntropyRows {
            losses: Vec::new(),
            max: Vec::new(),
            log_sum: Vec::new(),
        };
    }
    let row = |(x, &t): (&[T], &usize)| -> (T, T, T) {
        let m = lanes_max(x);
        let s = lanes_sum_exp(x, m);
        let ls = s.ln();
        (ls - (x[t] - m), m, ls)
    };
    let rows: Vec<(T, T, T)> = if parallel(logits.len()) {
        logits
            .par_chunks(c)
            .zip(labels.par_iter())
            .map(row)
            .collect()
    } else {
        logits.chunks(c).zip(labels.iter()).map(row).collect()
    };
    let mut out = CrossEntropyRows {
        losses: Vec::with_capacity(rows.len()),
        max: Vec::with_capacity(rows.len()),
        log_sum: Vec::with_capacity(rows.len()),
    };
    for (l, m, ls) in rows {
        out.losses.push(l);
        out.max.push(m);
        out.log_sum.push(ls);
    }
    out
}

/// The `[n, c]` gradient of cross entropy: `scale_i · (softmax(x_i) − onehot(labels[i]))`.
pub(crate) fn cross_entropy_backward<T: ExpFloat>(
    logits: &[T],
    c: usize,
    labels: &[usize],
    rows: (&[T], &[T]),
    scales: &[T],
) -> Vec<T> {
    let (max, log_sum) = rows;
    let mut grad = tandem_core::alloc::uninit::<T>(logits.len());
    if labels.is_empty() {
        return grad;
    }
    let row = |(i, (d, x)): (usize, (&mut [T], &[T]))| {
        let (m, ls, s) = (max[i], log_sum[i], scale_at(scales, i));
        for (d, &x) in d.iter_mut().zip(x) {
            *d = s * ((x - m) - ls).exp_fast();
        }
        d[labels[i]] -= s;
    };
    if parallel(logits.len()) {
        grad.par_chunks_mut(c)
            .zip(logits.par_chunks(c))
            .enumerate()
            .for_each(row);
    } else {
        grad.chunks_mut(c)
            .zip(logits.chunks(c))
            .enumerate()
            .for_each(row);
    }
    grad
}

/// `Σ (a − b)²` over two equally long slices; partial sums of fixed chunks are added in order,
/// so the result does not depend on the thread count.
pub(crate) fn squared_error_sum<T: FloatElement>(a: &[T], b: &[T]) -> T {
    let chunk_sum = |(a, b): (&[T], &[T])| -> T {
        let mut lanes = [T::ZERO; 8];
        let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
        let rest: T = ca
            .remainder()
            .iter()
            .zip(cb.remainder())
            .fold(T::ZERO, |acc, (&x, &y)| acc + (x - y) * (x - y));
        for (x, y) in ca.zip(cb) {
            for i in 0..8 {
                let d = x[i] - y[i];
                lanes[i] += d * d;
            }
        }
        lanes_sum(&lanes) + rest
    };
    let partials: Vec<T> = if parallel(a.len()) {
        a.par_chunks(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .map(chunk_sum)
            .collect()
    } else {
        a.chunks(CHUNK)
            .zip(b.chunks(CHUNK))
            .map(chunk_sum)
            .collect()
    };
    partials.into_iter().fold(T::ZERO, |acc, v| acc + v)
}

/// `2 (a − b) · scale` elementwise, the scale being one number or one per element.
pub(crate) fn squared_error_grad<T: FloatElement>(a: &[T], b: &[T], scales: &[T]) -> Vec<T> {
    let mut out = tandem_core::alloc::uninit::<T>(a.len());
    let two = T::from_f32(2.0);
    if scales.len() == 1 {
        let s = two * scales[0];
        crate::unary::zip_slices(a, b, &mut out, |x, y| (x - y) * s);
        return out;
    }
    if parallel(out.len()) {
        out.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK))
            .zip(scales.par_chunks(CHUNK))
            .for_each(|(((o, a), b), s)| scaled_difference(o, a, b, s, two));
    } else {
        scaled_difference(&mut out, a, b, scales, two);
    }
    out
}

/// `out = two · (a − b) · s` elementwise.
fn scaled_difference<T: FloatElement>(out: &mut [T], a: &[T], b: &[T], s: &[T], two: T) {
    for (((o, &x), &y), &s) in out.iter_mut().zip(a).zip(b).zip(s) {
        *o = two * (x - y) * s;
    }
}

/// The output-gradient factor of every sample, as a vector of 1 (`broadcast`) or n elements.
pub(crate) fn grad_scales<T: FloatElement>(g: &Tensor, divide_by: Option<usize>) -> Result<Vec<T>> {
    let mut scales = g.to_vec::<T>()?;
    if let Some(count) = divide_by {
        let inv = T::one() / T::from_f64(count as f64);
        scales.iter_mut().for_each(|s| *s *= inv);
    }
    Ok(scales)
}
