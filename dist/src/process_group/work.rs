//! `Work`: the handle a collective returns at once, completed later on the group's comm stream.
//!
//! A collective is issued to the group's comm stream and runs there in issue order; the caller
//! keeps the `Work` and decides when to wait for it. Two kinds of work exist:
//!
//! * **Host work** (CPU backends): the comm stream is a thread, and the work's [`Event`] is a
//!   host flag the thread sets when the collective is done. [`Work::wait`] blocks the calling
//!   thread until then.
//! * **Device work** (NCCL): the collective is a kernel on a CUDA comm stream, and the work's
//!   event is a CUDA event recorded after it. [`Work::wait`] does not block the host: it makes
//!   the caller's compute stream wait for that event, so kernels issued afterwards see the
//!   result, and returns at once (PyTorch's `work.wait()` on NCCL). [`Work::wait_host`] blocks
//!   the host until the collective has finished and reports its outcome. The tensors the
//!   collective reads and writes are held by the work until it is known to be done, so their
//!   memory cannot be reused under it. A barrier's `wait` blocks the host on every backend,
//!   since that is what a barrier is for.
//!
//! Either way the handle carries the event, so stream-ordered code (the DDP reducer) can make
//! another stream wait for it without blocking a thread. A device work's outcome is known
//! once its event has completed: it failed if the group's watchdog failed it before that (a
//! dead peer, a timeout, an NCCL error), else it succeeded.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_core::{Event, Stream, Tensor};

use super::CollectiveDesc;
use crate::{DistError, Result};

/// How often a host thread waiting for a device work checks whether the group's watchdog has
/// failed it (which it does before aborting the communicator).
const DEVICE_POLL: Duration = Duration::from_millis(20);

/// What a collective issued on a device stream carries besides its end event.
pub(crate) struct DeviceWork {
    /// The issuing rank (for error messages).
    pub rank: usize,
    /// The stream [`Work::wait`] orders after the collective: the caller's compute stream.
    pub compute: Stream,
    /// Recorded on the comm stream just before the collective.
    pub start: Event,
    /// The tensors the collective reads and writes, held until it is known to be done.
    pub keep_alive: Mutex<Vec<Tensor>>,
    /// Whether [`Work::wait`] blocks the host as well (a barrier's does).
    pub blocks_host: bool,
}

struct WorkInner {
    seq: u64,
    desc: CollectiveDesc,
    event: Event,
    result: Mutex<Option<Result<()>>>,
    device: Option<DeviceWork>,
}

/// The pending result of one collective. Cheap to clone; every clone sees the same outcome.
#[derive(Clone)]
pub struct Work {
    inner: Arc<WorkInner>,
}

impl Work {
    /// A host work for collective number `seq`, not complete yet.
    pub(crate) fn new(seq: u64, desc: CollectiveDesc) -> Self {
        Work {
            inner: Arc::new(WorkInner {
                seq,
                desc,
                event: Event::pending(),
                result: Mutex::new(None),
                device: None,
            }),
        }
    }

    /// A device work for collective number `seq`, complete when `end` (recorded on the comm
    /// stream after the collective) is.
    pub(crate) fn on_device(
        seq: u64,
        desc: CollectiveDesc,
        end: Event,
        device: DeviceWork,
    ) -> Self {
        Work {
            inner: Arc::new(WorkInner {
                seq,
                desc,
                event: end,
                result: Mutex::new(None),
                device: Some(device),
            }),
        }
    }

    /// Records the outcome and completes the event of a host work. Called once, by the comm
    /// stream.
    pub(crate) fn finish(&self, result: Result<()>) {
        *self.inner.result.lock() = Some(result);
        self.inner.event.complete();
    }

    /// Settles a device work's outcome (the first settlement wins) and releases the tensors
    /// it held. Called by the group's watchdog: with `Ok` once the end event has completed,
    /// with the failure when it gives up on the collective (before it aborts the communicator,
    /// which completes the event).
    pub(crate) fn settle(&self, result: Result<()>) {
        {
            let mut slot = self.inner.result.lock();
            if slot.is_none() {
                *slot = Some(result);
            }
        }
        if let Some(device) = &self.inner.device {
            device.keep_alive.lock().clear();
        }
    }

