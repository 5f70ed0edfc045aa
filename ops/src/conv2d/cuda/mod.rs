//! conv2d on CUDA devices: forward, input gradient, weight gradient and bias gradient, on the
//! device's compute stream, with no host synchronisation (except the one-time algorithm
//! search, see `cudnn/`).
//!
//! Two engines compute the convolution itself:
//!
//! - **cuDNN** (`cudnn/`), the default wherever `libcudnn.so.9` loads: the legacy convolution
//!   API (forward, backward-data, backward-filter), with descriptors and an algorithm chosen
//!   once per geometry and cached, workspaces from tandem's allocator, TF32 as
//!   [`allow_tf32_conv`] says.
//! - **im2col + cuBLAS** (`im2col.rs`, kernels in `conv2d.cu`): column matrices and strided
//!   batched GEMMs, col2im for the input gradient. It runs where cuDNN does not load (with a
//!   one-line notice on stderr, once per process), for a geometry cuDNN declines (sizes beyond
//!   its 32-bit limits, no algorithm that honours the TF32 setting), and everywhere when
//!   [`set_cuda_conv_backend`]`(CudaConvBackend::Im2col)` asks for it.
//!
//! The bias is added, and its gradient summed, by conv2d's own kernels on both engines. Inputs
//! are made contiguous first (a strided input is copied once, as any fast implementation would);
//! degenerate sizes (no samples, channels or pixels) never reach either engine.

mod cudnn;
mod im2col;
pub mod launch;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Once};

use tandem_core::cuda::blas::allow_tf32_conv;
use tandem_core::cuda::{launch_on_compute, CudaDevice, DeviceBuffer};
use tandem_core::{DType, Device, Error, MemoryFormat, Result, Tensor};

use super::shape::{Geometry, Needs};
use crate::checks::{float_dtype, same_dtype_device};
use crate::device_address::first_element as address;
use launch::{bias_add_launch, bias_grad_launches, BiasGradSplit};

use cudnn::Engine;
pub use cudnn::{cudnn_cache_stats, CudnnCacheStats};

/// Which engine runs conv2d on CUDA devices (a process-wide setting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaConvBackend {
    /// cuDNN where it loads, im2col + cuBLAS where it does not (the default).
    #[default]
    Cudnn,
    /// Always im2col + cuBLAS (and col2im), even where cuDNN loads: to test the fallback, or
    /// to compare the two.
    Im2col,
}

/// How cuDNN's algorithm is chosen for a geometry it has not seen (a process-wide setting;
/// each choice is made once per geometry, dtype, TF32 setting and search, and cached).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudnnAlgorithmSearch {
    /// Run every applicable algorithm once on the real buffers (`cudnnFind…AlgorithmEx`) and
    /// keep the fastest: PyTorch's `torch.backends.cudnn.benchmark = True`, and the default.
    /// Training repeats each layer's geometry every step, so the one-time cost (a few
    /// milliseconds per layer and pass, and one host synchronisation) is repaid at once, and
    /// the `_v7` heuristics are known to misjudge some layers, the weight gradient of small
    /// CIFAR-style layers above all. The choice can differ between runs (timing noise), so
    /// results are reproducible only to rounding across processes.
    #[default]
    Measured,
    /// Take cuDNN's heuristic ranking (`cudnnGet…Algorithm_v7`): no trial runs and no
    /// synchronisation, the same choice in every run; PyTorch's default
    /// (`benchmark = False`). Suits programs whose shapes change often.
    Heuristic,
}

static BACKEND: AtomicU8 = AtomicU8::new(0);
static SEARCH: AtomicU8 = AtomicU8::new(0);

/// Chooses the engine of conv2d on CUDA devices for the whole process (default
/// [`CudaConvBackend::Cudnn`]). Takes effect at the next call; cached cuDNN plans stay valid.
pub fn set_cuda_conv_backend(backend: CudaConvBackend) {
    BACKEND.store(backend as u8, Ordering::Relaxed);
}

/// The engine chosen by [`set_cuda_conv_backend`].
pub fn cuda_conv_backend() -> CudaConvBackend {
    match BACKEND.load(Ordering::Relaxed) {
        0 => CudaConvBackend::Cudnn,
        _ => CudaConvBackend::Im2col,
    }
}

