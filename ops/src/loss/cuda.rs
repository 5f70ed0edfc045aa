//! The losses on a CUDA device: launch plans for `loss.cu` (pure, run on a device by the ops
//! and on the CPU by the host harness) and the device side of `nll_loss`, `cross_entropy` and
//! `mse_loss`, forward and backward.
//!
//! Class labels are never read on the host (that would stall the stream every step): the
//! kernels check them and record the first bad one in the calling thread's deferred-error record
//! on the device ([`tandem_core::cuda::deferred`]), and the host reports it, worded as the CPU
//! op's error, at that thread's next read of the device (`loss.item()`, `to_vec`,
//! `synchronize`); other threads on the device never see it. Per-sample losses
//! are reduced (Sum, Mean) by `reduce.cu`'s deterministic sums. Nothing here waits for the
//! device.

use tandem_core::cuda::deferred::{self, DeferredCheck, DeferredSlot, Finding};
use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use tandem_core::cuda::{device_pointer, launch_on_compute};
use tandem_core::{DType, Error, Layout, Result, Shape, Tensor};

use super::cpu::CrossEntropySaved;
use super::{Classes, Reduction};
use crate::reduce::cuda::{check_dtype, compute_arg, rows_config, THREADS_PER_BLOCK};
use crate::softmax::cuda::element_address;

/// `loss.cu`, embedded.
pub static LOSS: KernelSource = KernelSource {
    name: "loss",
    source: include_str!("loss.cu"),
    headers: &[],
};

/// The CPU op's words for a label outside `0..C`.
fn describe_label(f: &Finding) -> String {
    format!(
        "target {} at position {} is out of range for C = {} classes (labels must be in 0..{})",
        f.value, f.position, f.bound, f.bound
    )
}

/// Bad labels found by `cross_entropy`'s kernels.
pub static CROSS_ENTROPY_LABELS: DeferredCheck =
    DeferredCheck::new("cross_entropy", describe_label);
/// Bad labels found by `nll_loss`'s kernels.
pub static NLL_LABELS: DeferredCheck = DeferredCheck::new("nll_loss", describe_label);

/// The i64 class labels as a kernel reads them: the address of the first and the stride between
/// two, in elements.
#[derive(Clone, Copy, Debug)]
pub struct Labels {
    /// Address of the first label.
    pub ptr: u64,
    /// Elements between two labels.
    pub stride: usize,
}

/// The output gradient of a classification loss as a kernel reads it: the address of its
/// first element, the stride between samples (0 for the scalar of a reduced loss), and the
/// factor applied to it (`1 / N` for a mean).
#[derive(Clone, Copy, Debug)]
pub struct Scales {
    /// Address of the first element.
    pub ptr: u64,
    /// Elements between two samples' gradients (0: one gradient for all).
    pub stride: usize,
    /// Applied to every gradient.
    pub scale: f64,
}

fn slot_args(slot: DeferredSlot) -> [KernelArg; 3] {
    [
        KernelArg::Out(slot.claim),
        KernelArg::Out(slot.record),
        KernelArg::U32(slot.code),
    ]
}

fn u64_arg(v: usize) -> KernelArg {
    KernelArg::U64(v as u64)
}

fn checked_cells(op: &'static str, rows: usize, classes: usize) -> Result<usize> {
    rows.checked_mul(classes)
        .ok_or_else(|| Error::invalid(op, format!("[{rows}, {classes}] is too large")))
}

/// Cross entropy per row of the dense `[rows, classes]` logits: `losses`, `row_max` and
/// `row_log_sum` (each `[rows]`, dense) get `ls − (x_t − m)`, `m` and `ls = ln Σ e^(x − m)`.
/// `classes` must be at least 1 when `rows > 0`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_rows_launch(
    op: &'static str,
    dtype: DType,
    logits: u64,
    labels: Labels,
    (losses, row_max, row_log_sum): (u64, u64, u64),
    rows: usize,
    classes: usize,
    slot: DeferredSlot,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    checked_cells(op, rows, classes)?;
    if classes == 0 && rows > 0 {
        return Err(Error::shape(op, "logits with 0 classes per sample"));
    }
    let (config, warp_per_row) = rows_config(op, rows, classes)?;
    let mut args = vec![
        KernelArg::In(logits),
        KernelArg::In(labels.ptr),
        u64_arg(labels.stride),
        KernelArg::Out(losses),
        KernelArg::Out(row_max),
        KernelArg::Out(row_log_sum),
        u64_arg(rows),
        u64_arg(classes),
        KernelArg::I32(warp_per_row as i32),
    ];
    args.extend(slot_args(slot));
    Ok(Launch {
        source: &LOSS,
        kernel: format!("cross_entropy_rows_{dtype}"),
        config,
        args,
    })
}

