//! Streams as concurrent workers, and events as completion markers.
//!
//! Each stream owns a host thread that runs its queue in order. Work is enqueued with a
//! sequence number; the stream's `completed` counter says how far the worker got, so "has the
//! stream passed point n" is `completed >= n`. An event records a stream and a point; waiting on
//! it (from the host, or from another stream's worker after `cuStreamWaitEvent`) waits for that
//! stream to pass that point. Nothing else orders two streams, so work tandem forgets to order
//! really runs concurrently.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::sys;
use parking_lot::{Condvar, Mutex};
use sys::cudaError_enum as E;

use crate::context::current;
use crate::counters::Counter;
use crate::{entry, put, sticky, CUresult, Res};

/// One unit of work on a stream's worker.
pub type Work = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    work: VecDeque<(u64, Work)>,
    enqueued: u64,
    completed: u64,
    /// Set by `cuStreamDestroy`: the worker finishes the queue, then exits.
    closing: bool,
}

/// A stream: its queue and the worker running it.
pub struct Stream {
    /// A small number naming the stream in messages (0: the legacy default stream).
    pub id: u64,
    /// `CU_STREAM_NON_BLOCKING` or 0.
    flags: u32,
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Stream {
    fn start(id: u64, flags: u32) -> Arc<Stream> {
        let stream = Arc::new(Stream {
            id,
            flags,
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name(format!("cuda-emu-stream-{id}"))
            .spawn(move || worker.run())
            .expect("the emulator could not start a stream's worker thread");
        stream
    }

    fn run(&self) {
        loop {
            let (seq, work) = {
                let mut q = self.queue.lock();
                loop {
                    if let Some(item) = q.work.pop_front() {
                        break item;
                    }
                    if q.closing {
                        return;
                    }
                    self.changed.wait(&mut q);
                }
            };
            // A panic in the work must not kill the worker (the stream would hang): report it.
            if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
                let text = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                crate::fault(
                    E::CUDA_ERROR_LAUNCH_FAILED,
                    format!("work on stream {} panicked: {text}", self.id),
                    true,
                );
            }
            let mut q = self.queue.lock();
            q.completed = seq;
            self.changed.notify_all();
        }
    }

    /// Appends `work`; returns its point in the stream.
    pub fn enqueue(self: &Arc<Self>, work: Work) -> u64 {
        if self.flags == 0 || self.id == 0 {
            legacy_ordering(self);
        }
        self.push(work)
    }

    fn push(&self, work: Work) -> u64 {
        let mut q = self.queue.lock();
        q.enqueued += 1;
        let seq = q.enqueued;
        q.work.push_back((seq, work));
        self.changed.notify_all();
        seq
    }

    /// The point of the last work enqueued.
    pub fn tail(&self) -> u64 {
        self.queue.lock().enqueued
    }

    /// Whether the worker has passed point `seq`.
    pub fn passed(&self, seq: u64) -> bool {
        self.queue.lock().completed >= seq
    }

    /// Blocks until the worker has passed point `seq`.
    pub fn wait_for(&self, seq: u64) {
        let mut q = self.queue.lock();
        while q.completed < seq {
            self.changed.wait(&mut q);
        }
    }

    /// Blocks until everything enqueued so far has run.
    pub fn drain(&self) {
        let tail = self.tail();
        self.wait_for(tail);
    }
}

/// The legacy default stream's implicit ordering: work on it waits for every blocking stream's
/// current work, and work on a blocking stream waits for the legacy stream's current work.
fn legacy_ordering(stream: &Arc<Stream>) {
    let legacy = legacy();
    if stream.id == 0 {
        let blocking: Vec<Arc<Stream>> = registry()
            .lock()
            .values()
            .filter(|s| s.flags == 0)
            .cloned()
            .collect();
        for other in blocking {
            let seq = other.tail();
            if seq > 0 && !other.passed(seq) {
                stream.push(Box::new(move || other.wait_for(seq)));
            }
        }
    } else {
        let seq = legacy.tail();
        if seq > 0 && !legacy.passed(seq) {
            let legacy = legacy.clone();
            stream.push(Box::new(move || legacy.wait_for(seq)));
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Live streams by handle.
fn registry() -> &'static Mutex<HashMap<usize, Arc<Stream>>> {
    static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<Stream>>>> = OnceLock::new();
    STREAMS.get_or_init(Default::default)
}

/// The legacy default stream (handle `NULL` or `CU_STREAM_LEGACY`).
pub fn legacy() -> &'static Arc<Stream> {
    static LEGACY: OnceLock<Arc<Stream>> = OnceLock::new();
    LEGACY.get_or_init(|| Stream::start(0, 0))
}

/// The stream behind a handle: null, `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD` (2)
/// are the default stream (the per-thread one is treated as the legacy one).
pub fn lookup(handle: sys::CUstream) -> Result<Arc<Stream>, CUresult> {
    let key = handle as usize;
    if key <= 2 {
        return Ok(legacy().clone());
    }
    registry().lock().get(&key).cloned().ok_or_else(|| {
        crate::say(&format!("stream handle {key:#x} is not a live stream"));
        E::CUDA_ERROR_INVALID_HANDLE
    })
}

/// Waits for every stream's current work (the device-wide synchronisation), then checks the
/// guards of every live allocation.
pub fn synchronize_all() -> Res {
    let streams: Vec<Arc<Stream>> = registry().lock().values().cloned().collect();
    legacy().drain();
    for s in streams {
        s.drain();
    }
    after_synchronisation()
}

/// What every synchronisation checks: the guards of live allocations, then the sticky fault.
pub fn after_synchronisation() -> Res {
    crate::memory::check_all_guards();
    crate::memory::apply_release_threshold();
    sticky()
}

fn create(out: *mut sys::CUstream, flags: u32) -> Res {
    current()?;
    if flags > 1 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let stream = Stream::start(NEXT_ID.fetch_add(1, Ordering::Relaxed), flags);
    let handle = Arc::as_ptr(&stream) as usize;
    registry().lock().insert(handle, stream);
    // SAFETY: out-parameter.
    unsafe { put(out, handle as sys::CUstream) }
}

/// Emulates `cuStreamCreate`: a new stream with its own worker thread; flags 0 or
/// `CU_STREAM_NON_BLOCKING` only.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut sys::CUstream, flags: u32) -> CUresult {
    entry("cuStreamCreate", || create(out, flags))
}

/// Emulates `cuStreamCreateWithPriority` as [`cuStreamCreate`]: the priority is ignored.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut sys::CUstream,
    flags: u32,
    _priority: i32,
) -> CUresult {
    // Priorities are accepted and ignored: the workers are scheduled by the host.
    entry("cuStreamCreateWithPriority", || create(out, flags))
}

fn destroy(handle: sys::CUstream) -> Res {
    current()?;
    if (handle as usize) <= 2 {
        return Err(E::CUDA_ERROR_INVALID_HANDLE);
    }
    let stream = registry()
        .lock()
        .remove(&(handle as usize))
        .ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
    // Like the driver: the call returns at once; work already enqueued still runs.
    let mut q = stream.queue.lock();
    q.closing = true;
    stream.changed.notify_all();
    Ok(())
}

/// Emulates `cuStreamDestroy_v2`: returns at once; work already enqueued still runs, then the
/// worker exits. The default stream handles are `CUDA_ERROR_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(handle: sys::CUstream) -> CUresult {
    entry("cuStreamDestroy_v2", || destroy(handle))
}

