//! Streams and events: the execution model shared by every device.
//!
//! Work is issued to a stream in order; an [`Event`] marks a point on a stream; another stream
//! can wait for an event. On the CPU the *compute* stream is the calling thread — its kernels
//! have finished when they return, so an event recorded on it is already complete — and a
//! *worker* stream (used as a communication stream) is a thread that runs queued jobs in order.
//! On CUDA the same calls map to CUDA streams and events (with timing, so the time between two
//! events can be measured), so code written against this module (the DDP reducer above all)
//! drives both devices.
//!
//! Waiting across kinds works too: a CUDA stream told to wait for a host event blocks the
//! calling thread until the host event completes (the device cannot wait for a host flag); a
//! host worker told to wait for a CUDA event waits on the device event before its next job.
//!
//! **Event objects are reused.** Creating and destroying a CUDA event costs host time on every
//! call (a backward records one per parameter that has a hook), so the object behind an
//! [`Event`] goes back to a small pool (one per device, and one for host events) when its last
//! handle is dropped, and [`Stream::record_event`] records into a pooled object before it
//! creates one. Nothing can observe the reuse: an object is only recorded again once no handle
//! to its earlier recording is left, and a CUDA stream that waited for an event keeps waiting
//! for the recording it was told about. [`events_created`] counts the objects made.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream};
use parking_lot::{Condvar, Mutex};

use crate::cuda::device::{device as cuda_device, driver_err};
use crate::cuda::sanitizer;
use crate::{Device, Error, Result};

/// Idle event objects kept per pool: more than a ResNet-50's 161 parameters, so a backward
/// whose hooks hold every parameter's event until the end still reuses all of them.
const KEPT_PER_POOL: usize = 512;

/// Event objects (host flags and CUDA events) created since the process started.
static EVENTS_CREATED: AtomicU64 = AtomicU64::new(0);

/// How many event objects (host completion flags and CUDA events) this process has created.
/// Reused objects are not counted, so the number stays flat over training steps that record
/// the same events: a diagnostic for tests and benchmarks.
pub fn events_created() -> u64 {
    EVENTS_CREATED.load(Ordering::Relaxed)
}

/// An event object that goes back to its pool when the last handle to it is dropped.
struct Pooled<T> {
    /// Always `Some` until the drop hands it back.
    item: Option<T>,
    release: fn(T),
}

impl<T> Pooled<T> {
    fn new(item: T, release: fn(T)) -> Self {
        Pooled {
            item: Some(item),
            release,
        }
    }
}

impl<T> std::ops::Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item
            .as_ref()
            .expect("a pooled event is present until it is dropped")
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            (self.release)(item);
        }
    }
}

/// Idle host events.
static HOST_EVENTS: Mutex<Vec<HostEvent>> = Mutex::new(Vec::new());

/// Idle CUDA events (with timing), per device ordinal.
static CUDA_EVENTS: Mutex<BTreeMap<usize, Vec<CudaEvent>>> = Mutex::new(BTreeMap::new());

fn release_host(event: HostEvent) {
    let mut free = HOST_EVENTS.lock();
    if free.len() < KEPT_PER_POOL {
        free.push(event);
    }
}

fn release_cuda(event: DeviceEvent) {
    let Device::Cuda(ordinal) = event.device else {
        return;
    };
    let mut pools = CUDA_EVENTS.lock();
    let free = pools.entry(ordinal).or_default();
    if free.len() < KEPT_PER_POOL {
        free.push(event.event);
    }
}

/// A host event: the instant it completed, once it has.
#[derive(Debug, Default)]
struct HostEvent {
    completed_at: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl HostEvent {
    /// A pending host event, from the pool when it holds one.
    fn take() -> Pooled<HostEvent> {
        let reused = HOST_EVENTS.lock().pop();
        let event = match reused {
            Some(event) => {
                // No handle to its last use is left: nobody waits on it.
                *event.completed_at.lock() = None;
                event
            }
            None => {
                EVENTS_CREATED.fetch_add(1, Ordering::Relaxed);
                HostEvent::default()
            }
        };
        Pooled::new(event, release_host)
    }
}

/// A CUDA event recorded on a stream of `device`.
struct DeviceEvent {
    device: Device,
    event: CudaEvent,
}

impl DeviceEvent {
    fn err(&self, op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        driver_err(op, self.device)
    }