/// The dense `[rows, classes]` gradient of cross entropy: `s_r · (softmax(x_r) − onehot(t_r))`,
/// from the dense logits and the per-row `row_max`, `row_log_sum` of the forward.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward_launch(
    op: &'static str,
    dtype: DType,
    logits: u64,
    labels: Labels,
    (row_max, row_log_sum): (u64, u64),
    g: Scales,
    grad: u64,
    (rows, classes): (usize, usize),
    slot: DeferredSlot,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let cells = checked_cells(op, rows, classes)?;
    let mut args = vec![
        KernelArg::In(logits),
        KernelArg::In(labels.ptr),
        u64_arg(labels.stride),
        KernelArg::In(row_max),
        KernelArg::In(row_log_sum),
        KernelArg::In(g.ptr),
        u64_arg(g.stride),
        compute_arg(dtype, g.scale),
        KernelArg::Out(grad),
        u64_arg(rows),
        u64_arg(classes),
    ];
    args.extend(slot_args(slot));
    Ok(Launch {
        source: &LOSS,
        kernel: format!("cross_entropy_backward_{dtype}"),
        config: LaunchConfig::for_elements(op, cells, THREADS_PER_BLOCK)?,
        args,
    })
}

/// `losses[r] = −log_probs[r·s0 + t_r·s1]` (`log_probs` the address of its first element,
/// `strides` = `(s0, s1)` in elements); `losses` dense.
#[allow(clippy::too_many_arguments)]
pub fn nll_forward_launch(
    op: &'static str,
    dtype: DType,
    log_probs: u64,
    strides: (usize, usize),
    labels: Labels,
    losses: u64,
    (rows, classes): (usize, usize),
    slot: DeferredSlot,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let mut args = vec![
        KernelArg::In(log_probs),
        u64_arg(strides.0),
        u64_arg(strides.1),
        KernelArg::In(labels.ptr),
        u64_arg(labels.stride),
        KernelArg::Out(losses),
        u64_arg(rows),
        u64_arg(classes),
    ];
    args.extend(slot_args(slot));
    Ok(Launch {
        source: &LOSS,
        kernel: format!("nll_forward_{dtype}"),
        config: LaunchConfig::for_elements(op, rows, THREADS_PER_BLOCK)?,
        args,
    })
}

/// The dense `[rows, classes]` gradient of nll: `−s_r` at `(r, t_r)`, zero elsewhere.
pub fn nll_backward_launch(
    op: &'static str,
    dtype: DType,
    labels: Labels,
    g: Scales,
    grad: u64,
    (rows, classes): (usize, usize),
    slot: DeferredSlot,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let cells = checked_cells(op, rows, classes)?;
    let mut args = vec![
        KernelArg::In(labels.ptr),
        u64_arg(labels.stride),
        KernelArg::In(g.ptr),
        u64_arg(g.stride),
        compute_arg(dtype, g.scale),
        KernelArg::Out(grad),
        u64_arg(rows),
        u64_arg(classes),
    ];
    args.extend(slot_args(slot));
    Ok(Launch {
        source: &LOSS,
        kernel: format!("nll_backward_{dtype}"),
        config: LaunchConfig::for_elements(op, cells, THREADS_PER_BLOCK)?,
        args,
    })
}

fn same_shape(op: &'static str, a: &Layout, b: &Layout) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            op,
            format!("{:?} vs {:?}", a.shape().as_slice(), b.shape().as_slice()),
        ));
    }
    Ok(())
}

/// `out[i] = (a[i] − b[i])²` for the dense `out` (any layouts of one shape for `a`, `b`).
pub fn mse_forward_launch(
    op: &'static str,
    dtype: DType,
    (a, a_layout): (u64, &Layout),
    (b, b_layout): (u64, &Layout),
    out: u64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    same_shape(op, a_layout, b_layout)?;
    let n = a_layout.numel();
    Ok(Launch {
        source: &LOSS,
        kernel: format!("mse_forward_{dtype}"),
        config: LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::In(a),
            KernelArg::pod(&StridedLayout::new(op, a_layout)?),
            KernelArg::In(b),
            KernelArg::pod(&StridedLayout::new(op, b_layout)?),
            KernelArg::Out(out),
            u64_arg(n),
        ],
    })
}

/// `grad_pred[i] = 2 (a[i] − b[i]) · scale · g[g_layout(i)]` (dense) and, when given,
/// `grad_target = −grad_pred`. `g_layout` has the inputs' shape (strides 0 for a scalar).
#[allow(clippy::too_many_arguments)]
pub fn mse_backward_launch(
    op: &'static str,
    dtype: DType,
    (a, a_layout): (u64, &Layout),
    (b, b_layout): (u64, &Layout),
    (g, g_layout): (u64, &Layout),
    scale: f64,
    grad_pred: u64,
    grad_target: Option<u64>,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    same_shape(op, a_layout, b_layout)?;
    same_shape(op, a_layout, g_layout)?;
    let n = a_layout.numel();
    Ok(Launch {
        source: &LOSS,
        kernel: format!("mse_backward_{dtype}"),
        config: LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::In(a),
            KernelArg::pod(&StridedLayout::new(op, a_layout)?),
            KernelArg::In(b),
            KernelArg::pod(&StridedLayout::new(op, b_layout)?),
            KernelArg::In(g),
            KernelArg::pod(&StridedLayout::new(op, g_layout)?),
            compute_arg(dtype, scale),
            KernelArg::Out(grad_pred),
            KernelArg::Out(grad_target.unwrap_or(0)),
            u64_arg(n),
        ],
    })
}

// ---- the device side of the ops ------------------------------------------------------------

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
