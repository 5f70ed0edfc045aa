//! Training-step benchmark: forward + cross entropy + backward + SGD step, tandem vs PyTorch.
//!
//! ```text
//! cargo bench --bench train_step -- --model lenet --batch-size 64 --threads 2 [--json FILE]
//! cargo bench --bench train_step -- --model resnet20 --batch-size 32 --threads 2
//! cargo bench --bench train_step -- --device cuda --model resnet20 --batch-size 128
//! cargo bench --bench train_step -- --device cuda --model resnet50 --batch-size 64
//! ```
//!
//! Times `--steps` steps (default 30) after `--warmup` untimed ones (default 5) on one fixed
//! random batch, and reports the median step time, images/s and peak RSS. When
//! `--peer-python` (default `python3`) can import torch, the same model and step are timed by
//! `benches/peers/train_step_torch.py` with the same batch size and thread count, and the
//! ratio tandem/PyTorch of median step times is printed. The script is found at run time
//! (`$TANDEM_PEERS_DIR`, else `benches/peers/` above the current folder or the executable's);
//! a peer that did not run is a "pytorch: not run: why" line, and with `--require-peer` (or
//! `TANDEM_REQUIRE_PEER=1`) also a failure. Unknown flags that `cargo bench` adds (`--bench`)
//! are ignored.
//!
//! **On a GPU** (`--device cuda` or `cuda:N`) the model, batch and optimizer state live on the
//! device; each timed step ends with a device synchronisation, and the host time — how long the
//! host took to issue the step's work, before waiting for the device — is reported beside it:
//! when it approaches the step time, the step is bound by the host, not the GPU. Peak device
//! memory is the most bytes held by tensors at once over the whole run (parameters, optimizer
//! state, activations, workspaces), on both sides (`torch.cuda.max_memory_allocated()`). TF32
//! is as both frameworks default: off for matmuls (`--tf32-matmul` turns it on, on both sides),
//! on for convolutions. `--profile N` then shows the host time per op. Models: LeNet-5
//! (1×28×28), ResNet-20/56 (3×32×32) and ResNet-50 (3×224×224, 1000 classes; torchvision's
//! layout on both sides). `--amp bf16|f16` runs forward and loss under autocast on both sides
//! (f16 with a gradient scaler), `--channels-last` gives both channels-last input batches and
//! converts both models to channels-last.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::{Parser, ValueEnum};
use tandem::autograd::TensorBackward;
use tandem::core::rng::manual_seed;
use tandem::core::{DType, Device, Generator, MemoryFormat, Tensor};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::Module;
use tandem::optim::{GradScaler, GradScalerConfig, Optimizer, Sgd, SgdConfig};

type AnyError = Box<dyn std::error::Error>;

#[path = "common/amp.rs"]
mod amp;
#[path = "common/peer.rs"]
mod peer;

use amp::Amp;

/// The models the benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// LeNet-5 on 1×28×28 inputs, 10 classes.
    Lenet,
    /// ResNet-20 (CIFAR) on 3×32×32 inputs, 10 classes.
    Resnet20,
    /// ResNet-56 (CIFAR) on 3×32×32 inputs, 10 classes.
    Resnet56,
    /// ResNet-50 (ImageNet, torchvision's layout) on 3×224×224 inputs, 1000 classes.
    Resnet50,
}

impl ModelKind {
    fn name(self) -> &'static str {
        match self {
            ModelKind::Lenet => "lenet",
            ModelKind::Resnet20 => "resnet20",
            ModelKind::Resnet56 => "resnet56",
            ModelKind::Resnet50 => "resnet50",
        }
    }

    /// The model with the shape of its inputs and its number of classes.
    fn build(self) -> Result<Workload, AnyError> {
        match self {
            ModelKind::Lenet => Ok(Workload {
                model: Box::new(tandem::nn::models::lenet5()?),
                sample_shape: vec![1, 28, 28],
                classes: 10,
            }),
            ModelKind::Resnet20 => Ok(Workload {
                model: Box::new(tandem::nn::models::resnet20()?),
                sample_shape: vec![3, 32, 32],
                classes: 10,
            }),
            ModelKind::Resnet56 => Ok(Workload {
                model: Box::new(tandem::nn::models::resnet_cifar(56, 10)?),
                sample_shape: vec![3, 32, 32],
                classes: 10,
            }),
            ModelKind::Resnet50 => Ok(Workload {
                model: Box::new(tandem::nn::models::resnet50()?),
                sample_shape: vec![3, 224, 224],
                classes: 1000,
            }),
        }
    }
}

