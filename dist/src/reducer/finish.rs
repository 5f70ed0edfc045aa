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

use super::telemetry::PendingStep;
use super::unused::UnreachedHere;
use super::{Reducer, State};
use crate::{DistError, Result};

impl Reducer {
    pub(super) fn on_backward_finished(&self, _summary: &BackwardSummary) -> Result<()> {
        let rank = self.group.rank();
        let mut st = self.state.lock();
        if !st.sync {
            st.forward_since_backward = false;
            return Ok(());
        }
        let stream_err = |e| DistError::tensor(rank, "ending the backward of DDP", e);
        let backward_end = self.compute.record_event().map_err(stream_err)?;
        let unready: Vec<usize> = (0..self.params.len()).filter(|&i| !st.ready[i]).collect();
        let mut unreached = None;
        if self.config.find_unused_parameters {
            // Their current gradient (zero when they have none) completes the buckets; every
            // rank launches the same buckets in the same order, then counts the users of each
            // parameter, so that what no rank used can be given back untouched.
            let here = UnreachedHere::prepare(rank, &self.params, &st.slots, &st.ready)?;
            let scale = self.pre_scale();
            for &i in &unready {
                let view = st.slots[i].view.clone();
                self.write_slot(&st, i, &view, scale)?;
                self.mark_ready(&mut st, i, false)?;
            }
            let counting = here.count_users(self.group.as_ref(), self.device)?;
            unreached = Some((here, counting));
        } else if !unready.is_empty() {
            st.unfinished = Some(unready.iter().map(|&i| self.params[i].0.clone()).collect());
        }

        // The step must see reduced gradients: the compute stream waits for every bucket.
        let in_flight = std::mem::take(&mut st.in_flight);
        crate::nvtx_ranges::mark(
            rank,
            &format!("backward finished; waiting for {} buckets", in_flight.len()),
        );
        let mut first_error = None;
        let mut works = Vec::new();
        let mut buckets = Vec::with_capacity(in_flight.len());
        for flight in in_flight {
            if let Err(e) = self.compute.wait_event(&flight.done) {
                first_error.get_or_insert(stream_err(e));
            }
            works.extend(flight.works);
            buckets.push(flight.timing);
        }
        let comm = self.group.comm_stream();
        let comm_end = comm.record_event().map_err(stream_err)?;

        if let Some((here, (counts, work))) = unreached {
            // Reading the counts on the host waits for them (see the module comment).
            if let Err(e) = self.compute.wait_event(&comm_end) {
                first_error.get_or_insert(stream_err(e));
            }
            match work.try_result() {
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                _ if first_error.is_some() => {}
                outcome => {
                    here.restore_unused_everywhere(rank, &counts, &self.params, &st.slots)?;
                    if outcome.is_none() {
                        works.push(work);
                    }
                }
            }
        }

        // Outcomes known now are reported now; the others at the next forward.
        for work in works {
            match work.try_result() {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                None => st.unchecked.push(work),
            }
        }
        let forward_end = st.forward_end.clone();
        st.pending_steps.push_back(PendingStep {
            forward_end,
            backward_end,
            comm_end,
            buckets,
        });
        // Not filed here: resolving a step's timings synchronises on its events (cudarc's
        // elapsed time does, even for complete events, and past `MAX_PENDING_STEPS` the oldest
        // step is waited for), and backward must never make the host wait for the device. The
        // next forward or a read of the telemetry files them.

        let through_ddp = st.reset_for_next_backward();
        // The bypass is reported last, once the state is ready for the next iteration: the
        // gradients were reduced, but what only `DistributedDataParallel::forward` does (the
        // buffer broadcast, the checks of the previous step) was skipped.
        match first_error {
            Some(e) => Err(e),
            None if !through_ddp => Err(DistError::ForwardBypassed { rank }),
            None => Ok(()),
        }
    }
}

impl State {
    /// Resets the per-backward bookkeeping after a synchronised backward. Returns whether a
    /// forward went through `DistributedDataParallel::forward` since the previous one.
    fn reset_for_next_backward(&mut self) -> bool {
        self.ready.iter_mut().for_each(|r| *r = false);
        for bucket in &mut self.buckets {
            bucket.pending = bucket.params.len();
        }
        self.next_launch = 0;
        self.sync_backwards += 1;
        std::mem::replace(&mut self.forward_since_backward, false)
    }
}
