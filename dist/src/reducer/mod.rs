//! The Reducer: turns gradient-ready events into bucketed all-reduces that run while backward
//! is still computing.
//!
//! For each parameter the reducer registers a gradient-ready hook. When a parameter's gradient
//! is final, the hook scales its slot in the bucket by `1/world_size` (under
//! [`GradReduction::Mean`]) and counts the bucket down; when the bucket's last gradient
//! arrives, the comm stream waits on the compute event and the bucket is all-reduced there —
//! strictly in bucket order, so every rank issues the same sequence of collectives. The
//! backward-finished hook launches what is left, waits for every bucket, and leaves averaged
//! gradients in `.grad`, which are views into the buckets. Under `find_unused_parameters`,
//! parameters that no rank's backward reached keep their `.grad` exactly as it was (see
//! `reducer/unused.rs`).

mod bucket;
pub mod comm_hook;
pub mod telemetry;
mod unused;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use tandem_autograd::{
    register_backward_finished_hook, register_grad_ready_hook, BackwardSummary, HookHandle,
};
use tandem_core::{DType, Device, Event, GradReady, Tensor, TensorId};

use crate::{DistError, ProcessGroup, Result, Work};
use bucket::{Bucket, BucketSet, Slot};
use comm_hook::{AllReduceHook, CommHook};
use telemetry::{BucketTiming, StepTiming, Telemetry};
use unused::{is_slot_view, UnreachedHere};

/// How gradients are combined across ranks.
///
/// With a mean-reduced loss and equal per-rank batches, `Mean` makes N ranks × B/N samples
/// produce exactly the gradient of one process × B samples, so the learning rate tuned for the
/// single-process batch B stays right. `Sum` gives gradients N times larger (scale the
/// learning rate by 1/N to compensate). With a sum-reduced loss, `Mean` yields the full-batch
/// sum divided by N.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradReduction {
    /// Average over ranks (default): each gradient is scaled by `1/world_size` as it is
    /// written into its bucket, then the buckets are summed.
    #[default]
    Mean,
    /// Sum over ranks.
    Sum,
}

/// The reducer's settings (part of [`DdpConfig`](crate::DdpConfig)).
#[derive(Clone)]
pub(crate) struct ReducerConfig {
    pub reduction: GradReduction,
    pub bucket_cap_bytes: usize,
    pub first_bucket_bytes: usize,
    pub find_unused_parameters: bool,
    pub rebuild_buckets: bool,
    pub comm_hook: Option<Arc<dyn CommHook>>,
}

struct InFlight {
    works: Vec<Work>,
    done: Event,
    /// Completes after the comm stream has stamped the end time.
    stamped: Event,
    timing: Arc<Mutex<BucketTiming>>,
}

/// What the reducer knows about the current and past iterations.
struct State {
    buckets: Vec<Bucket>,
    /// Per parameter: its bucket and its gradient view.
    slots: Vec<Slot>,
    ready: Vec<bool>,
    next_launch: usize,
    in_flight: Vec<InFlight>,
    /// False inside `no_sync`: gradients only accumulate locally.
    sync: bool,
    /// Order in which parameters became ready in the first synchronised backward.
    observed_order: Vec<usize>,
    sync_backwards: u64,
    rebuilt: bool,
    /// Parameters that got no gradient in the last backward (reported at the next forward).
    unfinished: Option<Vec<String>>,
    forward_end: Instant,
    telemetry: Telemetry,
    /// The most recent launches (at most `MAX_LAUNCH_RECORDS`), for tests and traces.
    launch_log: VecDeque<LaunchRecord>,
}

/// How many bucket launches the reducer remembers (a long run must not grow without bound).
const MAX_LAUNCH_RECORDS: usize = 100_000;

/// One bucket launch, as recorded for tests and traces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchRecord {
    /// Which synchronised backward (0-based).
    pub backward: u64,
    /// The bucket index.
    pub bucket: usize,
    /// Whether the launch happened from a gradient-ready hook, i.e. while backward was still
    /// computing (false: from the backward-finished hook).
    pub during_backward: bool,
}

/// Bucketed gradient reduction for one model on one process group.
pub(crate) struct Reducer {
    group: Arc<dyn ProcessGroup>,
    config: ReducerConfig,
    params: Vec<(String, Tensor)>,
    index_of: HashMap<TensorId, usize>,
    state: Mutex<State>,
    hooks: Mutex<Vec<HookHandle>>,
}

