//! The NCCL backend: one process per GPU, collectives run by NCCL on a CUDA comm stream.
//!
//! **Setting up.** [`NcclProcessGroup::connect`] loads NCCL (`libnccl.so.2`, found like every
//! CUDA library, see `tandem_core::cuda::libs`; at least 2.14), opens this rank's device,
//! starts the rank's heartbeat (the group's rendezvous: every rank waits for every other's
//! first heartbeat in the store, see `monitor`), and exchanges the communicator's 128-byte
//! unique id through the store (rank 0 creates it). The communicator is created
//! *non-blocking*, so that it can be aborted at any moment, also while it is being created.
//!
//! **Stream order.** Each collective is issued on the group's comm stream (a CUDA stream of
//! the rank's device) after that stream has waited for an event recorded on the device's
//! compute stream, so it sees everything the caller computed before issuing it, without
//! blocking the host. The returned [`Work`] holds the collective's tensors until it is known to
//! be done, and the tensors' memory is marked as used by the comm stream (`record_stream`), so
//! it is never reused under a running collective. [`Work::wait`] makes the compute stream wait
//! for the collective's end event and returns at once; [`Work::wait_host`] blocks the host. A
//! barrier (an all-reduce of one element) blocks the host in `wait`, as a barrier must.
//!
//! **Failures, never a hang.** A watchdog thread per group checks NCCL's asynchronous error
//! state, notes how far the comm stream has got, and asks the heartbeat monitor for a verdict:
//! a rank that died (the store notices its connection close), stopped or hung (its heartbeat
//! stopped), failed, left early, or issued different collectives; or a collective of this rank
//! that ran longer than [`GroupConfig::timeout`] after it started. On a verdict it fails every
//! collective in flight with an error naming the rank and the sequence number, publishes the
//! failure in its heartbeat (so every other rank fails within one heartbeat interval, naming
//! the culprit), leaves a failure report for `tandem-run`, and aborts the communicator
//! (`ncclCommAbort`), which ends NCCL's kernels so that nothing waits on them for ever. Later
//! calls fail with [`DistError::GroupBroken`]. With the default
//! [`NcclConfig::failure_timeout`] of 10 s, a rank whose process dies is noticed in about one
//! second, one that is stopped in about five.
//!
//! **Mismatched collectives.** NCCL cannot tell that two ranks issued different collectives
//! (it may hang, or silently combine the wrong buffers). Each rank publishes the descriptors of
//! its last 64 collectives with its heartbeat, and compares its own with those of the next
//! rank at every heartbeat: a difference fails the group with both descriptors and the
//! sequence number, as on TCP, within about one heartbeat interval, at no cost on the issuing
//! path. As the check runs beside the collectives, a mismatched collective that happens to
//! complete is reported at the next collective. [`NcclConfig::check_every_collective`] (off by
//! default; PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` plays the same part) checks each
//! collective against the next rank's through the store before issuing it, so that a
//! mismatched collective is never run, at the cost of a store round trip per collective.
//!
//! **Several ranks on one GPU (testing only).** NCCL up to 2.29 refuses two ranks of a
//! communicator on one GPU ("Duplicate GPU detected"). Giving every rank its own `NCCL_HOSTID`
//! environment variable makes NCCL believe they run on different hosts, so they talk over
//! sockets; tandem's tests use this to run two ranks on a machine with one GPU. It is slow and
//! unsupported by NVIDIA: never use it for training.

mod args;
mod collectives;
mod comm;
mod ffi;
mod issue;
mod monitor;
mod record;
mod unique_id;
mod watchdog;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_core::cuda::CudaDevice;
use tandem_core::{DType, Device, Event, Stream, Tensor};

use self::comm::{Comm, CommFailure};
use self::ffi::{Api, RawStream};
pub use self::ffi::{NcclVersion, MIN_VERSION, UNIQUE_ID_BYTES};
use self::monitor::{Monitor, MonitorSetup, Timing};
pub use self::unique_id::{exchange_unique_id, library_path, version, UniqueId};
use super::{CollectiveDesc, GroupConfig, Work};
use crate::process_group::MAX_WORLD_SIZE;
use crate::store::{StoreServer, TcpStore};
use crate::{DistError, Result};

/// Settings of an NCCL process group beside the [`GroupConfig`] every backend takes (of which
/// an NCCL group uses `name`, `timeout` — the longest time one collective may run on the comm
/// stream —, `connect_timeout` — rendezvous and communicator creation — and
/// `wait_log_interval`; the TCP transport settings do not apply). Every rank must use the same
/// values.
#[derive(Clone, Debug)]
pub struct NcclConfig {
    /// Longest time between a rank dying, stopping or failing and every other rank failing
    /// with an error naming it. Heartbeats are published every 1/40 of it and a rank whose
    /// heartbeat stops counts as stopped after half of it. Default: 10 s.
    pub failure_timeout: Duration,
    /// Checks every collective against the next rank's through the store before issuing it,
    /// so that mismatched collectives are never run (one store round trip per collective; for
    /// debugging). Off by default: the heartbeats compare the ranks' collectives at no cost
    /// on the issuing path, a moment after they are issued. Default: false.
    pub check_every_collective: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            failure_timeout: Duration::from_secs(10),
            check_every_collective: false,
        }
    }
}

