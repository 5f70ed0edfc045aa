//! All-reduce bandwidth and latency of tandem's TCP process group, side by side with
//! torch.distributed's gloo backend when PyTorch is installed.
//!
//! ```text
//! cargo bench --bench allreduce -- --nproc 2 [--peer-python python3] [--json FILE]
//!     [--min-bytes 4096] [--max-bytes 67108864] [--iters 30] [--no-gloo] [--no-tcp-ring]
//!     [--peer-script PATH] [--require-peer]
//! ```
//!
//! For f32 all-reduces (sum) of 4 KiB … 64 MiB (powers of 4), the bench starts `--nproc` local
//! worker processes through tandem's launcher (it re-executes itself with `--worker`), each
//! rank joins the TCP group over loopback, and rank 0 times every repetition. It runs tandem
//! twice: with the default configuration (large messages use same-host copies, since all ranks
//! share this host) and with `same_host_copy` off, i.e. the pipelined TCP ring that ranks on
//! different hosts use (`--no-tcp-ring` skips that run). The gloo side runs
//! `benches/peers/allreduce_gloo.py` as the same number of processes with the same protocol:
//! per size, 3 untimed warm-up repetitions, then up to `--iters` timed ones (at least 3, at most
//! about 2 s per size), each preceded by a one-element broadcast from rank 0 that keeps the
//! ranks in step and tells them whether to go on. The table reports the median time, the
//! algorithm bandwidth (bytes / time) and the bus bandwidth (algbw · 2(N−1)/N, what each rank's
//! link carries in a bandwidth-optimal all-reduce), and gloo's time over tandem's. The gloo
//! script is `--peer-script`, else found at run time (`$TANDEM_PEERS_DIR`, else `benches/peers/`
//! above the current folder or the executable's); with `--require-peer` (or
//! `TANDEM_REQUIRE_PEER=1`) a gloo side that gave no results fails the benchmark.
//!
//! `--json FILE` writes the rows as
//! `[{"bytes", "tandem_us", "tandem_busbw_gbps", "gloo_us", "gloo_busbw_gbps",
//! "tandem_tcp_ring_us", "tandem_tcp_ring_busbw_gbps"}, …]` (gloo fields `null` when PyTorch is
//! not importable or `--no-gloo` is given; ring fields `null` with `--no-tcp-ring`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem::locate::{Shipped, PEERS_DIR_VAR};
use tandem_core::{DType, Device, Tensor};
use tandem_dist::launch::{launch, LaunchOptions};
use tandem_dist::{init_from_env_with, GroupConfig, ReduceOp};

// Only `required` and `missing_error` are used here.
#[allow(dead_code)]
#[path = "common/peer.rs"]
mod peer;

/// Settings shared by the coordinator and its workers.
struct Settings {
    nproc: usize,
    python: String,
    json: Option<PathBuf>,
    min_bytes: usize,
    max_bytes: usize,
    iters: usize,
    gloo: bool,
    /// `--peer-script`; without it the script is found at run time (`tandem::locate`).
    peer_script: Option<PathBuf>,
    require_peer: bool,
    worker_out: Option<PathBuf>,
    tcp_only: bool,
    compare_tcp: bool,
}

const WARMUP: usize = 3;
const SECONDS_PER_SIZE: f64 = 2.0;

fn usage() -> ! {
    eprintln!(
        "usage: cargo bench --bench allreduce -- [--nproc N] [--peer-python PY] [--json FILE] \
         [--min-bytes B] [--max-bytes B] [--iters K] [--no-gloo] [--no-tcp-ring] \
         [--peer-script PATH] [--require-peer]"
    );
    std::process::exit(2);
}

fn parse_args() -> (Settings, bool) {
    let mut s = Settings {
        nproc: 2,
        python: "python3".into(),
        json: None,
        min_bytes: 4 << 10,
        max_bytes: 64 << 20,
        iters: 30,
        gloo: true,
        peer_script: None,
        require_peer: false,
        worker_out: None,
        tcp_only: false,
        compare_tcp: true,
    };
    let mut worker = false;
    let mut args = std::env::args().skip(1);
    let num =
        |v: Option<String>| -> usize { v.and_then(|v| v.parse().ok()).unwrap_or_else(|| usage()) };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--nproc" => s.nproc = num(args.next()),
            "--peer-python" => s.python = args.next().unwrap_or_else(|| usage()),
            "--json" => s.json = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--min-bytes" => s.min_bytes = num(args.next()),
            "--max-bytes" => s.max_bytes = num(args.next()),
            "--iters" => s.iters = num(args.next()).max(3),
            "--no-gloo" => s.gloo = false,
            "--peer-script" => s.peer_script = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--require-peer" => s.require_peer = true,
            "--worker" => worker = true,
            "--tcp-only" => s.tcp_only = true,
            "--no-tcp-ring" => s.compare_tcp = false,
            "--out" => s.worker_out = Some(args.next().unwrap_or_else(|| usage()).into()),
            "-h" | "--help" => usage(),
            _ => {} // filters and flags that libtest-style runners pass
        }
    }
    if s.nproc < 1 || s.min_bytes < 4 || s.min_bytes > s.max_bytes {
        usage();
    }
    (s, worker)
}

