//! The pools on a CUDA device: the launches of `pool.cu` (built in `launch.rs`) on the device's
//! compute stream, into fresh tensors from the stream-ordered allocator. Strided inputs and
//! output gradients are made dense first (pooling reads every element of a plane, so a copy is
//! what a fast implementation does anyway, as PyTorch's `.contiguous()` does). The max pool's
//! saved maxima are u32 plane indices in a device buffer that lives in the backward closure.
//!
//! A 4-D input dense in channels-last is pooled as it is, with the channel innermost (the
//! kernels' `channels` = C), into a channels-last output; its input gradient is channels-last
//! too, as on the CPU. Every other input is pooled as row-major planes.

pub mod launch;

use std::sync::Arc;

use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::cuda::{device_pointer, launch_on_compute, CudaDevice, DeviceBuffer};
use tandem_core::{Error, Layout, MemoryFormat, Result, Tensor};

use super::shape::PoolWindows;
use launch::{
    avg_pool2d_backward_launch, avg_pool2d_launch, max_pool2d_backward_launch, max_pool2d_launch,
    PoolGeometry,
};

/// Where each window's maximum came from (its index within the plane, as u32), in device
/// memory, kept by the forward of a max pool for its backward.
pub(crate) struct MaxIndices {
    buffer: DeviceBuffer,
    /// The format of the forward's input, which its gradient gets.
    format: MemoryFormat,
}

/// The format a pool reads `x` in: channels-last for a 4-D input dense in it, else row-major.
pub(crate) fn format_of(x: &Tensor) -> MemoryFormat {
    if x.rank() == 4 && x.layout().is_channels_last() {
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

/// The layout of `t` (dense in `format`) in storage order: itself for row-major, permuted to
/// `[N, H, W, C]` for channels-last, so that the launch builders see a dense array.
fn storage_layout(op: &'static str, t: &Tensor, format: MemoryFormat) -> Result<Layout> {
    match format {
        MemoryFormat::Contiguous => Ok(t.layout().clone()),
        MemoryFormat::ChannelsLast => t.layout().permute(op, &[0, 2, 3, 1]),
    }
}

/// The view of `t` through `layout` (its storage-order layout) and its device.
fn view<'a>(
    op: &'static str,
    t: &Tensor,
    layout: &'a Layout,
) -> Result<(Arc<CudaDevice>, DeviceView<'a>)> {
    let (dev, ptr) = device_pointer(op, t)?;
    Ok((
        dev,
        DeviceView {
            ptr,
            dtype: t.dtype(),
            layout,
        },
    ))
}

/// The pool's geometry for an input `x` of dims `[.., H, W]` and an output of `shape`.
fn geometry(
    op: &'static str,
    x: &Tensor,
    shape: &[usize],
    windows: PoolWindows,
    divisor: Option<usize>,
    format: MemoryFormat,
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
    let geometry = PoolGeometry::new(
        op,
        planes,
        (dims[r - 2], dims[r - 1]),
        output,
        windows,
        divisor,
    )?;
    match format {
        MemoryFormat::Contiguous => Ok(geometry),
        MemoryFormat::ChannelsLast => geometry.channels_last(op, dims[1]),
    }
}

/// Max pooling of `x` into a tensor of `shape`, with the maxima's indices when `keep_indices`.
pub(crate) fn max_pool(
    op: &'static str,
    x: &Tensor,
    windows: PoolWindows,
    keep_indices: bool,
    shape: &[usize],
) -> Result<(Tensor, Option<MaxIndices>)> {
    let format = format_of(x);
    let geometry = geometry(op, x, shape, windows, None, format)?;
    let x = dense_in(x, format)?;
    let out = Tensor::empty_in(shape, x.dtype(), x.device(), format)?;
    let (x_layout, out_layout) = (
        storage_layout(op, &x, format)?,
        storage_layout(op, &out, format)?,
    );
    let (dev, x_view) = view(op, &x, &x_layout)?;
    let (_, out_view) = view(op, &out, &out_layout)?;
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
    Ok((out, indices.map(|buffer| MaxIndices { buffer, format })))
}

/// The backward of [`max_pool`]: each output gradient routed to where its window's maximum
/// came from, as a tensor of `in_shape` in the forward input's format.
pub(crate) fn max_pool_backward(
    op: &'static str,
    g: &Tensor,
    indices: &MaxIndices,
    windows: PoolWindows,
    in_shape: &[usize],
) -> Result<Tensor> {
    let format = indices.format;
    let gx = Tensor::empty_in(in_shape, g.dtype(), g.device(), format)?;
    let geometry = geometry(op, &gx, g.dims(), windows, None, format)?;
    let g = dense_in(g, format)?;
    let (g_layout, gx_layout) = (
        storage_layout(op, &g, format)?,
        storage_layout(op, &gx, format)?,
    );
    let (dev, g_view) = view(op, &g, &g_layout)?;
    let (_, gx_view) = view(op, &gx, &gx_layout)?;
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
    let format = format_of(x);
    let geometry = geometry(op, x, shape, windows, divisor, format)?;
    let x = dense_in(x, format)?;
    let out = Tensor::empty_in(shape, x.dtype(), x.device(), format)?;
    let (x_layout, out_layout) = (
        storage_layout(op, &x, format)?,
        storage_layout(op, &out, format)?,
    );
    let (dev, x_view) = view(op, &x, &x_layout)?;
    let (_, out_view) = view(op, &out, &out_layout)?;
    let launch = avg_pool2d_launch(op, x_view, out_view, &geometry)?;
    launch_on_compute(&dev, &launch, out.numel())?;
    Ok(out)
}

/// The backward of [`avg_pool`], as a tensor of `in_shape` in `format` (the forward input's,
/// from [`format_of`]).
pub(crate) fn avg_pool_backward(
    op: &'static str,
    g: &Tensor,
    windows: PoolWindows,
    divisor: Option<usize>,
    in_shape: &[usize],
    format: MemoryFormat,
) -> Result<Tensor> {
    let format = match in_shape.len() {
        4 => format,
        _ => MemoryFormat::Contiguous,
    };
    let gx = Tensor::empty_in(in_shape, g.dtype(), g.device(), format)?;
    let geometry = geometry(op, &gx, g.dims(), windows, divisor, format)?;
    let g = dense_in(g, format)?;
    let (g_layout, gx_layout) = (
        storage_layout(op, &g, format)?,
        storage_layout(op, &gx, format)?,
    );
    let (dev, g_view) = view(op, &g, &g_layout)?;
    let (_, gx_view) = view(op, &gx, &gx_layout)?;
    let launch = avg_pool2d_backward_launch(op, g_view, gx_view, &geometry)?;
    launch_on_compute(&dev, &launch, gx.numel())?;
    Ok(gx)
}
