//! The device-neutral types of batch norm: the input's [`Dims`], the per-channel values the
//! phases pass between them ([`Statistics`], [`Normalization`], [`GradSums`]), the phases'
//! argument structs and what is fused onto the output ([`Epilogue`]). The CPU kernels
//! (`cpu/`), the CUDA side (`cuda/`) and the phases that dispatch to them (`phases.rs`) all
//! import from here, and this module imports from none of them.

use tandem_core::{Device, Error, Result, Tensor};

/// How many values each channel's statistics cover (`N·H·W…`, summed over processes for
/// all-reduced statistics).
#[derive(Clone, Debug)]
pub enum Count {
    /// A number the host knows: one process's batch, or sums read on the CPU.
    Host(usize),
    /// A one-element f64 tensor on the statistics' device that the host has not read: the
    /// first element of statistic sums all-reduced on a GPU ([`Statistics::from_sums`]). The
    /// kernels that need the count read it from there; it was checked on the device.
    Device(Tensor),
}

impl From<usize> for Count {
    fn from(n: usize) -> Self {
        Count::Host(n)
    }
}

/// Per-channel statistics of a batch: what batch norm normalises with.
#[derive(Clone, Debug)]
pub struct Statistics {
    /// How many values each channel's statistics cover (`N·H·W…`).
    pub count: Count,
    /// The mean of each channel, `[C]` f64.
    pub mean: Tensor,
    /// The biased variance of each channel, `[C]` f64.
    pub var: Tensor,
}

/// Whether statistics can be taken of `count` values: a whole number above 1, exact in f64
/// (counts are exact up to 2⁵³, far beyond any batch). The CUDA kernel's `bn_count_ok` is the
/// same test.
pub(crate) fn count_ok(count: f64) -> bool {
    count.is_finite() && count.fract() == 0.0 && count < 2f64.powi(53) && count >= 2.0
}

/// Errors, as [`Statistics::from_sums`] does, when statistics cannot be taken of `count`
/// values: for a caller that knows the count on the host (SyncBatchNorm on one process).
pub fn check_count(count: f64) -> Result<()> {
    if count_ok(count) {
        Ok(())
    } else {
        Err(bad_count("batch_norm_statistics", count))
    }
}

/// The error for statistics of `count` values (also how the GPU's deferred check words it).
pub(crate) fn bad_count(op: &'static str, count: f64) -> Error {
    Error::invalid(
        op,
        format!("batch statistics need more than one value per channel, got a count of {count}"),
    )
}

/// Arguments of [`update_running`](super::phases::update_running).
#[derive(Clone, Copy, Debug)]
pub struct RunningUpdate<'a> {
    /// The running mean to update in place, if tracked.
    pub running_mean: Option<&'a Tensor>,
    /// The running (unbiased) variance to update in place, if tracked.
    pub running_var: Option<&'a Tensor>,
    /// The batch statistics to fold in (a count above 1).
    pub stats: &'a Statistics,
    /// Weight of the batch: `running = (1 − momentum)·running + momentum·batch`.
    pub momentum: f64,
}

/// Arguments of [`normalization`](super::phases::normalization).
#[derive(Clone, Copy, Debug)]
pub struct NormalizationArgs<'a> {
    /// Per-channel mean `[C]` (batch or running statistics; any float dtype).
    pub mean: &'a Tensor,
    /// Per-channel biased variance `[C]`.
    pub var: &'a Tensor,
    /// Per-channel scale `[C]`; ones when absent.
    pub weight: Option<&'a Tensor>,
    /// Per-channel shift `[C]`; zeros when absent.
    pub bias: Option<&'a Tensor>,
    /// Added to the variance before the square root (≥ 0).
    pub eps: f64,
}

/// The per-channel constants of a normalization: the mean, `1/σ = 1/sqrt(var + eps)`, and the
/// affine map `y = x·scale + shift` that [`apply`](super::phases::apply) computes (`scale = w/σ`,
/// `shift = b − mean·scale`), as one `[4, C]` f64 tensor.
#[derive(Clone, Debug)]
pub struct Normalization {
    pub(crate) table: Tensor,
}

impl Normalization {
    /// The `[4, C]` f64 table: rows mean, 1/σ, scale, shift.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// Number of channels.
    pub fn channels(&self) -> usize {
        self.table.dims()[1]
    }

    /// The device the constants live on.
    pub fn device(&self) -> Device {
        self.table.device()
    }
}

