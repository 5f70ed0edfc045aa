//! What the training examples share: joining or launching the ranks of a data-parallel job
//! (restarting it after a failure), the loaders (a shard per rank), the forward that goes
//! through DDP when there is one, the training epoch with its checkpoints ([`checkpoints`]),
//! the per-epoch evaluation (every rank its `DistributedEvalSampler` part of the test set, the
//! counts summed over the ranks: the same figure for any number of ranks), `--eval-only`
//! ([`evaluate_checkpoint`]), the end-of-run report with the
//! job's merged trace (`Timeline::write_job_chrome_trace`), and output that survives a closed
//! pipe ([`output`]).

pub mod checkpoints;
pub mod output;
pub mod split;

use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tandem::autograd::TensorBackward;
use tandem::core::{DType, Device, MemoryFormat, Tensor};
use tandem::dist::launch::{forward_signals, launch, LaunchOptions};
use tandem::dist::metrics::evaluate_across_ranks;
use tandem::dist::{
    init_with_options, DdpConfig, DistributedDataParallel, DistributedEvalSampler, InitOptions,
    JoinConfig, LaunchEnv, Phase, ProcessGroup, Timeline,
};
use tandem::nn::checkpoint::GRAD_SCALER_PREFIX;
use tandem::nn::data::{Batch, DataLoader, DataLoaderConfig, Dataset};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::metrics::Accuracy;
use tandem::nn::Module;
use tandem::optim::{GradScaler, GradScalerConfig, Optimizer};

use checkpoints::{Checkpoints, Progress};
use output::complain;
pub use split::{train_loader, TrainLoader};

/// Errors of the examples' `run`.
pub type AnyError = Box<dyn std::error::Error>;

/// The built-in launcher's ranks failed (or it was interrupted); the example exits with
/// `code`, as `tandem-run` would.
#[derive(Debug)]
pub struct LaunchFailed {
    /// What failed (`rank 1 failed with … (after 2 restarts)`).
    pub message: String,
    /// The exit status for the launching process.
    pub code: u8,
}

impl std::fmt::Display for LaunchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LaunchFailed {}

/// Reports the error of `run` on stderr and gives the process's exit status: a failed
/// launch's own code (as `tandem-run` exits), otherwise 1.
pub fn exit_with_error(e: AnyError) -> std::process::ExitCode {
    complain(format_args!("error: {e}"));
    let code = e.downcast_ref::<LaunchFailed>().map_or(1, |f| f.code);
    std::process::ExitCode::from(code)
}

/// What one epoch produced.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochResult {
    pub train_loss: f64,
    pub test_accuracy: f64,
    /// Test samples classified correctly (over all ranks).
    pub test_correct: u64,
    pub images_per_sec: f64,
    pub seconds: f64,
    /// Training samples each rank used this epoch, in rank order (their sum is the training
    /// set's size when every sample is used exactly once; more when the split is padded).
    pub train_samples: Vec<u64>,
}

/// Whether the environment describes a process group this process should join (as
/// `tandem-run`, torchrun, SLURM's srun or mpirun set it).
fn group_in_environment() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some();
    (set("RANK") && set("WORLD_SIZE"))
        || (set("SLURM_PROCID") && set("SLURM_NTASKS"))
        || set("OMPI_COMM_WORLD_RANK")
}

/// What this process does in the job.
pub enum Role {
    /// It started the ranks, which have all finished: nothing left to do.
    Launched,
    /// It trains on `device`, alone (`group` is `None`) or as one rank of a group.
    Train {
        group: Option<Arc<dyn ProcessGroup>>,
        device: Device,
    },
}

