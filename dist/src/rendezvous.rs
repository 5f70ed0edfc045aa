//! Rendezvous: reading who this process is from the launcher's environment, and joining the
//! job's process group through the store at `MASTER_ADDR:MASTER_PORT`.
//!
//! Three launchers are understood, tried in this order:
//!
//! * **torchrun / tandem-run**: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`. (`LOCAL_RANK`/`LOCAL_WORLD_SIZE` may both be absent, as in
//!   a hand-written single-node launch; they then default to `RANK`/`WORLD_SIZE`.)
//! * **SLURM** (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, and
//!   `SLURM_NTASKS_PER_NODE` or else `SLURM_TASKS_PER_NODE` with `SLURM_NODEID` for the local
//!   world size; `MASTER_ADDR`/`MASTER_PORT` must be exported by the job script.
//! * **Open MPI** (`mpirun`): `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!   `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`, plus `MASTER_ADDR`/`MASTER_PORT`.
//!
//! A missing or malformed variable is an error naming it. Parsing is a pure function over a
//! map ([`LaunchEnv::from_map`]) so it can be tested; [`LaunchEnv::from_process_env`] wraps it.
//!
//! Who serves the store: rank 0, unless `TANDEM_STORE_HOSTED=1` says the launcher already does
//! (`tandem-run` serves it and sets that variable). Under torchrun, whose own agent store
//! (a different protocol) occupies `MASTER_PORT` when `TORCHELASTIC_USE_AGENT_STORE=True`,
//! rank 0 serves tandem's store on `MASTER_PORT + 1`. A store that rank 0 serves on a loopback
//! `MASTER_ADDR` listens on that address only, not on every interface.
//!
//! Authentication: the job secret comes from `TANDEM_JOB_SECRET` ([`crate::auth`]); the store
//! and every connection between ranks prove it. A job of more than one rank without it is
//! refused unless `TANDEM_ALLOW_UNAUTHENTICATED=1` asks to run unauthenticated. `WORLD_SIZE`
//! is bounded by [`MAX_WORLD_SIZE`].
//!
//! **Backend and device.** [`InitOptions`] says what the job trains on and which backend to
//! use. With [`Backend::Auto`] (the default), CUDA training uses NCCL and CPU training uses
//! tandem's TCP backend; [`Backend::Tcp`] and [`Backend::Nccl`] choose explicitly (a backend
//! that cannot serve the device is an error). A CUDA rank uses `cuda:LOCAL_RANK` — one GPU per
//! local rank, as torchrun, `tandem-run`, `srun` and `mpirun` number them — whatever ordinal the
//! requested device names; when the launcher gives each rank a single GPU of its own
//! (`CUDA_VISIBLE_DEVICES` naming exactly one device, as `srun --gpus-per-task=1` does), that
//! GPU, `cuda:0`, is used ([`LaunchEnv::rank_device`]).

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::str::FromStr;
use std::sync::Arc;

use tandem_core::Device;

use crate::auth::{self, JobSecret, ALLOW_UNAUTHENTICATED_VAR, SECRET_VAR};
use crate::process_group::nccl::{NcclConfig, NcclProcessGroup};
use crate::process_group::tcp::TcpProcessGroup;
use crate::process_group::{GroupConfig, ProcessGroup};
use crate::store::{StoreConfig, StoreServer, TcpStore};
use crate::{DistError, Result};

/// Set to `1` by a launcher that serves the rendezvous store itself (so rank 0 must not).
pub const STORE_HOSTED_VAR: &str = "TANDEM_STORE_HOSTED";

/// The largest world size tandem accepts (defined by the process groups, which enforce it).
pub use crate::process_group::MAX_WORLD_SIZE;

/// Which launcher's variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK`, `WORLD_SIZE`, … as set by torchrun and tandem-run.
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, … as set by `srun`.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, … as set by Open MPI's `mpirun`.
    OpenMpi,
}

/// Who this process is in the job, and where the rendezvous store is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this node (selects the device).
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// `MASTER_PORT` as given.
    pub master_port: u16,
    /// The port tandem's store listens on (`master_port`, or `master_port + 1` under
    /// torchrun's agent store).
    pub store_port: u16,
    /// Whether a launcher already serves the store (rank 0 then only connects to it).
    pub store_hosted: bool,
    /// Which launcher's variables were read.
    pub source: EnvSource,
    /// The job secret (`TANDEM_JOB_SECRET`); `None` only for a single rank or when
    /// `TANDEM_ALLOW_UNAUTHENTICATED=1`.
    pub secret: Option<JobSecret>,
}

