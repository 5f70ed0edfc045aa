//! The watchdog thread of an NCCL group: turns silence into errors.
//!
//! Every tick (at most 50 ms, and at most half a heartbeat interval) it
//!
//! 1. walks the collectives in flight in issue order: notes when each is seen starting on the
//!    comm stream (its start event completed) and settles each that has finished (its end
//!    event completed), releasing the tensors it held; tells the heartbeat how far it got;
//! 2. asks NCCL for an asynchronous error (`ncclCommGetAsyncError`);
//! 3. asks the heartbeat monitor for a verdict on the other ranks, the store, and this rank's
//!    oldest collective (see `monitor`).
//!
//! A verdict fails the group (`Shared::fail`): collectives in flight fail with it, the other
//! ranks and the launcher learn of it, and the communicator is aborted. An NCCL error without
//! a verdict first gives the heartbeats up to `stale_after` + one interval to name the rank
//! behind it (a peer whose process died makes NCCL report a remote error before the store has
//! noticed), then fails the group with NCCL's own message.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::comm::CommFailure;
use super::monitor::InFlight;
use super::Shared;
use crate::DistError;

/// Longest pause between two rounds.
const MAX_TICK: Duration = Duration::from_millis(50);

/// Runs until the group stops.
pub(super) fn run(shared: &Shared) {
    let timing = shared.monitor.timing();
    let tick = (timing.interval / 2).min(MAX_TICK);
    // CUDA event queries need the device's context on this thread.
    let _ = shared.cuda.bind("NCCL watchdog");
    let mut nccl_error_since: Option<Instant> = None;
    while !shared.stop.load(Ordering::SeqCst) {
        if shared.broken().is_none() {
            round(shared, &mut nccl_error_since);
        }
        std::thread::sleep(tick);
    }
}

/// One round; see the module docs.
fn round(shared: &Shared, nccl_error_since: &mut Option<Instant>) {
    let now = Instant::now();
    let in_flight = progress(shared, now);
    let nccl_error = match shared.comm.check() {
        Ok(_) => None,
        Err(CommFailure::Nccl(text)) => Some(text),
        // Aborted or interrupted: the group is failing already.
        Err(_) => None,
    };
    if let Some(verdict) = shared.monitor.assess(now, in_flight, shared.group.timeout) {
        shared.fail(verdict);
        return;
    }
    let Some(text) = nccl_error else {
        *nccl_error_since = None;
        return;
    };
    let first = *nccl_error_since.get_or_insert(now);
    let timing = shared.monitor.timing();
    if now.saturating_duration_since(first) >= timing.stale_after + timing.interval {
        let op = match in_flight {
            Some(f) => format!("{} (collective #{})", f.desc, f.seq),
            None => "between collectives".to_string(),
        };
        shared.fail(DistError::Nccl {
            rank: shared.rank,
            op,
            detail: format!("{text} (no rank reported a failure)"),
        });
    }
}

/// Settles the collectives that finished, notes the ones that started, and returns the oldest
/// collective still in flight (or being issued).
fn progress(shared: &Shared, now: Instant) -> Option<InFlight> {
    let (done, _) = shared.retire_finished();
    let (started, oldest) = {
        let mut pending = shared.pending.lock();
        let mut started = done;
        for p in pending.iter_mut() {
            if p.started_at.is_none() && p.start.is_complete() {
                p.started_at = Some(now);
            }
            if p.started_at.is_none() {
                break;
            }
            started = p.seq;
        }
        let oldest = pending.front().map(|p| InFlight {
            seq: p.seq,
            desc: p.desc,
            started_at: p.started_at,
        });
        (started, oldest)
    };
    shared.monitor.record_progress(started, done);
    oldest.or_else(|| {
        shared.issuing.lock().map(|i| InFlight {
            seq: i.seq,
            desc: i.desc,
            started_at: Some(i.since),
        })
    })
}
