//! `tandem-cuda-emu`: an emulated CUDA driver (`libcuda.so`) that runs tandem's unchanged CUDA
//! code — cudarc calls, streams, events, the stream-ordered pool, pinned copies, launches — on a
//! machine without a GPU. Tests only (issue 20, part 1): a program finds it only when
//! `TANDEM_CUDA_LIBS` names a folder holding a copy of it under the driver's file name
//! (`tests/common/mod.rs` makes one); a user's program never picks it by itself.
//!
//! It exports the driver's C ABI with the real signatures, handle types and `CUresult` codes.
//! Kernels come from the emulated NVRTC (`nvrtc/`, `tandem-cuda-emu-nvrtc`), which compiles
//! CUDA C for the host against the host harness's execution model; this driver loads those
//! modules and runs their kernels.
//!
//! # What is emulated
//!
//! - **Init and the device**: `cuInit`, `cuDriverGetVersion` (13.0), one device, `sm_90` with an
//!   H100's limits (`cuDeviceGetAttribute`: 132 SMs, 1024 threads per block, 48 KiB of shared
//!   memory per block, 227 KiB opt-in, memory pools supported, …), `cuDeviceGetName`,
//!   `cuDeviceTotalMem_v2` (80 GiB), `cuDeviceGetUuid(_v2)`, `cuDeviceGetPCIBusId`.
//! - **The primary context**: retain, release, set/get current (per thread), flags,
//!   `cuCtxSynchronize`. A call that needs a context fails with `CUDA_ERROR_INVALID_CONTEXT` on a
//!   thread where none is current, as the driver does — so a missing `bind` in tandem shows.
//! - **Streams run concurrently** ([`stream`]): each stream is a worker thread executing its
//!   queue in order; `cuStreamWaitEvent` enqueues a wait that blocks that worker until the
//!   event's stream has passed the event. A missing wait in tandem is a real race here, as on a
//!   GPU. The legacy default stream (`NULL`, `CU_STREAM_LEGACY`) orders with blocking streams;
//!   the per-thread default stream is treated as the legacy one. `cuLaunchHostFunc` runs host
//!   code in stream order.
//! - **Events**: create, record (a marker in the stream's queue that takes a timestamp when the
//!   worker reaches it), query, synchronize, elapsed time (`_v2` as well), destroy.
//! - **Device memory is host memory with teeth** ([`memory`]): every allocation is 256-byte
//!   aligned, its size rounded up to 256 bytes as the driver does, and its rounded end placed
//!   against an inaccessible (`PROT_NONE`) page: a kernel reading or writing there is reported
//!   by a SIGSEGV handler on stderr — the kernel (grid, block, stream), whether it read or wrote,
//!   the address, and the allocation it overran (number, base, size, who allocated it) — and the
//!   process aborts (a GPU would fail the launch with `CUDA_ERROR_ILLEGAL_ADDRESS`); other
//!   faults go to the handler installed before. Guard bytes fill the 256 bytes before each
//!   allocation and the slack of the rounding after it (up to 255 bytes; reads there go
//!   unnoticed, as on a GPU); fresh allocations are filled with `0xFF` bytes (a NaN
//!   for f16, bf16, f32 and f64; -1 for integers), so reading memory nobody wrote shows. Guards
//!   are checked at every free and every synchronisation; a corrupt guard is reported on stderr
//!   naming the allocation (size, address, who allocated it) and the synchronisation fails with
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`, sticky like a GPU fault. Freed memory is filled with `0xFF`
//!   and kept in quarantine (up to 256 MiB) before it returns to the host allocator; a block
//!   whose poison changed while in quarantine was written after its free, and is reported.
//!   Copies and memsets check that their device range lies inside one live allocation
//!   (`CUDA_ERROR_INVALID_VALUE` otherwise, with a message).
//! - **The stream-ordered pool**: `cuMemAllocAsync` / `cuMemFreeAsync` on the device's default
//!   pool (`cuDeviceGetDefaultMemPool`, `cuMemPoolGet/SetAttribute`, `cuMemPoolTrimTo`). A
//!   free takes effect when its stream's worker reaches it; the block is then poisoned and never
//!   handed out again before it leaves quarantine, so a block freed on stream S cannot reach
//!   another stream before S passed the free (stricter than the driver, which may reuse it at
//!   once on S). The pool's reserved/used counters and the release threshold are kept.
//! - **Copies and memsets**: `cuMemcpyHtoD/DtoH/DtoD` (`_v2`, sync and async),
//!   `cuMemsetD8/D16/D32` (sync and async). Async copies from or to pinned host memory run in
//!   stream order, touching the host memory when the worker gets there (as DMA does); with
//!   pageable host memory the host-to-device source is read at the call and device-to-host
//!   copies return when done, as the driver behaves.
//! - **Pinned host memory**: `cuMemAllocHost_v2`, `cuMemHostAlloc`, `cuMemFreeHost` (waits for
//!   the device, then poisons), `cuMemHostGetDevicePointer_v2` (unified addressing: the same
//!   address). `cuMemGetInfo_v2`.
//! - **Modules and launches** ([`module`]): `cuModuleLoadData` takes the emulated NVRTC's
//!   module image (a real CUBIN is refused with `CUDA_ERROR_INVALID_IMAGE` and a message), checks
//!   its architecture against `sm_90` and loads the host library it carries;
//!   `cuModuleGetFunction`, `cuFuncGet/SetAttribute`, `cuModuleUnload`. `cuLaunchKernel` checks
//!   the configuration against the device's limits (block size and dimensions, grid dimensions,
//!   dynamic shared memory against 48 KiB or the function's opt-in), copies the arguments at the
//!   launch, as the driver does, and runs the kernel's host entry on the stream's worker. A fault
//!   the execution model detects (a barrier not reached by every thread, …) is reported on
//!   stderr and fails the next synchronisation with `CUDA_ERROR_LAUNCH_FAILED`, sticky.
//!   Kernels of different streams run at the same time, as on a GPU (each launch has its own
//!   state and its own crew of threads in the execution model), so a kernel spinning until
//!   another stream's kernel or the host writes a flag finishes, and a missing wait between
//!   streams is a real race between kernels too. Two launches of the same kernel (by name) do
//!   not overlap: `__shared__` variables are one static copy per kernel on the host, so the
//!   second waits for the first. `clock64()` and `clock()` count cycles of a 2 GHz clock.
//! - **Errors**: `cuGetErrorName` and `cuGetErrorString` for every code.
//!
//! Every other entry point cudarc 0.19.10 may load is exported as a stub ([`stubs`]) that prints
//! `tandem-cuda-emu: <name> is not emulated` on stderr and returns `CUDA_ERROR_NOT_SUPPORTED`:
//! cudarc resolves symbols lazily and panics on a missing one, so the stubs turn a call tandem
//! makes that the emulator lacks into a clear error naming the function.
//!
//! # What it does not check (yet)
//!
//! Accesses inside the rounding slack of an allocation (reads there pass; writes are caught by
//! the guard bytes at the next synchronisation), accesses that land inside another live
//! allocation, two launches of the same kernel at once (serialised), graphs, several devices,
//! peer copies, managed memory, and anything about speed. Timestamps are the host's clock.
//! (cuBLAS, cuBLASLt, cuDNN and NCCL are separate libraries, emulated by `cublas/`, `cublaslt/`,
//! `cudnn/` and `nccl/`, which enqueue their work on this driver's stream workers.)
//!
//! Speed: a launch runs its blocks one after the other, each as OS threads meeting at barriers
//! (the harness's execution model), so a grid-stride launch over millions of elements (16384
//! blocks of 256 threads) takes seconds. Tests written for a GPU that launch hundreds of those
//! (core's `events_order_streams_and_measure_time`, `memory_used_on_a_second_stream_…`) are too
//! slow here until blocks run in parallel.
//!
//! # Emulator-only entry points
//!
//! `tandem_cuda_emu_last_fault(buf, len)` copies the last fault reported (guard corruption, use
//! after free, a kernel fault, a bad copy range) into `buf` and returns its length, so tests can
//! assert on it. `tandem_cuda_emu_check_quarantine()` checks every freed block in quarantine
//! now (otherwise each is checked when it leaves quarantine) and returns the sticky fault.
//! `tandem_cuda_emu_check_device_range(ptr, len, what)` checks that a range lies inside one live
//! allocation, as copies do (`CUDA_ERROR_INVALID_VALUE` and a fault starting with `what`
//! otherwise): the emulated cuBLAS and cuDNN check their operands with it.
//!
//! [`counters`]: `tandem_cuda_emu_counters(out, capacity)` copies the counters of launches,
//! copies and bytes per direction, memsets, host synchronisations, pool misses, allocations
//! outside the pool, cuBLAS products and cuDNN convolutions into a versioned `repr(C)` struct;
//! `tandem_cuda_emu_reset_counters()` zeroes them; `tandem_cuda_emu_count_blas(kind)` and
//! `tandem_cuda_emu_count_dnn(kind)` are how the emulated cuBLAS and cuDNN count their work; `tandem_cuda_emu_trace_host_syncs(on)` prints the call
//! stack of every host synchronisation. Tests read them through `tests/common`.

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;
use parking_lot::Mutex;

pub mod context;
pub mod counters;
pub mod memory;
pub mod module;
pub mod stream;
pub mod stubs;

/// The driver's result type (`CUresult`, `cudaError_enum` in cudarc's bindings).
pub type CUresult = sys::CUresult;
use sys::cudaError_enum as E;

/// The result of an entry point's body: `Err` holds the code to return.
pub(crate) type Res = Result<(), CUresult>;

static INITIALISED: AtomicBool = AtomicBool::new(false);

/// A fault that makes the context unusable, as a GPU fault does: once set, every
/// synchronisation and every later launch returns it.
static STICKY: Mutex<Option<(CUresult, String)>> = Mutex::new(None);
/// The last fault reported (sticky or not), for `tandem_cuda_emu_last_fault`.
static LAST_FAULT: Mutex<String> = Mutex::new(String::new());

/// Prints a message of the emulator on stderr.
pub(crate) use tandem_cuda_emu_link::say;

/// Reports a fault loudly and remembers it; a sticky one fails every later synchronisation.
pub(crate) fn fault(code: CUresult, message: String, sticky: bool) {
    say(&message);
    *LAST_FAULT.lock() = message.clone();
    if sticky {
        let mut s = STICKY.lock();
        if s.is_none() {
            *s = Some((code, message));
        }
    }
}

/// The sticky fault, if any.
pub(crate) fn sticky() -> Res {
    match &*STICKY.lock() {
        Some((code, _)) => Err(*code),
        None => Ok(()),
    }
}

/// Fails with `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub(crate) fn initialised() -> Res {
    if INITIALISED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// Runs an entry point's body, turning a panic into `CUDA_ERROR_UNKNOWN` with a message (a
/// panic must not unwind into C).
pub(crate) fn entry(name: &str, body: impl FnOnce() -> Res) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => E::CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(panic) => {
            let text = tandem_cuda_emu_link::panic_text(&*panic);
            say(&format!("{name} panicked inside the emulator: {text}"));
            E::CUDA_ERROR_UNKNOWN
        }
    }
}

