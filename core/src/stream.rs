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

use crate::Device;

/// A point on a stream; complete once all work issued before it has finished.
#[derive(Clone, Debug)]
pub struct Event {
    state: Arc<(Mutex<bool>, Condvar)>,
}

impl Event {
    /// An event that is not complete yet; [`Event::complete`] completes it.
    pub fn pending() -> Self {
        Event {
            state: Arc::new((Mutex::new(false), Condvar::new())),
        }
    }

    /// An event that is already complete.
    pub fn completed() -> Self {
        Event {
            state: Arc::new((Mutex::new(true), Condvar::new())),
        }
    }

    /// Marks the event complete and wakes every waiter.
    pub fn complete(&self) {
        let (flag, cv) = &*self.state;
        *flag.lock() = true;
        cv.notify_all();
    }

    /// Whether the work before the event has finished.
    pub fn is_complete(&self) -> bool {
        *self.state.0.lock()
    }

    /// Blocks the calling thread until the event is complete.
    pub fn synchronize(&self) {
        let (flag, cv) = &*self.state;
        let mut done = flag.lock();
        while !*done {
            cv.wait(&mut done);
        }
    }

    /// Blocks until the event is complete or `timeout` has passed; returns whether it completed.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (flag, cv) = &*self.state;
        let mut done = flag.lock();
        while !*done {
            if cv.wait_until(&mut done, deadline).timed_out() {
                return *done;
            }
        }
        true
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
    /// The compute stream of `device`: on the CPU, the calling thread.
    pub fn compute(device: Device) -> Self {
        Stream {
            inner: Arc::new(StreamInner {
                device,
                name: "compute".into(),
                kind: StreamKind::Compute,
            }),
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

    /// Issues `job` after everything already issued. On a compute stream it runs now.
    pub fn enqueue(&self, job: impl FnOnce() + Send + 'static) {
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
    }

    /// An event that completes when all work issued so far has finished.
    pub fn record_event(&self) -> Event {
        if self.is_compute() {
            return Event::completed();
        }
        let event = Event::pending();
        let marker = event.clone();
        self.enqueue(move || marker.complete());
        event
    }

    /// Makes work issued after this call wait for `event`. On a CPU compute stream the
    /// calling thread blocks until the event completes.
    pub fn wait_event(&self, event: &Event) {
        if self.is_compute() {
            event.synchronize();
        } else {
            let event = event.clone();
            self.enqueue(move || event.synchronize());
        }
    }

    /// Blocks until all work issued so far has finished.
    pub fn synchronize(&self) {
        self.record_event().synchronize();
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
        stream.wait_event(&gate);
        let c = counter.clone();
        stream.enqueue(move || assert_eq!(c.fetch_add(1, Ordering::SeqCst), 0));
        let first = stream.record_event();
        let c = counter.clone();
        stream.enqueue(move || assert_eq!(c.fetch_add(1, Ordering::SeqCst), 1));
        assert!(
            !first.wait_timeout(Duration::from_millis(20)),
            "must wait for the gate"
        );
        gate.complete();
        first.synchronize();
        stream.synchronize();
        assert_eq!(counter.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn compute_stream_events_are_complete_at_once() {
        let s = Stream::compute(Device::Cpu);
        assert!(s.record_event().is_complete());
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_worker() {
        let stream = Stream::worker("panicky").unwrap();
        stream.enqueue(|| panic!("boom"));
        assert!(stream.record_event().wait_timeout(Duration::from_secs(5)));
    }
}