/// Most collectives in flight on one rank. Issuing another first waits (on the host) for the
/// oldest to finish, so the host never runs so far ahead that CUDA's launch queues fill up —
/// a full queue blocks kernel launches, NCCL's included, where no abort can reach them.
const MAX_IN_FLIGHT: usize = 128;

/// A collective issued and not yet seen finishing.
struct Pending {
    work: Work,
    seq: u64,
    desc: CollectiveDesc,
    start: Event,
    end: Event,
    /// When the watchdog first saw `start` complete.
    started_at: Option<Instant>,
}

/// A collective being issued: checked against the neighbour or enqueued by NCCL.
#[derive(Clone, Copy)]
struct Issuing {
    seq: u64,
    desc: CollectiveDesc,
    since: Instant,
}

/// What the group handle, its issuing threads and its watchdog share.
struct Shared {
    rank: usize,
    world: usize,
    device: Device,
    group: GroupConfig,
    config: NcclConfig,
    prefix: String,
    cuda: Arc<CudaDevice>,
    comm: Comm,
    monitor: Monitor,
    compute: Stream,
    comm_stream: Stream,
    /// The raw comm stream handed to NCCL.
    raw_stream: RawStream,
    /// The next sequence number; held while a collective is issued, so numbers and NCCL's
    /// order agree.
    next_seq: Mutex<u64>,
    issuing: Mutex<Option<Issuing>>,
    pending: Mutex<VecDeque<Pending>>,
    /// The failure that broke the group (set under the `pending` lock).
    broken: Mutex<Option<DistError>>,
    store: Arc<TcpStore>,
    stop: AtomicBool,
}

// SAFETY: `raw_stream` is a CUDA stream handle, usable from any thread (the driver API is
// thread-safe); it stays valid while `comm_stream`, which owns it, lives in the same struct.
unsafe impl Send for Shared {}
// SAFETY: as above; every other field is Sync.
unsafe impl Sync for Shared {}

impl Shared {
    fn broken(&self) -> Option<DistError> {
        self.broken.lock().clone()
    }