/// Arguments of [`apply`](super::phases::apply).
#[derive(Clone, Copy, Debug)]
pub struct ApplyArgs<'a> {
    /// The input `[N, C, …]`.
    pub x: &'a Tensor,
    /// The constants to normalise with.
    pub norm: &'a Normalization,
    /// What is fused onto the output.
    pub epilogue: Epilogue<'a>,
}

/// How the forward's epilogue masks the output gradient, for the backward phases.
#[derive(Clone, Copy, Debug)]
pub enum GradMask<'a> {
    /// No epilogue: the gradient passes as it is.
    None,
    /// A ReLU on the normalised value: the gradient counts where `x·scale + shift > 0`, which
    /// is recomputed from the input with the forward's own constants.
    Relu,
    /// A residual add and a ReLU: the gradient counts where this saved output is positive.
    Output(&'a Tensor),
}

/// Arguments of [`backward_reduce`](super::phases::backward_reduce).
#[derive(Clone, Copy, Debug)]
pub struct BackwardReduceArgs<'a> {
    /// The gradient of the output.
    pub grad: &'a Tensor,
    /// The forward's input.
    pub x: &'a Tensor,
    /// The forward's constants.
    pub norm: &'a Normalization,
    /// The epilogue's mask.
    pub mask: GradMask<'a>,
}

/// What [`backward_reduce`](super::phases::backward_reduce) returns.
#[derive(Clone, Debug)]
pub struct GradSums {
    /// `[2, C]` f64: per channel `Σ g'` and `Σ g'·(x − mean)` of the masked gradient `g'`.
    /// Additive over batches normalised with the same mean: all-reduce it across processes
    /// for the gradient of a global batch.
    pub sums: Tensor,
    /// The masked gradient itself under [`GradMask::Output`] (it is the residual's gradient
    /// and the gradient [`backward_apply`](super::phases::backward_apply) takes), None otherwise.
    pub grad: Option<Tensor>,
}

/// Arguments of [`backward_apply`](super::phases::backward_apply).
#[derive(Clone, Copy, Debug)]
pub struct BackwardApplyArgs<'a> {
    /// The gradient batch norm itself sees: [`GradSums::grad`] where the reduce returned one,
    /// else the output gradient.
    pub grad: &'a Tensor,
    /// The forward's input.
    pub x: &'a Tensor,
    /// The forward's constants.
    pub norm: &'a Normalization,
    /// [`GradSums::sums`] (all-reduced where the statistics were).
    pub sums: &'a Tensor,
    /// How many values the statistics covered (the global batch's count where they were
    /// all-reduced: [`Statistics::count`] of [`Statistics::from_sums`]).
    pub count: &'a Count,
    /// Whether the forward normalised with batch statistics (whose dependence on `x` the
    /// gradient then includes) or with running ones.
    pub training: bool,
    /// Whether to mask `grad` by the recomputed ReLU mask ([`GradMask::Relu`]).
    pub relu_mask: bool,
}

/// What is fused onto batch norm's output (see [`batch_norm_fused`](super::batch_norm_fused)).
#[derive(Clone, Copy, Debug)]
pub enum Epilogue<'a> {
    /// Nothing: [`batch_norm`](super::batch_norm).
    Plain,
    /// A ReLU: [`batch_norm_relu`](super::batch_norm_relu).
    Relu,
    /// A residual add and then a ReLU: [`batch_norm_add_relu`](super::batch_norm_add_relu).
    AddRelu(&'a Tensor),
}

impl Epilogue<'_> {
    /// The op's name (in errors, the graph and the profiler).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Epilogue::Plain => "batch_norm",
            Epilogue::Relu => "batch_norm_relu",
            Epilogue::AddRelu(_) => "batch_norm_add_relu",
        }
    }
}

/// The input of a batch-norm kernel viewed as `[n, c, l]` (`l` = the product of the dims after
/// the channel dim, 1 for `[N, C]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Samples.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Elements of one channel of one sample.
    pub l: usize,
}

impl Dims {
    /// The dims of an `[N, C, …]` shape (rank ≥ 2, checked by the caller).
    pub fn of(shape: &[usize]) -> Dims {
        Dims {
            n: shape[0],
            c: shape[1],
            l: shape[2..].iter().product(),
        }
    }

    /// Elements of one channel over the batch (`n·l`).
    pub fn per_channel(&self) -> usize {
        self.n * self.l
    }

    /// Elements in all (`n·c·l`).
    pub fn numel(&self) -> usize {
        self.n * self.c * self.l
    }
}
