//! conv2d with f16/bf16 tensors on the CPU. bf16 runs on AMX tiles where the CPU has them
//! (`amx.rs`): the forward and both gradients. Everything else — f16, bf16 on other CPUs, the
//! bias gradient — converts the inputs to f32, runs the f32 kernels, and rounds each result once to the low dtype: exactly
//! "low-precision inputs, f32 accumulation" either way.

use tandem_core::half::bf16;
use tandem_core::{DType, MemoryFormat, Result, Tensor};

use crate::conv2d::shape::{Geometry, Needs};
use crate::cpu::memory;

const OP: &str = "conv2d";

fn wide(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F32)
}

/// The AMX proof where `x` is bf16 and the CPU has AMX-BF16.
#[cfg(target_arch = "x86_64")]
fn amx_for(x: &Tensor) -> Option<crate::cpu::amx::Amx> {
    (x.dtype() == DType::BF16)
        .then(crate::cpu::amx::detect)
        .flatten()
}

/// The format conv2d's output takes: channels-last when the input or the weight is (as
/// PyTorch picks it), else row-major.
fn output_format(x: &Tensor, weight: &Tensor) -> MemoryFormat {
    if x.memory_format() == MemoryFormat::ChannelsLast
        || weight.memory_format() == MemoryFormat::ChannelsLast
    {
        MemoryFormat::ChannelsLast
    } else {
        MemoryFormat::Contiguous
    }
}

/// `t` dense in the format it is closest to (itself when dense already).
fn dense(t: &Tensor) -> Result<Tensor> {
    let format = t.dense_format().unwrap_or(t.memory_format());
    memory::dense_in(t, format)
}

/// The forward of conv2d on f16/bf16 CPU tensors (the caller checked that x, weight and bias
/// share the dtype): `[N, O, OH, OW]` in that dtype.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    #[cfg(target_arch = "x86_64")]
    if let Some(amx) = amx_for(x) {
        return amx_forward(amx, x, weight, bias, g);
    }
    let bias = bias.map(wide).transpose()?;
    super::conv2d(&wide(x)?, &wide(weight)?, bias.as_ref(), g)?.to_dtype(x.dtype())
}

/// Where weight `(o, c, a, b)` of the dense weight `w` (row-major or channels-last, as
/// [`dense`] leaves it) lies in its storage.
#[cfg(target_arch = "x86_64")]
fn weight_index(w: &Tensor, g: &Geometry) -> impl Fn(usize, usize, usize, usize) -> usize {
    let (c, (kh, kw)) = (g.in_channels, g.kernel);
    let channels_last = w.dense_format() == Some(MemoryFormat::ChannelsLast);
    move |o, ci, a, b| {
        if channels_last {
            ((o * kh + a) * kw + b) * c + ci
        } else {
            ((o * c + ci) * kh + a) * kw + b
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn amx_forward(
    amx: crate::cpu::amx::Amx,
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    use super::amx::{forward, Dense};
    let format = output_format(x, weight);
    let xd = dense(x)?;
    let xs = xd.read_dense_slice::<bf16>()?;
    let wd = dense(weight)?;
    let ws = wd.read_dense_slice::<bf16>()?;
    let b: Option<Vec<f32>> = bias
        .map(|b| memory::gather::<f32>(OP, &wide(b)?))
        .transpose()?;
    let c = g.in_channels;
    let at = weight_index(&wd, g);
    let w = |o: usize, ci: usize, a: usize, bb: usize| ws[at(o, ci, a, bb)];
    let src = Dense {
        values: &xs,
        format: xd.dense_format().unwrap_or(MemoryFormat::Contiguous),
        dims: [g.batch, c, g.in_h, g.in_w],
    };
    let out = forward(amx, src, g, &w, b.as_deref(), format)?;
    Tensor::from_vec_in(out, &g.out_shape(), x.device(), format)
}

/// The backward of conv2d on f16/bf16 CPU tensors: the gradients `needs` asks for, in the dtype
/// of `x` (the forward checked that the weight shares it; the output gradient is read in f32
/// whatever float dtype it arrives in).
pub(crate) fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<[Option<Tensor>; 3]> {
    let low = x.dtype();
    #[allow(unused_mut)]
    let (mut input, mut weight_grad, mut rest) = (None, None, needs);
    #[cfg(target_arch = "x86_64")]
    if let (Some(amx), DType::BF16) = (amx_for(x), grad.dtype()) {
        (input, weight_grad) = amx_backward(amx, x, weight, grad, g, needs)?;
        rest.input &= input.is_none();
        rest.weight &= weight_grad.is_none();
    }
    if !(rest.input || rest.weight || rest.bias) {
        return Ok([input, weight_grad, None]);
    }
    let grads = super::conv2d_backward(&wide(x)?, &wide(weight)?, &wide(grad)?, g, rest)?;
    let round = |t: Option<Tensor>| t.map(|t| t.to_dtype(low)).transpose();
    let [i, w, b] = grads;
    Ok([
        input.map_or_else(|| round(i), |t| Ok(Some(t)))?,
        weight_grad.map_or_else(|| round(w), |t| Ok(Some(t)))?,
        round(b)?,
    ])
}

/// The gradients AMX computes for a bf16 layer: the input's and the weight's, where `needs`
/// asks for them.
#[cfg(target_arch = "x86_64")]
fn amx_backward(
    amx: crate::cpu::amx::Amx,
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    use super::amx::{forward, input_grad_scatter, weight_grad, Dense};
    let gd = dense(grad)?;
    let gs = gd.read_dense_slice::<bf16>()?;
    let dy = Dense {
        values: &gs,
        format: gd.dense_format().unwrap_or(MemoryFormat::Contiguous),
        dims: [g.batch, g.out_channels, g.out_h, g.out_w],
    };
    let format_of = |t: &Tensor| t.dense_format().unwrap_or(MemoryFormat::Contiguous);
    let mut input = None;
    if needs.input {
        let format = format_of(x);
        let dx = if let Some(tg) = g.input_gradient_as_forward() {
            let wd = dense(weight)?;
            let ws = wd.read_dense_slice::<bf16>()?;
            let (kh, kw) = g.kernel;
            let at = weight_index(&wd, g);
            // The transposed layer's weight (o', c') = (c, o), flipped in both taps.
            let w = |ci: usize, o: usize, a: usize, b: usize| ws[at(o, ci, kh - 1 - a, kw - 1 - b)];
            forward(amx, dy, &tg, &w, None, format)?
        } else {
            let wc = memory::contiguous(OP, weight)?;
            let ws = wc.read_slice::<bf16>()?;
            input_grad_scatter(amx, dy, g, &ws, format)?
        };
        input = Some(Tensor::from_vec_in(dx, x.dims(), x.device(), format)?);
    }
    let mut weight_grad_t = None;
    if needs.weight {
        let xd = dense(x)?;
        let xs = xd.read_dense_slice::<bf16>()?;
        let src = Dense {
            values: &xs,
            format: xd.dense_format().unwrap_or(MemoryFormat::Contiguous),
            dims: [g.batch, g.in_channels, g.in_h, g.in_w],
        };
        let dw = weight_grad(amx, src, dy, g)?;
        let t = Tensor::from_vec(dw, weight.dims(), x.device())?.to_dtype(DType::BF16)?;
        let format = format_of(weight);
        weight_grad_t = Some(if format == MemoryFormat::Contiguous {
            t
        } else {
            t.contiguous_in(format)?
        });
    }
    Ok((input, weight_grad_t))
}