fn get<'a>(env: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    env.get(name).map(|s| s.trim())
}

fn required<'a>(env: &'a HashMap<String, String>, name: &str, hint: &str) -> Result<&'a str> {
    match get(env, name) {
        Some(v) if !v.is_empty() => Ok(v),
        Some(_) => Err(DistError::env(name, format!("is empty; {hint}"))),
        None => Err(DistError::env(name, format!("is not set; {hint}"))),
    }
}

fn number<T: FromStr>(env: &HashMap<String, String>, name: &str, hint: &str) -> Result<T> {
    let v = required(env, name, hint)?;
    v.parse()
        .map_err(|_| DistError::env(name, format!("{v:?} is not a valid number")))
}

const MASTER_HINT: &str =
    "set MASTER_ADDR and MASTER_PORT to the host and a free port of the node running rank 0 \
     (tandem-run and torchrun set them)";

/// `SLURM_TASKS_PER_NODE` is a compressed list like `4(x2),3`: node `node` gets which count?
fn slurm_tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for part in list.split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c.parse().ok()?, r.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part.parse().ok()?, 1),
        };
        if node < seen + repeat {
            return Some(count);
        }
        seen += repeat;
    }
    None
}

/// Who this process is, as the launcher's variables say.
#[derive(Clone, Copy)]
struct Ranks {
    source: EnvSource,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
}

impl Ranks {
    /// Reads the ranks from the variables of the first launcher whose variables are set:
    /// torchrun or tandem-run, SLURM, Open MPI.
    fn from_map(env: &HashMap<String, String>) -> Result<Ranks> {
        let (source, rank, world_size, local_rank, local_world_size) = if get(env, "RANK").is_some()
        {
            let hint =
                "torchrun and tandem-run set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE";
            let rank = number(env, "RANK", hint)?;
            let world = number(env, "WORLD_SIZE", hint)?;
            let (local_rank, local_world) =
                match (get(env, "LOCAL_RANK"), get(env, "LOCAL_WORLD_SIZE")) {
                    (None, None) => (rank, world),
                    _ => (
                        number(env, "LOCAL_RANK", hint)?,
                        number(env, "LOCAL_WORLD_SIZE", hint)?,
                    ),
                };
            (EnvSource::Torchrun, rank, world, local_rank, local_world)
        } else if get(env, "SLURM_PROCID").is_some() {
            let hint = "run the program with srun inside a SLURM allocation";
            let rank = number(env, "SLURM_PROCID", hint)?;
            let world = if get(env, "SLURM_NTASKS").is_none() && get(env, "SLURM_NPROCS").is_some()
            {
                number(env, "SLURM_NPROCS", hint)?
            } else {
                number(env, "SLURM_NTASKS", hint)?
            };
            let local_rank = number(env, "SLURM_LOCALID", hint)?;
            let local_world = if get(env, "SLURM_NTASKS_PER_NODE").is_some() {
                number(env, "SLURM_NTASKS_PER_NODE", hint)?
            } else {
                let list = required(env, "SLURM_TASKS_PER_NODE", hint)?;
                let node: usize = number(env, "SLURM_NODEID", hint)?;
                slurm_tasks_on_node(list, node).ok_or_else(|| {
                    DistError::env(
                        "SLURM_TASKS_PER_NODE",
                        format!("{list:?} does not give a task count for node {node}"),
                    )
                })?
            };
            (EnvSource::Slurm, rank, world, local_rank, local_world)
        } else if get(env, "OMPI_COMM_WORLD_RANK").is_some() {
            let hint = "run the program with Open MPI's mpirun";
            (
                EnvSource::OpenMpi,
                number(env, "OMPI_COMM_WORLD_RANK", hint)?,
                number(env, "OMPI_COMM_WORLD_SIZE", hint)?,
                number(env, "OMPI_COMM_WORLD_LOCAL_RANK", hint)?,
                number(env, "OMPI_COMM_WORLD_LOCAL_SIZE", hint)?,
            )
        } else {
            return Err(DistError::env(
                "RANK",
                "is not set, and neither are SLURM_PROCID nor OMPI_COMM_WORLD_RANK; start the \
             program with tandem-run (or torchrun, srun, mpirun), or set RANK, WORLD_SIZE, \
             MASTER_ADDR and MASTER_PORT",
            ));
        };
        Ok(Ranks {
            source,
            rank,
            world_size,
            local_rank,
            local_world_size,
        })
    }