    /// `stream`'s current point, in a pooled event of `device` (created when none is idle).
    fn record(device: Device, stream: &CudaStream) -> Result<Pooled<DeviceEvent>> {
        const OP: &str = "Stream::record_event";
        let err = driver_err(OP, device);
        let reused = match device {
            Device::Cuda(n) => CUDA_EVENTS.lock().get_mut(&n).and_then(Vec::pop),
            Device::Cpu => None,
        };
        let event = match reused {
            Some(event) => event,
            None => {
                let event = stream
                    .context()
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(&err)?;
                EVENTS_CREATED.fetch_add(1, Ordering::Relaxed);
                event
            }
        };
        let pooled = Pooled::new(DeviceEvent { device, event }, release_cuda);
        // Recording again moves the event to the new point; a stream that waited for it
        // earlier waits for the earlier point (CUDA takes the recording at the wait).
        pooled.event.record(stream).map_err(&err)?;
        crate::cuda::sanitizer::event_recorded(&pooled.event, stream);
        Ok(pooled)
    }
}

#[derive(Clone)]
enum EventKind {
    Host(Arc<Pooled<HostEvent>>),
    Cuda(Arc<Pooled<DeviceEvent>>),
}

/// A point on a stream; complete once all work issued before it has finished.
///
/// On the CPU an event is a completion flag with the instant it was set; on CUDA a CUDA event
/// with timing. Either way the time between two events of one device can be measured.
#[derive(Clone)]
pub struct Event {
    kind: EventKind,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Event({}, complete: {})",
            self.device(),
            self.is_complete()
        )
    }
}

impl Event {
    /// A host event that is not complete yet; [`Event::complete`] completes it.
    pub fn pending() -> Self {
        Event {
            kind: EventKind::Host(Arc::new(HostEvent::take())),
        }
    }

    /// A host event that is already complete (stamped now).
    pub fn completed() -> Self {
        let event = Event::pending();
        event.complete();
        event
    }

    /// The device whose stream the event belongs to.
    pub fn device(&self) -> Device {
        match &self.kind {
            EventKind::Host(_) => Device::Cpu,
            EventKind::Cuda(e) => e.device,
        }
    }

    /// Marks a host event complete (stamping the instant, the first time) and wakes every
    /// waiter. A device event completes when its stream reaches it; this does nothing to it.
    pub fn complete(&self) {
        if let EventKind::Host(h) = &self.kind {
            let mut done = h.completed_at.lock();
            if done.is_none() {
                *done = Some(Instant::now());
            }
            h.cv.notify_all();
        }
    }

    /// Whether the work before the event has finished. A device event whose stream failed
    /// reads as complete; [`Event::synchronize`] reports the failure.
    pub fn is_complete(&self) -> bool {
        match &self.kind {
            EventKind::Host(h) => h.completed_at.lock().is_some(),
            EventKind::Cuda(e) => {
                let done = e.event.try_is_complete();
                if let Ok(true) = done {
                    sanitizer::event_completed(&e.event);
                }
                done.unwrap_or(true)
            }
        }
    }

    /// Blocks the calling thread until the event is complete.
    pub fn synchronize(&self) -> Result<()> {
        match &self.kind {
            EventKind::Host(h) => {
                let mut done = h.completed_at.lock();
                while done.is_none() {
                    h.cv.wait(&mut done);
                }
                Ok(())
            }
            EventKind::Cuda(e) => {
                e.event.synchronize().map_err(e.err("Event::synchronize"))?;
                sanitizer::event_completed(&e.event);
                Ok(())
            }
        }
    }

    /// Blocks until the event is complete or `timeout` has passed; returns whether it completed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        match &self.kind {
            EventKind::Host(h) => {
                let mut done = h.completed_at.lock();
                while done.is_none() {
                    if h.cv.wait_until(&mut done, deadline).timed_out() {
                        return Ok(done.is_some());
                    }
                }
                Ok(true)
            }
            EventKind::Cuda(e) => loop {
                if e.event
                    .try_is_complete()
                    .map_err(e.err("Event::wait_timeout"))?
                {
                    sanitizer::event_completed(&e.event);
                    return Ok(true);
                }
                if Instant::now() >= deadline {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_micros(50));
            },
        }
    }

    /// The host instant at which a host event completed (`None` while pending, and always for
    /// device events, whose times are only known relative to each other).
    pub fn completed_at(&self) -> Option<Instant> {
        match &self.kind {
            EventKind::Host(h) => *h.completed_at.lock(),
            EventKind::Cuda(_) => None,
        }
    }

    /// The CUDA event behind a device event (`None` for a host event), for the runtime's own
    /// ordering (a buffer's free waits for it).
    pub(crate) fn cuda_event(&self) -> Option<&CudaEvent> {
        match &self.kind {
            EventKind::Cuda(e) => Some(&e.event),
            EventKind::Host(_) => None,
        }
    }

    /// The time from this event to `end`, both complete and of one device: how long the work
    /// issued between them took on the stream(s) they were recorded on. Device events are
    /// waited for.
    pub fn elapsed_until(&self, end: &Event) -> Result<Duration> {
        const OP: &str = "Event::elapsed_until";
        self.device().same_as(end.device(), OP)?;
        match (&self.kind, &end.kind) {
            (EventKind::Cuda(a), EventKind::Cuda(b)) => {
                let ms = a.event.elapsed_ms(&b.event).map_err(a.err(OP))?;
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            _ => match (self.completed_at(), end.completed_at()) {
                (Some(a), Some(b)) => Ok(b.saturating_duration_since(a)),
                _ => Err(Error::invalid(
                    OP,
                    "both events must be complete; synchronize them first",
                )),
            },
        }
    }
}

