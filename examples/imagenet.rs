//! Trains a ResNet (ResNet-50 by default) on an ImageFolder tree of JPEG/PNG images laid out as
//! ImageNet is — `DIR/train/<class>/*.jpg` and `DIR/val/<class>/*.jpg` — with torchvision's
//! ImageNet recipe, printing the validation accuracy after each epoch.
//!
//! ```text
//! cargo run --release --example imagenet -- --data-dir /data/imagenet --nproc-per-node 8 --device cuda
//! cargo run --release --example mnist_to_folder -- --out mnist-jpeg
//! cargo run --release --example imagenet -- --data-dir mnist-jpeg --model resnet20 --image-size 32 \
//!     --epochs 1 --batch-size 128 --crop-scale 0.35 --no-flip --warmup-epochs 0.1
//! ```
//!
//! **Data.** Class names are the sorted sub-folders of `DIR/train` (torchvision's indices);
//! `DIR/val` must hold the same classes. Training images go through `RandomResizedCrop(N)`
//! (scale `(--crop-scale, 1)`, ratio `(3/4, 4/3)`) and a horizontal flip (`--no-flip` turns it
//! off, for data such as digits whose mirror image is another class); evaluation through
//! `Resize(round(N·256/224))` and `CenterCrop(N)`. `N` is `--image-size` (224). Both are drawn
//! per sample from `--seed`, the epoch and the sample's index, so a resumed or data-parallel
//! run sees the same crops. `--workers` threads decode and augment (default: the cores per
//! local rank); batches travel as bytes (u8 `[B, 3, N, N]`, 4× fewer than f32) and are
//! normalised with ImageNet's mean and std where the model is (on the GPU with `--device
//! cuda`). `--skip-bad-files` counts and skips files that do not decode instead of stopping.
//!
//! **Optimisation** (Goyal et al., "Accurate, Large Minibatch SGD", 2017): SGD with momentum
//! 0.9 and weight decay 1e-4, cross entropy. `--lr` is the peak learning rate; by
//! default the linear scaling rule sets it to `0.1 × global batch / 256` (0.1 for the reference
//! batch of 256, 3.2 for 8192). It rises linearly from `lr / W` to `lr` over the first W steps,
//! `--warmup-epochs` (5; fractions allowed) long, and then follows a cosine from `lr` to 0 at the
//! last step. `--batch-size` is the global batch (as in the other examples), split evenly over
//! the ranks.
//!
//! **Models.** `--model resnet18|resnet34|resnet50|resnet101|resnet152` (torchvision's
//! ImageNet ResNets, any image size ≥ 32) or `resnet20|resnet32|resnet44|resnet56|resnet110`
//! (the CIFAR ResNets, for small images such as MNIST's at `--image-size 32`); the last layer
//! has one output per class.
//!
//! **Output.** On a terminal a progress bar shows the running loss, images/s and the share of
//! time spent waiting for data; one line per epoch is printed. `--metrics-out FILE` writes
//! JSON with `test_accuracy` (a fraction), `test_correct`, `test_samples`, `images_per_sec`
//! and the per-epoch history; `--trace-out FILE` a Chrome trace of the steps.
//!
//! **Checkpoints, data-parallel, GPUs** as in `cifar_resnet`: a checkpoint after every epoch
//! (and every `--checkpoint-every` steps) in `--checkpoint-dir`, resumed from automatically or
//! with `--resume FILE`; `--nproc-per-node N` starts N ranks training with DDP (each its own
//! `DistributedSampler` shard, or its exact `DistributedUnpaddedSampler` share inside `join`
//! when N does not divide the training set, unless `--no-join`; every rank evaluates its own part of the validation set,
//! `DistributedEvalSampler`, and the counts are summed, so the accuracy is the same for any number
//! of ranks); `--device cuda`
//! trains on `cuda:LOCAL_RANK`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tandem::core::rng::manual_seed;
use tandem::core::{Device, Tensor};
use tandem::dist::ProcessGroup;
use tandem::nn::data::image::folder::{ImageFolder, ImageFolderConfig};
use tandem::nn::data::image::transforms::{ImageTransform, RandomResizedCrop};
use tandem::nn::data::{Batch, DataLoader, Dataset, Normalize};
use tandem::nn::models::{resnet_cifar, resnet_imagenet, Block};
use tandem::nn::{Forward, Module};
use tandem::optim::{Sgd, SgdConfig};

