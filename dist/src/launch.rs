//! The launcher behind `tandem-run`: starts the local ranks of a job, serves the rendezvous
//! store, labels their output, and stops everything when one rank fails.
//!
//! `tandem-run --nproc-per-node N -- PROGRAM ARGS…` starts N copies of PROGRAM with the
//! torchrun variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`). On node 0 the launcher itself serves the
//! rendezvous store (on `--master-port`, or a free port it picks) and tells the ranks so with
//! `TANDEM_STORE_HOSTED=1`; `--no-store` leaves that to rank 0 (for programs that bring their
//! own, such as torch.distributed). Every line a rank prints is prefixed with `[rank K] ` on the
//! launcher's stdout or stderr, and passed on as it comes — at each `\n` or `\r` (progress
//! bars), or in pieces of a bounded size (see [`relay`]). When a rank exits with a failure,
//! the others are sent SIGTERM, then SIGKILL after a grace period, and the launch reports
//! which rank failed and how. SIGINT/SIGTERM/SIGHUP received by the launcher (when
//! [`forward_signals`] was called) are passed on to the ranks.
//!
//! **Restarts.** With `--max-restarts N` (single node), a failed job is restarted as a whole,
//! as torchrun's elastic agent does: every rank is stopped, a fresh store is started, and all
//! ranks start again with [`RESTART_COUNT_VAR`] (`TANDEM_RESTART_COUNT`) set to the number of
//! restarts so far and [`MAX_RESTARTS_VAR`] (`TANDEM_MAX_RESTARTS`) to N. After N restarts the
//! next failure ends the launch with the usual report. Programs resume from their newest
//! checkpoint (the examples do, from `--checkpoint-dir`).
//!
//! **Ranks die with their launcher.** Each rank is started with `PR_SET_PDEATHSIG` = SIGKILL
//! (Linux), and checks between fork and exec that its parent is still the launcher, so a
//! launcher killed by SIGKILL — which cannot forward anything — takes its ranks with it
//! instead of leaving them training as orphans (see [`child`]).
//!
//! Every job gets a secret ([`crate::auth`]): the one in the launcher's own `TANDEM_JOB_SECRET`,
//! or, for a single node, a fresh random one; the ranks receive it in `TANDEM_JOB_SECRET` and
//! the store requires it. A single-node job's store listens on the address its ranks are given
//! (loopback by default), not on every interface. When a rank fails,
//! the launch also reports which rank the failed ones were waiting for
//! ([`crate::failure_report`]), which is the one to look at when a rank stopped responding.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::auth::{self, JobSecret};
use crate::failure_report;
pub use crate::failure_report::FailureReport;
use crate::rendezvous::{MAX_WORLD_SIZE, STORE_HOSTED_VAR};
use crate::store::{StoreConfig, StoreServer};
use crate::{DistError, Result};

pub mod child;
pub mod relay;

/// Environment variable telling each rank how many times the launcher has restarted the job
/// (`0` on the first start); see `--max-restarts`.
pub const RESTART_COUNT_VAR: &str = "TANDEM_RESTART_COUNT";
/// Environment variable telling each rank the launcher's `--max-restarts`.
pub const MAX_RESTARTS_VAR: &str = "TANDEM_MAX_RESTARTS";

/// The command-line help of `tandem-run`.
pub const USAGE: &str = "\
usage: tandem-run --nproc-per-node N [OPTIONS] [--] PROGRAM [ARGS...]

Starts N ranks of PROGRAM on this node with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, prefixes their output with [rank K], and stops all ranks when
one fails.

options:
  --nproc-per-node N   ranks to start on this node (required)
  --nnodes M           nodes in the job (default 1)
  --node-rank R        this node's index, 0..M (default 0)
  --master-addr A      host of node 0, where the rendezvous store runs (default 127.0.0.1)
  --master-port P      port of the store (default: a free port; required when --nnodes > 1)
  --no-store           do not serve tandem's store; rank 0 serves it (torch.distributed programs)
  --kill-grace S       seconds between SIGTERM and SIGKILL when stopping ranks (default 5)
  --max-restarts N     when a rank fails, stop all ranks and start the job again, up to N
                       times (default 0; single node only). Ranks see TANDEM_RESTART_COUNT
                       (restarts so far) and TANDEM_MAX_RESTARTS
  -h, --help           print this help
