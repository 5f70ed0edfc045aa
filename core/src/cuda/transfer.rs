//! Copies between host and device memory through pinned (page-locked) staging buffers.
//!
//! A copy from pageable host memory makes the driver stage it itself, synchronously. tandem
//! stages instead: the bytes go into a pinned buffer and the device copies from there
//! asynchronously on the stream, so the host thread returns as soon as the bytes are staged
//! and the copy is ordered with the stream's kernels. Large copies go in chunks through
//! several buffers, so staging the next chunk overlaps the transfer of the last one.
//!
//! Staging buffers come from a bounded, size-classed cache that never frees inside a step
//! ([`pinned_cache`](super::pinned_cache): classes, the cap and what happens at it). A buffer
//! whose copy is still in flight carries an event and is not handed out again before that event
//! completes. When no pinned buffer can be had without freeing one, a chunk is copied from or
//! to the caller's pageable memory directly: the driver then stages it itself, synchronously for
//! that copy, which waits for the stream but not for the device. The idle buffers are freed
//! only by [`trim_staging`] (from [`empty_cache`](super::empty_cache)).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaStream};
use parking_lot::Mutex;

use super::device::{driver_err, CudaDevice};
use super::pinned_cache::{
    Completion, PinnedCache, Staging, StagingBuffer, CAP_BYTES, MAX_CLASS_BYTES,
};
use crate::Result;

/// Bytes staged per chunk (the largest staging buffer).
const CHUNK_BYTES: usize = MAX_CLASS_BYTES;

