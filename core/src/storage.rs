//! Tensor storage: one shared, lockable buffer per allocation.
//!
//! Views share a `Storage`; in-place updates (gradient accumulation, optimizer steps, a
//! collective writing its result) take the write lock, readers take the read lock. Cloning a
//! `Storage` clones the handle, never the data.

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::{alloc, DType, Device};

/// Host memory of one dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::U8(v) => v.len(),
        }
    }

    /// Whether the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Zero-filled storage (from the caching allocator).
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(alloc::zeroed(len)),
            DType::F64 => CpuStorage::F64(alloc::zeroed(len)),
            DType::F16 => CpuStorage::F16(alloc::zeroed(len)),
            DType::BF16 => CpuStorage::BF16(alloc::zeroed(len)),
            DType::I64 => CpuStorage::I64(alloc::zeroed(len)),
            DType::U8 => CpuStorage::U8(alloc::zeroed(len)),
        }
    }
}

/// The buffer goes back to the caching allocator.
impl Drop for CpuStorage {
    fn drop(&mut self) {
        match self {
            CpuStorage::F32(v) => alloc::recycle(std::mem::take(v)),
            CpuStorage::F64(v) => alloc::recycle(std::mem::take(v)),
            CpuStorage::F16(v) => alloc::recycle(std::mem::take(v)),
            CpuStorage::BF16(v) => alloc::recycle(std::mem::take(v)),
            CpuStorage::I64(v) => alloc::recycle(std::mem::take(v)),
            CpuStorage::U8(v) => alloc::recycle(std::mem::take(v)),
        }
    }
}

/// A shared handle to a buffer on a device.
#[derive(Clone, Debug)]
pub struct Storage {
    data: Arc<RwLock<CpuStorage>>,
    device: Device,
}

impl Storage {
    /// Wraps host memory.
    pub fn cpu(data: CpuStorage) -> Self {
        Storage {
            data: Arc::new(RwLock::new(data)),
            device: Device::Cpu,
        }
    }

    /// Host memory labelled as belonging to `device`. Exists only so that device checks can be
    /// tested before a device backend is built; kernels still read it as host memory.
    #[doc(hidden)]
    pub fn host_memory_labelled(data: CpuStorage, device: Device) -> Self {
        Storage {
            data: Arc::new(RwLock::new(data)),
            device,
        }
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Shared access to the elements.
    pub fn read(&self) -> RwLockReadGuard<'_, CpuStorage> {
        self.data.read()
    }

    /// Exclusive access to the elements.
    pub fn write(&self) -> RwLockWriteGuard<'_, CpuStorage> {
        self.data.write()
    }

    /// Whether two handles refer to the same buffer.
    pub fn same_buffer(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.data, &other.data)
    }

    /// Whether this handle is the only one to its buffer (so the buffer may be reused).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.data) == 1
    }
}