fn sizes(s: &Settings) -> Vec<usize> {
    let mut v = Vec::new();
    let mut b = s.min_bytes;
    while b <= s.max_bytes {
        v.push(b);
        b *= 4;
    }
    v
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One rank of the tandem side (runs under the launcher's environment).
fn worker(s: &Settings) -> Result<(), Box<dyn std::error::Error>> {
    let config = GroupConfig {
        same_host_copy: !s.tcp_only,
        ..GroupConfig::default()
    };
    let pg = init_from_env_with(config)?;
    let go = Tensor::zeros(&[1], DType::F32, Device::Cpu)?;
    let mut lines = String::new();
    for bytes in sizes(s) {
        let t = Tensor::ones(&[bytes / 4], DType::F32, Device::Cpu)?;
        for _ in 0..WARMUP {
            pg.all_reduce(&t, ReduceOp::Sum)?.wait()?;
        }
        let mut times = Vec::new();
        let started = Instant::now();
        for i in 0..s.iters {
            // Rank 0 decides whether to go on, so every rank runs the same repetitions.
            let more = i < 3 || started.elapsed().as_secs_f64() < SECONDS_PER_SIZE;
            go.fill_(if more { 1.0 } else { 0.0 })?;
            pg.broadcast(&go, 0)?.wait()?;
            if go.item()? == 0.0 {
                break;
            }
            let t0 = Instant::now();
            pg.all_reduce(&t, ReduceOp::Sum)?.wait()?;
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        if pg.rank() == 0 {
            let list: Vec<String> = times.iter().map(|t| format!("{t:.1}")).collect();
            lines.push_str(&format!(
                "{{\"bytes\": {bytes}, \"median_us\": {:.2}, \"times_us\": [{}]}}\n",
                median(&mut times.clone()),
                list.join(", ")
            ));
        }
    }
    pg.barrier()?.wait()?;
    if let (0, Some(out)) = (pg.rank(), &s.worker_out) {
        std::fs::write(out, lines)?;
    }
    Ok(())
}

/// Median microseconds per size from a results file (one JSON object per line).
fn read_results(path: &Path) -> BTreeMap<usize, (f64, Vec<f64>)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let times = v["times_us"]
                .as_array()?
                .iter()
                .filter_map(|t| t.as_f64())
                .collect();
            Some((
                v["bytes"].as_u64()? as usize,
                (v["median_us"].as_f64()?, times),
            ))
        })
        .collect()
}

