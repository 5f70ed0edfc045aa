//! Device memory as host memory with teeth: guards, poison, quarantine, range checks; the
//! default memory pool; copies and memsets; pinned host memory.
//!
//! # Layout of a device allocation
//!
//! Each allocation is its own mapping: an inaccessible (`PROT_NONE`) page, the data pages, an
//! inaccessible page. The allocation's size is rounded up to 256 bytes, as the driver rounds
//! (its pointers are 256-byte aligned and its allocations come in multiples of that), and placed
//! so that the rounded end touches the second inaccessible page:
//!
//! ```text
//! | PROT_NONE page | (unused) | 256 guard bytes | size bytes | slack guard bytes | PROT_NONE page |
//!                                               ^ ptr (256-aligned)              ^ ptr + rounded
//! ```
//!
//! - A kernel reading or writing at or past `ptr + rounded` touches the inaccessible page: the
//!   SIGSEGV handler (`install_fault_handler`) prints which kernel was running (its grid, block
//!   and stream), the address, and the allocation it overran (number, base, size, who allocated
//!   it), and aborts the process. A fault anywhere else goes to the handler installed before.
//!   The page before the data catches reads far before the start the same way.
//! - The slack, `rounded - size` bytes (0 to 255, none when the size is a multiple of 256), and
//!   the 256 bytes before `ptr` hold guard bytes: a write there is found when the allocation is
//!   freed or at the next synchronisation; a read there goes unnoticed, as on a GPU (whose
//!   allocations have the same slack).
//! - Cost: two pages (8 KiB) of address space per allocation that are never backed by memory,
//!   and the data rounded up to whole pages: an allocation of n bytes keeps
//!   `round_up(256 + round_up(n, 256), 4096)` bytes of host memory (4 KiB for anything up to
//!   3840 bytes, where the guard bytes alone used to cost 512 bytes beside the rounded size),
//!   plus three kernel mappings. Freed blocks keep theirs while in quarantine (at most 4096
//!   blocks or 256 MiB).

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::Mutex;
use sys::cudaError_enum as E;

use crate::context::{current, TOTAL_MEMORY};
use crate::counters::{count, count_bytes, host_sync, Counter};
use crate::stream::{lookup, Stream};
use crate::{entry, fault, initialised, put, say, sticky, CUresult, Res};

/// Bytes of guard before every allocation; also its alignment and the granularity its size is
/// rounded to (the rest of the last 256 bytes is guard bytes too).
pub const GUARD: usize = 256;
/// The guard bytes' value.
pub const GUARD_BYTE: u8 = 0xFD;
/// What fresh and freed memory is filled with: all ones, a NaN in every float format.
pub const POISON: u8 = 0xFF;
/// Freed blocks are kept (poisoned) until the quarantine holds more than this.
const QUARANTINE_BYTES: usize = 256 << 20;
/// … or more than this many blocks.
const QUARANTINE_BLOCKS: usize = 4096;

/// One device allocation (see the module docs for its layout).
struct Block {
    /// The whole mapping, inaccessible pages included.
    map: usize,
    map_len: usize,
    /// The address handed out.
    ptr: u64,
    size: usize,
    /// `size` rounded up to [`GUARD`]: the data ends at `ptr + rounded`, against the
    /// inaccessible page.
    rounded: usize,
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

    /// `len` bytes from `offset` relative to `ptr` (negative: the guard bytes before it).
    fn bytes(&self, offset: isize, len: usize) -> &[u8] {
        // SAFETY: the block's accessible bytes are [ptr - GUARD, ptr + rounded); callers stay
        // inside.
        unsafe { std::slice::from_raw_parts((self.ptr as isize + offset) as *const u8, len) }
    }

    /// The inaccessible page after the data, and the one before the data pages.
    fn tail_page(&self) -> (u64, u64) {
        let start = self.ptr + self.rounded as u64;
        (start, start + page() as u64)
    }

    fn head_page(&self) -> (u64, u64) {
        (self.map as u64, (self.map + page()) as u64)
    }

