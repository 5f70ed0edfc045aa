//! CUDA kernels of the batch-norm phases (see `phases.rs`): each makes its inputs dense in the
//! input's format where a kernel needs them so (the fused ops pass dense inputs already),
//! allocates its outputs on the device, builds the launches of `launch.rs` and runs them on the
//! device's compute stream.
//!
//! The kernels view the input as `[N, C, L]`, dense. A row-major `[N, C, H, W]` input is
//! `[N, C, H·W]`; a channels-last one is `[N·H·W, C, 1]` (each pixel a row of C values, the
//! channel innermost), so the same kernels reduce each channel over its N·H·W values in the same
//! logical order with the same shifted f64 sums, and the elementwise passes write channels-last
//! outputs in storage order. Nothing is converted between formats. Nothing waits for the device: the count of all-reduced statistic sums stays
//! on the device, where `from_sums`'s kernel checks it (reporting a bad one through the
//! deferred-error record) and the kernels that divide by it read it.

pub mod launch;

use tandem_core::cuda::deferred::{self, DeferredCheck, Finding};
use tandem_core::cuda::launch::Launch;
use tandem_core::cuda::{device_pointer, launch_on_compute, CudaDevice};
use tandem_core::{DType, Layout, MemoryFormat, Result, Shape, Tensor};

use super::shape::{
    bad_count, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, Count, Dims, Epilogue, GradMask,
    GradSums, Normalization, NormalizationArgs, RunningUpdate, Statistics,
};
use crate::device_address::{first_element as address, first_element_address as ptr};
use launch::{ApplyEpilogue, ChannelArg, CountArg, ReduceMask, Split, SumsArg};

/// A count of all-reduced statistic sums that is not a whole number above 1, found by
/// `batch_norm_from_sums` (the finding's value holds the count's f64 bits).
pub(crate) static STATISTICS_COUNT: DeferredCheck =
    DeferredCheck::new("batch_norm_statistics", describe_count);

fn describe_count(finding: &Finding) -> String {
    let count = f64::from_bits(finding.value as u64);
    // The CPU's message, without its `op: ` prefix (the deferred error adds it).
    let message = bad_count("batch_norm_statistics", count).to_string();
    message
        .strip_prefix("batch_norm_statistics: ")
        .map_or(message.clone(), str::to_string)
}

/// The count as the kernels take it: a host value, or the address of the f64 on the device.
fn count_arg(op: &'static str, count: &Count) -> Result<CountArg> {
    Ok(match count {
        Count::Host(n) => CountArg::Host(*n),
        Count::Device(t) => CountArg::Device(ptr(op, t)?),
    })
}

/// A `[C]` tensor (any stride) as a kernel's per-channel vector; absent for `None`.
fn channel(op: &'static str, name: &str, t: Option<&Tensor>) -> Result<ChannelArg> {
    let Some(t) = t else {
        return Ok(ChannelArg::absent());
    };
    let stride = t.layout().strides().first().copied().unwrap_or(0);
    ChannelArg::new(op, name, ptr(op, t)?, stride, t.dtype())
}

/// Row `row` of a `[2, C]` f64 tensor (any strides) as a per-channel vector.
fn sums_row(op: &'static str, sums: &Tensor, row: usize) -> Result<ChannelArg> {
    let strides = sums.layout().strides();
    let at = ptr(op, sums)? + (row * strides[0] * DType::F64.size_in_bytes()) as u64;
    ChannelArg::new(op, "the gradient sums", at, strides[1], DType::F64)
}

/// The two rows of `[2, C]` gradient sums.
fn sums_arg(op: &'static str, sums: &Tensor) -> Result<SumsArg> {
    Ok(SumsArg {
        sum_g: sums_row(op, sums, 0)?,
        sum_centered: sums_row(op, sums, 1)?,
    })
}

