//! Helpers for tests that run ranks as real processes: the test binary re-executes itself as a
//! worker (selected by an environment variable) and the test hosts the rendezvous store.

#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_core::{DType, Device, Tensor};
use tandem_dist::auth::SECRET_VAR;
use tandem_dist::rendezvous::STORE_HOSTED_VAR;
use tandem_dist::{
    init_process_group, GroupConfig, JobSecret, LaunchEnv, ProcessGroup, ReduceOp, StoreConfig,
    StoreServer,
};

/// Selects the worker mode of a re-executed test binary.
pub const WORKER_VAR: &str = "TANDEM_DIST_TEST_WORKER";

/// Arguments that make a re-executed test binary run only the `worker` test.
pub fn worker_args() -> Vec<String> {
    ["worker", "--exact", "--nocapture", "--test-threads", "1"]
        .map(String::from)
        .to_vec()
}

/// The body of each test binary's `worker` test: does nothing in a normal test run; in a
/// re-executed worker, runs the mode and exits with its status.
pub fn worker_main() {
    let Ok(mode) = std::env::var(WORKER_VAR) else {
        return;
    };
    let code = match run_worker(&mode) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn run_worker(mode: &str) -> Result<(), String> {
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let config = match mode {
        // The TCP ring in many chunks (same-host copies off).
        "conformance-small-chunks" => GroupConfig {
            small_message_bytes: 1 << 10,
            chunk_bytes: 4 << 10,
            same_host_copy: false,
            ..GroupConfig::default()
        },
        "kill-ring" => GroupConfig {
            timeout: Duration::from_secs(60),
            same_host_copy: false,
            ..GroupConfig::default()
        },
        // Rendezvous diagnostics: short waits, frequent progress lines.
        "rendezvous" => GroupConfig {
            connect_timeout: Duration::from_secs(4),
            wait_log_interval: Duration::from_millis(500),
            ..GroupConfig::default()
        },
        // A rank that stops, or skips a collective: the others give up quickly.
        "stall" | "skip" => GroupConfig {
            timeout: Duration::from_secs(3),
            ..GroupConfig::default()
        },
        // As "stall", but rank 0 waits longer than the others: it learns of the failure from
        // a peer's abort instead of timing out itself, and exits at once.
        "stall-staggered" => GroupConfig {
            timeout: Duration::from_secs(if env.rank == 0 { 20 } else { 3 }),
            ..GroupConfig::default()
        },
        // The last rank stops before it joins: the others give up setting up quickly.
        "stall-setup" => {
            if env.rank == env.world_size - 1 {
                // SAFETY: raise(2) has no memory-safety preconditions; the process stops here
                // until the launcher kills it.
                unsafe {
                    libc::raise(libc::SIGSTOP);
                }
            }
            GroupConfig {
                connect_timeout: Duration::from_secs(3),
                ..GroupConfig::default()
            }
        }
        _ => GroupConfig {
            timeout: Duration::from_secs(60),
            ..GroupConfig::default()
        },
    };
    let pg = init_process_group(&env, config).map_err(|e| e.to_string())?;
    let rank = pg.rank();
    match mode {
        "conformance" | "conformance-small-chunks" => {
            tandem_dist::testing::conformance(&pg, 99, &[0, 1, 5, 1001, 20_003])?;
            println!("rank {rank} conformance ok");
            Ok(())
        }
        "sum" => {
            let t = Tensor::full(&[1000], rank as f64, DType::F32, Device::Cpu)
                .map_err(|e| e.to_string())?;
            pg.all_reduce(&t, ReduceOp::Sum)
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())?;
            let world = pg.world_size();
            let want = (world * (world - 1) / 2) as f32;
            let got = t.to_vec::<f32>().map_err(|e| e.to_string())?;
            if got.iter().any(|&x| x != want) {
                return Err(format!("sum {} != {want}", got[0]));
            }
            println!("all_reduce ok: sum of ranks = {want}");
            Ok(())
        }
        "kill" | "kill-ring" => {
            let t = Tensor::ones(&[1 << 20], DType::F32, Device::Cpu).map_err(|e| e.to_string())?;
            for i in 0.. {
                pg.all_reduce(&t, ReduceOp::Avg)
                    .and_then(|w| w.wait())
                    .map_err(|e| e.to_string())?;
                if i == 2 {
                    println!("ready");
                }
            }
            Ok(())
        }
        "rendezvous" | "stall-setup" => {
            pg.barrier()
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())?;
            println!("rank {rank} joined");
            Ok(())
        }
        "stall" | "stall-staggered" => {
            let t = Tensor::ones(&[16], DType::F32, Device::Cpu).map_err(|e| e.to_string())?;
            pg.all_reduce(&t, ReduceOp::Sum)
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())?;
            if rank == pg.world_size() - 1 {
                // SAFETY: raise(2) has no memory-safety preconditions; the process stops here
                // until the launcher kills it.
                unsafe {
                    libc::raise(libc::SIGSTOP);
                }
            }
            pg.all_reduce(&t, ReduceOp::Sum)
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())
        }
        "skip" => {
            // Buckets 0, 1, 2 all-reduced under DDP's labels; the last rank skips bucket 1,
            // then stays alive, issuing nothing, while the others time out at #3.
            let t = Tensor::ones(&[16], DType::F32, Device::Cpu).map_err(|e| e.to_string())?;
            let last = rank == pg.world_size() - 1;
            for b in [0, 1, 2].into_iter().filter(|&b| !(last && b == 1)) {
                tandem_dist::with_collective_label(tandem_dist::CollectiveLabel::Bucket(b), || {
                    pg.all_reduce(&t, ReduceOp::Sum)
                })
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())?;
            }
            if last {
                std::thread::sleep(Duration::from_secs(8));
            }
            Ok(())
        }
        "mismatch" => {
            let t = Tensor::zeros(&[100], DType::F32, Device::Cpu).map_err(|e| e.to_string())?;
            let out = Tensor::zeros(&[100 * pg.world_size()], DType::F32, Device::Cpu)
                .map_err(|e| e.to_string())?;
            pg.barrier()
                .and_then(|w| w.wait())
                .map_err(|e| e.to_string())?;
            let work = if rank == 0 {
                pg.all_reduce(&t, ReduceOp::Sum)
            } else {
                pg.all_gather(&t, &out)
            };
            match work.and_then(|w| w.wait()) {
                Ok(()) => Err("the mismatched collective succeeded".into()),
                Err(e) => Err(e.to_string()),
            }
        }
        other => Err(format!("unknown worker mode {other}")),
    }
}