    /// Checks that the ranks are consistent, naming the variable that is not.
    fn check(&self) -> Result<()> {
        let Ranks {
            source,
            rank,
            world_size,
            local_rank,
            local_world_size,
        } = *self;
        let (rank_var, world_var) = match source {
            EnvSource::Torchrun => ("RANK", "WORLD_SIZE"),
            EnvSource::Slurm => ("SLURM_PROCID", "SLURM_NTASKS"),
            EnvSource::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        };
        if world_size == 0 {
            return Err(DistError::env(
                world_var,
                "is 0; a job needs at least one rank",
            ));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(DistError::env(
                world_var,
                format!("is {world_size}; tandem supports at most {MAX_WORLD_SIZE} ranks"),
            ));
        }
        if rank >= world_size {
            return Err(DistError::env(
                rank_var,
                format!("is {rank}, not below the world size {world_size}"),
            ));
        }
        if local_world_size == 0 || local_rank >= local_world_size || local_world_size > world_size
        {
            return Err(DistError::env(
                match source {
                    EnvSource::Torchrun => "LOCAL_RANK",
                    EnvSource::Slurm => "SLURM_LOCALID",
                    EnvSource::OpenMpi => "OMPI_COMM_WORLD_LOCAL_RANK",
                },
                format!(
                    "local rank {local_rank} of {local_world_size} on this node is inconsistent \
                 (world size {world_size})"
                ),
            ));
        }
        Ok(())
    }
}

impl LaunchEnv {
    /// Reads the launch environment from `env` (variable name → value). Pure: use it to test,
    /// or to describe a process other than this one.
    pub fn from_map(env: &HashMap<String, String>) -> Result<Self> {
        let ranks = Ranks::from_map(env)?;
        ranks.check()?;
        let Ranks {
            source,
            rank,
            world_size,
            local_rank,
            local_world_size,
        } = ranks;
        let master_addr = required(env, "MASTER_ADDR", MASTER_HINT)?.to_string();
        let master_port: u16 = number(env, "MASTER_PORT", MASTER_HINT)?;
        if master_port == 0 {
            return Err(DistError::env(
                "MASTER_PORT",
                "is 0; give the port the store listens on",
            ));
        }
        let store_hosted = match get(env, STORE_HOSTED_VAR) {
            None | Some("") | Some("0") => false,
            Some("1") => true,
            Some(other) => {
                return Err(DistError::env(
                    STORE_HOSTED_VAR,
                    format!("{other:?} is not 0 or 1"),
                ))
            }
        };
        let agent_store = source == EnvSource::Torchrun
            && matches!(
                get(env, "TORCHELASTIC_USE_AGENT_STORE"),
                Some("True" | "true" | "1")
            );
        let store_port = if agent_store && !store_hosted {
            master_port.checked_add(1).ok_or_else(|| {
                DistError::env(
                    "MASTER_PORT",
                    "is 65535; tandem needs the next port too under torchrun",
                )
            })?
        } else {
            master_port
        };
        let secret = auth::secret_from_map(env)?;
        if secret.is_none() && world_size > 1 && !auth::unauthenticated_allowed(env)? {
            return Err(DistError::env(
                SECRET_VAR,
                format!(
                    "is not set; the ranks of a tandem job prove to each other that they know a \
                     shared secret. tandem-run sets it; under torchrun, srun or mpirun export \
                     the same random value to every rank (e.g. `export \
                     {SECRET_VAR}=$(openssl rand -hex 32)`), or set \
                     {ALLOW_UNAUTHENTICATED_VAR}=1 to run without authentication on a network \
                     you trust"
                ),
            ));
        }
        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            store_port,
            store_hosted,
            source,
            secret,
        })
    }

    /// Reads this process's launch environment.
    pub fn from_process_env() -> Result<Self> {
        let env: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        Self::from_map(&env)
    }

    /// `host:port` of tandem's rendezvous store.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.store_port)
        } else {
            format!("{}:{}", self.master_addr, self.store_port)
        }
    }
}