/// Emulates `cuStreamDestroy`: as [`cuStreamDestroy_v2`].
#[no_mangle]
pub extern "C" fn cuStreamDestroy(handle: sys::CUstream) -> CUresult {
    entry("cuStreamDestroy", || destroy(handle))
}

/// Emulates `cuStreamSynchronize`: waits for the stream's work, then checks every allocation's
/// guards and returns a sticky fault if one was reported.
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(handle: sys::CUstream) -> CUresult {
    entry("cuStreamSynchronize", || {
        current()?;
        let stream = lookup(handle)?;
        crate::counters::host_sync(Counter::stream_syncs, "cuStreamSynchronize");
        stream.drain();
        after_synchronisation()
    })
}

/// Emulates `cuStreamQuery`: `CUDA_ERROR_NOT_READY` until the worker has run everything enqueued so
/// far.
#[no_mangle]
pub extern "C" fn cuStreamQuery(handle: sys::CUstream) -> CUresult {
    entry("cuStreamQuery", || {
        current()?;
        let stream = lookup(handle)?;
        crate::counters::count(Counter::queries);
        sticky()?;
        if stream.passed(stream.tail()) {
            Ok(())
        } else {
            Err(E::CUDA_ERROR_NOT_READY)
        }
    })
}

/// Emulates `cuStreamGetFlags`: the flags the stream was created with.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetFlags(handle: sys::CUstream, flags: *mut u32) -> CUresult {
    entry("cuStreamGetFlags", || {
        current()?;
        let stream = lookup(handle)?;
        // SAFETY: out-parameter.
        unsafe { put(flags, stream.flags) }
    })
}