/// The flags every example shares: where it runs, on how many ranks, from which seed, and what
/// it writes besides checkpoints (`#[command(flatten)]` in each example's own arguments).
#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// Seed of the initialisation, the shuffling and the augmentation (where there is one).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Threads of the compute pool [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write the results as a JSON object to this file.
    #[arg(long)]
    pub metrics_out: Option<std::path::PathBuf>,
    /// Write tandem's own timeline of the steps (forward, backward, optimizer and data on the
    /// compute stream, each bucket's all-reduce on the comm stream; one track per stream per
    /// rank) as a Chrome trace to this file; open it in Perfetto or chrome://tracing.
    #[arg(long)]
    pub trace_out: Option<std::path::PathBuf>,
    /// Where to train: cpu, cuda (with several ranks: each rank on cuda:LOCAL_RANK) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Train data-parallel on this many local processes (DDP).
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// With --nproc-per-node: restart all ranks up to this many times after a failure (they
    /// resume from the newest checkpoint in --checkpoint-dir).
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Also write a checkpoint every this many steps inside an epoch.
    #[arg(long)]
    pub checkpoint_every: Option<usize>,
    /// Resume from this checkpoint (written by this example) instead of the newest in
    /// --checkpoint-dir.
    #[arg(long)]
    pub resume: Option<std::path::PathBuf>,
    /// With --nproc-per-node: DDP's bucket size in MiB, or `auto` to have it chosen from the
    /// measured link and gradient-ready times after a few steps (README, "What bucket size").
    #[arg(long, default_value = "25", value_parser = parse_bucket_cap)]
    pub bucket_cap_mb: BucketCap,
    /// Mixed precision: forward and loss under autocast in bf16 or f16 (f16 with a dynamic
    /// gradient scaler, PyTorch's defaults); parameters, gradients, the optimizer and DDP's
    /// buckets stay f32, and evaluation runs in f32.
    #[arg(long, value_enum)]
    pub amp: Option<Amp>,
    /// Channels-last (NHWC) training batches and a channels-last model (its convolution
    /// weights converted in place by `Module::to_memory_format`): convolution, batch norm,
    /// pooling and the elementwise ops then run channels-last.
    #[arg(long)]
    pub channels_last: bool,
    /// With --nproc-per-node, when the world size does not divide the training set: pad each
    /// rank's share by repeating samples (PyTorch's DistributedSampler) instead of giving each
    /// rank its exact share and training each epoch inside DDP's join (README, "My ranks have
    /// different amounts of data").
    #[arg(long)]
    pub no_join: bool,
}

/// `--amp`: the autocast dtype.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Amp {
    /// bfloat16: f32's range, no scaler needed.
    Bf16,
    /// IEEE half: a gradient scaler keeps small gradients from flushing to zero.
    F16,
}

impl Amp {
    /// The autocast dtype.
    pub fn dtype(self) -> DType {
        match self {
            Amp::Bf16 => DType::BF16,
            Amp::F16 => DType::F16,
        }
    }
}

/// `--bucket-cap-mb`: a fixed size or the automatic choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BucketCap {
    /// This many MiB per bucket.
    Fixed(f64),
    /// `DdpConfig::auto()`.
    Auto,
}

/// Reads `--bucket-cap-mb`: a positive number of MiB or `auto`.
pub fn parse_bucket_cap(text: &str) -> Result<BucketCap, String> {
    if text == "auto" {
        return Ok(BucketCap::Auto);
    }
    match text.parse::<f64>() {
        Ok(mb) if mb.is_finite() && mb > 0.0 => Ok(BucketCap::Fixed(mb)),
        _ => Err(format!(
            "expected a positive number of MiB or `auto`, got `{text}`"
        )),
    }
}

impl BucketCap {
    /// DDP's settings for this choice (the defaults otherwise).
    pub fn ddp_config(self) -> DdpConfig {
        match self {
            BucketCap::Fixed(mb) => DdpConfig {
                bucket_cap_mb: mb,
                ..DdpConfig::default()
            },
            BucketCap::Auto => DdpConfig::auto(),
        }
    }
}

/// Reads `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(text: &str) -> Result<Device, String> {
    text.parse::<Device>().map_err(|e| e.to_string())
}

/// Checks that `device` can be used, so `--device cuda` on a machine without a usable GPU ends
/// with the runtime's error (no driver, no device, ordinal out of range) before any data is
/// loaded.
fn check_device(device: Device) -> Result<Device, AnyError> {
    if let Device::Cuda(_) = device {
        Tensor::zeros(&[1], DType::F32, device)?;
    }
    Ok(device)
}