mod common;

use common::checkpoints::{Checkpoints, Progress};
use common::output::say;
use common::{
    check_global_batch, exit_with_error, join_or_launch, rank_and_world, report_end, report_epoch,
    test_loader, train_epoch, train_loader, trainer, write_metrics, AnyError, Role, TrainLoader,
};

/// The reference batch of the linear scaling rule: `lr = 0.1 × batch / 256`.
const REFERENCE_BATCH: f64 = 256.0;
/// The learning rate for the reference batch.
const REFERENCE_LR: f64 = 0.1;

/// Train a ResNet on an ImageFolder tree (DIR/train, DIR/val) with the ImageNet recipe.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// The folder holding train/ and val/, each with one sub-folder of images per class.
    #[arg(long)]
    data_dir: PathBuf,
    /// The network: resnet18, resnet34, resnet50, resnet101, resnet152 (ImageNet ResNets) or
    /// resnet20, resnet32, resnet44, resnet56, resnet110 (CIFAR ResNets, for small images).
    #[arg(long, default_value = "resnet50")]
    model: String,
    /// Side of the square crops the network sees.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 90)]
    epochs: usize,
    /// The global batch size, split evenly over the ranks.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Peak learning rate [default: 0.1 × batch-size / 256, the linear scaling rule].
    #[arg(long)]
    lr: Option<f64>,
    /// Epochs of linear learning-rate warm-up (fractions allowed), then a cosine to 0.
    #[arg(long, default_value_t = 5.0)]
    warmup_epochs: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    momentum: f64,
    /// L2 weight decay.
    #[arg(long, default_value_t = 1e-4)]
    weight_decay: f64,
    /// Lower end of RandomResizedCrop's scale range (the crop's share of the image's area).
    #[arg(long, default_value_t = 0.08)]
    crop_scale: f64,
    /// Do not flip training images horizontally.
    #[arg(long)]
    no_flip: bool,
    /// Threads decoding and augmenting images [default: the cores per local rank].
    #[arg(long)]
    workers: Option<usize>,
    /// Skip (and count) image files that cannot be decoded instead of stopping.
    #[arg(long)]
    skip_bad_files: bool,
    /// Directory for the checkpoints, and to resume from (the newest complete one).
    #[arg(long, default_value = "checkpoints")]
    checkpoint_dir: PathBuf,
    /// Train on this many training images only, spread evenly over the folder (which is in
    /// class order), so every class keeps its share (for quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// Evaluate on this many validation images only, spread evenly over the folder.
    #[arg(long)]
    test_limit: Option<usize>,
    /// How and where the example runs.
    #[command(flatten)]
    run: common::RunArgs,
}

impl Args {
    /// The peak learning rate: `--lr`, else the linear scaling rule's.
    fn peak_lr(&self) -> f64 {
        self.lr
            .unwrap_or(REFERENCE_LR * self.batch_size as f64 / REFERENCE_BATCH)
    }
}

/// A network that takes the loader's byte batches: normalises them with ImageNet's mean and
/// std on the device they are on, then runs the network. It delegates its tensors, children
/// and flag to the network, so checkpoints and DDP see the network's own names.
#[derive(tandem::nn::Module)]
struct Normalized {
    #[module(delegate)]
    net: Arc<dyn Module>,
    #[module(skip)]
    normalize: Normalize,
}

impl Forward for Normalized {
    fn forward(&self, x: &Tensor) -> tandem::nn::Result<Tensor> {
        self.net.forward(&self.normalize.normalize_batch(x)?)
    }
}

