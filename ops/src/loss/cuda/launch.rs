//! Launch plans of the losses (`loss.cu`): pure functions from device addresses and sizes to
//! [`Launch`]es, run on a device by the ops and on the CPU by the host harness, and the
//! deferred checks through which the kernels report a bad class label.

use tandem_core::cuda::deferred::{DeferredCheck, DeferredSlot, Finding};
use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use tandem_core::{DType, Error, Layout, Result};

use crate::reduce::cuda::launch::{check_dtype, compute_arg, rows_config, THREADS_PER_BLOCK};

/// `loss.cu`, embedded.
pub static LOSS: KernelSource = KernelSource {
    name: "loss",
    source: include_str!("../loss.cu"),
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
