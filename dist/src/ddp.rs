//! `DistributedDataParallel`: the user-facing wrapper that makes a model train on many ranks.
//!
//! ```text
//! rank r:  forward ──► loss ──► backward: grads of layer L, L-1, … , 1
//!                                    │ gradient-ready events
//!                                    ▼
//!          Reducer: scale grad by 1/world in its bucket slot; bucket full ──► all-reduce on
//!                   the comm stream while backward goes on
//!          backward finished ──► the compute stream waits on the buckets still in flight
//!                                    ▼
//!          optimizer.step() reads averaged gradients (views into the buckets)
//! ```
//!
//! **Devices.** The model lives on the device of the group's comm stream: the CPU for the TCP and
//! threads backends, a GPU for a device backend (move the model first with
//! `Module::to_device`). Buckets are allocated there (device memory on a GPU), gradients are
//! views into them, and on a GPU the host never waits inside backward: the optimizer's kernels,
//! issued next on the compute stream, run once the buckets are reduced.
//!
//! **Averaging.** Gradients are averaged over ranks by default ([`GradReduction::Mean`]): with
//! a mean-reduced loss and a global batch B split into B/N per rank, the averaged gradient is
//! exactly the gradient one process computes on the whole batch B, so the single-process
//! learning rate stays right. `GradReduction::Sum` is an explicit choice and makes gradients N
//! times larger. With a sum-reduced loss, `Mean` yields the full-batch sum divided by N.
//!
//! **When synchronisation happens.** During backward, bucket by bucket, in reverse layer order
//! (the order gradients become ready); at backward's end the compute stream waits only for what
//! is still in flight. A collective that fails is reported by `backward()` when its failure is
//! known by then (always on the CPU), otherwise by the next [`DistributedDataParallel::forward`].
//!
//! **BatchNorm.** Plain BatchNorm under DDP normalises each rank's B/N samples with that
//! rank's own statistics — not what one process with batch B computes. Use
//! [`SyncBatchNorm`](crate::SyncBatchNorm) (see [`convert_sync_batch_norm`](crate::convert_sync_batch_norm))
//! for statistics over the global batch. Buffers (running statistics) are broadcast from rank
//! 0 before every forward unless [`DdpConfig::broadcast_buffers`] is off.
//!
//! **Uneven inputs.** Ranks with different numbers of batches wrap their loops in
//! [`DistributedDataParallel::join`] (see [`crate::join`]); without it a rank that stops early
//! leaves the others failing at the group's timeout with an error naming it.

use std::sync::Arc;
use std::time::Duration;

use tandem_core::{Device, Tensor};
use tandem_nn::Module;

use parking_lot::Mutex;

use crate::coalesce::CoalescedBroadcast;
use crate::join::JoinSession;
use crate::reducer::autotune::{AutoBuckets, BucketChoice};
use crate::reducer::comm_hook::CommHook;
use crate::reducer::telemetry::Telemetry;
use crate::reducer::{GradReduction, LaunchRecord, Reducer, ReducerConfig};
use crate::stragglers::{self, RankStepTimes, StragglerSummary};
use crate::{CollectiveLabel, DistError, ProcessGroup, ReduceOp, Result};

