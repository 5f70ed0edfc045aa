//! Losses: negative log-likelihood, cross entropy (log-softmax and nll fused) and mean
//! squared error, each with a [`Reduction`] over the samples.
//!
//! Class targets are i64 labels in `0..C`; a label outside that range is an error naming the
//! op, the label, its position and `C` — never an out-of-bounds read. Cross entropy works
//! from the raw logits and is stable for logits of any size (see `cpu.rs`).
//!
//! # Shapes
//! * `nll_loss(log_probs [N, C], targets [N])`, `cross_entropy(logits [N, C], targets [N])`:
//!   output `[N]` with `Reduction::None`, a 0-dim scalar otherwise.
//! * `mse_loss(pred, target)`: two tensors of one shape; output that shape with
//!   `Reduction::None`, a 0-dim scalar otherwise.

mod cpu;

use tandem_autograd::record_fn;
use tandem_core::{with_float_type, DType, Element, Error, FloatElement, Result, Tensor};

use crate::softmax::cpu::lanes_sum;
use crate::unary::{map, zip_map};
use crate::util::{float_dtype, same_dtype_device};

/// How a loss combines the losses of the individual samples (or elements).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The average over samples (elements for `mse_loss`): the default, as in PyTorch. The
    /// mean of zero samples is an error rather than NaN.
    #[default]
    Mean,
    /// The sum over samples (elements).
    Sum,
    /// No reduction: one loss per sample (element).
    None,
}

/// Checks `[N, C]` float scores against `[N]` i64 targets; returns `(N, C)`.
fn check_class_inputs(
    op: &'static str,
    what: &str,
    scores: &Tensor,
    targets: &Tensor,
) -> Result<(usize, usize)> {
    float_dtype(op, scores)?;
    scores.device().same_as(targets.device(), op)?;
    if scores.rank() != 2 {
        return Err(Error::shape(
            op,
            format!("{what} must be [N, C], got shape {:?}", scores.dims()),
        ));
    }
    let (n, c) = (scores.dims()[0], scores.dims()[1]);
    if targets.dtype() != DType::I64 {
        return Err(Error::invalid(
            op,
            format!(
                "targets must be i64 class indices, got {} targets of shape {:?}",
                targets.dtype(),
                targets.dims()
            ),
        ));
    }
    if targets.dims() != [n] {
        return Err(Error::shape(
            op,
            format!(
                "targets of shape {:?} do not match {what} of shape {:?}: expected targets [{n}]",
                targets.dims(),
                scores.dims()
            ),
        ));
    }
    Ok((n, c))
}

/// The labels as indices, each checked to lie in `0..c`.
fn read_labels(op: &'static str, targets: &Tensor, c: usize) -> Result<Vec<usize>> {
    let raw = targets.to_vec::<i64>()?;
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

/// Combines per-sample losses; `what` names the samples in the empty-mean error.
fn reduce_losses<T: FloatElement>(
    op: &'static str,
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
            check_not_empty(op, losses.len(), source)?;
            let mean = lanes_sum(&losses) / T::from_f64(losses.len() as f64);
            Tensor::scalar(mean, device)
        }
    }
}

fn check_not_empty(op: &'static str, count: usize, source: &Tensor) -> Result<()> {
    if count == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "Reduction::Mean of an empty input (shape {:?}) is undefined",
                source.dims()
            ),
        ));
    }
    Ok(())
}

/// Runs `f` on the elements of `x` as one contiguous slice (copying only a strided `x`). A
/// zero-size tensor gives an empty slice without being read: its layout may not count as
/// contiguous.
fn with_slice<T: FloatElement, R>(x: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    if x.numel() == 0 {
        return Ok(f(&[]));
    }
    let c = x.contiguous_detached()?;
    let data = c.read_slice::<T>()?;
    Ok(f(&data))
}

/// [`with_slice`] for two tensors.
fn with_slices<T: FloatElement, R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&[T], &[T]) -> R,
) -> Result<R> {
    with_slice(a, |x| with_slice(b, |y| f(x, y)))?
}

/// The count to divide the output gradient by under `reduction`.
fn mean_count(reduction: Reduction, count: usize) -> Option<usize> {
    (reduction == Reduction::Mean).then_some(count)
}

