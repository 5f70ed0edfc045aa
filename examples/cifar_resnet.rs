//! Trains a CIFAR ResNet (ResNet-20 by default) on CIFAR-10, or on MNIST shaped as 3×32×32
//! images, printing the test accuracy after each epoch.
//!
//! ```text
//! cargo run --release --example cifar_resnet -- --data-dir cifar-10-batches-bin --epochs 30
//! cargo run --release --example cifar_resnet -- --dataset mnist32 --epochs 1
//! ```
//!
//! CIFAR-10 is not shipped: download the "CIFAR-10 binary version" from
//! <https://www.cs.toronto.edu/~kriz/cifar.html> and pass its unpacked directory (the one with
//! `data_batch_1.bin` … `test_batch.bin`) as `--data-dir`. Training images are augmented with
//! random 4-pixel-padded crops and horizontal flips, seeded per epoch and sample.
//! `--dataset mnist32` instead trains on the MNIST files shipped in `data/mnist`, each digit
//! padded to 32×32 and repeated into 3 channels (no augmentation); that folder is found at run
//! time (`--data-dir`, else `$TANDEM_DATA_DIR/mnist`, else `data/mnist` in the current folder,
//! the executable's folder or a folder above either; see `tandem::locate`).
//!
//! Optimisation: SGD with momentum 0.9 and weight decay 5e-4, cross entropy, batch 128. The
//! learning rate rises linearly from 0 to `--lr` (0.1) over the first `--warmup-frac` of all
//! steps and then falls linearly to 0 at the last step, so even one epoch ends well settled:
//! one epoch of `mnist32` reaches about 99% test accuracy. On a terminal a progress bar shows
//! the running loss and throughput; one line per epoch is printed. `--metrics-out FILE`
//! writes the results as JSON. With `--nproc-per-node N` each rank trains its own shard; when N
//! does not divide the training set, its exact share inside DDP's `join` (`--no-join`: padded
//! shares, as PyTorch's `DistributedSampler`).
//!
//! **Checkpoints.** After each epoch (and, with `--checkpoint-every N`, every N steps) the
//! model, its BatchNorm statistics, the optimizer's momentum buffers, the learning rate, the
//! position in the schedule and every rank's random-number state are saved atomically
//! (safetensors, names as in PyTorch's `state_dict`) to `--checkpoint-dir` (default
//! `checkpoints/`) as `resnet{depth}-epoch{E}.safetensors` (kept) or
//! `resnet{depth}-step{G}.safetensors` (replaced by the next). A run finding checkpoints of
//! the same settings there resumes from the newest complete one, exactly where it stopped;
//! `--resume FILE` names one explicitly. `--train-limit` / `--test-limit` train and test on the
//! first samples only, for quick runs. `--max-restarts N` makes the built-in launcher restart
//! the ranks after a failure (as `tandem-run --max-restarts N` does), resuming that way.
//!
//! **Data-parallel.** `--nproc-per-node N` trains with DistributedDataParallel on N local
//! processes over TCP (or joins a group the environment describes, as `tandem-run`, torchrun,
//! srun or mpirun set it). `--batch-size` is the global batch, split evenly; gradients are
//! averaged, so the single-process learning rate stays right. Every rank evaluates its own
//! part of the test set (a `DistributedEvalSampler`: no sample repeated or left out) and the
//! counts are summed, so the test accuracy is the same for any number of ranks; rank 0 prints
//! and writes checkpoints and metrics. `--eval-only --resume FILE` only evaluates that
//! checkpoint (written with any number of ranks) and prints its test accuracy;
//! `--metrics-out` then records `test_accuracy`, `test_correct` and `test_total`.
//!
//! **GPUs.** `--device cuda` (or `cuda:N`) trains on a GPU: the model's parameters live there,
//! the loader copies each batch there in the background, and checkpoints hold the same
//! tensors as on the CPU, so a run may resume on either. With several ranks each trains on
//! `cuda:LOCAL_RANK`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use tandem::core::rng::manual_seed;
use tandem::core::Device;
use tandem::dist::ProcessGroup;
use tandem::nn::data::{Augmentation, Cifar10, CifarDataset, DataLoader, Dataset, Mnist32, Split};
use tandem::nn::models::resnet_cifar;
use tandem::nn::Module;
use tandem::optim::{Sgd, SgdConfig};

const CIFAR_HELP: &str = "CIFAR-10 is not included: download the \"CIFAR-10 binary version\" \
from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it, and pass the directory holding \
data_batch_1.bin … test_batch.bin with --data-dir; or train on the shipped MNIST with \
--dataset mnist32";

/// Which data to train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DatasetKind {
    /// CIFAR-10 from `--data-dir`.
    Cifar10,
    /// The shipped MNIST, padded to 3×32×32.
    Mnist32,
}