/// The network `name` with `classes` outputs.
fn build_model(name: &str, classes: usize) -> Result<Arc<dyn Module>, AnyError> {
    let imagenet = |block, blocks| -> Result<Arc<dyn Module>, AnyError> {
        Ok(Arc::new(resnet_imagenet(block, blocks, classes)?))
    };
    match name {
        "resnet18" => imagenet(Block::Basic, [2, 2, 2, 2]),
        "resnet34" => imagenet(Block::Basic, [3, 4, 6, 3]),
        "resnet50" => imagenet(Block::Bottleneck, [3, 4, 6, 3]),
        "resnet101" => imagenet(Block::Bottleneck, [3, 4, 23, 3]),
        "resnet152" => imagenet(Block::Bottleneck, [3, 8, 36, 3]),
        _ => match name.strip_prefix("resnet").map(str::parse::<usize>) {
            Some(Ok(depth)) if depth < 200 && depth % 6 == 2 => {
                Ok(Arc::new(resnet_cifar(depth, classes)?))
            }
            _ => Err(format!(
                "--model {name}: expected resnet18, resnet34, resnet50, resnet101, resnet152 or \
                 a CIFAR ResNet resnet{{6n+2}} (resnet20, resnet32, resnet44, resnet56, \
                 resnet110)"
            )
            .into()),
        },
    }
}

/// Linear warm-up to `peak` over `warmup` steps, then a cosine from `peak` to 0 at `total`.
fn learning_rate(peak: f64, step: usize, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        peak * (step + 1) as f64 / warmup as f64
    } else {
        let done = (step - warmup) as f64 / (total - warmup).max(1) as f64;
        0.5 * peak * (1.0 + (std::f64::consts::PI * done.min(1.0)).cos())
    }
}

pub fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit_with_error(e),
    }
}

fn run(args: Args) -> Result<(), AnyError> {
    check_args(&args)?;
    let (group, device) = match join_or_launch(&args.run)? {
        Role::Launched => return Ok(()),
        Role::Train { group, device } => (group, device),
    };
    let group = group.as_ref();
    let (rank, world) = rank_and_world(group);
    check_global_batch(args.batch_size, world)?;
    let data = Data::load(&args, group, device)?;

    manual_seed(args.run.seed);
    let net = build_model(&args.model, data.classes)?;
    let model: Arc<dyn Module> = Arc::new(Normalized {
        net,
        normalize: Normalize::imagenet(),
    });
    model.to_device(device)?;
    let mut optimizer = Sgd::new(
        model.parameters(),
        SgdConfig::new(args.peak_lr())
            .with_momentum(args.momentum)
            .with_weight_decay(args.weight_decay),
    )?;
    let total_steps = args.epochs * data.train.len();
    let warmup_steps =
        ((args.warmup_epochs * data.train.len() as f64).round() as usize).min(total_steps);
    let checkpoints = Checkpoints::new(
        Some(args.checkpoint_dir.clone()),
        args.run.checkpoint_every,
        &args.model,
        settings(&args, world),
        data.train.len(),
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
                "resuming from {}: epoch {}, step {} of {}",
                resumed.path.display(),
                progress.epoch.min(args.epochs),
                if progress.epoch > args.epochs {
                    data.train.len()
                } else {
                    progress.epoch_step
                },
                data.train.len()
            ));
        }
    }
    let trainer = trainer(model.clone(), group, &args.run)?;
    trainer.load_scaler(&scaler_state)?;
    if rank == 0 {
        announce(&args, &data, model.as_ref(), device, world, warmup_steps);
    }

    let started = Instant::now();
    let peak = args.peak_lr();
    let lr_at = |step: usize| learning_rate(peak, step, warmup_steps, total_steps);
    while progress.epoch <= args.epochs {
        let epoch = progress.epoch;
        data.train_set.set_epoch(epoch as u64 - 1);
        let mut result = train_epoch(
            &trainer,
            &mut optimizer,
            &data.train,
            &mut progress,
            args.epochs,
            Some(&lr_at),
            &checkpoints,
        )?;
        report_epoch(&trainer, &data.test, &mut result, epoch, args.epochs)?;
        progress.finish_epoch(result);
        checkpoints.save(&trainer, &optimizer, &progress)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    report_end(&trainer, args.run.trace_out.as_deref(), seconds)?;
    if rank == 0 {
        report_skipped(&data);
    }
    match &args.run.metrics_out {
        Some(path) if rank == 0 => {
            let settings = metrics_settings(&args, &data, world, device);
            write_metrics(path, settings, &progress.history, seconds)
        }
        _ => Ok(()),
    }
}

