//! A caching host allocator for tensor buffers.
//!
//! A training step allocates the same buffers every iteration: activations, gradients, scratch
//! space of the kernels. Handing large blocks back to the C allocator each time is expensive on
//! Linux — glibc returns blocks above its mmap threshold to the kernel, so the next step pays a
//! page fault per 4 KiB page and the kernel zeroes every page again. This module keeps freed
//! buffers instead and hands them out again, so a steady-state step allocates nothing from
//! the system.
//!
//! Buffers are kept per element type in size classes four to an octave (a request is rounded
//! up to the next class, so at most a quarter of a buffer is slack). Buffers below
//! [`MIN_CACHED_BYTES`] are left to the system allocator, whose small-size bins are already
//! fast. The cache holds at most [`cache_limit`] bytes (default 2 GiB, change it with
//! [`set_cache_limit`]; 0 turns caching off); [`empty_cache`] returns everything to the
//! system, and [`stats`] says how well it works.
//!
//! Every element type tensors hold is plain data (any bit pattern is a valid value), so a
//! recycled buffer can be handed out without clearing it: [`uninit`] does that for kernels that
//! overwrite their whole output, [`zeroed`] clears it for kernels that accumulate into it.
//! Dropping a [`CpuStorage`](crate::CpuStorage) recycles its buffer; scratch vectors of a
//! kernel go back with [`recycle`]. Only buffers that came from the cache are kept; other
//! vectors go straight back to the system.

use std::collections::HashSet;

use parking_lot::Mutex;

use crate::{Element, Error, Result};

/// Buffers smaller than this many bytes are not cached.
pub const MIN_CACHED_BYTES: usize = 16 * 1024;

/// Default for [`cache_limit`]: 2 GiB.
const DEFAULT_LIMIT: usize = 2 << 30;

/// Free buffers of one element type, indexed by size class.
#[doc(hidden)]
pub struct Pool<T> {
    classes: Vec<Vec<Vec<T>>>,
}

impl<T> Pool<T> {
    const fn new() -> Self {
        Pool {
            classes: Vec::new(),
        }
    }

    fn take(&mut self, class: usize) -> Option<Vec<T>> {
        self.classes.get_mut(class)?.pop()
    }

    fn put(&mut self, class: usize, buffer: Vec<T>) {
        if self.classes.len() <= class {
            self.classes.resize_with(class + 1, Vec::new);
        }
        self.classes[class].push(buffer);
    }

    fn clear(&mut self) {
        self.classes.clear();
    }
}

/// The cache's state: one pool per element type and the counters.
#[doc(hidden)]
pub struct Pools {
    pub(crate) f32: Pool<f32>,
    pub(crate) f64: Pool<f64>,
    pub(crate) f16: Pool<half::f16>,
    pub(crate) bf16: Pool<half::bf16>,
    pub(crate) i64: Pool<i64>,
    pub(crate) u8: Pool<u8>,
    cached_bytes: usize,
    limit: usize,
    counters: CacheStats,
    /// Addresses of the buffers handed out and not yet back: only these are kept on recycle.
    lent: Option<HashSet<usize>>,
}

impl Pools {
    fn lent(&mut self) -> &mut HashSet<usize> {
        self.lent.get_or_insert_with(HashSet::new)
    }

    fn clear(&mut self) {
        self.f32.clear();
        self.f64.clear();
        self.f16.clear();
        self.bf16.clear();
        self.i64.clear();
        self.u8.clear();
        self.cached_bytes = 0;
    }
}

static POOLS: Mutex<Pools> = Mutex::new(Pools {
    f32: Pool::new(),
    f64: Pool::new(),
    f16: Pool::new(),
    bf16: Pool::new(),
    i64: Pool::new(),
    u8: Pool::new(),
    cached_bytes: 0,
    limit: DEFAULT_LIMIT,
    counters: CacheStats {
        hits: 0,
        misses: 0,
        cached_bytes: 0,
        peak_cached_bytes: 0,
    },
    lent: None,
});

/// How the cache has fared since the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served from a cached buffer.
    pub hits: u64,
    /// Requests of a cacheable size that had to allocate.
    pub misses: u64,
    /// Bytes held by the cache now (not in use by any tensor).
    pub cached_bytes: usize,
    /// The most bytes the cache has held at once.
    pub peak_cached_bytes: usize,
}

