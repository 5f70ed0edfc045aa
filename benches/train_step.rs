//! Training-step benchmark: forward + cross entropy + backward + SGD step, tandem vs PyTorch.
//!
//! ```text
//! cargo bench --bench train_step -- --model lenet --batch-size 64 --threads 2 [--json FILE]
//! cargo bench --bench train_step -- --model resnet20 --batch-size 32 --threads 2
//! ```
//!
//! Times `--steps` steps (default 30) after `--warmup` untimed ones (default 5) on one fixed
//! random batch, and reports the median step time, images/s and peak RSS. When
//! `--peer-python` (default `python3`) can import torch, the same model and step are timed by
//! `benches/peers/train_step_torch.py` with the same batch size and thread count, and the
//! ratio tandem/PyTorch of median step times is printed. Unknown flags that `cargo bench`
//! adds (`--bench`) are ignored.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::{Parser, ValueEnum};
use tandem::autograd::TensorBackward;
use tandem::core::rng::manual_seed;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::Module;
use tandem::optim::{Optimizer, Sgd, SgdConfig};

type AnyError = Box<dyn std::error::Error>;

/// The models the benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// LeNet-5 on 1×28×28 inputs, 10 classes.
    Lenet,
    /// ResNet-20 (CIFAR) on 3×32×32 inputs, 10 classes.
    Resnet20,
}

impl ModelKind {
    fn name(self) -> &'static str {
        match self {
            ModelKind::Lenet => "lenet",
            ModelKind::Resnet20 => "resnet20",
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
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

/// Step-time statistics of one side.
struct Timing {
    median_ms: f64,
    mean_ms: f64,
    min_ms: f64,
    peak_rss_mib: Option<f64>,
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
        "train_step: model {}, batch {}, {} threads, median of {} steps after {} warm-up",
        args.model.name(),
        args.batch_size,
        threads,
        args.steps,
        args.warmup
    );
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>14}",
        "side", "median ms", "mean ms", "min ms", "images/s", "peak RSS MiB"
    );
    let row = |side: &str, t: &Timing| {
        println!(
            "{:<8} {:>10.2} {:>10.2} {:>10.2} {:>10.0} {:>14}",
            side,
            t.median_ms,
            t.mean_ms,
            t.min_ms,
            args.batch_size as f64 / (t.median_ms / 1e3),
            t.peak_rss_mib
                .map(|m| format!("{m:.1}"))
                .unwrap_or_else(|| "-".into())
        )
    };
    row("tandem", &tandem);
    let ratio = match &torch {
        Ok((t, version)) => {
            row("pytorch", t);
            let ratio = tandem.median_ms / t.median_ms;
            println!("ratio tandem/pytorch (median step time): {ratio:.2} (torch {version})");
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
            "torch_version": torch_ok.map(|(_, v)| v.clone()),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
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
    model.train();
    let mut optimizer = Sgd::new(model.parameters(), SgdConfig::new(0.01).with_momentum(0.9))?;
    let mut generator = Generator::new(args.seed);
    let mut shape = vec![args.batch_size];
    shape.extend(&sample_shape);
    let inputs = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut generator)?;
    let labels: Vec<i64> = (0..args.batch_size)
        .map(|_| generator.below(classes) as i64)
        .collect();
    let targets = Tensor::from_vec(labels, &[args.batch_size], Device::Cpu)?;

    let mut step = || -> Result<(), AnyError> {
        let logits = model.forward(&inputs)?;
        let loss = cross_entropy(&logits, &targets, Reduction::Mean)?;
        optimizer.zero_grad()?;
        loss.backward()?;
        optimizer.step()?;
        Ok(())
    };
    for _ in 0..args.warmup {
        step()?;
    }
    let mut times = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let start = Instant::now();
        step()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let timing = summarise(times, peak_rss_mib());
    if args.profile > 0 {
        tandem::core::profile::start();
        for _ in 0..args.profile {
            step()?;
        }
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

fn summarise(mut times: Vec<f64>, peak_rss_mib: Option<f64>) -> Timing {
    times.sort_by(|a, b| a.total_cmp(b));
    let n = times.len();
    let median_ms = if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    };
    Timing {
        median_ms,
        mean_ms: times.iter().sum::<f64>() / n as f64,
        min_ms: times[0],
        peak_rss_mib,
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
    let probe = Command::new(&args.peer_python)
        .args(["-c", "import torch"])
        .output()
        .map_err(|e| format!("cannot run `{}`: {e}", args.peer_python))?;
    if !probe.status.success() {
        return Err(format!(
            "`{}` cannot import torch (install it, or pass --peer-python)",
            args.peer_python
        ));
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/peers/train_step_torch.py"
    );
    let output = Command::new(&args.peer_python)
        .arg(script)
        .args(["--model", args.model.name()])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .output()
        .map_err(|e| format!("cannot run the peer script: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "the peer script failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    let last = stdout.lines().last().unwrap_or("");
    let value: serde_json::Value =
        serde_json::from_str(last).map_err(|e| format!("unreadable peer output `{last}`: {e}"))?;
    let field = |name: &str| {
        value[name]
            .as_f64()
            .ok_or_else(|| format!("peer output lacks `{name}`: {last}"))
    };
    Ok((
        Timing {
            median_ms: field("median_ms")?,
            mean_ms: field("mean_ms")?,
            min_ms: field("min_ms")?,
            peak_rss_mib: value["peak_rss_mib"].as_f64(),
        },
        value["torch_version"].as_str().unwrap_or("?").to_string(),
    ))
}
