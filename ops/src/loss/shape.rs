//! The device-neutral types of the losses, shared by the CPU and CUDA kernels.

use tandem_core::Tensor;

/// The sizes of a classification loss and its reduction, as its kernels need them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Classes {
    /// Samples.
    pub n: usize,
    /// Classes.
    pub c: usize,
    /// How the per-sample losses combine.
    pub reduction: Reduction,
}

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

/// What cross entropy's backward reads: the contiguous logits and, per row, the maximum and
/// `ln Σ e^(x − max)` (tensors of `[n]`).
pub(crate) struct CrossEntropySaved {
    /// The contiguous logits.
    pub(crate) logits: Tensor,
    /// Per-row maximum.
    pub(crate) max: Tensor,
    /// Per-row `ln Σ e^(x − max)`.
    pub(crate) log_sum: Tensor,
}