/// Train a CIFAR ResNet.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Directory of the CIFAR-10 binary files (implies --dataset cifar10); with --dataset
    /// mnist32 the MNIST folder [default: $TANDEM_DATA_DIR/mnist, else data/mnist in the
    /// current folder or one above it, else above the executable's folder].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The data set [default: cifar10 with --data-dir].
    #[arg(long, value_enum)]
    dataset: Option<DatasetKind>,
    /// ResNet depth, 6n + 2 (20, 32, 44, 56, 110).
    #[arg(long, default_value_t = 20)]
    depth: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Training batch size.
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// Peak SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Fraction of all steps spent warming the learning rate up from 0.
    #[arg(long, default_value_t = 0.1)]
    warmup_frac: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// L2 weight decay.
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// Directory for the checkpoints, and to resume from (the newest complete one).
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Do not train: evaluate the checkpoint given by --resume on the test set (on every rank
    /// with --nproc-per-node; the figure is the same for any number of ranks) and exit.
    #[arg(long, requires = "resume")]
    eval_only: bool,
    /// Train on the first this many training images only (for quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// Evaluate on the first this many test images only.
    #[arg(long)]
    test_limit: Option<usize>,
    /// How and where the example runs.
    #[command(flatten)]
    run: common::RunArgs,
}

/// The training data: CIFAR-10 needs its epoch set for the augmentation.
enum TrainData {
    Cifar(Arc<CifarDataset>),
    Mnist(Arc<Mnist32>),
}

impl TrainData {
    fn dataset(&self) -> Arc<dyn Dataset> {
        match self {
            TrainData::Cifar(d) => d.clone(),
            TrainData::Mnist(d) => d.clone(),
        }
    }

    fn set_epoch(&self, epoch: u64) {
        if let TrainData::Cifar(d) = self {
            d.set_epoch(epoch);
        }
    }
}

/// Linear warm-up to `peak` over `warmup` steps, then linear decay to 0 at `total`.
fn learning_rate(peak: f64, step: usize, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        peak * (step + 1) as f64 / warmup as f64
    } else {
        peak * (total - step) as f64 / (total - warmup).max(1) as f64
    }
}

mod common;

use common::checkpoints::{Checkpoints, Progress};
use common::output::say;
use common::{
    check_global_batch, evaluate_checkpoint, exit_with_error, join_or_launch, rank_and_world,
    report_end, report_epoch, test_loader, train_epoch, train_loader, trainer, write_metrics,
    AnyError, Limited, Role, TrainLoader,
};

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit_with_error(e),
    }
}