/// Settings of [`DistributedDataParallel`]; every rank must use the same.
#[derive(Clone)]
pub struct DdpConfig {
    /// How gradients are combined across ranks. Default: [`GradReduction::Mean`].
    pub reduction: GradReduction,
    /// Largest bucket, in MiB (with [`DdpConfig::auto_buckets`], the cap until the first
    /// choice). Default: 25.
    pub bucket_cap_mb: f64,
    /// Largest first bucket (the last layers' gradients), in MiB, so that communication
    /// starts early. Default: 1.
    pub first_bucket_mb: f64,
    /// Broadcast buffers (BatchNorm running statistics) from rank 0 before each forward.
    /// Default: true.
    pub broadcast_buffers: bool,
    /// Let backward passes leave parameters unreached, so models with conditional branches
    /// train. A parameter reached on some ranks gets the average over all ranks, the others
    /// contributing their current gradient (zero when they have none) — what one process on
    /// the full batch computes. A parameter no rank reached keeps its `.grad` exactly as it
    /// was (`None` stays `None`, so optimizers skip it and weight decay or momentum do not
    /// move it), as in PyTorch. Costs one small all-reduce per step. Default: false (such a
    /// parameter makes the next forward fail with an error naming it).
    pub find_unused_parameters: bool,
    /// After the first iteration, rebuild buckets in the order gradients actually became ready
    /// (rank 0's order is broadcast). Default: true.
    pub rebuild_buckets: bool,
    /// Replaces each bucket's all-reduce (for example [`CompressionHook::bf16`](crate::CompressionHook::bf16)).
    /// Default: none (plain all-reduce).
    pub comm_hook: Option<Arc<dyn CommHook>>,
    /// Gather every rank's step times (forward, backward, last-bucket wait: a few floats per
    /// step) every this many training forwards, to name stragglers ([`crate::stragglers`]).
    /// Every rank must use the same value. 0: only [`DistributedDataParallel::gather_step_times`]
    /// gathers. Default: 100.
    pub straggler_every: usize,
    /// Choose the bucket cap from measurements: after a few synchronised steps, rank 0 fits the
    /// link to DDP's own bucket all-reduces, replays the measured gradient-ready times under
    /// each candidate cap and every rank re-buckets to the cap with the least predicted
    /// exposed communication ([`DistributedDataParallel::bucket_choices`]; README "what bucket
    /// size"). Default: none (the fixed `bucket_cap_mb`).
    pub auto_buckets: Option<AutoBuckets>,
}

impl DdpConfig {
    /// The default settings with the automatic bucket cap ([`AutoBuckets::default`]).
    pub fn auto() -> DdpConfig {
        DdpConfig {
            auto_buckets: Some(AutoBuckets::default()),
            ..DdpConfig::default()
        }
    }
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            reduction: GradReduction::Mean,
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            broadcast_buffers: true,
            find_unused_parameters: false,
            rebuild_buckets: true,
            comm_hook: None,
            straggler_every: 100,
            auto_buckets: None,
        }
    }
}

/// A model replicated on every rank whose gradients are averaged during backward.
pub struct DistributedDataParallel {
    pub(crate) module: Arc<dyn Module>,
    pub(crate) group: Arc<dyn ProcessGroup>,
    pub(crate) reducer: Arc<Reducer>,
    /// The buffers, packed for one broadcast per dtype before each forward.
    buffers: Option<CoalescedBroadcast>,
    config: DdpConfig,
    /// The join context while [`DistributedDataParallel::join`] runs (`join.rs`).
    pub(crate) join: Mutex<Option<JoinSession>>,
    /// Step times gathered across ranks so far (`stragglers.rs`).
    stragglers: Mutex<StragglerState>,
    /// A delay added to every forward of this rank (tests: a straggler to be named).
    forward_delay: Mutex<Duration>,
}

/// What [`DistributedDataParallel`] knows of the ranks' step times.
#[derive(Default)]
struct StragglerState {
    summary: StragglerSummary,
    /// Telemetry steps (counted from the start) already gathered.
    gathered_upto: usize,
    /// Training forwards outside a join since the last periodic gather.
    forwards: usize,
}