/// Chooses how cuDNN algorithms are picked for new geometries (default
/// [`CudnnAlgorithmSearch::Measured`]). Plans are cached per search, so switching does not
/// discard what the other search found.
pub fn set_cudnn_algorithm_search(search: CudnnAlgorithmSearch) {
    SEARCH.store(search as u8, Ordering::Relaxed);
}

/// The search chosen by [`set_cudnn_algorithm_search`].
pub fn cudnn_algorithm_search() -> CudnnAlgorithmSearch {
    match SEARCH.load(Ordering::Relaxed) {
        0 => CudnnAlgorithmSearch::Measured,
        _ => CudnnAlgorithmSearch::Heuristic,
    }
}

/// Whether cuDNN can be used on `device`: the library loads, is cuDNN 9, and no handle has
/// failed to be created (checked once per process; a failure prints the notice). Says nothing
/// about [`cuda_conv_backend`].
pub fn cudnn_available(device: Device) -> bool {
    match device {
        Device::Cuda(n) => tandem_core::cuda::device(n).is_ok_and(|dev| cudnn::loads(&dev)),
        Device::Cpu => false,
    }
}

/// Whether conv2d uses cuDNN on `dev` now: the backend setting asks for it and it loads.
fn cudnn_in_use(dev: &CudaDevice) -> bool {
    cuda_conv_backend() == CudaConvBackend::Cudnn && cudnn::loads(dev)
}

/// Prints, once per process, that conv2d runs through im2col + cuBLAS because cuDNN cannot be
/// used (`reason`).
fn notice_cudnn_unavailable(reason: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "tandem: cuDNN cannot be used ({reason}); conv2d on CUDA runs through im2col + cuBLAS"
        )
    });
}

/// Whether the f32 products of this call may use TF32.
fn tf32(dtype: DType) -> bool {
    dtype == DType::F32 && allow_tf32_conv()
}

/// How the tensors of one conv2d call lie in memory for cuDNN: NCHW (contiguous), or NHWC
/// (channels last: an `[N, C, H, W]` tensor with strides `[H·W·C, 1, W·C, C]`, the weight
/// `[O, C, kh, kw]` with strides `[kh·kw·C, 1, kw·C, C]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Format {
    /// Contiguous `[N, C, H, W]`.
    Nchw,
    /// Channels last.
    Nhwc,
}

/// The memory format a conv2d call on input `x` runs in: NHWC when `x` is dense channels-last
/// and not also contiguous (a tensor that is both, with one channel or 1×1 pixels, stays NCHW).
pub(crate) fn format_of(x: &Tensor) -> Format {
    if !x.is_contiguous() && x.is_contiguous_in(MemoryFormat::ChannelsLast) {
        Format::Nhwc
    } else {
        Format::Nchw
    }
}

/// A new tensor of `dims` (`[N, C, H, W]`) whose memory is in `format`.
fn empty_in(format: Format, dims: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    match format {
        Format::Nchw => Tensor::empty(dims, dtype, device),
        Format::Nhwc => {
            let buf = Tensor::empty(&[dims[0], dims[2], dims[3], dims[1]], dtype, device)?;
            buf.view_detached(buf.layout().permute("conv2d", &[0, 3, 1, 2])?)
        }
    }
}

/// `t`'s values, dense in `format` (`t` itself when it already is; a copy otherwise).
fn dense_in(t: &Tensor, format: Format) -> Result<Tensor> {
    match format {
        Format::Nchw => t.contiguous_detached(),
        Format::Nhwc if t.is_contiguous_in(MemoryFormat::ChannelsLast) => Ok(t.detach()),
        Format::Nhwc => {
            let out = empty_in(format, t.dims(), t.dtype(), t.device())?;
            out.copy_(&t.detach())?;
            Ok(out)
        }
    }
}

