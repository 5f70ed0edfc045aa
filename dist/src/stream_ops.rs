//! Runtime operations issued on a chosen CUDA stream.
//!
//! tandem's runtime operations (`copy_`, `to_dtype`, …) run on the device's compute stream, in
//! order with every op. Communication works on its own stream: a bucket is compressed, a
//! collective's snapshot taken and its result written *on the comm stream*, ordered after the
//! compute stream only through events, so that backward keeps computing meanwhile. These helpers
//! issue the CUDA runtime's own kernels (core's launch plans, nothing new) on such a stream, and
//! allocate memory in its order. Every tensor they touch is marked as used on the stream
//! ([`Tensor::record_stream`]), so its memory is not reused before the stream is done with it.
//!
//! They are for CUDA streams only; on the CPU a comm stream is a host thread, and callers use the
//! ordinary operations inside the jobs they queue there.

use tandem_core::cuda::launch::Launch;
use tandem_core::cuda::runtime_kernels::cast_launch;
use tandem_core::cuda::{device_view, CudaDevice, CudaStorage};
use tandem_core::{DType, Device, Error, Layout, Result, Storage, Stream, Tensor};

/// Checks that `stream` is a CUDA stream and that `tensors` live on its device.
fn check_stream(op: &'static str, stream: &Stream, tensors: &[&Tensor]) -> Result<()> {
    if stream.cuda_stream().is_none() {
        return Err(Error::invalid(
            op,
            format!("{stream:?} is not a CUDA stream"),
        ));
    }
    for t in tensors {
        t.device().same_as(stream.device(), op)?;
    }
    Ok(())
}

/// Runs `launch` (over `numel` elements; nothing when 0) on `stream`, a CUDA stream of `dev`.
pub(crate) fn launch_on(
    dev: &CudaDevice,
    stream: &Stream,
    launch: &Launch,
    numel: usize,
) -> Result<()> {
    if numel == 0 {
        return Ok(());
    }
    match stream.cuda_stream() {
        Some(cuda) => dev.launch(launch, cuda),
        None => Err(Error::invalid(
            "launch",
            format!("{stream:?} is not a CUDA stream"),
        )),
    }
}

/// A contiguous tensor of uninitialised memory on `stream`'s device, allocated in the stream's
/// order: usable on `stream` at once, on other streams after waiting for it.
pub(crate) fn empty_on(
    op: &'static str,
    stream: &Stream,
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    let (Some(cuda), Device::Cuda(ordinal)) = (stream.cuda_stream(), stream.device()) else {
        return Err(Error::invalid(
            op,
            format!("{stream:?} is not a CUDA stream"),
        ));
    };
    let dev = tandem_core::cuda::device(ordinal)?;
    let numel = tandem_core::checked_numel(op, dims)?;
    let storage = CudaStorage::uninit_on(op, &dev, dtype, numel, cuda)?;
    Tensor::from_storage(Storage::cuda(storage), Layout::contiguous(dims))
}

/// `dst = src` converted to `dst`'s dtype (a plain copy when the dtypes match), on `stream`
/// (same shape; any layouts). The caller orders `stream` after whatever wrote `src`.
pub(crate) fn cast_on(stream: &Stream, dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "to_dtype (on a comm stream)";
    check_stream(OP, stream, &[dst, src])?;
    if dst.dims() != src.dims() {
        return Err(Error::shape(
            OP,
            format!("destination {:?} vs source {:?}", dst.dims(), src.dims()),
        ));
    }
    let (dev, d) = device_view(OP, dst)?;
    let (_, s) = device_view(OP, src)?;
    // The plan refuses a source that overlaps its destination other than as the same view.
    let launch = cast_launch(d, s)?;
    dst.record_stream(stream)?;
    src.record_stream(stream)?;
    launch_on(&dev, stream, &launch, dst.numel())
}
/// `dst = src` (same shape and dtype) on `stream`.
pub(crate) fn copy_on(stream: &Stream, dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op: "copy_ (on a comm stream)",
            lhs: dst.dtype(),
            rhs: src.dtype(),
        });
    }
    cast_on(stream, dst, src)
}
