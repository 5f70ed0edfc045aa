//! The CUDA variant of a tensor's storage: one device allocation holding elements of one dtype.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::device::CudaDevice;
use super::memory::DeviceBuffer;
use super::transfer;
use crate::{with_element_type, CpuStorage, DType, Device, Error, Result};

/// Device memory holding `len` elements of one dtype.
#[derive(Debug)]
pub struct CudaStorage {
    buffer: DeviceBuffer,
    dtype: DType,
    len: usize,
}

impl CudaStorage {
    /// Uninitialised storage for `len` elements on `device`, ordered on its compute stream.
    pub fn uninit(
        op: &'static str,
        device: &Arc<CudaDevice>,
        dtype: DType,
        len: usize,
    ) -> Result<Self> {
        Self::uninit_on(op, device, dtype, len, device.compute_stream())
    }

    /// Uninitialised storage for `len` elements on `device`, ordered on `stream` (one of the
    /// device's streams): usable there at once, elsewhere after waiting for that stream.
    pub fn uninit_on(
        op: &'static str,
        device: &Arc<CudaDevice>,
        dtype: DType,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Self> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::OutOfMemory {
                op,
                device: device.device(),
                bytes: usize::MAX,
            })?;
        let buffer = DeviceBuffer::alloc(op, device, bytes, stream)?;
        super::sanitizer::described(buffer.ptr(), dtype, len);
        Ok(CudaStorage { buffer, dtype, len })
    }

    /// A copy of host memory on `device` (every element, in order).
    pub fn upload(op: &'static str, device: &Arc<CudaDevice>, host: &CpuStorage) -> Result<Self> {
        let out = CudaStorage::uninit(op, device, host.dtype(), host.len())?;
        transfer::upload(
            device,
            op,
            host.as_bytes(),
            out.ptr(),
            device.compute_stream(),
        )?;
        Ok(out)
    }

    /// A copy of every element in host memory, after the work already issued on the device's
    /// compute stream.
    pub fn download(&self, op: &'static str) -> Result<CpuStorage> {
        let dev = self.cuda_device();
        with_element_type!(self.dtype, T => {
            let mut out = crate::alloc::try_uninit::<T>(op, self.len)?;
            // SAFETY: every dtype storage holds is plain data, so its elements may be written
            // as bytes; the byte length covers exactly the elements.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(
                    out.as_mut_ptr().cast::<u8>(),
                    std::mem::size_of_val(out.as_slice()),
                )
            };
            transfer::download(dev, op, self.ptr(), bytes, dev.compute_stream())?;
            Ok(CpuStorage::from_vec(out))
        })
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.buffer.ptr()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device as tandem names it.
    pub fn device(&self) -> Device {
        self.buffer.device().device()
    }

    /// The open device holding the memory.
    pub fn cuda_device(&self) -> &Arc<CudaDevice> {
        self.buffer.device()
    }

    /// The allocation (to note other streams that use it).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }
}