/// Which process-group backend a job uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// NCCL when training on CUDA, TCP when training on the CPU.
    #[default]
    Auto,
    /// tandem's TCP backend: CPU tensors, one or many hosts.
    Tcp,
    /// NCCL: CUDA tensors, one GPU per rank.
    Nccl,
}

impl Backend {
    /// The lower-case name (`auto`, `tcp`, `nccl`), as [`Backend::from_str`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
        }
    }

    /// The backend that serves training on `device`: `Auto` picks NCCL for CUDA and TCP for
    /// the CPU; an explicit choice that cannot serve the device is an error.
    pub fn resolve(self, device: Device) -> Result<Backend> {
        match (self, device) {
            (Backend::Auto, Device::Cpu) | (Backend::Tcp, Device::Cpu) => Ok(Backend::Tcp),
            (Backend::Auto, Device::Cuda(_)) | (Backend::Nccl, Device::Cuda(_)) => {
                Ok(Backend::Nccl)
            }
            (Backend::Nccl, Device::Cpu) => Err(DistError::Connect {
                rank: 0,
                detail: "the NCCL backend needs CUDA training; use Backend::Tcp (or Auto) for \
                         the CPU"
                    .into(),
            }),
            (Backend::Tcp, Device::Cuda(_)) => Err(DistError::Connect {
                rank: 0,
                detail: "the TCP backend works on CPU tensors; use Backend::Nccl (or Auto) for \
                         CUDA training"
                    .into(),
            }),
        }
    }
}

impl FromStr for Backend {
    type Err = DistError;

    /// Reads `auto`, `tcp` or `nccl` (any case), e.g. from a `--backend` option.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "tcp" => Ok(Backend::Tcp),
            "nccl" => Ok(Backend::Nccl),
            _ => Err(DistError::Connect {
                rank: 0,
                detail: format!("`{s}` is not a backend; use auto, tcp or nccl"),
            }),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a process joins the job's process group: the backend, the device it trains on, and
/// the groups' settings. Every rank must use the same values.
#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    /// The backend. Default: [`Backend::Auto`].
    pub backend: Backend,
    /// What the job trains on: [`Device::Cpu`], or a CUDA device, in which case each rank uses
    /// its own GPU ([`LaunchEnv::rank_device`]). Default: the CPU.
    pub device: Device,
    /// Settings every backend takes (name, timeouts).
    pub group: GroupConfig,
    /// Settings of an NCCL group (failure detection, collective checks).
    pub nccl: NcclConfig,
}

impl LaunchEnv {
    /// The device this rank trains on when the job trains on `requested`: the CPU for the
    /// CPU; for CUDA, `cuda:LOCAL_RANK`, or `cuda:0` when the launcher made a single GPU
    /// visible to this rank (`CUDA_VISIBLE_DEVICES` naming one device). An error names the
    /// local rank and the devices this node shows.
    pub fn rank_device(&self, requested: Device) -> Result<Device> {
        match requested {
            Device::Cpu => Ok(Device::Cpu),
            Device::Cuda(_) => pick_cuda_device(
                self.local_rank,
                tandem_core::cuda::device_count(),
                std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            )
            .map_err(|problem| DistError::env(local_rank_var(self.source), problem)),
        }
    }
}

/// The variable that gave the local rank.
fn local_rank_var(source: EnvSource) -> &'static str {
    match source {
        EnvSource::Torchrun => "LOCAL_RANK",
        EnvSource::Slurm => "SLURM_LOCALID",
        EnvSource::OpenMpi => "OMPI_COMM_WORLD_LOCAL_RANK",
    }
}

/// The CUDA device of local rank `local_rank` on a node that shows `count` devices (see
/// [`LaunchEnv::rank_device`]).
fn pick_cuda_device(
    local_rank: usize,
    count: usize,
    visible: Option<&str>,
) -> std::result::Result<Device, String> {
    if count == 0 {
        return Err(format!(
            "is {local_rank}, and CUDA training needs a GPU per rank, but this process sees no \
             CUDA device"
        ));
    }
    if local_rank < count {
        return Ok(Device::Cuda(local_rank));
    }
    let one_visible =
        visible.is_some_and(|v| v.split(',').filter(|d| !d.trim().is_empty()).count() == 1);
    if count == 1 && one_visible {
        return Ok(Device::Cuda(0));
    }
    Err(format!(
        "is {local_rank}, so this rank would use cuda:{local_rank}, but this node shows {count} \
         CUDA device{} (CUDA_VISIBLE_DEVICES={}); start at most {count} rank{} per node",
        if count == 1 { "" } else { "s" },
        visible.map_or("unset".to_string(), |v| format!("{v:?}")),
        if count == 1 { "" } else { "s" },
    ))
}