    /// The error to report for `nccl_error`, met while issuing a collective. A peer whose
    /// process died makes NCCL report a remote error before the store has noticed, so this
    /// gives the watchdog the time it takes itself (the heartbeats' `stale_after` and one
    /// interval, plus a margin) to name the rank behind it, and reports the group's failure if
    /// one comes; NCCL's own error otherwise.
    fn explain_nccl_error(&self, nccl_error: DistError) -> DistError {
        let timing = self.monitor.timing();
        let deadline = Instant::now() + timing.stale_after + timing.interval * 3;
        while Instant::now() < deadline {
            if let Some(verdict) = self.broken() {
                return verdict;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        self.broken().unwrap_or(nccl_error)
    }

    /// Settles the collectives at the head of the queue whose end events have completed;
    /// returns the last one's sequence number (0 if none) and how many remain in flight.
    fn retire_finished(&self) -> (u64, usize) {
        let mut pending = self.pending.lock();
        let mut done = 0;
        while let Some(front) = pending.front() {
            if !front.end.is_complete() {
                break;
            }
            front.work.settle(Ok(()));
            done = front.seq;
            pending.pop_front();
        }
        (done, pending.len())
    }

    /// Waits until fewer than [`MAX_IN_FLIGHT`] collectives are in flight, or the group fails.
    fn make_room(&self) -> Option<DistError> {
        let mut nap = Duration::from_micros(20);
        loop {
            if let Some(cause) = self.broken() {
                return Some(cause);
            }
            let (done, in_flight) = self.retire_finished();
            if done > 0 {
                self.monitor.record_progress(0, done);
            }
            if in_flight < MAX_IN_FLIGHT {
                return None;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    fn group_broken(&self, desc: &CollectiveDesc, seq: u64, cause: DistError) -> DistError {
        DistError::GroupBroken {
            rank: self.rank,
            collective: desc.to_string(),
            seq,
            cause: Box::new(cause),
        }
    }

    /// Fails the group with `err` (the first failure wins): settles every collective in
    /// flight, tells the other ranks and the launcher, aborts the communicator.
    fn fail(&self, err: DistError) {
        {
            // Under the queue's lock, as the issuing path checks it: a collective issued from
            // now on is settled with the failure there instead of joining the queue.
            let _pending = self.pending.lock();
            let mut broken = self.broken.lock();
            if broken.is_some() {
                return;
            }
            *broken = Some(err.clone());
        }
        // The launcher's report and the other ranks' notice go out before this rank's waiters
        // wake: an application that exits on the error at once, or a peer that does, must not
        // outrun them (the launcher then stops this rank before it has reported).
        crate::failure_report::post(&self.store, self.rank, &err);
        self.monitor.publish_failure(&err);
        for (i, p) in self.pending.lock().drain(..).enumerate() {
            if p.end.is_complete() {
                p.work.settle(Ok(()));
            } else if i == 0 {
                p.work.settle(Err(err.clone()));
            } else {
                p.work
                    .settle(Err(self.group_broken(&p.desc, p.seq, err.clone())));
            }
        }
        eprintln!(
            "tandem: rank {}: NCCL group {:?} failed; aborting its communicator: {err}",
            self.rank, self.group.name
        );
        self.comm.abort();
    }
}

/// A process group whose ranks are processes, one per GPU, running collectives with NCCL. See
/// the module docs.
pub struct NcclProcessGroup {
    shared: Arc<Shared>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    /// One element all-reduced by `barrier`.
    barrier: Tensor,
    store: Arc<TcpStore>,
    /// The store this rank serves (rank 0 without a launcher), kept until the others are done.
    server: Mutex<Option<StoreServer>>,
}

impl std::fmt::Debug for NcclProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclProcessGroup(rank {} of {} on {}, group {:?}, NCCL {})",
            self.shared.rank,
            self.shared.world,
            self.shared.device,
            self.shared.group.name,
            self.shared.comm.version()
        )
    }
}

fn connect_error(rank: usize, detail: impl Into<String>) -> DistError {
    DistError::Connect {
        rank,
        detail: detail.into(),
    }
}

impl NcclProcessGroup {
    /// Joins the NCCL group `group.name` as `rank` of `world_size`, on the CUDA device
    /// `device`, meeting the other ranks through `store`. Blocks until every rank has joined
    /// (at most `group.connect_timeout`).
    pub fn connect(
        store: Arc<TcpStore>,
        rank: usize,
        world_size: usize,
        device: Device,
        group: GroupConfig,
        config: NcclConfig,
    ) -> Result<Self> {
        Self::connect_with_server(store, rank, world_size, device, group, config, None, None)
    }

    /// Like [`NcclProcessGroup::connect`]; `server` is the store this rank serves (kept until
    /// the other ranks are done with it) and `store_owner` the rank whose process serves the
    /// store, if a rank does (losing the store then names that rank).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect_with_server(
        store: Arc<TcpStore>,
        rank: usize,
        world: usize,
        device: Device,
        group: GroupConfig,
        config: NcclConfig,
        server: Option<StoreServer>,
        store_owner: Option<usize>,
    ) -> Result<Self> {
        if world == 0 || rank >= world || world > MAX_WORLD_SIZE {
            return Err(connect_error(
                rank,
                format!(
                    "rank {rank} is not in a group of {world} (a group has 1 to {MAX_WORLD_SIZE} \
                     ranks)"
                ),
            ));
        }
        let Device::Cuda(ordinal) = device else {
            return Err(connect_error(
                rank,
                format!("the NCCL backend needs a CUDA device, not {device}"),
            ));
        };
        let api = ffi::api().map_err(DistError::NcclUnavailable)?;
        let cuda = tandem_core::cuda::device(ordinal)
            .map_err(|e| connect_error(rank, format!("opening {device}: {e}")))?;
        let name = &group.name;
        let generation = store.add(&format!("tandem/{name}/nccl/instances/{rank}"), 1)?;
        let prefix = format!("tandem/{name}/nccl/{generation}");
        let timing = Timing::new(config.failure_timeout, world);
        let monitor = Monitor::start(MonitorSetup {
            store: &store,
            prefix: prefix.clone(),
            rank,
            world,
            timing,
            store_owner,
            connect_timeout: group.connect_timeout,
            wait_log_interval: group.wait_log_interval,
        })?;
        let id = exchange_unique_id(
            &store,
            rank,
            &format!("{prefix}/unique_id"),
            group.connect_timeout,
        )?;
        let (compute, comm_stream, raw_stream) = streams(rank, device)?;
        let comm = create_comm(api, cuda.clone(), rank, world, &id, &group, &monitor)?;
        let barrier = Tensor::zeros(&[1], DType::F32, device)
            .map_err(|e| connect_error(rank, format!("the barrier buffer: {e}")))?;
        let shared = Arc::new(Shared {
            rank,
            world,
            device,
            group,
            config,
            prefix,
            cuda,
            comm,
            monitor,
            compute,
            comm_stream,
            raw_stream,
            next_seq: Mutex::new(1),
            issuing: Mutex::new(None),
            pending: Mutex::new(VecDeque::new()),
            broken: Mutex::new(None),
            store: store.clone(),
            stop: AtomicBool::new(false),
        });
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("tandem-nccl-watchdog-{rank}"))
            .spawn(move || watchdog::run(&watched))
            .map_err(|e| DistError::io("starting the NCCL watchdog thread", e))?;
        Ok(NcclProcessGroup {
            shared,
            watchdog: Mutex::new(Some(watchdog)),
            barrier,
            store,
            server: Mutex::new(server),
        })
    }

