//! The pools on a CUDA device: the launches of `pool.cu` (built in `launch.rs`) on the device's
//! compute stream, into fresh tensors from the stream-ordered allocator. Strided inputs and
//! output gradients are made dense first (pooling reads every element of a plane, so a copy is
//! what a fast implementation does anyway, as PyTorch's `.contiguous()` does). The max pool's
//! saved maxima are u32 plane indices in a device buffer that lives in the backward closure.

pub mod launch;

use tandem_core::cuda::{device_view, launch_on_compute, DeviceBuffer};
use tandem_core::{Error, Result, Tensor};

use super::shape::PoolWindows;
use launch::{
    avg_pool2d_backward_launch, avg_pool2d_launch, max_pool2d_backward_launch, max_pool2d_launch,
    PoolGeometry,
};

/// Where each window's maximum came from (its index within the plane, as u32), in device
/// memory, kept by the forward of a max pool for its backward.
pub(crate) struct MaxIndices {
    buffer: DeviceBuffer,
}

/// The pool's geometry for an input `x` of dims `[.., H, W]` and an output of `shape`.
fn geometry(
    op: &'static str,
    x: &Tensor,
    shape: &[usize],
    windows: PoolWindows,
    divisor: Option<usize>,
) -> Result<PoolGeometry> {
    let (r, dims) = (x.rank(), x.dims());
    if shape.len() != r || r < 2 {
        return Err(Error::shape(
            op,
            format!("input {dims:?} and output {shape:?} of a 2-D pool differ in rank"),
        ));
    }
    let planes = dims[..r - 2].iter().product();
    let output = (shape[r - 2], shape[r - 1]);
    PoolGeometry::new(
        op,
        planes,
        (dims[r - 2], dims[r - 1]),
        output,
        windows,
        divisor,
    )
}

/// Max pooling of `x` into a tensor of `shape`, with the maxima's indices when `keep_indices`.
pub(crate) fn max_pool(
    op: &'static str,
    x: &Tensor,
    windows: PoolWindows,
    keep_indices: bool,
    shape: &[usize],
) -> Result<(Tensor, Option<MaxIndices>)> {
    let geometry = geometry(op, x, shape, windows, None)?;
    let x = x.contiguous_detached()?;
    let out = Tensor::empty(shape, x.dtype(), x.device())?;
    let (dev, x_view) = device_view(op, &x)?;
    let (_, out_view) = device_view(op, &out)?;
    let n = out.numel();
    let indices = if keep_indices {
        let bytes = n.checked_mul(4).ok_or_else(|| Error::OutOfMemory {
            op,
            device: x.device(),
            bytes: usize::MAX,
        })?;
        Some(DeviceBuffer::alloc(op, &dev, bytes, dev.compute_stream())?)
    } else {
        None
    };
    let launch = max_pool2d_launch(
        op,
        x_view,
        out_view,
        indices.as_ref().map_or(0, DeviceBuffer::ptr),
        &geometry,
    )?;
    launch_on_compute(&dev, &launch, n)?;
    Ok((out, indices.map(|buffer| MaxIndices { buffer })))
}

/// The backward of [`max_pool`]: each output gradient routed to where its window's maximum
/// came from, as a tensor of `in_shape`.
pub(crate) fn max_pool_backward(
    op: &'static str,
    g: &Tensor,
    indices: &MaxIndices,
    windows: PoolWindows,
    in_shape: &[usize],
) -> Result<Tensor> {
    let gx = Tensor::empty(in_shape, g.dtype(), g.device())?;
    let geometry = geometry(op, &gx, g.dims(), windows, None)?;
    let g = g.contiguous_detached()?;
    let (dev, g_view) = device_view(op, &g)?;
    let (_, gx_view) = device_view(op, &gx)?;
    if indices.buffer.device().device() != g.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: indices.buffer.device().device(),
            rhs: g.device(),
        });
    }
    let launch = max_pool2d_backward_launch(op, g_view, indices.buffer.ptr(), gx_view, &geometry)?;
    launch_on_compute(&dev, &launch, gx.numel())?;
    Ok(gx)
}

/// Average pooling of `x` into a tensor of `shape`: sliding windows divided by `divisor`, or
/// adaptive windows divided by their size.
pub(crate) fn avg_pool(
    op: &'static str,
    x: &Tensor,
    windows: PoolWindows,
    divisor: Option<usize>,
    shape: &[usize],
) -> Result<Tensor> {
    let geometry = geometry(op, x, shape, windows, divisor)?;
    let x = x.contiguous_detached()?;
    let out = Tensor::empty(shape, x.dtype(), x.device())?;
    let (dev, x_view) = device_view(op, &x)?;
    let (_, out_view) = device_view(op, &out)?;
    let launch = avg_pool2d_launch(op, x_view, out_view, &geometry)?;
    launch_on_compute(&dev, &launch, out.numel())?;
    Ok(out)
}

/// The backward of [`avg_pool`], as a tensor of `in_shape`.
pub(crate) fn avg_pool_backward(
    op: &'static str,
    g: &Tensor,
    windows: PoolWindows,
    divisor: Option<usize>,
    in_shape: &[usize],
) -> Result<Tensor> {
    let gx = Tensor::empty(in_shape, g.dtype(), g.device())?;
    let geometry = geometry(op, &gx, g.dims(), windows, divisor)?;
    let g = g.contiguous_detached()?;
    let (dev, g_view) = device_view(op, &g)?;
    let (_, gx_view) = device_view(op, &gx)?;
    let launch = avg_pool2d_backward_launch(op, g_view, gx_view, &geometry)?;
    launch_on_compute(&dev, &launch, gx.numel())?;
    Ok(gx)
}