type Job = Box<dyn FnOnce() + Send + 'static>;

enum StreamKind {
    /// Kernels run on the thread that issues them.
    Compute,
    /// A thread that runs queued jobs in order.
    Worker {
        queue: Mutex<Option<Sender<Job>>>,
        thread: Mutex<Option<JoinHandle<()>>>,
    },
    /// A CUDA stream.
    Cuda(Arc<CudaStream>),
}

struct StreamInner {
    device: Device,
    name: String,
    kind: StreamKind,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if let StreamKind::Worker { queue, thread } = &self.kind {
            // Closing the queue lets the worker finish what it has and exit.
            queue.lock().take();
            if let Some(handle) = thread.lock().take() {
                if handle.thread().id() != std::thread::current().id() {
                    let _ = handle.join();
                }
            }
        }
    }
}

/// An ordered queue of work on a device.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({} on {})", self.inner.name, self.inner.device)
    }
}

impl Stream {
    /// The compute stream of `device`: on the CPU, the calling thread (its kernels have
    /// finished when they return); on CUDA, the stream every op of that device runs on.
    pub fn compute(device: Device) -> Result<Self> {
        let kind = match device {
            Device::Cpu => StreamKind::Compute,
            Device::Cuda(n) => StreamKind::Cuda(cuda_device(n)?.compute_stream().clone()),
        };
        Ok(Stream {
            inner: Arc::new(StreamInner {
                device,
                name: "compute".into(),
                kind,
            }),
        })
    }

    /// A second stream on `device` (a communication stream, say), named `name`: on the CPU a
    /// worker thread that runs queued jobs in order, on CUDA a new non-blocking CUDA stream.
    pub fn new_on(device: Device, name: &str) -> Result<Self> {
        match device {
            Device::Cpu => Stream::worker(name).map_err(|e| {
                Error::invalid("Stream::new_on", format!("cannot start thread {name}: {e}"))
            }),
            Device::Cuda(n) => {
                let stream = cuda_device(n)?.new_stream()?;
                sanitizer::name_stream(&stream, &format!("{name} ({device})"));
                Ok(Stream {
                    inner: Arc::new(StreamInner {
                        device,
                        name: name.to_string(),
                        kind: StreamKind::Cuda(stream),
                    }),
                })
            }
        }
    }

    /// A CPU stream backed by its own thread, named `name` (visible in debuggers and traces).
    pub fn worker(name: &str) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking job must not take the stream down: later jobs (and the events
                    // that waiters block on) still run. The job's own result channel reports it.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })?;
        Ok(Stream {
            inner: Arc::new(StreamInner {
                device: Device::Cpu,
                name: name.to_string(),
                kind: StreamKind::Worker {
                    queue: Mutex::new(Some(tx)),
                    thread: Mutex::new(Some(thread)),
                },
            }),
        })
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether work issued here runs on the caller's thread.
    pub fn is_compute(&self) -> bool {
        matches!(self.inner.kind, StreamKind::Compute)
    }

    /// The CUDA stream, for kernel launches and libraries (`None` on the CPU).
    pub fn cuda_stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.inner.kind {
            StreamKind::Cuda(s) => Some(s),
            _ => None,
        }
    }

    /// Issues a host job after everything already issued (host streams only). On a CPU
    /// compute stream it runs now.
    pub fn enqueue(&self, job: impl FnOnce() + Send + 'static) -> Result<()> {
        match &self.inner.kind {
            StreamKind::Compute => job(),
            StreamKind::Worker { queue, .. } => {
                let queue = queue.lock();
                match queue.as_ref() {
                    Some(tx) => {
                        if let Err(returned) = tx.send(Box::new(job)) {
                            // The worker has gone; run the job here rather than drop it.
                            (returned.0)();
                        }
                    }
                    None => job(),
                }
            }
            StreamKind::Cuda(_) => {
                return Err(Error::invalid(
                    "Stream::enqueue",
                    format!(
                        "host jobs run on host streams; {} is a CUDA stream",
                        self.inner.name
                    ),
                ))
            }
        }
        Ok(())
    }