fn run(args: Args) -> Result<(), AnyError> {
    let kind = check_args(&args)?;
    let (group, device) = match join_or_launch(&args.run)? {
        Role::Launched => return Ok(()),
        Role::Train { group, device } => (group, device),
    };
    let group = group.as_ref();
    let (rank, world) = rank_and_world(group);
    if !args.eval_only {
        check_global_batch(args.batch_size, world)?;
    }
    let (train_data, train, test) = loaders(&args, kind, group, device)?;
    if let (true, Some(path)) = (args.eval_only, &args.run.resume) {
        let model = resnet_cifar(args.depth, 10)?;
        model.to_device(device)?;
        let settings = metrics_settings(&args, kind, world, device);
        let out = args.run.metrics_out.as_deref();
        evaluate_checkpoint(path, &model, group, &test, out, settings)?;
        return Ok(());
    }

    manual_seed(args.run.seed);
    let model: Arc<dyn Module> = Arc::new(resnet_cifar(args.depth, 10)?);
    model.to_device(device)?;
    let mut optimizer = Sgd::new(
        model.parameters(),
        SgdConfig::new(args.lr)
            .with_momentum(args.momentum)
            .with_weight_decay(args.weight_decay),
    )?;
    let total_steps = args.epochs * train.len();
    let warmup_steps = (args.warmup_frac * total_steps as f64).round() as usize;
    let checkpoints = Checkpoints::new(
        Some(args.checkpoint_dir.clone()),
        args.run.checkpoint_every,
        &format!("resnet{}", args.depth),
        settings(&args, kind, world),
        train.len(),
    )?;
    // Resume before DDP wraps the model (every rank reads the same checkpoint).
    let mut progress = Progress::start();
    let mut scaler_state = Vec::new();
    if let Some(resumed) = checkpoints.resume(
        args.run.resume.as_deref(),
        model.as_ref(),
        &mut optimizer,
        rank,
    )? {
        progress = resumed.progress;
        scaler_state = resumed.grad_scaler;
        if rank == 0 {
            say(format_args!(
                "resuming from {}: epoch {}, {} of {} steps done",
                resumed.path.display(),
                progress.epoch.min(args.epochs),
                if progress.epoch > args.epochs {
                    train.len()
                } else {
                    progress.epoch_step
                },
                train.len()
            ));
        }
    }
    let trainer = trainer(model.clone(), group, &args.run)?;
    trainer.load_scaler(&scaler_state)?;
    if rank == 0 {
        announce(&args, kind, model.as_ref(), device, warmup_steps);
    }

    let started = Instant::now();
    let lr_at = |global_step: usize| learning_rate(args.lr, global_step, warmup_steps, total_steps);
    while progress.epoch <= args.epochs {
        let epoch = progress.epoch;
        train_data.set_epoch(epoch as u64 - 1);
        let mut result = train_epoch(
            &trainer,
            &mut optimizer,
            &train,
            &mut progress,
            args.epochs,
            Some(&lr_at),
            &checkpoints,
        )?;
        report_epoch(&trainer, &test, &mut result, epoch, args.epochs)?;
        progress.finish_epoch(result);
        checkpoints.save(&trainer, &optimizer, &progress)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    report_end(&trainer, args.run.trace_out.as_deref(), seconds)?;
    match &args.run.metrics_out {
        Some(path) if rank == 0 => write_metrics(
            path,
            metrics_settings(&args, kind, world, device),
            &progress.history,
            seconds,
        ),
        _ => Ok(()),
    }
}

/// Checks the arguments that need no data or group, and gives the data set to train on.
fn check_args(args: &Args) -> Result<DatasetKind, AnyError> {
    let kind = match (args.dataset, &args.data_dir) {
        (Some(kind), _) => kind,
        (None, Some(_)) => DatasetKind::Cifar10,
        (None, None) => return Err(CIFAR_HELP.into()),
    };
    if args.batch_size == 0 || args.epochs == 0 {
        return Err("--batch-size and --epochs must be > 0".into());
    }
    if !(0.0..1.0).contains(&args.warmup_frac) {
        return Err(format!("--warmup-frac must be in [0, 1), got {}", args.warmup_frac).into());
    }
    Ok(kind)
}

/// The training data (for its per-epoch augmentation), the training loader (a shard per rank)
/// and the test loader (a part per rank), on `device`.
fn loaders(
    args: &Args,
    kind: DatasetKind,
    group: Option<&Arc<dyn ProcessGroup>>,
    device: Device,
) -> Result<(TrainData, TrainLoader, DataLoader), AnyError> {
    let (train_data, test_set): (TrainData, Arc<dyn Dataset>) = match kind {
        DatasetKind::Cifar10 => {
            let dir = args.data_dir.clone().ok_or(CIFAR_HELP)?;
            let train = Cifar10::load(&dir, Split::Train)?
                .with_augmentation(Augmentation::cifar(), args.run.seed);
            let test = Cifar10::load(&dir, Split::Test)?;
            (TrainData::Cifar(Arc::new(train)), Arc::new(test))
        }
        DatasetKind::Mnist32 => {
            let dir = tandem::locate::mnist_dir(args.data_dir.as_deref())?;
            let train = Mnist32::load(&dir, Split::Train)?;
            let test = Mnist32::load(&dir, Split::Test)?;
            (TrainData::Mnist(Arc::new(train)), Arc::new(test))
        }
    };
    let train_set = Limited::first(train_data.dataset(), args.train_limit);
    let test_set = Limited::first(test_set, args.test_limit);
    let train = train_loader(train_set, group, args.batch_size, &args.run, device)?;
    Ok((
        train_data,
        train,
        test_loader(test_set, group, 500, device)?,
    ))
}

/// The settings a resumed run must share with the checkpoint's run.
fn settings(args: &Args, kind: DatasetKind, world: usize) -> BTreeMap<String, String> {
    BTreeMap::from(
        [
            ("dataset", format!("{kind:?}").to_lowercase()),
            ("epochs", args.epochs.to_string()),
            ("batch_size", args.batch_size.to_string()),
            ("lr", args.lr.to_string()),
            ("warmup_frac", args.warmup_frac.to_string()),
            ("momentum", args.momentum.to_string()),
            ("weight_decay", args.weight_decay.to_string()),
            ("seed", args.run.seed.to_string()),
            ("world_size", world.to_string()),
            ("no_join", args.run.no_join.to_string()),
            ("train_limit", format!("{:?}", args.train_limit)),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    )
}

/// Rank 0's first line: the model and the run's settings.
fn announce(args: &Args, kind: DatasetKind, model: &dyn Module, device: Device, warmup: usize) {
    say(format_args!(
        "ResNet-{} ({} parameters) on {:?}: {} epochs, batch {}, lr {} (linear warm-up over {} \
         steps, then linear decay to 0), momentum {}, weight decay {}, on {}, {} threads",
        args.depth,
        model.num_parameters(),
        kind,
        args.epochs,
        args.batch_size,
        args.lr,
        warmup,
        args.momentum,
        args.weight_decay,
        device,
        rayon::current_num_threads()
    ));
}

/// The run's description in `--metrics-out`.
fn metrics_settings(
    args: &Args,
    kind: DatasetKind,
    world: usize,
    device: Device,
) -> serde_json::Value {
    serde_json::json!({
        "model": format!("resnet{}", args.depth),
        "dataset": format!("{kind:?}").to_lowercase(),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_frac": args.warmup_frac,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "seed": args.run.seed,
        "threads": rayon::current_num_threads(),
        "world_size": world,
        "device": device.to_string(),
    })
}