impl Reducer {
    /// Builds buckets in reverse registration order and registers the hooks.
    pub fn new(
        group: Arc<dyn ProcessGroup>,
        params: Vec<(String, Tensor)>,
        config: ReducerConfig,
    ) -> Result<Arc<Self>> {
        let rank = group.rank();
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let BucketSet { buckets, slots } = Self::layout(rank, &params, &order, &config)?;
        let index_of = params
            .iter()
            .enumerate()
            .map(|(i, (_, t))| (t.id(), i))
            .collect();
        let n = params.len();
        let reducer = Arc::new(Reducer {
            group,
            config,
            params,
            index_of,
            state: Mutex::new(State {
                buckets,
                slots,
                ready: vec![false; n],
                next_launch: 0,
                in_flight: Vec::new(),
                sync: true,
                observed_order: Vec::with_capacity(n),
                sync_backwards: 0,
                rebuilt: false,
                unfinished: None,
                forward_end: Instant::now(),
                telemetry: Telemetry::default(),
                launch_log: VecDeque::new(),
            }),
            hooks: Mutex::new(Vec::new()),
        });
        reducer.register_hooks()?;
        Ok(reducer)
    }

    fn layout(
        rank: usize,
        params: &[(String, Tensor)],
        order: &[usize],
        config: &ReducerConfig,
    ) -> Result<BucketSet> {
        let bytes: Vec<usize> = params
            .iter()
            .map(|(_, t)| t.numel() * t.dtype().size_in_bytes())
            .collect();
        let dtypes: Vec<DType> = params.iter().map(|(_, t)| t.dtype()).collect();
        let groups = bucket::assign(
            order,
            &bytes,
            &dtypes,
            config.first_bucket_bytes,
            config.bucket_cap_bytes,
        );
        bucket::build(rank, params, &groups)
    }

    fn register_hooks(self: &Arc<Self>) -> Result<()> {
        let rank = self.group.rank();
        let mut handles = Vec::with_capacity(self.params.len() + 1);
        for (path, param) in &self.params {
            let weak: Weak<Reducer> = Arc::downgrade(self);
            let handle = register_grad_ready_hook(param, move |ready| match weak.upgrade() {
                Some(reducer) => reducer.on_grad_ready(ready).map_err(to_core),
                None => Ok(()),
            })
            .map_err(|e| DistError::tensor(rank, format!("registering the hook of `{path}`"), e))?;
            handles.push(handle);
        }
        let tensors: Vec<Tensor> = self.params.iter().map(|(_, t)| t.clone()).collect();
        let weak: Weak<Reducer> = Arc::downgrade(self);
        let handle =
            register_backward_finished_hook(&tensors, move |summary| match weak.upgrade() {
                Some(reducer) => reducer.on_backward_finished(summary).map_err(to_core),
                None => Ok(()),
            })
            .map_err(|e| DistError::tensor(rank, "registering the backward-finished hook", e))?;
        handles.push(handle);
        *self.hooks.lock() = handles;
        Ok(())
    }

    /// Removes the hooks (when the DDP wrapper is dropped).
    pub fn detach(&self) {
        for handle in self.hooks.lock().drain(..) {
            handle.remove();
        }
    }

    /// Turns synchronisation on or off (`no_sync`).
    pub fn set_sync(&self, sync: bool) {
        self.state.lock().sync = sync;
    }

    /// Whether backward passes currently synchronise.
    pub fn is_sync(&self) -> bool {
        self.state.lock().sync
    }

    /// Called at the start of every forward: reports parameters left without gradient by the
    /// last backward, and rebuilds the buckets in the observed order after the first iteration.
    pub fn prepare_forward(&self) -> Result<()> {
        let rank = self.group.rank();
        let mut st = self.state.lock();
        if let Some(paths) = st.unfinished.take() {
            return Err(DistError::UnusedParameters { rank, paths });
        }
        if self.config.rebuild_buckets && !st.rebuilt && st.sync_backwards >= 1 {
            let mut order = st.observed_order.clone();
            let mut seen = vec![false; self.params.len()];
            order.iter().for_each(|&p| seen[p] = true);
            order.extend((0..self.params.len()).rev().filter(|&p| !seen[p]));
            if self.group.world_size() > 1 {
                // Every rank must bucket alike: rank 0's order wins.
                let values: Vec<i64> = order.iter().map(|&p| p as i64).collect();
                let t = Tensor::from_vec(values, &[order.len()], Device::Cpu)
                    .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
                self.group.broadcast(&t, 0)?.wait()?;
                let agreed = t
                    .to_vec::<i64>()
                    .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
                order = agreed.into_iter().map(|p| p as usize).collect();
            }
            let BucketSet { buckets, slots } =
                Self::layout(rank, &self.params, &order, &self.config)?;
            st.buckets = buckets;
            st.slots = slots;
            st.rebuilt = true;
        }
        Ok(())
    }