/// Ranks running as child processes, meeting at a store this test serves.
pub struct Job {
    children: Vec<Child>,
    output: Vec<Arc<Mutex<String>>>,
    _store: StoreServer,
}

fn collect(from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(from);
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            into.lock().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
}

impl Job {
    /// Starts `world` ranks of this test binary in worker `mode`.
    pub fn start(world: usize, mode: &str) -> Job {
        let ranks: Vec<usize> = (0..world).collect();
        Job::start_ranks(world, mode, &ranks, |_| Vec::new())
    }

    /// Starts the ranks `ranks` of a job of `world` in worker `mode`, at a store that requires a
    /// fresh job secret; `extra(rank)` adds or overrides environment variables of a rank.
    pub fn start_ranks(
        world: usize,
        mode: &str,
        ranks: &[usize],
        extra: impl Fn(usize) -> Vec<(String, String)>,
    ) -> Job {
        let secret = JobSecret::generate().expect("secret");
        let config = StoreConfig {
            secret: Some(secret.clone()),
            ..StoreConfig::default()
        };
        let store = StoreServer::bind_with("127.0.0.1:0", config).expect("store");
        let port = store.local_addr().port();
        let exe = std::env::current_exe().expect("test binary path");
        let mut children = Vec::new();
        let mut output = Vec::new();
        for &rank in ranks {
            let mut cmd = Command::new(&exe);
            cmd.args(worker_args())
                .env(WORKER_VAR, mode)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(STORE_HOSTED_VAR, "1")
                .env(SECRET_VAR, secret.env_value())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra(rank) {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawn worker");
            let text = Arc::new(Mutex::new(String::new()));
            collect(child.stdout.take().unwrap(), text.clone());
            collect(child.stderr.take().unwrap(), text.clone());
            children.push(child);
            output.push(text);
        }
        Job {
            children,
            output,
            _store: store,
        }
    }

    /// Starts a job of `world` ranks in worker `mode` that all train on `cuda:0` of this
    /// machine (a test-only arrangement for one GPU): each rank gets `LOCAL_RANK=0` and
    /// `LOCAL_WORLD_SIZE=1`, as one rank per host would have, and, for the real NCCL (which
    /// refuses two ranks of a communicator on one GPU), an `NCCL_HOSTID` of its own, so that NCCL
    /// takes the ranks for different hosts and connects them through sockets on loopback.
    ///
    /// The ranks inherit this process's CUDA setup: on the emulator, the emulator's folder
    /// (with its NCCL) in `TANDEM_CUDA_LIBS`, the stream sanitizer, and the fresh kernel cache
    /// `tandem_test_support::select_cuda` made, which the job's ranks share (entries are
    /// written atomically).
    pub fn start_on_one_gpu(world: usize, mode: &str) -> Job {
        let ranks: Vec<usize> = (0..world).collect();
        Job::start_ranks(world, mode, &ranks, |rank| {
            [
                ("LOCAL_RANK", "0".to_string()),
                ("LOCAL_WORLD_SIZE", "1".to_string()),
                ("NCCL_HOSTID", format!("tandem-test-{mode}-rank-{rank}")),
                ("NCCL_SOCKET_IFNAME", "lo".to_string()),
                ("NCCL_IB_DISABLE", "1".to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
        })
    }

    /// What rank `rank` printed so far (stdout and stderr).
    pub fn output(&self, rank: usize) -> String {
        self.output[rank].lock().clone()
    }

    /// Waits until every rank's output contains `text`; fails at once, with the outputs, when
    /// a rank exits before printing it (instead of waiting out `timeout`).
    pub fn wait_for_all(&mut self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !(0..self.children.len()).all(|r| self.output(r).contains(text)) {
            assert!(
                Instant::now() < deadline,
                "ranks did not print {text:?}: {:?}",
                self.outputs()
            );
            for rank in 0..self.children.len() {
                if let Ok(Some(status)) = self.children[rank].try_wait() {
                    // Let the collectors read the last bytes before looking again.
                    std::thread::sleep(Duration::from_millis(50));
                    assert!(
                        self.output(rank).contains(text),
                        "rank {rank} exited ({status}) before printing {text:?}: {:?}",
                        self.outputs()
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until rank `rank`'s output contains `text`; returns whether it did within
    /// `timeout`.
    pub fn wait_for(&self, rank: usize, text: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.output(rank).contains(text) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// SIGKILLs rank `rank`.
    pub fn kill(&mut self, rank: usize) {
        self.children[rank].kill().expect("kill");
    }

    /// Waits for every rank (killing all on timeout) and returns exit statuses and output.
    pub fn wait(mut self, timeout: Duration) -> Vec<(ExitStatus, String)> {
        let deadline = Instant::now() + timeout;
        let mut statuses: Vec<Option<ExitStatus>> = vec![None; self.children.len()];
        while statuses.iter().any(Option::is_none) {
            for (s, c) in statuses.iter_mut().zip(&mut self.children) {
                if s.is_none() {
                    *s = c.try_wait().expect("try_wait");
                }
            }
            if Instant::now() >= deadline {
                for c in &mut self.children {
                    let _ = c.kill();
                }
                panic!(
                    "ranks still running after {timeout:?}: {:?}",
                    self.outputs()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Give the collectors a moment to read the last bytes.
        std::thread::sleep(Duration::from_millis(50));
        statuses
            .into_iter()
            .enumerate()
            .map(|(r, s)| (s.unwrap(), self.output(r)))
            .collect()
    }

    fn outputs(&self) -> Vec<String> {
        (0..self.children.len()).map(|r| self.output(r)).collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
