//! Device memory: stream-ordered allocations from the device's memory pool, freed in stream
//! order, never reused before every stream that used them is done.
//!
//! tandem allocates with `cuMemAllocAsync` on the stream that will first use the memory and
//! frees with `cuMemFreeAsync`. The driver's pool caches freed memory (its release threshold is
//! raised when the device is opened) and hands it to later allocations on the same stream at
//! once — stream order guarantees the earlier user is done — and to other streams only once
//! they are ordered after the free. A buffer that another stream used as well (a gradient
//! bucket read by the communication stream, say) must not be reused before that stream is done
//! with it: [`DeviceBuffer::record_stream`] notes such a stream (PyTorch's `recordStream`), and
//! the drop orders the free after the current work of every stream that used the buffer —
//! except the allocating stream when [`DeviceBuffer::allocating_stream_done`] said where its
//! use ended (a data loader's copy): then after that point only, so that freeing a batch does
//! not wait for the copies of later batches (see `free_order.rs`).
//!
//! [`memory_stats`] reports the bytes in use by tensors now and at most since the last reset,
//! and what the pool holds from the driver.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaStream, DriverError};
use parking_lot::Mutex;

use super::device::{device, driver_err, CudaDevice};
use super::free_order::{plan_free, Wait};
use crate::{Error, Event, Result};

/// Bytes in use by tensors on one device, now and at the most.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    allocated: AtomicUsize,
    peak: AtomicUsize,
}

impl Counters {
    fn add(&self, bytes: usize) {
        let now = self.allocated.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.allocated.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Memory figures of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live tensors and buffers now.
    pub allocated: usize,
    /// The most bytes held at once since the device was opened or [`reset_peak_memory`].
    pub peak_allocated: usize,
    /// Bytes the memory pool holds from the driver (allocated plus cached).
    pub reserved: usize,
    /// The most bytes the pool has held from the driver.
    pub peak_reserved: usize,
}

/// A value the runtime gives a memory-pool attribute: the reuse policies are C `int` flags, the
/// release threshold a `cuuint64_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolValue {
    /// An `int` flag (0 or 1).
    Flag(bool),
    /// A byte count (`cuuint64_t`).
    Bytes(u64),
}

/// The attributes tandem sets on a device's memory pool when it opens the device, in order.
///
/// - **Release threshold: the maximum.** The default (0) returns freed memory to the driver at
///   every synchronisation; tandem's steps allocate the same sizes again and again.
/// - **Internal dependencies: off.** With it on (the driver's default), an allocation may be
///   given memory whose free on *another* stream has not run yet, and the driver makes the
///   allocating stream wait for the freeing stream to get there. Memory freed on the
///   communication stream (NCCL temporaries, SyncBatchNorm sums, compression buffers) would then
///   tie a later compute-stream allocation to every all-reduce queued before that free: backward
///   would wait for communication, the very thing tandem exists to avoid. Off, such memory is
///   reused only under the two rules below, which add no wait.
/// - **Event dependencies: on.** Reuse of memory freed on another stream once the allocating
///   stream is already ordered after the free by an event wait that tandem issued itself (the
///   compute stream waiting on a bucket's all-reduce, say): the dependency exists anyway, so
///   reuse costs nothing.
/// - **Opportunistic reuse: on.** Reuse of memory whose free the device has already executed,
///   with no ordering at all: nothing is pending, so nothing can be waited for. (Which blocks
///   this finds depends on timing, so addresses can differ between runs; values cannot.)
pub(crate) const POOL_SETTINGS: [(sys::CUmemPool_attribute, PoolValue); 4] = {
    use sys::CUmemPool_attribute::*;
    [
        (
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            PoolValue::Bytes(u64::MAX),
        ),
        (
            CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            PoolValue::Flag(false),
        ),
        (
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
            PoolValue::Flag(true),
        ),
        (
            CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
            PoolValue::Flag(true),
        ),
    ]
};

