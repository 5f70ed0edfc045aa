//! CUDA kernel benchmark: an f32 matrix product (cuBLAS, TF32 off and on) and a
//! bandwidth-bound elementwise op (`y += α·x`), tandem vs PyTorch on the same GPU in one run.
//!
//! ```text
//! cargo bench --bench cuda_kernels -- [--size 4096] [--elements 67108864] [--iters 20]
//! ```
//!
//! Each op is timed with CUDA events recorded on the compute stream around every call, after
//! `--warmup` untimed calls, and the median is reported with TFLOP/s (`2·size³` per product) or
//! GB/s (12 bytes per element: two f32 reads and one write). When `--peer-python` (default
//! `python3`) can import torch with CUDA, `benches/peers/cuda_kernels_torch.py` times the same
//! ops on the same device and the table shows the ratio tandem/PyTorch of median times. The
//! script is found at run time (`$TANDEM_PEERS_DIR`, else `benches/peers/` above the current
//! folder or the executable's); with `--require-peer` (or `TANDEM_REQUIRE_PEER=1`) a peer that
//! did not run fails the benchmark. Without a CUDA device the benchmark says so and exits
//! successfully. Unknown flags that `cargo bench` adds (`--bench`) are ignored.

use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::Parser;
use tandem::core::cuda::{self, blas};
use tandem::core::{DType, Device, Generator, Stream, Tensor};

type AnyError = Box<dyn std::error::Error>;

#[path = "common/peer.rs"]
mod peer;

