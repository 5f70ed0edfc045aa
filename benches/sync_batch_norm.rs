//! SyncBatchNorm against plain BatchNorm2d on thread ranks, in one run:
//!
//! ```text
//! cargo bench --bench sync_batch_norm -- [--ranks 2] [--batch-size 32] [--steps 60]
//! cargo bench --bench sync_batch_norm -- --model resnet20
//! ```
//!
//! The ranks are threads of this process joined by the threads backend, each running its
//! kernels on its own `--threads-per-rank` compute threads (default 1) over its share of the
//! global `--batch-size`. With `--model layers` (the default) a step is one layer's forward and
//! backward (`y = bn(x)`, then the gradient of `Σ y·g`) at the three ResNet-20 batch-norm
//! shapes; with `--model resnet20` it is ResNet-20's forward, cross entropy and backward, its
//! batch norms plain or converted by `convert_sync_batch_norm`. Each timed step starts on a
//! barrier, so every rank starts together; its time is the slowest rank's. The plain and the
//! synchronised step alternate (which goes first flips every step), and the table gives the
//! median over `--steps` steps of each and their ratio. Unknown flags that `cargo bench` adds
//! (`--bench`) are ignored.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use tandem::autograd::backward;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::dist::{convert_sync_batch_norm, ProcessGroup, SyncBatchNorm, ThreadProcessGroup};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::{BatchNormConfig, Module};

type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// What a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// One batch-norm layer, at each ResNet-20 batch-norm shape.
    Layers,
    /// A ResNet-20 forward + backward.
    Resnet20,
}

/// Time SyncBatchNorm against BatchNorm2d on thread ranks.
#[derive(Parser, Debug)]
struct Args {
    /// What a step runs.
    #[arg(long, value_enum, default_value_t = Workload::Layers)]
    model: Workload,
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Global batch size, split evenly over the ranks.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Compute threads of each rank.
    #[arg(long, default_value_t = 1)]
    threads_per_rank: usize,
    /// Untimed steps of each kind first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Timed steps of each kind.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), AnyError> {
    if args.ranks == 0 || args.steps == 0 || args.threads_per_rank == 0 {
        return Err("--ranks, --steps and --threads-per-rank must be > 0".into());
    }
    if !args.batch_size.is_multiple_of(args.ranks) || args.batch_size / args.ranks < 1 {
        return Err("--batch-size must be a positive multiple of --ranks".into());
    }
    let local = args.batch_size / args.ranks;
    println!(
        "sync_batch_norm: {} thread ranks × {} compute thread(s), global batch {}, median of {} \
         steps (each the slowest rank's), plain and synchronised alternating",
        args.ranks, args.threads_per_rank, args.batch_size, args.steps
    );
    println!(
        "{:28} {:>14} {:>14} {:>8}",
        "step", "BatchNorm2d ms", "SyncBN ms", "ratio"
    );
    match args.model {
        Workload::Layers => {
            for (c, hw) in [(16, 32), (32, 16), (64, 8)] {
                let shape = [local, c, hw, hw];
                let (plain, sync) = compare(args, |rank, group| layer_steps(shape, rank, group))?;
                report(&format!("layer {shape:?}"), plain, sync);
            }
            // The floor under the difference: a synchronised layer step issues two small
            // all-reduces (the statistics and the gradient sums).
            let (nothing, collectives) = compare(args, |_, group| collective_steps(64, group))?;
            report("2 all-reduces of 129 f64", nothing, collectives);
        }
        Workload::Resnet20 => {
            let (plain, sync) = compare(args, |rank, group| resnet_steps(local, rank, group))?;
            report(&format!("resnet20, {local} per rank"), plain, sync);
        }
    }
    Ok(())
}

fn report(what: &str, plain: f64, sync: f64) {
    // A plain step of (nearly) nothing has no meaningful ratio.
    let ratio = if plain > 1e-3 {
        format!("{:.2}", sync / plain)
    } else {
        "-".to_string()
    };
    println!("{what:28} {plain:>14.3} {sync:>14.3} {ratio:>8}");
}

/// A plain and a synchronised step of one rank.
struct Steps {
    plain: Box<dyn FnMut() -> Result<(), AnyError>>,
    sync: Box<dyn FnMut() -> Result<(), AnyError>>,
}