";

/// What to launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Ranks to start on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job. Default 1.
    pub nnodes: usize,
    /// This node's index. Default 0.
    pub node_rank: usize,
    /// Host of node 0. Default `127.0.0.1`.
    pub master_addr: String,
    /// Port of the store; `None` picks a free one (single node only).
    pub master_port: Option<u16>,
    /// Whether the launcher on node 0 serves tandem's rendezvous store. Default true.
    pub serve_store: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks. Default 5 s.
    pub kill_grace: Duration,
    /// How many times a failed job is restarted (all ranks) before the launch gives up.
    /// Default 0. Single node only.
    pub max_restarts: usize,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl LaunchOptions {
    /// Options for `nproc_per_node` local ranks of `program args…`, other settings default.
    pub fn new(nproc_per_node: usize, program: impl Into<OsString>, args: Vec<OsString>) -> Self {
        LaunchOptions {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            serve_store: true,
            kill_grace: Duration::from_secs(5),
            max_restarts: 0,
            program: program.into(),
            args,
        }
    }

    /// Parses `tandem-run`'s arguments (without the program name). `Ok(None)` means help was
    /// asked for.
    pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Option<Self>> {
        let bad = |m: String| DistError::Launch(format!("{m}\n\n{USAGE}"));
        let mut opts = LaunchOptions::new(0, OsString::new(), Vec::new());
        let mut nproc = None;
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            let Some(text) = arg.to_str().map(str::to_string) else {
                opts.program = arg;
                break;
            };
            if text == "--" {
                opts.program = it.next().ok_or_else(|| bad("no PROGRAM after --".into()))?;
                break;
            }
            if text == "-h" || text == "--help" {
                return Ok(None);
            }
            if text == "--no-store" {
                opts.serve_store = false;
                continue;
            }
            if !text.starts_with("--") {
                opts.program = arg;
                break;
            }
            let (name, inline) = match text.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (text.clone(), None),
            };
            let value = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or_else(|| bad(format!("{name} needs a value")))?,
            };
            let num = |v: &str| {
                v.parse::<usize>()
                    .map_err(|_| bad(format!("{name}: {v:?} is not a number")))
            };
            match name.as_str() {
                "--nproc-per-node" | "--nproc_per_node" => nproc = Some(num(&value)?),
                "--nnodes" => opts.nnodes = num(&value)?,
                "--max-restarts" | "--max_restarts" => opts.max_restarts = num(&value)?,
                "--node-rank" | "--node_rank" => opts.node_rank = num(&value)?,
                "--master-addr" | "--master_addr" => opts.master_addr = value,
                "--master-port" | "--master_port" => {
                    opts.master_port = Some(
                        value
                            .parse()
                            .map_err(|_| bad(format!("{name}: {value:?} is not a port number")))?,
                    )
                }
                "--kill-grace" => {
                    let secs: f64 = value
                        .parse()
                        .map_err(|_| bad(format!("{name}: {value:?} is not seconds")))?;
                    if !(0.0..=3600.0).contains(&secs) {
                        return Err(bad(format!(
                            "{name}: {secs} is not between 0 and 3600 seconds"
                        )));
                    }
                    opts.kill_grace = Duration::from_secs_f64(secs);
                }
                _ => return Err(bad(format!("unknown option {name}"))),
            }
        }
        opts.args = it.collect();
        opts.nproc_per_node = nproc.ok_or_else(|| bad("--nproc-per-node is required".into()))?;
        if opts.program.is_empty() {
            return Err(bad("no PROGRAM given".into()));
        }
        opts.validate()?;
        Ok(Some(opts))
    }

    fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return Err(DistError::Launch(
                "--nproc-per-node and --nnodes must be at least 1".into(),
            ));
        }
        if self.node_rank >= self.nnodes {
            return Err(DistError::Launch(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.nnodes > 1 && self.max_restarts > 0 {
            return Err(DistError::Launch(
                "--max-restarts works on a single node (--nnodes 1): each node's launcher \
                 would restart its ranks on its own"
                    .into(),
            ));
        }
        if self.nproc_per_node.saturating_mul(self.nnodes) > MAX_WORLD_SIZE {
            return Err(DistError::Launch(format!(
                "--nproc-per-node {} × --nnodes {} is more than {MAX_WORLD_SIZE} ranks",
                self.nproc_per_node, self.nnodes
            )));
        }
        if self.nnodes > 1 && self.master_port.is_none() {
            return Err(DistError::Launch(
                "--master-port is required when --nnodes > 1".into(),
            ));
        }
        Ok(())
    }
}

/// How a rank ended when it did not succeed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFailure {
    /// The global rank.
    pub rank: usize,
    /// Its exit status.
    pub status: ExitStatus,
}

