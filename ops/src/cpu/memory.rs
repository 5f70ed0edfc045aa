//! Host memory for the CPU kernels, allocated fallibly: every output or scratch buffer whose
//! size comes from a caller's shapes is taken here, so an allocation that cannot be made (a
//! product of dims larger than memory) is an error naming the op, never an abort.

use tandem_core::{
    alloc, checked_numel, CpuStorage, DType, Element, Layout, MemoryFormat, Result, Storage, Tensor,
};

/// `len` elements whose values are unspecified (a recycled buffer), for a kernel that writes
/// all of them.
pub(crate) fn uninit<T: Element>(op: &'static str, len: usize) -> Result<Vec<T>> {
    alloc::try_uninit(op, len)
}

/// `len` zeros, for a kernel that accumulates into them.
pub(crate) fn zeroed<T: Element>(op: &'static str, len: usize) -> Result<Vec<T>> {
    alloc::try_zeroed(op, len)
}

/// A contiguous CPU tensor of `shape` whose elements are unspecified, for a result the kernel
/// overwrites entirely. The shape's product is checked.
pub(crate) fn empty(op: &'static str, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let numel = checked_numel(op, shape)?;
    Tensor::from_storage(
        Storage::cpu(CpuStorage::try_uninit(op, dtype, numel)?),
        Layout::contiguous(shape),
    )
}

/// `x` itself (detached) when it is contiguous, else a contiguous copy of it.
pub(crate) fn contiguous(op: &'static str, x: &Tensor) -> Result<Tensor> {
    if x.is_contiguous() {
        return Ok(x.detach());
    }
    let out = empty(op, x.dims(), x.dtype())?;
    out.copy_(x)?;
    Ok(out)
}

/// `x` itself (detached) when its storage order is `format`'s (dense in `format`), else a
/// copy dense in `format`: the operands of a kernel that runs in storage order.
pub(crate) fn dense_in(x: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    if x.is_contiguous_in(format) {
        return Ok(x.detach());
    }
    x.contiguous_in(format)
}

/// The elements of a CPU tensor of dtype `T` in row-major order (any layout), as a fresh
/// buffer.
pub(crate) fn gather<T: Element>(op: &'static str, x: &Tensor) -> Result<Vec<T>> {
    let mut out = uninit::<T>(op, x.numel())?;
    if out.is_empty() {
        return Ok(out);
    }
    let guard = x.storage().read_host(op)?;
    let data = host_slice::<T>(op, &guard)?;
    let row_len = x.dims().last().copied().unwrap_or(1).max(1);
    let mut rows = out.chunks_mut(row_len);
    x.layout().for_each_row(|start, stride| {
        if let Some(row) = rows.next() {
            if stride == 1 {
                row.copy_from_slice(&data[start..start + row.len()]);
            } else {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = data[start + j * stride];
                }
            }
        }
    });
    Ok(out)
}

/// The whole host buffer as elements of `T`, or an error naming `op` when it holds another
/// dtype (the callers have checked it, so this is a guard, not a path).
pub(crate) fn host_slice<'a, T: Element>(
    op: &'static str,
    storage: &'a CpuStorage,
) -> Result<&'a [T]> {
    T::slice(storage).ok_or(tandem_core::Error::DTypeMismatch {
        op,
        lhs: storage.dtype(),
        rhs: T::DTYPE,
    })
}

/// A scratch buffer from the caching allocator, handed back to it on drop.
pub(crate) struct Scratch<T: Element> {
    /// The elements (unspecified until written).
    pub buf: Vec<T>,
}

impl<T: Element> Scratch<T> {
    /// `len` elements of unspecified value; an error naming `op` when they cannot be had.
    pub(crate) fn new(op: &'static str, len: usize) -> Result<Self> {
        Ok(Scratch {
            buf: uninit(op, len)?,
        })
    }

    /// `len` zeros.
    pub(crate) fn zeroed(op: &'static str, len: usize) -> Result<Self> {
        Ok(Scratch {
            buf: zeroed(op, len)?,
        })
    }
}

impl<T: Element> Drop for Scratch<T> {
    fn drop(&mut self) {
        alloc::recycle(std::mem::take(&mut self.buf));
    }
}
