//! Data-parallel training-step benchmark: what communication costs per step, and how much of
//! it `DistributedDataParallel` hides behind backward.
//!
//! ```text
//! cargo bench --bench ddp_step -- --nproc 2 [--model lenet|convnet] [--batch-size 32]
//!     [--steps 30] [--link-mbit R] [--amp bf16|f16] [--channels-last]
//!     [--peer-python python3] [--json FILE] [--record FILE]
//! ```
//!
//! Runs `--nproc` local ranks (this binary re-executed as worker processes, meeting over TCP
//! at a store this process serves) and reports the median time of one step (forward, cross
//! entropy, backward, SGD with momentum) per rank, for three modes on the same model, per-rank
//! batch and ranks:
//!
//! - `no_comm`: every rank trains alone (no collective during the timed steps);
//! - `allreduce_after_backward`: after backward, each gradient is all-reduced (sum) and scaled
//!   by 1/world one parameter at a time, the loop users write by hand;
//! - `ddp`: [`DistributedDataParallel`] with its default configuration, which all-reduces
//!   buckets while backward still runs; its telemetry gives the share of communication left
//!   exposed after backward.
//!
//! When `--peer-python` can import torch, `benches/peers/ddp_step_torch.py` times PyTorch DDP
//! (gloo) on the same model, batch and number of ranks, each rank with cores/N threads. The
//! script is found at run time (`$TANDEM_PEERS_DIR`, else `benches/peers/` above the current
//! folder or the executable's); with `--require-peer` (or `TANDEM_REQUIRE_PEER=1`) a peer that
//! did not run fails the benchmark.
//!
//! `--record FILE` writes rank 0's per-bucket ready times and sizes (DDP's telemetry over the
//! timed steps) for `tandem-project`, which projects the step onto more devices.
//!
//! `--link-mbit R` puts every rank in its own network namespace (`tandem-bench-K`, addresses in
//! 10.231.0.0/24 behind a bridge) whose link is shaped to R Mbit/s each way with `tc tbf`, so
//! the numbers show a slow network rather than loopback. It needs root and iproute2, and turns
//! off tandem's same-host copies (which would bypass the link). Namespaces, links and the
//! bridge are removed when the benchmark ends.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use tandem::autograd::TensorBackward;
use tandem::core::rng::manual_seed;
use tandem::core::{DType, Device, Generator, MemoryFormat, Tensor};
use tandem::dist::projection::{ReadyClock, Recording};
use tandem::dist::rendezvous::STORE_HOSTED_VAR;
use tandem::dist::{
    init_process_group, init_with_options, Backend, DdpConfig, DistributedDataParallel,
    GroupConfig, InitOptions, JobSecret, LaunchEnv, ProcessGroup, ReduceOp, StoreConfig,
    StoreServer,
};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::{
    AdaptiveAvgPool2dConfig, Conv2dConfig, Flatten, LinearConfig, MaxPool2dConfig, Module, ReLU,
    Sequential,
};
use tandem::optim::{GradScaler, GradScalerConfig, Optimizer, Sgd, SgdConfig};

type AnyError = Box<dyn std::error::Error>;

#[path = "common/amp.rs"]
mod amp;

// Not `run_json` and `field`: the peer runs on several ranks, whose output is read here.
#[allow(dead_code)]
#[path = "common/peer.rs"]
mod peer;

use amp::Amp;

/// Selects the worker mode of a re-executed benchmark binary (`no_comm`,
/// `allreduce_after_backward` or `ddp`).
const WORKER_VAR: &str = "TANDEM_DDP_STEP_WORKER";

/// Prefix of the line rank 0 prints with its result.
const RESULT_PREFIX: &str = "RESULT ";

/// Longest time one mode (all its ranks) may take.
const MODE_TIMEOUT: Duration = Duration::from_secs(600);

/// A model, the shape of one input sample and the number of classes.
type BuiltModel = (Arc<dyn Module>, Vec<usize>, usize);

/// The models the benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// LeNet-5 on 1×28×28 inputs, 10 classes (62 k parameters).
    Lenet,
    /// A mid-size CNN on 3×32×32 inputs, 10 classes (~160 k parameters).
    Convnet,
    /// ResNet-20 on 3×32×32 inputs, 10 classes (272 k parameters, ~1.1 MB of gradients).
    Resnet20,
    /// ResNet-50 on 3×224×224 inputs, 1000 classes (25.6 M parameters, ~97.5 MiB of
    /// gradients).
    Resnet50,
}

