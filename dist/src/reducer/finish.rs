//! The end of a synchronised backward: launch the buckets still waiting (under
//! `find_unused_parameters`, completing them with the unreached parameters' contributions), make
//! the compute stream wait on every bucket's completion event, and queue the step's timing
//! events (filed at the next forward, or when the telemetry is read).
//!
//! The host does not wait for the reductions here: it makes the compute stream wait, which on
//! the CPU (whose compute stream is the calling thread) means waiting, and on CUDA means that
//! the kernels issued after backward — the optimizer's — run after the buckets are reduced while
//! the host goes on. The collectives' outcomes are reported here when known (always on the CPU;
//! failures at issue on a device backend) and otherwise at the next forward. The one exception
//! is `find_unused_parameters`: restoring the gradients that no rank reached needs the users'
//! count on the host, so the host waits for that small all-reduce (issued after the buckets), as
//! PyTorch's DDP does.

use tandem_autograd::BackwardSummary;
use tandem_core::{Event, Tensor};

use super::accounting;
use super::telemetry::{PendingBucket, PendingStep};
use super::unused::UnreachedHere;
use super::{Reducer, State};
use crate::{DistError, Result, Work};

/// The unreached parameters of this rank and the all-reduce counting each parameter's users.
type Unreached = (UnreachedHere, (Tensor, Work));

/// What waiting for the launched buckets gave: their collectives, their timing events, and the
/// first error met.
struct Waited {
    works: Vec<Work>,
    buckets: Vec<PendingBucket>,
    first_error: Option<DistError>,
}

impl Reducer {
    pub(super) fn on_backward_finished(&self, _summary: &BackwardSummary) -> Result<()> {
        let rank = self.group.rank();
        let mut state = self.state.lock();
        let path = |p: usize| self.params[p].0.clone();
        if !state.sync {
            state.pass.forward_through_ddp = false;
            let misreduced = accounting::check(rank, &state.layout.buckets, None, path);
            state
                .layout
                .buckets
                .iter_mut()
                .for_each(|b| b.reductions = 0);
            return misreduced.map_or(Ok(()), Err);
        }
        let stream_err = |e| DistError::tensor(rank, "ending the backward of DDP", e);
        let backward_end = self.compute.record_event().map_err(stream_err)?;
        let unreached = self.complete_unready_buckets(&mut state)?;
        let mut waited = self.wait_for_buckets(&mut state);
        let backward = Some(state.sync_backwards);
        let misreduced = accounting::check(rank, &state.layout.buckets, backward, path);
        let comm_end = self
            .group
            .comm_stream()
            .record_event()
            .map_err(stream_err)?;
        if let Some(unreached) = unreached {
            self.restore_unreached(&state, unreached, &comm_end, &mut waited)?;
        }
        let Waited {
            works,
            buckets,
            mut first_error,
        } = waited;

        // Outcomes known now are reported now; the others at the next forward.
        for work in works {
            match work.try_result() {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                None => state.deferred.unchecked_works.push(work),
            }
        }
        let forward_end = state.timing.forward_end.clone();
        let forward_start = state.timing.forward_start;
        if let Some(tune) = state.tune.as_mut() {
            tune.end_backward(forward_end.0, std::time::Instant::now());
        }
        state.timing.pending_steps.push_back(PendingStep {
            forward_start,
            forward_end,
            backward_end,
            comm_end,
            buckets,
        });
        // Not filed here: resolving a step's timings synchronises on its events (cudarc's
        // elapsed time does, even for complete events, and past `MAX_PENDING_STEPS` the oldest
        // step is waited for), and backward must never make the host wait for the device. The
        // next forward or a read of the telemetry files them.
        let through_ddp = reset_for_next_backward(&mut state);
        // The bypass is reported last, once the state is ready for the next iteration: the
        // gradients were reduced, but what only `DistributedDataParallel::forward` does (the
        // buffer broadcast, the checks of the previous step) was skipped.
        // A bucket reduced other than once is the root cause of what else went wrong.
        match misreduced.or(first_error) {
            Some(e) => Err(e),
            None if !through_ddp => Err(DistError::ForwardBypassed { rank }),
            None => Ok(()),
        }
    }