    /// Waits for the collective.
    ///
    /// * Host work: blocks until the collective has finished and returns its outcome.
    /// * Device work: makes the caller's compute stream wait for the collective and returns
    ///   at once, without blocking the host; an error means the collective is already known
    ///   to have failed. Failures found later surface in [`Work::wait_host`], in the group's
    ///   next collective, and through the group's watchdog. A barrier's `wait` blocks the host
    ///   (as [`Work::wait_host`]).
    ///
    /// This never blocks for ever: a collective gives up after the group's timeout
    /// ([`GroupConfig::timeout`](super::GroupConfig::timeout)) and fails as soon as a peer is
    /// known to be gone.
    pub fn wait(&self) -> Result<()> {
        let Some(device) = &self.inner.device else {
            return self.wait_host_work();
        };
        if let Some(Err(e)) = self.inner.result.lock().clone() {
            return Err(e);
        }
        if device.blocks_host {
            return self.wait_host();
        }
        device.compute.wait_event(&self.inner.event).map_err(|e| {
            DistError::tensor(
                device.rank,
                format!(
                    "{} (collective #{}): making the compute stream wait",
                    self.inner.desc.kind.name(),
                    self.inner.seq
                ),
                e,
            )
        })
    }

    /// Blocks the calling thread until the collective has finished, and returns its outcome.
    /// The same as [`Work::wait`] for host work.
    pub fn wait_host(&self) -> Result<()> {
        if self.inner.device.is_none() {
            return self.wait_host_work();
        }
        loop {
            if let Some(done) = self.wait_device(DEVICE_POLL)? {
                return done;
            }
        }
    }

    /// Blocks for at most `timeout`. `Ok(true)`: finished successfully; `Ok(false)`: still
    /// running; `Err`: the collective failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        if self.inner.device.is_none() {
            return if self.inner.event.wait_timeout(timeout).unwrap_or(false) {
                self.outcome().map(|()| true)
            } else {
                Ok(false)
            };
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(done) = self.wait_device(left.min(DEVICE_POLL))? {
                return done.map(|()| true);
            }
            if left.is_zero() {
                return Ok(false);
            }
        }
    }

    /// Whether the collective has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.inner.result.lock().is_some() || self.inner.event.is_complete()
    }

    /// The outcome if finished, without blocking.
    pub fn try_result(&self) -> Option<Result<()>> {
        if let Some(r) = self.inner.result.lock().clone() {
            return Some(r);
        }
        if self.inner.device.is_some() && self.inner.event.is_complete() {
            self.settle(Ok(()));
            return Some(self.outcome());
        }
        None
    }

    /// The event completed when the collective finishes; another stream may wait on it (a
    /// CUDA event for device work).
    pub fn event(&self) -> &Event {
        &self.inner.event
    }

    /// For device work, the event recorded on the comm stream just before the collective (so
    /// that `started().elapsed_until(event())` is the collective's time on the device).
    pub fn started(&self) -> Option<&Event> {
        self.inner.device.as_ref().map(|d| &d.start)
    }

    /// Whether the collective runs on a device stream (see the module docs).
    pub fn is_device(&self) -> bool {
        self.inner.device.is_some()
    }

    /// The collective's sequence number in its group (the first collective is #1).
    pub fn sequence_number(&self) -> u64 {
        self.inner.seq
    }

    /// What was issued.
    pub fn collective(&self) -> CollectiveDesc {
        self.inner.desc
    }

    /// How many tensors a device work still holds.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.inner
            .device
            .as_ref()
            .map_or(0, |d| d.keep_alive.lock().len())
    }

    fn outcome(&self) -> Result<()> {
        self.inner.result.lock().clone().unwrap_or(Ok(()))
    }

    /// Host work: blocks on the host event the comm thread completes.
    fn wait_host_work(&self) -> Result<()> {
        // Poll briefly first: small collectives finish in tens of microseconds and waking a
        // sleeping thread costs about as much again. Yielding leaves the CPU to the comm
        // thread if it needs it.
        let started = Instant::now();
        while started.elapsed() < Duration::from_micros(30) {
            if self.inner.event.is_complete() {
                return self.outcome();
            }
            std::thread::yield_now();
        }
        // A host event (the comm stream completes it); waiting on it cannot fail.
        let _ = self.inner.event.synchronize();
        self.outcome()
    }

    /// Device work: waits up to `slice` for the end event. `Some(outcome)` once settled or
    /// complete, `None` if still running.
    fn wait_device(&self, slice: Duration) -> Result<Option<Result<()>>> {
        if let Some(r) = self.inner.result.lock().clone() {
            return Ok(Some(r));
        }
        let complete = self.inner.event.wait_timeout(slice).map_err(|e| {
            let rank = self.inner.device.as_ref().map_or(0, |d| d.rank);
            DistError::tensor(
                rank,
                format!(
                    "{} (collective #{}): waiting for its end",
                    self.inner.desc.kind.name(),
                    self.inner.seq
                ),
                e,
            )
        })?;
        if complete {
            // The watchdog settles a collective it gives up on before it aborts the
            // communicator (the abort completes the event), so a completed event that nobody
            // settled is a success.
            self.settle(Ok(()));
            return Ok(Some(self.outcome()));
        }
        Ok(None)
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.inner.result.lock().clone() {
            None if self.is_completed() => "done",
            None => "pending",
            Some(Ok(())) => "done",
            Some(Err(_)) => "failed",
        };
        write!(f, "Work(#{} {}, {state})", self.inner.seq, self.inner.desc)
    }
}

