//! The Reducer: turns gradient-ready events into bucketed all-reduces that run while backward
//! is still computing, on the CPU or on a CUDA device alike.
//!
//! Buckets live on the parameters' device (device memory on CUDA), and each parameter's `.grad`
//! is a view into its bucket. For each parameter the reducer registers a gradient-ready hook
//! (`ready.rs`). When a parameter's gradient is final, the hook scales its slot by
//! `1/world_size` (under [`GradReduction::Mean`]) on the compute stream and counts the bucket
//! down; when the bucket's last gradient arrives, the comm stream waits on a compute-stream event
//! and the bucket is reduced there — strictly in bucket order, so every rank issues the same
//! sequence of collectives. The backward-finished hook (`finish.rs`) launches what is left and
//! makes the **compute stream** wait on each bucket's completion event: on the CPU, whose compute
//! stream is the calling thread, that is a wait; on CUDA the host returns at once and the
//! optimizer's kernels, issued next, run after the reductions. Under `find_unused_parameters`,
//! parameters that no rank's backward reached keep their `.grad` exactly as it was (see
//! `unused.rs`).
//!
//! Streams and events, per bucket:
//!
//! ```text
//! compute: … grad(p) → scale slot → [ready event] … backward ends → wait(done_0) wait(done_1) → step
//! comm:              wait(ready) → [start] collective(bucket) [end] [done] …          [comm end]
//! ```
//!
//! Every event feeds the telemetry (`telemetry.rs`): bucket timings are the comm-stream events
//! around each collective, turned into times once the device has passed them.

mod accounting;
pub mod autotune;
mod bucket;
pub mod comm_hook;
mod finish;
pub mod overlap;
mod ready;
pub mod telemetry;
mod unused;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use tandem_autograd::{register_backward_finished_hook, register_grad_ready_hook, HookHandle};
use tandem_core::{DType, Device, Event, Stream, Tensor, TensorId};

use crate::{CollectiveLabel, DistError, ProcessGroup, Result, Work};
use autotune::{AutoBuckets, BucketChoice, Tuner};
use bucket::{Bucket, BucketSet, Slot};
use comm_hook::CommHook;
use telemetry::{PendingBucket, PendingStep, Telemetry};

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
    /// Choose the bucket cap from measurements (`bucket_cap_bytes` is the start).
    pub auto_buckets: Option<AutoBuckets>,
}

/// A bucket whose reduction has been issued.
struct InFlight {
    /// The collectives the hook issued; their outcome is checked when known.
    works: Vec<Work>,
    /// Completes when the bucket holds the reduced gradients (the compute stream waits on it).
    done: Event,
    timing: PendingBucket,
}

/// What the reducer knows about the current and past iterations, one part per concern.
struct State {
    /// False inside `no_sync`: gradients only accumulate locally.
    sync: bool,
    /// Synchronised backwards so far (the first one observes the order of the gradients).
    sync_backwards: u64,
    /// The buckets and where each parameter's gradient lives in them.
    layout: Layout,
    /// How far the current synchronised backward has got.
    pass: Pass,
    /// The order learned from the first synchronised backward, for rebuilding the buckets.
    rebuild: Rebuild,
    /// Problems found after a backward returned, reported at the next forward.
    deferred: Deferred,
    /// Timing events and records: the telemetry and the launch log.
    timing: Timing,
    /// The automatic bucket cap's measurements and choices (`DdpConfig::auto_buckets`).
    tune: Option<Tuner>,
}

/// The buckets and, per parameter, its bucket and its gradient view.
struct Layout {
    buckets: Vec<Bucket>,
    /// Indexed like the reducer's parameters.
    slots: Vec<Slot>,
}