/// Joins the group the environment describes; otherwise, with `run.nproc_per_node > 1`, starts
/// that many ranks of this same program (each then joins) and waits for them — with
/// `tandem-run`'s launcher: signals are forwarded to the ranks, the ranks die with this
/// process, and a failed job is restarted up to `max_restarts` times (the ranks then resume
/// from their newest checkpoint); otherwise trains alone. Sizes rayon's pool: `threads`, or
/// the cores shared among the local ranks.
pub fn join_or_launch(run: &RunArgs) -> Result<Role, AnyError> {
    let RunArgs {
        nproc_per_node,
        max_restarts,
        threads,
        device,
        ..
    } = *run;
    let joining = group_in_environment();
    if nproc_per_node > 1 && !joining {
        let program = std::env::current_exe()?;
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        if let Err(e) = forward_signals() {
            complain(format_args!(
                "warning: {e}; Ctrl-C will not be forwarded to the ranks"
            ));
        }
        let options = LaunchOptions {
            max_restarts,
            ..LaunchOptions::new(nproc_per_node, program, args)
        };
        let report = launch(&options)?;
        if let Some(message) = report.failure_message() {
            return Err(Box::new(LaunchFailed {
                message,
                code: report.exit_code(),
            }));
        }
        return Ok(Role::Launched);
    }
    if !joining {
        tandem::ops::set_num_threads(threads.unwrap_or(0))?;
        return Ok(Role::Train {
            group: None,
            device: check_device(device)?,
        });
    }
    let env = LaunchEnv::from_process_env()?;
    let threads = threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / env.local_world_size.max(1)).max(1)
    });
    tandem::ops::set_num_threads(threads)?;
    // Plain `cuda` means one GPU per local rank: cuda:LOCAL_RANK (or the only GPU the launcher
    // left visible). The group is NCCL for CUDA and TCP for the CPU.
    let device = check_device(env.rank_device(device)?)?;
    let group = init_with_options(
        &env,
        InitOptions {
            device,
            ..InitOptions::default()
        },
    )?;
    Ok(Role::Train {
        group: Some(group),
        device,
    })
}

/// The model as the training step sees it: through DDP when training data-parallel.
pub struct Trainer {
    pub model: Arc<dyn Module>,
    pub ddp: Option<DistributedDataParallel>,
    /// The step timeline (`--trace-out`), when asked for.
    pub timeline: Option<RefCell<Timeline>>,
    /// `--amp`: the autocast dtype of the forward and the loss.
    pub amp: Option<DType>,
    /// `--amp f16`: the gradient scaler.
    pub scaler: RefCell<Option<GradScaler>>,
}

impl Trainer {
    /// A timeline for this rank when `trace_out` is set (see [`Trainer::write_trace`]).
    pub fn with_timeline(mut self, trace_out: Option<&Path>) -> Result<Self, AnyError> {
        if trace_out.is_some() {
            let device = self.model.device();
            self.timeline = Some(RefCell::new(Timeline::new(self.rank(), device)?));
        }
        Ok(self)
    }

    /// Runs `f` as `phase` of the current step on the timeline (and in an NVTX range), when
    /// there is a timeline.
    pub fn phase<T>(
        &self,
        phase: Phase,
        f: impl FnOnce() -> Result<T, AnyError>,
    ) -> Result<T, AnyError> {
        let Some(timeline) = &self.timeline else {
            return f();
        };
        timeline.borrow_mut().begin(phase)?;
        let out = f();
        timeline.borrow_mut().end(phase)?;
        out
    }

