//! Batch normalization as phases, for callers that put something between them — above all
//! `SyncBatchNorm`, which all-reduces the statistics across processes between [`statistics`]
//! and [`apply`], and the gradient sums between [`backward_reduce`] and [`backward_apply`]:
//!
//! ```text
//! forward:  statistics(x) ──(to_sums → all-reduce → from_sums)──► normalization ──► apply
//!                     └──► update_running
//! backward: backward_reduce(g) ──(all-reduce of the sums)──► backward_apply ──► grad_x
//!                     └──► parameter_gradients ──► grad_weight, grad_bias
//! ```
//!
//! [`batch_norm`](super::batch_norm) and its fused forms are these phases run in a row. The
//! phases are not recorded by autograd: a caller records its own backward, as the fused ops
//! do. Per-channel values (statistics, the normalization table, gradient sums) are f64 tensors
//! on the input's device; every phase checks its arguments and dispatches once on that device.
//! On a CUDA device no phase waits for the device: the count of all-reduced statistics stays
//! in device memory ([`Count::Device`]) and is checked there (see [`Statistics::from_sums`]),
//! so that a SyncBatchNorm forward never blocks the host on the all-reduce. [`count_batch`]
//! advances `num_batches_tracked`.

use tandem_core::{DType, Device, Error, Result, Tensor};

use super::shape::{bad_count, count_ok, Epilogue};
use super::{cpu, cuda};
use crate::checks::{float_dtype, float_or_half, same_dtype_device};

// The phases' types live in `shape.rs` (so that the kernels of both devices can take them
// without importing this module, which dispatches to them); they are part of this module's API.
pub use super::shape::{
    check_count, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, Count, GradMask, GradSums,
    Normalization, NormalizationArgs, RunningUpdate, Statistics,
};

impl Count {
    /// The count when the host knows it.
    pub fn on_host(&self) -> Option<usize> {
        match self {
            Count::Host(n) => Some(*n),
            Count::Device(_) => None,
        }
    }

    /// The count's value, read from the device when it lives there. That read waits for the
    /// device: for tests and diagnostics, never inside a training step.
    pub fn read(&self) -> Result<usize> {
        match self {
            Count::Host(n) => Ok(*n),
            Count::Device(t) => {
                let on_host = Count::Device(t.to_device(Device::Cpu)?);
                Ok(cpu::count_value("Count::read", &on_host)? as usize)
            }
        }
    }