/// Checks the arguments that need no data or group.
fn check_args(args: &Args) -> Result<(), AnyError> {
    if args.batch_size == 0 || args.epochs == 0 || args.image_size == 0 {
        return Err("--batch-size, --epochs and --image-size must be > 0".into());
    }
    if !(args.warmup_epochs >= 0.0 && args.warmup_epochs.is_finite()) {
        return Err(format!("--warmup-epochs must be ≥ 0, got {}", args.warmup_epochs).into());
    }
    if !(args.crop_scale > 0.0 && args.crop_scale <= 1.0) {
        return Err(format!("--crop-scale must be in (0, 1], got {}", args.crop_scale).into());
    }
    if args.workers == Some(0) {
        return Err("--workers must be > 0".into());
    }
    let lr = args.peak_lr();
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(format!("--lr must be > 0, got {lr}").into());
    }
    Ok(())
}

/// The folders and their loaders.
struct Data {
    /// The training folder (its epoch seeds the augmentation).
    train_set: Arc<ImageFolder>,
    /// The validation folder.
    test_set: Arc<ImageFolder>,
    /// This rank's training batches.
    train: TrainLoader,
    /// The validation batches (whole set, in order).
    test: DataLoader,
    /// Number of classes.
    classes: usize,
    /// Validation images evaluated (after `--test-limit`).
    test_samples: usize,
}

impl Data {
    /// Reads both folders (checking they hold the same classes) and makes the loaders.
    fn load(
        args: &Args,
        group: Option<&Arc<dyn ProcessGroup>>,
        device: Device,
    ) -> Result<Data, AnyError> {
        let (_, world) = rank_and_world(group);
        let workers = args.workers.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / world).max(1)
        });
        let size = args.image_size;
        let crop = RandomResizedCrop::new((size, size))?.with_scale((args.crop_scale, 1.0))?;
        let train_transform = ImageTransform::Train {
            crop,
            flip: !args.no_flip,
        };
        let config = |transform| {
            ImageFolderConfig::new(transform)
                .with_seed(args.run.seed)
                .with_workers(workers)
                .with_skip_bad_files(args.skip_bad_files)
        };
        let train_dir = args.data_dir.join("train");
        let val_dir = args.data_dir.join("val");
        let train_set = Arc::new(ImageFolder::new(&train_dir, config(train_transform))?);
        let test_set = Arc::new(ImageFolder::new(
            &val_dir,
            config(ImageTransform::imagenet_eval(size)?),
        )?);
        check_classes(&train_set, &test_set, &train_dir, &val_dir)?;
        let classes = train_set.classes().len();
        let train_subset = Spread::apply(train_set.clone(), args.train_limit);
        let test_subset = Spread::apply(test_set.clone(), args.test_limit);
        let test_samples = test_subset.len();
        let train = train_loader(train_subset, group, args.batch_size, &args.run, device)?;
        let eval_batch = args.batch_size.clamp(1, 256);
        let test = test_loader(test_subset, group, eval_batch, device)?;
        Ok(Data {
            train_set,
            test_set,
            train,
            test,
            classes,
            test_samples,
        })
    }
}

/// `limit` samples of a dataset spread evenly over it (sample `k` is the inner sample
/// `k · len / limit`), all of them without a limit. An ImageFolder lists its samples class by
/// class, so the first `limit` samples would hold the first classes only.
struct Spread {
    inner: Arc<dyn Dataset>,
    len: usize,
}

impl Spread {
    fn apply(inner: Arc<dyn Dataset>, limit: Option<usize>) -> Arc<dyn Dataset> {
        match limit {
            Some(limit) if limit < inner.len() => Arc::new(Spread { inner, len: limit }),
            _ => inner,
        }
    }
}

impl Dataset for Spread {
    fn len(&self) -> usize {
        self.len
    }