impl ModelKind {
    fn name(self) -> &'static str {
        match self {
            ModelKind::Lenet => "lenet",
            ModelKind::Convnet => "convnet",
            ModelKind::Resnet20 => "resnet20",
            ModelKind::Resnet50 => "resnet50",
        }
    }

    /// The model, the shape of one input sample and the number of classes.
    fn build(self) -> Result<BuiltModel, AnyError> {
        match self {
            ModelKind::Lenet => Ok((Arc::new(tandem::nn::models::lenet5()?), vec![1, 28, 28], 10)),
            ModelKind::Convnet => Ok((Arc::new(convnet()?), vec![3, 32, 32], 10)),
            ModelKind::Resnet20 => Ok((
                Arc::new(tandem::nn::models::resnet20()?),
                vec![3, 32, 32],
                10,
            )),
            ModelKind::Resnet50 => Ok((
                Arc::new(tandem::nn::models::resnet50()?),
                vec![3, 224, 224],
                1000,
            )),
        }
    }
}

/// conv 3→32 · relu · maxpool 2 · conv 32→64 · relu · maxpool 2 · conv 64→128 · relu ·
/// adaptive avg pool 1 · flatten · fc 128→512 · relu · fc 512→10 (3×3 kernels, padding 1).
/// `benches/peers/ddp_step_torch.py` builds the same network.
fn convnet() -> Result<Sequential, AnyError> {
    let conv = |i, o| Conv2dConfig::new(i, o, 3).with_padding(1).init();
    Ok(Sequential::new()
        .add(conv(3, 32)?)
        .add(ReLU::new())
        .add(MaxPool2dConfig::new(2).init()?)
        .add(conv(32, 64)?)
        .add(ReLU::new())
        .add(MaxPool2dConfig::new(2).init()?)
        .add(conv(64, 128)?)
        .add(ReLU::new())
        .add(AdaptiveAvgPool2dConfig::new(1).init()?)
        .add(Flatten::new())
        .add(LinearConfig::new(128, 512).init()?)
        .add(ReLU::new())
        .add(LinearConfig::new(512, 10).init()?))
}

/// The three tandem modes, in the order they run.
const MODES: [&str; 3] = ["no_comm", "allreduce_after_backward", "ddp"];

/// Time a data-parallel training step with and without communication, tandem vs PyTorch DDP.
/// `--bucket-cap-mb`: a cap in MiB, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BucketCap {
    Mib(f64),
    /// Chosen by DDP from its measurements, starting from the default 25 MiB.
    Auto,
}

impl BucketCap {
    /// The fixed cap, or the automatic mode's starting cap (25 MiB, DDP's default).
    fn mib(self) -> f64 {
        match self {
            BucketCap::Mib(m) => m,
            BucketCap::Auto => 25.0,
        }
    }
}

impl std::str::FromStr for BucketCap {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(BucketCap::Auto);
        }
        match s.parse::<f64>() {
            Ok(m) if m > 0.0 && m.is_finite() => Ok(BucketCap::Mib(m)),
            _ => Err(format!(
                "`{s}` is neither a positive number of MiB nor `auto`"
            )),
        }
    }
}

impl std::fmt::Display for BucketCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BucketCap::Mib(m) => write!(f, "{m}"),
            BucketCap::Auto => f.write_str("auto"),
        }
    }
}

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Number of ranks (local processes).
    #[arg(long)]
    nproc: usize,
    /// The model.
    #[arg(long, value_enum, default_value_t = ModelKind::Lenet)]
    model: ModelKind,
    /// Samples per step on each rank.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Timed steps per mode.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Untimed steps before timing.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Seed of the model and of the random batches.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Shape every rank's link to this many Mbit/s each way (needs root and iproute2).
    #[arg(long)]
    link_mbit: Option<u32>,
    /// DDP's bucket cap in MiB (tandem and PyTorch; default 25 as in both), or `auto`: tandem
    /// chooses it after a few steps (`DdpConfig::auto_buckets`; PyTorch then runs with 25).
    #[arg(long, default_value = "25")]
    bucket_cap_mb: BucketCap,
    /// tandem DDP's first-bucket cap in MiB (default 1; PyTorch fixes its first bucket at 1 MiB).
    #[arg(long, default_value_t = 1.0)]
    first_bucket_mb: f64,
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
    /// Write rank 0's per-bucket ready times and sizes, and the step's phases, measured over
    /// the timed DDP steps, to this file: the input of `tandem-project`.
    #[arg(long)]
    record: Option<PathBuf>,
    /// Where the ranks train: cpu (TCP backend) or cuda (NCCL, each rank on cuda:LOCAL_RANK).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// With --device cuda: put every rank on cuda:0, each with its own NCCL_HOSTID so NCCL
    /// takes them for separate hosts (a test arrangement for machines with one GPU: the ranks
    /// share the GPU's compute and talk over loopback sockets). On by itself when the machine
    /// has fewer GPUs than ranks.
    #[arg(long)]
    share_gpu: bool,
    /// Mixed precision on both sides: forward and loss under autocast in this dtype (f16 with
    /// a gradient scaler, PyTorch's defaults); gradients and DDP's buckets stay f32.
    #[arg(long, value_enum)]
    amp: Option<Amp>,
    /// Channels-last on both sides: NHWC input batches and each rank's model converted in
    /// place before DDP wraps it (tandem's `Module::to_memory_format`, PyTorch's
    /// `model.to(memory_format=...)`).
    #[arg(long)]
    channels_last: bool,
    /// Set in workers under `--link-mbit`: always use the TCP ring.
    #[arg(long, hide = true)]
    tcp_only: bool,
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