    /// Marks the end of forward for telemetry.
    pub fn mark_forward_end(&self) {
        self.state.lock().forward_end = Instant::now();
    }

    fn on_grad_ready(&self, ready: &GradReady) -> Result<()> {
        let rank = self.group.rank();
        let Some(&index) = self.index_of.get(&ready.param.id()) else {
            return Ok(());
        };
        let mut st = self.state.lock();
        self.ensure_in_bucket(&st, index, &ready.grad)?;
        if !st.sync {
            return Ok(());
        }
        if st.ready[index] {
            return Err(DistError::GradientReadyTwice {
                rank,
                path: self.params[index].0.clone(),
            });
        }
        self.mark_ready(&mut st, index, &ready.event, true)
    }

    /// Makes sure the parameter's gradient lives in its bucket slot (it does not when the
    /// gradient was set to `None` and autograd allocated a fresh one).
    fn ensure_in_bucket(&self, st: &State, index: usize, grad: &Tensor) -> Result<()> {
        let (path, param) = &self.params[index];
        let view = &st.slots[index].view;
        if !is_slot_view(grad, view) {
            let rank = self.group.rank();
            let err = |e| {
                DistError::tensor(
                    rank,
                    format!("moving the gradient of `{path}` into its bucket"),
                    e,
                )
            };
            view.copy_(grad).map_err(err)?;
            param.set_grad(Some(view.clone())).map_err(err)?;
        }
        Ok(())
    }

    fn mark_ready(
        &self,
        st: &mut State,
        index: usize,
        event: &Event,
        during_backward: bool,
    ) -> Result<()> {
        let rank = self.group.rank();
        if self.config.reduction == GradReduction::Mean && self.group.world_size() > 1 {
            st.slots[index]
                .view
                .scale_(1.0 / self.group.world_size() as f64)
                .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
        }
        st.ready[index] = true;
        if st.sync_backwards == 0 {
            st.observed_order.push(index);
        }
        let b = st.slots[index].bucket;
        st.buckets[b].pending -= 1;
        while st.next_launch < st.buckets.len() && st.buckets[st.next_launch].pending == 0 {
            let next = st.next_launch;
            self.launch(st, next, event, during_backward)?;
            st.next_launch += 1;
        }
        Ok(())
    }

    fn launch(&self, st: &mut State, b: usize, event: &Event, during_backward: bool) -> Result<()> {
        let stream = self.group.comm_stream();
        let buffer = st.buckets[b].buffer.clone();
        let timing = Arc::new(Mutex::new(BucketTiming {
            bucket: b,
            bytes: buffer.numel() * buffer.dtype().size_in_bytes(),
            issued: Instant::now(),
            started: None,
            ended: None,
        }));
        let rank = self.group.rank();
        // The collective must not read the bucket before the compute stream wrote it.
        stream
            .wait_event(event)
            .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
        let t = timing.clone();
        stream
            .enqueue(move || t.lock().started = Some(Instant::now()))
            .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
        let hook: &dyn CommHook = match &self.config.comm_hook {
            Some(h) => h.as_ref(),
            None => &AllReduceHook,
        };
        let reduction = hook.reduce(self.group.as_ref(), &buffer)?;
        let t = timing.clone();
        stream
            .enqueue(move || t.lock().ended = Some(Instant::now()))
            .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
        let stamped = stream
            .record_event()
            .map_err(|e| DistError::tensor(rank, "DistributedDataParallel", e))?;
        let backward = st.sync_backwards;
        if st.launch_log.len() == MAX_LAUNCH_RECORDS {
            st.launch_log.pop_front();
        }
        st.launch_log.push_back(LaunchRecord {
            backward,
            bucket: b,
            during_backward,
        });
        st.in_flight.push(InFlight {
            works: reduction.works,
            done: reduction.done,
            stamped,
            timing,
        });
        Ok(())
    }

