//! CPU kernels of the batch-norm phases (see `phases.rs`): each reads its tensors on the host,
//! runs the passes of `passes.rs` and returns tensors. The per-channel constants (the
//! normalization table, the gradient sums) are f64, as are the formulas that combine them.

mod half;
mod half_nhwc;
mod nhwc;
mod passes;

use tandem_core::{with_float_type, with_half_type, DType, Element, Result, Tensor};

use super::shape::{
    ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, Count, Dims, Epilogue, GradMask, GradSums,
    Normalization, NormalizationArgs, RunningUpdate, Statistics,
};
use crate::cpu::memory;
use tandem_core::MemoryFormat;

/// Whether the phases run on the channels-last passes (`nhwc.rs`): `x` is a dense
/// channels-last 4-D tensor. The other same-shaped operands are then read in that format too,
/// and the outputs are channels-last.
fn channels_last(x: &Tensor) -> bool {
    x.layout().is_channels_last()
}

/// The format the phases read `x` in: channels-last or row-major.
fn format_of(x: &Tensor) -> MemoryFormat {
    if channels_last(x) {
        MemoryFormat::ChannelsLast
    } else {
        MemoryFormat::Contiguous
    }
}

/// `t` dense in `format` (itself when it is), for reading in storage order.
fn dense(op: &'static str, t: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    match format {
        MemoryFormat::Contiguous => memory::contiguous(op, t),
        MemoryFormat::ChannelsLast => memory::dense_in(t, format),
    }
}

/// The input `[N, C, ...]` viewed as `[n, c, l]`.
fn dims(x: &Tensor) -> Dims {
    Dims::of(x.dims())
}

/// How the half passes split `x` (read in `format`) into units.
fn units(x: &Tensor, format: MemoryFormat) -> half::Units {
    let d = dims(x);
    match format {
        MemoryFormat::ChannelsLast => half::Units::Rows { c: d.c },
        MemoryFormat::Contiguous => half::Units::Samples(d),
    }
}

/// A `[len]` f64 tensor on the CPU.
fn f64_tensor(values: Vec<f64>) -> Result<Tensor> {
    let len = values.len();
    Tensor::from_vec(values, &[len], tandem_core::Device::Cpu)
}

/// The values of a float tensor as f64 (any layout).
fn f64_values(op: &'static str, t: &Tensor) -> Result<Vec<f64>> {
    with_float_type!(op, t.dtype(), T => Ok(memory::gather::<T>(op, t)?.into_iter().map(|v| v.to_f64()).collect()))
}

/// Per-channel mean and biased variance of `x` (contiguous or not).
pub(crate) fn statistics(op: &'static str, x: &Tensor) -> Result<Statistics> {
    let d = dims(x);
    let (mean, var) = if x.dtype().is_half() {
        let format = format_of(x);
        let xc = dense(op, x, format)?;
        with_half_type!(op, x.dtype(), H => half::moments::<H>(&xc.read_dense_slice::<H>()?, units(x, format)))?
    } else if channels_last(x) {
        with_float_type!(op, x.dtype(), T => Ok(nhwc::moments::<T>(&x.read_dense_slice::<T>()?, d.c)))?
    } else {
        let xc = memory::contiguous(op, x)?;
        with_float_type!(op, x.dtype(), T => Ok(passes::moments::<T>(&xc.read_slice::<T>()?, d)))?
    };
    Ok(Statistics {
        count: Count::Host(d.n * d.l),
        mean: f64_tensor(mean)?,
        var: f64_tensor(var)?,
    })
}

/// The count as f64: a host count as it is, a count held in a (CPU) tensor read from it.
pub(crate) fn count_value(op: &'static str, count: &Count) -> Result<f64> {
    match count {
        Count::Host(n) => Ok(*n as f64),
        Count::Device(t) => f64_values(op, t)?.first().copied().ok_or_else(|| {
            tandem_core::Error::invalid(op, format!("need one value, got a tensor {:?}", t.dims()))
        }),
    }
}

/// `counter += 1` for a one-element i64 tensor (`num_batches_tracked`).
pub(crate) fn count_batch(counter: &Tensor) -> Result<()> {
    let mut values = counter.write_slice::<i64>()?;
    values[0] = values[0].wrapping_add(1);
    Ok(())
}

/// `[count, count·mean…, count·(var + mean²)…]`.
pub(crate) fn to_sums(op: &'static str, stats: &Statistics) -> Result<Tensor> {
    let (mean, var) = (f64_values(op, &stats.mean)?, f64_values(op, &stats.var)?);
    let n = count_value(op, &stats.count)?;
    let mut sums = Vec::with_capacity(1 + 2 * mean.len());
    sums.push(n);
    sums.extend(mean.iter().map(|m| n * m));
    sums.extend(mean.iter().zip(&var).map(|(m, v)| n * (v + m * m)));
    f64_tensor(sums)
}

