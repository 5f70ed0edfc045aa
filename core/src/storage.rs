//! Tensor storage: one shared buffer per allocation, held by the device that owns the memory.
//!
//! A [`Storage`] is a cheap handle; views of a tensor share it. What it holds depends on the
//! device: host memory ([`CpuStorage`], behind a read-write lock so in-place updates —
//! gradient accumulation, optimizer steps, a collective writing its result — exclude
//! readers), or a CUDA device allocation (kernels are ordered by streams, not locks). Host access goes through
//! [`Storage::read_host`] / [`Storage::write_host`], which fail with an error naming the op
//! when the memory is not host memory, so device memory can never be read as if it were.

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use crate::cpu::CpuStorage;
pub use crate::cuda::CudaStorage;
use crate::{DType, Device, Error, Result};

/// What a storage handle points at.
enum Buffer {
    /// Host memory.
    Cpu(RwLock<CpuStorage>),
    /// Memory of a CUDA device.
    Cuda(CudaStorage),
    /// No memory: a stand-in on a device this machine may not have, for tests of device
    /// checks. Every access to its elements is an error.
    Placeholder {
        device: Device,
        dtype: DType,
        len: usize,
    },
}

/// A shared handle to a buffer on a device.
#[derive(Clone)]
pub struct Storage {
    buffer: Arc<Buffer>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Storage({} × {} on {})",
            self.len(),
            self.dtype(),
            self.device()
        )
    }
}

impl Storage {
    /// Wraps host memory.
    pub fn cpu(data: CpuStorage) -> Self {
        Storage {
            buffer: Arc::new(Buffer::Cpu(RwLock::new(data))),
        }
    }

    /// Wraps CUDA device memory.
    pub fn cuda(data: CudaStorage) -> Self {
        Storage {
            buffer: Arc::new(Buffer::Cuda(data)),
        }
    }

    /// A storage that claims `data`'s dtype and length on `device` but holds no usable memory
    /// there: every element access is an error. It exists so that device checks can be tested
    /// on machines without that device (the data is dropped).
    #[doc(hidden)]
    pub fn host_memory_labelled(data: CpuStorage, device: Device) -> Self {
        if device == Device::Cpu {
            return Storage::cpu(data);
        }
        Storage {
            buffer: Arc::new(Buffer::Placeholder {
                device,
                dtype: data.dtype(),
                len: data.len(),
            }),
        }
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Device {
        match &*self.buffer {
            Buffer::Cpu(_) => Device::Cpu,
            Buffer::Cuda(data) => data.device(),
            Buffer::Placeholder { device, .. } => *device,
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &*self.buffer {
            Buffer::Cpu(data) => data.read().dtype(),
            Buffer::Cuda(data) => data.dtype(),
            Buffer::Placeholder { dtype, .. } => *dtype,
        }
    }

    /// Number of elements the buffer holds.
    pub fn len(&self) -> usize {
        match &*self.buffer {
            Buffer::Cpu(data) => data.read().len(),
            Buffer::Cuda(data) => data.len(),
            Buffer::Placeholder { len, .. } => *len,
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn not_host(&self, op: &'static str) -> Error {
        Error::invalid(
            op,
            format!(
                "the tensor's memory is on {}, not in host memory; move it with \
                 to_device(Device::Cpu) first",
                self.device()
            ),
        )
    }

    /// Shared access to host memory. Errors (naming `op`) when the buffer is not on the CPU.
    pub fn read_host(&self, op: &'static str) -> Result<RwLockReadGuard<'_, CpuStorage>> {
        match &*self.buffer {
            Buffer::Cpu(data) => Ok(data.read()),
            _ => Err(self.not_host(op)),
        }
    }

    /// Exclusive access to host memory. Errors (naming `op`) when the buffer is not on the CPU.
    pub fn write_host(&self, op: &'static str) -> Result<RwLockWriteGuard<'_, CpuStorage>> {
        match &*self.buffer {
            Buffer::Cpu(data) => Ok(data.write()),
            _ => Err(self.not_host(op)),
        }
    }

    /// The CUDA memory. Errors (naming `op`) when the buffer is not on a CUDA device.
    pub fn cuda_memory(&self, op: &'static str) -> Result<&CudaStorage> {
        match &*self.buffer {
            Buffer::Cuda(data) => Ok(data),
            _ => Err(Error::invalid(
                op,
                format!(
                    "the tensor's memory is on {}, not on a CUDA device",
                    self.device()
                ),
            )),
        }
    }

    /// Whether two handles refer to the same buffer.
    pub fn same_buffer(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.buffer, &other.buffer)
    }

    /// Whether this handle is the only one to its buffer (so the buffer may be reused).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.buffer) == 1
    }
}