fn main() -> ExitCode {
    // `cargo bench` appends `--bench` to the arguments of harness = false benchmarks.
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    let result = match std::env::var(WORKER_VAR) {
        Ok(mode) => worker(&args, &mode),
        Err(_) => run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

// ---------------------------------------------------------------------------------------------
// Worker side: one rank of one mode.

fn worker(args: &Args, mode: &str) -> Result<(), AnyError> {
    let env = LaunchEnv::from_process_env()?;
    let config = GroupConfig {
        same_host_copy: !args.tcp_only,
        ..GroupConfig::default()
    };
    // On CUDA: NCCL, each rank on its own GPU (or on the one the parent left visible).
    let (group, device): (Arc<dyn ProcessGroup>, Device) = match args.device {
        Device::Cpu => (Arc::new(init_process_group(&env, config)?), Device::Cpu),
        cuda => {
            let device = env.rank_device(cuda)?;
            let options = InitOptions {
                backend: Backend::Nccl,
                device,
                group: config,
                ..InitOptions::default()
            };
            (init_with_options(&env, options)?, device)
        }
    };
    let (rank, world) = (group.rank(), group.world_size());
    tandem::ops::set_num_threads((cores() / world).max(1))?;
    // Waits for the device's queued work (nothing to wait for on the CPU).
    let sync = || -> Result<(), AnyError> {
        if let Device::Cuda(n) = device {
            tandem::core::cuda::device(n)?.synchronize()?;
        }
        Ok(())
    };

    manual_seed(args.seed);
    let (model, sample_shape, classes) = args.model.build()?;
    model.to_device(device)?;
    if args.channels_last {
        model.to_memory_format(MemoryFormat::ChannelsLast)?;
    }
    model.train();
    let ddp = if mode == "ddp" {
        Some(DistributedDataParallel::new(
            model.clone(),
            group.clone(),
            DdpConfig {
                bucket_cap_mb: args.bucket_cap_mb.mib(),
                auto_buckets: (args.bucket_cap_mb == BucketCap::Auto)
                    .then(tandem::dist::AutoBuckets::default),
                first_bucket_mb: args.first_bucket_mb,
                ..DdpConfig::default()
            },
        )?)
    } else {
        None
    };
    let mut optimizer = Sgd::new(model.parameters(), SgdConfig::new(0.01).with_momentum(0.9))?;
    // Each rank its own fixed batch.
    let mut generator = Generator::new(args.seed.wrapping_add(1 + rank as u64));
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
    let params = model.parameters();
    let mut scaler: Option<GradScaler> = match args.amp {
        Some(Amp::F16) => Some(GradScalerConfig::default().init()?),
        _ => None,
    };
    let scale = 1.0 / world as f64;

    // When the last backward returned (for `--record`).
    let backward_done = std::cell::Cell::new(Instant::now());
    let mut step = || -> Result<(), AnyError> {
        optimizer.zero_grad()?;
        let forward = || -> Result<Tensor, AnyError> {
            let logits = match &ddp {
                Some(ddp) => ddp.forward(&inputs)?,
                None => model.forward(&inputs)?,
            };
            Ok(cross_entropy(&logits, &targets, Reduction::Mean)?)
        };
        let loss = match args.amp {
            Some(amp) => tandem::autocast(amp.dtype(), forward)??,
            None => forward()?,
        };
        match &scaler {
            Some(scaler) => scaler.scale(&loss)?.backward()?,
            None => loss.backward()?,
        }
        backward_done.set(Instant::now());
        if mode == "allreduce_after_backward" {
            for p in &params {
                if let Some(grad) = p.grad() {
                    group.all_reduce(&grad, ReduceOp::Sum)?.wait()?;
                    grad.scale_(scale)?;
                }
            }
        }
        match scaler.as_mut() {
            Some(scaler) => {
                scaler.step(&mut optimizer)?;
                scaler.update()?;
            }
            None => optimizer.step()?,
        }
        // A GPU step ends when the device has done its work.
        sync()?;
        Ok(())
    };
    for _ in 0..args.warmup {
        step()?;
    }
    let before = ddp.as_ref().map(|d| d.telemetry().summary());
    // Start the timed steps together.
    group.barrier()?.wait()?;
    let mut times = Vec::with_capacity(args.steps);
    let mut bounds = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let start = Instant::now();
        step()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        bounds.push((start, backward_done.get(), Instant::now()));
    }
    if let (Some(path), Some(ddp), 0) = (&args.record, &ddp, rank) {
        record_buckets(args, path, &ddp.telemetry(), &bounds, world, device)?;
    }
    // Only the timed steps: the totals now minus those after warm-up.
    let overlap = match (&ddp, before) {
        (Some(ddp), Some(before)) => {
            let after = ddp.telemetry().summary();
            let comm = after.comm.saturating_sub(before.comm).as_secs_f64();
            let exposed = after.exposed.saturating_sub(before.exposed).as_secs_f64();
            let per_step = |t: f64| t * 1e3 / args.steps as f64;
            let fraction = if comm > 0.0 {
                format!("{:.4}", exposed / comm)
            } else {
                "none".into()
            };
            format!(
                " exposed={fraction} comm_ms={:.3} exposed_ms={:.3}",
                per_step(comm),
                per_step(exposed)
            )
        }
        _ => String::new(),
    };
    group.barrier()?.wait()?;
    if rank == 0 {
        println!(
            "{RESULT_PREFIX}mode={mode} median_ms={:.4}{overlap}",
            median(&mut times)
        );
    }
    Ok(())
}

/// Writes the recording `tandem-project` reads: per bucket its size and when it was issued
/// (on the CPU, when its last gradient was computed) after forward ended, medians over the
/// timed steps (`bounds`: each timed step's start, the return of its backward, and its end).
fn record_buckets(
    args: &Args,
    path: &std::path::Path,
    telemetry: &tandem::dist::Telemetry,
    bounds: &[(Instant, Instant, Instant)],
    world: usize,
    device: Device,
) -> Result<(), AnyError> {
    let steps = telemetry.steps();
    let timed = &steps[steps.len().saturating_sub(bounds.len())..];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let on_gpu = device != Device::Cpu;
    let (mut forward, mut optimizer): (Vec<f64>, Vec<f64>) = if on_gpu {
        // The host runs ahead of a GPU, so host times say little: backward's end is the
        // device's (placed on the host clock by the telemetry), what follows it until the
        // synchronised end of the step is the optimizer's, and forward is the rest.
        timed
            .iter()
            .zip(bounds)
            .map(|(s, (start, _, end))| {
                let step = ms(end.saturating_duration_since(*start));
                let after = ms(end.saturating_duration_since(s.backward_compute_end));
                ((step - after - ms(s.backward_compute())).max(0.0), after)
            })
            .unzip()
    } else {
        timed
            .iter()
            .zip(bounds)
            .map(|(s, (start, backward_done, end))| {
                (
                    ms(s.forward_end.saturating_duration_since(*start)),
                    ms(end.saturating_duration_since(*backward_done)),
                )
            })
            .unzip()
    };
    // On a GPU the comm stream's start of a bucket is the device's time (the bucket is issued
    // by the host long before the device reaches it).
    let clock = if on_gpu {
        ReadyClock::Started
    } else {
        ReadyClock::Issued
    };
    let mut recording =
        Recording::from_steps(timed, clock, median(&mut forward), median(&mut optimizer))
            .ok_or("--record: DDP recorded no step")?;
    recording.model = args.model.name().to_string();
    recording.device = match device {
        Device::Cpu => format!(
            "cpu, {} threads per rank, {world} ranks on {}",
            (cores() / world).max(1),
            args.link_mbit
                .map_or_else(|| "loopback".to_string(), |m| format!("{m} Mbit/s links"))
        ),
        cuda => format!("{cuda}, {world} ranks (NCCL)"),
    };
    recording.batch_size = args.batch_size;
    recording.note = format!(
        "ddp_step --bucket-cap-mb {} --first-bucket-mb {}; ready times are {}; medians of {} steps",
        args.bucket_cap_mb,
        args.first_bucket_mb,
        if on_gpu {
            "when the comm stream started each bucket (device clock; in a world of 1 as soon as it was ready)"
        } else {
            "when rank 0 issued each bucket (host clock, exact on the CPU)"
        },
        timed.len()
    );
    std::fs::write(path, serde_json::to_string_pretty(&recording)? + "\n")
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

fn median(times: &mut [f64]) -> f64 {
    times.sort_by(|a, b| a.total_cmp(b));
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    }
}

// ---------------------------------------------------------------------------------------------
// Parent side: start the ranks of each mode, collect and print.

/// What one mode measured (rank 0's view).
struct ModeResult {
    median_ms: f64,
    /// DDP only: exposed communication over all communication, timed steps.
    exposed_fraction: Option<f64>,
    /// DDP only: communication per timed step (buckets' busy time), in ms.
    comm_ms: Option<f64>,
    /// DDP only: communication per timed step left after backward's computation, in ms.
    exposed_ms: Option<f64>,
}

fn run(args: &Args) -> Result<(), AnyError> {
    if args.nproc == 0 || args.steps == 0 || args.batch_size == 0 {
        return Err("--nproc, --steps and --batch-size must be > 0".into());
    }
    // Fail early on a model tandem lacks.
    args.model.build()?;
    let mut args = args.clone();
    if let Device::Cuda(_) = args.device {
        if args.link_mbit.is_some() {
            return Err(
                "--link-mbit shapes TCP links between CPU ranks; it does not apply to --device cuda"
                    .into(),
            );
        }
        let gpus = tandem::core::cuda::device_count();
        if gpus == 0 {
            // The runtime's error names what is missing.
            Tensor::zeros(&[1], DType::F32, args.device)?;
        }
        if gpus < args.nproc && !args.share_gpu {
            eprintln!(
                "ddp_step: {} ranks but {gpus} GPU(s): every rank on cuda:0 (--share-gpu)",
                args.nproc
            );
            args.share_gpu = true;
        }
    }
    let args = &args;
    let network = match args.link_mbit {
        Some(0) => return Err("--link-mbit must be > 0".into()),
        Some(mbit) => Some(ShapedNetwork::create(args.nproc, mbit)?),
        None => None,
    };
    let threads = (cores() / args.nproc).max(1);

    let mut results = Vec::new();
    for mode in MODES {
        eprintln!("ddp_step: running {mode} on {} ranks…", args.nproc);
        results.push(run_tandem_mode(args, mode, network.as_ref())?);
    }
    let torch = if args.no_peer {
        Err("skipped (--no-peer)".to_string())
    } else {
        eprintln!("ddp_step: running PyTorch DDP on {} ranks…", args.nproc);
        run_torch(args, threads, network.as_ref())
    };
    drop(network);

    let [no_comm, after_backward, ddp] = &results[..] else {
        unreachable!("three modes")
    };
    let link = match (args.link_mbit, args.device) {
        (Some(m), _) => format!("{m} Mbit/s links"),
        (None, Device::Cpu) => "loopback".into(),
        (None, _) if args.share_gpu => "one shared GPU, NCCL over loopback sockets".into(),
        (None, _) => "one GPU per rank, NCCL".into(),
    };
    println!(
        "ddp_step: model {}, batch {} per rank, {} ranks × {} threads, {link}, median of {} steps after {} warm-up",
        args.model.name(),
        args.batch_size,
        args.nproc,
        threads,
        args.steps,
        args.warmup
    );
    println!("{:<28} {:>12}", "mode", "median ms");
    println!("{:<28} {:>12.2}", "no_comm", no_comm.median_ms);
    println!(
        "{:<28} {:>12.2}",
        "allreduce_after_backward", after_backward.median_ms
    );
    println!("{:<28} {:>12.2}", "ddp", ddp.median_ms);
    match &torch {
        Ok(t) => println!(
            "{:<28} {:>12.2}",
            format!("torch_ddp ({})", t.backend),
            t.median_ms
        ),
        Err(why) => println!("torch_ddp: not run: {why}"),
    }
    match ddp.exposed_fraction {
        Some(f) => println!(
            "ddp communication: {:.2} ms/step, exposed after backward {:.2} ms/step ({:.1}%)",
            ddp.comm_ms.unwrap_or(f64::NAN),
            ddp.exposed_ms.unwrap_or(f64::NAN),
            f * 100.0
        ),
        None => println!("ddp exposed communication: no communication recorded"),
    }
    println!(
        "ddp / no_comm:           {:.2}",
        ddp.median_ms / no_comm.median_ms
    );
    println!(
        "ddp / after_backward:    {:.2}",
        ddp.median_ms / after_backward.median_ms
    );
    if let Ok(t) = &torch {
        println!(
            "ddp / torch_ddp:         {:.2} (torch {})",
            ddp.median_ms / t.median_ms,
            t.version
        );
    }

    if let Some(path) = &args.json {
        let torch_ok = torch.as_ref().ok();
        let json = serde_json::json!({
            "nproc": args.nproc,
            "model": args.model.name(),
            "batch_size": args.batch_size,
            "link_mbit": args.link_mbit,
            "step_ms_no_comm": no_comm.median_ms,
            "step_ms_allreduce_after_backward": after_backward.median_ms,
            "step_ms_ddp": ddp.median_ms,
            "exposed_comm_fraction": ddp.exposed_fraction,
            "torch_ddp_step_ms": torch_ok.map(|t| t.median_ms),
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

/// Runs one tandem mode on `args.nproc` ranks and parses rank 0's result line.
fn run_tandem_mode(
    args: &Args,
    mode: &str,
    network: Option<&ShapedNetwork>,
) -> Result<ModeResult, AnyError> {
    let bind = if network.is_some() {
        format!("{}:0", ShapedNetwork::HOST_ADDR)
    } else {
        "127.0.0.1:0".into()
    };
    let secret = JobSecret::generate()?;
    let store = StoreServer::bind_with(
        bind.as_str(),
        StoreConfig {
            secret: Some(secret.clone()),
            ..StoreConfig::default()
        },
    )?;
    let addr = store.local_addr();
    let exe = std::env::current_exe()?;
    let world = args.nproc;
    let outputs = run_ranks(world, |rank| {
        let mut cmd = match network {
            Some(n) => n.command_in(rank, &exe),
            None => Command::new(&exe),
        };
        cmd.args(["--nproc", &world.to_string()])
            .args(["--model", args.model.name()])
            .args(["--batch-size", &args.batch_size.to_string()])
            .args(["--steps", &args.steps.to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--bucket-cap-mb", &args.bucket_cap_mb.to_string()])
            .args(["--first-bucket-mb", &args.first_bucket_mb.to_string()])
            .args(["--device", &args.device.to_string()])
            .args(args.amp.iter().flat_map(|a| ["--amp", a.name()]))
            .args(args.channels_last.then_some("--channels-last"));
        if let (Some(path), "ddp") = (&args.record, mode) {
            cmd.arg("--record").arg(path);
        }
        if network.is_some() {
            cmd.arg("--tcp-only");
        }
        if args.share_gpu {
            share_gpu_env(&mut cmd, rank);
        }
        cmd.env(WORKER_VAR, mode)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", addr.ip().to_string())
            .env("MASTER_PORT", addr.port().to_string())
            .env(STORE_HOSTED_VAR, "1")
            .env(tandem::dist::auth::SECRET_VAR, secret.env_value());
        cmd
    })
    .map_err(|e| format!("mode {mode}: {e}"))?;
    drop(store);
    let line = outputs[0]
        .lines()
        .find_map(|l| l.strip_prefix(RESULT_PREFIX))
        .ok_or_else(|| format!("mode {mode}: rank 0 printed no result: {}", outputs[0]))?;
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .ok_or_else(|| format!("mode {mode}: result line lacks `{name}`: {line}"))
    };
    let median_ms: f64 = field("median_ms")?.parse()?;
    let optional = |name: &str| -> Result<Option<f64>, AnyError> {
        match field(name) {
            Err(_) | Ok("none") => Ok(None),
            Ok(v) => Ok(Some(v.parse()?)),
        }
    };
    Ok(ModeResult {
        median_ms,
        exposed_fraction: optional("exposed")?,
        comm_ms: optional("comm_ms")?,
        exposed_ms: optional("exposed_ms")?,
    })
}

/// The environment that lets rank `rank` share cuda:0 with the other ranks: only that GPU
/// visible, and an `NCCL_HOSTID` of its own, so that NCCL (which refuses two ranks on one GPU)
/// takes every rank for a separate host and connects them over loopback sockets. A test
/// arrangement for a machine with one GPU; real jobs give each rank its own GPU.
fn share_gpu_env(cmd: &mut Command, rank: usize) {
    cmd.env("CUDA_VISIBLE_DEVICES", "0")
        .env("NCCL_HOSTID", format!("tandem-ddp-step-rank-{rank}"))
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_IB_DISABLE", "1");
}

/// Collects what a child writes, in the background.
fn collect(from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut from = from;
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            if let Ok(mut s) = into.lock() {
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
    });
}

/// Kills and reaps the children still running when dropped.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// Starts `world` processes (`command(rank)`), waits for all, and returns each one's stdout.
/// When one fails the others are killed and the error carries every rank's output.
fn run_ranks(world: usize, command: impl Fn(usize) -> Command) -> Result<Vec<String>, String> {
    let mut children = Children(Vec::new());
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    for rank in 0..world {
        let mut child = command(rank)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start rank {rank}: {e}"))?;
        let (out, err) = (Arc::default(), Arc::default());
        if let (Some(o), Some(e)) = (child.stdout.take(), child.stderr.take()) {
            collect(o, Arc::clone(&out));
            collect(e, Arc::clone(&err));
        }
        children.0.push(child);
        stdout.push(out);
        stderr.push(err);
    }
    let text = |v: &Arc<Mutex<String>>| v.lock().map(|s| s.clone()).unwrap_or_default();
    let report = |why: String| {
        let mut msg = why;
        for (rank, (o, e)) in stdout.iter().zip(&stderr).enumerate() {
            msg.push_str(&format!(
                "\n--- rank {rank} ---\n{}{}",
                text(o),
                text(e).trim_end()
            ));
        }
        msg
    };
    let deadline = Instant::now() + MODE_TIMEOUT;
    let mut done = vec![false; world];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.0.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) if status.success() => done[rank] = true,
                Ok(Some(status)) => {
                    drop(children);
                    std::thread::sleep(Duration::from_millis(100));
                    return Err(report(format!("rank {rank} failed ({status})")));
                }
                Ok(None) => {}
                Err(e) => return Err(report(format!("rank {rank}: {e}"))),
            }
        }
        if Instant::now() >= deadline {
            drop(children);
            return Err(report(format!(
                "ranks still running after {MODE_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Give the collectors a moment to read the last bytes.
    std::thread::sleep(Duration::from_millis(100));
    // `--bucket-cap-mb auto`: rank 0's choices.
    if let Some(e) = stderr.first() {
        text(e)
            .lines()
            .filter(|l| l.starts_with("DDP auto buckets"))
            .for_each(|l| eprintln!("ddp_step: {l}"));
    }
    Ok(stdout.iter().map(text).collect())
}

// ---------------------------------------------------------------------------------------------
// PyTorch peer.

/// PyTorch DDP's median step time and version.
struct TorchResult {
    median_ms: f64,
    version: String,
    /// gloo or nccl.
    backend: String,
}

/// Runs the PyTorch DDP peer on `args.nproc` ranks; `Err` says why it could not run.
fn run_torch(
    args: &Args,
    threads: usize,
    network: Option<&ShapedNetwork>,
) -> Result<TorchResult, String> {
    let script = peer::script("ddp_step_torch.py")?;
    peer::probe(&args.peer_python, "import torch", "import torch")?;
    let (master, port, ifname) = match network {
        Some(n) => (n.rank_addr(0), 29500, ShapedNetwork::RANK_IFNAME),
        None => {
            // A port that was free a moment ago.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("cannot find a free port: {e}"))?
                .port();
            ("127.0.0.1".to_string(), port, "lo")
        }
    };
    let world = args.nproc;
    let python = PathBuf::from(&args.peer_python);
    let outputs = run_ranks(world, |rank| {
        let mut cmd = match network {
            Some(n) => n.command_in(rank, &python),
            None => Command::new(&python),
        };
        cmd.arg(&script)
            .args(["--model", args.model.name()])
            .args(["--batch-size", &args.batch_size.to_string()])
            .args(["--threads", &threads.to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--steps", &args.steps.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--bucket-cap-mb", &args.bucket_cap_mb.mib().to_string()])
            .args(args.amp.iter().flat_map(|a| ["--amp", a.name()]))
            .args(args.channels_last.then_some("--channels-last"))
            .args([
                "--device",
                if args.device == Device::Cpu {
                    "cpu"
                } else {
                    "cuda"
                },
            ])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", &master)
            .env("MASTER_PORT", port.to_string())
            .env("GLOO_SOCKET_IFNAME", ifname);
        if args.share_gpu {
            cmd.arg("--share-gpu");
            share_gpu_env(&mut cmd, rank);
        }
        cmd
    })?;
    let last = outputs[0].lines().last().unwrap_or("");
    let value: serde_json::Value =
        serde_json::from_str(last).map_err(|e| format!("unreadable peer output `{last}`: {e}"))?;
    Ok(TorchResult {
        median_ms: value["median_ms"]
            .as_f64()
            .ok_or_else(|| format!("peer output lacks `median_ms`: {last}"))?,
        version: value["torch_version"].as_str().unwrap_or("?").to_string(),
        backend: value["backend"].as_str().unwrap_or("gloo").to_string(),
    })
}

// ---------------------------------------------------------------------------------------------
// Shaped links (`--link-mbit`).

/// One network namespace per rank, each joined to a bridge in the root namespace by a veth
/// pair whose two ends are shaped with `tc tbf`; removed on drop.
struct ShapedNetwork {
    ranks: usize,
}

impl ShapedNetwork {
    const BRIDGE: &'static str = "tdmbench0";
    /// The bridge's address, where this process serves the store.
    const HOST_ADDR: &'static str = "10.231.0.1";
    /// Name of each rank's interface inside its namespace.
    const RANK_IFNAME: &'static str = "tdm0";

    fn namespace(rank: usize) -> String {
        format!("tandem-bench-{rank}")
    }

    fn host_veth(rank: usize) -> String {
        format!("tdmb-h{rank}")
    }

    fn rank_addr(&self, rank: usize) -> String {
        format!("10.231.0.{}", 10 + rank)
    }

    fn create(ranks: usize, mbit: u32) -> Result<Self, AnyError> {
        let needs = "--link-mbit needs root and iproute2";
        if ranks > 200 {
            return Err(format!("{needs}; and at most 200 ranks (one /24)").into());
        }
        let root = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        if !root {
            return Err(format!("{needs}: this process is not running as root").into());
        }
        for tool in ["ip", "tc"] {
            if Command::new(tool).arg("-V").output().is_err() {
                return Err(format!("{needs}: `{tool}` was not found").into());
            }
        }
        // Leftovers of an interrupted run would make the setup fail.
        Self::remove(ranks);
        let network = ShapedNetwork { ranks };
        network
            .setup(mbit)
            .map_err(|e| format!("{needs}: setting up the shaped links failed: {e}"))?;
        Ok(network)
    }

    fn setup(&self, mbit: u32) -> Result<(), String> {
        let bytes_per_sec = mbit as u64 * 1_000_000 / 8;
        // Room for a full GSO segment, and at least 10 ms at the rate.
        let burst = (bytes_per_sec / 100).max(128 * 1024);
        let shape = |dev: &str, ns: Option<&str>| -> Result<(), String> {
            let mut cmd = vec![];
            if let Some(ns) = ns {
                cmd.extend(["-n", ns]);
            }
            let (rate, burst) = (format!("{mbit}mbit"), burst.to_string());
            cmd.extend(["qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate]);
            cmd.extend(["burst", &burst, "latency", "100ms"]);
            sh("tc", &cmd)
        };
        let bridge = Self::BRIDGE;
        let host_cidr = format!("{}/24", Self::HOST_ADDR);
        sh("ip", &["link", "add", bridge, "type", "bridge"])?;
        sh("ip", &["addr", "add", &host_cidr, "dev", bridge])?;
        sh("ip", &["link", "set", bridge, "up"])?;
        for rank in 0..self.ranks {
            let ns = Self::namespace(rank);
            let host = Self::host_veth(rank);
            let peer = format!("tdmb-n{rank}");
            let cidr = format!("{}/24", self.rank_addr(rank));
            let inner = Self::RANK_IFNAME;
            sh("ip", &["netns", "add", &ns])?;
            sh(
                "ip",
                &["link", "add", &host, "type", "veth", "peer", "name", &peer],
            )?;
            sh("ip", &["link", "set", &host, "master", bridge])?;
            sh("ip", &["link", "set", &host, "up"])?;
            sh("ip", &["link", "set", &peer, "netns", &ns])?;
            sh("ip", &["-n", &ns, "link", "set", &peer, "name", inner])?;
            sh("ip", &["-n", &ns, "addr", "add", &cidr, "dev", inner])?;
            sh("ip", &["-n", &ns, "link", "set", inner, "up"])?;
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            // Out of the rank, and into it.
            shape(inner, Some(&ns))?;
            shape(&host, None)?;
        }
        Ok(())
    }

    /// `program` run inside rank `rank`'s namespace.
    fn command_in(&self, rank: usize, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &Self::namespace(rank)])
            .arg(program);
        cmd
    }

    /// Removes what [`ShapedNetwork::setup`] may have made; errors are ignored.
    fn remove(ranks: usize) {
        for rank in 0..ranks {
            let _ = quiet("ip", &["link", "del", &Self::host_veth(rank)]);
            let _ = quiet("ip", &["netns", "del", &Self::namespace(rank)]);
        }
        let _ = quiet("ip", &["link", "del", Self::BRIDGE]);
    }
}

impl Drop for ShapedNetwork {
    fn drop(&mut self) {
        Self::remove(self.ranks);
    }
}

/// Runs `program args`; `Err` carries the command and its stderr.
fn sh(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("`{program} {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `program args` with its output discarded.
fn quiet(program: &str, args: &[&str]) -> std::io::Result<std::process::ExitStatus> {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
}
