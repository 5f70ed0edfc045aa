//! The losses on a CUDA device: the device side of `nll_loss`, `cross_entropy` and `mse_loss`,
//! forward and backward, running the plans of [`launch`].
//!
//! Class labels are never read on the host (that would stall the stream every step): the
//! kernels check them and record the first bad one in the calling thread's deferred-error record
//! on the device ([`tandem_core::cuda::deferred`]), and the host reports it, worded as the CPU
//! op's error, at that thread's next read of the device (`loss.item()`, `to_vec`,
//! `synchronize`); other threads on the device never see it. Per-sample losses
//! are reduced (Sum, Mean) by `reduce.cu`'s deterministic sums. Nothing here waits for the
//! device.

pub mod launch;

use tandem_core::cuda::deferred;
use tandem_core::cuda::{device_pointer, launch_on_compute};
use tandem_core::{Error, Layout, Result, Shape, Tensor};

use super::shape::{Classes, CrossEntropySaved, Reduction};
use crate::device_address::first_element_address as element_address;
use launch::{
    cross_entropy_backward_launch, cross_entropy_rows_launch, mse_backward_launch,
    mse_forward_launch, nll_backward_launch, nll_forward_launch, Labels, Scales,
    CROSS_ENTROPY_LABELS, NLL_LABELS,
};

/// The labels of the `[n]` i64 `targets` as the kernels read them.
fn labels(op: &'static str, targets: &Tensor) -> Result<Labels> {
    Ok(Labels {
        ptr: element_address(op, targets)?,
        stride: targets.layout().strides().first().copied().unwrap_or(0),
    })
}

/// The output gradient `g` (a scalar, or one per sample) with the factor of `reduction`.
fn scales(op: &'static str, g: &Tensor, reduction: Reduction, count: usize) -> Result<Scales> {
    let scale = if reduction == Reduction::Mean {
        1.0 / count as f64
    } else {
        1.0
    };
    let stride = if g.rank() == 0 {
        0
    } else {
        g.layout().strides()[0]
    };
    Ok(Scales {
        ptr: element_address(op, g)?,
        stride,
        scale,
    })
}

/// Per-sample losses (`[n]`, dense) combined by `reduction`.
fn reduce_losses(op: &'static str, losses: Tensor, reduction: Reduction) -> Result<Tensor> {
    let n = losses.numel();
    match reduction {
        Reduction::None => Ok(losses),
        Reduction::Sum => crate::reduce::cuda::sum(op, &losses, &[0], &[], 1.0),
        Reduction::Mean => crate::reduce::cuda::sum(op, &losses, &[0], &[], 1.0 / n as f64),
    }
}

