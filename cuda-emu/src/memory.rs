//! Device memory as host memory with teeth: guards, poison, quarantine, range checks; the
//! default memory pool; copies and memsets; pinned host memory.

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use parking_lot::Mutex;
use sys::cudaError_enum as E;

use crate::context::{current, TOTAL_MEMORY};
use crate::counters::{count, count_bytes, host_sync, Counter};
use crate::stream::{lookup, Stream};
use crate::{entry, fault, initialised, put, say, sticky, CUresult, Res};

/// Bytes of guard before and after every allocation (also its alignment).
pub const GUARD: usize = 256;
/// The guard bytes' value.
pub const GUARD_BYTE: u8 = 0xFD;
/// What fresh and freed memory is filled with: all ones, a NaN in every float format.
pub const POISON: u8 = 0xFF;
/// Freed blocks are kept (poisoned) until the quarantine holds more than this.
const QUARANTINE_BYTES: usize = 256 << 20;
/// … or more than this many blocks.
const QUARANTINE_BLOCKS: usize = 4096;

/// One device allocation.
struct Block {
    base: usize,
    layout: Layout,
    /// The address handed out.
    ptr: u64,
    size: usize,
    /// A number naming the allocation in messages.
    id: u64,
    /// Who allocated it ("cuMemAllocAsync on stream 3").
    origin: String,
    /// From the pool (`cuMemAllocAsync`) rather than `cuMemAlloc`.
    pooled: bool,
    /// A free was issued (its stream has not reached it yet).
    freeing: bool,
    /// Who freed it, once freed.
    freed_by: String,
    /// Damage to its guards was reported already (once is enough).
    reported: bool,
}

// SAFETY: a Block owns its host memory; the raw address is only dereferenced under the
// allocator's rules (live or quarantined blocks).
unsafe impl Send for Block {}

impl Block {
    fn describe(&self) -> String {
        format!(
            "allocation #{} of {} bytes at {:#x} ({})",
            self.id, self.size, self.ptr, self.origin
        )
    }

    fn bytes(&self, start: usize, len: usize) -> &[u8] {
        // SAFETY: the block owns `layout.size()` bytes from `base`; callers stay inside.
        unsafe { std::slice::from_raw_parts((self.base + start) as *const u8, len) }
    }

    /// A description of the damage to the guards, if any.
    fn check_guards(&self) -> Option<String> {
        let head = self.bytes(0, GUARD);
        let tail_start = GUARD + self.size;
        let tail = self.bytes(tail_start, self.layout.size() - tail_start);
        let before = head.iter().filter(|&&b| b != GUARD_BYTE).count();
        let after = tail.iter().filter(|&&b| b != GUARD_BYTE).count();
        if before == 0 && after == 0 {
            return None;
        }
        let mut what = Vec::new();
        if before > 0 {
            let first = head.iter().position(|&b| b != GUARD_BYTE).unwrap_or(0);
            what.push(format!(
                "{before} byte(s) before its start were overwritten (the first at offset -{})",
                GUARD - first
            ));
        }
        if after > 0 {
            let first = tail.iter().position(|&b| b != GUARD_BYTE).unwrap_or(0);
            what.push(format!(
                "{after} byte(s) after its end were overwritten (the first at offset +{})",
                self.size + first
            ));
        }
        Some(format!("{}: {}", self.describe(), what.join("; ")))
    }

    fn repair_guards(&self) {
        let tail_start = GUARD + self.size;
        // SAFETY: the guards are the block's own bytes outside [GUARD, GUARD + size).
        unsafe {
            std::ptr::write_bytes(self.base as *mut u8, GUARD_BYTE, GUARD);
            std::ptr::write_bytes(
                (self.base + tail_start) as *mut u8,
                GUARD_BYTE,
                self.layout.size() - tail_start,
            );
        }
    }

    fn fill(&self, value: u8) {
        // SAFETY: the block's user bytes are [base + GUARD, base + GUARD + size).
        unsafe { std::ptr::write_bytes((self.base + GUARD) as *mut u8, value, self.size) };
    }
}

