//! Op-level timing of the kernels that dominate a training step, forward and backward, at
//! one or more thread counts:
//!
//! ```text
//! cargo bench --bench ops -- --op conv2d [--geometry r20_16_16] [--threads 1,2]
//! cargo bench --bench ops -- --op conv2d --geometry 32,16,32,32,16,3,1,1
//! cargo bench --bench ops -- --op batch-norm [--shape 32x16x32x32]
//! cargo bench --bench ops -- --op pool [--shape 64x6x28x28]
//! ```
//!
//! `conv2d` times the LeNet-5 and ResNet-20 layer shapes (or the named / given one): the
//! forward, the input gradient alone, the weight (and bias) gradient alone, and both, as in
//! training. `batch-norm` times the ResNet-20 normalisation stages: batch norm in training
//! mode, ReLU, the residual add, the residual join unfused (`add_relu(batch_norm(x), skip)`)
//! and fused (`batch_norm_add_relu`). `pool` times LeNet-5's ReLU and `MaxPool2d(2)`. Every
//! figure is the median (and the minimum) over at least `--min-reps` runs and about
//! `--seconds` seconds, after one untimed run; a backward figure is the time of forward +
//! backward minus that of the forward. All through the public API, f32, with the rayon pool
//! sized per thread count. Unknown flags that `cargo bench` adds (`--bench`) are ignored.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use tandem::autograd::backward;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::ops;

type AnyError = Box<dyn std::error::Error + Send + Sync>;

/// What to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    /// conv2d forward, input gradient, weight gradient.
    Conv2d,
    /// Batch norm and the ResNet-20 residual join.
    BatchNorm,
    /// ReLU and 2×2 max pooling.
    Pool,
}

/// Time the kernels of one op family.
#[derive(Parser, Debug)]
struct Args {
    /// The op family.
    #[arg(long, value_enum)]
    op: Op,
    /// conv2d only: a layer name from the built-in list (a prefix selects all that match,
    /// e.g. `r20`), or a layer as `N,C,H,W,O,k,stride,padding`. Default: every built-in layer.
    #[arg(long)]
    geometry: Option<String>,
    /// batch-norm and pool: one input shape as `NxCxHxW`. Default: the built-in shapes.
    #[arg(long)]
    shape: Option<String>,
    /// Comma-separated rayon thread counts to run at.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    threads: Vec<usize>,
    /// Timed runs per figure, at least.
    #[arg(long, default_value_t = 10)]
    min_reps: usize,
    /// Keep timing a figure up to about this many seconds (and at most 500 runs).
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
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
    if args.threads.is_empty() || args.threads.contains(&0) {
        return Err("--threads needs one or more counts above 0".into());
    }
    let timer = Timer {
        min_reps: args.min_reps.max(1),
        seconds: args.seconds,
    };
    for &threads in &args.threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        pool.install(|| match args.op {
            Op::Conv2d => conv2d(args, &timer, threads),
            Op::BatchNorm => batch_norm(args, &timer, threads),
            Op::Pool => pool_stages(args, &timer, threads),
        })?;
    }
    Ok(())
}

/// Median and minimum of one figure, in milliseconds.
#[derive(Clone, Copy, Debug)]
struct Figure {
    median: f64,
    min: f64,
}

impl Figure {
    /// `self − other`, for a backward timed as forward + backward minus the forward.
    fn minus(self, other: Figure) -> Figure {
        Figure {
            median: self.median - other.median,
            min: self.min - other.min,
        }
    }
}

impl std::fmt::Display for Figure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:7.3} ({:7.3})", self.median, self.min)
    }
}

/// How long a figure is timed.
struct Timer {
    min_reps: usize,
    seconds: f64,
}