/// nll of `log_probs` (`[n, c]`, any layout) against `targets`, reduced.
pub(crate) fn nll_forward(
    op: &'static str,
    log_probs: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<Tensor> {
    let losses = Tensor::empty(&[k.n], log_probs.dtype(), log_probs.device())?;
    if k.n > 0 {
        let (dev, _) = device_pointer(op, log_probs)?;
        let strides = log_probs.layout().strides();
        let launch = nll_forward_launch(
            op,
            log_probs.dtype(),
            element_address(op, log_probs)?,
            (strides[0], strides[1]),
            labels(op, targets)?,
            element_address(op, &losses)?,
            (k.n, k.c),
            deferred::slot(&dev, &NLL_LABELS)?,
        )?;
        launch_on_compute(&dev, &launch, k.n)?;
    }
    reduce_losses(op, losses, k.reduction)
}

/// The `[n, c]` gradient of nll for the output gradient `g`.
pub(crate) fn nll_backward(
    op: &'static str,
    g: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<Tensor> {
    let grad = Tensor::empty(&[k.n, k.c], g.dtype(), g.device())?;
    if grad.numel() == 0 {
        return Ok(grad);
    }
    let (dev, _) = device_pointer(op, g)?;
    let launch = nll_backward_launch(
        op,
        g.dtype(),
        labels(op, targets)?,
        scales(op, g, k.reduction, k.n)?,
        element_address(op, &grad)?,
        (k.n, k.c),
        deferred::slot(&dev, &NLL_LABELS)?,
    )?;
    launch_on_compute(&dev, &launch, grad.numel())?;
    Ok(grad)
}

/// Cross entropy of `logits` (`[n, c]`) against `targets`, reduced, and what its backward
/// needs (the dense logits, and per row the maximum and `ln Σ e^(x − max)`).
pub(crate) fn cross_entropy_forward(
    op: &'static str,
    logits: &Tensor,
    targets: &Tensor,
    k: Classes,
) -> Result<(Tensor, CrossEntropySaved)> {
    if k.c == 0 && k.n > 0 {
        // No label can be in range, and there is no logit to read: the CPU op's error, now.
        return Err(Error::invalid(
            op,
            format!(
                "targets are out of range for C = 0 classes (logits of shape {:?})",
                logits.dims()
            ),
        ));
    }
    let x = logits.contiguous_detached()?;
    let device = logits.device();
    let losses = Tensor::empty(&[k.n], x.dtype(), device)?;
    let max = Tensor::empty(&[k.n], x.dtype(), device)?;
    let log_sum = Tensor::empty(&[k.n], x.dtype(), device)?;
    if k.n > 0 {
        let (dev, _) = device_pointer(op, &x)?;
        let launch = cross_entropy_rows_launch(
            op,
            x.dtype(),
            element_address(op, &x)?,
            labels(op, targets)?,
            (
                element_address(op, &losses)?,
                element_address(op, &max)?,
                element_address(op, &log_sum)?,
            ),
            k.n,
            k.c,
            deferred::slot(&dev, &CROSS_ENTROPY_LABELS)?,
        )?;
        launch_on_compute(&dev, &launch, k.n)?;
    }
    let out = reduce_losses(op, losses, k.reduction)?;
    Ok((
        out,
        CrossEntropySaved {
            logits: x,
            max,
            log_sum,
        },
    ))
}

/// The `[n, c]` gradient of cross entropy for the output gradient `g`.
pub(crate) fn cross_entropy_backward(
    op: &'static str,
    g: &Tensor,
    targets: &Tensor,
    saved: &CrossEntropySaved,
    k: Classes,
) -> Result<Tensor> {
    let grad = Tensor::empty(&[k.n, k.c], g.dtype(), g.device())?;
    if grad.numel() == 0 {
        return Ok(grad);
    }
    let (dev, _) = device_pointer(op, g)?;
    let launch = cross_entropy_backward_launch(
        op,
        g.dtype(),
        element_address(op, &saved.logits)?,
        labels(op, targets)?,
        (
            element_address(op, &saved.max)?,
            element_address(op, &saved.log_sum)?,
        ),
        scales(op, g, k.reduction, k.n)?,
        element_address(op, &grad)?,
        (k.n, k.c),
        deferred::slot(&dev, &CROSS_ENTROPY_LABELS)?,
    )?;
    launch_on_compute(&dev, &launch, grad.numel())?;
    Ok(grad)
}

/// Mean squared error of `pred` and `target` (same shape), reduced.
pub(crate) fn mse_forward(
    op: &'static str,
    pred: &Tensor,
    target: &Tensor,
    reduction: Reduction,
) -> Result<Tensor> {
    let squares = Tensor::empty(pred.dims(), pred.dtype(), pred.device())?;
    let n = squares.numel();
    if n > 0 {
        let (dev, p) = device_pointer(op, pred)?;
        let (_, t) = device_pointer(op, target)?;
        let (_, out) = device_pointer(op, &squares)?;
        let launch = mse_forward_launch(
            op,
            pred.dtype(),
            (p, pred.layout()),
            (t, target.layout()),
            out,
        )?;
        launch_on_compute(&dev, &launch, n)?;
    }
    let all: Vec<usize> = (0..squares.rank()).collect();
    match reduction {
        Reduction::None => Ok(squares),
        Reduction::Sum => crate::reduce::cuda::sum(op, &squares, &all, &[], 1.0),
        Reduction::Mean => crate::reduce::cuda::sum(op, &squares, &all, &[], 1.0 / n as f64),
    }
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
    let grad_pred = Tensor::empty(pred.dims(), pred.dtype(), pred.device())?;
    let grad_target = if need_target {
        Some(Tensor::empty(pred.dims(), pred.dtype(), pred.device())?)
    } else {
        None
    };
    let n = grad_pred.numel();
    if n == 0 {
        return Ok((grad_pred, grad_target));
    }
    let scale = if reduction == Reduction::Mean {
        1.0 / n as f64
    } else {
        1.0
    };
    // A scalar gradient (Sum, Mean) is read through strides of 0.
    let g_layout = if g.rank() == 0 {
        Layout::from_parts(
            Shape::from_slice(pred.dims()),
            pred.dims().iter().map(|_| 0).collect(),
            g.layout().offset(),
        )
    } else {
        g.layout().clone()
    };
    let (dev, p) = device_pointer(op, pred)?;
    let (_, t) = device_pointer(op, target)?;
    let (_, g_ptr) = device_pointer(op, g)?;
    let (_, gp) = device_pointer(op, &grad_pred)?;
    let gt = match &grad_target {
        Some(t) => Some(device_pointer(op, t)?.1),
        None => None,
    };
    let launch = mse_backward_launch(
        op,
        pred.dtype(),
        (p, pred.layout()),
        (t, target.layout()),
        (g_ptr, &g_layout),
        scale,
        gp,
        gt,
    )?;
    launch_on_compute(&dev, &launch, n)?;
    Ok((grad_pred, grad_target))
}