impl RankFailure {
    /// `exit status 3` or `killed by signal 9 (SIGKILL)`.
    pub fn describe(&self) -> String {
        describe_status(self.status)
    }

    /// The conventional shell exit code for the failure (the rank's code, or 128 + signal).
    pub fn exit_code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        match (self.status.code(), self.status.signal()) {
            (Some(c), _) if c != 0 => c,
            (_, Some(s)) => 128 + s,
            _ => 1,
        }
    }
}

/// Describes an exit status for people.
pub fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => {
            let name = match s {
                libc::SIGINT => " (SIGINT)",
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGHUP => " (SIGHUP)",
                _ => "",
            };
            format!("killed by signal {s}{name}")
        }
        _ => "an unknown status".into(),
    }
}

/// The outcome of a launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchReport {
    /// The first rank that failed, if any (the others were then stopped).
    pub failed: Option<RankFailure>,
    /// A signal the launcher received and forwarded, if any.
    pub interrupted: Option<i32>,
    /// The port the ranks met on (in the last start of the job).
    pub master_port: u16,
    /// How many times the job was restarted after a failure.
    pub restarts: usize,
    /// What the first failed rank reported: the rank it was waiting for, if any.
    pub report: Option<FailureReport>,
}

impl LaunchReport {
    /// Whether every rank succeeded.
    pub fn success(&self) -> bool {
        self.failed.is_none() && self.interrupted.is_none()
    }

    /// What ended an unsuccessful launch, for people (`None` after a success): `rank 2 failed
    /// with exit status 3 (after 1 restart)`, or `received signal 15; forwarded it to the
    /// ranks`. A rank failure that came first is named rather than a later signal. When the
    /// failed rank reported that it was waiting for another rank ([`LaunchReport::report`]),
    /// that rank is named first: `rank 1 did not respond (stopped or hung?); rank 0, which was
    /// waiting for it, failed with exit status 1`.
    pub fn failure_message(&self) -> Option<String> {
        let after = match self.restarts {
            0 => String::new(),
            1 => " (after 1 restart)".to_string(),
            n => format!(" (after {n} restarts)"),
        };
        if let Some(f) = &self.failed {
            return Some(format!(
                "{}; stopped the other ranks{after}",
                describe_failure(f, self.report.as_ref())
            ));
        }
        self.interrupted
            .map(|sig| format!("received signal {sig}; forwarded it to the ranks{after}"))
    }

    /// The exit code for a launcher process: 0 on success, the failed rank's code (128 +
    /// signal for a rank killed by one), or 128 + a forwarded signal; always 0–255.
    pub fn exit_code(&self) -> u8 {
        let code = if let Some(f) = &self.failed {
            f.exit_code()
        } else if let Some(sig) = self.interrupted {
            128 + sig
        } else {
            0
        };
        if self.success() {
            0
        } else {
            code.clamp(1, 255) as u8
        }
    }
}