/// The inverse of [`to_sums`]: the count (checked by the caller) and the per-channel mean and
/// biased variance (clamped at 0 against rounding).
pub(crate) fn from_sums(op: &'static str, sums: &Tensor) -> Result<(f64, Tensor, Tensor)> {
    let values = f64_values(op, sums)?;
    let c = values.len() / 2;
    let n = values[0];
    let mean: Vec<f64> = values[1..=c].iter().map(|s| s / n).collect();
    let var: Vec<f64> = values[1 + c..]
        .iter()
        .zip(&mean)
        .map(|(s, m)| (s / n - m * m).max(0.0))
        .collect();
    Ok((n, f64_tensor(mean)?, f64_tensor(var)?))
}

/// `running = (1 − momentum)·running + momentum·factor·stat`, in place, computed in f64.
fn update_one(
    op: &'static str,
    running: &Tensor,
    stat: &Tensor,
    momentum: f64,
    factor: f64,
) -> Result<()> {
    let (old, stat) = (f64_values(op, running)?, f64_values(op, stat)?);
    let new: Vec<f64> = old
        .iter()
        .zip(&stat)
        .map(|(o, s)| (1.0 - momentum) * o + momentum * factor * s)
        .collect();
    let update = Tensor::from_vec(new, running.dims(), running.device())?;
    let update = if running.dtype() == DType::F64 {
        update
    } else {
        update.to_dtype(running.dtype())?
    };
    running.copy_(&update)
}

/// The running-statistics update (the unbiased variance for `running_var`).
pub(crate) fn update_running(op: &'static str, args: &RunningUpdate<'_>) -> Result<()> {
    let count = count_value(op, &args.stats.count)?;
    if let Some(r) = args.running_mean {
        update_one(op, r, &args.stats.mean, args.momentum, 1.0)?;
    }
    if let Some(r) = args.running_var {
        update_one(op, r, &args.stats.var, args.momentum, count / (count - 1.0))?;
    }
    Ok(())
}

/// The `[4, C]` table of mean, 1/σ, scale = w/σ and shift = b − mean·scale.
pub(crate) fn normalization(op: &'static str, args: &NormalizationArgs<'_>) -> Result<Tensor> {
    let (mean, var) = (f64_values(op, args.mean)?, f64_values(op, args.var)?);
    let c = mean.len();
    let invstd: Vec<f64> = var.iter().map(|v| 1.0 / (v + args.eps).sqrt()).collect();
    let w = match args.weight {
        Some(w) => f64_values(op, w)?,
        None => vec![1.0; c],
    };
    let b = match args.bias {
        Some(b) => f64_values(op, b)?,
        None => vec![0.0; c],
    };
    let scale: Vec<f64> = (0..c).map(|i| w[i] * invstd[i]).collect();
    let shift: Vec<f64> = (0..c).map(|i| b[i] - mean[i] * scale[i]).collect();
    let mut table = mean;
    table.extend(invstd);
    table.extend(scale);
    table.extend(shift);
    Tensor::from_vec(table, &[4, c], tandem_core::Device::Cpu)
}

/// The rows of a normalization table: `(mean, invstd, scale, shift)`.
fn rows(table: &[f64], c: usize) -> (&[f64], &[f64], &[f64], &[f64]) {
    (
        &table[..c],
        &table[c..2 * c],
        &table[2 * c..3 * c],
        &table[3 * c..4 * c],
    )
}

/// `y = x·scale + shift` and the epilogue, in one pass.
pub(crate) fn apply(op: &'static str, args: &ApplyArgs<'_>) -> Result<Tensor> {
    let x = args.x;
    let d = dims(x);
    let format = format_of(x);
    let xc = dense(op, x, format)?;
    let table = args.norm.table().read_slice::<f64>()?;
    let (_, _, scale, shift) = rows(&table, d.c);
    if x.dtype().is_half() {
        return with_half_type!(op, x.dtype(), H => {
            let xs = xc.read_dense_slice::<H>()?;
            let units = units(x, format);
            let y = with_epilogue::<H, _>(op, args.epilogue, format, |e| {
                half::normalize::<H>(op, &xs, units, scale, shift, e)
            })?;
            Tensor::from_vec_in(y, x.dims(), x.device(), format)
        });
    }
    with_float_type!(op, x.dtype(), T => {
        let xs = xc.read_dense_slice::<T>()?;
        let y = with_epilogue::<T, _>(op, args.epilogue, format, |e| match format {
            MemoryFormat::ChannelsLast => nhwc::normalize::<T>(op, &xs, d.c, scale, shift, e),
            MemoryFormat::Contiguous => passes::normalize::<T>(op, &xs, d, scale, shift, e),
        })?;
        Tensor::from_vec_in(y, x.dims(), x.device(), format)
    })
}