/// The size class of a request of `bytes` (rounded up), or `None` below the cached sizes.
fn class_above(bytes: usize) -> Option<usize> {
    if bytes < MIN_CACHED_BYTES {
        return None;
    }
    let floor = class_below(bytes)?;
    Some(if class_bytes(floor) < bytes {
        floor + 1
    } else {
        floor
    })
}

/// The largest size class not above `bytes`: the class a buffer of that capacity serves.
fn class_below(bytes: usize) -> Option<usize> {
    if bytes < MIN_CACHED_BYTES {
        return None;
    }
    let octave = (usize::BITS - 1 - bytes.leading_zeros()) as usize;
    let step = (bytes >> (octave - 2)) & 3;
    Some(octave * 4 + step)
}

/// Bytes of size class `class`: `(4 + step) · 2^(octave - 2)`.
fn class_bytes(class: usize) -> usize {
    let (octave, step) = (class / 4, class % 4);
    (4 + step) << (octave - 2)
}

/// A vector of `len` elements whose contents are unspecified (values left by an earlier user
/// of the buffer, or zeros): for kernels that write every element.
///
/// Aborts the process if the memory cannot be had, as `Vec` does; buffers whose size comes
/// from a user (tensor creation, a kernel's output) go through [`try_uninit`] instead.
pub fn uninit<T: Element>(len: usize) -> Vec<T> {
    match try_uninit::<T>("alloc", len) {
        Ok(buffer) => buffer,
        Err(e) => panic!("{e}"),
    }
}

/// A fresh vector of `len` copies of `value`, or an out-of-memory error naming `op`.
fn try_filled<T: Element>(op: &'static str, len: usize, value: T) -> Result<Vec<T>> {
    let mut buffer = Vec::new();
    buffer
        .try_reserve_exact(len)
        .map_err(|_| out_of_memory::<T>(op, len))?;
    buffer.resize(len, value);
    Ok(buffer)
}

fn out_of_memory<T>(op: &'static str, len: usize) -> Error {
    Error::OutOfMemory {
        op,
        device: crate::Device::Cpu,
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    }
}

/// [`uninit`], with an error naming `op` instead of an abort when the memory cannot be had
/// (or when `len` elements would not fit in the address space).
pub fn try_uninit<T: Element>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let bytes = len
        .checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| out_of_memory::<T>(op, len))?;
    let Some(class) = class_above(bytes) else {
        return try_filled(op, len, T::ZERO);
    };
    let cached = {
        let mut pools = POOLS.lock();
        let found = T::pool(&mut pools).take(class);
        match &found {
            Some(buffer) => {
                pools.cached_bytes -= buffer.capacity() * std::mem::size_of::<T>();
                pools.counters.hits += 1;
                let address = buffer.as_ptr() as usize;
                pools.lent().insert(address);
            }
            None => pools.counters.misses += 1,
        }
        found
    };
    match cached {
        Some(mut buffer) => {
            // The buffer's capacity covers the class, hence `len`; only a tail beyond its
            // current length needs writing.
            if buffer.len() >= len {
                buffer.truncate(len);
            } else {
                buffer.resize(len, T::ZERO);
            }
            Ok(buffer)
        }
        None => {
            let elements = class_bytes(class).div_ceil(std::mem::size_of::<T>());
            let mut buffer = try_filled(op, elements, T::ZERO)?;
            buffer.truncate(len);
            let address = buffer.as_ptr() as usize;
            POOLS.lock().lent().insert(address);
            Ok(buffer)
        }
    }
}

/// A vector of `len` zeros.
pub fn zeroed<T: Element>(len: usize) -> Vec<T> {
    let mut buffer = uninit::<T>(len);
    buffer.fill(T::ZERO);
    buffer
}

/// [`zeroed`], with an error naming `op` instead of an abort when the memory cannot be had.
pub fn try_zeroed<T: Element>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let mut buffer = try_uninit::<T>(op, len)?;
    buffer.fill(T::ZERO);
    Ok(buffer)
}