/// A page-locked host buffer from `cuMemHostAlloc`.
struct Pinned {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; the cache hands it to one user at
// a time.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once. A failure leaks it.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

impl StagingBuffer for Pinned {
    fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Completion for CudaEvent {
    fn is_complete(&self) -> bool {
        CudaEvent::is_complete(self)
    }
}

static CACHE: Mutex<PinnedCache<Pinned, CudaEvent>> = Mutex::new(PinnedCache::new(CAP_BYTES));

/// A staging buffer of at least `bytes` (at most [`CHUNK_BYTES`]) that no copy is using, or
/// `None` when the chunk must go through pageable memory.
fn take(device: &CudaDevice, op: &'static str, bytes: usize) -> Result<Option<Pinned>> {
    let staging = CACHE.lock().take(bytes, |capacity| {
        device.bind(op)?;
        // SAFETY: a plain allocation; PORTABLE makes it usable with every context.
        let ptr = unsafe { result::malloc_host(capacity, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver_err(op, device.device()))?;
        Ok(Pinned {
            ptr: ptr.cast(),
            capacity,
        })
    })?;
    match staging {
        Staging::Buffer { buffer, wait_for } => {
            if let Some(copy) = wait_for {
                // The cache is at its cap: wait for the one earlier copy using this buffer (a
                // host wait for that event only, not a device synchronisation).
                if let Err(e) = copy.synchronize() {
                    CACHE.lock().give(buffer, Some(copy));
                    return Err(driver_err(op, device.device())(e));
                }
            }
            Ok(Some(buffer))
        }
        Staging::Pageable => Ok(None),
    }
}

/// Returns a staging buffer to the cache, busy until `busy` completes. Never frees.
fn give(pinned: Pinned, busy: Option<CudaEvent>) {
    CACHE.lock().give(pinned, busy);
}

/// Gives up a staging buffer after a failed copy: the device may still read or write it, so it
/// is neither reused nor freed (it stays counted against the cap). Driver errors that get here
/// leave the context unusable anyway.
fn leak(pinned: Pinned) {
    std::mem::forget(pinned);
}

/// Frees the idle staging buffers whose copies have completed (buffers in use stay). The
/// runtime calls it only where the user asked for memory back ([`empty_cache`](super::empty_cache)),
/// never during a step: freeing pinned memory can synchronise the device.
pub(crate) fn trim_staging() {
    let freed = CACHE.lock().trim();
    drop(freed);
}

/// Copies `src` (host) to device address `dst` on `stream`. Returns once the bytes are staged;
/// the transfer itself runs in stream order.
pub(crate) fn upload(
    device: &Arc<CudaDevice>,
    op: &'static str,
    src: &[u8],
    dst: u64,
    stream: &CudaStream,
) -> Result<()> {
    let err = driver_err(op, device.device());
    if !src.is_empty() {
        super::sanitizer::access(
            device.device(),
            stream,
            "memcpy HtoD",
            &[(dst, super::sanitizer::Use::Write)],
        )?;
    }
    for (i, chunk) in src.chunks(CHUNK_BYTES).enumerate() {
        let at = dst + (i * CHUNK_BYTES) as u64;
        let Some(pinned) = take(device, op, chunk.len())? else {
            device.bind(op)?;
            // SAFETY: `at` lies inside the destination allocation (the caller passes a buffer
            // of at least `src.len()` bytes). From pageable memory the driver stages `chunk`
            // before returning, so the borrow may end with the call.
            unsafe { result::memcpy_htod_async(at, chunk, stream.cu_stream()) }.map_err(&err)?;
            continue;
        };
        // SAFETY: the pinned buffer holds at least `chunk.len()` bytes and is not in use.
        let staged = unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), pinned.ptr, chunk.len());
            std::slice::from_raw_parts(pinned.ptr, chunk.len())
        };
        let copied = device.bind(op).and_then(|()| {
            // SAFETY: `at` lies inside the destination allocation (the caller passes a buffer
            // of at least `src.len()` bytes); the pinned source stays alive and unused until
            // the event recorded after the copy completes.
            unsafe { result::memcpy_htod_async(at, staged, stream.cu_stream()) }.map_err(&err)?;
            let event = stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(&err)?;
            event.record(stream).map_err(&err)?;
            Ok(event)
        });
        match copied {
            Ok(event) => give(pinned, Some(event)),
            Err(e) => {
                leak(pinned);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Copies `dst.len()` bytes from device address `src` into `dst` (host), after the work already
/// issued on `stream`. Blocks until the bytes have arrived.
pub(crate) fn download(
    device: &Arc<CudaDevice>,
    op: &'static str,
    src: u64,
    dst: &mut [u8],
    stream: &CudaStream,
) -> Result<()> {
    super::host_reads::note_copy();
    let err = driver_err(op, device.device());
    if !dst.is_empty() {
        super::sanitizer::access(
            device.device(),
            stream,
            "memcpy DtoH",
            &[(src, super::sanitizer::Use::Read)],
        )?;
    }
    for (i, chunk) in dst.chunks_mut(CHUNK_BYTES).enumerate() {
        let at = src + (i * CHUNK_BYTES) as u64;
        let Some(pinned) = take(device, op, chunk.len())? else {
            device.bind(op)?;
            // SAFETY: `at` lies inside the source allocation (the caller reads at most its
            // size); the stream is synchronised before `chunk` is released.
            unsafe { result::memcpy_dtoh_async(chunk, at, stream.cu_stream()) }.map_err(&err)?;
            super::sanitizer::synchronized(stream, || stream.synchronize()).map_err(&err)?;
            continue;
        };
        // SAFETY: the pinned buffer holds at least `chunk.len()` bytes and is not in use.
        let staging = unsafe { std::slice::from_raw_parts_mut(pinned.ptr, chunk.len()) };
        let copied = device.bind(op).and_then(|()| {
            // SAFETY: `at` lies inside the source allocation (the caller reads at most its
            // size); the stream is synchronised before the staging buffer is read.
            unsafe { result::memcpy_dtoh_async(staging, at, stream.cu_stream()) }.map_err(&err)?;
            super::sanitizer::synchronized(stream, || stream.synchronize()).map_err(&err)
        });
        if let Err(e) = copied {
            leak(pinned);
            return Err(e);
        }
        chunk.copy_from_slice(staging);
        give(pinned, None);
    }
    Ok(())
}