fn torch_available(python: &str) -> bool {
    Command::new(python)
        .args(["-c", "import torch, torch.distributed"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run_side(label: &str, mut opts: LaunchOptions, out: &Path) -> BTreeMap<usize, (f64, Vec<f64>)> {
    let _ = std::fs::remove_file(out);
    opts.kill_grace = Duration::from_secs(2);
    match launch(&opts) {
        Ok(report) if report.success() => {}
        Ok(report) => eprintln!(
            "{label}: a rank failed: {:?}",
            report.failed.map(|f| (f.rank, f.describe()))
        ),
        Err(e) => eprintln!("{label}: {e}"),
    }
    read_results(out)
}

type Results = BTreeMap<usize, (f64, Vec<f64>)>;

/// Runs the tandem side with `extra` worker flags; returns rank 0's results.
fn run_tandem(s: &Settings, label: &str, extra: &[&str]) -> Results {
    let out = std::env::temp_dir().join(format!(
        "tandem-allreduce-{}-{label}.jsonl",
        std::process::id()
    ));
    let exe = std::env::current_exe().expect("bench executable");
    let mut args: Vec<OsString> = vec![
        "--worker".into(),
        "--iters".into(),
        s.iters.to_string().into(),
    ];
    for (flag, v) in [("--min-bytes", s.min_bytes), ("--max-bytes", s.max_bytes)] {
        args.push(flag.into());
        args.push(v.to_string().into());
    }
    args.extend(extra.iter().map(OsString::from));
    args.push("--out".into());
    args.push(out.clone().into());
    let results = run_side(label, LaunchOptions::new(s.nproc, exe, args), &out);
    let _ = std::fs::remove_file(&out);
    results
}

/// Runs the gloo side, if its script is found and PyTorch can be imported.
fn run_gloo(s: &Settings, sizes: &[usize]) -> Results {
    if !s.gloo {
        return BTreeMap::new();
    }
    let script = Shipped {
        what: "the gloo peer script",
        folder: "benches/peers",
        name: "allreduce_gloo.py",
        env_var: PEERS_DIR_VAR,
        flag: Some("--peer-script"),
    }
    .locate(s.peer_script.as_deref());
    let script = match script {
        Ok(script) => script,
        Err(e) => {
            eprintln!("gloo: not run: {e}");
            return BTreeMap::new();
        }
    };
    if !torch_available(&s.python) {
        eprintln!("gloo: not run: {} cannot import torch", s.python);
        return BTreeMap::new();
    }
    eprintln!(
        "gloo: {} processes, torch.distributed gloo backend",
        s.nproc
    );
    let out = std::env::temp_dir().join(format!("gloo-allreduce-{}.jsonl", std::process::id()));
    let size_list: Vec<String> = sizes.iter().map(|b| b.to_string()).collect();
    let mut args: Vec<OsString> = vec![script.into()];
    for (flag, v) in [
        ("--sizes", size_list.join(",")),
        ("--iters", s.iters.to_string()),
        ("--warmup", WARMUP.to_string()),
        ("--max-seconds", SECONDS_PER_SIZE.to_string()),
    ] {
        args.push(flag.into());
        args.push(v.into());
    }
    args.push("--out".into());
    args.push(out.clone().into());
    let mut opts = LaunchOptions::new(s.nproc, &s.python, args);
    opts.serve_store = false; // torch's rank 0 serves its own TCPStore on MASTER_PORT
    let results = run_side("gloo", opts, &out);
    let _ = std::fs::remove_file(&out);
    results
}

fn main() {
    let (s, is_worker) = parse_args();
    if is_worker {
        if let Err(e) = worker(&s) {
            eprintln!("allreduce worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    let n = s.nproc;
    let sizes = sizes(&s);
    eprintln!("tandem: {n} processes, TCP group (same-host copies on, as by default)");
    let tandem = run_tandem(&s, "default", &[]);
    let ring = if s.compare_tcp {
        eprintln!("tandem: {n} processes, TCP group with same-host copies off (TCP ring only)");
        run_tandem(&s, "tcp-ring", &["--tcp-only"])
    } else {
        BTreeMap::new()
    };
    let gloo = run_gloo(&s, &sizes);

    let bus = 2.0 * (n as f64 - 1.0) / n as f64;
    let gbps = |bytes: usize, us: f64| bytes as f64 / (us * 1e-6) / 1e9;
    let cell =
        |r: &Results, bytes: usize| r.get(&bytes).map(|(us, _)| (*us, gbps(bytes, *us) * bus));
    let show = |c: Option<(f64, f64)>| match c {
        Some((us, bw)) => format!("{us:>11.1} {bw:>7.3}"),
        None => format!("{:>11} {:>7}", "-", "-"),
    };
    println!();
    println!(
        "f32 all_reduce(sum), {n} processes on this host; median µs and busbw (GB/s) per size"
    );
    println!(
        "{:>10} | {:>19} | {:>19} | {:>19} | {:>11}",
        "bytes", "tandem", "tandem TCP ring", "gloo", "gloo/tandem"
    );
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let t = cell(&tandem, bytes);
        let r = cell(&ring, bytes);
        let g = cell(&gloo, bytes);
        let ratio = match (t, g) {
            (Some(t), Some(g)) => format!("{:.2}×", g.0 / t.0),
            _ => "-".into(),
        };
        println!(
            "{bytes:>10} | {} | {} | {} | {ratio:>11}",
            show(t),
            show(r),
            show(g)
        );
        rows.push(serde_json::json!({
            "bytes": bytes,
            "tandem_us": t.map(|t| t.0),
            "tandem_busbw_gbps": t.map(|t| t.1),
            "gloo_us": g.map(|g| g.0),
            "gloo_busbw_gbps": g.map(|g| g.1),
            "tandem_tcp_ring_us": r.map(|r| r.0),
            "tandem_tcp_ring_busbw_gbps": r.map(|r| r.1),
        }));
    }
    println!(
        "(busbw = algbw · 2(N−1)/N; \"tandem\" uses same-host copies when all ranks share a host)"
    );
    if let Some(path) = &s.json {
        let text = serde_json::to_string_pretty(&rows).expect("json");
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("cannot write {}: {e}", path.display());
        }
    }
    if s.gloo && gloo.is_empty() && peer::required(s.require_peer) {
        eprintln!(
            "error: {}",
            peer::missing_error("gloo gave no results (see above)")
        );
        std::process::exit(1);
    }
}