/// A fresh f64 tensor on `t`'s device.
fn f64_like(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    Tensor::empty(shape, DType::F64, t.device())
}

/// Scratch for the partial sums of a split reduction and its address (none for one split).
fn partials(
    op: &'static str,
    t: &Tensor,
    dims: Dims,
    split: Split,
) -> Result<(Option<Tensor>, u64)> {
    let len = split.partials_len(dims);
    if len == 0 {
        return Ok((None, 0));
    }
    let p = f64_like(t, &[len])?;
    let at = ptr(op, &p)?;
    Ok((Some(p), at))
}

/// The format the kernels read `x` in: channels-last when `x` is dense channels-last, row-major
/// otherwise (a strided input is copied to row-major).
fn format_of(x: &Tensor) -> MemoryFormat {
    if x.layout().is_channels_last() {
        MemoryFormat::ChannelsLast
    } else {
        MemoryFormat::Contiguous
    }
}

/// `t` dense in `format`: itself (detached) when it already is, else a copy.
fn dense_in(t: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    match format {
        MemoryFormat::Contiguous => t.contiguous_detached(),
        MemoryFormat::ChannelsLast if t.is_contiguous_in(format) => Ok(t.detach()),
        MemoryFormat::ChannelsLast => t.contiguous_in(format),
    }
}

/// The `[N, C, L]` view the kernels take of an input of `shape` dense in `format`: `L = H·W…`
/// for row-major, `[N·H·W, C, 1]` for channels-last.
fn kernel_dims(shape: &[usize], format: MemoryFormat) -> Dims {
    let dims = Dims::of(shape);
    match format {
        MemoryFormat::Contiguous => dims,
        MemoryFormat::ChannelsLast => Dims {
            n: dims.n * dims.l,
            c: dims.c,
            l: 1,
        },
    }
}

/// Runs launches in order on the compute stream; `work` is the number of items they cover
/// (nothing runs for none).
fn run(dev: &CudaDevice, launches: &[Launch], work: usize) -> Result<()> {
    for launch in launches {
        launch_on_compute(dev, launch, work)?;
    }
    Ok(())
}

/// Per-channel mean and biased variance of `x` (any layout; a dense channels-last one is read
/// as it is).
pub(crate) fn statistics(op: &'static str, x: &Tensor) -> Result<Statistics> {
    let format = format_of(x);
    let xc = dense_in(x, format)?;
    let dims = kernel_dims(x.dims(), format);
    let (dev, xa) = address(op, &xc)?;
    let mean = f64_like(x, &[dims.c])?;
    let var = f64_like(x, &[dims.c])?;
    let split = Split::for_dims(dims);
    let (_scratch, scratch_at) = partials(op, x, dims, split)?;
    let launches = launch::statistics_launches(
        op,
        xa,
        x.dtype(),
        dims,
        split,
        scratch_at,
        ptr(op, &mean)?,
        ptr(op, &var)?,
    )?;
    // Every channel gets a value, also for an input without elements (NaN).
    run(&dev, &launches, dims.c)?;
    Ok(Statistics {
        count: Count::Host(dims.per_channel()),
        mean,
        var,
    })
}

/// `[count, count·mean…, count·(var + mean²)…]`.
pub(crate) fn to_sums(op: &'static str, stats: &Statistics) -> Result<Tensor> {
    let c = stats.mean.numel();
    let (dev, _) = device_pointer(op, &stats.mean)?;
    let sums = f64_like(&stats.mean, &[1 + 2 * c])?;
    let launch = launch::to_sums_launch(
        op,
        channel(op, "mean", Some(&stats.mean))?,
        channel(op, "var", Some(&stats.var))?,
        c,
        count_arg(op, &stats.count)?,
        ptr(op, &sums)?,
    )?;
    run(&dev, &[launch], c + 1)?;
    Ok(sums)
}