impl DistributedDataParallel {
    /// Wraps `module`: checks that every rank holds the same parameter names and shapes,
    /// broadcasts parameters and buffers from rank 0, and sets up the buckets and hooks.
    pub fn new(
        module: Arc<dyn Module>,
        group: Arc<dyn ProcessGroup>,
        config: DdpConfig,
    ) -> Result<Self> {
        let rank = group.rank();
        if !(config.bucket_cap_mb > 0.0 && config.first_bucket_mb > 0.0) {
            return Err(DistError::config(
                rank,
                format!(
                    "DdpConfig: bucket_cap_mb ({}) and first_bucket_mb ({}) must be positive",
                    config.bucket_cap_mb, config.first_bucket_mb
                ),
            ));
        }
        let params = module.named_parameters();
        let buffers = module.named_buffers();
        let device = model_device(group.as_ref(), &params, &buffers)?;
        check_same_model(group.as_ref(), device, &params, &buffers)?;
        // Every rank starts from rank 0's values.
        let everything: Vec<Tensor> = params
            .iter()
            .chain(&buffers)
            .map(|(_, t)| t.clone())
            .collect();
        CoalescedBroadcast::new(rank, &everything)?.broadcast(group.as_ref(), 0)?;
        let buffers = if buffers.is_empty() || group.world_size() == 1 {
            None
        } else {
            let tensors: Vec<Tensor> = buffers.iter().map(|(_, t)| t.clone()).collect();
            Some(CoalescedBroadcast::new(rank, &tensors)?)
        };
        let mib = |m: f64| ((m * (1 << 20) as f64) as usize).max(1);
        let reducer = Reducer::new(
            group.clone(),
            params,
            device,
            ReducerConfig {
                reduction: config.reduction,
                bucket_cap_bytes: mib(config.bucket_cap_mb),
                first_bucket_bytes: mib(config.first_bucket_mb),
                find_unused_parameters: config.find_unused_parameters,
                rebuild_buckets: config.rebuild_buckets,
                comm_hook: config.comm_hook.clone(),
                auto_buckets: config.auto_buckets.clone(),
            },
        )?;
        Ok(DistributedDataParallel {
            module,
            group,
            reducer,
            buffers,
            config,
            join: Mutex::new(None),
            stragglers: Mutex::new(StragglerState::default()),
            forward_delay: Mutex::new(Duration::ZERO),
        })
    }