#[derive(Default)]
struct Heap {
    /// Live allocations by address.
    live: BTreeMap<u64, Block>,
    /// Freed blocks, oldest first.
    quarantine: VecDeque<Block>,
    quarantined_bytes: usize,
    /// Bytes of live allocations (all kinds).
    live_bytes: usize,
    /// The default pool's counters.
    pool: PoolCounters,
}

#[derive(Default)]
struct PoolCounters {
    used: u64,
    used_high: u64,
    /// Freed pool memory the pool keeps (below the release threshold).
    cached: u64,
    reserved_high: u64,
    release_threshold: u64,
}

impl PoolCounters {
    fn reserved(&self) -> u64 {
        self.used + self.cached
    }

    fn note_high(&mut self) {
        self.used_high = self.used_high.max(self.used);
        self.reserved_high = self.reserved_high.max(self.reserved());
    }
}

static HEAP: Mutex<Option<Heap>> = Mutex::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn with_heap<T>(f: impl FnOnce(&mut Heap) -> T) -> T {
    let mut guard = HEAP.lock();
    f(guard.get_or_insert_with(Heap::default))
}

/// Allocates `size` bytes, poisoned, between guards.
fn allocate(size: usize, origin: String, pooled: bool) -> Result<u64, CUresult> {
    if size == 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let rounded = size
        .checked_add(GUARD - 1)
        .ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?
        / GUARD
        * GUARD;
    let total = rounded
        .checked_add(2 * GUARD)
        .ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
    if with_heap(|h| h.live_bytes + size > TOTAL_MEMORY) {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    let layout = Layout::from_size_align(total, GUARD).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: the layout has a non-zero size.
    let base = unsafe { std::alloc::alloc(layout) } as usize;
    if base == 0 {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: `base` owns `total` bytes.
    unsafe {
        std::ptr::write_bytes(base as *mut u8, GUARD_BYTE, total);
        std::ptr::write_bytes((base + GUARD) as *mut u8, POISON, size);
    }
    let ptr = (base + GUARD) as u64;
    let block = Block {
        base,
        layout,
        ptr,
        size,
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        origin,
        pooled,
        freeing: false,
        freed_by: String::new(),
        reported: false,
    };
    with_heap(|h| {
        h.live_bytes += size;
        if pooled {
            if h.pool.cached < size as u64 {
                count(Counter::pool_misses); // the pool reserves more from the device
            }
            h.pool.used += size as u64;
            // Reuse what the pool cached before asking for more.
            h.pool.cached = h.pool.cached.saturating_sub(size as u64);
            h.pool.note_high();
        }
        h.live.insert(ptr, block);
    });
    Ok(ptr)
}

/// Marks `ptr` as being freed (so a second free is caught at the call), or explains why not.
fn begin_free(ptr: u64, what: &str) -> Res {
    with_heap(|h| match h.live.get_mut(&ptr) {
        Some(b) if b.freeing => {
            fault(
                E::CUDA_ERROR_INVALID_VALUE,
                format!("{what}: double free of {}", b.describe()),
                false,
            );
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
        Some(b) => {
            b.freeing = true;
            Ok(())
        }
        None => {
            let hint = h
                .quarantine
                .iter()
                .find(|b| b.ptr == ptr)
                .map(|b| {
                    format!(
                        ": double free of {} (freed by {})",
                        b.describe(),
                        b.freed_by
                    )
                })
                .unwrap_or_else(|| ": not the start of a live allocation".to_string());
            fault(
                E::CUDA_ERROR_INVALID_VALUE,
                format!("{what}({ptr:#x}){hint}"),
                false,
            );
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

/// Frees a block now: checks its guards, poisons it and moves it to quarantine.
fn finish_free(ptr: u64, freed_by: String) {
    let evicted = with_heap(|h| {
        let Some(mut block) = h.live.remove(&ptr) else {
            return Vec::new();
        };
        match block.check_guards() {
            Some(damage) if !block.reported => fault(
                E::CUDA_ERROR_ILLEGAL_ADDRESS,
                format!("guard bytes damaged, found when {freed_by} freed it: {damage}"),
                true,
            ),
            // Reported once; repaired so that the quarantine check does not report it again.
            _ => {}
        }
        block.repair_guards();
        block.fill(POISON);
        block.freed_by = freed_by;
        h.live_bytes -= block.size;
        if block.pooled {
            h.pool.used -= block.size as u64;
            h.pool.cached += block.size as u64;
        }
        h.quarantined_bytes += block.size;
        h.quarantine.push_back(block);
        let mut evicted = Vec::new();
        while h.quarantined_bytes > QUARANTINE_BYTES || h.quarantine.len() > QUARANTINE_BLOCKS {
            let Some(old) = h.quarantine.pop_front() else {
                break;
            };
            h.quarantined_bytes -= old.size;
            evicted.push(old);
        }
        evicted
    });
    for block in evicted {
        release(block);
    }
}

/// Returns a quarantined block to the host allocator, after checking it was not written since
/// its free.
fn release(block: Block) {
    if let Some(message) = quarantine_damage(&block) {
        fault(E::CUDA_ERROR_ILLEGAL_ADDRESS, message, true);
    }
    // SAFETY: `base` came from std::alloc::alloc with this layout and is freed once.
    unsafe { std::alloc::dealloc(block.base as *mut u8, block.layout) };
}

/// Checks the guards of every live allocation (at synchronisations).
pub fn check_all_guards() {
    let damaged: Vec<String> = with_heap(|h| {
        h.live
            .values_mut()
            .filter(|b| !b.reported)
            .filter_map(|b| {
                let damage = b.check_guards()?;
                b.reported = true;
                Some(damage)
            })
            .collect()
    });
    for damage in damaged {
        fault(
            E::CUDA_ERROR_ILLEGAL_ADDRESS,
            format!("guard bytes damaged, found at a synchronisation: {damage}"),
            true,
        );
    }
}

/// Lets the pool keep at most its release threshold (the driver trims at synchronisations).
pub fn apply_release_threshold() {
    with_heap(|h| {
        let keep = h.pool.release_threshold.saturating_sub(h.pool.used);
        h.pool.cached = h.pool.cached.min(keep);
    });
}

/// Checks that `[ptr, ptr + len)` lies inside one live device allocation.
fn device_range(ptr: u64, len: usize, what: &str) -> Res {
    if len == 0 {
        return Ok(());
    }
    let found = with_heap(|h| {
        h.live
            .range(..=ptr)
            .next_back()
            .map(|(_, b)| (b.ptr, b.size, b.describe()))
    });
    match found {
        Some((start, size, _)) if ptr + len as u64 <= start + size as u64 => Ok(()),
        Some((start, size, name)) if ptr < start + size as u64 => {
            fault(
                E::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "{what}: {len} bytes at {ptr:#x} run past the end of {name} by {} bytes",
                    ptr + len as u64 - (start + size as u64)
                ),
                false,
            );
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
        _ => {
            fault(
                E::CUDA_ERROR_INVALID_VALUE,
                format!("{what}: {ptr:#x} is not in a live device allocation ({len} bytes)"),
                false,
            );
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    }
}

/// Pinned host allocations: address → size.
static PINNED: Mutex<BTreeMap<u64, usize>> = Mutex::new(BTreeMap::new());

/// Whether `[ptr, ptr + len)` lies inside pinned host memory.
fn pinned(ptr: u64, len: usize) -> bool {
    PINNED
        .lock()
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&start, &size)| ptr + len as u64 <= start + size as u64)
}

/// A raw address moved to a stream's worker.
#[derive(Clone, Copy)]
struct Addr(u64);

fn stream_name(s: &Stream) -> String {
    if s.id == 0 {
        "the legacy default stream".to_string()
    } else {
        format!("stream {}", s.id)
    }
}

// ---- Allocation entry points ------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, size: usize) -> CUresult {
    entry("cuMemAlloc_v2", || {
        current()?;
        let ptr = allocate(size, "cuMemAlloc".to_string(), false)?;
        count(Counter::driver_allocations);
        // SAFETY: out-parameter.
        unsafe { put(out, ptr) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    entry("cuMemFree_v2", || {
        current()?;
        begin_free(ptr, "cuMemFree")?;
        host_sync(Counter::blocking_frees, "cuMemFree");
        // cuMemFree synchronises with the device before it returns the memory.
        crate::stream::synchronize_all()?;
        finish_free(ptr, "cuMemFree".to_string());
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    out: *mut u64,
    size: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemAllocAsync", || {
        current()?;
        let stream = lookup(stream)?;
        sticky()?;
        count(Counter::pool_allocations);
        let ptr = allocate(
            size,
            format!("cuMemAllocAsync on {}", stream_name(&stream)),
            true,
        )?;
        // SAFETY: out-parameter.
        unsafe { put(out, ptr) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    out: *mut u64,
    size: usize,
    pool: sys::CUmemoryPool,
    stream: sys::CUstream,
) -> CUresult {
    if pool != default_pool() {
        say("cuMemAllocFromPoolAsync: only the default pool is emulated");
        return E::CUDA_ERROR_NOT_SUPPORTED;
    }
    // SAFETY: forwarded.
    unsafe { cuMemAllocAsync(out, size, stream) }
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: u64, stream: sys::CUstream) -> CUresult {
    entry("cuMemFreeAsync", || {
        current()?;
        let stream = lookup(stream)?;
        begin_free(ptr, "cuMemFreeAsync")?;
        count(Counter::pool_frees);
        let by = format!("cuMemFreeAsync on {}", stream_name(&stream));
        // The free takes effect when the stream gets there; until then the memory is in use.
        stream.enqueue(Box::new(move || finish_free(ptr, by)));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry("cuMemGetInfo_v2", || {
        current()?;
        let used = with_heap(|h| h.live_bytes + h.pool.cached as usize);
        // SAFETY: out-parameters.
        unsafe {
            put(free, TOTAL_MEMORY.saturating_sub(used))?;
            put(total, TOTAL_MEMORY)
        }
    })
}

// ---- The default pool --------------------------------------------------------------------

/// The default pool's handle (a fixed address; there is one pool).
static POOL_TAG: u8 = 0;

fn default_pool() -> sys::CUmemoryPool {
    &POOL_TAG as *const u8 as sys::CUmemoryPool
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    out: *mut sys::CUmemoryPool,
    dev: i32,
) -> CUresult {
    entry("cuDeviceGetDefaultMemPool", || {
        initialised()?;
        if dev != 0 {
            return Err(E::CUDA_ERROR_INVALID_DEVICE);
        }
        // SAFETY: out-parameter.
        unsafe { put(out, default_pool()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(out: *mut sys::CUmemoryPool, dev: i32) -> CUresult {
    // SAFETY: forwarded: the current pool is always the default one.
    unsafe { cuDeviceGetDefaultMemPool(out, dev) }
}

use sys::CUmemPool_attribute as P;

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: sys::CUmemoryPool,
    attr: u32,
    value: *mut c_void,
) -> CUresult {
    entry("cuMemPoolGetAttribute", || {
        initialised()?;
        if pool != default_pool() || value.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let v64 = with_heap(|h| {
            let p = &h.pool;
            Some(match attr {
                a if a == P::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as u32 => p.release_threshold,
                a if a == P::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as u32 => p.reserved(),
                a if a == P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH as u32 => p.reserved_high,
                a if a == P::CU_MEMPOOL_ATTR_USED_MEM_CURRENT as u32 => p.used,
                a if a == P::CU_MEMPOOL_ATTR_USED_MEM_HIGH as u32 => p.used_high,
                _ => return None,
            })
        });
        match v64 {
            // SAFETY: these attributes are u64 values (cuuint64_t).
            Some(v) => unsafe { put(value.cast::<u64>(), v) },
            None if attr >= P::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES as u32
                && attr <= P::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES as u32 =>
            {
                // SAFETY: the reuse policies are ints; all are on by default.
                unsafe { put(value.cast::<i32>(), 1) }
            }
            None => {
                say(&format!(
                    "cuMemPoolGetAttribute: attribute {attr} is not emulated"
                ));
                Err(E::CUDA_ERROR_NOT_SUPPORTED)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: sys::CUmemoryPool,
    attr: u32,
    value: *mut c_void,
) -> CUresult {
    entry("cuMemPoolSetAttribute", || {
        initialised()?;
        if pool != default_pool() || value.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if attr == P::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD as u32 {
            // SAFETY: a u64 (cuuint64_t) per the driver's documentation.
            let v = unsafe { *value.cast::<u64>() };
            with_heap(|h| h.pool.release_threshold = v);
            return Ok(());
        }
        if attr == P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH as u32
            || attr == P::CU_MEMPOOL_ATTR_USED_MEM_HIGH as u32
        {
            // SAFETY: a u64; only 0 (reset) is allowed.
            if unsafe { *value.cast::<u64>() } != 0 {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            with_heap(|h| {
                if attr == P::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH as u32 {
                    h.pool.reserved_high = h.pool.reserved();
                } else {
                    h.pool.used_high = h.pool.used;
                }
            });
            return Ok(());
        }
        if attr >= P::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES as u32
            && attr <= P::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES as u32
        {
            // Accepted: the emulator never reuses a block early, whatever the policy.
            return Ok(());
        }
        say(&format!(
            "cuMemPoolSetAttribute: attribute {attr} is not emulated"
        ));
        Err(E::CUDA_ERROR_NOT_SUPPORTED)
    })
}

#[no_mangle]
pub extern "C" fn cuMemPoolTrimTo(pool: sys::CUmemoryPool, min_bytes: usize) -> CUresult {
    entry("cuMemPoolTrimTo", || {
        initialised()?;
        if pool != default_pool() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        with_heap(|h| {
            let keep = (min_bytes as u64).saturating_sub(h.pool.used);
            h.pool.cached = h.pool.cached.min(keep);
        });
        Ok(())
    })
}

// ---- Copies and memsets ---------------------------------------------------------------------

/// Enqueues a copy of `len` bytes on `stream` (both ranges already checked).
fn enqueue_copy(stream: &Arc<Stream>, dst: Addr, src: Addr, len: usize) -> u64 {
    stream.enqueue(Box::new(move || {
        let (dst, src) = (dst, src);
        // SAFETY: both ranges were checked at the call (device ranges inside live allocations,
        // host ranges the caller's); freed device memory stays mapped in quarantine, so a copy
        // racing with a free reads or writes poison, as on a GPU, instead of crashing.
        unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, len) }
    }))
}

fn htod(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: &Arc<Stream>,
    what: &str,
) -> Result<u64, CUresult> {
    current()?;
    sticky()?;
    device_range(dst, len, what)?;
    count_bytes(Counter::copies_htod, Counter::bytes_htod, len);
    if len == 0 {
        return Ok(stream.tail());
    }
    if src.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    if pinned(src as u64, len) {
        // DMA from pinned memory reads it when the stream gets there.
        Ok(enqueue_copy(stream, Addr(dst), Addr(src as u64), len))
    } else {
        // From pageable memory the driver stages the bytes before it returns.
        // SAFETY: the caller passes `len` readable bytes at `src`.
        let staged = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) }.to_vec();
        let dst = Addr(dst);
        Ok(stream.enqueue(Box::new(move || {
            let dst = dst;
            // SAFETY: the destination range was checked at the call.
            unsafe {
                std::ptr::copy_nonoverlapping(staged.as_ptr(), dst.0 as *mut u8, staged.len())
            }
        })))
    }
}

fn dtoh(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: &Arc<Stream>,
    what: &str,
) -> Result<bool, CUresult> {
    current()?;
    sticky()?;
    device_range(src, len, what)?;
    count_bytes(Counter::copies_dtoh, Counter::bytes_dtoh, len);
    if len == 0 {
        return Ok(false);
    }
    if dst.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let seq = enqueue_copy(stream, Addr(dst as u64), Addr(src), len);
    // To pageable memory the copy is complete when the call returns.
    let must_wait = !pinned(dst as u64, len);
    if must_wait {
        host_sync(Counter::blocking_copies, what);
        stream.wait_for(seq);
    }
    Ok(must_wait)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemcpyHtoDAsync_v2", || {
        htod(dst, src, len, &lookup(stream)?, "cuMemcpyHtoDAsync").map(|_| ())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> CUresult {
    entry("cuMemcpyHtoD_v2", || {
        let legacy = crate::stream::legacy().clone();
        let seq = htod(dst, src, len, &legacy, "cuMemcpyHtoD")?;
        host_sync(Counter::blocking_copies, "cuMemcpyHtoD");
        legacy.wait_for(seq);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemcpyDtoHAsync_v2", || {
        if dtoh(dst, src, len, &lookup(stream)?, "cuMemcpyDtoHAsync")? {
            sticky()?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> CUresult {
    entry("cuMemcpyDtoH_v2", || {
        let legacy = crate::stream::legacy().clone();
        if !dtoh(dst, src, len, &legacy, "cuMemcpyDtoH")? {
            host_sync(Counter::blocking_copies, "cuMemcpyDtoH"); // into pinned memory
        }
        legacy.drain();
        sticky()
    })
}

fn dtod(dst: u64, src: u64, len: usize, stream: &Arc<Stream>, what: &str) -> Result<u64, CUresult> {
    current()?;
    sticky()?;
    device_range(dst, len, what)?;
    device_range(src, len, what)?;
    count_bytes(Counter::copies_dtod, Counter::bytes_dtod, len);
    Ok(enqueue_copy(stream, Addr(dst), Addr(src), len))
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    len: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemcpyDtoDAsync_v2", || {
        dtod(dst, src, len, &lookup(stream)?, "cuMemcpyDtoDAsync").map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> CUresult {
    entry("cuMemcpyDtoD_v2", || {
        let legacy = crate::stream::legacy().clone();
        let seq = dtod(dst, src, len, &legacy, "cuMemcpyDtoD")?;
        host_sync(Counter::blocking_copies, "cuMemcpyDtoD");
        legacy.wait_for(seq);
        sticky()
    })
}

/// Enqueues a memset of `count` elements of `width` bytes each, all `value`.
fn memset(
    dst: u64,
    value: u32,
    width: usize,
    count: usize,
    stream: &Arc<Stream>,
    what: &str,
) -> Result<u64, CUresult> {
    current()?;
    sticky()?;
    if !dst.is_multiple_of(width as u64) {
        say(&format!("{what}: {dst:#x} is not aligned to {width} bytes"));
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let len = count
        .checked_mul(width)
        .ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
    device_range(dst, len, what)?;
    count_bytes(Counter::memsets, Counter::bytes_memset, len);
    let dst = Addr(dst);
    Ok(stream.enqueue(Box::new(move || {
        let dst = dst;
        let bytes = value.to_le_bytes();
        // SAFETY: the range was checked at the call; see enqueue_copy about frees.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.0 as *mut u8, len) };
        for chunk in out.chunks_exact_mut(width) {
            chunk.copy_from_slice(&bytes[..width]);
        }
    })))
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(
    dst: u64,
    value: u8,
    count: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemsetD8Async", || {
        memset(
            dst,
            value as u32,
            1,
            count,
            &lookup(stream)?,
            "cuMemsetD8Async",
        )
        .map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD16Async(
    dst: u64,
    value: u16,
    count: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemsetD16Async", || {
        memset(
            dst,
            value as u32,
            2,
            count,
            &lookup(stream)?,
            "cuMemsetD16Async",
        )
        .map(|_| ())
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32Async(
    dst: u64,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> CUresult {
    entry("cuMemsetD32Async", || {
        memset(dst, value, 4, count, &lookup(stream)?, "cuMemsetD32Async").map(|_| ())
    })
}

fn memset_sync(dst: u64, value: u32, width: usize, count: usize, what: &str) -> Res {
    let legacy = crate::stream::legacy().clone();
    let seq = memset(dst, value, width, count, &legacy, what)?;
    host_sync(Counter::blocking_copies, what);
    legacy.wait_for(seq);
    sticky()
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, count: usize) -> CUresult {
    entry("cuMemsetD8_v2", || {
        memset_sync(dst, value as u32, 1, count, "cuMemsetD8")
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD16_v2(dst: u64, value: u16, count: usize) -> CUresult {
    entry("cuMemsetD16_v2", || {
        memset_sync(dst, value as u32, 2, count, "cuMemsetD16")
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(dst: u64, value: u32, count: usize) -> CUresult {
    entry("cuMemsetD32_v2", || {
        memset_sync(dst, value, 4, count, "cuMemsetD32")
    })
}

// ---- Pinned host memory ------------------------------------------------------------------

const PAGE: usize = 4096;

fn host_alloc(out: *mut *mut c_void, size: usize) -> Res {
    current()?;
    if size == 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let layout = Layout::from_size_align(size, PAGE).map_err(|_| E::CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: non-zero size.
    let ptr = unsafe { std::alloc::alloc(layout) };
    if ptr.is_null() {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: `ptr` owns `size` bytes; poisoned so that reading before writing shows.
    unsafe { std::ptr::write_bytes(ptr, POISON, size) };
    PINNED.lock().insert(ptr as u64, size);
    count(Counter::pinned_allocations);
    // SAFETY: out-parameter.
    unsafe { put(out, ptr.cast()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    out: *mut *mut c_void,
    size: usize,
    flags: u32,
) -> CUresult {
    entry("cuMemHostAlloc", || {
        if flags & !0x7 != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        host_alloc(out, size)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, size: usize) -> CUresult {
    entry("cuMemAllocHost_v2", || host_alloc(out, size))
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CUresult {
    entry("cuMemFreeHost", || {
        current()?;
        let size = PINNED.lock().remove(&(ptr as u64)).ok_or_else(|| {
            fault(
                E::CUDA_ERROR_INVALID_VALUE,
                format!(
                    "cuMemFreeHost({:#x}): not pinned memory from cuMemHostAlloc",
                    ptr as u64
                ),
                false,
            );
            E::CUDA_ERROR_INVALID_VALUE
        })?;
        // Copies in flight may still use it: wait for the device, as the driver does.
        host_sync(Counter::blocking_frees, "cuMemFreeHost");
        crate::stream::synchronize_all()?;
        // SAFETY: `ptr` came from host_alloc with this size and page alignment.
        unsafe {
            std::ptr::write_bytes(ptr.cast::<u8>(), POISON, size);
            std::alloc::dealloc(ptr.cast(), Layout::from_size_align_unchecked(size, PAGE));
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut u64,
    host: *mut c_void,
    flags: u32,
) -> CUresult {
    entry("cuMemHostGetDevicePointer_v2", || {
        current()?;
        if flags != 0 || !pinned(host as u64, 1) {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // Unified addressing: the device sees pinned memory at its host address.
        // SAFETY: out-parameter.
        unsafe { put(out, host as u64) }
    })
}

/// Describes the first change to a freed block since its free, if any.
fn quarantine_damage(block: &Block) -> Option<String> {
    let user = block.bytes(GUARD, block.size);
    if let Some(offset) = user.iter().position(|&b| b != POISON) {
        return Some(format!(
            "use after free: {} was written after {} freed it (the first changed byte at \
             offset {offset})",
            block.describe(),
            block.freed_by
        ));
    }
    block.check_guards().map(|damage| {
        format!(
            "guard bytes damaged after the free by {}: {damage}",
            block.freed_by
        )
    })
}

/// Checks every quarantined block now (tests call it; blocks are otherwise checked when they
/// leave quarantine). Returns the sticky fault's code, or `CUDA_SUCCESS`.
#[no_mangle]
pub extern "C" fn tandem_cuda_emu_check_quarantine() -> CUresult {
    entry("tandem_cuda_emu_check_quarantine", || {
        let found: Vec<String> =
            with_heap(|h| h.quarantine.iter().filter_map(quarantine_damage).collect());
        for message in found {
            fault(E::CUDA_ERROR_ILLEGAL_ADDRESS, message, true);
        }
        sticky()
    })
}

/// Checks that `[ptr, ptr + len)` lies inside one live device allocation, as copies do, for
/// the emulated libraries beside the driver (cuBLAS checks its GEMM operands with it): fails
/// with `CUDA_ERROR_INVALID_VALUE` and reports a fault whose message starts with `what` (a
/// NUL-terminated string naming the call and the operand) otherwise.
#[no_mangle]
pub unsafe extern "C" fn tandem_cuda_emu_check_device_range(
    ptr: u64,
    len: usize,
    what: *const std::ffi::c_char,
) -> CUresult {
    entry("tandem_cuda_emu_check_device_range", || {
        let what = if what.is_null() {
            "a device range".to_string()
        } else {
            // SAFETY: the caller passes a NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(what) }
                .to_string_lossy()
                .into_owned()
        };
        device_range(ptr, len, &what)
    })
}