/// Joins the job's process group as described by the environment, with the default options:
/// CPU training over TCP. Blocks until every rank has joined.
pub fn init_from_env() -> Result<Arc<dyn ProcessGroup>> {
    init_from_env_with_options(InitOptions::default())
}

/// [`init_from_env`] with a configuration (timeouts, thresholds): CPU training over TCP.
pub fn init_from_env_with(config: GroupConfig) -> Result<Arc<dyn ProcessGroup>> {
    init_from_env_with_options(InitOptions {
        group: config,
        ..InitOptions::default()
    })
}

/// Joins the job's process group for training on `device`: NCCL on this rank's GPU
/// (`cuda:LOCAL_RANK`) for a CUDA device, TCP for the CPU.
pub fn init_from_env_on(device: Device) -> Result<Arc<dyn ProcessGroup>> {
    init_from_env_with_options(InitOptions {
        device,
        ..InitOptions::default()
    })
}

/// Joins the job's process group as described by the environment and `options`.
pub fn init_from_env_with_options(options: InitOptions) -> Result<Arc<dyn ProcessGroup>> {
    init_with_options(&LaunchEnv::from_process_env()?, options)
}

/// Joins the process group described by `env` with `options`: picks the backend and this
/// rank's device, serves the store on rank 0 (unless a launcher does), and connects.
pub fn init_with_options(env: &LaunchEnv, options: InitOptions) -> Result<Arc<dyn ProcessGroup>> {
    let backend = options.backend.resolve(options.device)?;
    match backend {
        Backend::Nccl => {
            let device = env.rank_device(options.device)?;
            let (server, store) = join_store(env, &options.group)?;
            // Without a launcher serving it, the store lives in rank 0's process.
            let owner = (!env.store_hosted).then_some(0);
            let group = NcclProcessGroup::connect_with_server(
                store,
                env.rank,
                env.world_size,
                device,
                options.group,
                options.nccl,
                server,
                owner,
            )?;
            Ok(Arc::new(group))
        }
        _ => Ok(Arc::new(init_process_group(env, options.group)?)),
    }
}

/// Joins the TCP process group described by `env`: rank 0 serves the store (unless a launcher
/// does), every rank connects to it, then the ranks connect to each other.
pub fn init_process_group(env: &LaunchEnv, config: GroupConfig) -> Result<TcpProcessGroup> {
    let (server, store) = join_store(env, &config)?;
    TcpProcessGroup::connect_with_server(store, env.rank, env.world_size, config, server)
}

/// Serves the store on rank 0 (unless a launcher does) and connects to it.
fn join_store(
    env: &LaunchEnv,
    config: &GroupConfig,
) -> Result<(Option<StoreServer>, Arc<TcpStore>)> {
    let addr = env.store_addr();
    let server = if env.rank == 0 && !env.store_hosted {
        let store_config = StoreConfig {
            secret: env.secret.clone(),
            ..StoreConfig::default()
        };
        Some(StoreServer::bind_with(
            store_bind_addr(&addr, env.store_port),
            store_config,
        )?)
    } else {
        None
    };
    let store = Arc::new(TcpStore::connect_logging(
        &addr,
        config.connect_timeout,
        env.secret.clone(),
        &format!("rank {}", env.rank),
        config.wait_log_interval,
    )?);
    Ok((server, store))
}