/// Negative log-likelihood of the target classes: `loss_i = −log_probs[i, targets[i]]`,
/// reduced by `reduction`. `log_probs` are usually the output of `log_softmax(·, 1)`; use
/// [`cross_entropy`] to go from logits in one stable step.
///
/// # Shapes
/// `log_probs`: `[N, C]` (f32/f64), `targets`: `[N]` (i64 in `0..C`) → output: `[N]` for
/// `Reduction::None`, `[]` otherwise.
pub fn nll_loss(log_probs: &Tensor, targets: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("nll_loss", tandem_core::profile::Phase::Forward);
    const OP: &str = "nll_loss";
    let (n, c) = check_class_inputs(OP, "log_probs", log_probs, targets)?;
    let labels = read_labels(OP, targets, c)?;
    let out = with_float_type!(OP, log_probs.dtype(), T => {
        let losses = cpu::nll_forward::<T>(log_probs, &labels)?;
        reduce_losses(OP, losses, &[n], reduction, log_probs)
    })?;
    let device = log_probs.device();
    Ok(record_fn(out, &[log_probs], OP, move || {
        move |g: &Tensor| {
            let grad = with_float_type!(OP, g.dtype(), T => {
                let scales = cpu::grad_scales::<T>(g, mean_count(reduction, n))?;
                Tensor::from_vec(cpu::nll_backward(&labels, c, &scales), &[n, c], device)
            })?;
            Ok(vec![Some(grad)])
        }
    }))
}

/// Cross entropy between the softmax of `logits` and the target classes:
/// `loss_i = ln Σ_j e^(logits[i, j]) − logits[i, targets[i]]`, reduced by `reduction`.
///
/// Equal to `nll_loss(log_softmax(logits, 1), targets)` but fused: one pass forward, one
/// backward (`softmax − onehot`), stable for logits of any magnitude.
///
/// # Shapes
/// `logits`: `[N, C]` (f32/f64), `targets`: `[N]` (i64 in `0..C`) → output: `[N]` for
/// `Reduction::None`, `[]` otherwise.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let _profile =
        tandem_core::profile::scope("cross_entropy", tandem_core::profile::Phase::Forward);
    const OP: &str = "cross_entropy";
    let (n, c) = check_class_inputs(OP, "logits", logits, targets)?;
    let labels = read_labels(OP, targets, c)?;
    // contiguous once: forward and backward both walk whole rows
    let x = if logits.numel() == 0 {
        logits.detach()
    } else {
        logits.contiguous_detached()?
    };
    with_float_type!(OP, logits.dtype(), T => {
        let rows = with_slice(&x, |data| cpu::cross_entropy_forward::<T>(data, c, &labels))?;
        let out = reduce_losses(OP, rows.losses, &[n], reduction, logits)?;
        let (max, log_sum) = (rows.max, rows.log_sum);
        Ok(record_fn(out, &[logits], OP, move || {
            move |g: &Tensor| {
                let scales = cpu::grad_scales::<T>(g, mean_count(reduction, n))?;
                let grad = with_slice(&x, |data| {
                    cpu::cross_entropy_backward(data, c, &labels, (&max, &log_sum), &scales)
                })?;
                Ok(vec![Some(Tensor::from_vec(grad, &[n, c], x.device())?)])
            }
        }))
    })
}

/// Mean squared error: `(pred − target)²` elementwise, reduced by `reduction` (the mean is
/// over all elements). Both inputs are differentiable.
///
/// # Shapes
/// `pred`, `target`: the same shape (no broadcasting), same float dtype → output: that shape
/// for `Reduction::None`, `[]` otherwise.
pub fn mse_loss(pred: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("mse_loss", tandem_core::profile::Phase::Forward);
    const OP: &str = "mse_loss";
    same_dtype_device(OP, pred, target)?;
    float_dtype(OP, pred)?;
    if pred.dims() != target.dims() {
        return Err(Error::shape(
            OP,
            format!(
                "pred of shape {:?} and target of shape {:?} must have the same shape",
                pred.dims(),
                target.dims()
            ),
        ));
    }
    let count = pred.numel();
    let out = with_float_type!(OP, pred.dtype(), T => match reduction {
        Reduction::None => zip_map::<T>(pred, target, |a, b| (a - b) * (a - b)),
        Reduction::Sum | Reduction::Mean => {
            if reduction == Reduction::Mean {
                check_not_empty(OP, count, pred)?;
            }
            let total = with_slices(pred, target, cpu::squared_error_sum::<T>)?;
            let value = if reduction == Reduction::Mean {
                total / T::from_f64(count as f64)
            } else {
                total
            };
            Tensor::scalar(value, pred.device())
        }
    })?;
    let (need_pred, need_target) = (pred.requires_grad(), target.requires_grad());
    let (p, t) = (pred.detach(), target.detach());
    Ok(record_fn(out, &[pred, target], OP, move || {
        move |g: &Tensor| {
            with_float_type!(OP, g.dtype(), T => {
                let scales = cpu::grad_scales::<T>(g, mean_count(reduction, count))?;
                let grad = with_slices(&p, &t, |a, b| cpu::squared_error_grad(a, b, &scales))?;
                let grad_pred = Tensor::from_vec(grad, p.dims(), p.device())?;
                let grad_target = if need_target { Some(map::<T>(&grad_pred, |v| -v)?) } else { None };
                Ok(vec![need_pred.then_some(grad_pred), grad_target])
            })
        }
    }))
}

#[cfg(test)]
mod tests;