    /// Writes the job's timeline as one Chrome trace to `path` (every rank its part, then
    /// rank 0 merges them; see `Timeline::write_job_chrome_trace`) and returns this rank's
    /// overlap summary. Every rank must call it.
    pub fn write_trace(&self, path: &Path) -> Result<Option<String>, AnyError> {
        let Some(timeline) = &self.timeline else {
            return Ok(None);
        };
        let mut timeline = timeline.borrow_mut();
        if let Some(ddp) = &self.ddp {
            timeline.record_ddp(&ddp.telemetry());
        }
        let summary = timeline.overlap_summary()?.to_string();
        let group = self.ddp.as_ref().map(|d| d.group().as_ref());
        timeline.write_job_chrome_trace(path, group)?;
        Ok(Some(summary))
    }

    /// The step's loss: forward and cross entropy, under autocast with `--amp`.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Result<Tensor, AnyError> {
        let forward = || -> Result<Tensor, AnyError> {
            let logits = self.forward(inputs)?;
            Ok(cross_entropy(&logits, targets, Reduction::Mean)?)
        };
        match self.amp {
            Some(dtype) => tandem::autocast(dtype, forward)?,
            None => forward(),
        }
    }

    /// Backward from `loss` (scaled, with a gradient scaler).
    pub fn backward(&self, loss: &Tensor) -> Result<(), AnyError> {
        match self.scaler.borrow().as_ref() {
            Some(scaler) => scaler.scale(loss)?.backward()?,
            None => loss.backward()?,
        }
        Ok(())
    }

    /// The optimizer's step; with a gradient scaler, skipped when a gradient is not finite
    /// (the same decision on every rank: DDP's gradients are the same everywhere), and the
    /// scale updated.
    pub fn step(&self, optimizer: &mut dyn Optimizer) -> Result<(), AnyError> {
        match self.scaler.borrow_mut().as_mut() {
            Some(scaler) => {
                scaler.step(optimizer)?;
                scaler.update()?;
            }
            None => optimizer.step()?,
        }
        Ok(())
    }

    /// The gradient scaler's state for a checkpoint (empty without one).
    pub fn scaler_state(&self) -> Vec<(String, Tensor)> {
        self.scaler.borrow().as_ref().map_or_else(Vec::new, |s| {
            s.state()
                .into_iter()
                .map(|(n, t)| (format!("{GRAD_SCALER_PREFIX}{n}"), t))
                .collect()
        })
    }

    /// Restores the gradient scaler from a checkpoint's state (nothing to do without a scaler
    /// or without saved state).
    pub fn load_scaler(&self, state: &[(String, Tensor)]) -> Result<(), AnyError> {
        if let (Some(scaler), false) = (self.scaler.borrow_mut().as_mut(), state.is_empty()) {
            scaler.load_state(state)?;
        }
        Ok(())
    }

    /// The step's forward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, AnyError> {
        Ok(match &self.ddp {
            Some(ddp) => ddp.forward(x)?,
            None => self.model.forward(x)?,
        })
    }

    /// This process's rank (0 when alone).
    pub fn rank(&self) -> usize {
        self.ddp.as_ref().map_or(0, |d| d.group().rank())
    }

    /// Number of ranks (1 when alone).
    pub fn world_size(&self) -> usize {
        self.ddp.as_ref().map_or(1, |d| d.group().world_size())
    }
}

/// Evaluates the model on the test set after an epoch (every rank its part, the counts summed:
/// see [`test_loader`]), fills in the result's accuracy and (rank 0) prints the epoch's line.
/// Every rank must call it.
pub fn report_epoch(
    trainer: &Trainer,
    test: &DataLoader,
    result: &mut EpochResult,
    epoch: usize,
    epochs: usize,
) -> Result<(), AnyError> {
    // The model itself, not DDP's forward: evaluation reduces no gradients.
    let group = trainer.ddp.as_ref().map(|d| d.group().as_ref());
    let accuracy = evaluate_across_ranks(group, trainer.model.as_ref(), test.epoch(0))?;
    result.test_accuracy = accuracy.fraction();
    result.test_correct = accuracy.correct;
    if trainer.rank() != 0 {
        return Ok(());
    }
    output::say(format_args!(
        "epoch {epoch}/{epochs}: train loss {:.4}, test accuracy {:.2}%, {:.0} images/s, {:.1} s",
        result.train_loss,
        100.0 * result.test_accuracy,
        result.images_per_sec,
        result.seconds
    ));
    Ok(())
}