impl Timer {
    /// Times `f` after one untimed call: at least `min_reps` runs, and more up to `seconds`
    /// (at most 500).
    fn time(&self, mut f: impl FnMut() -> Result<(), AnyError>) -> Result<Figure, AnyError> {
        f()?;
        let start = Instant::now();
        let mut times = Vec::new();
        while times.len() < self.min_reps
            || (start.elapsed().as_secs_f64() < self.seconds && times.len() < 500)
        {
            let t = Instant::now();
            f()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let n = times.len();
        let median = if n % 2 == 1 {
            times[n / 2]
        } else {
            0.5 * (times[n / 2 - 1] + times[n / 2])
        };
        Ok(Figure {
            median,
            min: times[0],
        })
    }
}

/// A layer of the conv2d table: `(name, N, C, H, W, O, k, stride, padding)`.
type Layer = (String, [usize; 8]);

/// The LeNet-5 and ResNet-20 layer shapes (LeNet at batch 64, ResNet-20 at batch 32).
const LAYERS: [(&str, [usize; 8]); 8] = [
    ("lenet1", [64, 1, 28, 28, 6, 5, 1, 2]),
    ("lenet2", [64, 6, 14, 14, 16, 5, 1, 0]),
    ("r20_3_16", [32, 3, 32, 32, 16, 3, 1, 1]),
    ("r20_16_16", [32, 16, 32, 32, 16, 3, 1, 1]),
    ("r20_16_32s2", [32, 16, 32, 32, 32, 3, 2, 1]),
    ("r20_32_32", [32, 32, 16, 16, 32, 3, 1, 1]),
    ("r20_32_64s2", [32, 32, 16, 16, 64, 3, 2, 1]),
    ("r20_64_64", [32, 64, 8, 8, 64, 3, 1, 1]),
];

/// The layers `--geometry` selects.
fn layers(geometry: Option<&str>) -> Result<Vec<Layer>, AnyError> {
    let Some(g) = geometry else {
        return Ok(LAYERS.iter().map(|(n, l)| (n.to_string(), *l)).collect());
    };
    if g.contains(',') {
        let values: Vec<usize> = g
            .split(',')
            .map(|v| v.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("--geometry {g}: {e} (want N,C,H,W,O,k,stride,padding)"))?;
        let layer: [usize; 8] = values
            .try_into()
            .map_err(|_| format!("--geometry {g}: want 8 numbers N,C,H,W,O,k,stride,padding"))?;
        return Ok(vec![(g.to_string(), layer)]);
    }
    let chosen: Vec<Layer> = LAYERS
        .iter()
        .filter(|(n, _)| n.starts_with(g))
        .map(|(n, l)| (n.to_string(), *l))
        .collect();
    if chosen.is_empty() {
        let names: Vec<&str> = LAYERS.iter().map(|(n, _)| *n).collect();
        return Err(format!("--geometry {g} matches no layer of {names:?}").into());
    }
    Ok(chosen)
}

/// Deterministic f32 values in [−1, 1) of `shape`, optionally a leaf that requires grad.
fn values(shape: &[usize], seed: u64, grad: bool) -> Result<Tensor, AnyError> {
    let t = Tensor::rand(
        shape,
        -1.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )?;
    Ok(if grad { t.with_requires_grad()? } else { t })
}

fn conv2d(args: &Args, timer: &Timer, threads: usize) -> Result<(), AnyError> {
    println!(
        "conv2d, {threads} thread(s): ms median (min) — forward, input gradient, weight+bias \
         gradient, both gradients, forward + both"
    );
    let (mut lenet, mut resnet) = (0.0, 0.0);
    for (name, [n, c, h, w, o, k, s, p]) in layers(args.geometry.as_deref())? {
        let params = ops::Conv2dParams {
            stride: (s, s),
            padding: (p, p),
            dilation: (1, 1),
        };
        let (x, wt, b) = (
            values(&[n, c, h, w], 1, false)?,
            values(&[o, c, k, k], 2, false)?,
            values(&[o], 3, false)?,
        );
        let out = ops::conv2d(&x, &wt, Some(&b), &params)?;
        let gy = values(out.dims(), 4, false)?;
        // Leaves that require grad where a pass needs it (the first layer's input never does).
        let leaf = |t: &Tensor, grad: bool| -> Result<Tensor, AnyError> {
            let d = t.detach();
            Ok(if grad { d.with_requires_grad()? } else { d })
        };
        let pass = |input: bool, weight: bool| -> Result<Figure, AnyError> {
            let (xl, wl, bl) = (leaf(&x, input)?, leaf(&wt, weight)?, leaf(&b, weight)?);
            timer.time(|| {
                let y = ops::conv2d(&xl, &wl, Some(&bl), &params)?;
                if input || weight {
                    backward(&y, Some(&gy), &Default::default())?;
                    for t in [&xl, &wl, &bl] {
                        t.set_grad(None)?;
                    }
                }
                Ok(())
            })
        };
        let forward = pass(false, false)?;
        let dx = pass(true, false)?.minus(forward);
        let dw = pass(false, true)?.minus(forward);
        let all = pass(c > 1, true)?;
        let both = all.minus(forward);
        if name.starts_with("lenet") {
            lenet += all.median;
        } else {
            resnet += all.median;
        }
        println!("T{threads} {name:12} fwd {forward}  dx {dx}  dw {dw}  bwd {both}  total {all}");
    }
    println!("T{threads} total (medians): lenet {lenet:.3} ms, resnet20 {resnet:.3} ms");
    Ok(())
}

/// The shapes `--shape` selects, else `default`.
fn shapes(shape: Option<&str>, default: &[[usize; 4]]) -> Result<Vec<[usize; 4]>, AnyError> {
    let Some(s) = shape else {
        return Ok(default.to_vec());
    };
    let dims: Vec<usize> = s
        .split('x')
        .map(|v| v.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--shape {s}: {e} (want NxCxHxW)"))?;
    let dims: [usize; 4] = dims
        .try_into()
        .map_err(|_| format!("--shape {s}: want four sizes NxCxHxW"))?;
    Ok(vec![dims])
}

/// Times `f` forward, and forward + backward against `grad` (clearing the gradients of
/// `leaves` after each): `(forward, backward)`.
fn stage(
    timer: &Timer,
    leaves: &[&Tensor],
    grad: &Tensor,
    f: &dyn Fn() -> Result<Tensor, AnyError>,
) -> Result<(Figure, Figure), AnyError> {
    let forward = timer.time(|| f().map(drop))?;
    let both = timer.time(|| {
        let y = f()?;
        backward(&y, Some(grad), &Default::default())?;
        for t in leaves {
            t.set_grad(None)?;
        }
        Ok(())
    })?;
    Ok((forward, both.minus(forward)))
}

fn batch_norm(args: &Args, timer: &Timer, threads: usize) -> Result<(), AnyError> {
    let defaults = [[32, 16, 32, 32], [32, 32, 16, 16], [32, 64, 8, 8]];
    println!("batch norm, {threads} thread(s): ms median (min), forward | backward");
    for shape in shapes(args.shape.as_deref(), &defaults)? {
        let c = shape[1];
        let x = values(&shape, 1, true)?;
        let skip = values(&shape, 2, true)?;
        let g = values(&shape, 3, false)?;
        let (rm, rv) = (
            Tensor::zeros(&[c], DType::F32, Device::Cpu)?,
            Tensor::ones(&[c], DType::F32, Device::Cpu)?,
        );
        let w = Tensor::ones(&[c], DType::F32, Device::Cpu)?.with_requires_grad()?;
        let b = Tensor::zeros(&[c], DType::F32, Device::Cpu)?.with_requires_grad()?;
        let leaves = [&x, &skip, &w, &b];
        let bn = || -> Result<Tensor, AnyError> {
            Ok(ops::batch_norm(
                &x,
                Some(&rm),
                Some(&rv),
                Some(&w),
                Some(&b),
                true,
                0.1,
                1e-5,
            )?)
        };
        let (bf, bb) = stage(timer, &leaves, &g, &bn)?;
        let (rf, rb) = stage(timer, &leaves, &g, &|| Ok(ops::relu(&x)?))?;
        let (af, ab) = stage(timer, &leaves, &g, &|| Ok(ops::add(&x, &skip)?))?;
        let (jf, jb) = stage(timer, &leaves, &g, &|| Ok(ops::add_relu(&bn()?, &skip)?))?;
        let fused = || -> Result<Tensor, AnyError> {
            Ok(ops::batch_norm_add_relu(
                &x,
                &skip,
                Some(&rm),
                Some(&rv),
                Some(&w),
                Some(&b),
                true,
                0.1,
                1e-5,
            )?)
        };
        let (ff, fb) = stage(timer, &leaves, &g, &fused)?;
        println!("T{threads} {shape:?}");
        println!("  batch_norm                {bf} | {bb}");
        println!("  relu                      {rf} | {rb}");
        println!("  add                       {af} | {ab}");
        println!("  add_relu(batch_norm)      {jf} | {jb}");
        println!("  batch_norm_add_relu       {ff} | {fb}");
    }
    Ok(())
}

fn pool_stages(args: &Args, timer: &Timer, threads: usize) -> Result<(), AnyError> {
    let defaults = [[64, 6, 28, 28], [64, 16, 10, 10]];
    println!("pool, {threads} thread(s): ms median (min), forward | backward");
    for shape in shapes(args.shape.as_deref(), &defaults)? {
        let x = values(&shape, 1, true)?;
        let r = ops::relu(&x.detach())?.with_requires_grad()?;
        let pooled = [shape[0], shape[1], shape[2] / 2, shape[3] / 2];
        let (g_relu, g_pool) = (values(&shape, 2, false)?, values(&pooled, 3, false)?);
        let (rf, rb) = stage(timer, &[&x], &g_relu, &|| Ok(ops::relu(&x)?))?;
        let (pf, pb) = stage(timer, &[&r], &g_pool, &|| {
            Ok(ops::max_pool2d(&r, (2, 2), (2, 2), (0, 0))?)
        })?;
        println!("T{threads} {shape:?}");
        println!("  relu        {rf} | {rb}");
        println!("  max_pool2d  {pf} | {pb}");
    }
    Ok(())
}