    fn on_backward_finished(&self, _summary: &BackwardSummary) -> Result<()> {
        let rank = self.group.rank();
        let compute_end = Instant::now();
        let mut st = self.state.lock();
        if !st.sync {
            return Ok(());
        }
        let unready: Vec<usize> = (0..self.params.len()).filter(|&i| !st.ready[i]).collect();
        let mut unreached = None;
        if self.config.find_unused_parameters {
            // Their current gradient (zero when they have none) completes the buckets; every
            // rank launches the same buckets in the same order, then counts the users of each
            // parameter, so that what no rank used can be given back untouched.
            let here = UnreachedHere::prepare(rank, &self.params, &st.slots, &st.ready)?;
            let done = Event::completed();
            for &i in &unready {
                self.mark_ready(&mut st, i, &done, false)?;
            }
            let counting = here.count_users(self.group.as_ref())?;
            unreached = Some((here, counting));
        } else if !unready.is_empty() {
            st.unfinished = Some(unready.iter().map(|&i| self.params[i].0.clone()).collect());
        }
        // Wait for every bucket in flight: the step sees reduced gradients.
        let in_flight = std::mem::take(&mut st.in_flight);
        let mut first_error = None;
        let mut timings = Vec::with_capacity(in_flight.len());
        for flight in in_flight {
            for work in &flight.works {
                if let Err(e) = work.wait() {
                    first_error.get_or_insert(e);
                }
            }
            for event in [&flight.done, &flight.stamped] {
                if let Err(e) = event.synchronize() {
                    first_error.get_or_insert(DistError::tensor(
                        rank,
                        "DistributedDataParallel",
                        e,
                    ));
                }
            }
            timings.push(flight.timing.lock().clone());
        }
        if let Some((here, (counts, work))) = unreached {
            match work.wait() {
                Ok(()) if first_error.is_none() => {
                    here.restore_unused_everywhere(rank, &counts, &self.params, &st.slots)?
                }
                Ok(()) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let comm_end = Instant::now();
        let forward_end = st.forward_end;
        st.telemetry.push(StepTiming {
            forward_end,
            backward_compute_end: compute_end,
            comm_end,
            buckets: timings,
        });
        // Reset for the next backward.
        st.ready.iter_mut().for_each(|r| *r = false);
        for bucket in &mut st.buckets {
            bucket.pending = bucket.params.len();
        }
        st.next_launch = 0;
        st.sync_backwards += 1;
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A copy of the telemetry.
    pub fn telemetry(&self) -> Telemetry {
        self.state.lock().telemetry.clone()
    }

    /// Every bucket launch so far.
    pub fn launch_log(&self) -> Vec<LaunchRecord> {
        self.state.lock().launch_log.iter().cloned().collect()
    }

    /// The current bucket layout: parameter paths per bucket, in launch order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        let st = self.state.lock();
        st.buckets
            .iter()
            .map(|b| b.params.iter().map(|&p| self.params[p].0.clone()).collect())
            .collect()
    }
}

fn to_core(e: DistError) -> tandem_core::Error {
    tandem_core::Error::external("DistributedDataParallel", e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadProcessGroup;

    #[test]
    fn a_gradient_ready_twice_in_one_backward_is_an_error_naming_the_parameter() {
        let group: Arc<dyn ProcessGroup> =
            Arc::new(ThreadProcessGroup::new_group(1).unwrap().remove(0));
        let w = Tensor::zeros(&[3], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        let config = ReducerConfig {
            reduction: GradReduction::Mean,
            bucket_cap_bytes: 1 << 20,
            first_bucket_bytes: 1 << 20,
            find_unused_parameters: false,
            rebuild_buckets: true,
            comm_hook: None,
        };
        let reducer =
            Reducer::new(group, vec![("layer.weight".into(), w.clone())], config).unwrap();
        let ready = GradReady {
            param: w.clone(),
            // What autograd hands over for a parameter without a gradient yet: its own tensor.
            grad: Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap(),
            event: Event::completed(),
        };
        // One bucket of one parameter: the first event launches it; the second is refused
        // before the backward-finished hook resets the pass.
        reducer.on_grad_ready(&ready).unwrap();
        let err = reducer.on_grad_ready(&ready).unwrap_err().to_string();
        assert!(
            err.contains("`layer.weight`") && err.contains("twice"),
            "{err}"
        );
        reducer.detach();
    }
}