    /// A description of the damage to the guards, if any.
    fn check_guards(&self) -> Option<String> {
        let head = self.bytes(-(GUARD as isize), GUARD);
        let tail = self.bytes(self.size as isize, self.rounded - self.size);
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
        // SAFETY: the guards are the block's own accessible bytes [ptr - GUARD, ptr) and
        // [ptr + size, ptr + rounded).
        unsafe {
            std::ptr::write_bytes((self.ptr as usize - GUARD) as *mut u8, GUARD_BYTE, GUARD);
            std::ptr::write_bytes(
                (self.ptr as usize + self.size) as *mut u8,
                GUARD_BYTE,
                self.rounded - self.size,
            );
        }
    }

    fn fill(&self, value: u8) {
        // SAFETY: the block's user bytes are [ptr, ptr + size).
        unsafe { std::ptr::write_bytes(self.ptr as *mut u8, value, self.size) };
    }
}

/// The host's page size.
fn page() -> usize {
    static PAGE_SIZE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *PAGE_SIZE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    })
}

/// Maps a block's memory (see the module docs): the mapping's start and length, and the
/// address handed out. `None` when the system refuses.
fn map_block(rounded: usize) -> Option<(usize, usize, usize)> {
    let page = page();
    let data = (GUARD + rounded).checked_next_multiple_of(page)?;
    let map_len = data.checked_add(2 * page)?;
    // SAFETY: a fresh anonymous mapping; nothing else refers to it.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return None;
    }
    let map = map as usize;
    // SAFETY: the data pages lie inside the mapping just made.
    if unsafe {
        libc::mprotect(
            (map + page) as *mut c_void,
            data,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    } != 0
    {
        // SAFETY: our mapping, unused.
        unsafe { libc::munmap(map as *mut c_void, map_len) };
        return None;
    }
    Some((map, map_len, map + page + data - rounded))
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
        .checked_next_multiple_of(GUARD)
        .ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
    if with_heap(|h| h.live_bytes + size > TOTAL_MEMORY) {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    install_fault_handler();
    let (map, map_len, ptr) = map_block(rounded).ok_or(E::CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: [ptr - GUARD, ptr + rounded) lies in the mapping's accessible pages.
    unsafe {
        std::ptr::write_bytes((ptr - GUARD) as *mut u8, GUARD_BYTE, GUARD + rounded);
        std::ptr::write_bytes(ptr as *mut u8, POISON, size);
    }
    let ptr = ptr as u64;
    let block = Block {
        map,
        map_len,
        ptr,
        size,
        rounded,
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
    // SAFETY: the block's mapping, unmapped once (the block is consumed).
    unsafe { libc::munmap(block.map as *mut c_void, block.map_len) };
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

/// Emulates `cuMemAlloc_v2`: a fresh guarded, poisoned mapping (see the module docs); size 0 is
/// `CUDA_ERROR_INVALID_VALUE`, more than [`TOTAL_MEMORY`] live is `CUDA_ERROR_OUT_OF_MEMORY`.
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

/// Emulates `cuMemFree_v2`: waits for every stream, checks the guards, poisons the block and
/// quarantines it (never reused); a double or foreign free is `CUDA_ERROR_INVALID_VALUE` with a
/// message.
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

/// Emulates `cuMemAllocAsync` from the default pool: the memory is allocated at the call (not in
/// stream order) and the pool's counters are updated; blocks are never reused, only counted as
/// cached.
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

/// Emulates `cuMemAllocFromPoolAsync` for the default pool only (as [`cuMemAllocAsync`]); any other
/// pool is `CUDA_ERROR_NOT_SUPPORTED`.
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

/// Emulates `cuMemFreeAsync`: a double free is caught at the call; the free itself (guard check,
/// poison, quarantine) runs when the stream reaches it.
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

/// Emulates `cuMemGetInfo_v2`: total is [`TOTAL_MEMORY`]; free is that minus live allocations and
/// the pool's cached bytes (not the host's free memory).
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

/// Emulates `cuDeviceGetDefaultMemPool`: the handle of the one pool.
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

/// Emulates `cuDeviceGetMemPool`: always the default pool (setting another is not emulated).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(out: *mut sys::CUmemoryPool, dev: i32) -> CUresult {
    // SAFETY: forwarded: the current pool is always the default one.
    unsafe { cuDeviceGetDefaultMemPool(out, dev) }
}

use sys::CUmemPool_attribute as P;

/// Emulates `cuMemPoolGetAttribute` for the default pool: the release threshold, reserved and used
/// memory (current and high) from the emulator's counters, and the reuse policies (always on);
/// other attributes are `CUDA_ERROR_NOT_SUPPORTED`.
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

/// Emulates `cuMemPoolSetAttribute` for the default pool: the release threshold, resetting the
/// high-water marks (only 0), and the reuse policies (accepted and ignored: blocks are never reused
/// early); other attributes are `CUDA_ERROR_NOT_SUPPORTED`.
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

/// Emulates `cuMemPoolTrimTo` on the default pool's counters: the cached bytes drop so that the
/// pool reserves at most `min_bytes` (no memory is returned: freed blocks are in quarantine).
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

/// Emulates `cuMemcpyHtoDAsync_v2`: from pinned memory the bytes are read when the stream gets
/// there; from pageable memory they are staged at the call, as the driver does.
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

/// Emulates `cuMemcpyHtoD_v2` on the legacy default stream, waiting for the copy (counted as a
/// blocking host synchronisation).
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

/// Emulates `cuMemcpyDtoHAsync_v2`: into pinned memory it is asynchronous; into pageable memory the
/// call waits for the copy, as the driver does (counted as a host synchronisation).
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

/// Emulates `cuMemcpyDtoH_v2` on the legacy default stream: returns once the copy and everything
/// before it on that stream are done.
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

/// Emulates `cuMemcpyDtoDAsync_v2`: both ranges must lie in live allocations; the copy runs in
/// stream order.
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

/// Emulates `cuMemcpyDtoD_v2` on the legacy default stream, waiting for the copy (the real call may
/// return before it ends).
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

/// Emulates `cuMemsetD8Async`: the range must lie in one live allocation; the fill runs in stream
/// order.
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

/// Emulates `cuMemsetD16Async`: `dst` must be 2-byte aligned and the range in one live allocation;
/// the fill runs in stream order.
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

/// Emulates `cuMemsetD32Async`: `dst` must be 4-byte aligned and the range in one live allocation;
/// the fill runs in stream order.
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

/// Emulates `cuMemsetD8_v2` on the legacy default stream, waiting for the fill.
#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, count: usize) -> CUresult {
    entry("cuMemsetD8_v2", || {
        memset_sync(dst, value as u32, 1, count, "cuMemsetD8")
    })
}

/// Emulates `cuMemsetD16_v2` on the legacy default stream, waiting for the fill.
#[no_mangle]
pub extern "C" fn cuMemsetD16_v2(dst: u64, value: u16, count: usize) -> CUresult {
    entry("cuMemsetD16_v2", || {
        memset_sync(dst, value as u32, 2, count, "cuMemsetD16")
    })
}

/// Emulates `cuMemsetD32_v2` on the legacy default stream, waiting for the fill.
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

/// Emulates `cuMemHostAlloc`: page-aligned poisoned host memory, remembered as pinned (copies from
/// and to it are asynchronous); the flags are checked, not acted on.
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

/// Emulates `cuMemAllocHost_v2`: as [`cuMemHostAlloc`] without flags.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, size: usize) -> CUresult {
    entry("cuMemAllocHost_v2", || host_alloc(out, size))
}

/// Emulates `cuMemFreeHost`: waits for every stream, then poisons and frees the memory; a pointer
/// not from [`cuMemHostAlloc`] is `CUDA_ERROR_INVALID_VALUE` with a message.
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

/// Emulates `cuMemHostGetDevicePointer_v2` with unified addressing: the device pointer is the host
/// address; only pinned memory and `flags == 0` are accepted.
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
    let user = block.bytes(0, block.size);
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

/// What an access at `addr` inside an inaccessible page of a device allocation overran: "N
/// bytes past the end of allocation #… of S bytes at 0x… (who allocated it), at offset +M"
/// (live or freed blocks). `None` when
/// `addr` is in no allocation's inaccessible page. Called from the SIGSEGV handler: it waits a
/// bounded time for the heap (another thread may hold it; the faulting one does not, as no code
/// holding it touches an inaccessible page).
pub(crate) fn guard_page_report(addr: u64) -> Option<String> {
    let guard = HEAP.try_lock_for(Duration::from_secs(2))?;
    let heap = guard.as_ref()?;
    let inside = |(start, end): (u64, u64)| (start..end).contains(&addr);
    let report = |b: &Block, freed: bool| -> Option<String> {
        let state = if freed {
            format!(" (freed by {})", b.freed_by)
        } else {
            String::new()
        };
        if inside(b.tail_page()) {
            return Some(format!(
                "{} bytes past the end of {}{state}, at offset +{} (in the inaccessible page \
                 after it)",
                addr - (b.ptr + b.size as u64),
                b.describe(),
                addr - b.ptr
            ));
        }
        if inside(b.head_page()) {
            return Some(format!(
                "{} bytes before the start of {}{state} (in the inaccessible page before it)",
                b.ptr - addr,
                b.describe(),
            ));
        }
        None
    };
    let below = heap.live.range(..=addr).next_back().map(|(_, b)| b);
    let above = heap.live.range(addr + 1..).next().map(|(_, b)| b);
    below
        .into_iter()
        .chain(above)
        .find_map(|b| report(b, false))
        .or_else(|| heap.quarantine.iter().find_map(|b| report(b, true)))
}

/// The SIGSEGV disposition in place before the emulator's handler, to pass other faults on to.
static PREVIOUS_SEGV: OnceLock<libc::sigaction> = OnceLock::new();

/// Installs, once, the SIGSEGV handler that reports an access to an allocation's inaccessible
/// page (see the module docs) and passes every other fault on to the handler installed before.
fn install_fault_handler() {
    PREVIOUS_SEGV.get_or_init(|| {
        // SAFETY: sigaction with a zeroed (empty-mask) action and an out-parameter for the old
        // one; the handler has the SA_SIGINFO signature. SA_ONSTACK keeps threads that have an
        // alternate signal stack (Rust's, for its stack-overflow report) on it.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_segv as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGSEGV, &action, &mut previous) != 0 {
                say(
                    "could not install the SIGSEGV handler: kernel accesses past an allocation \
                     will crash without a report",
                );
                previous.sa_sigaction = libc::SIG_DFL;
            }
            previous
        }
    });
}

