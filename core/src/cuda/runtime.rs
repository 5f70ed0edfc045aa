//! The runtime's own operations on CUDA tensors: allocation, fill, copy, cast, scale,
//! accumulate, moving between host and device, and reading elements back. [`Tensor`]'s
//! device-neutral methods (`core/src/access.rs`, `core/src/create.rs`) call these for CUDA
//! tensors. Kernels run on the device's compute stream, in issue order with every op.

use std::sync::Arc;

use super::device::{device, CudaDevice};
use super::launch::Launch;
use super::runtime_kernels::{self as kernels, DeviceView};
use super::storage::CudaStorage;
use super::transfer;
use crate::{
    with_element_type, DType, Device, Element, Error, Event, Layout, Result, Storage, Stream,
    Tensor,
};

/// The open device of a CUDA tensor and the device address of its storage's first element
/// (the tensor's layout offset counts from there). For ops' CUDA code building launches.
pub fn device_pointer(op: &'static str, t: &Tensor) -> Result<(Arc<CudaDevice>, u64)> {
    let m = t.storage().cuda_memory(op)?;
    Ok((m.cuda_device().clone(), m.ptr()))
}

/// The open device of a CUDA tensor and its view for a launch plan (address of the storage,
/// dtype, layout).
pub fn device_view<'a>(
    op: &'static str,
    t: &'a Tensor,
) -> Result<(Arc<CudaDevice>, DeviceView<'a>)> {
    let (dev, ptr) = device_pointer(op, t)?;
    Ok((
        dev,
        DeviceView {
            ptr,
            dtype: t.dtype(),
            layout: t.layout(),
        },
    ))
}

/// A fresh contiguous tensor of `numel` uninitialised elements on `cuda:ordinal`.
pub(crate) fn empty(
    op: &'static str,
    ordinal: usize,
    shape: &[usize],
    dtype: DType,
    numel: usize,
) -> Result<Tensor> {
    let dev = device(ordinal)?;
    let storage = CudaStorage::uninit(op, &dev, dtype, numel)?;
    Tensor::from_storage(Storage::cuda(storage), Layout::contiguous(shape))
}

/// Runs `launch` on the device's compute stream, unless the work is empty (`numel` is 0).
pub fn launch_on_compute(dev: &CudaDevice, launch: &Launch, numel: usize) -> Result<()> {
    if numel == 0 {
        return Ok(());
    }
    dev.launch(launch, dev.compute_stream())
}

/// Sets every element to `value`.
pub(crate) fn fill(t: &Tensor, value: f64) -> Result<()> {
    let (dev, dst) = device_view("fill_", t)?;
    launch_on_compute(&dev, &kernels::fill_launch(dst, value)?, t.numel())
}

/// A copy of `src` when it overlaps `dst` other than as the same view (the kernels read and
/// write element `i` in one thread, so only that kind of aliasing is safe).
fn unaliased(dst: &Tensor, src: &Tensor) -> Result<Option<Tensor>> {
    let (_, d) = device_view("copy_", dst)?;
    let (_, s) = device_view("copy_", src)?;
    if kernels::overlaps_other_than_same_view(&d, &s)? {
        let fresh = Tensor::empty(src.dims(), src.dtype(), src.device())?;
        copy(&fresh, src)?;
        Ok(Some(fresh))
    } else {
        Ok(None)
    }
}

/// `dst = src` (same shape and dtype, any layouts).
pub(crate) fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    let staged = unaliased(dst, src)?;
    let src = staged.as_ref().unwrap_or(src);
    let (dev, d) = device_view("copy_", dst)?;
    let (_, s) = device_view("copy_", src)?;
    launch_on_compute(&dev, &kernels::copy_launch(d, s)?, dst.numel())
}

/// `t *= factor`.
pub(crate) fn scale(t: &Tensor, factor: f64) -> Result<()> {
    let (dev, dst) = device_view("scale_", t)?;
    launch_on_compute(&dev, &kernels::scale_launch(dst, factor)?, t.numel())
}

/// `dst += alpha * src`.
pub(crate) fn add_scaled(dst: &Tensor, src: &Tensor, alpha: f64) -> Result<()> {
    let staged = unaliased(dst, src)?;
    let src = staged.as_ref().unwrap_or(src);
    let (dev, d) = device_view("add_scaled_", dst)?;
    let (_, s) = device_view("add_scaled_", src)?;
    launch_on_compute(&dev, &kernels::add_scaled_launch(d, s, alpha)?, dst.numel())
}