    /// The rendezvous store the group met through (usable for the application's own keys).
    pub fn store(&self) -> &Arc<TcpStore> {
        &self.store
    }

    /// The group's configuration.
    pub fn group_config(&self) -> &GroupConfig {
        &self.shared.group
    }

    /// The group's NCCL settings.
    pub fn nccl_config(&self) -> &NcclConfig {
        &self.shared.config
    }

    /// This rank's device.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// The NCCL library's version.
    pub fn nccl_version(&self) -> NcclVersion {
        self.shared.comm.version()
    }

    /// The failure that broke the group, if it is broken.
    pub fn failure(&self) -> Option<DistError> {
        self.shared.broken()
    }
}

/// The device's compute stream, a new comm stream for this rank, and the comm stream's raw
/// handle for NCCL.
fn streams(rank: usize, device: Device) -> Result<(Stream, Stream, RawStream)> {
    let stream_err = |e: tandem_core::Error| connect_error(rank, format!("{device}: {e}"));
    let compute = Stream::compute(device).map_err(stream_err)?;
    let comm_stream =
        Stream::new_on(device, &format!("tandem-nccl-comm-{rank}")).map_err(stream_err)?;
    let raw_stream = comm_stream
        .cuda_stream()
        .map(|s| s.cu_stream() as RawStream)
        .ok_or_else(|| connect_error(rank, "the comm stream is not a CUDA stream"))?;
    Ok((compute, comm_stream, raw_stream))
}

/// Creates this rank's communicator (non-blocking, so that it can be aborted: by the connect
/// timeout, or by the monitor's verdict on another rank) and checks that NCCL placed it where
/// asked.
fn create_comm(
    api: &'static Api,
    cuda: Arc<CudaDevice>,
    rank: usize,
    world: usize,
    id: &UniqueId,
    group: &GroupConfig,
    monitor: &Monitor,
) -> Result<Comm> {
    let deadline = Instant::now() + group.connect_timeout;
    let init_interrupt = || {
        if Instant::now() > deadline {
            return Some(connect_error(
                rank,
                format!(
                    "creating the NCCL communicator timed out after {:?}",
                    group.connect_timeout
                ),
            ));
        }
        monitor.assess(Instant::now(), None, group.timeout)
    };
    let comm =
        Comm::init(api, cuda, world, rank, id, &init_interrupt).map_err(
            |failure| match failure {
                CommFailure::Interrupted(e) => e,
                CommFailure::Nccl(detail) => DistError::Nccl {
                    rank,
                    op: "creating the communicator".into(),
                    detail,
                },
                CommFailure::Gone => connect_error(rank, "the communicator was aborted"),
            },
        )?;
    match comm.count_and_rank() {
        Ok((count, me)) if count == world && me == rank => {}
        Ok((count, me)) => {
            return Err(connect_error(
                rank,
                format!("NCCL created a communicator for rank {me} of {count}"),
            ))
        }
        Err(e) => return Err(connect_error(rank, format!("{e:?}"))),
    }
    Ok(comm)
}

impl Drop for NcclProcessGroup {
    fn drop(&mut self) {
        let s = &*self.shared;
        // Collectives already issued finish first (the watchdog still fails them if a peer is
        // lost or they time out).
        while s.broken().is_none() && !s.pending.lock().is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        s.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.watchdog.lock().take() {
            let _ = t.join();
        }
        // Tell the others that this rank leaves after its last collective, then take the
        // communicator down in step with them (or abort it if that does not happen in time).
        s.monitor.leave();
        if s.broken().is_none() {
            let deadline = Instant::now() + s.config.failure_timeout;
            let interrupt = || {
                (Instant::now() > deadline).then(|| DistError::Nccl {
                    rank: s.rank,
                    op: "ncclCommFinalize".into(),
                    detail: "did not finish in time".into(),
                })
            };
            if let Err(e) = s.comm.finalize_and_destroy(&interrupt) {
                eprintln!(
                    "tandem: rank {}: NCCL group {:?}: finalizing the communicator failed, \
                     aborted it instead: {e:?}",
                    s.rank, s.group.name
                );
            }
        } else {
            s.comm.abort();
        }
        if self.server.lock().is_some() {
            s.monitor.wait_for_others(s.group.timeout);
        }
        self.server.lock().take();
    }
}