    /// Runs the wrapped module's forward. Reports parameters the previous backward did not
    /// reach, rebuilds buckets after the first iteration, and broadcasts buffers from rank 0
    /// (inside [`DistributedDataParallel::join`], from the lowest rank still active).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let root = self.join_notify(x)?;
        self.forward_from(x, root)
    }

    /// [`DistributedDataParallel::forward`] with the buffers broadcast from `root`.
    pub(crate) fn forward_from(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        let rank = self.group.rank();
        self.reducer.prepare_forward()?;
        self.maybe_gather_step_times()?;
        if let Some(buffers) = self
            .buffers
            .as_ref()
            .filter(|_| self.config.broadcast_buffers)
        {
            buffers.broadcast(self.group.as_ref(), root)?;
        }
        self.reducer.mark_forward_start();
        let out = self
            .module
            .forward(x)
            .map_err(|e| DistError::model(rank, "forward of the wrapped module", e))?;
        let delay = *self.forward_delay.lock();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        self.reducer.mark_forward_end();
        Ok(out)
    }

    /// Runs `f` (typically forward and backward of a micro-batch) without synchronising:
    /// gradients accumulate locally, and the next synchronised backward reduces the
    /// accumulated sum. Use it for gradient accumulation.
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        let previous = self.reducer.is_sync();
        self.reducer.set_sync(false);
        let out = f();
        self.reducer.set_sync(previous);
        out
    }

    /// The wrapped module, for its parameters (the optimizer's), checkpoints and inspection.
    ///
    /// **Run forwards through [`DistributedDataParallel::forward`], not through
    /// `ddp.module().forward(..)`.** DDP's forward broadcasts rank 0's buffers (BatchNorm
    /// running statistics) and checks the previous step (parameters that got no gradient,
    /// collectives that failed later); the module's own forward skips all of it. The gradient
    /// hooks still fire on backward, so the gradients are still reduced, and the backward of
    /// such a forward returns [`DistError::ForwardBypassed`] after reducing them. A forward
    /// under `no_grad` (evaluation) has no backward and may use the module directly.
    pub fn module(&self) -> &Arc<dyn Module> {
        &self.module
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Per-step overlap telemetry, with the stragglers of the steps gathered across ranks so
    /// far ([`Telemetry::stragglers`]).
    pub fn telemetry(&self) -> Telemetry {
        let mut telemetry = self.reducer.telemetry();
        telemetry.stragglers = self.stragglers.lock().summary.clone();
        telemetry
    }

    /// Gathers every rank's step times not gathered yet and returns the stragglers of all the
    /// steps gathered so far (see [`crate::stragglers`]). A collective: every rank calls it at
    /// the same point (for example after its training loop, before printing the summary).
    pub fn gather_step_times(&self) -> Result<StragglerSummary> {
        // Named in hang diagnoses: a rank that skips this gather (its summary) is told apart
        // from one that skips a step's collectives.
        crate::with_collective_label(CollectiveLabel::Named(stragglers::GATHER_LABEL), || {
            self.gather_step_times_labelled()
        })
    }

    /// [`DistributedDataParallel::gather_step_times`], its collectives labelled by the caller.
    fn gather_step_times_labelled(&self) -> Result<StragglerSummary> {
        let telemetry = self.reducer.telemetry();
        let mut state = self.stragglers.lock();
        let world = self.group.world_size();
        let total = telemetry.total_steps();
        let kept = telemetry.steps();
        let new = total.saturating_sub(state.gathered_upto).min(kept.len());
        let local: Vec<RankStepTimes> = kept[kept.len() - new..]
            .iter()
            .map(RankStepTimes::of)
            .collect();
        // Every rank needs the same window: the longest of the ranks' unread steps.
        let window = if world > 1 {
            let n = [local.len() as f64];
            let n = Tensor::from_vec(n.to_vec(), &[1], self.reducer_device())
                .map_err(|e| DistError::tensor(self.group.rank(), "gathering step times", e))?;
            self.group.all_reduce(&n, ReduceOp::Max)?.wait()?;
            n.to_vec::<f64>()
                .map_err(|e| DistError::tensor(self.group.rank(), "gathering step times", e))?[0]
                as usize
        } else {
            local.len()
        };
        if window > 0 {
            let steps =
                stragglers::gather(self.group.as_ref(), self.reducer_device(), &local, window)?;
            steps.iter().for_each(|s| state.summary.add_step(s));
        }
        state.gathered_upto = total;
        state.forwards = 0;
        Ok(state.summary.clone())
    }

    /// The periodic gather of [`DdpConfig::straggler_every`]: counts training forwards outside a
    /// join (which every rank issues alike) and gathers at every K-th.
    fn maybe_gather_step_times(&self) -> Result<()> {
        let every = self.config.straggler_every;
        if every == 0 || !tandem_autograd::is_grad_enabled() || self.join.lock().is_some() {
            return Ok(());
        }
        let due = {
            let mut state = self.stragglers.lock();
            state.forwards += 1;
            state.forwards > every
        };
        if due {
            self.gather_step_times()?;
        }
        Ok(())
    }

    /// Test knob: sleeps `delay` after every forward of the wrapped module on this rank, so that
    /// it becomes a straggler the summary must name.
    #[doc(hidden)]
    pub fn inject_forward_delay(&self, delay: Duration) {
        *self.forward_delay.lock() = delay;
    }

    fn reducer_device(&self) -> Device {
        self.group.comm_stream().device()
    }

    /// The current buckets, as parameter paths, in launch order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_layout()
    }

    /// The automatic bucket cap's choices so far, the same on every rank (empty without
    /// [`DdpConfig::auto_buckets`] or on one rank).
    pub fn bucket_choices(&self) -> Vec<BucketChoice> {
        self.reducer.bucket_choices()
    }

    /// Every bucket launch so far (bucket index, and whether it was issued while backward was
    /// still computing).
    pub fn launch_log(&self) -> Vec<LaunchRecord> {
        self.reducer.launch_log()
    }
}

impl Drop for DistributedDataParallel {
    fn drop(&mut self) {
        self.reducer.detach();
    }
}

/// The device holding every parameter and buffer, which must be the device of the group's comm
/// stream (the CPU for the TCP and threads backends, the GPU for a device backend); parameters
/// must be dense, row-major or channels-last (their gradients become row-major views into the
/// buckets, filled and read in logical order, so a parameter's memory format — which may
/// differ between ranks — never changes what is reduced).
fn model_device(
    group: &dyn ProcessGroup,
    params: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
) -> Result<Device> {
    let rank = group.rank();
    let device = group.comm_stream().device();
    for (kind, list) in [("parameter", params), ("buffer", buffers)] {
        for (path, t) in list {
            if t.device() != device {
                return Err(DistError::config(
                    rank,
                    format!(
                        "DistributedDataParallel: {kind} `{path}` is on {} but the {} process \
                         group works on {device}; move the model there first \
                         (Module::to_device)",
                        t.device(),
                        group.backend()
                    ),
                ));
            }
        }
    }
    for (path, p) in params {
        if p.dense_format().is_none() {
            return Err(DistError::config(
                rank,
                format!(
                    "DistributedDataParallel: parameter `{path}` {:?} with strides {:?} is dense \
                     in no memory format (neither row-major nor channels-last)",
                    p.dims(),
                    p.layout().strides().as_slice()
                ),
            ));
        }
    }
    Ok(device)
}