/// `t` converted to `dtype`, as a fresh tensor on the same device: channels-last when `t` is,
/// else contiguous.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    // A channels-last tensor stays channels-last (PyTorch's preserve_format), as on the CPU.
    let out = if t.layout().is_channels_last() {
        Tensor::empty_in(
            t.dims(),
            dtype,
            t.device(),
            crate::MemoryFormat::ChannelsLast,
        )?
    } else {
        Tensor::empty(t.dims(), dtype, t.device())?
    };
    let (dev, src) = device_view("to_dtype", t)?;
    let (_, dst) = device_view("to_dtype", &out)?;
    launch_on_compute(&dev, &kernels::cast_launch(dst, src)?, t.numel())?;
    Ok(out)
}

/// The elements of a CUDA tensor in row-major order, in host memory. Waits for the work
/// issued before it on the compute stream, then reports what its kernels found wrong
/// ([`deferred`](super::deferred)).
pub(crate) fn to_vec<T: Element>(t: &Tensor) -> Result<Vec<T>> {
    let dense = t.contiguous_detached()?;
    let (dev, ptr) = device_pointer("to_vec", &dense)?;
    let mut out = crate::alloc::try_uninit::<T>("to_vec", dense.numel())?;
    let size = std::mem::size_of::<T>();
    let start = ptr + (dense.layout().offset() * size) as u64;
    // SAFETY: every dtype tensors hold is plain data, so its elements may be written as bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * size) };
    transfer::download(&dev, "to_vec", start, bytes, dev.compute_stream())?;
    super::deferred::check(&dev, "to_vec")?;
    Ok(out)
}

/// `t` (any device) as a contiguous tensor on `cuda:ordinal`.
pub(crate) fn upload(t: &Tensor, ordinal: usize) -> Result<Tensor> {
    const OP: &str = "to_device";
    let host = match t.device() {
        Device::Cpu => t.contiguous_detached()?,
        _ => {
            with_element_type!(t.dtype(), T => Tensor::from_vec(t.to_vec::<T>()?, t.dims(), Device::Cpu)?)
        }
    };
    let out = empty(OP, ordinal, t.dims(), t.dtype(), t.numel())?;
    let (dev, ptr) = device_pointer(OP, &out)?;
    let guard = host.storage().read_host(OP)?;
    let size = t.dtype().size_in_bytes();
    let offset = host.layout().offset() * size;
    let bytes = &guard.as_bytes()[offset..offset + t.numel() * size];
    transfer::upload(&dev, OP, bytes, ptr, dev.compute_stream())?;
    drop(guard);
    Ok(out)
}

/// `t` (a CPU tensor) as a contiguous tensor on `cuda:ordinal`, allocated and copied in order on
/// `stream` (a stream of that device other than the compute stream, typically a copy stream),
/// so that the copy overlaps the compute stream's work, and the event right after the copy.
/// The memory is noted as used on the compute stream, where the caller uses it after waiting
/// for the event, and as done with on `stream` at the event: dropping the copy frees it on the
/// compute stream after the event, not after later work on `stream` (later batches' copies).
pub(crate) fn upload_on(t: &Tensor, ordinal: usize, stream: &Stream) -> Result<(Tensor, Event)> {
    const OP: &str = "to_device_on";
    let cuda_stream = stream
        .cuda_stream()
        .ok_or_else(|| Error::invalid(OP, format!("{stream:?} is not a CUDA stream")))?;
    let host = t.contiguous_detached()?;
    let dev = device(ordinal)?;
    let storage = CudaStorage::uninit_on(OP, &dev, t.dtype(), t.numel(), cuda_stream)?;
    storage.buffer().record_stream(dev.compute_stream());
    let guard = host.storage().read_host(OP)?;
    let size = t.dtype().size_in_bytes();
    let offset = host.layout().offset() * size;
    let bytes = &guard.as_bytes()[offset..offset + t.numel() * size];
    transfer::upload(&dev, OP, bytes, storage.ptr(), cuda_stream)?;
    let copied = stream.record_event()?;
    storage.buffer().allocating_stream_done(copied.clone());
    let out = Tensor::from_storage(Storage::cuda(storage), Layout::contiguous(t.dims()))?;
    Ok((out, copied))
}

/// `t` (on a CUDA device) as a CPU tensor.
pub(crate) fn download(t: &Tensor) -> Result<Tensor> {
    with_element_type!(t.dtype(), T => Tensor::from_vec(t.to_vec::<T>()?, t.dims(), Device::Cpu))
}