/// `rank 2 failed with exit status 3`, or, when it reported waiting for another rank, that rank
/// first: the one to look at (it may be stopped or hung), not the first one to exit.
fn describe_failure(failed: &RankFailure, report: Option<&FailureReport>) -> String {
    let summary = describe_blame(failed, report);
    // The hang diagnosis, when a rank's collective timed out: who diverged and where.
    match report.and_then(|r| r.diagnosis.as_deref()) {
        Some(diagnosis) => format!("{summary}. Diagnosis: {diagnosis}"),
        None => summary,
    }
}

/// The failed rank, or the rank it was waiting for first.
fn describe_blame(failed: &RankFailure, report: Option<&FailureReport>) -> String {
    match report.filter(|r| r.waiting_for != failed.rank) {
        Some(r) => format!(
            "rank {} did not respond (stopped or hung?); rank {}, which was waiting for it, \
             failed with {}",
            r.waiting_for,
            failed.rank,
            failed.describe()
        ),
        None => format!("rank {} failed with {}", failed.rank, failed.describe()),
    }
}

static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Makes SIGINT, SIGTERM and SIGHUP delivered to this process be forwarded to the ranks of a
/// running [`launch`] instead of killing the launcher. Call once, from a launcher binary.
pub fn forward_signals() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `sigaction` is a plain C struct for which zero bytes are valid; the handler only
        // stores to an atomic, which is async-signal-safe; the pointers passed live for the call.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = remember_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(DistError::io(
                "installing signal handlers",
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

fn send_signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is one of our children that
    // has not been reported as exited.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Runs the ranks of this node to completion. Returns when all have exited: successfully, or
/// because one failed (the first failure is reported, the rest were stopped) and
/// `max_restarts` restarts have been used up, or because a forwarded signal ended them.
///
/// Call it from a thread that lives until it returns (it blocks until then anyway): the
/// ranks' parent-death signal fires when the thread that started them ends.
pub fn launch(opts: &LaunchOptions) -> Result<LaunchReport> {
    opts.validate()?;
    let mut restarts = 0;
    loop {
        let report = launch_once(opts, restarts)?;
        let Some(failure) = report.failed.as_ref() else {
            return Ok(LaunchReport { restarts, ..report });
        };
        if report.interrupted.is_some() || restarts >= opts.max_restarts {
            return Ok(LaunchReport { restarts, ..report });
        }
        restarts += 1;
        relay::note(&format!(
            "{}; stopped the other ranks and restarting the job (restart {restarts} of {})",
            describe_failure(failure, report.report.as_ref()),
            opts.max_restarts
        ));
    }
}

/// What a rank's exit reports: its rank and how its process ended.
type Exit = (usize, std::io::Result<ExitStatus>);

/// The ranks of this node, started.
struct Started {
    /// `(rank, process id)` of every rank started.
    pids: Vec<(usize, u32)>,
    /// The threads that relay the ranks' output.
    relays: Vec<std::thread::JoinHandle<()>>,
    /// Receives every rank's exit.
    exits: mpsc::Receiver<Exit>,
    /// Why a rank could not be started (the ranks started before it are stopped).
    spawn_error: Option<DistError>,
}

/// How the ranks of one start ended.
struct Outcome {
    failed: Option<RankFailure>,
    interrupted: Option<i32>,
}

/// One start of the job: the ranks, with `restart` in their environment, until all exit.
fn launch_once(opts: &LaunchOptions, restart: usize) -> Result<LaunchReport> {
    let world = opts.nproc_per_node * opts.nnodes;
    let secret = auth::launcher_secret(opts.nnodes)?;
    let (server, port) = store_and_port(opts, secret.as_ref())?;
    let started = spawn_ranks(opts, restart, port, secret.as_ref());
    let Outcome {
        failed,
        interrupted,
    } = supervise(opts, &started);
    drain_relays(started.relays);
    let report = failed
        .as_ref()
        .zip(server.as_ref())
        .and_then(|(f, s)| failure_report::explain(s, f.rank, world));
    drop(server);
    if let Some(e) = started.spawn_error {
        return Err(e);
    }
    Ok(LaunchReport {
        failed,
        interrupted,
        master_port: port,
        restarts: restart,
        report,
    })
}