/// The end of a run: every rank writes its part of the trace (`trace_out`), then rank 0 prints
/// where the trace is, the run's time, DDP's overlap summary, its stragglers and the gradient
/// scaler's skipped steps. Every rank must call it.
pub fn report_end(
    trainer: &Trainer,
    trace_out: Option<&Path>,
    seconds: f64,
) -> Result<(), AnyError> {
    let trace = match trace_out {
        Some(path) => trainer.write_trace(path)?.map(|summary| (path, summary)),
        None => None,
    };
    // A collective (every rank is here): the step times not gathered yet, for the summary.
    let stragglers = match &trainer.ddp {
        Some(ddp) => Some(ddp.gather_step_times()?),
        None => None,
    };
    if trainer.rank() != 0 {
        return Ok(());
    }
    if let Some((path, summary)) = trace {
        output::say(format_args!("timeline: {} ({summary})", path.display()));
    }
    output::say(format_args!("done in {seconds:.1} s"));
    if let Some(ddp) = &trainer.ddp {
        output::say(format_args!("overlap: {}", ddp.telemetry().summary()));
    }
    if let Some(stragglers) = stragglers {
        output::say(format_args!("stragglers: {stragglers}"));
    }
    if let Some(scaler) = trainer.scaler.borrow().as_ref() {
        output::say(format_args!(
            "gradient scaler: {} of {} steps skipped (inf/NaN gradients), scale now {}",
            scaler.skipped_steps(),
            scaler.steps(),
            scaler.scale_value()
        ));
    }
    Ok(())
}

/// This process's rank and the number of ranks (0 and 1 when training alone).
pub fn rank_and_world(group: Option<&Arc<dyn ProcessGroup>>) -> (usize, usize) {
    group.map_or((0, 1), |g| (g.rank(), g.world_size()))
}

/// Checks that the global batch `batch_size` splits evenly over `world` ranks.
pub fn check_global_batch(batch_size: usize, world: usize) -> Result<(), AnyError> {
    if !batch_size.is_multiple_of(world) {
        return Err(format!(
            "--batch-size {batch_size} (the global batch) must be divisible by the world size \
             {world}"
        )
        .into());
    }
    Ok(())
}

/// The test loader, in order, in batches of `batch_size`: alone, the whole set; in a group,
/// this rank's `DistributedEvalSampler` part (contiguous, no sample repeated or left out, the
/// ranks' counts differing by at most one), so the counts summed over the ranks are those of
/// the whole set.
pub fn test_loader(
    set: Arc<dyn Dataset>,
    group: Option<&Arc<dyn ProcessGroup>>,
    batch_size: usize,
    device: Device,
) -> Result<DataLoader, AnyError> {
    let config = DataLoaderConfig {
        device,
        batch_size,
        ..Default::default()
    };
    Ok(match group {
        Some(g) => {
            let sampler = DistributedEvalSampler::new(set.len(), g.world_size(), g.rank())?;
            DataLoader::with_sampler(set, Arc::new(sampler), config)?
        }
        None => DataLoader::new(set, config)?,
    })
}

/// `--eval-only`: loads the model's parameters and buffers from the checkpoint `path` (any
/// world size may evaluate a checkpoint of any other), evaluates it on the test set (every
/// rank its part of `test`, see [`test_loader`]), and rank 0 prints the accuracy and writes
/// `settings` with `checkpoint`, `test_accuracy`, `test_correct` and `test_total` to
/// `metrics_out`. Every rank must call it.
#[allow(dead_code)] // Not every example offers --eval-only.
pub fn evaluate_checkpoint(
    path: &Path,
    model: &dyn Module,
    group: Option<&Arc<dyn ProcessGroup>>,
    test: &DataLoader,
    metrics_out: Option<&Path>,
    settings: serde_json::Value,
) -> Result<Accuracy, AnyError> {
    checkpoints::load_model(path, model)?;
    let (rank, world) = rank_and_world(group);
    let accuracy = evaluate_across_ranks(group.map(|g| g.as_ref()), model, test.epoch(0))?;
    if rank != 0 {
        return Ok(accuracy);
    }
    output::say(format_args!(
        "{}: test accuracy {accuracy} on {world} rank{}",
        path.display(),
        if world == 1 { "" } else { "s" }
    ));
    if let Some(out) = metrics_out {
        let serde_json::Value::Object(mut metrics) = settings else {
            return Err("metrics settings must be a JSON object".into());
        };
        metrics.insert("eval_only".into(), json!(true));
        metrics.insert("checkpoint".into(), json!(path.display().to_string()));
        metrics.insert("test_accuracy".into(), json!(accuracy.fraction()));
        metrics.insert("test_correct".into(), json!(accuracy.correct));
        metrics.insert("test_total".into(), json!(accuracy.total));
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(metrics))? + "\n";
        std::fs::write(out, text).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    Ok(accuracy)
}