/// The progress of one synchronised backward; reset when it finishes.
struct Pass {
    /// Per parameter: whether its final gradient is in its slot.
    ready: Vec<bool>,
    /// The next bucket to launch (buckets launch strictly in order).
    next_launch: usize,
    /// Buckets launched in this backward.
    in_flight: Vec<InFlight>,
    /// Whether `DistributedDataParallel::forward` ran since the last synchronised backward; a
    /// backward without one ran through a forward that bypassed DDP (`ddp.module().forward`).
    forward_through_ddp: bool,
    /// A fault injected into bucket launches (tests only; see `accounting`).
    fault: Option<accounting::BucketFault>,
}

/// The bucket order observed in the first synchronised backward, and whether the buckets were
/// rebuilt in it.
struct Rebuild {
    /// Order in which parameters became ready in the first synchronised backward.
    observed_order: Vec<usize>,
    /// The order the current buckets were assigned in.
    order: Vec<usize>,
    /// Whether the buckets have been rebuilt (once, before the second synchronised forward).
    done: bool,
}

/// What a backward learned too late to report from inside it; reported at the next forward.
struct Deferred {
    /// Parameters that got no gradient in the last backward.
    unused_paths: Option<Vec<String>>,
    /// Collectives whose outcome was not known yet when their backward finished (a device
    /// backend completes them later).
    unchecked_works: Vec<Work>,
}

/// The telemetry's inputs and records.
struct Timing {
    /// When the wrapped module's forward was last called.
    forward_start: Instant,
    /// When forward last returned, and the compute-stream event recorded then.
    forward_end: (Instant, Event),
    /// Steps whose timing events the device may not have reached yet.
    pending_steps: VecDeque<PendingStep>,
    telemetry: Telemetry,
    /// The most recent launches (at most `MAX_LAUNCH_RECORDS`), for tests and traces.
    launch_log: VecDeque<LaunchRecord>,
}

impl State {
    /// The state before the first forward: buckets in `layout`, synchronising.
    fn new(
        layout: Layout,
        order: Vec<usize>,
        forward_end: (Instant, Event),
        tune: Option<Tuner>,
    ) -> State {
        let params = order.len();
        State {
            sync: true,
            sync_backwards: 0,
            layout,
            pass: Pass {
                ready: vec![false; params],
                next_launch: 0,
                in_flight: Vec::new(),
                forward_through_ddp: false,
                fault: None,
            },
            rebuild: Rebuild {
                observed_order: Vec::with_capacity(params),
                order,
                done: false,
            },
            deferred: Deferred {
                unused_paths: None,
                unchecked_works: Vec::new(),
            },
            timing: Timing {
                forward_start: forward_end.0,
                forward_end,
                pending_steps: VecDeque::new(),
                telemetry: Telemetry::default(),
                launch_log: VecDeque::new(),
            },
            tune,
        }
    }
}

/// How many bucket launches the reducer remembers (a long run must not grow without bound).
const MAX_LAUNCH_RECORDS: usize = 100_000;

/// How many steps may wait for their timing events before the oldest is waited for (the device
/// runs a step or two behind the host; a long queue means it fell far behind).
const MAX_PENDING_STEPS: usize = 16;

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
    /// The parameters' device, where the buckets live.
    device: Device,
    /// That device's compute stream.
    compute: Stream,
    state: Mutex<State>,
    hooks: Mutex<Vec<HookHandle>>,
    /// What `GradReduction::Mean` divides by when not 0 (the world size): the active ranks'
    /// count inside `DistributedDataParallel::join` with `JoinDivisor::ActiveRanks`.
    pub(crate) divisor: AtomicUsize,
    /// Whether the current step is a joined rank's shadow step (`DistributedDataParallel::join`),
    /// whose backward counts as reaching no parameter in the unused-parameter agreement.
    pub(crate) shadowing: AtomicBool,
}

