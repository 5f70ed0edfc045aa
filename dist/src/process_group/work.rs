//! `Work`: the handle a collective returns at once, completed later by the comm stream.
//!
//! A collective is issued to the group's comm stream and runs there in issue order; the caller
//! keeps the `Work` and decides when to block on it. The handle carries the collective's
//! [`Event`], so stream-ordered code (the DDP reducer) can make another stream wait for it
//! without blocking a thread — the same contract a CUDA/NCCL backend would offer.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tandem_core::Event;

use super::CollectiveDesc;
use crate::Result;

struct WorkInner {
    seq: u64,
    desc: CollectiveDesc,
    event: Event,
    result: Mutex<Option<Result<()>>>,
}

/// The pending result of one collective. Cheap to clone; every clone sees the same outcome.
#[derive(Clone)]
pub struct Work {
    inner: Arc<WorkInner>,
}

impl Work {
    /// A handle for collective number `seq`, not complete yet.
    pub(crate) fn new(seq: u64, desc: CollectiveDesc) -> Self {
        Work {
            inner: Arc::new(WorkInner {
                seq,
                desc,
                event: Event::pending(),
                result: Mutex::new(None),
            }),
        }
    }

    /// Records the outcome and completes the event. Called once, by the comm stream.
    pub(crate) fn finish(&self, result: Result<()>) {
        *self.inner.result.lock() = Some(result);
        self.inner.event.complete();
    }

    /// Blocks until the collective has finished and returns its outcome.
    ///
    /// This never blocks for ever: a collective gives up after the group's timeout
    /// ([`GroupConfig::timeout`](super::GroupConfig::timeout)) and fails as soon as a peer is
    /// known to be gone.
    pub fn wait(&self) -> Result<()> {
        // Poll briefly first: small collectives finish in tens of microseconds and waking a
        // sleeping thread costs about as much again. Yielding leaves the CPU to the comm
        // thread if it needs it.
        let started = std::time::Instant::now();
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

    /// Blocks for at most `timeout`. `Ok(true)`: finished successfully; `Ok(false)`: still
    /// running; `Err`: the collective failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        if self.inner.event.wait_timeout(timeout).unwrap_or(false) {
            self.outcome().map(|()| true)
        } else {
            Ok(false)
        }
    }

    /// Whether the collective has finished (successfully or not). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.inner.event.is_complete()
    }

    /// The outcome if finished, without blocking.
    pub fn try_result(&self) -> Option<Result<()>> {
        self.inner.result.lock().clone()
    }

    /// The event completed when the collective finishes; another stream may wait on it.
    pub fn event(&self) -> &Event {
        &self.inner.event
    }

    /// The collective's sequence number in its group (the first collective is #1).
    pub fn sequence_number(&self) -> u64 {
        self.inner.seq
    }

    /// What was issued.
    pub fn collective(&self) -> CollectiveDesc {
        self.inner.desc
    }

    fn outcome(&self) -> Result<()> {
        self.inner.result.lock().clone().unwrap_or(Ok(()))
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.try_result() {
            None => "pending",
            Some(Ok(())) => "done",
            Some(Err(_)) => "failed",
        };
        write!(f, "Work(#{} {}, {state})", self.inner.seq, self.inner.desc)
    }
}