/// Applies [`POOL_SETTINGS`] to `pool` (the context owning it is current).
pub(crate) fn configure_pool(pool: sys::CUmemoryPool) -> std::result::Result<(), DriverError> {
    for (attr, value) in POOL_SETTINGS {
        match value {
            PoolValue::Flag(on) => {
                let mut flag: std::ffi::c_int = on.into();
                // SAFETY: the reuse-policy attributes take a C int, which `flag` is.
                unsafe {
                    result::mem_pool::set_attribute(pool, attr, (&mut flag as *mut i32).cast())
                }?;
            }
            PoolValue::Bytes(bytes) => {
                let mut bytes = bytes;
                // SAFETY: the threshold attribute takes a cuuint64_t, which `bytes` is.
                unsafe {
                    result::mem_pool::set_attribute(pool, attr, (&mut bytes as *mut u64).cast())
                }?;
            }
        }
    }
    Ok(())
}

fn pool_attribute(dev: &CudaDevice, attr: sys::CUmemPool_attribute) -> Result<usize> {
    let mut value: u64 = 0;
    dev.bind("memory_stats")?;
    // SAFETY: the reserved-memory attributes are u64 values.
    unsafe { result::mem_pool::get_attribute(dev.pool(), attr, (&mut value as *mut u64).cast()) }
        .map_err(driver_err("memory_stats", dev.device()))?;
    Ok(value as usize)
}