impl Reducer {
    /// Builds buckets on `device` (where every parameter lives) in reverse registration order
    /// and registers the hooks.
    pub fn new(
        group: Arc<dyn ProcessGroup>,
        params: Vec<(String, Tensor)>,
        device: Device,
        config: ReducerConfig,
    ) -> Result<Arc<Self>> {
        let rank = group.rank();
        let stream_err = |e| DistError::tensor(rank, format!("the compute stream of {device}"), e);
        let compute = Stream::compute(device).map_err(stream_err)?;
        let forward_end = (Instant::now(), compute.record_event().map_err(stream_err)?);
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let caps = (config.first_bucket_bytes, config.bucket_cap_bytes);
        let BucketSet { buckets, slots } = Self::layout(rank, &params, &order, &caps)?;
        let index_of = params
            .iter()
            .enumerate()
            .map(|(i, (_, t))| (t.id(), i))
            .collect();
        // One rank has no link to tune for.
        let tune = config
            .auto_buckets
            .clone()
            .filter(|_| group.world_size() > 1)
            .map(|auto| {
                // The first window starts once the buckets are rebuilt (after one backward).
                let start = u64::from(config.rebuild_buckets);
                let first = start + auto.warmup_steps.max(1) as u64;
                Tuner::new(auto, params.len(), config.bucket_cap_bytes, first)
            });
        let reducer = Arc::new(Reducer {
            group,
            config,
            params,
            index_of,
            device,
            compute,
            state: Mutex::new(State::new(
                Layout { buckets, slots },
                order,
                forward_end,
                tune,
            )),
            hooks: Mutex::new(Vec::new()),
            divisor: AtomicUsize::new(0),
            shadowing: AtomicBool::new(false),
        });
        reducer.register_hooks()?;
        Ok(reducer)
    }

