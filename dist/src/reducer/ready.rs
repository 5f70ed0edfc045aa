//! The gradient-ready path: a parameter's final gradient is written into its bucket slot
//! (pre-scaled by `1/world` for an average), and every bucket that is complete — in bucket
//! order — is launched on the comm stream.
//!
//! The pre-scale is one kernel per gradient in the common case: when `.grad` already is the
//! slot view (every backward after the first, unless the user sets gradients to `None`),
//! autograd has accumulated into the slot and a single in-place `scale_` divides it. A gradient
//! that autograd allocated fresh (the first backward, or after `zero_grad_set_to_none`) is
//! copied into its slot and scaled there: two passes, because the runtime has no fused
//! "`dst = alpha * src`" operation.
//!
//! Each launch opens an NVTX range (`rank K: all_reduce bucket B (N KiB)`) that lasts until the
//! reducer files the step's timings, i.e. until the host has seen the bucket complete.
//!
//! Nothing here waits: on CUDA the slot writes are kernels on the compute stream, the comm
//! stream waits for them through an event, and the collective is issued on the comm stream.

use std::time::Instant;

use tandem_core::{Event, GradReady, Tensor};

use super::accounting;
use super::comm_hook::{AllReduceHook, CommHook};
use super::telemetry::PendingBucket;
use super::unused::is_slot_view;
use super::{GradReduction, InFlight, LaunchRecord, Layout, Reducer, State, MAX_LAUNCH_RECORDS};
use crate::nvtx_ranges::Range;
use crate::{CollectiveLabel, DistError, Result};

impl Reducer {
    pub(super) fn on_grad_ready(&self, ready: &GradReady) -> Result<()> {
        let rank = self.group.rank();
        let Some(&index) = self.index_of.get(&ready.param.id()) else {
            return Ok(());
        };
        let mut state = self.state.lock();
        if !state.sync {
            // Accumulate locally, unscaled: the next synchronised backward adds to the slot
            // and scales the sum.
            return self.write_slot(&state.layout, index, &ready.grad, None);
        }
        if state.pass.ready[index] {
            return Err(DistError::GradientReadyTwice {
                rank,
                path: self.params[index].0.clone(),
            });
        }
        let scale = self.pre_scale();
        self.write_slot(&state.layout, index, &ready.grad, scale)?;
        self.mark_ready(&mut state, index, true)
    }

    /// `1/world_size` when gradients are averaged over more than one rank (inside `join` with
    /// `JoinDivisor::ActiveRanks`, `1/active ranks`).
    pub(super) fn pre_scale(&self) -> Option<f64> {
        let world = match self.divisor.load(std::sync::atomic::Ordering::Relaxed) {
            0 => self.group.world_size(),
            active => active,
        };
        (self.config.reduction == GradReduction::Mean && world > 1).then(|| 1.0 / world as f64)
    }

    /// Leaves `grad` (the parameter's accumulated gradient) in its bucket slot, multiplied by
    /// `scale`, and points `.grad` at the slot.
    pub(super) fn write_slot(
        &self,
        layout: &Layout,
        index: usize,
        grad: &Tensor,
        scale: Option<f64>,
    ) -> Result<()> {
        let (path, param) = &self.params[index];
        let view = &layout.slots[index].view;
        let rank = self.group.rank();
        let err = |e| {
            DistError::tensor(
                rank,
                format!("writing the gradient of `{path}` into its bucket"),
                e,
            )
        };
        if is_slot_view(grad, view) {
            // Autograd accumulated into the slot: one kernel.
            if let Some(alpha) = scale {
                view.scale_(alpha).map_err(err)?;
            }
            return Ok(());
        }
        view.copy_(grad).map_err(err)?;
        if let Some(alpha) = scale {
            view.scale_(alpha).map_err(err)?;
        }
        param.set_grad(Some(view.clone())).map_err(err)
    }

    /// Counts parameter `index` as ready (its slot holds its final, scaled gradient) and
    /// launches, in bucket order, every bucket that is complete.
    pub(super) fn mark_ready(
        &self,
        state: &mut State,
        index: usize,
        during_backward: bool,
    ) -> Result<()> {
        state.pass.ready[index] = true;
        if state.sync_backwards == 0 {
            state.rebuild.observed_order.push(index);
        }
        // Ready times feed the automatic bucket cap while it still has decisions to take.
        if let Some(tune) = state.tune.as_mut().filter(|t| t.next_decision != u64::MAX) {
            tune.ready_at[index] = Some(Instant::now());
        }
        let b = state.layout.slots[index].bucket;
        state.layout.buckets[b].pending -= 1;
        if state
            .layout
            .buckets
            .get(state.pass.next_launch)
            .map(|b| b.pending)
            != Some(0)
        {
            return Ok(());
        }
        // Everything the buckets hold was written on the compute stream before this point.
        let rank = self.group.rank();
        let written = self
            .compute
            .record_event()
            .map_err(|e| DistError::tensor(rank, "recording the gradients' event", e))?;
        while state.pass.next_launch < state.layout.buckets.len()
            && state.layout.buckets[state.pass.next_launch].pending == 0
        {
            let next = state.pass.next_launch;
            for _ in 0..accounting::launches(state.pass.fault.as_ref(), next) {
                self.launch(state, next, &written, during_backward)?;
            }
            state.pass.next_launch += 1;
        }
        Ok(())
    }

    /// Issues bucket `b`'s reduction on the comm stream, after `written`.
    fn launch(
        &self,
        state: &mut State,
        b: usize,
        written: &Event,
        during_backward: bool,
    ) -> Result<()> {
        let rank = self.group.rank();
        let comm = self.group.comm_stream();
        let err = |e| DistError::tensor(rank, format!("launching gradient bucket {b}"), e);
        state.layout.buckets[b].reductions += 1;
        let buffer = state.layout.buckets[b].buffer.clone();
        // The collective must not read the bucket before the compute stream wrote it, and its
        // memory must not be reused before the comm stream is done with it.
        comm.wait_event(written).map_err(err)?;
        buffer.record_stream(comm).map_err(err)?;
        let issued = Instant::now();
        let bytes = buffer.numel() * buffer.dtype().size_in_bytes();
        let nvtx = Range::start(
            rank,
            &format!("all_reduce bucket {b} ({} KiB)", bytes.div_ceil(1024)),
        );
        let start = comm.record_event().map_err(err)?;
        let hook: &dyn CommHook = match &self.config.comm_hook {
            Some(h) => h.as_ref(),
            None => &AllReduceHook,
        };
        let reduction = crate::with_collective_label(CollectiveLabel::Bucket(b), || {
            hook.reduce(self.group.as_ref(), &buffer)
        })?;
        let end = comm.record_event().map_err(err)?;
        let backward = state.sync_backwards;
        if state.timing.launch_log.len() == MAX_LAUNCH_RECORDS {
            state.timing.launch_log.pop_front();
        }
        state.timing.launch_log.push_back(LaunchRecord {
            backward,
            bucket: b,
            during_backward,
        });
        state.pass.in_flight.push(InFlight {
            works: reduction.works,
            done: reduction.done,
            timing: PendingBucket {
                bucket: b,
                bytes,
                issued,
                start,
                end,
                nvtx,
            },
        });
        Ok(())
    }
}
