//! CPU kernels of the losses: per-sample negative log-likelihood, fused log-softmax +
//! negative log-likelihood (cross entropy), the sum of squared differences, and their
//! gradients; the class labels are read and checked here.
//!
//! Cross entropy keeps, per row, the maximum `m` and `ls = ln Σ e^(x − m)`: the loss is
//! `ls − (x_t − m)` and the gradient `e^((x − m) − ls) − onehot(t)`, both free of overflow for
//! any logits and without the rounding of subtracting two large numbers.

use rayon::prelude::*;
use tandem_core::{with_float_type, Element, Error, FloatElement, Result, Tensor};

use super::shape::{Classes, CrossEntropySaved, Reduction};
use crate::cpu::elementwise::{map, zip_map, zip_slices};
use crate::cpu::exp::ExpFloat;
use crate::cpu::lanes::{lanes_max, lanes_sum, lanes_sum_exp};
use crate::cpu::memory::{self, host_slice};
use crate::cpu::parallel::parallel;

const CHUNK: usize = 1 << 13;

/// The labels as indices, each checked to lie in `0..c`: a label outside is an error naming
/// the op, the label and its position, never an out-of-bounds read.
fn read_labels(op: &'static str, targets: &Tensor, c: usize) -> Result<Vec<usize>> {
    let raw = memory::gather::<i64>(op, targets)?;
    raw.iter()
        .enumerate()
        .map(|(i, &label)| {
            if label < 0 || label as u64 >= c as u64 {
                Err(Error::invalid(
                    op,
                    format!(
                        "target {label} at position {i} is out of range for C = {c} classes \
                         (labels must be in 0..{c})"
                    ),
                ))
            } else {
                Ok(label as usize)
            }
        })
        .collect()
}

/// Combines per-sample losses (of `shape`) by `reduction` (the caller has refused a mean of
/// nothing).
fn reduce_losses<T: FloatElement>(
    losses: Vec<T>,
    shape: &[usize],
    reduction: Reduction,
    source: &Tensor,
) -> Result<Tensor> {
    let device = source.device();
    match reduction {
        Reduction::None => Tensor::from_vec(losses, shape, device),
        Reduction::Sum => Tensor::scalar(lanes_sum(&losses), device),
        Reduction::Mean => {
            let mean = lanes_sum(&losses) / T::from_f64(losses.len() as f64);
            Tensor::scalar(mean, device)
        }
    }
}

/// Runs `f` on the elements of `x` as one contiguous slice (copying only a strided `x`). A
/// zero-size tensor gives an empty slice without being read: its layout may not count as
/// contiguous.
fn with_slice<T: FloatElement, R>(
    op: &'static str,
    x: &Tensor,
    f: impl FnOnce(&[T]) -> R,
) -> Result<R> {
    if x.numel() == 0 {
        return Ok(f(&[]));
    }
    let c = memory::contiguous(op, x)?;
    let data = c.read_slice::<T>()?;
    Ok(f(&data))
}

/// [`with_slice`] for two tensors.
fn with_slices<T: FloatElement, R>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&[T], &[T]) -> R,
) -> Result<R> {
    with_slice(op, a, |x| with_slice(op, b, |y| f(x, y)))?
}

/// The count to divide the output gradient by under `reduction`.
fn mean_count(reduction: Reduction, count: usize) -> Option<usize> {
    (reduction == Reduction::Mean).then_some(count)
}

