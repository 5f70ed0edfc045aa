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
pub mod cuda;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{DType, Device, Error, Result, Tensor};

use crate::checks::{float_dtype, same_dtype_device};
use shape::Classes;
pub use shape::Reduction;

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

/// Errors (naming `op`) on a `Reduction::Mean` over no samples.
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
    let log_probs = &crate::autocast::to_f32(log_probs)?; // autocast's f32 list
    let (n, c) = check_class_inputs(OP, "log_probs", log_probs, targets)?;
    if reduction == Reduction::Mean {
        check_not_empty(OP, n, log_probs)?;
    }
    let classes = Classes { n, c, reduction };
    let out = match log_probs.device() {
        Device::Cpu => cpu::nll_forward(OP, log_probs, targets, classes)?,
        Device::Cuda(_) => cuda::nll_forward(OP, log_probs, targets, classes)?,
    };
    let targets = targets.detach();
    Ok(record_fn(out, &[log_probs], OP, move || {
        move |g: &Tensor| {
            let grad = match g.device() {
                Device::Cpu => cpu::nll_backward(OP, g, &targets, classes)?,
                Device::Cuda(_) => cuda::nll_backward(OP, g, &targets, classes)?,
            };
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
    let logits = &crate::autocast::to_f32(logits)?; // autocast's f32 list
    let (n, c) = check_class_inputs(OP, "logits", logits, targets)?;
    if reduction == Reduction::Mean {
        check_not_empty(OP, n, logits)?;
    }
    let classes = Classes { n, c, reduction };
    let (out, saved) = match logits.device() {
        Device::Cpu => cpu::cross_entropy_forward(OP, logits, targets, classes)?,
        Device::Cuda(_) => cuda::cross_entropy_forward(OP, logits, targets, classes)?,
    };
    let targets = targets.detach();
    Ok(record_fn(out, &[logits], OP, move || {
        move |g: &Tensor| {
            let grad = match g.device() {
                Device::Cpu => cpu::cross_entropy_backward(OP, g, &targets, &saved, classes)?,
                Device::Cuda(_) => cuda::cross_entropy_backward(OP, g, &targets, &saved, classes)?,
            };
            Ok(vec![Some(grad)])
        }
    }))
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
    let pred = &crate::autocast::to_f32(pred)?; // autocast's f32 list
    let target = &crate::autocast::to_f32(target)?;
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
    if reduction == Reduction::Mean {
        check_not_empty(OP, pred.numel(), pred)?;
    }
    let out = match pred.device() {
        Device::Cpu => cpu::mse_forward(OP, pred, target, reduction)?,
        Device::Cuda(_) => cuda::mse_forward(OP, pred, target, reduction)?,
    };
    let (need_pred, need_target) = (pred.requires_grad(), target.requires_grad());
    let (p, t) = (pred.detach(), target.detach());
    Ok(record_fn(out, &[pred, target], OP, move || {
        move |g: &Tensor| {
            let (grad_pred, grad_target) = match g.device() {
                Device::Cpu => cpu::mse_backward(OP, g, &p, &t, reduction, need_target)?,
                Device::Cuda(_) => cuda::mse_backward(OP, g, &p, &t, reduction, need_target)?,
            };
            Ok(vec![need_pred.then_some(grad_pred), grad_target])
        }
    }))
}

#[cfg(test)]
mod tests;