    /// Checks that a device count is a one-element f64 tensor on `device`.
    fn check(&self, op: &'static str, device: Device) -> Result<()> {
        if let Count::Device(t) = self {
            device.same_as(t.device(), op)?;
            if t.dtype() != DType::F64 || t.numel() != 1 {
                return Err(Error::shape(
                    op,
                    format!(
                        "a count on the device is one f64 value, got {} {:?}",
                        t.dtype(),
                        t.dims()
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl Statistics {
    /// The statistics as additive sums, a `[1 + 2C]` f64 tensor
    /// `[count, count·mean…, count·(var + mean²)…]`: the elementwise sum of the sums of
    /// several batches is the sums of their union. All-reduce them across processes, then
    /// [`Statistics::from_sums`] gives the statistics of the global batch. (Each batch's own
    /// moments are exact; the merge's subtraction loses only `ε·mean²/var` relative, in f64.)
    pub fn to_sums(&self) -> Result<Tensor> {
        const OP: &str = "batch_norm_statistics";
        let c = self.mean.numel();
        check_channel_tensor(OP, "mean", &self.mean, c, self.mean.device())?;
        check_channel_tensor(OP, "var", &self.var, c, self.mean.device())?;
        self.count.check(OP, self.mean.device())?;
        match self.mean.device() {
            Device::Cpu => cpu::to_sums(OP, self),
            Device::Cuda(_) => cuda::to_sums(OP, self),
        }
    }

    /// The statistics whose [`Statistics::to_sums`] are `sums` (`[1 + 2C]` f64, as summed
    /// over processes). Errors when the tensor has the wrong shape or dtype, or when its count
    /// is not a whole number above 1 (no variance can be taken of fewer values).
    ///
    /// On the CPU the count is read and checked here, and the result holds it as
    /// [`Count::Host`]. On a GPU the host does not read it — that would wait for the
    /// all-reduce that produced the sums, once per layer and forward — so the result holds it
    /// as [`Count::Device`] (a view of `sums[0]`, read by the kernels that need the count),
    /// and the kernel checks it: a bad count is reported, with the CPU's message, at the host's
    /// next read of the device (`to_vec`, `item`, `synchronize`). A caller that knows the
    /// count is bad without reading it (SyncBatchNorm on one process) says so at once.
    pub fn from_sums(sums: &Tensor) -> Result<Statistics> {
        const OP: &str = "batch_norm_statistics";
        if sums.dtype() != DType::F64 || sums.rank() != 1 || sums.dims()[0] % 2 != 1 {
            return Err(Error::shape(
                OP,
                format!(
                    "statistic sums must be a [1 + 2C] f64 tensor, got {} {:?}",
                    sums.dtype(),
                    sums.dims()
                ),
            ));
        }
        match sums.device() {
            Device::Cpu => {
                let (count, mean, var) = cpu::from_sums(OP, sums)?;
                if !count_ok(count) {
                    return Err(bad_count(OP, count));
                }
                Ok(Statistics {
                    count: Count::Host(count as usize),
                    mean,
                    var,
                })
            }
            Device::Cuda(_) => {
                let (count, mean, var) = cuda::from_sums(OP, sums)?;
                Ok(Statistics {
                    count: Count::Device(count),
                    mean,
                    var,
                })
            }
        }
    }
}

/// Checks that `x` is a float `[N, C, …]` tensor (f16 and bf16 too on the CPU, where the
/// phases have half passes); returns `C`.
fn channels(op: &'static str, x: &Tensor) -> Result<usize> {
    let dtype = float_or_half(op, x)?;
    if dtype.is_half() && x.device() != Device::Cpu {
        return Err(Error::UnsupportedDType {
            op,
            dtype,
            supported: "f32, f64 (f16 and bf16 on the CPU)",
        });
    }
    if x.rank() < 2 {
        return Err(Error::shape(
            op,
            format!("need input [N, C] or [N, C, ...], got {:?}", x.dims()),
        ));
    }
    Ok(x.dims()[1])
}

/// Checks that a per-channel tensor is `[c]`, float, on `device`.
fn check_channel_tensor(
    op: &'static str,
    name: &str,
    t: &Tensor,
    c: usize,
    device: Device,
) -> Result<()> {
    device.same_as(t.device(), op)?;
    float_dtype(op, t)?;
    if t.dims() != [c] {
        return Err(Error::shape(
            op,
            format!("{name} has shape {:?}, need [{c}]", t.dims()),
        ));
    }
    Ok(())
}

/// The per-channel mean and biased variance of `x` (`[N, C]` or `[N, C, …]`, f32 or f64, or
/// on the CPU f16 or bf16; any layout), over every dim but the channel dim.
///
/// # Shapes
/// `x`: `[N, C, …]` → `mean`, `var`: `[C]` f64; `count = N·(product of the trailing dims)`.
pub fn statistics(x: &Tensor) -> Result<Statistics> {
    const OP: &str = "batch_norm_statistics";
    channels(OP, x)?;
    match x.device() {
        Device::Cpu => cpu::statistics(OP, x),
        Device::Cuda(_) => cuda::statistics(OP, x),
    }
}

/// Folds batch statistics into the running ones, in place: the mean as it is, the variance
/// unbiased (`var·count/(count − 1)`), as PyTorch does.
pub fn update_running(args: &RunningUpdate<'_>) -> Result<()> {
    const OP: &str = "batch_norm_update_running";
    let c = args.stats.mean.numel();
    for (name, t) in [
        ("running_mean", args.running_mean),
        ("running_var", args.running_var),
    ] {
        if let Some(t) = t {
            check_channel_tensor(OP, name, t, c, args.stats.mean.device())?;
        }
    }
    args.stats.count.check(OP, args.stats.mean.device())?;
    // A count on the device was checked there (`Statistics::from_sums`).
    if let Some(count) = args.stats.count.on_host().filter(|&n| n < 2) {
        return Err(Error::invalid(
            OP,
            format!("need a count above 1, got {count}"),
        ));
    }
    match args.stats.mean.device() {
        Device::Cpu => cpu::update_running(OP, args),
        Device::Cuda(_) => cuda::update_running(OP, args),
    }
}

/// The constants [`apply`] and the backward phases use, from the statistics, the affine
/// parameters and `eps`.
pub fn normalization(args: &NormalizationArgs<'_>) -> Result<Normalization> {
    const OP: &str = "batch_norm_normalization";
    let c = args.mean.numel();
    let device = args.mean.device();
    check_channel_tensor(OP, "mean", args.mean, c, device)?;
    check_channel_tensor(OP, "var", args.var, c, device)?;
    for (name, t) in [("weight", args.weight), ("bias", args.bias)] {
        if let Some(t) = t {
            check_channel_tensor(OP, name, t, c, device)?;
        }
    }
    if args.eps.is_nan() || args.eps < 0.0 {
        return Err(Error::invalid(
            OP,
            format!("eps must be non-negative, got {}", args.eps),
        ));
    }
    let table = match device {
        Device::Cpu => cpu::normalization(OP, args)?,
        Device::Cuda(_) => cuda::normalization(OP, args)?,
    };
    Ok(Normalization { table })
}

/// Checks that `x` fits `norm` (channels and device); returns nothing else.
fn check_input(op: &'static str, x: &Tensor, norm: &Normalization) -> Result<()> {
    let c = channels(op, x)?;
    x.device().same_as(norm.device(), op)?;
    if c != norm.channels() {
        return Err(Error::shape(
            op,
            format!(
                "input {:?} has {c} channels but the normalization has {}",
                x.dims(),
                norm.channels()
            ),
        ));
    }
    Ok(())
}

/// Checks that `t` has `x`'s shape, dtype and device.
fn check_like(op: &'static str, what: &str, x: &Tensor, t: &Tensor) -> Result<()> {
    same_dtype_device(op, x, t)?;
    if t.dims() != x.dims() {
        return Err(Error::shape(
            op,
            format!(
                "{what} has shape {:?} but input has shape {:?} (they must match)",
                t.dims(),
                x.dims()
            ),
        ));
    }
    Ok(())
}

/// `y = x·scale + shift` per channel, then the epilogue (a ReLU, or a residual add and a
/// ReLU), in one pass. Not recorded by autograd.
///
/// # Shapes
/// `x` (and the residual): `[N, C, …]` → output: the same shape.
pub fn apply(args: &ApplyArgs<'_>) -> Result<Tensor> {
    const OP: &str = "batch_norm_apply";
    check_input(OP, args.x, args.norm)?;
    if let Epilogue::AddRelu(r) = args.epilogue {
        check_like(OP, "residual", args.x, r)?;
    }
    match args.x.device() {
        Device::Cpu => cpu::apply(OP, args),
        Device::Cuda(_) => cuda::apply(OP, args),
    }
}

/// The per-channel reductions of the backward (see [`GradSums`]), with the epilogue's mask
/// applied on the way.
pub fn backward_reduce(args: &BackwardReduceArgs<'_>) -> Result<GradSums> {
    const OP: &str = "batch_norm_backward_reduce";
    check_input(OP, args.x, args.norm)?;
    check_like(OP, "gradient", args.x, args.grad)?;
    if let GradMask::Output(y) = args.mask {
        check_like(OP, "saved output", args.x, y)?;
    }
    match args.x.device() {
        Device::Cpu => cpu::backward_reduce(OP, args),
        Device::Cuda(_) => cuda::backward_reduce(OP, args),
    }
}

/// The gradient of the input: `(w/σ)·(g − Σg/m − x̂·Σg·x̂/m)` per channel in training,
/// `g·w/σ` in evaluation.
pub fn backward_apply(args: &BackwardApplyArgs<'_>) -> Result<Tensor> {
    const OP: &str = "batch_norm_backward_apply";
    check_input(OP, args.x, args.norm)?;
    check_like(OP, "gradient", args.x, args.grad)?;
    check_sums(OP, args.sums, args.norm)?;
    args.count.check(OP, args.x.device())?;
    if args.training && args.count.on_host() == Some(0) {
        return Err(Error::invalid(OP, "training needs a count above 0"));
    }
    match args.x.device() {
        Device::Cpu => cpu::backward_apply(OP, args),
        Device::Cuda(_) => cuda::backward_apply(OP, args),
    }
}

/// Checks that `sums` is a `[2, C]` f64 tensor on the normalization's device.
fn check_sums(op: &'static str, sums: &Tensor, norm: &Normalization) -> Result<()> {
    norm.device().same_as(sums.device(), op)?;
    if sums.dtype() != DType::F64 || sums.dims() != [2, norm.channels()] {
        return Err(Error::shape(
            op,
            format!(
                "gradient sums must be a [2, {}] f64 tensor, got {} {:?}",
                norm.channels(),
                sums.dtype(),
                sums.dims()
            ),
        ));
    }
    Ok(())
}

/// The gradients of the weight and the bias, `(Σ g'·x̂, Σ g')` per channel (`[C]` each, in
/// `dtype`), from the [`GradSums::sums`] of this process.
pub fn parameter_gradients(
    sums: &Tensor,
    norm: &Normalization,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "batch_norm_parameter_gradients";
    check_sums(OP, sums, norm)?;
    match sums.device() {
        Device::Cpu => cpu::parameter_gradients(OP, sums, norm, dtype),
        Device::Cuda(_) => cuda::parameter_gradients(OP, sums, norm, dtype),
    }
}

/// Adds one to `num_batches_tracked` (a one-element i64 tensor), in place on its device: what
/// every training forward of a layer that tracks running statistics does.
pub fn count_batch(num_batches_tracked: &Tensor) -> Result<()> {
    const OP: &str = "batch_norm_count_batch";
    let t = num_batches_tracked;
    if t.dtype() != DType::I64 || t.numel() != 1 {
        return Err(Error::shape(
            OP,
            format!(
                "num_batches_tracked must be one i64 value, got {} {:?}",
                t.dtype(),
                t.dims()
            ),
        ));
    }
    match t.device() {
        Device::Cpu => cpu::count_batch(&t.contiguous_detached()?),
        Device::Cuda(_) => cuda::count_batch(OP, t),
    }
}