/// Whether the faulting access was a write (x86-64 Linux: bit 1 of the page fault's error code).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn access_kind(context: *mut c_void) -> &'static str {
    if context.is_null() {
        return "accessed";
    }
    // SAFETY: the kernel passes a ucontext_t to an SA_SIGINFO handler.
    let error =
        unsafe { (*context.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_ERR as usize] };
    if error & 2 != 0 {
        "wrote"
    } else {
        "read"
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn access_kind(_context: *mut c_void) -> &'static str {
    "accessed"
}

extern "C" fn on_segv(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SIGSEGV.
    let addr = unsafe { (*info).si_addr() } as u64;
    if let Some(overran) = guard_page_report(addr) {
        let who = crate::module::running_on_this_thread()
            .map(|r| r.describe())
            .unwrap_or_else(|| "a host thread (no kernel)".to_string());
        let message = format!(
            "tandem-cuda-emu: out-of-range access: {who} {} address {addr:#x}, {overran}. \
             On a GPU this is CUDA_ERROR_ILLEGAL_ADDRESS; the emulator aborts the process here.\n",
            access_kind(context)
        );
        // SAFETY: write(2) of a live buffer; async-signal-safe.
        unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
        // SAFETY: ends the process; no return.
        unsafe { libc::abort() };
    }
    let Some(previous) = PREVIOUS_SEGV.get() else {
        return;
    };
    let handler = previous.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // The default action: restore it and return; the access faults again and kills the
        // process as it would have without the emulator.
        // SAFETY: a zeroed action is SIG_DFL with an empty mask.
        unsafe {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &default, std::ptr::null_mut());
        }
    } else if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this signature.
        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(handler) };
        f(signal, info, context);
    } else {
        // SAFETY: a plain handler takes the signal number.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
        f(signal);
    }
}