/// The store this node serves (node 0, unless the ranks serve it) and the port the ranks meet
/// on. Node 0 serves the store on the requested port or a free one; it binds before any rank
/// starts, so there is no race for the port.
fn store_and_port(
    opts: &LaunchOptions,
    secret: Option<&JobSecret>,
) -> Result<(Option<StoreServer>, u16)> {
    Ok(if opts.serve_store && opts.node_rank == 0 {
        let server = serve_store(opts, secret)?;
        let port = server.local_addr().port();
        (Some(server), port)
    } else {
        let port = match opts.master_port {
            Some(p) => p,
            None => TcpListener::bind((opts.master_addr.as_str(), 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| DistError::io("picking a free port", e))?
                .port(),
        };
        (None, port)
    })
}

/// Starts this node's ranks with their environment, relaying their output with a `[rank K] `
/// prefix; stops at the first rank that cannot be started.
fn spawn_ranks(
    opts: &LaunchOptions,
    restart: usize,
    port: u16,
    secret: Option<&JobSecret>,
) -> Started {
    let world = opts.nproc_per_node * opts.nnodes;
    let (exits_tx, exits) = mpsc::channel::<Exit>();
    let mut pids: Vec<(usize, u32)> = Vec::new();
    let mut relays = Vec::new();
    let mut spawn_error = None;
    for local in 0..opts.nproc_per_node {
        let rank = opts.node_rank * opts.nproc_per_node + local;
        let mut cmd = Command::new(&opts.program);
        cmd.args(&opts.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", opts.nproc_per_node.to_string())
            .env("GROUP_RANK", opts.node_rank.to_string())
            .env("MASTER_ADDR", &opts.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(RESTART_COUNT_VAR, restart.to_string())
            .env(MAX_RESTARTS_VAR, opts.max_restarts.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if opts.serve_store {
            cmd.env(STORE_HOSTED_VAR, "1");
        } else {
            cmd.env_remove(STORE_HOSTED_VAR);
        }
        child::die_with_launcher(&mut cmd);
        if let Some(secret) = secret {
            cmd.env(auth::SECRET_VAR, secret.env_value());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(DistError::io(
                    format!("starting rank {rank} ({:?})", opts.program),
                    e,
                ));
                break;
            }
        };
        pids.push((rank, child.id()));
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let p = prefix.clone();
            relays.push(std::thread::spawn(move || relay::relay(out, p, false)));
        }
        if let Some(err) = child.stderr.take() {
            relays.push(std::thread::spawn(move || relay::relay(err, prefix, true)));
        }
        let tx = exits_tx.clone();
        std::thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send((rank, status));
        });
    }
    drop(exits_tx);
    Started {
        pids,
        relays,
        exits,
        spawn_error,
    }
}