/// Runs `make(rank, group)`'s steps on every rank and returns the median plain and synchronised
/// step times in ms (each step's time the slowest rank's).
fn compare(
    args: &Args,
    make: impl Fn(usize, Arc<dyn ProcessGroup>) -> Result<Steps, AnyError> + Sync,
) -> Result<(f64, f64), AnyError> {
    let groups = ThreadProcessGroup::new_group(args.ranks)?;
    let make = &make;
    let per_rank: Vec<Result<Vec<[f64; 2]>, AnyError>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                s.spawn(move || -> Result<Vec<[f64; 2]>, AnyError> {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(args.threads_per_rank)
                        .build()?;
                    pool.install(|| {
                        let group: Arc<dyn ProcessGroup> = Arc::new(group);
                        let mut steps = make(rank, group.clone())?;
                        time_steps(args, &group, &mut steps)
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
            .collect()
    });
    let per_rank: Vec<Vec<[f64; 2]>> = per_rank.into_iter().collect::<Result<_, _>>()?;
    let slowest = |k: usize| -> Vec<f64> {
        (0..args.steps)
            .map(|i| per_rank.iter().map(|r| r[i][k]).fold(0.0, f64::max))
            .collect()
    };
    Ok((median(slowest(0)), median(slowest(1))))
}

/// `[plain, sync]` times of each timed step of one rank, in ms.
fn time_steps(
    args: &Args,
    group: &Arc<dyn ProcessGroup>,
    steps: &mut Steps,
) -> Result<Vec<[f64; 2]>, AnyError> {
    let barrier = || -> Result<(), AnyError> { Ok(group.barrier()?.wait()?) };
    for _ in 0..args.warmup {
        (steps.plain)()?;
        (steps.sync)()?;
    }
    let mut times = Vec::with_capacity(args.steps);
    for i in 0..args.steps {
        let mut pair = [0.0; 2];
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            barrier()?;
            let start = Instant::now();
            if k == 0 {
                (steps.plain)()?;
            } else {
                (steps.sync)()?;
            }
            pair[k] = start.elapsed().as_secs_f64() * 1e3;
        }
        times.push(pair);
    }
    barrier()?;
    Ok(times)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Random f32 values of `shape` from `seed`.
fn random(shape: &[usize], seed: u64) -> Result<Tensor, AnyError> {
    Ok(Tensor::randn(
        shape,
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )?)
}

/// One layer's forward and backward, plain and synchronised, on this rank's `[n, c, h, w]`.
fn layer_steps(
    shape: [usize; 4],
    rank: usize,
    group: Arc<dyn ProcessGroup>,
) -> Result<Steps, AnyError> {
    let c = shape[1];
    let seed = 10 * rank as u64;
    let x = random(&shape, seed + 1)?.with_requires_grad()?;
    let g = random(&shape, seed + 2)?;
    let plain = Arc::new(BatchNormConfig::new(c).init()?);
    let sync = SyncBatchNorm::new(Arc::new(BatchNormConfig::new(c).init()?), group);
    let step = |layer: &dyn Module, x: &Tensor, g: &Tensor| -> Result<(), AnyError> {
        let y = layer.forward(x)?;
        backward(&y, Some(g), &Default::default())?;
        x.set_grad(None)?;
        for (_, _, t) in layer.named_tensors() {
            if t.requires_grad() {
                t.set_grad(None)?;
            }
        }
        Ok(())
    };
    let (xp, gp) = (x.clone(), g.clone());
    Ok(Steps {
        plain: Box::new(move || step(plain.as_ref(), &xp, &gp)),
        sync: Box::new(move || step(&sync, &x, &g)),
    })
}

/// Nothing (plain), against the two all-reduces a synchronised layer step of `c` channels
/// issues (sync).
fn collective_steps(c: usize, group: Arc<dyn ProcessGroup>) -> Result<Steps, AnyError> {
    let stats = Tensor::zeros(&[2 * c + 1], DType::F64, Device::Cpu)?;
    let sums = Tensor::zeros(&[2, c], DType::F64, Device::Cpu)?;
    Ok(Steps {
        plain: Box::new(|| Ok(())),
        sync: Box::new(move || {
            for t in [&stats, &sums] {
                group.all_reduce(t, tandem::dist::ReduceOp::Sum)?.wait()?;
            }
            Ok(())
        }),
    })
}

/// ResNet-20's forward, cross entropy and backward on this rank's `n` samples, its batch norms
/// plain or synchronised.
fn resnet_steps(n: usize, rank: usize, group: Arc<dyn ProcessGroup>) -> Result<Steps, AnyError> {
    let seed = 10 * rank as u64;
    let x = random(&[n, 3, 32, 32], seed + 1)?;
    let labels: Vec<i64> = (0..n as i64).map(|i| (i * 7 + rank as i64) % 10).collect();
    let y = Tensor::from_vec(labels, &[n], Device::Cpu)?;
    let plain: Arc<dyn Module> = Arc::new(tandem::nn::models::resnet20()?);
    let sync = convert_sync_batch_norm(Arc::new(tandem::nn::models::resnet20()?), group)?;
    let step = move |model: &dyn Module, x: &Tensor, y: &Tensor| -> Result<(), AnyError> {
        let loss = cross_entropy(&model.forward(x)?, y, Reduction::Mean)?;
        backward(&loss, None, &Default::default())?;
        for (_, _, t) in model.named_tensors() {
            if t.requires_grad() {
                t.set_grad(None)?;
            }
        }
        Ok(())
    };
    let (xp, yp) = (x.clone(), y.clone());
    Ok(Steps {
        plain: Box::new(move || step(plain.as_ref(), &xp, &yp)),
        sync: Box::new(move || step(sync.as_ref(), &x, &y)),
    })
}
