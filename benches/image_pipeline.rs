//! Input-pipeline benchmark: decode + `RandomResizedCrop(224)` + horizontal flip + to-tensor
//! (u8 CHW batches of 64) on a folder of ImageNet-sized JPEGs, tandem's `ImageFolder` +
//! `DataLoader` against torchvision's `ImageFolder` + `DataLoader`, per number of workers.
//!
//! ```text
//! cargo bench --bench image_pipeline                       # workers 1 and 2
//! cargo bench --bench image_pipeline -- --workers 1,2,4 --runs 7 --json image_pipeline.json
//! ```
//!
//! **The folder** (500 JPEGs, 500×375 or 375×500, quality 90, in 4 class folders) is built once
//! by `benches/peers/image_pipeline_torchvision.py make-folder` with PIL from the 20 ImageNet
//! photographs in PyPI's `foolbox` wheel (downloaded once with pip), each cropped and resized
//! differently, and kept in `target/<profile>/image_pipeline/` (`--folder DIR` names another;
//! any ImageFolder tree works there).
//!
//! **Timing.** For each worker count, tandem runs in a child process of its own (so its peak
//! memory is the run's alone): one untimed epoch, then `--runs` timed epochs, each a full pass
//! over the shuffled folder, and the median images/s. The two sides take turns `--rounds`
//! times (3), so that a change in the machine's load falls on both; each side's figure is the
//! median of its rounds' medians. `--workers` is the number of decoding threads of
//! `ImageFolder`. The peer does the same with torchvision
//! (`num_workers` worker processes, persistent; `PILToTensor()`, which yields the same u8
//! tensors; `ToTensor()`'s f32 figure is printed beside it). Peak memory: tandem's is the child
//! process's peak RSS (VmHWM); torchvision's is the peak, sampled every 50 ms, of the main
//! process and its workers together, as PSS (shared pages counted once; RSS summed over the
//! processes is reported too). The peer is found as the other benchmarks' are; a peer that did
//! not run is a "torchvision: not run: why" line, and with `--require-peer` (or
//! `TANDEM_REQUIRE_PEER=1`) a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tandem::nn::data::image::folder::{ImageFolder, ImageFolderConfig};
use tandem::nn::data::image::transforms::ImageTransform;
use tandem::nn::data::{DataLoader, DataLoaderConfig};

type AnyError = Box<dyn std::error::Error>;

#[path = "common/peer.rs"]
mod peer;

/// The peer script, also the maker of the folder.
const PEER: &str = "image_pipeline_torchvision.py";
/// Set in the environment of the child that times tandem: its number of workers.
const CHILD_VAR: &str = "TANDEM_IMAGE_PIPELINE_WORKERS";

/// Time tandem's and torchvision's image input pipelines.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Worker counts to time, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<usize>,
    /// Images per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Timed epochs per side and worker count (after one untimed epoch).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Times each side runs, in turn, per worker count.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Images in the folder the benchmark builds.
    #[arg(long, default_value_t = 500)]
    images: usize,
    /// An ImageFolder tree to read instead of the benchmark's own.
    #[arg(long)]
    folder: Option<PathBuf>,
    /// Seed of the shuffling and the crops.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Python interpreter for the torchvision side (and to build the folder).
    #[arg(long, default_value = "python3")]
    peer_python: String,
    /// Skip the torchvision side.
    #[arg(long)]
    no_peer: bool,
    /// Fail when the torchvision side did not run (also with TANDEM_REQUIRE_PEER=1).
    #[arg(long)]
    require_peer: bool,
    /// Also write the results as JSON (one row per worker count) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Benchmark-name filters passed by `cargo bench` (ignored).
    #[arg(hide = true)]
    filters: Vec<String>,
}

/// One side's figures for one worker count.
struct Side {
    images_per_s: f64,
    peak_mib: Option<f64>,
}

/// torchvision's figures.
struct Peer {
    side: Side,
    rss_sum_mib: Option<f64>,
    to_tensor_images_per_s: Option<f64>,
    version: String,
}