/// The trainer of `model`: through DDP (buckets as `run.bucket_cap_mb` says) when there is a
/// `group`, with a timeline when `run.trace_out` is set. With `--channels-last` the model's
/// convolution weights are converted to channels-last here, in place (an optimizer made before
/// keeps working with them; checkpoints store logical order either way).
pub fn trainer(
    model: Arc<dyn Module>,
    group: Option<&Arc<dyn ProcessGroup>>,
    run: &RunArgs,
) -> Result<Trainer, AnyError> {
    if run.channels_last {
        model.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    let ddp = match group {
        Some(g) => Some(DistributedDataParallel::new(
            model.clone(),
            g.clone(),
            run.bucket_cap_mb.ddp_config(),
        )?),
        None => None,
    };
    let scaler = match run.amp {
        Some(Amp::F16) => Some(GradScalerConfig::default().init()?),
        _ => None,
    };
    Trainer {
        model,
        ddp,
        timeline: None,
        amp: run.amp.map(Amp::dtype),
        scaler: RefCell::new(scaler),
    }
    .with_timeline(run.trace_out.as_deref())
}

/// The rest of the epoch `progress` is in: one pass over the training set from step
/// `progress.epoch_step` on (cross entropy; the test accuracy is filled in by the caller),
/// advancing `progress` step by step and writing the checkpoints that fall due. When the split
/// is uneven (see [`split`]) the pass runs inside `ddp.join`: the ranks with fewer batches
/// shadow the others' last steps, every rank ends at the epoch's last step, and every rank then
/// takes rank 0's optimizer state. `lr_at(g)`, when given, sets the learning rate of global
/// step `g`. Rank 0 shows a progress bar (on a terminal) with the running loss, the global
/// throughput and the share of the epoch spent waiting for the loader (data wait).
pub fn train_epoch(
    trainer: &Trainer,
    optimizer: &mut dyn Optimizer,
    train: &TrainLoader,
    progress: &mut Progress,
    epochs: usize,
    lr_at: Option<&dyn Fn(usize) -> f64>,
    checkpoints: &Checkpoints,
) -> Result<EpochResult, AnyError> {
    trainer.model.train();
    let bar = if trainer.rank() == 0 {
        ProgressBar::new(train.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {msg} ({eta})")?
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{}/{epochs}", progress.epoch));
    bar.set_position(progress.epoch_step as u64);
    let epoch = EpochSteps {
        trainer,
        train,
        lr_at,
        checkpoints,
        bar: &bar,
        started: Instant::now(),
    };
    let epoch_start = progress.global_step - progress.epoch_step;
    // The steps before a resumed position were full batches (they come before every rank's
    // last batch).
    let mut tally = Tally {
        images: 0,
        samples: progress.epoch_step * train.split.batch,
        losses: LossSum::default(),
    };
    match (&trainer.ddp, train.split.join) {
        (Some(ddp), true) => ddp.join(JoinConfig::default(), || {
            epoch.run(optimizer, progress, &mut tally)
        })??,
        _ => epoch.run(optimizer, progress, &mut tally)?,
    }
    progress.loss_sum += tally.losses.take()?;
    bar.finish_and_clear();
    let seconds = epoch.started.elapsed().as_secs_f64();
    let train_loss = progress.loss_sum / progress.epoch_step.max(1) as f64;
    if train.split.join {
        // Every rank took part in every step of the epoch (some shadowing the last ones).
        progress.epoch_step = train.len();
        progress.global_step = epoch_start + train.len();
        if train.split.common_steps < train.split.steps {
            split::sync_optimizer_state(trainer, optimizer)?;
        }
    }
    Ok(EpochResult {
        train_loss,
        test_accuracy: 0.0,
        test_correct: 0,
        images_per_sec: tally.images as f64 / seconds,
        seconds,
        train_samples: split::gather_sample_counts(trainer, tally.samples)?,
    })
}

/// What one epoch's steps share.
struct EpochSteps<'a> {
    trainer: &'a Trainer,
    train: &'a TrainLoader,
    lr_at: Option<&'a dyn Fn(usize) -> f64>,
    checkpoints: &'a Checkpoints,
    bar: &'a ProgressBar,
    started: Instant,
}

/// What the steps of an epoch add up.
struct Tally {
    /// Images of all ranks (this rank's times the world size), for the throughput.
    images: usize,
    /// This rank's samples.
    samples: usize,
    losses: LossSum,
}

impl EpochSteps<'_> {
    /// This rank's steps of the epoch from `progress.epoch_step` on.
    fn run(
        &self,
        optimizer: &mut dyn Optimizer,
        progress: &mut Progress,
        tally: &mut Tally,
    ) -> Result<(), AnyError> {
        let trainer = self.trainer;
        let mut batches = self
            .train
            .loader
            .epoch_from(progress.epoch as u64 - 1, progress.epoch_step);
        loop {
            if let Some(timeline) = &trainer.timeline {
                timeline.borrow_mut().begin_step()?;
            }
            let Some(batch) = trainer.phase(Phase::Data, || Ok(batches.next()))? else {
                break;
            };
            let batch = batch?;
            if let Some(lr_at) = self.lr_at {
                optimizer.set_learning_rate(lr_at(progress.global_step))?;
            }
            let loss = trainer.phase(Phase::Forward, || {
                trainer.loss(&batch.inputs, &batch.targets)
            })?;
            optimizer.zero_grad()?;
            trainer.phase(Phase::Backward, || trainer.backward(&loss))?;
            trainer.phase(Phase::Optimizer, || trainer.step(&mut *optimizer))?;
            tally.losses.add(&loss)?;
            progress.epoch_step += 1;
            progress.global_step += 1;
            tally.samples += batch.targets.numel();
            tally.images += batch.targets.numel() * trainer.world_size();
            if progress.epoch_step.is_multiple_of(10) {
                progress.loss_sum += tally.losses.take()?;
                let elapsed = self.started.elapsed().as_secs_f64();
                // A large share of waiting for the loader means the input pipeline (decoding,
                // augmentation), not the model, bounds the step.
                let data_wait = batches.wait_time().as_secs_f64();
                self.bar.set_message(format!(
                    "loss {:.4}, {:.0} images/s, data wait {:.0}%",
                    progress.loss_sum / progress.epoch_step as f64,
                    tally.images as f64 / elapsed,
                    100.0 * data_wait / elapsed
                ));
            }
            self.bar.inc(1);
            // Under join, only where every rank still trains: a checkpoint gathers every
            // rank's random-number state, a collective join does not shadow.
            if self.checkpoints.due(progress) && progress.epoch_step < self.train.split.common_steps
            {
                progress.loss_sum += tally.losses.take()?;
                self.checkpoints.save(trainer, optimizer, progress)?;
            }
        }
        Ok(())
    }
}

/// The running sum of the step losses, kept where the losses are: reading a CUDA loss on the
/// host every step would stall the host until the GPU catches up, so the sum is read only
/// every few steps (for the progress bar and before checkpoints).
#[derive(Default)]
struct LossSum {
    sum: Option<Tensor>,
}

impl LossSum {
    /// Adds the (scalar) loss of one step, without reading it.
    fn add(&mut self, loss: &Tensor) -> Result<(), AnyError> {
        if self.sum.is_none() {
            // A fresh sum every few steps: its own dtype (the loss's) loses nothing.
            self.sum = Some(Tensor::zeros(&[], loss.dtype(), loss.device())?);
        }
        if let Some(sum) = &self.sum {
            sum.add_scaled_(&loss.detach(), 1.0)?;
        }
        Ok(())
    }

    /// The sum since the last call (0 after none), read on the host.
    fn take(&mut self) -> Result<f64, AnyError> {
        Ok(match self.sum.take() {
            Some(sum) => sum.item()?,
            None => 0.0,
        })
    }
}

/// The first `limit` samples of a dataset (all of them without a limit): for short runs.
#[allow(dead_code)] // Not every example offers limits.
pub struct Limited {
    inner: Arc<dyn Dataset>,
    len: usize,
}

#[allow(dead_code)]
impl Limited {
    /// `inner` cut to its first `limit` samples.
    pub fn first(inner: Arc<dyn Dataset>, limit: Option<usize>) -> Arc<dyn Dataset> {
        let len = limit.map_or(inner.len(), |l| l.min(inner.len()));
        Arc::new(Limited { inner, len })
    }
}

impl Dataset for Limited {
    fn len(&self) -> usize {
        self.len
    }

    fn get_batch(&self, indices: &[usize]) -> tandem::nn::Result<Batch> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len) {
            return Err(tandem::nn::Error::data(
                "Limited",
                format!(
                    "sample index {bad} is out of range for the first {} samples",
                    self.len
                ),
            ));
        }
        self.inner.get_batch(indices)
    }
}