/// Waits for every rank to exit. The first failure (or an interrupting signal, passed on to
/// the ranks) stops the others: SIGTERM, then SIGKILL after the grace period.
fn supervise(opts: &LaunchOptions, started: &Started) -> Outcome {
    let exits_rx = &started.exits;
    let mut running: Vec<(usize, u32)> = started.pids.clone();
    let mut failed: Option<RankFailure> = None;
    let mut interrupted = None;
    let mut stop_deadline: Option<Instant> = None;
    let mut killed = false;
    if started.spawn_error.is_some() {
        for &(_, pid) in &running {
            send_signal(pid, libc::SIGTERM);
        }
        stop_deadline = Some(Instant::now() + opts.kill_grace);
    }
    while !running.is_empty() {
        match exits_rx.recv_timeout(Duration::from_millis(50)) {
            Ok((rank, status)) => {
                running.retain(|&(r, _)| r != rank);
                let failure = match status {
                    Ok(s) if s.success() => None,
                    Ok(s) => Some(RankFailure { rank, status: s }),
                    Err(_) => None,
                };
                if let Some(f) = failure {
                    if failed.is_none() && interrupted.is_none() && stop_deadline.is_none() {
                        for &(_, pid) in &running {
                            send_signal(pid, libc::SIGTERM);
                        }
                        stop_deadline = Some(Instant::now() + opts.kill_grace);
                    }
                    if failed.is_none() && interrupted.is_none() {
                        failed = Some(f);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            interrupted = Some(sig);
            for &(_, pid) in &running {
                send_signal(pid, sig);
            }
            stop_deadline.get_or_insert(Instant::now() + opts.kill_grace);
        }
        if !killed && stop_deadline.is_some_and(|d| Instant::now() >= d) {
            for &(_, pid) in &running {
                send_signal(pid, libc::SIGKILL);
            }
            killed = true;
        }
    }
    Outcome {
        failed,
        interrupted,
    }
}

/// Lets the relays print what the ranks wrote last (bounded: a grandchild could hold a pipe).
fn drain_relays(relays: Vec<std::thread::JoinHandle<()>>) {
    let deadline = Instant::now() + Duration::from_secs(2);
    for r in relays {
        while !r.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if r.is_finished() {
            let _ = r.join();
        }
    }
}

/// Serves the job's store, requiring `secret`: a single-node job on the address its ranks are
/// given (`--master-addr`, loopback by default) rather than on every interface; a job of
/// several nodes on every interface, since the other nodes' ranks connect to it.
fn serve_store(opts: &LaunchOptions, secret: Option<&JobSecret>) -> Result<StoreServer> {
    let port = opts.master_port.unwrap_or(0);
    let addr = if opts.nnodes == 1 {
        (opts.master_addr.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                DistError::Launch(format!(
                    "cannot resolve --master-addr {:?}",
                    opts.master_addr
                ))
            })?
    } else {
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))
    };
    let config = StoreConfig {
        secret: secret.cloned(),
        ..StoreConfig::default()
    };
    StoreServer::bind_with(addr, config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<OsString> {
        s.iter().map(OsString::from).collect()
    }

    #[test]
    fn arguments_parse_in_both_styles() {
        let o = LaunchOptions::parse_args(args(&[
            "--nproc-per-node",
            "4",
            "--master-port=1234",
            "--",
            "prog",
            "-x",
            "--y",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.nproc_per_node, 4);
        assert_eq!(o.master_port, Some(1234));
        assert_eq!(o.program, "prog");
        assert_eq!(o.args, args(&["-x", "--y"]));
        let o = LaunchOptions::parse_args(args(&[
            "--nproc_per_node=2",
            "--no-store",
            "python3",
            "train.py",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (o.nproc_per_node, o.serve_store, o.args.len()),
            (2, false, 1)
        );
        assert_eq!(LaunchOptions::parse_args(args(&["--help"])).unwrap(), None);
    }

    #[test]
    fn max_restarts_parses_and_is_refused_across_nodes() {
        let o = LaunchOptions::parse_args(args(&["--nproc-per-node=2", "--max-restarts=3", "p"]))
            .unwrap()
            .unwrap();
        assert_eq!(o.max_restarts, 3);
        let err = LaunchOptions::parse_args(args(&[
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--master-port",
            "1234",
            "--max-restarts",
            "1",
            "p",
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--max-restarts") && err.contains("single node"),
            "{err}"
        );
    }

    #[test]
    fn bad_arguments_say_what_is_wrong() {
        for (a, want) in [
            (vec!["prog"], "--nproc-per-node is required"),
            (vec!["--nproc-per-node", "two", "prog"], "not a number"),
            (vec!["--nproc-per-node", "2"], "no PROGRAM"),
            (
                vec!["--nproc-per-node", "2", "--bogus", "1", "prog"],
                "unknown option --bogus",
            ),
            (
                vec!["--nproc-per-node", "2", "--nnodes", "2", "prog"],
                "--master-port is required",
            ),
            (
                vec!["--nproc-per-node", "2", "--node-rank", "1", "prog"],
                "not below --nnodes",
            ),
        ] {
            let err = LaunchOptions::parse_args(args(&a)).unwrap_err().to_string();
            assert!(err.contains(want), "{a:?}: {err}");
        }
    }
}