fn main() -> ExitCode {
    // `cargo bench` appends `--bench` to the arguments of harness = false benchmarks.
    let args = Args::parse_from(std::env::args().filter(|a| a != "--bench"));
    let result = match std::env::var(CHILD_VAR) {
        Ok(workers) => child(&args, &workers),
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

fn run(args: &Args) -> Result<(), AnyError> {
    if args.runs == 0 || args.rounds == 0 || args.batch_size == 0 || args.workers.contains(&0) {
        return Err("--runs, --rounds, --batch-size and every --workers must be > 0".into());
    }
    let folder = match &args.folder {
        Some(folder) => folder.clone(),
        None => build_folder(args)?,
    };
    println!(
        "image_pipeline: {} ({} images), decode + RandomResizedCrop(224) + flip + to u8 tensor, \
         batch {}, {} rounds a side of {} epochs after 1 untimed (median of the rounds' medians)",
        folder.display(),
        count_images(&folder),
        args.batch_size,
        args.rounds,
        args.runs
    );
    println!(
        "{:>7} {:>14} {:>14} {:>7} {:>12} {:>12} {:>12} {:>14}",
        "workers",
        "tandem img/s",
        "torchvision",
        "ratio",
        "tandem MiB",
        "tv PSS MiB",
        "tv RSS sum",
        "tv ToTensor"
    );
    let mut rows = Vec::new();
    let mut missing = None;
    for &workers in &args.workers {
        let (tandem, peer) = time_rounds(args, &folder, workers)?;
        print_row(workers, &tandem, peer.as_ref().ok());
        if let Err(why) = &peer {
            println!("torchvision: not run: {why}");
            missing.get_or_insert(why.clone());
        }
        rows.push(json_row(workers, &tandem, peer.as_ref().ok()));
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&serde_json::Value::Array(rows))? + "\n";
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    match missing {
        Some(why) if !args.no_peer && peer::required(args.require_peer) => {
            Err(peer::missing_error(&why).into())
        }
        _ => Ok(()),
    }
}

/// Both sides with `workers` workers, `--rounds` times in turn (tandem, torchvision, tandem, …)
/// so that a change in the machine's load during the run falls on both: each side's figure is
/// the median of its rounds' medians, its peak memory the largest of its rounds'.
fn time_rounds(
    args: &Args,
    folder: &Path,
    workers: usize,
) -> Result<(Side, Result<Peer, String>), AnyError> {
    let mut tandem = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..args.rounds {
        tandem.push(time_tandem_in_child(args, folder, workers)?);
        if !args.no_peer {
            peers.push(time_peer(args, folder, workers));
        }
    }
    let max = |values: Vec<Option<f64>>| values.into_iter().flatten().reduce(f64::max);
    let combined = Side {
        images_per_s: median(tandem.iter().map(|s| s.images_per_s).collect()),
        peak_mib: max(tandem.iter().map(|s| s.peak_mib).collect()),
    };
    if args.no_peer {
        return Ok((combined, Err("skipped (--no-peer)".to_string())));
    }
    let peers = match peers.into_iter().collect::<Result<Vec<Peer>, String>>() {
        Ok(peers) => peers,
        Err(why) => return Ok((combined, Err(why))),
    };
    let peer = Peer {
        side: Side {
            images_per_s: median(peers.iter().map(|p| p.side.images_per_s).collect()),
            peak_mib: max(peers.iter().map(|p| p.side.peak_mib).collect()),
        },
        rss_sum_mib: max(peers.iter().map(|p| p.rss_sum_mib).collect()),
        to_tensor_images_per_s: peers
            .iter()
            .map(|p| p.to_tensor_images_per_s)
            .collect::<Option<Vec<f64>>>()
            .map(median),
        version: peers.last().map_or_else(String::new, |p| p.version.clone()),
    };
    Ok((combined, Ok(peer)))
}

/// Prints one worker count's line of the table.
fn print_row(workers: usize, tandem: &Side, peer: Option<&Peer>) {
    let or_dash = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };
    println!(
        "{:>7} {:>14.0} {:>14} {:>7} {:>12} {:>12} {:>12} {:>14}",
        workers,
        tandem.images_per_s,
        or_dash(peer.map(|p| p.side.images_per_s), 0),
        or_dash(peer.map(|p| tandem.images_per_s / p.side.images_per_s), 2),
        or_dash(tandem.peak_mib, 0),
        or_dash(peer.and_then(|p| p.side.peak_mib), 0),
        or_dash(peer.and_then(|p| p.rss_sum_mib), 0),
        or_dash(peer.and_then(|p| p.to_tensor_images_per_s), 0),
    );
}

/// One worker count's row of `--json`.
fn json_row(workers: usize, tandem: &Side, peer: Option<&Peer>) -> serde_json::Value {
    serde_json::json!({
        "workers": workers,
        "tandem_images_per_s": tandem.images_per_s,
        "torchvision_images_per_s": peer.map(|p| p.side.images_per_s),
        "ratio": peer.map(|p| tandem.images_per_s / p.side.images_per_s),
        "tandem_peak_rss_mib": tandem.peak_mib,
        "torchvision_peak_pss_mib": peer.and_then(|p| p.side.peak_mib),
        "torchvision_peak_rss_sum_mib": peer.and_then(|p| p.rss_sum_mib),
        "torchvision_to_tensor_f32_images_per_s": peer.and_then(|p| p.to_tensor_images_per_s),
        "torchvision_version": peer.map(|p| p.version.clone()),
    })
}

/// The benchmark's folder in `target/<profile>/image_pipeline/`, built by the peer script
/// unless a complete one is there.
fn build_folder(args: &Args) -> Result<PathBuf, AnyError> {
    let exe = std::env::current_exe()?;
    // The bench binary is target/<profile>/deps/image_pipeline-<hash>.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("cannot find the target folder above the benchmark's executable")?;
    let base = profile_dir.join("image_pipeline");
    let folder = base.join(format!("folder-{}", args.images));
    if base
        .join(format!("folder-{}.complete", args.images))
        .is_file()
    {
        return Ok(folder);
    }
    let script = peer::script(PEER)?;
    peer::probe(
        &args.peer_python,
        "import PIL",
        "import PIL (pip install pillow) to build the benchmark's folder",
    )?;
    println!("building {} from foolbox's photographs …", folder.display());
    let status = Command::new(&args.peer_python)
        .arg(script)
        .args(["make-folder", "--count", &args.images.to_string()])
        .arg("--out")
        .arg(&folder)
        .arg("--cache")
        .arg(base.join("cache"))
        .status()?;
    if !status.success() {
        return Err(format!("building the folder failed ({status}); or pass --folder DIR").into());
    }
    Ok(folder)
}

/// Number of files below the class folders of `root` (0 if unreadable).
fn count_images(root: &Path) -> usize {
    let Ok(classes) = std::fs::read_dir(root) else {
        return 0;
    };
    classes
        .flatten()
        .filter_map(|c| std::fs::read_dir(c.path()).ok())
        .map(|files| files.count())
        .sum()
}

/// Runs this benchmark again as the child that times tandem with `workers` workers.
fn time_tandem_in_child(args: &Args, folder: &Path, workers: usize) -> Result<Side, AnyError> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .env(CHILD_VAR, workers.to_string())
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--runs", &args.runs.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .arg("--folder")
        .arg(folder);
    let value = peer::run_json(command)?;
    Ok(Side {
        images_per_s: peer::field(&value, "images_per_s")?,
        peak_mib: value["peak_rss_mib"].as_f64(),
    })
}