    /// An event that completes when all work issued so far has finished.
    pub fn record_event(&self) -> Result<Event> {
        match &self.inner.kind {
            StreamKind::Compute => Ok(Event::completed()),
            StreamKind::Worker { .. } => {
                let event = Event::pending();
                let marker = event.clone();
                self.enqueue(move || marker.complete())?;
                Ok(event)
            }
            StreamKind::Cuda(stream) => Ok(Event {
                kind: EventKind::Cuda(Arc::new(DeviceEvent::record(self.inner.device, stream)?)),
            }),
        }
    }

    /// Makes work issued after this call wait for `event`, without blocking the calling thread
    /// where the device allows it: a CUDA stream waits for a CUDA event on the device; a CPU
    /// worker waits before its next job; a CPU compute stream (the calling thread) and a CUDA
    /// stream told to wait for a host event block the calling thread until the event completes.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        match (&self.inner.kind, &event.kind) {
            (StreamKind::Cuda(stream), EventKind::Cuda(e)) => {
                if e.device != self.inner.device {
                    return Err(Error::DeviceMismatch {
                        op: "Stream::wait_event",
                        lhs: self.inner.device,
                        rhs: e.device,
                    });
                }
                stream
                    .wait(&e.event)
                    .map_err(driver_err("Stream::wait_event", self.inner.device))?;
                sanitizer::stream_waited(stream, &e.event);
                Ok(())
            }
            (StreamKind::Compute, _) | (StreamKind::Cuda(_), EventKind::Host(_)) => {
                event.synchronize()
            }
            (StreamKind::Worker { .. }, _) => {
                let event = event.clone();
                // A failed wait has nothing to report to: the waiting job only orders the queue;
                // the failed device work is reported by whoever waits for its result.
                self.enqueue(move || drop(event.synchronize()))
            }
        }
    }

    /// Blocks until all work issued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner.kind {
            StreamKind::Cuda(stream) => sanitizer::synchronized(stream, || stream.synchronize())
                .map_err(driver_err("Stream::synchronize", self.inner.device)),
            _ => self.record_event()?.synchronize(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn worker_runs_jobs_in_issue_order_and_events_mark_points() {
        let stream = Stream::worker("test-comm").unwrap();
        let counter = Arc::new(AtomicUsize::new(0));
        let gate = Event::pending();
        stream.wait_event(&gate).unwrap();
        let c = counter.clone();
        stream
            .enqueue(move || assert_eq!(c.fetch_add(1, Ordering::SeqCst), 0))
            .unwrap();
        let first = stream.record_event().unwrap();
        let c = counter.clone();
        stream
            .enqueue(move || assert_eq!(c.fetch_add(1, Ordering::SeqCst), 1))
            .unwrap();
        assert!(
            !first.wait_timeout(Duration::from_millis(20)).unwrap(),
            "must wait for the gate"
        );
        gate.complete();
        first.synchronize().unwrap();
        stream.synchronize().unwrap();
        assert_eq!(counter.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn compute_stream_events_are_complete_at_once() {
        let s = Stream::compute(Device::Cpu).unwrap();
        assert!(s.record_event().unwrap().is_complete());
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_worker() {
        let stream = Stream::worker("panicky").unwrap();
        stream.enqueue(|| panic!("boom")).unwrap();
        assert!(stream
            .record_event()
            .unwrap()
            .wait_timeout(Duration::from_secs(5))
            .unwrap());
    }

    #[test]
    fn a_reused_event_object_starts_over_and_an_event_held_elsewhere_is_not_reused() {
        let stream = Stream::worker("reuse").unwrap();
        for _ in 0..50 {
            // Pending events from the pool are pending, whatever their last use was.
            let pending = Event::pending();
            assert!(!pending.is_complete());
            assert_eq!(pending.completed_at(), None);
            drop(pending);
            let done = Stream::compute(Device::Cpu)
                .unwrap()
                .record_event()
                .unwrap();
            assert!(done.is_complete());
            // A clone keeps the object: recording more events never completes or resets it.
            let gate = Event::pending();
            let held = gate.clone();
            drop(gate);
            stream.wait_event(&held).unwrap();
            let after = stream.record_event().unwrap();
            for _ in 0..4 {
                let other = Event::pending();
                other.complete();
            }
            assert!(!held.is_complete(), "a held event was handed out again");
            assert!(!after.wait_timeout(Duration::from_millis(1)).unwrap());
            held.complete();
            after.synchronize().unwrap();
        }
    }

    #[test]
    fn elapsed_time_between_host_events_is_measured() {
        let stream = Stream::worker("timed").unwrap();
        let start = stream.record_event().unwrap();
        stream
            .enqueue(|| std::thread::sleep(Duration::from_millis(20)))
            .unwrap();
        let end = stream.record_event().unwrap();
        end.synchronize().unwrap();
        let took = start.elapsed_until(&end).unwrap();
        assert!(took >= Duration::from_millis(20), "{took:?}");
        let pending = Event::pending();
        assert!(start.elapsed_until(&pending).is_err());
    }
}
