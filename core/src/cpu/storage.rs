//! Host memory of one dtype: the CPU variant of a tensor's storage.

use crate::cpu::alloc;
use crate::{DType, Element, Result};

/// Host memory of one dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// [`DType::F32`] elements.
    F32(Vec<f32>),
    /// [`DType::F64`] elements.
    F64(Vec<f64>),
    /// [`DType::F16`] elements.
    F16(Vec<half::f16>),
    /// [`DType::BF16`] elements.
    BF16(Vec<half::bf16>),
    /// [`DType::I64`] elements.
    I64(Vec<i64>),
    /// [`DType::U8`] elements.
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

    /// Wraps a vector.
    pub fn from_vec<T: Element>(data: Vec<T>) -> Self {
        T::into_storage(data)
    }

    /// The elements as bytes (native byte order).
    pub fn as_bytes(&self) -> &[u8] {
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: every element type storage holds is plain data without padding, so its
            // memory may be read as bytes; the length covers exactly the elements.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        match self {
            CpuStorage::F32(v) => bytes(v),
            CpuStorage::F64(v) => bytes(v),
            CpuStorage::F16(v) => bytes(v),
            CpuStorage::BF16(v) => bytes(v),
            CpuStorage::I64(v) => bytes(v),
            CpuStorage::U8(v) => bytes(v),
        }
    }

    /// Zero-filled storage (from the caching allocator). Aborts if the memory cannot be had;
    /// see [`CpuStorage::try_zeros`].
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match Self::try_zeros("CpuStorage::zeros", dtype, len) {
            Ok(storage) => storage,
            Err(e) => panic!("{e}"),
        }
    }

    /// Zero-filled storage, or an out-of-memory error naming `op`.
    pub fn try_zeros(op: &'static str, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(alloc::try_zeroed(op, len)?),
            DType::F64 => CpuStorage::F64(alloc::try_zeroed(op, len)?),
            DType::F16 => CpuStorage::F16(alloc::try_zeroed(op, len)?),
            DType::BF16 => CpuStorage::BF16(alloc::try_zeroed(op, len)?),
            DType::I64 => CpuStorage::I64(alloc::try_zeroed(op, len)?),
            DType::U8 => CpuStorage::U8(alloc::try_zeroed(op, len)?),
        })
    }

    /// Storage whose elements are unspecified (a recycled buffer), for kernels that write every
    /// element; an out-of-memory error names `op`.
    pub fn try_uninit(op: &'static str, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(alloc::try_uninit(op, len)?),
            DType::F64 => CpuStorage::F64(alloc::try_uninit(op, len)?),
            DType::F16 => CpuStorage::F16(alloc::try_uninit(op, len)?),
            DType::BF16 => CpuStorage::BF16(alloc::try_uninit(op, len)?),
            DType::I64 => CpuStorage::I64(alloc::try_uninit(op, len)?),
            DType::U8 => CpuStorage::U8(alloc::try_uninit(op, len)?),
        })
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