/// The child: times tandem's pipeline with the workers in `CHILD_VAR` and prints one JSON line.
fn child(args: &Args, workers: &str) -> Result<(), AnyError> {
    let workers: usize = workers.parse()?;
    let folder = args.folder.as_ref().ok_or("the child needs --folder")?;
    let transform = ImageTransform::imagenet_train(224)?;
    let set = Arc::new(ImageFolder::new(
        folder,
        ImageFolderConfig::new(transform)
            .with_workers(workers)
            .with_seed(args.seed),
    )?);
    let loader = DataLoader::new(
        set.clone(),
        DataLoaderConfig {
            batch_size: args.batch_size,
            shuffle: true,
            seed: args.seed,
            ..Default::default()
        },
    )?;
    let mut rates = Vec::with_capacity(args.runs);
    for epoch in 0..=args.runs as u64 {
        set.set_epoch(epoch);
        let started = Instant::now();
        let mut images = 0;
        for batch in loader.epoch(epoch) {
            images += batch?.targets.numel();
        }
        // The first epoch is untimed, as the peer's (which starts its workers in it).
        if epoch > 0 {
            rates.push(images as f64 / started.elapsed().as_secs_f64());
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "images_per_s": median(rates),
            "peak_rss_mib": peak_rss_mib(),
        })
    );
    Ok(())
}

/// Runs the torchvision peer with `workers` worker processes; `Err` says why it could not.
fn time_peer(args: &Args, folder: &Path, workers: usize) -> Result<Peer, String> {
    let script = peer::script(PEER)?;
    peer::probe(
        &args.peer_python,
        "import torch, torchvision, PIL",
        "import torch, torchvision and PIL",
    )?;
    let mut command = Command::new(&args.peer_python);
    command
        .arg(script)
        .arg("time")
        .arg("--root")
        .arg(folder)
        .args(["--workers", &workers.to_string()])
        .args(["--batch-size", &args.batch_size.to_string()])
        .args(["--runs", &args.runs.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .arg("--to-tensor");
    let value = peer::run_json(command)?;
    Ok(Peer {
        side: Side {
            images_per_s: peer::field(&value, "images_per_s")?,
            peak_mib: value["peak_pss_mib"].as_f64(),
        },
        rss_sum_mib: value["peak_rss_sum_mib"].as_f64(),
        to_tensor_images_per_s: value["to_tensor_f32_images_per_s"].as_f64(),
        version: format!(
            "torch {}, torchvision {}",
            value["torch_version"].as_str().unwrap_or("?"),
            value["torchvision_version"].as_str().unwrap_or("?")
        ),
    })
}

/// The median of a non-empty sample (0 for an empty one).
fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    }
}

/// This process's peak resident set size (VmHWM), on Linux.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
