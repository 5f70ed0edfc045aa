//! Tensor storage: one shared buffer per allocation, held by the device that owns the memory.
//!
//! A [`Storage`] is a cheap handle; views of a tensor share it. What it holds depends on the
//! device: host memory ([`CpuStorage`]) or a CUDA device allocation ([`CudaStorage`]). The
//! buffer sits behind a read-write lock: in-place updates of host memory (gradient
//! accumulation, optimizer steps, a collective writing its result) exclude readers, and a
//! storage can be moved to another device as a whole ([`Storage::move_to`]) — every tensor
//! sharing it, a module's parameters above all, then lives there, keeping its identity.
//!
//! Host access goes through [`Storage::read_host`] / [`Storage::write_host`], which fail with
//! an error naming the op when the memory is not host memory, so device memory can never be
//! read as if it were. Device kernels get the address through [`Storage::cuda_memory`];
//! they are ordered by streams, not by this lock.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

pub use crate::cpu::CpuStorage;
pub use crate::cuda::CudaStorage;
use crate::{DType, Device, Error, Result};

/// What a storage handle points at.
enum Buffer {
    /// Host memory.
    Cpu(CpuStorage),
    /// Memory of a CUDA device.
    Cuda(CudaStorage),
    /// No memory: a stand-in on a device this machine may not have, for tests of device
    /// checks. Every access to its elements is an error.
    Placeholder,
}

struct Inner {
    dtype: DType,
    len: usize,
    /// The device, encoded (`usize::MAX` for the CPU, else the CUDA ordinal), kept beside the
    /// buffer so that asking for it never takes the lock (a kernel may hold it).
    device: AtomicUsize,
    buffer: RwLock<Buffer>,
}

const CPU: usize = usize::MAX;

fn encode(device: Device) -> usize {
    match device {
        Device::Cpu => CPU,
        Device::Cuda(n) => n,
    }
}

/// A shared handle to a buffer on a device.
#[derive(Clone)]
pub struct Storage {
    inner: Arc<Inner>,
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
    fn new(dtype: DType, len: usize, device: Device, buffer: Buffer) -> Self {
        Storage {
            inner: Arc::new(Inner {
                dtype,
                len,
                device: AtomicUsize::new(encode(device)),
                buffer: RwLock::new(buffer),
            }),
        }
    }

    /// Wraps host memory.
    pub fn cpu(data: CpuStorage) -> Self {
        Storage::new(data.dtype(), data.len(), Device::Cpu, Buffer::Cpu(data))
    }

    /// Wraps CUDA device memory.
    pub fn cuda(data: CudaStorage) -> Self {
        Storage::new(data.dtype(), data.len(), data.device(), Buffer::Cuda(data))
    }

    /// A storage that claims `data`'s dtype and length on `device` but holds no usable memory
    /// there: every element access is an error. It exists so that device checks can be tested
    /// on machines without that device (the data is dropped).
    #[doc(hidden)]
    pub fn host_memory_labelled(data: CpuStorage, device: Device) -> Self {
        if device == Device::Cpu {
            return Storage::cpu(data);
        }
        Storage::new(data.dtype(), data.len(), device, Buffer::Placeholder)
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Device {
        match self.inner.device.load(Ordering::Acquire) {
            CPU => Device::Cpu,
            n => Device::Cuda(n),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// Number of elements the buffer holds.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn not_on(&self, op: &'static str, wanted: &str) -> Error {
        Error::invalid(
            op,
            format!(
                "the tensor's memory is on {}, not {wanted}; move it with to_device first",
                self.device()
            ),
        )
    }

    /// Shared access to host memory. Errors (naming `op`) when the buffer is not on the CPU.
    pub fn read_host(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, CpuStorage>> {
        RwLockReadGuard::try_map(self.inner.buffer.read(), |b| match b {
            Buffer::Cpu(data) => Some(data),
            _ => None,
        })
        .map_err(|_| self.not_on(op, "in host memory"))
    }

    /// Exclusive access to host memory. Errors (naming `op`) when the buffer is not on the CPU.
    pub fn write_host(&self, op: &'static str) -> Result<MappedRwLockWriteGuard<'_, CpuStorage>> {
        RwLockWriteGuard::try_map(self.inner.buffer.write(), |b| match b {
            Buffer::Cpu(data) => Some(data),
            _ => None,
        })
        .map_err(|_| self.not_on(op, "in host memory"))
    }

    /// The CUDA memory. Errors (naming `op`) when the buffer is not on a CUDA device.
    pub fn cuda_memory(&self, op: &'static str) -> Result<MappedRwLockReadGuard<'_, CudaStorage>> {
        RwLockReadGuard::try_map(self.inner.buffer.read(), |b| match b {
            Buffer::Cuda(data) => Some(data),
            _ => None,
        })
        .map_err(|_| self.not_on(op, "on a CUDA device"))
    }

    /// Moves the whole buffer to `device` (a copy there replaces it), so that every tensor
    /// sharing this storage lives on `device` from now on, with its shape, strides and identity
    /// unchanged. Nothing happens when it is already there.
    pub fn move_to(&self, device: Device) -> Result<()> {
        if device == self.device() {
            return Ok(());
        }
        device.ensure_available()?;
        let mut buffer = self.inner.buffer.write();
        let moved = match (&*buffer, device) {
            (Buffer::Placeholder, _) => {
                return Err(self.not_on("move_to", "anywhere it can be read from"))
            }
            (Buffer::Cpu(data), Device::Cuda(n)) => Buffer::Cuda(CudaStorage::upload(
                "move_to",
                &crate::cuda::device(n)?,
                data,
            )?),
            (Buffer::Cuda(data), Device::Cpu) => Buffer::Cpu(data.download("move_to")?),
            (Buffer::Cuda(data), Device::Cuda(n)) => Buffer::Cuda(CudaStorage::upload(
                "move_to",
                &crate::cuda::device(n)?,
                &data.download("move_to")?,
            )?),
            (Buffer::Cpu(_), Device::Cpu) => return Ok(()),
        };
        *buffer = moved;
        self.inner.device.store(encode(device), Ordering::Release);
        Ok(())
    }

    /// Replaces this storage's buffer by `donor`'s, so that every tensor sharing this storage
    /// reads the donor's elements from now on (the old buffer is freed). `donor` must be the
    /// only handle to its buffer and hold as many elements of the same dtype on the same device;
    /// errors name `op`. This is how a tensor is re-laid out in place
    /// ([`Tensor::to_memory_format_`](crate::Tensor::to_memory_format_)): the donor holds the
    /// elements in the new order.
    pub(crate) fn adopt(&self, op: &'static str, donor: Storage) -> Result<()> {
        if donor.dtype() != self.dtype() || donor.len() != self.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "a buffer of {} × {} cannot replace one of {} × {}",
                    donor.len(),
                    donor.dtype(),
                    self.len(),
                    self.dtype()
                ),
            ));
        }
        self.device().same_as(donor.device(), op)?;
        let inner = Arc::try_unwrap(donor.inner).map_err(|_| {
            Error::invalid(op, "the replacement buffer is shared with another tensor")
        })?;
        *self.inner.buffer.write() = inner.buffer.into_inner();
        Ok(())
    }

    /// Whether two handles refer to the same buffer.
    pub fn same_buffer(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether this handle is the only one to its buffer (so the buffer may be reused).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
    }
}
