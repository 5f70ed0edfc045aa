//! The stream sanitizer: finds device memory used by two CUDA streams without an order between
//! the uses, and memory freed while another stream may still use it. On with
//! `TANDEM_CUDA_SANITIZER=1` (read once, at the first CUDA call that asks); off, each hook costs
//! one branch on the cached flag. It works the same on a real GPU and on the CUDA emulator,
//! since it watches tandem's own calls, not the device. (PyTorch's CSAN is the model.)
//!
//! # What it watches
//! - **Streams and events** (`model`'s happens-before rules): every stream has a vector clock;
//!   recording an event captures the recording stream's clock, `wait_event` joins it into the
//!   waiting stream, host synchronisations (stream and device synchronize, an event seen
//!   complete, the synchronous end of a download) join into one host clock, and every enqueue
//!   joins the host clock into its stream. The hooks sit where tandem calls the driver:
//!   `Stream` and `Event` (`core/src/stream.rs`), [`CudaDevice`](super::CudaDevice), the
//!   buffer's free (`memory.rs`).
//! - **Allocations**: every [`DeviceBuffer`](super::DeviceBuffer) registers its address range,
//!   the op that allocated it and its stream (the allocation counts as a write there);
//!   [`CudaStorage`](super::CudaStorage) adds its dtype and element count. Per allocation the
//!   registry keeps the last write (op, stream, epoch) and the last read of each stream since.
//! - **Declared accesses**: a kernel launch reads its [`KernelArg::In`] pointers and writes its
//!   [`KernelArg::Out`] pointers (every plan declares one or the other; the host harness checks
//!   the declarations against the kernels' `const`); copies and memsets of the runtime declare themselves;
//!   libraries' calls (cuBLAS, cuDNN, NCCL) and kernels that reach memory through a table
//!   (the device-thread group's peer snapshots) declare through [`access`]. A pointer
//!   anywhere inside an allocation stands for the whole allocation.
//!
//! # What it reports
//! An access that is not ordered after a conflicting access of another stream (write after
//! write, read after write, write after read) makes the racing call return
//! [`Error::StreamRace`] naming both ops, both streams and the memory (dtype, elements, bytes,
//! the op and stream that allocated it); the call does not reach the device and records
//! nothing. So does a use of memory freed since (remembered until reallocated).
//!
//! A free that is not ordered after another stream's use happens in a `Drop`, which cannot
//! return an error: it is printed to stderr at once and returned, as [`Error::StreamRace`], by
//! the next synchronising call of the thread that dropped the buffer on that device
//! ([`CudaDevice::synchronize`](super::CudaDevice::synchronize) or a read such as `to_vec`,
//! the calls that report [`deferred`](super::deferred) errors).
//!
//! # What it cannot see
//! Accesses tandem does not declare (memory a kernel reaches through a pointer it was not given
//! as an argument, a library's internal buffers), races inside one stream (stream order
//! serialises them; a kernel racing with itself is the host harness's business), host memory,
//! and orderings made outside tandem's calls (a stream synchronised through cudarc directly).
//! All host threads share one clock: a synchronisation that one thread made orders what every
//! thread issues afterwards, which they do run after; another interleaving of the threads could
//! expose a race this run does not report.

mod model;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;

use cudarc::driver::{CudaEvent, CudaStream};
use parking_lot::Mutex;

use model::{Clock, Tracker};
pub use model::{Finding, Memory, Use};

use super::launch::{KernelArg, Launch, Reach};
use crate::{DType, Device, Error, Result};

/// The environment variable that turns the sanitizer on (`1`; unset, empty or `0` is off).
pub const ENV: &str = "TANDEM_CUDA_SANITIZER";

static ENABLED: OnceLock<bool> = OnceLock::new();
static TRACKER: Mutex<Tracker> = Mutex::new(Tracker::new());

/// Whether the sanitizer is on: `TANDEM_CUDA_SANITIZER` as it was at the first call.
#[inline]
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| {
        std::env::var(ENV)
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false)
    })
}

fn id(stream: &CudaStream) -> u64 {
    stream.cu_stream() as u64
}

fn event_id(event: &CudaEvent) -> u64 {
    event.cu_event() as u64
}

fn error(device: Device, finding: &Finding) -> Error {
    Error::StreamRace {
        device,
        detail: finding.to_string(),
    }
}

/// Declares that `op` (a library call's name: `cublasSgemm`, `ncclAllReduce`, …), about to be
/// issued on `stream` of `device`, uses each `(address, use)`. Call it right before issuing the
/// work; an `Err` means the work races with another stream's and must not be issued. Addresses
/// outside tandem's allocations are ignored. A no-op while the sanitizer is off.
pub fn access(device: Device, stream: &CudaStream, op: &str, uses: &[(u64, Use)]) -> Result<()> {
    if !enabled() {
        return Ok(());
    }
    TRACKER
        .lock()
        .access(id(stream), op, uses)
        .map_err(|f| error(device, &f))
}