/// Emulates `cuStreamGetPriority`: always 0 (priorities are not emulated).
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetPriority(
    handle: sys::CUstream,
    priority: *mut i32,
) -> CUresult {
    entry("cuStreamGetPriority", || {
        current()?;
        lookup(handle)?;
        // SAFETY: out-parameter.
        unsafe { put(priority, 0) }
    })
}

/// A 32-bit word a stream waits on (`cuStreamWaitValue32`), moved to the stream's worker.
struct WaitedWord(*const u32);
// SAFETY: the caller of cuStreamWaitValue32 promises the word stays mapped until the stream has
// passed the wait, and it is only read (volatile) from the worker.
unsafe impl Send for WaitedWord {}

/// `cuStreamWaitValue32`: the stream's worker holds its queue until the word at `address`
/// (mapped host memory or device memory; both are host memory here) satisfies `flags`' test
/// against `value` — as the GPU's front end does, with no time limit.
fn wait_value32(handle: sys::CUstream, address: sys::CUdeviceptr, value: u32, flags: u32) -> Res {
    use sys::CUstreamWaitValue_flags_enum as F;
    current()?;
    let stream = lookup(handle)?;
    if address == 0 || !address.is_multiple_of(4) {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // The flush flag only orders remote writes on a GPU; every other bit picks the test.
    let test = flags & !(F::CU_STREAM_WAIT_VALUE_FLUSH as u32);
    let passes: fn(u32, u32) -> bool = match test {
        t if t == F::CU_STREAM_WAIT_VALUE_GEQ as u32 => {
            |w, v| (w as i32).wrapping_sub(v as i32) >= 0
        }
        t if t == F::CU_STREAM_WAIT_VALUE_EQ as u32 => |w, v| w == v,
        t if t == F::CU_STREAM_WAIT_VALUE_AND as u32 => |w, v| w & v != 0,
        t if t == F::CU_STREAM_WAIT_VALUE_NOR as u32 => |w, v| !(w | v) != 0,
        _ => return Err(E::CUDA_ERROR_INVALID_VALUE),
    };
    let word = WaitedWord(address as *const u32);
    stream.enqueue(Box::new(move || {
        let word = word;
        // SAFETY: the caller keeps the word mapped until the stream passed the wait; another
        // thread (the host or another stream) writes it, hence the volatile read.
        while !passes(unsafe { std::ptr::read_volatile(word.0) }, value) {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }));
    Ok(())
}

/// Emulates `cuStreamWaitValue32_v2`: the stream's worker polls the word (every 50 µs, with no time
/// limit) until the GEQ, EQ, AND or NOR test passes; the flush flag is ignored.
#[no_mangle]
pub extern "C" fn cuStreamWaitValue32_v2(
    handle: sys::CUstream,
    address: sys::CUdeviceptr,
    value: u32,
    flags: u32,
) -> CUresult {
    entry("cuStreamWaitValue32_v2", || {
        wait_value32(handle, address, value, flags)
    })
}

/// Emulates `cuStreamWaitValue32`: as [`cuStreamWaitValue32_v2`].
#[no_mangle]
pub extern "C" fn cuStreamWaitValue32(
    handle: sys::CUstream,
    address: sys::CUdeviceptr,
    value: u32,
    flags: u32,
) -> CUresult {
    entry("cuStreamWaitValue32", || {
        wait_value32(handle, address, value, flags)
    })
}

/// A host pointer handed to a host function, moved to the stream's worker.
struct UserData(*mut c_void);
// SAFETY: the caller of cuLaunchHostFunc promises the data may be used from the driver's thread.
unsafe impl Send for UserData {}

/// Emulates `cuLaunchHostFunc`: the function runs on the stream's worker thread, in stream order.
#[no_mangle]
pub extern "C" fn cuLaunchHostFunc(
    handle: sys::CUstream,
    function: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CUresult {
    entry("cuLaunchHostFunc", || {
        current()?;
        let stream = lookup(handle)?;
        let function = function.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let data = UserData(data);
        crate::counters::count(Counter::host_functions);
        stream.enqueue(Box::new(move || {
            let data = data;
            // SAFETY: the caller passed a function and the data it expects.
            unsafe { function(data.0) }
        }));
        Ok(())
    })
}

/// An event: the stream and point it was last recorded at, and when the worker passed it.
pub struct Event {
    flags: u32,
    state: Mutex<EventState>,
}

#[derive(Default)]
struct EventState {
    target: Option<(Arc<Stream>, u64)>,
    /// Incremented by every record; the marker of an older record does not set the time.
    generation: u64,
    time: Option<Instant>,
}

fn events() -> &'static Mutex<HashMap<usize, Arc<Event>>> {
    static EVENTS: OnceLock<Mutex<HashMap<usize, Arc<Event>>>> = OnceLock::new();
    EVENTS.get_or_init(Default::default)
}

fn event(handle: sys::CUevent) -> Result<Arc<Event>, CUresult> {
    events()
        .lock()
        .get(&(handle as usize))
        .cloned()
        .ok_or_else(|| {
            crate::say(&format!(
                "event handle {:#x} is not a live event",
                handle as usize
            ));
            E::CUDA_ERROR_INVALID_HANDLE
        })
}

/// `CU_EVENT_DISABLE_TIMING`.
const DISABLE_TIMING: u32 = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;

/// Emulates `cuEventCreate`: the flags are checked and kept (only `CU_EVENT_DISABLE_TIMING`
/// changes anything).
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut sys::CUevent, flags: u32) -> CUresult {
    entry("cuEventCreate", || {
        current()?;
        if flags & !0xf != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let event = Arc::new(Event {
            flags,
            state: Mutex::new(EventState::default()),
        });
        let handle = Arc::as_ptr(&event) as usize;
        crate::counters::count(Counter::events_created);
        events().lock().insert(handle, event);
        // SAFETY: out-parameter.
        unsafe { put(out, handle as sys::CUevent) }
    })
}

fn destroy_event(handle: sys::CUevent) -> Res {
    current()?;
    events()
        .lock()
        .remove(&(handle as usize))
        .map(|_| ())
        .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

/// Emulates `cuEventDestroy_v2`: forgets the handle (streams already waiting on it still wait).
#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(handle: sys::CUevent) -> CUresult {
    entry("cuEventDestroy_v2", || destroy_event(handle))
}

/// Emulates `cuEventDestroy`: as [`cuEventDestroy_v2`].
#[no_mangle]
pub extern "C" fn cuEventDestroy(handle: sys::CUevent) -> CUresult {
    entry("cuEventDestroy", || destroy_event(handle))
}

fn record(handle: sys::CUevent, stream: sys::CUstream) -> Res {
    current()?;
    let event = event(handle)?;
    let stream = lookup(stream)?;
    crate::counters::count(Counter::event_records);
    let mut state = event.state.lock();
    state.generation += 1;
    state.time = None;
    let generation = state.generation;
    let marker = event.clone();
    let seq = stream.enqueue(Box::new(move || {
        let mut s = marker.state.lock();
        if s.generation == generation {
            s.time = Some(Instant::now());
        }
    }));
    state.target = Some((stream, seq));
    Ok(())
}

/// Emulates `cuEventRecord`: the event now marks the stream's current point; its time is taken when
/// the worker passes it.
#[no_mangle]
pub extern "C" fn cuEventRecord(handle: sys::CUevent, stream: sys::CUstream) -> CUresult {
    entry("cuEventRecord", || record(handle, stream))
}

/// Emulates `cuEventRecordWithFlags` as [`cuEventRecord`]: the flags are ignored.
#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags(
    handle: sys::CUevent,
    stream: sys::CUstream,
    _flags: u32,
) -> CUresult {
    entry("cuEventRecordWithFlags", || record(handle, stream))
}