/// A model to time and the data it takes.
struct Workload {
    model: Box<dyn Module>,
    /// Shape of one input sample (without the batch dim).
    sample_shape: Vec<usize>,
    /// Number of classes of the targets.
    classes: usize,
}

/// Time one training step of a model in tandem and (when available) PyTorch.
#[derive(Parser, Debug)]
struct Args {
    /// The model.
    #[arg(long, value_enum, default_value_t = ModelKind::Lenet)]
    model: ModelKind,
    /// Samples per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Where to train: cpu, cuda or cuda:N (both sides).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Allow TF32 in matmuls on both sides (convolutions use TF32 either way, as both
    /// frameworks default).
    #[arg(long)]
    tf32_matmul: bool,
    /// Compute threads on both sides [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Untimed steps before timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Seed of the model and of the random batch.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Python interpreter for the PyTorch side.
    #[arg(long, default_value = "python3")]
    peer_python: String,
    /// Skip the PyTorch side.
    #[arg(long)]
    no_peer: bool,
    /// Fail (exit non-zero, after printing tandem's results) when the PyTorch side did not
    /// run, unless --no-peer skipped it; also with TANDEM_REQUIRE_PEER=1.
    #[arg(long)]
    require_peer: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// After timing, run this many more steps under tandem's per-op profiler and print where
    /// the time goes (per op, forward and backward).
    #[arg(long, default_value_t = 0)]
    profile: usize,
    /// Turn tandem's caching allocator off (to measure what it gains).
    #[arg(long)]
    no_cache: bool,
    /// Mixed precision on both sides: forward and loss under autocast in this dtype (f16 with
    /// a gradient scaler, PyTorch's defaults); parameters, gradients and the update stay f32.
    #[arg(long, value_enum)]
    amp: Option<Amp>,
    /// Channels-last on both sides: NHWC input batches and the model converted in place
    /// (tandem's `Module::to_memory_format`, PyTorch's `model.to(memory_format=...)`).
    #[arg(long)]
    channels_last: bool,
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

/// Step-time statistics of one side.
struct Timing {
    median_ms: f64,
    mean_ms: f64,
    min_ms: f64,
    /// On a GPU: median time to issue a step, before waiting for the device.
    host_ms: Option<f64>,
    peak_rss_mib: Option<f64>,
    /// On a GPU: the most device memory held by tensors at once.
    peak_device_mib: Option<f64>,
}

fn main() -> ExitCode {
    // `cargo bench` appends `--bench` to the arguments of harness = false benchmarks.
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), AnyError> {
    if args.steps == 0 || args.batch_size == 0 {
        return Err("--steps and --batch-size must be > 0".into());
    }
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    tandem::ops::set_num_threads(threads)?;

    let tandem = time_tandem(&args)?;
    let torch = if args.no_peer {
        Err("skipped (--no-peer)".to_string())
    } else {
        time_torch(&args, threads)
    };

    println!(
        "train_step: model {}, batch {}, on {}, {} threads, {}{}, median of {} steps after {} warm-up",
        args.model.name(),
        args.batch_size,
        args.device,
        threads,
        args.amp.map_or("f32", Amp::name),
        if args.channels_last { ", channels-last" } else { "" },
        args.steps,
        args.warmup
    );
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>14}",
        "side",
        "median ms",
        "mean ms",
        "min ms",
        "host ms",
        "images/s",
        "peak RSS MiB",
        "peak dev MiB"
    );
    let or_dash = |v: Option<f64>, digits: usize| {
        v.map(|m| format!("{m:.digits$}"))
            .unwrap_or_else(|| "-".into())
    };
    let row = |side: &str, t: &Timing| {
        println!(
            "{:<8} {:>10.2} {:>10.2} {:>10.2} {:>10} {:>10.0} {:>14} {:>14}",
            side,
            t.median_ms,
            t.mean_ms,
            t.min_ms,
            or_dash(t.host_ms, 2),
            args.batch_size as f64 / (t.median_ms / 1e3),
            or_dash(t.peak_rss_mib, 1),
            or_dash(t.peak_device_mib, 1),
        )
    };
    row("tandem", &tandem);
    let ratio = match &torch {
        Ok((t, version)) => {
            row("pytorch", t);
            let ratio = tandem.median_ms / t.median_ms;
            println!("ratio tandem/pytorch (median step time): {ratio:.2} (torch {version})");
            if let (Some(ours), Some(theirs)) = (tandem.peak_device_mib, t.peak_device_mib) {
                println!(
                    "ratio tandem/pytorch (peak device memory): {:.2}",
                    ours / theirs
                );
            }
            Some(ratio)
        }
        Err(why) => {
            println!("pytorch: not run: {why}");
            None
        }
    };

    if let Some(path) = &args.json {
        let torch_ok = torch.as_ref().ok();
        let json = serde_json::json!({
            "model": args.model.name(),
            "batch_size": args.batch_size,
            "device": args.device.to_string(),
            "tf32_matmul": args.tf32_matmul,
            "amp": args.amp.map(Amp::name),
            "channels_last": args.channels_last,
            "threads": threads,
            "warmup": args.warmup,
            "steps": args.steps,
            "tandem_ms": tandem.median_ms,
            "tandem_mean_ms": tandem.mean_ms,
            "torch_ms": torch_ok.map(|(t, _)| t.median_ms),
            "torch_mean_ms": torch_ok.map(|(t, _)| t.mean_ms),
            "ratio": ratio,
            "images_per_sec": args.batch_size as f64 / (tandem.median_ms / 1e3),
            "torch_images_per_sec": torch_ok.map(|(t, _)| args.batch_size as f64 / (t.median_ms / 1e3)),
            "tandem_peak_rss_mib": tandem.peak_rss_mib,
            "torch_peak_rss_mib": torch_ok.and_then(|(t, _)| t.peak_rss_mib),
            "tandem_host_ms": tandem.host_ms,
            "torch_host_ms": torch_ok.and_then(|(t, _)| t.host_ms),
            "tandem_peak_device_mib": tandem.peak_device_mib,
            "torch_peak_device_mib": torch_ok.and_then(|(t, _)| t.peak_device_mib),
            "torch_version": torch_ok.map(|(_, v)| v.clone()),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    match torch {
        Err(why) if !args.no_peer && peer::required(args.require_peer) => {
            Err(peer::missing_error(&why).into())
        }
        _ => Ok(()),
    }
}

fn time_tandem(args: &Args) -> Result<Timing, AnyError> {
    if args.no_cache {
        tandem::core::alloc::set_cache_limit(0);
    }
    manual_seed(args.seed);
    let Workload {
        model,
        sample_shape,
        classes,
    } = args.model.build()?;
    let device = args.device;
    if let Device::Cuda(_) = device {
        tandem::core::cuda::blas::set_allow_tf32_matmul(args.tf32_matmul);
        tandem::core::cuda::blas::set_allow_tf32_conv(true);
    }
    model.to_device(device)?;
    if args.channels_last {
        model.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    model.train();
    let mut optimizer = Sgd::new(model.parameters(), SgdConfig::new(0.01).with_momentum(0.9))?;
    let mut generator = Generator::new(args.seed);
    let mut shape = vec![args.batch_size];
    shape.extend(&sample_shape);
    let mut inputs = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut generator)?
        .to_device(device)?;
    if args.channels_last {
        inputs = inputs.contiguous_in(MemoryFormat::ChannelsLast)?;
    }
    let labels: Vec<i64> = (0..args.batch_size)
        .map(|_| generator.below(classes) as i64)
        .collect();
    let targets = Tensor::from_vec(labels, &[args.batch_size], Device::Cpu)?.to_device(device)?;
    // Waits for the device's queued work (nothing to wait for on the CPU).
    let sync = || -> Result<(), AnyError> {
        if let Device::Cuda(n) = device {
            tandem::core::cuda::device(n)?.synchronize()?;
        }
        Ok(())
    };
    let mut scaler: Option<GradScaler> = match args.amp {
        Some(Amp::F16) => Some(GradScalerConfig::default().init()?),
        _ => None,
    };

    let mut step = || -> Result<(), AnyError> {
        let forward = || -> Result<Tensor, AnyError> {
            let logits = model.forward(&inputs)?;
            Ok(cross_entropy(&logits, &targets, Reduction::Mean)?)
        };
        let loss = match args.amp {
            Some(amp) => tandem::autocast(amp.dtype(), forward)??,
            None => forward()?,
        };
        optimizer.zero_grad()?;
        match scaler.as_mut() {
            Some(scaler) => {
                scaler.scale(&loss)?.backward()?;
                scaler.step(&mut optimizer)?;
                scaler.update()?;
            }
            None => {
                loss.backward()?;
                optimizer.step()?;
            }
        }
        Ok(())
    };
    for _ in 0..args.warmup {
        step()?;
    }
    sync()?;
    let mut times = Vec::with_capacity(args.steps);
    let mut host = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let start = Instant::now();
        step()?;
        let issued = start.elapsed();
        sync()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        host.push(issued.as_secs_f64() * 1e3);
    }
    let mut timing = summarise(times, peak_rss_mib());
    if let Device::Cuda(n) = device {
        timing.host_ms = Some(median(host));
        let stats = tandem::core::cuda::memory_stats(n)?;
        timing.peak_device_mib = Some(stats.peak_allocated as f64 / (1024.0 * 1024.0));
    }
    if args.profile > 0 {
        tandem::core::profile::start();
        for _ in 0..args.profile {
            step()?;
        }
        sync()?;
        print_profile(&tandem::core::profile::stop(), args.profile);
    }
    Ok(timing)
}

/// The profiler's table per step, then the totals per phase.
fn print_profile(report: &tandem::core::profile::ProfileReport, steps: usize) {
    use tandem::core::profile::Phase;
    let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps as f64;
    let wall = per_step(report.wall);
    println!("tandem per-op profile over {steps} steps ({wall:.2} ms per step):");
    println!(
        "{:<22} {:<9} {:>12} {:>11}",
        "op", "phase", "ms per step", "% of step"
    );
    for r in &report.rows {
        println!(
            "{:<22} {:<9} {:>12.3} {:>10.1}%",
            r.op,
            r.phase.to_string(),
            per_step(r.total),
            100.0 * per_step(r.total) / wall
        );
    }
    for phase in [Phase::Forward, Phase::Backward, Phase::Other] {
        let t = per_step(report.phase_total(phase));
        println!(
            "{:<32} {t:>12.3} {:>10.1}%",
            format!("total {phase}"),
            100.0 * t / wall
        );
    }
    println!();
}

/// The median of a non-empty sample.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    }
}