/// Declares the pointer arguments of `launch` (on `stream` of `device`).
pub(crate) fn launch(device: Device, stream: &CudaStream, launch: &Launch) -> Result<()> {
    if !enabled() {
        return Ok(());
    }
    let uses: Vec<(u64, Use)> = launch
        .args
        .iter()
        .flat_map(|arg| match arg {
            KernelArg::In(p) => vec![(*p, Use::Read)],
            KernelArg::Out(p) => vec![(*p, Use::Write)],
            // Addresses inside a struct argument, as its plan declared them.
            KernelArg::Pod(bytes) => bytes
                .reaches()
                .iter()
                .map(|r| match *r {
                    Reach::In(p) => (p, Use::Read),
                    Reach::Out(p) => (p, Use::Write),
                })
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    access(device, stream, &launch.kernel, &uses)
}

/// A stream was created (a reused handle starts over) and is called `name` in reports.
pub(crate) fn stream_created(stream: &CudaStream, name: &str) {
    if enabled() {
        TRACKER.lock().new_stream(id(stream), name);
    }
}

/// Names `stream` in reports (`Stream::new_on`'s name, say).
pub fn name_stream(stream: &CudaStream, name: &str) {
    if enabled() {
        TRACKER.lock().name_stream(id(stream), name);
    }
}

/// `event` was recorded on `stream`.
pub(crate) fn event_recorded(event: &CudaEvent, stream: &CudaStream) {
    if enabled() {
        TRACKER.lock().record(event_id(event), id(stream));
    }
}

/// `stream` waits for `event` (its latest recording).
pub(crate) fn stream_waited(stream: &CudaStream, event: &CudaEvent) {
    if enabled() {
        TRACKER.lock().wait(id(stream), event_id(event));
    }
}

/// `waiting` waits for everything issued on `other` so far.
pub(crate) fn stream_waited_for_stream(waiting: &CudaStream, other: &CudaStream) {
    if enabled() {
        TRACKER.lock().wait_for_stream(id(waiting), id(other));
    }
}

/// The host saw `event` complete.
pub(crate) fn event_completed(event: &CudaEvent) {
    if enabled() {
        TRACKER.lock().host_saw_event(event_id(event));
    }
}

/// Runs `wait`, a host synchronisation with `stream`; once it succeeded, the host is ordered
/// after everything issued on `stream` before the call.
pub(crate) fn synchronized<R, E>(
    stream: &CudaStream,
    wait: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    if !enabled() {
        return wait();
    }
    let point: Clock = TRACKER.lock().sync_point(id(stream));
    let out = wait()?;
    TRACKER.lock().host_saw(&point);
    Ok(out)
}

/// `bytes` at `address` were allocated by `op` on `stream`.
pub(crate) fn allocated(address: u64, bytes: usize, op: &str, stream: &CudaStream) {
    if enabled() {
        TRACKER
            .lock()
            .allocate(address, bytes as u64, op, id(stream));
    }
}

/// The allocation at `address` holds `len` elements of `dtype`.
pub(crate) fn described(address: u64, dtype: DType, len: usize) {
    if enabled() {
        TRACKER.lock().describe(address, dtype, len);
    }
}

/// Frees reported at the next synchronising call of the thread that dropped the memory.
static PENDING: Mutex<Vec<(ThreadId, Device, String)>> = Mutex::new(Vec::new());
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The allocation at `address` of `device` is freed on `stream` (after the waits the free
/// issued, already told). What may still be using it is printed now and kept for
/// [`take_reported`].
pub(crate) fn freed(device: Device, address: u64, stream: &CudaStream) {
    if !enabled() {
        return;
    }
    let findings = TRACKER.lock().free(address, id(stream));
    if findings.is_empty() {
        return;
    }
    let thread = std::thread::current().id();
    let mut pending = PENDING.lock();
    for f in findings {
        let text = f.to_string();
        eprintln!("tandem stream sanitizer on {device}: {text}");
        pending.push((thread, device, text));
        PENDING_COUNT.fetch_add(1, Ordering::Release);
    }
}

/// Returns, as an error, the first free the calling thread made on `device` that was not
/// ordered after another stream's use (see the module documentation). One load when there is
/// none.
pub(crate) fn take_reported(device: Device) -> Result<()> {
    if PENDING_COUNT.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let thread = std::thread::current().id();
    let mut pending = PENDING.lock();
    let Some(i) = pending
        .iter()
        .position(|(t, d, _)| *t == thread && *d == device)
    else {
        return Ok(());
    };
    let (_, _, detail) = pending.remove(i);
    PENDING_COUNT.fetch_sub(1, Ordering::Release);
    Err(Error::StreamRace { device, detail })
}