/// `run` with the forward's epilogue in element type `T` (a residual read dense in `format`).
fn with_epilogue<T: Element, R>(
    op: &'static str,
    epilogue: Epilogue<'_>,
    format: MemoryFormat,
    run: impl FnOnce(passes::Epilogue<'_, T>) -> Result<R>,
) -> Result<R> {
    match epilogue {
        Epilogue::AddRelu(r) => {
            let rc = dense(op, r, format)?;
            let rs = rc.read_dense_slice::<T>()?;
            run(passes::Epilogue::AddRelu(&rs))
        }
        Epilogue::Relu => run(passes::Epilogue::Relu),
        Epilogue::Plain => run(passes::Epilogue::Plain),
    }
}

/// Per-channel `[Σg', Σg'·(x − mean)]` of the masked gradient `g'`, and `g'` itself where the
/// mask comes from the saved output.
pub(crate) fn backward_reduce(op: &'static str, args: &BackwardReduceArgs<'_>) -> Result<GradSums> {
    let d = dims(args.x);
    let format = format_of(args.x);
    let (xc, gc) = (dense(op, args.x, format)?, dense(op, args.grad, format)?);
    let table = args.norm.table().read_slice::<f64>()?;
    let (mean, _, scale, shift) = rows(&table, d.c);
    let (sum_g, sum_gc, masked) = if args.grad.dtype().is_half() {
        half_backward_reduce(op, args, &xc, &gc, mean, scale, shift)?
    } else {
        f32_backward_reduce(op, args, &xc, &gc, mean, scale, shift)?
    };
    let mut sums = sum_g;
    sums.extend(sum_gc);
    Ok(GradSums {
        sums: Tensor::from_vec(sums, &[2, d.c], tandem_core::Device::Cpu)?,
        grad: masked,
    })
}

/// The sums (and the masked gradient) of [`backward_reduce`] for an f16/bf16 gradient.
#[allow(clippy::type_complexity)]
fn half_backward_reduce(
    op: &'static str,
    args: &BackwardReduceArgs<'_>,
    xc: &Tensor,
    gc: &Tensor,
    mean: &[f64],
    scale: &[f64],
    shift: &[f64],
) -> Result<(Vec<f64>, Vec<f64>, Option<Tensor>)> {
    let format = format_of(args.x);
    let units = units(args.x, format);
    with_half_type!(op, args.grad.dtype(), H => {
        let (gs, xs) = (gc.read_dense_slice::<H>()?, xc.read_dense_slice::<H>()?);
        match args.mask {
            GradMask::Output(y) => {
                let yc = dense(op, y, format)?;
                let ys = yc.read_dense_slice::<H>()?;
                let (masked, sum_g, sum_gc) = half::masked_grad_sums::<H>(op, &gs, &ys, &xs, units, mean)?;
                Ok((sum_g, sum_gc, Some(Tensor::from_vec_in(masked, args.x.dims(), args.grad.device(), format)?)))
            }
            GradMask::Relu => {
                let mask = passes::affine_coefs::<f32>(scale, shift);
                let (sum_g, sum_gc) = half::grad_sums::<H>(&gs, &xs, units, mean, Some(&mask))?;
                Ok((sum_g, sum_gc, None))
            }
            GradMask::None => {
                let (sum_g, sum_gc) = half::grad_sums::<H>(&gs, &xs, units, mean, None)?;
                Ok((sum_g, sum_gc, None))
            }
        }
    })
}

/// The sums (and the masked gradient) of [`backward_reduce`] for an f32/f64 gradient.
#[allow(clippy::type_complexity)]
fn f32_backward_reduce(
    op: &'static str,
    args: &BackwardReduceArgs<'_>,
    xc: &Tensor,
    gc: &Tensor,
    mean: &[f64],
    scale: &[f64],
    shift: &[f64],
) -> Result<(Vec<f64>, Vec<f64>, Option<Tensor>)> {
    let d = dims(args.x);
    let format = format_of(args.x);
    let cl = format == MemoryFormat::ChannelsLast;
    with_float_type!(op, args.grad.dtype(), T => {
        let (gs, xs) = (gc.read_dense_slice::<T>()?, xc.read_dense_slice::<T>()?);
        let sums = |mask: Option<&[(T, T)]>| if cl {
            nhwc::grad_sums::<T>(&gs, &xs, d.c, mean, mask)
        } else {
            passes::grad_sums::<T>(&gs, &xs, d, mean, mask)
        };
        match args.mask {
            GradMask::Output(y) => {
                let yc = dense(op, y, format)?;
                let ys = yc.read_dense_slice::<T>()?;
                let (masked, sum_g, sum_gc) = if cl {
                    nhwc::masked_grad_sums::<T>(op, &gs, &ys, &xs, d.c, mean)?
                } else {
                    passes::masked_grad_sums::<T>(op, &gs, &ys, &xs, d, mean)?
                };
                Ok((sum_g, sum_gc, Some(Tensor::from_vec_in(masked, args.x.dims(), args.grad.device(), format)?)))
            }
            GradMask::Relu => {
                let mask = passes::affine_coefs::<T>(scale, shift);
                let (sum_g, sum_gc) = sums(Some(&mask));
                Ok((sum_g, sum_gc, None))
            }
            GradMask::None => {
                let (sum_g, sum_gc) = sums(None);
                Ok((sum_g, sum_gc, None))
            }
        }
    })
}

/// The input gradient: in training `(w/σ)·(g − Σg/m − x̂·Σg·x̂/m)` per channel, expanded into
/// `g·a + x·slope + offset`; in evaluation `g·w/σ`.
pub(crate) fn backward_apply(op: &'static str, args: &BackwardApplyArgs<'_>) -> Result<Tensor> {
    let d = dims(args.x);
    let format = format_of(args.x);
    let (xc, gc) = (dense(op, args.x, format)?, dense(op, args.grad, format)?);
    let table = args.norm.table().read_slice::<f64>()?;
    let (mean, invstd, scale, shift) = rows(&table, d.c);
    let sums = memory::gather::<f64>(op, args.sums)?;
    let (sum_g, sum_gc) = sums.split_at(d.c);
    // w/σ per channel: the forward's scale
    let a = scale;
    let (slope, offset): (Vec<f64>, Vec<f64>) = if args.training {
        let m = count_value(op, args.count)?;
        (0..d.c)
            .map(|c| {
                // Σ g·x̂
                let sum_g_xhat = sum_gc[c] * invstd[c];
                let slope = -a[c] * invstd[c] * sum_g_xhat / m;
                (slope, -a[c] * sum_g[c] / m - slope * mean[c])
            })
            .unzip()
    } else {
        (vec![0.0; d.c], vec![0.0; d.c])
    };
    if args.grad.dtype().is_half() {
        let mask = args
            .relu_mask
            .then(|| passes::affine_coefs::<f32>(scale, shift));
        let coefs = half::GradCoefs {
            a,
            b: &slope,
            k: &offset,
        };
        return with_half_type!(op, args.grad.dtype(), H => {
            let (gs, xs) = (gc.read_dense_slice::<H>()?, xc.read_dense_slice::<H>()?);
            let gx = half::grad_input::<H>(op, &gs, &xs, units(args.x, format), &coefs, mask.as_deref())?;
            Tensor::from_vec_in(gx, args.x.dims(), args.grad.device(), format)
        });
    }
    with_float_type!(op, args.grad.dtype(), T => {
        let mask = args.relu_mask.then(|| passes::affine_coefs::<T>(scale, shift));
        let (gs, xs) = (gc.read_dense_slice::<T>()?, xc.read_dense_slice::<T>()?);
        let gx = match format {
            MemoryFormat::ChannelsLast => nhwc::grad_input::<T>(op, &gs, &xs, d.c, a, &slope, &offset, mask.as_deref())?,
            MemoryFormat::Contiguous => passes::grad_input::<T>(op, &gs, &xs, d, a, &slope, &offset, mask.as_deref())?,
        };
        Tensor::from_vec_in(gx, args.x.dims(), args.grad.device(), format)
    })
}

/// The weight and bias gradients `(Σ g·x̂, Σ g)` per channel, in `dtype`.
pub(crate) fn parameter_gradients(
    op: &'static str,
    sums: &Tensor,
    norm: &Normalization,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let c = norm.channels();
    let sums = memory::gather::<f64>(op, sums)?;
    let table = norm.table().read_slice::<f64>()?;
    let (_, invstd, _, _) = rows(&table, c);
    let (sum_g, sum_gc) = sums.split_at(c);
    with_float_type!(op, dtype, T => {
        let weight: Vec<T> = (0..c).map(|i| T::from_f64(sum_gc[i] * invstd[i])).collect();
        let bias: Vec<T> = sum_g.iter().map(|&s| T::from_f64(s)).collect();
        Ok((
            Tensor::from_vec(weight, &[c], tandem_core::Device::Cpu)?,
            Tensor::from_vec(bias, &[c], tandem_core::Device::Cpu)?,
        ))
    })
}