    fn get_batch(&self, indices: &[usize]) -> tandem::nn::Result<Batch> {
        let inner_len = self.inner.len();
        let mut mapped = Vec::with_capacity(indices.len());
        for &k in indices {
            if k >= self.len {
                return Err(tandem::nn::Error::data(
                    "Spread",
                    format!("sample index {k} is out of range for {} samples", self.len),
                ));
            }
            mapped.push(k * inner_len / self.len);
        }
        self.inner.get_batch(&mapped)
    }
}

/// Errors unless the validation folder holds the training folder's classes, in its order
/// (class indices are positions in the sorted list, so they must agree).
fn check_classes(
    train: &ImageFolder,
    val: &ImageFolder,
    train_dir: &Path,
    val_dir: &Path,
) -> Result<(), AnyError> {
    if train.classes() == val.classes() {
        return Ok(());
    }
    Err(format!(
        "{} has classes {:?} but {} has {:?}: both need the same class folders",
        train_dir.display(),
        train.classes(),
        val_dir.display(),
        val.classes()
    )
    .into())
}

/// Rank 0's first line: the model, the data and the run's settings.
fn announce(
    args: &Args,
    data: &Data,
    model: &dyn Module,
    device: Device,
    world: usize,
    warmup: usize,
) {
    say(format_args!(
        "{} ({} parameters) on {} ({} classes, {} training and {} validation images, {}×{} \
         crops): {} epochs, batch {} on {world} rank{}, lr {} (linear warm-up over {warmup} \
         steps, then cosine to 0), momentum {}, weight decay {}, on {device}, {} threads",
        args.model,
        model.num_parameters(),
        args.data_dir.display(),
        data.classes,
        data.train_set.len(),
        data.test_set.len(),
        args.image_size,
        args.image_size,
        args.epochs,
        args.batch_size,
        if world == 1 { "" } else { "s" },
        args.peak_lr(),
        args.momentum,
        args.weight_decay,
        rayon::current_num_threads()
    ));
}

/// Says how many files were skipped as undecodable (with `--skip-bad-files`).
fn report_skipped(data: &Data) {
    let skipped = data.train_set.skipped() + data.test_set.skipped();
    if skipped > 0 {
        say(format_args!(
            "skipped {skipped} image files that could not be decoded"
        ));
    }
}

/// The settings a resumed run must share with the checkpoint's run.
fn settings(args: &Args, world: usize) -> BTreeMap<String, String> {
    BTreeMap::from(
        [
            ("model", args.model.clone()),
            ("image_size", args.image_size.to_string()),
            ("epochs", args.epochs.to_string()),
            ("batch_size", args.batch_size.to_string()),
            ("lr", args.peak_lr().to_string()),
            ("warmup_epochs", args.warmup_epochs.to_string()),
            ("momentum", args.momentum.to_string()),
            ("weight_decay", args.weight_decay.to_string()),
            ("crop_scale", args.crop_scale.to_string()),
            ("flip", (!args.no_flip).to_string()),
            ("seed", args.run.seed.to_string()),
            ("world_size", world.to_string()),
            ("no_join", args.run.no_join.to_string()),
            ("train_limit", format!("{:?}", args.train_limit)),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    )
}

/// The run's description in `--metrics-out` (`write_metrics` adds the last evaluation's
/// `test_accuracy` and `test_correct`, counted over every rank's part of the test set).
fn metrics_settings(args: &Args, data: &Data, world: usize, device: Device) -> serde_json::Value {
    serde_json::json!({
        "model": args.model,
        "data_dir": args.data_dir.display().to_string(),
        "classes": data.classes,
        "image_size": args.image_size,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.peak_lr(),
        "warmup_epochs": args.warmup_epochs,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "crop_scale": args.crop_scale,
        "flip": !args.no_flip,
        "seed": args.run.seed,
        "threads": rayon::current_num_threads(),
        "world_size": world,
        "device": device.to_string(),
        "test_samples": data.test_samples,
        "skipped_files": data.train_set.skipped() + data.test_set.skipped(),
    })
}