/// Time CUDA kernels in tandem and (when available) PyTorch.
#[derive(Parser, Debug)]
struct Args {
    /// Matrix size n of the n×n·n×n product.
    #[arg(long, default_value_t = 4096)]
    size: usize,
    /// Elements of the bandwidth-bound op.
    #[arg(long, default_value_t = 1 << 26)]
    elements: usize,
    /// Untimed calls before timing.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed calls (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
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
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

/// Median times (ms) of the three ops on one side.
struct Times {
    matmul: f64,
    matmul_tf32: f64,
    axpy: f64,
}

fn main() -> ExitCode {
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    if !cuda::is_available() {
        println!("cuda_kernels: skipped: no CUDA device");
        return ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The median time of `f` over `iters` calls, each between two events on the compute stream.
fn timed(
    stream: &Stream,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<(), AnyError>,
) -> Result<f64, AnyError> {
    for _ in 0..warmup {
        f()?;
    }
    stream.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = stream.record_event()?;
        f()?;
        let end = stream.record_event()?;
        end.synchronize()?;
        times.push(start.elapsed_until(&end)?);
    }
    times.sort();
    let mid = times
        .get(times.len() / 2)
        .copied()
        .unwrap_or(Duration::ZERO);
    Ok(mid.as_secs_f64() * 1e3)
}

fn time_tandem(args: &Args) -> Result<Times, AnyError> {
    let device = Device::Cuda(args.device);
    let stream = Stream::compute(device)?;
    let mut gen = Generator::new(0);
    let n = args.size;
    let a =
        Tensor::randn(&[n, n], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)?.to_device(device)?;
    let b =
        Tensor::randn(&[n, n], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)?.to_device(device)?;
    let product = || -> Result<(), AnyError> {
        tandem::ops::matmul(&a, &b)?;
        Ok(())
    };
    let previous = blas::allow_tf32_matmul();
    blas::set_allow_tf32_matmul(false);
    let matmul = timed(&stream, args.warmup, args.iters, product);
    blas::set_allow_tf32_matmul(true);
    let matmul_tf32 = timed(&stream, args.warmup, args.iters, product);
    blas::set_allow_tf32_matmul(previous);
    let (matmul, matmul_tf32) = (matmul?, matmul_tf32?);
    drop((a, b));

    let x = Tensor::randn(
        &[args.elements],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut gen,
    )?
    .to_device(device)?;
    let y = Tensor::randn(
        &[args.elements],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut gen,
    )?
    .to_device(device)?;
    let axpy = timed(&stream, args.warmup, args.iters, || {
        y.add_scaled_(&x, 0.5)?;
        Ok(())
    })?;
    Ok(Times {
        matmul,
        matmul_tf32,
        axpy,
    })
}

/// Runs the PyTorch peer; `Err` says why it could not run.
fn time_torch(args: &Args) -> Result<(Times, String), String> {
    let script = peer::script("cuda_kernels_torch.py")?;
    peer::probe(
        &args.peer_python,
        "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)",
        "import torch with CUDA",
    )?;
    let mut command = Command::new(&args.peer_python);
    command
        .arg(script)
        .args(["--size", &args.size.to_string()])
        .args(["--elements", &args.elements.to_string()])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--iters", &args.iters.to_string()])
        .args(["--device", &args.device.to_string()]);
    let value = peer::run_json(command)?;
    Ok((
        Times {
            matmul: peer::field(&value, "matmul_ms")?,
            matmul_tf32: peer::field(&value, "matmul_tf32_ms")?,
            axpy: peer::field(&value, "axpy_ms")?,
        },
        format!(
            "torch {} on {}",
            value["torch_version"].as_str().unwrap_or("?"),
            value["device"].as_str().unwrap_or("?")
        ),
    ))
}

fn run(args: &Args) -> Result<(), AnyError> {
    if args.iters == 0 || args.size == 0 || args.elements == 0 {
        return Err("--iters, --size and --elements must be > 0".into());
    }
    let tandem = time_tandem(args)?;
    let torch = if args.no_peer {
        Err("skipped (--no-peer)".to_string())
    } else {
        time_torch(args)
    };
    let n = args.size as f64;
    let flops = 2.0 * n * n * n;
    let bytes = 12.0 * args.elements as f64;
    println!(
        "cuda_kernels: cuda:{}, median of {} calls after {} warm-up",
        args.device, args.iters, args.warmup
    );
    println!(
        "{:<28} {:>11} {:>12} {:>11} {:>12} {:>8}",
        "op", "tandem ms", "tandem rate", "torch ms", "torch rate", "ratio"
    );
    let rate = |ms: f64, work: f64, unit: &str, scale: f64| {
        format!("{:.1} {unit}", work / (ms / 1e3) / scale)
    };
    let rows = [
        (
            format!("matmul {0}³ f32, TF32 off", args.size),
            tandem.matmul,
            torch.as_ref().ok().map(|t| t.0.matmul),
            flops,
            "TFLOP/s",
            1e12,
        ),
        (
            format!("matmul {0}³ f32, TF32 on", args.size),
            tandem.matmul_tf32,
            torch.as_ref().ok().map(|t| t.0.matmul_tf32),
            flops,
            "TFLOP/s",
            1e12,
        ),
        (
            format!("y += 0.5·x, {} f32", args.elements),
            tandem.axpy,
            torch.as_ref().ok().map(|t| t.0.axpy),
            bytes,
            "GB/s",
            1e9,
        ),
    ];
    for (name, ours, theirs, work, unit, scale) in rows {
        let (theirs_ms, theirs_rate, ratio) = match theirs {
            Some(t) => (
                format!("{t:.3}"),
                rate(t, work, unit, scale),
                format!("{:.2}", ours / t),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<28} {:>11.3} {:>12} {:>11} {:>12} {:>8}",
            name,
            ours,
            rate(ours, work, unit, scale),
            theirs_ms,
            theirs_rate,
            ratio
        );
    }
    match &torch {
        Ok((_, version)) => println!("ratio = tandem/pytorch median time ({version})"),
        Err(why) => {
            println!("pytorch: not run: {why}");
            if !args.no_peer && peer::required(args.require_peer) {
                return Err(peer::missing_error(why).into());
            }
        }
    }
    Ok(())
}
