//! `tandem-project`: projects a data-parallel step onto more devices from per-bucket timings
//! recorded on one device (see [`tandem_dist::projection`]).
//!
//! ```text
//! tandem-project RECORDING.json [--devices 2,8,16,64] [--busbw-gbs B --alpha-us A]
//!     [--bucket-cap-mb C] [--first-bucket-mb F] [--scale-to-step-ms T]
//! ```
//!
//! Without `--busbw-gbs`/`--alpha-us` the links are DGX A100's (NVLink inside a node of 8,
//! InfiniBand across nodes); with them, one link for every device count. Prints, per device
//! count, the step, the communication left exposed after backward, the speed-up over one
//! device (same per-device batch), and the bucket cap that minimises the step.

use std::process::ExitCode;

use tandem_dist::projection::{project, rebucket, LinkModel, LinkPreset, Recording};

const USAGE: &str = "\
usage: tandem-project RECORDING.json [options]

Projects step time, exposed communication and speed-up of DDP onto more devices, from the
per-bucket ready times and sizes in RECORDING.json (written by `cargo bench --bench ddp_step --
--record FILE`), queueing the buckets' ring all-reduces behind backward.

options:
  --devices LIST         device counts to project (default 2,8,16,64)
  --busbw-gbs B          one link for all counts: nccl-tests bus bandwidth in GB/s …
  --alpha-us A           … and latency per ring step in µs (default: DGX A100 presets:
                         NVLink 230 GB/s, 1.5 µs up to 8 GPUs; InfiniBand 185 GB/s, 5 µs beyond)
  --bucket-cap-mb C      merge the recorded buckets into buckets of C MiB first
  --first-bucket-mb F    first bucket's cap when merging (default 1)
  --scale-to-step-ms T   scale every recorded time so that one device's step takes T ms
                         (to stand in for a faster device with the same proportions)
";

/// Caps tried when looking for the best bucket size, MiB.
const CAPS_MIB: [f64; 12] = [
    0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 32.0, 64.0, 128.0, 256.0,
];

struct Options {
    recording: String,
    devices: Vec<usize>,
    link: Option<LinkModel>,
    bucket_cap_mb: Option<f64>,
    first_bucket_mb: f64,
    scale_to_step_ms: Option<f64>,
}

fn parse(args: &[String]) -> Result<Option<Options>, String> {
    let mut recording = None;
    let mut devices = vec![2, 8, 16, 64];
    let (mut busbw, mut alpha) = (None, None);
    let mut bucket_cap_mb = None;
    let mut first_bucket_mb = 1.0;
    let mut scale_to_step_ms = None;
    let mut it = args.iter();
    let number = |flag: &str, v: Option<&String>| -> Result<f64, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(format!("{flag} {v}: expected a positive number")),
        }
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--devices" => {
                let v = it.next().ok_or("--devices needs a value")?;
                devices = v
                    .split(',')
                    .map(|d| match d.trim().parse::<usize>() {
                        Ok(n) if (1..=1_000_000).contains(&n) => Ok(n),
                        _ => Err(format!("--devices {v}: `{d}` is not a device count")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--busbw-gbs" => busbw = Some(number(arg, it.next())?),
            "--alpha-us" => {
                let v = it.next().ok_or("--alpha-us needs a value")?;
                alpha = match v.parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= 0.0 => Some(x),
                    _ => return Err(format!("--alpha-us {v}: expected a number ≥ 0")),
                };
            }
            "--bucket-cap-mb" => bucket_cap_mb = Some(number(arg, it.next())?),
            "--first-bucket-mb" => first_bucket_mb = number(arg, it.next())?,
            "--scale-to-step-ms" => scale_to_step_ms = Some(number(arg, it.next())?),
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            path if recording.is_none() => recording = Some(path.to_string()),
            extra => return Err(format!("unexpected argument {extra}")),
        }
    }
    let link = match (busbw, alpha) {
        (Some(b), Some(a)) => Some(LinkModel::new(b, a)),
        (None, None) => None,
        _ => return Err("--busbw-gbs and --alpha-us go together".into()),
    };
    let recording = recording.ok_or("missing RECORDING.json")?;
    Ok(Some(Options {
        recording,
        devices,
        link,
        bucket_cap_mb,
        first_bucket_mb,
        scale_to_step_ms,
    }))
}

fn run(opts: &Options) -> Result<(), String> {
    let text = std::fs::read_to_string(&opts.recording)
        .map_err(|e| format!("reading {}: {e}", opts.recording))?;
    let mut recording: Recording = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a recording: {e}", opts.recording))?;
    recording
        .validate()
        .map_err(|e| format!("{}: {e}", opts.recording))?;
    if let Some(target) = opts.scale_to_step_ms {
        let compute = recording.compute_ms();
        if compute <= 0.0 {
            return Err(format!(
                "{}: the recorded step takes no time",
                opts.recording
            ));
        }
        recording = recording.scaled(target / compute);
    }
    let mib = |m: f64| (m * 1048576.0) as u64;
    if let Some(cap) = opts.bucket_cap_mb {
        recording = rebucket(&recording, mib(opts.first_bucket_mb.min(cap)), mib(cap));
    }
    println!(
        "recording: {} on {}, batch {} per device: forward {:.2} + backward {:.2} + optimizer {:.2} = {:.2} ms; {:.2} MiB of gradients in {} buckets{}",
        recording.model,
        recording.device,
        recording.batch_size,
        recording.forward_ms,
        recording.backward_ms,
        recording.optimizer_ms,
        recording.compute_ms(),
        recording.total_bytes() as f64 / 1048576.0,
        recording.buckets.len(),
        opts.scale_to_step_ms
            .map(|t| format!(" (scaled to a {t} ms step)"))
            .unwrap_or_default()
    );
    if !recording.note.is_empty() {
        println!("note: {}", recording.note);
    }
    let link_for = |p: usize| match opts.link {
        Some(link) => link,
        None => LinkPreset::DgxA100.link_for(p),
    };
    let projection = project(
        &recording,
        &opts.devices,
        &link_for,
        &CAPS_MIB,
        opts.first_bucket_mb,
    );
    println!(
        "{:>5}  {:<28} {:>10} {:>11} {:>9} {:>8}   {:>9} {:>10} {:>8}",
        "GPUs",
        "link",
        "step ms",
        "exposed ms",
        "comm ms",
        "speed-up",
        "best cap",
        "step ms",
        "speed-up"
    );
    for row in &projection.rows {
        println!(
            "{:>5}  {:<28} {:>10.2} {:>11.2} {:>9.2} {:>7.2}×   {:>5} MiB {:>10.2} {:>7.2}×",
            row.step.devices,
            row.link.to_string(),
            row.step.step_ms,
            row.step.exposed_ms,
            row.step.comm_ms,
            row.step.speedup,
            row.best_cap_mib,
            row.best.step_ms,
            row.best.speedup
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args) {
        Ok(None) => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Some(opts)) => match run(&opts) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tandem-project: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("tandem-project: {e}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