fn summarise(times: Vec<f64>, peak_rss_mib: Option<f64>) -> Timing {
    let n = times.len();
    Timing {
        mean_ms: times.iter().sum::<f64>() / n as f64,
        min_ms: times.iter().copied().fold(f64::INFINITY, f64::min),
        median_ms: median(times),
        host_ms: None,
        peak_rss_mib,
        peak_device_mib: None,
    }
}

/// This process's peak resident set size (VmHWM), on Linux.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Runs the PyTorch peer; `Err` says why it could not run.
fn time_torch(args: &Args, threads: usize) -> Result<(Timing, String), String> {
    let script = peer::script("train_step_torch.py")?;
    peer::probe(&args.peer_python, "import torch", "import torch")?;
    let mut command = Command::new(&args.peer_python);
    command
        .arg(script)
        .args(["--model", args.model.name()])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--device", &args.device.to_string()])
        .args(args.tf32_matmul.then_some("--tf32-matmul"))
        .args(args.amp.iter().flat_map(|a| ["--amp", a.name()]))
        .args(args.channels_last.then_some("--channels-last"));
    let value = peer::run_json(command)?;
    Ok((
        Timing {
            median_ms: peer::field(&value, "median_ms")?,
            mean_ms: peer::field(&value, "mean_ms")?,
            min_ms: peer::field(&value, "min_ms")?,
            host_ms: value["host_ms"]
                .as_f64()
                .filter(|_| args.device != Device::Cpu),
            peak_rss_mib: value["peak_rss_mib"].as_f64(),
            peak_device_mib: value["peak_device_mib"].as_f64(),
        },
        value["torch_version"].as_str().unwrap_or("?").to_string(),
    ))
}