/// Hands a buffer back to the cache (or to the system when it is small or the cache is full).
pub fn recycle<T: Element>(buffer: Vec<T>) {
    let bytes = buffer.capacity() * std::mem::size_of::<T>();
    let Some(class) = class_below(bytes) else {
        return;
    };
    // Only buffers this cache handed out are kept, with their capacity unchanged: a vector
    // built elsewhere belongs to a kernel that does not ask the cache, so keeping it would
    // hold memory that no request takes.
    if class_bytes(class).div_ceil(std::mem::size_of::<T>()) != buffer.capacity() {
        return;
    }
    let mut pools = POOLS.lock();
    if !pools.lent().remove(&(buffer.as_ptr() as usize)) {
        return;
    }
    if pools.cached_bytes + bytes > pools.limit {
        return;
    }
    pools.cached_bytes += bytes;
    pools.counters.peak_cached_bytes = pools.counters.peak_cached_bytes.max(pools.cached_bytes);
    T::pool(&mut pools).put(class, buffer);
}

/// Returns every cached buffer to the system.
pub fn empty_cache() {
    POOLS.lock().clear();
}

/// The most bytes the cache keeps.
pub fn cache_limit() -> usize {
    POOLS.lock().limit
}

/// Sets the most bytes the cache keeps; 0 turns caching off. Buffers above the new limit are
/// returned to the system.
pub fn set_cache_limit(bytes: usize) {
    let mut pools = POOLS.lock();
    pools.limit = bytes;
    if pools.cached_bytes > bytes {
        pools.clear();
    }
}

/// The cache's counters.
pub fn stats() -> CacheStats {
    let pools = POOLS.lock();
    CacheStats {
        cached_bytes: pools.cached_bytes,
        ..pools.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        for bytes in [
            MIN_CACHED_BYTES,
            20_000,
            65_536,
            65_537,
            100_000,
            3 << 20,
            12_345_678,
        ] {
            let class = class_above(bytes).unwrap();
            let size = class_bytes(class);
            assert!(size >= bytes, "{bytes} -> {size}");
            assert!(size as f64 <= bytes as f64 * 1.25, "{bytes} -> {size}");
            // A buffer of exactly the class size serves that class.
            assert_eq!(class_below(size), Some(class));
        }
        assert_eq!(class_above(MIN_CACHED_BYTES - 1), None);
    }

    #[test]
    fn a_buffer_of_any_capacity_serves_only_requests_it_can_hold() {
        for capacity in [MIN_CACHED_BYTES, 17_000, 99_999, 1 << 20, (1 << 20) + 1] {
            let class = class_below(capacity).unwrap();
            assert!(class_bytes(class) <= capacity);
            assert!(class_bytes(class + 1) > capacity);
        }
    }

    #[test]
    fn recycled_buffers_are_reused_and_zeroed_on_request() {
        // Other tests run concurrently and share the cache, so only this test's own buffer is
        // followed: a distinctive size class nobody else uses.
        let len = 777_777;
        let mut first = uninit::<u8>(len);
        assert_eq!(first.len(), len);
        first.fill(7);
        let address = first.as_ptr() as usize;
        recycle(first);
        let second = uninit::<u8>(len - 5);
        assert_eq!(second.len(), len - 5);
        if second.as_ptr() as usize == address {
            assert!(second.iter().all(|&v| v == 7), "uninit does not clear");
        }
        recycle(second);
        let third = zeroed::<u8>(len);
        assert!(third.iter().all(|&v| v == 0));
    }

    #[test]
    fn vectors_not_made_by_the_cache_are_not_kept() {
        // A class-sized vector made elsewhere: recycling it must not make it available.
        let bytes = class_bytes(class_above(3_333_333).unwrap());
        let foreign = vec![5u8; bytes];
        let address = foreign.as_ptr() as usize;
        recycle(foreign);
        let class = class_below(bytes).unwrap();
        let pools = POOLS.lock();
        let kept = pools.u8.classes.get(class).into_iter().flatten();
        assert!(kept.into_iter().all(|b| b.as_ptr() as usize != address));
    }

    #[test]
    fn small_buffers_bypass_the_cache() {
        let v = uninit::<f32>(10);
        assert_eq!(v, vec![0.0; 10]);
        recycle(v);
    }
}