/// Whether `dtype` is a 16-bit float: im2col runs it in f32 on converted copies.
fn is_low(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// `t` as a contiguous NCHW tensor of the im2col engine's dtype (f32 for f16 and bf16).
fn im2col_operand(t: &Tensor) -> Result<Tensor> {
    if is_low(t.dtype()) {
        t.to_dtype(DType::F32)?.contiguous_detached()
    } else {
        t.contiguous_detached()
    }
}

/// Runs one im2col pass into `out`: directly when `out` is contiguous in a dtype im2col has,
/// otherwise into a contiguous temporary of the im2col dtype (f32 for f16/bf16: products and
/// sums in f32, one rounding at the end, as cuDNN's f32 compute type does), then copied (and
/// rounded) into `out`, whatever its layout.
fn im2col_into(out: &Tensor, run: impl FnOnce(DType, u64) -> Result<()>) -> Result<()> {
    const OP: &str = "conv2d (im2col)";
    if !is_low(out.dtype()) && out.is_contiguous() {
        let (_, oa) = address(OP, out)?;
        return run(out.dtype(), oa);
    }
    let dtype = if is_low(out.dtype()) {
        DType::F32
    } else {
        out.dtype()
    };
    let temp = Tensor::empty(out.dims(), dtype, out.device())?;
    let (_, ta) = address(OP, &temp)?;
    run(dtype, ta)?;
    out.copy_(&temp.to_dtype(out.dtype())?)
}

/// The forward of conv2d on CUDA tensors: `[N, O, OH, OW]`, channels last when `x` is (see
/// [`format_of`]).
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let dtype = x.dtype();
    let format = format_of(x);
    let out = empty_in(format, &g.out_shape(), dtype, x.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let (dev, y) = address(OP, &out)?;
    if x.numel() == 0 || g.patch() == 0 {
        // Every output sums over no input element.
        out.fill_(0.0)?;
    } else {
        let (x, weight) = (dense_in(x, format)?, dense_in(weight, format)?);
        let (_, xa) = address(OP, &x)?;
        let (_, wa) = address(OP, &weight)?;
        let engine = if cudnn_in_use(&dev) {
            cudnn::forward(&dev, g, dtype, format, xa, wa, y)?
        } else {
            Engine::Im2col
        };
        if engine == Engine::Im2col {
            let (x, weight) = (im2col_operand(&x)?, im2col_operand(&weight)?);
            let (_, xa) = address(OP, &x)?;
            let (_, wa) = address(OP, &weight)?;
            im2col_into(&out, |dt, ya| im2col::forward(&dev, g, dt, xa, wa, ya))?;
        }
    }
    if let Some(b) = bias {
        let b = b.contiguous_detached()?;
        let (_, ba) = address(OP, &b)?;
        let [samples, channels, pixels] = bias_dims(g, format);
        let launch = bias_add_launch(dtype, y, ba, samples, channels, pixels)?;
        launch_on_compute(&dev, &launch, out.numel())?;
    }
    Ok(out)
}

/// The output as the bias kernels see it, `[samples, channels, pixels]`: NHWC is NCHW with
/// `N·OH·OW` samples of one pixel.
fn bias_dims(g: &Geometry, format: Format) -> [usize; 3] {
    match format {
        Format::Nchw => [g.batch, g.out_channels, g.out_pixels()],
        Format::Nhwc => [g.batch * g.out_pixels(), g.out_channels, 1],
    }
}

/// The backward of conv2d on CUDA tensors: the gradients `needs` asks for, shaped like the
/// input, the weight and the bias (`[O]`). In NHWC (when `x` is channels last) the input
/// gradient is channels last too, and the weight gradient takes the weight's layout.
pub(crate) fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<[Option<Tensor>; 3]> {
    const OP: &str = "conv2d_backward";
    same_dtype_device(OP, x, grad)?;
    // The forward checked x; cuDNN's descriptors and the kernels exist for these dtypes only.
    if !is_low(grad.dtype()) {
        float_dtype(OP, grad)?;
    }
    if grad.dims() != g.out_shape() {
        return Err(Error::shape(
            OP,
            format!(
                "output gradient {:?} does not match the output {:?}",
                grad.dims(),
                g.out_shape()
            ),
        ));
    }
    let format = format_of(x);
    let gy = dense_in(grad, format)?;
    let input = match needs.input {
        false => None,
        true => Some(input_grad(x, weight, &gy, g, format)?),
    };
    let weight_grad = match needs.weight {
        false => None,
        true => Some(weight_grad(x, weight, &gy, g, format)?),
    };
    let bias = match needs.bias {
        false => None,
        true => {
            let (dev, gya) = address(OP, &gy)?;
            Some(bias_grad(&dev, g, format, &gy, gya)?)
        }
    };
    Ok([input, weight_grad, bias])
}

/// The input gradient from the weights and `gy` (dense in `format`), in `format`.
fn input_grad(
    x: &Tensor,
    weight: &Tensor,
    gy: &Tensor,
    g: &Geometry,
    format: Format,
) -> Result<Tensor> {
    const OP: &str = "conv2d_backward";
    let dtype = gy.dtype();
    let dx = empty_in(format, x.dims(), dtype, x.device())?;
    if dx.numel() == 0 {
        return Ok(dx);
    }
    if gy.numel() == 0 || weight.numel() == 0 {
        dx.fill_(0.0)?;
        return Ok(dx);
    }
    let (dev, dxa) = address(OP, &dx)?;
    let (_, gya) = address(OP, gy)?;
    let w = dense_in(weight, format)?;
    let (_, wa) = address(OP, &w)?;
    let engine = if cudnn_in_use(&dev) {
        cudnn::input_grad(&dev, g, dtype, format, wa, gya, dxa)?
    } else {
        Engine::Im2col
    };
    if engine == Engine::Im2col {
        let (w, gy) = (im2col_operand(&w)?, im2col_operand(gy)?);
        let (_, wa) = address(OP, &w)?;
        let (_, gya) = address(OP, &gy)?;
        im2col_into(&dx, |dt, dxa| im2col::input_grad(&dev, g, dt, wa, gya, dxa))?;
    }
    Ok(dx)
}

/// The weight gradient from `x` and `gy` (dense in `format`), in the weight's layout (NHWC
/// only when the weight is channels last itself).
fn weight_grad(
    x: &Tensor,
    weight: &Tensor,
    gy: &Tensor,
    g: &Geometry,
    format: Format,
) -> Result<Tensor> {
    const OP: &str = "conv2d_backward";
    let dtype = gy.dtype();
    let dw = empty_in(format, weight.dims(), dtype, weight.device())?;
    if dw.numel() == 0 {
        return Ok(dw);
    }
    if gy.numel() == 0 || x.numel() == 0 {
        dw.fill_(0.0)?;
    } else {
        let (dev, dwa) = address(OP, &dw)?;
        let (_, gya) = address(OP, gy)?;
        let xc = dense_in(x, format)?;
        let (_, xa) = address(OP, &xc)?;
        let engine = if cudnn_in_use(&dev) {
            cudnn::weight_grad(&dev, g, dtype, format, xa, gya, dwa)?
        } else {
            Engine::Im2col
        };
        if engine == Engine::Im2col {
            let (xc, gy) = (im2col_operand(&xc)?, im2col_operand(gy)?);
            let (_, xa) = address(OP, &xc)?;
            im2col_into(&dw, |dt, dwa| {
                im2col::weight_grad(&dev, g, dt, xa, &gy, dwa)
            })?;
        }
    }
    if format == Format::Nhwc && !weight.is_contiguous_in(MemoryFormat::ChannelsLast) {
        return dw.contiguous_detached();
    }
    Ok(dw)
}

/// `Σ_{n,p} gy[n, o, p]` for every output channel `o`, by conv2d's two-pass reduction (f32
/// partial sums for f16 and bf16).
fn bias_grad(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    format: Format,
    gy: &Tensor,
    gya: u64,
) -> Result<Tensor> {
    const OP: &str = "conv2d_backward";
    let dtype = gy.dtype();
    let db = Tensor::empty(&[g.out_channels], dtype, gy.device())?;
    if g.out_channels == 0 {
        return Ok(db);
    }
    let (_, dba) = address(OP, &db)?;
    let dims = bias_dims(g, format);
    let split = BiasGradSplit::new(dims[0], dims[2]);
    let partials = DeviceBuffer::alloc(
        OP,
        dev,
        split.partials_bytes(g.out_channels, dtype),
        dev.compute_stream(),
    )?;
    let launches = bias_grad_launches(dtype, gya, dba, partials.ptr(), dims, split)?;
    for launch in &launches {
        // Never empty: every channel's sum is written, zero when there is nothing to sum.
        dev.launch(launch, dev.compute_stream())?;
    }
    Ok(db)
}