/// The count (a view of `sums[0]`, left on the device and checked there) and the per-channel
/// mean and biased variance of `[1 + 2C]` f64 sums.
pub(crate) fn from_sums(op: &'static str, sums: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let c = sums.dims()[0] / 2;
    let (dev, _) = device_pointer(op, sums)?;
    let mean = f64_like(sums, &[c])?;
    let var = f64_like(sums, &[c])?;
    let stride = sums.layout().strides()[0];
    let launch = launch::from_sums_launch(
        op,
        ChannelArg::new(op, "the statistic sums", ptr(op, sums)?, stride, DType::F64)?,
        c,
        ptr(op, &mean)?,
        ptr(op, &var)?,
        deferred::slot(&dev, &STATISTICS_COUNT)?,
    )?;
    // Also for no channels: the kernel checks the count.
    run(&dev, &[launch], c + 1)?;
    let count = sums.view_detached(Layout::from_parts(
        Shape::new(),
        Shape::new(),
        sums.layout().offset(),
    ))?;
    Ok((count, mean, var))
}

/// The running-statistics update, in place.
pub(crate) fn update_running(op: &'static str, args: &RunningUpdate<'_>) -> Result<()> {
    let stats = args.stats;
    let c = stats.mean.numel();
    if args.running_mean.is_none() && args.running_var.is_none() {
        return Ok(());
    }
    let (dev, _) = device_pointer(op, &stats.mean)?;
    let launch = launch::update_running_launch(
        op,
        channel(op, "running_mean", args.running_mean)?,
        channel(op, "running_var", args.running_var)?,
        channel(op, "mean", Some(&stats.mean))?,
        channel(op, "var", Some(&stats.var))?,
        c,
        args.momentum,
        count_arg(op, &stats.count)?,
    )?;
    run(&dev, &[launch], c)
}

/// The `[4, C]` table of mean, 1/σ, scale and shift.
pub(crate) fn normalization(op: &'static str, args: &NormalizationArgs<'_>) -> Result<Tensor> {
    let c = args.mean.numel();
    let (dev, _) = device_pointer(op, args.mean)?;
    let table = f64_like(args.mean, &[4, c])?;
    let launch = launch::normalization_launch(
        op,
        channel(op, "mean", Some(args.mean))?,
        channel(op, "var", Some(args.var))?,
        channel(op, "weight", args.weight)?,
        channel(op, "bias", args.bias)?,
        c,
        args.eps,
        ptr(op, &table)?,
    )?;
    run(&dev, &[launch], c)?;
    Ok(table)
}

/// `y = x·scale + shift` and the epilogue, in `x`'s format (channels-last or row-major).
pub(crate) fn apply(op: &'static str, args: &ApplyArgs<'_>) -> Result<Tensor> {
    let format = format_of(args.x);
    let xc = dense_in(args.x, format)?;
    let dims = kernel_dims(xc.dims(), format);
    let (dev, xa) = address(op, &xc)?;
    let out = Tensor::empty_in(xc.dims(), xc.dtype(), xc.device(), format)?;
    let residual = match args.epilogue {
        Epilogue::AddRelu(r) => Some(dense_in(r, format)?),
        _ => None,
    };
    let epilogue = match (&args.epilogue, &residual) {
        (Epilogue::AddRelu(_), Some(r)) => ApplyEpilogue::AddRelu(ptr(op, r)?),
        (Epilogue::Relu, _) => ApplyEpilogue::Relu,
        _ => ApplyEpilogue::Plain,
    };
    let launch = launch::apply_launch(
        op,
        xa,
        epilogue,
        ptr(op, &out)?,
        xc.dtype(),
        dims,
        ptr(op, args.norm.table())?,
    )?;
    run(&dev, &[launch], dims.numel())?;
    Ok(out)
}

