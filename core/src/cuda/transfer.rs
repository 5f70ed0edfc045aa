//! Copies between host and device memory through pinned (page-locked) staging buffers.
//!
//! A copy from pageable host memory makes the driver stage it itself, synchronously. tandem
//! stages instead: the bytes go into a pinned buffer and the device copies from there
//! asynchronously on the stream, so the host thread returns as soon as the bytes are staged
//! and the copy is ordered with the stream's kernels. Large copies go in chunks through
//! several buffers, so staging the next chunk overlaps the transfer of the last one.
//!
//! Staging buffers are kept in a small process-wide pool (pinned memory is expensive to
//! allocate). A buffer whose copy is still in flight carries an event and is not handed out
//! again before that event completes.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaStream};
use parking_lot::Mutex;

use super::device::{driver_err, CudaDevice};
use crate::Result;

/// Bytes staged per chunk (and the largest staging buffer).
const CHUNK_BYTES: usize = 8 << 20;
/// The smallest staging buffer.
const MIN_STAGING_BYTES: usize = 64 << 10;
/// Idle staging buffers kept for reuse.
const MAX_POOLED: usize = 8;

/// A page-locked host buffer from `cuMemHostAlloc`.
struct Pinned {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; the pool hands it to one user at
// a time.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once. A failure leaks it.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

struct Staged {
    pinned: Pinned,
    /// The copy still reading the buffer, if any.
    busy: Option<CudaEvent>,
}

static POOL: Mutex<Vec<Staged>> = Mutex::new(Vec::new());

/// A staging buffer of at least `bytes` (at most [`CHUNK_BYTES`]) that no copy is using.
fn take(device: &CudaDevice, op: &'static str, bytes: usize) -> Result<Pinned> {
    let reusable = {
        let mut pool = POOL.lock();
        let found = pool.iter().position(|s| {
            s.pinned.capacity >= bytes && s.busy.as_ref().is_none_or(CudaEvent::is_complete)
        });
        found.map(|i| pool.swap_remove(i))
    };
    if let Some(staged) = reusable {
        return Ok(staged.pinned);
    }
    let capacity = bytes
        .next_power_of_two()
        .clamp(MIN_STAGING_BYTES, CHUNK_BYTES.max(bytes));
    device.bind(op)?;
    // SAFETY: a plain allocation; PORTABLE makes it usable with every context.
    let ptr = unsafe { result::malloc_host(capacity, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(driver_err(op, device.device()))?;
    Ok(Pinned {
        ptr: ptr.cast(),
        capacity,
    })
}

/// Returns a staging buffer to the pool, busy until `busy` completes.
fn give(pinned: Pinned, busy: Option<CudaEvent>) {
    let mut pool = POOL.lock();
    if pool.len() < MAX_POOLED {
        pool.push(Staged { pinned, busy });
    } else if let Some(event) = busy {
        // No room: the buffer may only be freed once its copy is done.
        drop(pool);
        let _ = event.synchronize();
    }
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
    for (i, chunk) in src.chunks(CHUNK_BYTES).enumerate() {
        let pinned = take(device, op, chunk.len())?;
        // SAFETY: the pinned buffer holds at least `chunk.len()` bytes and is not in use.
        let staged = unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), pinned.ptr, chunk.len());
            std::slice::from_raw_parts(pinned.ptr, chunk.len())
        };
        device.bind(op)?;
        // SAFETY: `dst + offset` lies inside the destination allocation (the caller passes a
        // buffer of at least `src.len()` bytes); the pinned source stays alive and unused until
        // the event recorded after the copy completes.
        unsafe {
            result::memcpy_htod_async(dst + (i * CHUNK_BYTES) as u64, staged, stream.cu_stream())
        }
        .map_err(&err)?;
        let event = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(&err)?;
        event.record(stream).map_err(&err)?;
        give(pinned, Some(event));
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
    for (i, chunk) in dst.chunks_mut(CHUNK_BYTES).enumerate() {
        let pinned = take(device, op, chunk.len())?;
        // SAFETY: the pinned buffer holds at least `chunk.len()` bytes and is not in use.
        let staging = unsafe { std::slice::from_raw_parts_mut(pinned.ptr, chunk.len()) };
        device.bind(op)?;
        // SAFETY: `src + offset` lies inside the source allocation (the caller reads at most
        // its size); the stream is synchronised before the staging buffer is read.
        unsafe {
            result::memcpy_dtoh_async(staging, src + (i * CHUNK_BYTES) as u64, stream.cu_stream())
        }
        .map_err(&err)?;
        stream.synchronize().map_err(&err)?;
        chunk.copy_from_slice(staging);
        give(pinned, None);
    }
    Ok(())
}