/// Where rank 0 serves the store: the loopback address `addr` resolves to, if it is one (so a
/// single-host job is not reachable from the network); else every interface of its family.
fn store_bind_addr(addr: &str, port: u16) -> SocketAddr {
    let resolved = addr.to_socket_addrs().ok().and_then(|mut a| a.next());
    match resolved {
        Some(a) if a.ip().is_loopback() => SocketAddr::new(a.ip(), port),
        Some(a) if a.is_ipv6() => SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
        _ => SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const MASTER: [(&str, &str); 3] = [
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        (SECRET_VAR, "0123456789abcdef0123456789abcdef"),
    ];

    #[test]
    fn torchrun_variables_are_read() {
        let mut pairs = vec![
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
        ];
        pairs.extend(MASTER);
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(env.store_addr(), "10.0.0.1:29500");
        assert_eq!(env.source, EnvSource::Torchrun);
        assert!(!env.store_hosted);
    }

    #[test]
    fn local_variables_default_only_when_both_are_absent() {
        let mut pairs = vec![("RANK", "1"), ("WORLD_SIZE", "2")];
        pairs.extend(MASTER);
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!((env.local_rank, env.local_world_size), (1, 2));
        pairs.push(("LOCAL_RANK", "1"));
        let err = LaunchEnv::from_map(&map(&pairs)).unwrap_err().to_string();
        assert!(err.contains("LOCAL_WORLD_SIZE"), "{err}");
    }

    #[test]
    fn slurm_variables_are_read_including_compressed_task_lists() {
        let mut pairs = vec![
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x2),3"),
        ];
        pairs.extend(MASTER);
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (6, 7, 0, 3)
        );
        assert_eq!(env.source, EnvSource::Slurm);
        pairs.push(("SLURM_NTASKS_PER_NODE", "2"));
        assert_eq!(
            LaunchEnv::from_map(&map(&pairs)).unwrap().local_world_size,
            2
        );
        assert_eq!(slurm_tasks_on_node("4(x2),3", 1), Some(4));
        assert_eq!(slurm_tasks_on_node("4(x2),3", 3), None);
        assert_eq!(slurm_tasks_on_node("garbage", 0), None);
    }

    #[test]
    fn open_mpi_variables_are_read() {
        let mut pairs = vec![
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        pairs.extend(MASTER);
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 4, 1, 2)
        );
        assert_eq!(env.source, EnvSource::OpenMpi);
    }

    #[test]
    fn missing_and_malformed_variables_are_named() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![], "RANK"),
            (vec![("RANK", "0")], "WORLD_SIZE"),
            (vec![("RANK", "zero"), ("WORLD_SIZE", "2")], "RANK"),
            (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "MASTER_PORT",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
                "MASTER_ADDR",
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT",
            ),
            (
                vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
                "SLURM_LOCALID",
            ),
            (
                vec![
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_LOCALID", "0"),
                ],
                "SLURM_TASKS_PER_NODE",
            ),
            (
                vec![("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "x")],
                "OMPI_COMM_WORLD_SIZE",
            ),
        ];
        for (pairs, name) in cases {
            let err = LaunchEnv::from_map(&map(&pairs)).unwrap_err();
            assert!(
                matches!(&err, DistError::Env { name: n, .. } if n == name),
                "{pairs:?}: expected {name}, got {err}"
            );
        }
    }

    #[test]
    fn launcher_hosted_and_torchrun_agent_stores_are_respected() {
        let mut pairs = vec![("RANK", "0"), ("WORLD_SIZE", "2"), (STORE_HOSTED_VAR, "1")];
        pairs.extend(MASTER);
        assert!(LaunchEnv::from_map(&map(&pairs)).unwrap().store_hosted);
        pairs[2] = ("TORCHELASTIC_USE_AGENT_STORE", "True");
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!((env.master_port, env.store_port), (29500, 29501));
        pairs.push((STORE_HOSTED_VAR, "maybe"));
        assert!(LaunchEnv::from_map(&map(&pairs))
            .unwrap_err()
            .to_string()
            .contains(STORE_HOSTED_VAR));
    }

    #[test]
    fn absurd_world_sizes_are_refused_before_anything_is_allocated() {
        for world in ["1000000000000", "18446744073709551615", "50000000", "65537"] {
            let mut pairs = vec![("RANK", "0"), ("WORLD_SIZE", world)];
            pairs.extend(MASTER);
            let err = LaunchEnv::from_map(&map(&pairs)).unwrap_err().to_string();
            assert!(
                err.contains("WORLD_SIZE") && err.contains("65536") && err.len() < 200,
                "{err}"
            );
        }
        let err = LaunchEnv::from_map(&map(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "18446744073709551616"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("WORLD_SIZE") && err.contains("not a valid number"),
            "{err}"
        );
    }

    #[test]
    fn a_multi_rank_job_needs_a_secret_or_an_explicit_opt_out() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let err = LaunchEnv::from_map(&map(&base)).unwrap_err();
        assert!(
            matches!(&err, DistError::Env { name, .. } if name == SECRET_VAR),
            "{err}"
        );
        let mut pairs = base.to_vec();
        pairs.push((ALLOW_UNAUTHENTICATED_VAR, "1"));
        assert_eq!(LaunchEnv::from_map(&map(&pairs)).unwrap().secret, None);
        let mut pairs = base.to_vec();
        pairs.push((SECRET_VAR, "0123456789abcdef0123"));
        assert!(LaunchEnv::from_map(&map(&pairs)).unwrap().secret.is_some());
        let mut pairs = base.to_vec();
        pairs[1] = ("WORLD_SIZE", "1");
        assert_eq!(LaunchEnv::from_map(&map(&pairs)).unwrap().secret, None);
        assert!(store_bind_addr("127.0.0.1:1", 1).ip().is_loopback());
        assert!(store_bind_addr("localhost:1", 1).ip().is_loopback());
        assert!(store_bind_addr("10.1.2.3:1", 1).ip().is_unspecified());
    }

    #[test]
    fn auto_picks_nccl_for_cuda_and_tcp_for_the_cpu_and_explicit_choices_are_checked() {
        assert_eq!(Backend::Auto.resolve(Device::Cpu).unwrap(), Backend::Tcp);
        assert_eq!(
            Backend::Auto.resolve(Device::Cuda(3)).unwrap(),
            Backend::Nccl
        );
        assert_eq!(Backend::Tcp.resolve(Device::Cpu).unwrap(), Backend::Tcp);
        assert_eq!(
            Backend::Nccl.resolve(Device::Cuda(0)).unwrap(),
            Backend::Nccl
        );
        let err = Backend::Nccl.resolve(Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("NCCL backend needs CUDA"), "{err}");
        let err = Backend::Tcp
            .resolve(Device::Cuda(0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("TCP backend works on CPU tensors"), "{err}");
        for b in [Backend::Auto, Backend::Tcp, Backend::Nccl] {
            assert_eq!(b.name().parse::<Backend>().unwrap(), b);
        }
        assert_eq!(" NCCL ".parse::<Backend>().unwrap(), Backend::Nccl);
        assert!("gloo"
            .parse::<Backend>()
            .unwrap_err()
            .to_string()
            .contains("auto, tcp or nccl"));
        assert_eq!(InitOptions::default().backend, Backend::Auto);
        assert_eq!(InitOptions::default().device, Device::Cpu);
    }

    #[test]
    fn each_cuda_rank_uses_the_gpu_of_its_local_rank() {
        assert_eq!(pick_cuda_device(0, 8, None).unwrap(), Device::Cuda(0));
        assert_eq!(pick_cuda_device(7, 8, None).unwrap(), Device::Cuda(7));
        // srun --gpus-per-task=1: each rank sees only its own GPU.
        assert_eq!(pick_cuda_device(3, 1, Some("3")).unwrap(), Device::Cuda(0));
        let err = pick_cuda_device(2, 2, Some("0,1")).unwrap_err();
        assert!(
            err.contains("cuda:2") && err.contains("2 CUDA devices") && err.contains("\"0,1\""),
            "{err}"
        );
        let err = pick_cuda_device(1, 1, None).unwrap_err();
        assert!(err.contains("at most 1 rank per node"), "{err}");
        let err = pick_cuda_device(0, 0, None).unwrap_err();
        assert!(err.contains("sees no CUDA device"), "{err}");
        let mut pairs = vec![("RANK", "0"), ("WORLD_SIZE", "1")];
        pairs.extend(MASTER);
        let env = LaunchEnv::from_map(&map(&pairs)).unwrap();
        assert_eq!(env.rank_device(Device::Cpu).unwrap(), Device::Cpu);
        if tandem_core::cuda::device_count() == 0 {
            let err = env.rank_device(Device::Cuda(0)).unwrap_err();
            assert!(
                matches!(&err, DistError::Env { name, .. } if name == "LOCAL_RANK"),
                "{err}"
            );
        }
    }

    #[test]
    fn ipv6_master_addresses_are_bracketed() {
        let mut pairs = vec![
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "1234"),
        ];
        assert_eq!(
            LaunchEnv::from_map(&map(&pairs)).unwrap().store_addr(),
            "[::1]:1234"
        );
        pairs[2] = ("MASTER_ADDR", "localhost");
        assert_eq!(
            LaunchEnv::from_map(&map(&pairs)).unwrap().store_addr(),
            "localhost:1234"
        );
    }
}