#[cfg(test)]
mod tests {
    use super::super::describe_barrier;
    use super::*;
    use tandem_core::{DType, Device};

    /// A device-style work whose "compute stream" is a host worker and whose end event is a
    /// host event the test completes: the stream-ordering logic without a GPU.
    fn device_work(blocks_host: bool) -> (Work, Event, Stream, Tensor) {
        let end = Event::pending();
        let compute = Stream::worker("test-compute").unwrap();
        let held = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
        let work = Work::on_device(
            7,
            describe_barrier(),
            end.clone(),
            DeviceWork {
                rank: 3,
                compute: compute.clone(),
                start: Event::completed(),
                keep_alive: Mutex::new(vec![held.clone()]),
                blocks_host,
            },
        );
        (work, end, compute, held)
    }

    #[test]
    fn device_wait_orders_the_compute_stream_without_blocking_the_host() {
        let (work, end, compute, held) = device_work(false);
        let started = Instant::now();
        work.wait().unwrap();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(!work.is_completed());
        // Work issued to the compute stream after wait() runs only after the collective.
        let after = compute.record_event().unwrap();
        assert!(!after.wait_timeout(Duration::from_millis(50)).unwrap());
        assert_eq!(work.held(), 1, "the work holds the tensor");
        end.complete();
        assert!(after.wait_timeout(Duration::from_secs(5)).unwrap());
        work.wait_host().unwrap();
        assert_eq!(
            work.held(),
            0,
            "the tensor is released once the collective is known to be done"
        );
        drop(held);
        assert!(matches!(work.try_result(), Some(Ok(()))));
    }

    #[test]
    fn device_wait_host_blocks_until_the_end_event_and_reports_a_failure() {
        let (work, end, _compute, _held) = device_work(false);
        assert!(!work.wait_timeout(Duration::from_millis(30)).unwrap());
        let failing = work.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            failing.settle(Err(DistError::Config {
                rank: 3,
                problem: "peer gone".into(),
            }));
            // The abort that follows completes the event.
            end.complete();
        });
        let err = work.wait_host().unwrap_err().to_string();
        t.join().unwrap();
        assert!(err.contains("peer gone"), "{err}");
        assert!(
            work.wait().is_err(),
            "a known failure is reported by wait too"
        );
        assert!(format!("{work:?}").contains("failed"));
    }

    #[test]
    fn a_barrier_wait_blocks_the_host() {
        let (work, end, _compute, _held) = device_work(true);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            end.complete();
        });
        let started = Instant::now();
        work.wait().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(40));
        t.join().unwrap();
    }
}
