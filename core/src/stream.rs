//! Streams and events: the execution model shared by every device.
//!
//! Work is issued to a stream in order; an [`Event`] marks a point on a stream; another stream
//! can wait for an event. On the CPU the *compute* stream is the calling thread — its kernels
//! have finished when they return, so an event recorded on it is already complete — and a
//! *worker* stream (used as a communication stream) is a thread that runs queued jobs in order.
//! On CUDA the same calls map to CUDA streams and events, so code written against this module
//! (the DDP reducer above all) drives both devices.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::{Device, Error, Result};

/// A host event: the instant it completed, once it has.
#[derive(Debug, Default)]
struct HostEvent {
    completed_at: Mutex<Option<Instant>>,
    cv: Condvar,
}

/// A point on a stream; complete once all work issued before it has finished.
///
/// On the CPU an event is a completion flag with the instant it was set, so the time between
/// two events can be measured as on a device.
#[derive(Clone, Debug)]
pub struct Event {
    host: Arc<HostEvent>,
}

impl Event {
    /// A host event that is not complete yet; [`Event::complete`] completes it.
    pub fn pending() -> Self {
        Event {
            host: Arc::new(HostEvent::default()),
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
        Device::Cpu
    }

    /// Marks a host event complete (stamping the instant, the first time) and wakes every
    /// waiter.
    pub fn complete(&self) {
        let mut done = self.host.completed_at.lock();
        if done.is_none() {
            *done = Some(Instant::now());
        }
        self.host.cv.notify_all();
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> bool {
        self.host.completed_at.lock().is_some()
    }

    /// Blocks the calling thread until the event is complete.
    pub fn synchronize(&self) -> Result<()> {
        let mut done = self.host.completed_at.lock();
        while done.is_none() {
            self.host.cv.wait(&mut done);
        }
        Ok(())
    }

    /// Blocks until the event is complete or `timeout` has passed; returns whether it completed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut done = self.host.completed_at.lock();
        while done.is_none() {
            if self.host.cv.wait_until(&mut done, deadline).timed_out() {
                return Ok(done.is_some());
            }
        }
        Ok(true)
    }

    /// The host instant at which a host event completed (`None` while pending). Timelines use
    /// it to place host events on the wall clock.
    pub fn completed_at(&self) -> Option<Instant> {
        *self.host.completed_at.lock()
    }

    /// The time from this event to `end`, both complete and of one device: how long the work
    /// issued between them took on the stream(s) they were recorded on.
    pub fn elapsed_until(&self, end: &Event) -> Result<Duration> {
        self.device()
            .same_as(end.device(), "Event::elapsed_until")?;
        match (self.completed_at(), end.completed_at()) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a)),
            _ => Err(Error::invalid(
                "Event::elapsed_until",
                "both events must be complete; synchronize them first",
            )),
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
    /// finished when they return).
    pub fn compute(device: Device) -> Result<Self> {
        device.ensure_available()?;
        match device {
            Device::Cpu => Ok(Stream {
                inner: Arc::new(StreamInner {
                    device,
                    name: "compute".into(),
                    kind: StreamKind::Compute,
                }),
            }),
            Device::Cuda(_) => Err(device.unavailable("CUDA streams")),
        }
    }

    /// A second stream on `device` (a communication stream, say), named `name`: on the CPU a
    /// worker thread that runs queued jobs in order.
    pub fn new_on(device: Device, name: &str) -> Result<Self> {
        device.ensure_available()?;
        match device {
            Device::Cpu => Stream::worker(name).map_err(|e| {
                Error::invalid("Stream::new_on", format!("cannot start thread {name}: {e}"))
            }),
            Device::Cuda(_) => Err(device.unavailable("CUDA streams")),
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
        }
        Ok(())
    }

    /// An event that completes when all work issued so far has finished.
    pub fn record_event(&self) -> Result<Event> {
        if self.is_compute() {
            return Ok(Event::completed());
        }
        let event = Event::pending();
        let marker = event.clone();
        self.enqueue(move || marker.complete())?;
        Ok(event)
    }

    /// Makes work issued after this call wait for `event`. On a CPU compute stream the
    /// calling thread blocks until the event completes.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        if self.is_compute() {
            event.synchronize()
        } else {
            let event = event.clone();
            // A failed wait has nothing to report to: the waiting job only orders the queue.
            self.enqueue(move || drop(event.synchronize()))
        }
    }

    /// Blocks until all work issued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.record_event()?.synchronize()
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