/// nll of `log_probs` (`[n, c]`, any layout) against `targets` (`[n]` i64), reduced.
pub(crate) fn nll_forward(
    op: &'static str,
    log_probs: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<Tensor> {
    let labels = read_labels(op, targets, k.c)?;
    with_float_type!(op, log_probs.dtype(), T => {
        let losses = nll_losses::<T>(op, log_probs, &labels)?;
        reduce_losses(losses, &[k.n], k.reduction, log_probs)
    })
}

/// The `[n, c]` gradient of nll for the output gradient `g`.
pub(crate) fn nll_backward(
    op: &'static str,
    g: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<Tensor> {
    let labels = read_labels(op, targets, k.c)?;
    with_float_type!(op, g.dtype(), T => {
        let scales = grad_scales::<T>(op, g, mean_count(k.reduction, k.n))?;
        Tensor::from_vec(nll_grad(op, &labels, k.c, &scales)?, &[k.n, k.c], g.device())
    })
}

/// Cross entropy of `logits` (`[n, c]`) against `targets`, reduced, and what its backward
/// needs.
pub(crate) fn cross_entropy_forward(
    op: &'static str,
    logits: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<(Tensor, CrossEntropySaved)> {
    let labels = read_labels(op, targets, k.c)?;
    // contiguous once: forward and backward both walk whole rows
    let x = if logits.numel() == 0 {
        logits.detach()
    } else {
        memory::contiguous(op, logits)?
    };
    with_float_type!(op, logits.dtype(), T => {
        let rows = with_slice(op, &x, |data| cross_entropy_rows::<T>(data, k.c, &labels))?;
        let out = reduce_losses(rows.losses, &[k.n], k.reduction, logits)?;
        let device = logits.device();
        let saved = CrossEntropySaved {
            max: Tensor::from_vec(rows.max, &[k.n], device)?,
            log_sum: Tensor::from_vec(rows.log_sum, &[k.n], device)?,
            logits: x,
        };
        Ok((out, saved))
    })
}

/// The `[n, c]` gradient of cross entropy for the output gradient `g`.
pub(crate) fn cross_entropy_backward(
    op: &'static str,
    g: &Tensor,
    targets: &Tensor,
    saved: &CrossEntropySaved,
    k: Classes,
) -> Result<Tensor> {
    let labels = read_labels(op, targets, k.c)?;
    with_float_type!(op, g.dtype(), T => {
        let scales = grad_scales::<T>(op, g, mean_count(k.reduction, k.n))?;
        let (max, log_sum) = (saved.max.read_slice::<T>()?, saved.log_sum.read_slice::<T>()?);
        let grad = with_slice(op, &saved.logits, |data| {
            cross_entropy_grad(op, data, k.c, &labels, (&max, &log_sum), &scales)
        })??;
        Tensor::from_vec(grad, &[k.n, k.c], saved.logits.device())
    })
}

/// Mean squared error of `pred` and `target` (same shape), reduced.
pub(crate) fn mse_forward(
    op: &'static str,
    pred: &Tensor,
    target: &Tensor,
    reduction: Reduction,
) -> Result<Tensor> {
    let count = pred.numel();
    with_float_type!(op, pred.dtype(), T => match reduction {
        Reduction::None => zip_map::<T>(op, pred, target, |a, b| (a - b) * (a - b)),
        Reduction::Sum | Reduction::Mean => {
            let total = with_slices(op, pred, target, squared_error_sum::<T>)?;
            let value = if reduction == Reduction::Mean {
                total / T::from_f64(count as f64)
            } else {
                total
            };
            Tensor::scalar(value, pred.device())
        }
    })
}

/// The gradients of mse for the output gradient `g`: of `pred`, and of `target` when
/// `need_target`.
pub(crate) fn mse_backward(
    op: &'static str,
    g: &Tensor,
    pred: &Tensor,
    target: &Tensor,
    reduction: Reduction,
    need_target: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    with_float_type!(op, g.dtype(), T => {
        let scales = grad_scales::<T>(op, g, mean_count(reduction, pred.numel()))?;
        let grad = with_slices(op, pred, target, |a, b| squared_error_grad(op, a, b, &scales))??;
        let grad_pred = Tensor::from_vec(grad, pred.dims(), pred.device())?;
        let grad_target = if need_target { Some(map::<T>(op, &grad_pred, |v| -v)?) } else { None };
        Ok((grad_pred, grad_target))
    })
}

/// The per-sample (or single, broadcast) factor applied to a loss gradient.
fn scale_at<T: Copy>(scales: &[T], i: usize) -> T {
    if scales.len() == 1 {
        scales[0]
    } else {
        scales[i]
    }
}

/// `−log_probs[i, labels[i]]` for every row, read in place from any layout.
fn nll_losses<T: FloatElement>(
    op: &'static str,
    log_probs: &Tensor,
    labels: &[usize],
) -> Result<Vec<T>> {
    let layout = log_probs.layout();
    let (s0, s1, off) = (layout.strides()[0], layout.strides()[1], layout.offset());
    let guard = log_probs.storage().read_host(op)?;
    let data = host_slice::<T>(op, &guard)?;
    Ok(labels
        .iter()
        .enumerate()
        .map(|(i, &t)| -data[off + i * s0 + t * s1])
        .collect())
}

/// The `[n, c]` gradient of nll: `−scale_i` at `(i, labels[i])`, zero elsewhere.
fn nll_grad<T: FloatElement>(
    op: &'static str,
    labels: &[usize],
    c: usize,
    scales: &[T],
) -> Result<Vec<T>> {
    let mut grad = memory::zeroed::<T>(op, labels.len() * c)?;
    for (i, &t) in labels.iter().enumerate() {
        grad[i * c + t] = -scale_at(scales, i);
    }
    Ok(grad)
}

/// Per-row results of the fused cross-entropy forward.
struct CrossEntropyRows<T> {
    /// The loss of each row.
    pub losses: Vec<T>,
    /// The maximum logit of each row.
    pub max: Vec<T>,
    /// `ln Σ e^(x − max)` of each row.
    pub log_sum: Vec<T>,
}

/// Cross entropy of each row of the contiguous `[n, c]` logits.
fn cross_entropy_rows<T: ExpFloat>(
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
fn cross_entropy_grad<T: ExpFloat>(
    op: &'static str,
    logits: &[T],
    c: usize,
    labels: &[usize],
    rows: (&[T], &[T]),
    scales: &[T],
) -> Result<Vec<T>> {
    let (max, log_sum) = rows;
    let mut grad = memory::uninit::<T>(op, logits.len())?;
    if labels.is_empty() {
        return Ok(grad);
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
    Ok(grad)
}

/// `Σ (a − b)²` over two equally long slices; partial sums of fixed chunks are added in order,
/// so the result does not depend on the thread count.
fn squared_error_sum<T: FloatElement>(a: &[T], b: &[T]) -> T {
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
fn squared_error_grad<T: FloatElement>(
    op: &'static str,
    a: &[T],
    b: &[T],
    scales: &[T],
) -> Result<Vec<T>> {
    let mut out = memory::uninit::<T>(op, a.len())?;
    let two = T::from_f32(2.0);
    if scales.len() == 1 {
        let s = two * scales[0];
        zip_slices(a, b, &mut out, |x, y| (x - y) * s);
        return Ok(out);
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
    Ok(out)
}

/// `out = two · (a − b) · s` elementwise.
fn scaled_difference<T: FloatElement>(out: &mut [T], a: &[T], b: &[T], s: &[T], two: T) {
    for (((o, &x), &y), &s) in out.iter_mut().zip(a).zip(b).zip(s) {
        *o = two * (x - y) * s;
    }
}

/// The output-gradient factor of every sample, as a vector of 1 (`broadcast`) or n elements.
fn grad_scales<T: FloatElement>(
    op: &'static str,
    g: &Tensor,
    divide_by: Option<usize>,
) -> Result<Vec<T>> {
    let mut scales = memory::gather::<T>(op, g)?;
    if let Some(count) = divide_by {
        let inv = T::one() / T::from_f64(count as f64);
        scales.iter_mut().for_each(|s| *s *= inv);
    }
    Ok(scales)
}