    /// Deals with the parameters this backward did not reach. Under `find_unused_parameters`
    /// their current gradient (zero when they have none) completes the buckets; every rank
    /// launches the same buckets in the same order, then counts the users of each parameter, so
    /// that what no rank used can be given back untouched. Otherwise they are reported at the
    /// next forward.
    fn complete_unready_buckets(&self, state: &mut State) -> Result<Option<Unreached>> {
        let rank = self.group.rank();
        let unready: Vec<usize> = (0..self.params.len())
            .filter(|&i| !state.pass.ready[i])
            .collect();
        if !self.config.find_unused_parameters {
            if !unready.is_empty() {
                let paths = unready.iter().map(|&i| self.params[i].0.clone()).collect();
                state.deferred.unused_paths = Some(paths);
            }
            return Ok(None);
        }
        let here =
            UnreachedHere::prepare(rank, &self.params, &state.layout.slots, &state.pass.ready)?;
        let scale = self.pre_scale();
        for &i in &unready {
            let view = state.layout.slots[i].view.clone();
            self.write_slot(&state.layout, i, &view, scale)?;
            self.mark_ready(state, i, false)?;
        }
        let counting = here.count_users(
            self.group.as_ref(),
            self.device,
            self.shadowing.load(std::sync::atomic::Ordering::Relaxed),
        )?;
        Ok(Some((here, counting)))
    }

    /// The step must see reduced gradients: makes the compute stream wait for every bucket
    /// launched in this backward.
    fn wait_for_buckets(&self, state: &mut State) -> Waited {
        let rank = self.group.rank();
        let in_flight = std::mem::take(&mut state.pass.in_flight);
        crate::nvtx_ranges::mark(
            rank,
            &format!("backward finished; waiting for {} buckets", in_flight.len()),
        );
        let mut waited = Waited {
            works: Vec::new(),
            buckets: Vec::with_capacity(in_flight.len()),
            first_error: None,
        };
        for flight in in_flight {
            if let Err(e) = self.compute.wait_event(&flight.done) {
                let err = DistError::tensor(rank, "ending the backward of DDP", e);
                waited.first_error.get_or_insert(err);
            }
            waited.works.extend(flight.works);
            waited.buckets.push(flight.timing);
        }
        waited
    }

    /// Gives the parameters no rank reached their gradients back, once the users' counts are
    /// known: reading them on the host waits for them (see the module comment).
    fn restore_unreached(
        &self,
        state: &State,
        (here, (counts, work)): Unreached,
        comm_end: &Event,
        waited: &mut Waited,
    ) -> Result<()> {
        let rank = self.group.rank();
        if let Err(e) = self.compute.wait_event(comm_end) {
            let err = DistError::tensor(rank, "ending the backward of DDP", e);
            waited.first_error.get_or_insert(err);
        }
        match work.try_result() {
            Some(Err(e)) => {
                waited.first_error.get_or_insert(e);
            }
            _ if waited.first_error.is_some() => {}
            outcome => {
                here.restore_unused_everywhere(rank, &counts, &self.params, &state.layout.slots)?;
                if outcome.is_none() {
                    waited.works.push(work);
                }
            }
        }
        Ok(())
    }
}

/// Resets the pass for the next backward and counts this one. Returns whether a forward went
/// through `DistributedDataParallel::forward` since the previous synchronised backward.
fn reset_for_next_backward(state: &mut State) -> bool {
    state.pass.ready.iter_mut().for_each(|r| *r = false);
    for bucket in &mut state.layout.buckets {
        bucket.pending = bucket.params.len();
        bucket.reductions = 0;
    }
    state.pass.next_launch = 0;
    state.sync_backwards += 1;
    std::mem::replace(&mut state.pass.forward_through_ddp, false)
}