/// Writes `value` through an out-pointer, or fails with `CUDA_ERROR_INVALID_VALUE` when null.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> Res {
    if out.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null; the caller passes a pointer valid for a write of T (the driver's
    // contract for out-parameters).
    unsafe { out.write(value) };
    Ok(())
}

/// Emulates `cuInit`: marks the driver initialised; only `flags == 0` is accepted
/// (`CUDA_ERROR_INVALID_VALUE` otherwise).
#[no_mangle]
pub extern "C" fn cuInit(flags: u32) -> CUresult {
    entry("cuInit", || {
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        INITIALISED.store(true, Ordering::Release);
        Ok(())
    })
}

/// Emulates `cuDriverGetVersion`: always 13000 (CUDA 13.0, the version tandem's cudarc binds).
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut i32) -> CUresult {
    // SAFETY: out-parameter per the driver's contract.
    entry("cuDriverGetVersion", || unsafe { put(version, 13000) })
}

/// Copies the last fault's message into `buf` (NUL-terminated, truncated to `len`) and returns
/// its full length; 0 when none was reported.
#[no_mangle]
pub unsafe extern "C" fn tandem_cuda_emu_last_fault(buf: *mut c_char, len: usize) -> usize {
    let message = LAST_FAULT.lock().clone();
    if !buf.is_null() && len > 0 {
        let n = message.len().min(len - 1);
        // SAFETY: the caller passes a buffer of `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(message.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    message.len()
}

fn error_text(code: u32) -> Option<(&'static str, &'static str)> {
    Some(match code {
        0 => ("CUDA_SUCCESS\0", "no error\0"),
        1 => ("CUDA_ERROR_INVALID_VALUE\0", "invalid argument\0"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY\0", "out of memory\0"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED\0", "initialization error\0"),
        4 => ("CUDA_ERROR_DEINITIALIZED\0", "driver shutting down\0"),
        100 => (
            "CUDA_ERROR_NO_DEVICE\0",
            "no CUDA-capable device is detected\0",
        ),
        101 => ("CUDA_ERROR_INVALID_DEVICE\0", "invalid device ordinal\0"),
        200 => (
            "CUDA_ERROR_INVALID_IMAGE\0",
            "device kernel image is invalid\0",
        ),
        201 => ("CUDA_ERROR_INVALID_CONTEXT\0", "invalid device context\0"),
        209 => (
            "CUDA_ERROR_NO_BINARY_FOR_GPU\0",
            "no kernel image is available for execution on the device\0",
        ),
        400 => ("CUDA_ERROR_INVALID_HANDLE\0", "invalid resource handle\0"),
        500 => ("CUDA_ERROR_NOT_FOUND\0", "named symbol not found\0"),
        600 => ("CUDA_ERROR_NOT_READY\0", "device not ready\0"),
        700 => (
            "CUDA_ERROR_ILLEGAL_ADDRESS\0",
            "an illegal memory access was encountered\0",
        ),
        701 => (
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES\0",
            "too many resources requested for launch\0",
        ),
        719 => ("CUDA_ERROR_LAUNCH_FAILED\0", "unspecified launch failure\0"),
        801 => ("CUDA_ERROR_NOT_SUPPORTED\0", "operation not supported\0"),
        999 => ("CUDA_ERROR_UNKNOWN\0", "unknown error\0"),
        _ => return None,
    })
}

/// Emulates `cuGetErrorName`: the enum name of the codes the emulator returns; any other code is
/// `CUDA_ERROR_INVALID_VALUE`.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: u32, out: *mut *const c_char) -> CUresult {
    entry("cuGetErrorName", || match error_text(error) {
        // SAFETY: out-parameter; the strings are static and NUL-terminated.
        Some((name, _)) => unsafe { put(out, name.as_ptr().cast()) },
        None => Err(E::CUDA_ERROR_INVALID_VALUE),
    })
}

/// Emulates `cuGetErrorString`: the driver's description of the codes the emulator returns; any
/// other code is `CUDA_ERROR_INVALID_VALUE`.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: u32, out: *mut *const c_char) -> CUresult {
    entry("cuGetErrorString", || match error_text(error) {
        // SAFETY: as above.
        Some((_, text)) => unsafe { put(out, text.as_ptr().cast()) },
        None => Err(E::CUDA_ERROR_INVALID_VALUE),
    })
}