/// Per-channel `[Σg', Σg'·(x − mean)]` of the masked gradient, and the masked gradient
/// itself under [`GradMask::Output`].
pub(crate) fn backward_reduce(op: &'static str, args: &BackwardReduceArgs<'_>) -> Result<GradSums> {
    let format = format_of(args.x);
    let xc = dense_in(args.x, format)?;
    let gc = dense_in(args.grad, format)?;
    let dims = kernel_dims(xc.dims(), format);
    let (dev, xa) = address(op, &xc)?;
    let sums = f64_like(&xc, &[2, dims.c])?;
    let (output, masked) = match args.mask {
        GradMask::Output(y) => (
            Some(dense_in(y, format)?),
            Some(Tensor::empty_in(
                xc.dims(),
                xc.dtype(),
                xc.device(),
                format,
            )?),
        ),
        _ => (None, None),
    };
    let mask = match (args.mask, &output, &masked) {
        (GradMask::Output(_), Some(y), Some(m)) => ReduceMask::Output {
            output: ptr(op, y)?,
            masked: ptr(op, m)?,
        },
        (GradMask::Relu, _, _) => ReduceMask::Relu,
        _ => ReduceMask::None,
    };
    let split = Split::for_dims(dims);
    let (_scratch, scratch_at) = partials(op, &xc, dims, split)?;
    let launches = launch::backward_reduce_launches(
        op,
        ptr(op, &gc)?,
        xa,
        mask,
        xc.dtype(),
        dims,
        split,
        ptr(op, args.norm.table())?,
        scratch_at,
        ptr(op, &sums)?,
    )?;
    // Every channel's sums are written, also for an input without elements (zeros).
    run(&dev, &launches, dims.c)?;
    Ok(GradSums { sums, grad: masked })
}

/// The input gradient from the (all-reduced) sums, in `x`'s format.
pub(crate) fn backward_apply(op: &'static str, args: &BackwardApplyArgs<'_>) -> Result<Tensor> {
    let format = format_of(args.x);
    let xc = dense_in(args.x, format)?;
    let gc = dense_in(args.grad, format)?;
    let dims = kernel_dims(xc.dims(), format);
    let (dev, xa) = address(op, &xc)?;
    let out = Tensor::empty_in(xc.dims(), xc.dtype(), xc.device(), format)?;
    let coefficients = Tensor::empty(&[4, dims.c], xc.dtype(), xc.device())?;
    let [coefs, apply] = launch::backward_apply_launches(
        op,
        ptr(op, &gc)?,
        xa,
        ptr(op, &out)?,
        xc.dtype(),
        dims,
        ptr(op, args.norm.table())?,
        sums_arg(op, args.sums)?,
        count_arg(op, args.count)?,
        args.training,
        args.relu_mask,
        ptr(op, &coefficients)?,
    )?;
    launch_on_compute(&dev, &coefs, dims.c)?;
    launch_on_compute(&dev, &apply, dims.numel())?;
    Ok(out)
}

/// The weight and bias gradients `(Σg'·x̂, Σg')` per channel, in `dtype`.
pub(crate) fn parameter_gradients(
    op: &'static str,
    sums: &Tensor,
    norm: &Normalization,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let c = norm.channels();
    let (dev, _) = device_pointer(op, sums)?;
    let grad_weight = Tensor::empty(&[c], dtype, sums.device())?;
    let grad_bias = Tensor::empty(&[c], dtype, sums.device())?;
    let launch = launch::parameter_gradients_launch(
        op,
        sums_arg(op, sums)?,
        ptr(op, norm.table())?,
        c,
        dtype,
        ptr(op, &grad_weight)?,
        ptr(op, &grad_bias)?,
    )?;
    run(&dev, &[launch], c)?;
    Ok((grad_weight, grad_bias))
}

/// `counter += 1` for a one-element i64 tensor.
pub(crate) fn count_batch(op: &'static str, counter: &Tensor) -> Result<()> {
    let (dev, at) = address(op, counter)?;
    run(&dev, &[launch::count_batch_launch(op, at)?], 1)
}