    fn layout(
        rank: usize,
        params: &[(String, Tensor)],
        order: &[usize],
        (first_cap_bytes, cap_bytes): &(usize, usize),
    ) -> Result<BucketSet> {
        let bytes: Vec<usize> = params
            .iter()
            .map(|(_, t)| t.numel() * t.dtype().size_in_bytes())
            .collect();
        let dtypes: Vec<DType> = params.iter().map(|(_, t)| t.dtype()).collect();
        let groups = bucket::assign(order, &bytes, &dtypes, *first_cap_bytes, *cap_bytes);
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
    /// last backward and collectives of earlier steps that failed after their backward
    /// returned, files the timings the device has completed, and rebuilds the buckets in the
    /// observed order after the first iteration.
    pub fn prepare_forward(&self) -> Result<()> {
        let rank = self.group.rank();
        let mut state = self.state.lock();
        if let Some(paths) = state.deferred.unused_paths.take() {
            return Err(DistError::UnusedParameters { rank, paths });
        }
        check_finished_works(&mut state.deferred.unchecked_works)?;
        file_timings(&mut state.timing, false);
        if self.config.rebuild_buckets && !state.rebuild.done && state.sync_backwards >= 1 {
            let mut order = state.rebuild.observed_order.clone();
            let mut seen = vec![false; self.params.len()];
            order.iter().for_each(|&p| seen[p] = true);
            order.extend((0..self.params.len()).rev().filter(|&p| !seen[p]));
            if self.group.world_size() > 1 {
                order = self.agree_on_order(&order)?;
            }
            let BucketSet { buckets, slots } =
                Self::layout(rank, &self.params, &order, &self.caps(&state))?;
            state.layout = Layout { buckets, slots };
            state.rebuild.order = order;
            state.rebuild.done = true;
            let backwards = state.sync_backwards;
            if let Some(tune) = state.tune.as_mut() {
                tune.restart(backwards);
            }
        }
        self.auto_tune(&mut state)
    }

    /// The caps (first bucket, others) in bytes: the configured ones, or the automatic choice,
    /// which caps the first bucket too (as [`autotune::choose_cap`] predicted it).
    fn caps(&self, state: &State) -> (usize, usize) {
        match state.tune.as_ref() {
            Some(t) => (self.config.first_bucket_bytes.min(t.cap_bytes), t.cap_bytes),
            None => (self.config.first_bucket_bytes, self.config.bucket_cap_bytes),
        }
    }

    /// The automatic bucket cap's choices so far (empty without `DdpConfig::auto_buckets`).
    pub fn bucket_choices(&self) -> Vec<BucketChoice> {
        self.state
            .lock()
            .tune
            .as_ref()
            .map_or_else(Vec::new, |t| t.choices.clone())
    }

    /// Rank 0's bucket order, broadcast to every rank so that all bucket alike. Outside
    /// backward, so the host may wait for it.
    fn agree_on_order(&self, order: &[usize]) -> Result<Vec<usize>> {
        let rank = self.group.rank();
        let err = |e| DistError::tensor(rank, "agreeing on the rebuilt bucket order", e);
        let values: Vec<i64> = order.iter().map(|&p| p as i64).collect();
        let t = Tensor::from_vec(values, &[order.len()], self.device).map_err(err)?;
        crate::with_collective_label(CollectiveLabel::BucketOrderBroadcast, || {
            self.group.broadcast(&t, 0)
        })?
        .wait()?;
        let agreed = t.to_vec::<i64>().map_err(err)?;
        let n = self.params.len();
        let mut seen = vec![false; n];
        let mut out = Vec::with_capacity(n);
        for p in agreed {
            // Rank 0 holds the same model (checked at construction); guard anyway, since an
            // index out of range would otherwise panic.
            match usize::try_from(p).ok().filter(|&p| p < n && !seen[p]) {
                Some(p) => {
                    seen[p] = true;
                    out.push(p);
                }
                None => {
                    return Err(DistError::internal(
                        format!("rank {rank}: DistributedDataParallel"),
                        format!("rank 0's bucket order names parameter #{p} of {n}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Marks the start of the wrapped module's forward for telemetry (host time).
    pub fn mark_forward_start(&self) {
        self.state.lock().timing.forward_start = Instant::now();
    }

    /// Marks the end of forward for telemetry: the host instant and an event on the compute
    /// stream, which anchors device times to the host clock. Also notes that a forward went
    /// through DDP, for the check at the end of the next synchronised backward.
    pub fn mark_forward_end(&self) {
        // A failed record leaves the previous anchor; timings are never worth an error.
        let event = self.compute.record_event();
        let mut state = self.state.lock();
        state.pass.forward_through_ddp = true;
        if let Ok(event) = event {
            state.timing.forward_end = (Instant::now(), event);
        }
    }

    /// A copy of the telemetry; waits for the timing events of the steps recorded so far.
    pub fn telemetry(&self) -> Telemetry {
        let mut state = self.state.lock();
        file_timings(&mut state.timing, true);
        state.timing.telemetry.clone()
    }

    /// Every bucket launch so far.
    pub fn launch_log(&self) -> Vec<LaunchRecord> {
        self.state
            .lock()
            .timing
            .launch_log
            .iter()
            .cloned()
            .collect()
    }

    /// The current bucket layout: parameter paths per bucket, in launch order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        let state = self.state.lock();
        state
            .layout
            .buckets
            .iter()
            .map(|b| b.params.iter().map(|&p| self.params[p].0.clone()).collect())
            .collect()
    }
}

/// Reports the first failure among `works` whose outcome is known, and forgets the finished.
fn check_finished_works(works: &mut Vec<Work>) -> Result<()> {
    let mut failure = None;
    works.retain(|w| match w.try_result() {
        None => true,
        Some(Ok(())) => false,
        Some(Err(e)) => {
            failure.get_or_insert(e);
            false
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Turns completed pending steps into timings (all of them, waiting, with `wait`; otherwise those
/// the device has passed, and the oldest ones beyond the bound).
fn file_timings(timing: &mut Timing, wait: bool) {
    while let Some(step) = timing.pending_steps.front() {
        let must = wait || timing.pending_steps.len() > MAX_PENDING_STEPS;
        if !must && !step.is_complete() {
            break;
        }
        if let Some(step) = timing.pending_steps.pop_front() {
            let resolved = step.resolve();
            timing.telemetry.push(resolved);
        }
    }
}

fn to_core(e: DistError) -> tandem_core::Error {
    tandem_core::Error::external("DistributedDataParallel", e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadProcessGroup;
    use tandem_core::GradReady;

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
            auto_buckets: None,
        };
        let reducer = Reducer::new(
            group,
            vec![("layer.weight".into(), w.clone())],
            Device::Cpu,
            config,
        )
        .unwrap();
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

    /// A reducer on a group of one over `a.weight` and `b.weight` (3 elements each), one
    /// bucket per parameter, with `fault` injected into its launches.
    fn two_buckets(fault: Option<accounting::BucketFault>) -> (Arc<Reducer>, [Tensor; 2]) {
        let group: Arc<dyn ProcessGroup> =
            Arc::new(ThreadProcessGroup::new_group(1).unwrap().remove(0));
        let param = || {
            Tensor::zeros(&[3], DType::F32, Device::Cpu)
                .unwrap()
                .with_requires_grad()
                .unwrap()
        };
        let (a, b) = (param(), param());
        let config = ReducerConfig {
            reduction: GradReduction::Mean,
            bucket_cap_bytes: 12,
            first_bucket_bytes: 12,
            find_unused_parameters: false,
            rebuild_buckets: false,
            comm_hook: None,
            auto_buckets: None,
        };
        let params = vec![
            ("a.weight".into(), a.clone()),
            ("b.weight".into(), b.clone()),
        ];
        let reducer = Reducer::new(group, params, Device::Cpu, config).unwrap();
        reducer.state.lock().pass.fault = fault;
        (reducer, [a, b])
    }

    /// One synchronised backward through the hooks: both gradients ready, then finished.
    fn backward(reducer: &Reducer, params: &[Tensor; 2]) -> Result<()> {
        reducer.mark_forward_end();
        for p in params.iter().rev() {
            reducer.on_grad_ready(&GradReady {
                param: p.clone(),
                grad: Tensor::ones(&[3], DType::F32, Device::Cpu).unwrap(),
                event: Event::completed(),
            })?;
        }
        let summary = tandem_core::graph::BackwardSummary {
            reached: Default::default(),
        };
        reducer.on_backward_finished(&summary)
    }

    #[test]
    fn every_bucket_reduced_once_passes_the_self_check() {
        let (reducer, params) = two_buckets(None);
        assert_eq!(reducer.bucket_layout().len(), 2);
        backward(&reducer, &params).unwrap();
        backward(&reducer, &params).unwrap();
        reducer.detach();
    }

    #[test]
    fn a_skipped_bucket_is_an_error_naming_it_and_its_parameters() {
        let (reducer, params) = two_buckets(Some(accounting::BucketFault::Skip(1)));
        let in_bucket_1 = reducer.bucket_layout()[1].join(", ");
        let err = backward(&reducer, &params).unwrap_err().to_string();
        assert!(
            err.contains("gradient bucket 1 was reduced 0 time(s) in synchronised backward #0")
                && err.contains(&format!("its parameters: {in_bucket_1}.")),
            "{err}"
        );
        reducer.detach();
    }

    #[test]
    fn a_bucket_reduced_twice_is_an_error_naming_it_and_its_parameters() {
        let (reducer, params) = two_buckets(Some(accounting::BucketFault::Twice(0)));
        let in_bucket_0 = reducer.bucket_layout()[0].join(", ");
        let err = backward(&reducer, &params).unwrap_err().to_string();
        assert!(
            err.contains("gradient bucket 0 was reduced 2 time(s)")
                && err.contains(&format!("its parameters: {in_bucket_0}.")),
            "{err}"
        );
        reducer.detach();
    }
}