/// Memory figures of `cuda:ordinal` (benchmarks report them).
pub fn memory_stats(ordinal: usize) -> Result<MemoryStats> {
    let dev = device(ordinal)?;
    use sys::CUmemPool_attribute::*;
    Ok(MemoryStats {
        allocated: dev.memory.allocated.load(Ordering::Relaxed),
        peak_allocated: dev.memory.peak.load(Ordering::Relaxed),
        reserved: pool_attribute(&dev, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        peak_reserved: pool_attribute(&dev, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    })
}

/// Starts a new peak: the peak becomes what is allocated now.
pub fn reset_peak_memory(ordinal: usize) -> Result<()> {
    let dev = device(ordinal)?;
    let now = dev.memory.allocated.load(Ordering::Relaxed);
    dev.memory.peak.store(now, Ordering::Relaxed);
    let mut zero: u64 = 0;
    dev.bind("reset_peak_memory")?;
    // SAFETY: the high-water mark attribute takes a u64 (only 0 is allowed, resetting it).
    unsafe {
        result::mem_pool::set_attribute(
            dev.pool(),
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    }
    .map_err(driver_err("reset_peak_memory", dev.device()))
}

/// Returns the pool's cached memory to the driver (after the device has finished its work),
/// and frees the pinned host buffers that staged copies and are idle now. The one place the
/// runtime frees pinned memory, which can synchronise the device: call it between phases of a
/// program, not inside a training step.
pub fn empty_cache(ordinal: usize) -> Result<()> {
    let dev = device(ordinal)?;
    dev.synchronize()?;
    super::transfer::trim_staging();
    // SAFETY: trimming keeps every live allocation.
    unsafe { result::mem_pool::trim_to(dev.pool(), 0) }
        .map_err(driver_err("empty_cache", dev.device()))
}

/// One allocation of device memory. Dropping it frees the memory in stream order.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    device: Arc<CudaDevice>,
    /// The stream the memory was allocated on (and is freed on, unless others used it).
    stream: Arc<CudaStream>,
    /// Other streams that used the memory.
    used_on: Mutex<Vec<Arc<CudaStream>>>,
    /// Where the allocating stream's use of the memory ended, when known.
    allocation_done: Mutex<Option<Event>>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({} bytes at {:#x} on {})",
            self.bytes,
            self.ptr,
            self.device.device()
        )
    }
}

impl DeviceBuffer {
    /// `bytes` of uninitialised memory on `device`, ordered on `stream`. Zero bytes allocate
    /// nothing (the address is 0).
    pub fn alloc(
        op: &'static str,
        device: &Arc<CudaDevice>,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Self> {
        let ptr = if bytes == 0 {
            0
        } else {
            device.bind(op)?;
            // SAFETY: `stream` belongs to this device's context, which is current.
            unsafe { result::malloc_async(stream.cu_stream(), bytes) }.map_err(|e| {
                if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                    Error::OutOfMemory {
                        op,
                        device: device.device(),
                        bytes,
                    }
                } else {
                    driver_err(op, device.device())(e)
                }
            })?
        };
        device.memory.add(bytes);
        super::sanitizer::allocated(ptr, bytes, op, stream);
        Ok(DeviceBuffer {
            ptr,
            bytes,
            device: device.clone(),
            stream: stream.clone(),
            used_on: Mutex::new(Vec::new()),
            allocation_done: Mutex::new(None),
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device holding the memory.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Notes that work on `stream` uses this memory, so that its free waits for that work
    /// (`recordStream`). The allocating stream needs no note, but a note for it withdraws
    /// [`DeviceBuffer::allocating_stream_done`]: it uses the memory again.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        if Arc::ptr_eq(stream, &self.stream) || stream.cu_stream() == self.stream.cu_stream() {
            self.allocation_done.lock().take();
            return;
        }
        let mut used = self.used_on.lock();
        if !used.iter().any(|s| s.cu_stream() == stream.cu_stream()) {
            used.push(stream.clone());
        }
    }

    /// Says that the allocating stream's use of the memory ends at `done`, an event recorded
    /// on it right after its last use (the copy that filled a batch, say), so that the free,
    /// issued on another stream that used the memory, waits for that point only and not for
    /// whatever the allocating stream runs by then. Ignored for an event of another device and
    /// for a host event.
    pub fn allocating_stream_done(&self, done: Event) {
        if done.device() == self.device.device() && done.cuda_event().is_some() {
            *self.allocation_done.lock() = Some(done);
        }
    }

    fn free(&mut self) -> std::result::Result<(), DriverError> {
        self.device.context().bind_to_thread()?;
        let used = std::mem::take(&mut *self.used_on.lock());
        let done = self.allocation_done.lock().take();
        let plan = plan_free(&self.stream, done.as_ref(), &used);
        for wait in &plan.waits {
            match wait {
                Wait::Tail(other) => {
                    let event = self
                        .device
                        .context()
                        .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
                    event.record(other)?;
                    plan.free_on.wait(&event)?;
                    super::sanitizer::stream_waited_for_stream(&plan.free_on, other);
                }
                Wait::Event(done) => {
                    if let Some(event) = done.cuda_event() {
                        plan.free_on.wait(event)?;
                        super::sanitizer::stream_waited(&plan.free_on, event);
                    }
                }
            }
        }
        super::sanitizer::freed(self.device.device(), self.ptr, &plan.free_on);
        // SAFETY: `free_on` is ordered after every use of the memory: its own by stream order,
        // every other stream's through the waits above.
        unsafe { result::free_async(self.ptr, plan.free_on.cu_stream()) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // A free that fails leaves the memory to the pool until the process ends; the
            // context keeps the error, and the next call on the device reports it.
            if let Err(e) = self.free() {
                self.device.context().record_err::<()>(Err(e));
            }
        }
        self.device.memory.sub(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::CUmemPool_attribute::*;

    fn setting(attr: sys::CUmemPool_attribute) -> Option<PoolValue> {
        POOL_SETTINGS
            .iter()
            .find(|(a, _)| *a == attr)
            .map(|&(_, value)| value)
    }

    #[test]
    fn the_pool_never_makes_one_stream_wait_for_another_to_reuse_memory() {
        assert_eq!(
            setting(CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES),
            Some(PoolValue::Flag(false)),
            "memory freed on the comm stream must not tie compute-stream allocations to it"
        );
        // The reuse that adds no wait stays on.
        assert_eq!(
            setting(CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES),
            Some(PoolValue::Flag(true))
        );
        assert_eq!(
            setting(CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC),
            Some(PoolValue::Flag(true))
        );
    }

    #[test]
    fn the_pool_keeps_freed_memory_and_sets_each_attribute_once() {
        assert_eq!(
            setting(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD),
            Some(PoolValue::Bytes(u64::MAX))
        );
        for (i, (a, _)) in POOL_SETTINGS.iter().enumerate() {
            assert!(
                POOL_SETTINGS[i + 1..].iter().all(|(b, _)| b != a),
                "{a:?} is set twice"
            );
        }
    }
}