/// The stream and point an event waits for, if it was recorded.
fn target(event: &Event) -> Option<(Arc<Stream>, u64)> {
    event.state.lock().target.clone()
}

/// Emulates `cuEventQuery`: `CUDA_ERROR_NOT_READY` until the recorded point is passed (an event
/// never recorded is complete).
#[no_mangle]
pub extern "C" fn cuEventQuery(handle: sys::CUevent) -> CUresult {
    entry("cuEventQuery", || {
        current()?;
        let event = event(handle)?;
        crate::counters::count(Counter::queries);
        sticky()?;
        match target(&event) {
            Some((stream, seq)) if !stream.passed(seq) => Err(E::CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    })
}

/// Emulates `cuEventSynchronize`: waits for the recorded point, then checks every allocation's
/// guards and returns a sticky fault if one was reported.
#[no_mangle]
pub extern "C" fn cuEventSynchronize(handle: sys::CUevent) -> CUresult {
    entry("cuEventSynchronize", || {
        current()?;
        let event = event(handle)?;
        crate::counters::host_sync(Counter::event_syncs, "cuEventSynchronize");
        if let Some((stream, seq)) = target(&event) {
            stream.wait_for(seq);
        }
        after_synchronisation()
    })
}

fn elapsed(ms: *mut f32, start: sys::CUevent, end: sys::CUevent) -> Res {
    current()?;
    let (start, end) = (event(start)?, event(end)?);
    if start.flags & DISABLE_TIMING != 0 || end.flags & DISABLE_TIMING != 0 {
        crate::say("cuEventElapsedTime: an event was created with CU_EVENT_DISABLE_TIMING");
        return Err(E::CUDA_ERROR_INVALID_HANDLE);
    }
    let time = |e: &Event| -> Result<Instant, CUresult> {
        let s = e.state.lock();
        match (&s.target, s.time) {
            (None, _) => Err(E::CUDA_ERROR_INVALID_HANDLE),
            (Some(_), None) => Err(E::CUDA_ERROR_NOT_READY),
            (Some(_), Some(t)) => Ok(t),
        }
    };
    let (t0, t1) = (time(&start)?, time(&end)?);
    let millis = if t1 >= t0 {
        (t1 - t0).as_secs_f64() * 1e3
    } else {
        -((t0 - t1).as_secs_f64() * 1e3)
    };
    // SAFETY: out-parameter.
    unsafe { put(ms, millis as f32) }
}

/// Emulates `cuEventElapsedTime`: milliseconds between the host times at which the workers passed
/// the two events (host clock, not GPU time).
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: sys::CUevent,
    end: sys::CUevent,
) -> CUresult {
    entry("cuEventElapsedTime", || elapsed(ms, start, end))
}

/// Emulates `cuEventElapsedTime_v2`: as [`cuEventElapsedTime`].
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: sys::CUevent,
    end: sys::CUevent,
) -> CUresult {
    entry("cuEventElapsedTime_v2", || elapsed(ms, start, end))
}

/// Emulates `cuStreamWaitEvent`: the stream's worker waits for the event's recorded point as of
/// this call (a later record does not change the wait).
#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(
    stream: sys::CUstream,
    handle: sys::CUevent,
    flags: u32,
) -> CUresult {
    entry("cuStreamWaitEvent", || {
        current()?;
        let stream = lookup(stream)?;
        let event = event(handle)?;
        if flags > 1 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        crate::counters::count(Counter::stream_waits);
        // The wait is for the event's state now; a later record does not change it.
        if let Some((other, seq)) = target(&event) {
            if !Arc::ptr_eq(&other, &stream) {
                stream.enqueue(Box::new(move || other.wait_for(seq)));
            }
        }
        Ok(())
    })
}