/// Checks that every rank has the same parameter and buffer names, shapes and dtypes. Rank 0's
/// description is broadcast; each rank compares and the ranks' verdicts are gathered, so every
/// rank fails with an error naming the first rank that differs and the first difference. The
/// collectives run on `device`, the model's, which every backend reaches.
fn check_same_model(
    group: &dyn ProcessGroup,
    device: Device,
    params: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
) -> Result<()> {
    let rank = group.rank();
    let world = group.world_size();
    if world == 1 {
        return Ok(());
    }
    let describe = |kind: &str, list: &[(String, Tensor)]| -> Vec<String> {
        list.iter()
            .map(|(n, t)| format!("{kind} `{n}` {:?} {}", t.dims(), t.dtype()))
            .collect()
    };
    let mut mine = describe("parameter", params);
    mine.extend(describe("buffer", buffers));
    let text = mine.join("\n");
    let model_err =
        |e: tandem_core::Error| DistError::tensor(rank, "comparing the models of the ranks", e);

    let len = Tensor::from_vec(vec![text.len() as i64], &[1], device).map_err(model_err)?;
    group.broadcast(&len, 0)?.wait()?;
    let n = len.to_vec::<i64>().map_err(model_err)?[0].max(0) as usize;
    // Rank 0's description has a line per tensor; anything near this bound is not a model.
    const MAX_DESCRIPTION_BYTES: usize = 256 << 20;
    if n > MAX_DESCRIPTION_BYTES {
        return Err(DistError::ModelMismatch {
            rank,
            detail: format!(
                "rank 0 describes its model in {n} bytes, more than the {MAX_DESCRIPTION_BYTES} \
                 any model needs"
            ),
        });
    }
    let bytes = if rank == 0 {
        text.as_bytes().to_vec()
    } else {
        vec![0u8; n]
    };
    let reference = Tensor::from_vec(bytes, &[n], device).map_err(model_err)?;
    group.broadcast(&reference, 0)?.wait()?;
    let reference_text =
        String::from_utf8_lossy(&reference.to_vec::<u8>().map_err(model_err)?).into_owned();
    let theirs: Vec<&str> = reference_text
        .split('\n')
        .filter(|l| !l.is_empty())
        .collect();

    // Index of this rank's first difference with rank 0 (or -1 when identical).
    let first_diff = (0..mine.len().max(theirs.len()))
        .find(|&i| mine.get(i).map(String::as_str) != theirs.get(i).copied())
        .map_or(-1.0, |i| i as f64);
    let mut verdicts = vec![0.0f64; world];
    verdicts[rank] = first_diff;
    let verdicts = Tensor::from_vec(verdicts, &[world], device).map_err(model_err)?;
    group.all_reduce(&verdicts, ReduceOp::Sum)?.wait()?;
    let verdicts = verdicts.to_vec::<f64>().map_err(model_err)?;
    if let Some((bad_rank, &at)) = verdicts.iter().enumerate().find(|(_, &v)| v >= 0.0) {
        let at = at as usize;
        let reference = theirs.get(at).copied().unwrap_or("nothing");
        let detail = if bad_rank == rank {
            let ours = mine.get(at).map(String::as_str).unwrap_or("nothing");
            format!("rank {rank} has {ours} where rank 0 has {reference} (entry #{at})")
        } else {
            format!(
                "rank {bad_rank} differs from rank 0 at entry #{at}, where rank 0 has {reference}"
            )
        };
        return Err(DistError::ModelMismatch { rank, detail });
    }
    Ok(())
}