/// Writes `settings` (a JSON object describing the run) extended with the results —
/// `test_accuracy` (a fraction), `test_correct` (samples), `train_loss`, `images_per_sec` (mean over epochs),
/// `seconds` and the per-epoch `history` — to `path`.
pub fn write_metrics(
    path: &Path,
    settings: serde_json::Value,
    history: &[EpochResult],
    seconds: f64,
) -> Result<(), AnyError> {
    let serde_json::Value::Object(mut metrics) = settings else {
        return Err("metrics settings must be a JSON object".into());
    };
    let last = history.last();
    let images_per_sec =
        history.iter().map(|r| r.images_per_sec).sum::<f64>() / history.len().max(1) as f64;
    metrics.insert("test_accuracy".into(), json!(last.map(|r| r.test_accuracy)));
    metrics.insert("test_correct".into(), json!(last.map(|r| r.test_correct)));
    metrics.insert("train_loss".into(), json!(last.map(|r| r.train_loss)));
    metrics.insert("images_per_sec".into(), json!(images_per_sec));
    metrics.insert("seconds".into(), json!(seconds));
    let epochs: Vec<serde_json::Value> = history
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({
                "epoch": i + 1,
                "train_loss": r.train_loss,
                "test_accuracy": r.test_accuracy,
                "test_correct": r.test_correct,
                "images_per_sec": r.images_per_sec,
                "seconds": r.seconds,
                "train_samples": r.train_samples,
            })
        })
        .collect();
    metrics.insert("history".into(), json!(epochs));
    let text = serde_json::to_string_pretty(&serde_json::Value::Object(metrics))? + "\n";
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

/// A digest of `model`'s parameters, to show that the replicas of a data-parallel job agree:
/// FNV-1a (64 bits) over each parameter's name and the bytes of its values (as f64, exact for
/// every float dtype), in registration order. Ranks holding bit-identical parameters print the
/// same digest; it is not cryptographic.
#[allow(dead_code)] // Not every example offers a digest.
pub fn parameter_digest(model: &dyn Module) -> Result<String, AnyError> {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    let params = model.named_parameters();
    for (name, p) in &params {
        feed(name.as_bytes());
        for v in p.to_vec_f64()? {
            feed(&v.to_le_bytes());
        }
    }
    Ok(format!("{hash:016x} ({} tensors)", params.len()))
}
