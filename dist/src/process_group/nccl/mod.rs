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
mod comm;
mod ffi;
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
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::cuda::CudaDevice;
use tandem_core::{DType, Device, Event, Stream, Tensor};

use self::args::Buffer;
use self::comm::{Comm, CommFailure};
use self::ffi::{Api, NcclStatus, RawComm, RawStream};
pub use self::ffi::{NcclVersion, MIN_VERSION, UNIQUE_ID_BYTES};
use self::monitor::{Monitor, MonitorSetup, Timing};
pub use self::unique_id::{exchange_unique_id, library_path, version, UniqueId};
use super::work::DeviceWork;
use super::{CollectiveDesc, CollectiveKind, GroupConfig, ProcessGroup, ReduceOp, Work};
use crate::rendezvous::MAX_WORLD_SIZE;
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
            let mut pending = self.pending.lock();
            {
                let mut broken = self.broken.lock();
                if broken.is_some() {
                    return;
                }
                *broken = Some(err.clone());
            }
            for (i, p) in pending.drain(..).enumerate() {
                if p.end.is_complete() {
                    p.work.settle(Ok(()));
                } else if i == 0 {
                    p.work.settle(Err(err.clone()));
                } else {
                    p.work
                        .settle(Err(self.group_broken(&p.desc, p.seq, err.clone())));
                }
            }
        }
        self.monitor.publish_failure(&err);
        crate::failure_report::post(&self.store, self.rank, &err);
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
        let stream_err = |e: tandem_core::Error| connect_error(rank, format!("{device}: {e}"));
        let compute = Stream::compute(device).map_err(stream_err)?;
        let comm_stream =
            Stream::new_on(device, &format!("tandem-nccl-comm-{rank}")).map_err(stream_err)?;
        let raw_stream = comm_stream
            .cuda_stream()
            .map(|s| s.cu_stream() as RawStream)
            .ok_or_else(|| connect_error(rank, "the comm stream is not a CUDA stream"))?;
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
        let comm = Comm::init(api, cuda.clone(), world, rank, &id, &init_interrupt).map_err(
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

    /// Issues one collective: orders the comm stream after the compute stream, has NCCL
    /// enqueue it (`call`, skipped for an empty collective), records its end, and hands back
    /// the work. `tensors` are held by the work and marked as used on the comm stream; `uses`
    /// says which device addresses NCCL reads and writes (for the stream sanitizer).
    fn issue(
        &self,
        desc: CollectiveDesc,
        tensors: Vec<Tensor>,
        uses: &[(u64, Use)],
        blocks_host: bool,
        call: impl FnOnce(&'static Api, RawComm, RawStream) -> NcclStatus,
    ) -> Result<Work> {
        let s = &*self.shared;
        let mut next = s.next_seq.lock();
        let seq = *next;
        if let Some(cause) = s.make_room() {
            return Err(s.group_broken(&desc, seq, cause));
        }
        *s.issuing.lock() = Some(Issuing {
            seq,
            desc,
            since: Instant::now(),
        });
        let issued = self.issue_locked(seq, desc, &tensors, uses, call);
        *s.issuing.lock() = None;
        let (start, end) = match issued {
            Ok(events) => events,
            Err(Failure::BeforeIssue(e)) => return Err(e),
            Err(Failure::Fatal(e)) => {
                s.fail(e.clone());
                return Err(s.broken().map_or(e, |first| first));
            }
        };
        s.monitor.record_issue(seq, &desc);
        *next = seq + 1;
        drop(next);
        let work = Work::on_device(
            seq,
            desc,
            end.clone(),
            DeviceWork {
                rank: s.rank,
                compute: s.compute.clone(),
                start: start.clone(),
                keep_alive: Mutex::new(tensors),
                blocks_host,
            },
        );
        let mut pending = s.pending.lock();
        match s.broken() {
            // The watchdog failed the group while this collective was being issued, after it
            // settled the collectives it knew of: settle this one too.
            Some(cause) => work.settle(Err(s.group_broken(&desc, seq, cause))),
            None => pending.push_back(Pending {
                work: work.clone(),
                seq,
                desc,
                start,
                end,
                started_at: None,
            }),
        }
        Ok(work)
    }

    /// The steps of [`NcclProcessGroup::issue`] that may fail; returns the start and end events.
    fn issue_locked(
        &self,
        seq: u64,
        desc: CollectiveDesc,
        tensors: &[Tensor],
        uses: &[(u64, Use)],
        call: impl FnOnce(&'static Api, RawComm, RawStream) -> NcclStatus,
    ) -> std::result::Result<(Event, Event), Failure> {
        let s = &*self.shared;
        let label = format!("{desc} (collective #{seq})");
        let device_err = |what: &str, e: tandem_core::Error| {
            DistError::tensor(
                s.rank,
                format!("{} (collective #{seq}): {what}", desc.kind.name()),
                e,
            )
        };
        if s.config.check_every_collective {
            self.check_with_neighbour(seq, &desc)?;
        }
        // Nothing has been issued yet: a failure here leaves the group intact.
        s.cuda
            .bind("NCCL collective")
            .map_err(|e| Failure::BeforeIssue(device_err("binding the device", e)))?;
        let ready = s
            .compute
            .record_event()
            .map_err(|e| Failure::BeforeIssue(device_err("recording the compute stream", e)))?;
        // From here on the comm stream has work queued for this collective, so any failure
        // breaks the group (the other ranks expect this collective).
        let fatal = |what: &str, e: tandem_core::Error| Failure::Fatal(device_err(what, e));
        s.comm_stream
            .wait_event(&ready)
            .map_err(|e| fatal("ordering the comm stream after the compute stream", e))?;
        let start = s
            .comm_stream
            .record_event()
            .map_err(|e| fatal("recording the start", e))?;
        // Marked before the call, so that a tensor freed after NCCL refused the call (the
        // sanitizer has seen its buffers declared on the comm stream by then) still waits for
        // the comm stream: a free waits for the comm stream's work queued by then.
        for t in tensors {
            t.record_stream(&s.comm_stream)
                .map_err(|e| fatal("marking a tensor as used by the comm stream", e))?;
        }
        if desc.numel > 0 || desc.kind == CollectiveKind::Barrier {
            let timeout = s.group.timeout;
            let since = Instant::now();
            let interrupt = || {
                s.broken().or_else(|| {
                    (since.elapsed() > timeout).then(|| DistError::Timeout {
                        rank: s.rank,
                        collective: desc.to_string(),
                        seq,
                        timeout,
                        waiting_for: Vec::new(),
                    })
                })
            };
            // The collective's buffers, declared once the comm stream is ordered after compute.
            if let Some(cuda) = s.comm_stream.cuda_stream() {
                sanitizer::access(s.comm_stream.device(), cuda, nccl_name(desc.kind), uses)
                    .map_err(|e| fatal("the stream sanitizer", e))?;
            }
            let raw_stream = s.raw_stream;
            s.comm
                .enqueue(&label, &interrupt, |api, comm| call(api, comm, raw_stream))
                .map_err(|failure| {
                    Failure::Fatal(match failure {
                        CommFailure::Interrupted(e) => e,
                        CommFailure::Nccl(detail) => s.explain_nccl_error(DistError::Nccl {
                            rank: s.rank,
                            op: label.clone(),
                            detail,
                        }),
                        CommFailure::Gone => s.broken().unwrap_or_else(|| DistError::Nccl {
                            rank: s.rank,
                            op: label.clone(),
                            detail: "the communicator was aborted".into(),
                        }),
                    })
                })?;
        }
        let end = s
            .comm_stream
            .record_event()
            .map_err(|e| fatal("recording the end", e))?;
        Ok((start, end))
    }

    /// `check_every_collective`: publishes this collective's descriptor and compares it with
    /// the next rank's for the same sequence number (the reader deletes the key it read).
    fn check_with_neighbour(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
    ) -> std::result::Result<(), Failure> {
        let s = &*self.shared;
        if s.world < 2 {
            return Ok(());
        }
        let peer = (s.rank + 1) % s.world;
        let mine = format!("{}/check/{seq}/{}", s.prefix, s.rank);
        let theirs = format!("{}/check/{seq}/{peer}", s.prefix);
        s.store
            .set(&mine, &record::encode_desc(desc))
            .map_err(Failure::BeforeIssue)?;
        let deadline = Instant::now() + s.group.timeout;
        let bytes = loop {
            match s.store.get_timeout(&theirs, Duration::from_millis(100)) {
                Ok(bytes) => break bytes,
                Err(DistError::StoreTimeout { .. }) => {
                    if let Some(cause) = s.broken() {
                        return Err(Failure::BeforeIssue(s.group_broken(desc, seq, cause)));
                    }
                    if Instant::now() > deadline {
                        return Err(Failure::Fatal(DistError::Timeout {
                            rank: s.rank,
                            collective: desc.to_string(),
                            seq,
                            timeout: s.group.timeout,
                            waiting_for: vec![peer],
                        }));
                    }
                }
                Err(e) => return Err(Failure::BeforeIssue(e)),
            }
        };
        let _ = s.store.delete(&theirs);
        let theirs = record::decode_desc(&bytes).map_err(|problem| {
            Failure::Fatal(DistError::Protocol {
                rank: s.rank,
                peer,
                collective: desc.to_string(),
                seq,
                problem: format!("its descriptor in the store is malformed: {problem}"),
            })
        })?;
        if theirs != *desc {
            return Err(Failure::Fatal(DistError::Mismatch {
                rank: s.rank,
                peer,
                seq,
                their_seq: seq,
                ours: desc.to_string(),
                theirs: theirs.to_string(),
            }));
        }
        Ok(())
    }

    fn check(&self, collective: &'static str, what: &str, t: &Tensor) -> Result<Buffer> {
        args::check(self.shared.rank, self.shared.device, collective, what, t)
    }
}

/// How issuing a collective failed.
enum Failure {
    /// Before anything was queued: the group is intact.
    BeforeIssue(DistError),
    /// After work was queued, or a mismatch: the group must fail.
    Fatal(DistError),
}

impl From<DistError> for Failure {
    fn from(e: DistError) -> Self {
        Failure::Fatal(e)
    }
}

impl ProcessGroup for NcclProcessGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn comm_stream(&self) -> &Stream {
        &self.shared.comm_stream
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        const NAME: &str = "all_reduce";
        let rank = self.shared.rank;
        let buf = self.check(NAME, "tensor", tensor)?;
        args::check_reducible(rank, NAME, tensor)?;
        let desc = args::desc(
            CollectiveKind::AllReduce,
            Some(tensor.dtype()),
            tensor.numel(),
            Some(op),
            None,
        );
        let (count, dtype, op) = (
            tensor.numel(),
            args::nccl_type(tensor.dtype()),
            args::nccl_op(op, self.shared.world),
        );
        self.issue(
            desc,
            vec![tensor.clone()],
            &[(buf.ptr, Use::Write)],
            false,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: `ptr` addresses `count` elements of `dtype` on this group's device (checked
                // above), kept alive by the work until the collective is done; in place is allowed.
                unsafe { (api.all_reduce)(ptr, ptr, count, dtype, op, comm, stream) }
            },
        )
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        const NAME: &str = "broadcast";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let buf = self.check(NAME, "tensor", tensor)?;
        if root >= world {
            return Err(DistError::InvalidArgument {
                rank,
                collective: NAME,
                problem: format!("root {root} is not a rank of a group of {world}"),
            });
        }
        let desc = args::desc(
            CollectiveKind::Broadcast,
            Some(tensor.dtype()),
            tensor.numel(),
            None,
            Some(root),
        );
        let (count, dtype) = (tensor.numel(), args::nccl_type(tensor.dtype()));
        // The root sends its tensor, every other rank receives into its own.
        let use_ = if rank == root { Use::Read } else { Use::Write };
        self.issue(
            desc,
            vec![tensor.clone()],
            &[(buf.ptr, use_)],
            false,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: as in all_reduce; `root` is a rank of the communicator.
                unsafe {
                    (api.broadcast)(
                        ptr,
                        ptr,
                        count,
                        dtype,
                        root as std::ffi::c_int,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        const NAME: &str = "all_gather";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let mut inp = self.check(NAME, "input", input)?;
        let out = self.check(NAME, "output", output)?;
        args::check_same_dtype(rank, NAME, input, output)?;
        args::check_world_multiple(rank, world, NAME, ("output", output), ("input", input))?;
        let desc = args::desc(
            CollectiveKind::AllGather,
            Some(input.dtype()),
            input.numel(),
            None,
            None,
        );
        let mut held = vec![input.clone(), output.clone()];
        // NCCL allows the input to be this rank's block of the output (in place); any other
        // overlap would have NCCL read what it is writing, so such an input is copied first.
        let in_place = inp.ptr == out.ptr + rank as u64 * inp.bytes;
        if inp.overlaps(&out) && !in_place {
            let copy = staged(input).map_err(|e| tensor_error(rank, NAME, e))?;
            inp = self.check(NAME, "input", &copy)?;
            held.push(copy);
        }
        let (count, dtype) = (input.numel(), args::nccl_type(input.dtype()));
        let uses = [(inp.ptr, Use::Read), (out.ptr, Use::Write)];
        self.issue(desc, held, &uses, false, move |api, comm, stream| {
            // SAFETY: `inp` holds `count` elements and `out` `world × count`, of `dtype`, on this
            // group's device, alive until the collective is done, and disjoint or in place.
            unsafe {
                (api.all_gather)(
                    inp.ptr as *const std::ffi::c_void,
                    out.ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    comm,
                    stream,
                )
            }
        })
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work> {
        const NAME: &str = "reduce_scatter";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let mut inp = self.check(NAME, "input", input)?;
        let out = self.check(NAME, "output", output)?;
        args::check_same_dtype(rank, NAME, input, output)?;
        args::check_reducible(rank, NAME, input)?;
        args::check_world_multiple(rank, world, NAME, ("input", input), ("output", output))?;
        let desc = args::desc(
            CollectiveKind::ReduceScatter,
            Some(output.dtype()),
            output.numel(),
            Some(op),
            None,
        );
        let mut held = vec![input.clone(), output.clone()];
        // The input must survive unchanged, so an output that shares its memory (NCCL's in-place
        // form writes into the input) gets a copy of the input to read from.
        if inp.overlaps(&out) {
            let copy = staged(input).map_err(|e| tensor_error(rank, NAME, e))?;
            inp = self.check(NAME, "input", &copy)?;
            held.push(copy);
        }
        let (count, dtype, op) = (
            output.numel(),
            args::nccl_type(output.dtype()),
            args::nccl_op(op, world),
        );
        let uses = [(inp.ptr, Use::Read), (out.ptr, Use::Write)];
        self.issue(desc, held, &uses, false, move |api, comm, stream| {
            // SAFETY: `inp` holds `world × count` elements and `out` `count`, of `dtype`, on this
            // group's device, alive until the collective is done, and disjoint.
            unsafe {
                (api.reduce_scatter)(
                    inp.ptr as *const std::ffi::c_void,
                    out.ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    op,
                    comm,
                    stream,
                )
            }
        })
    }

    fn barrier(&self) -> Result<Work> {
        let buf = self.check("barrier", "barrier buffer", &self.barrier)?;
        let desc = super::describe_barrier();
        self.issue(
            desc,
            vec![self.barrier.clone()],
            &[(buf.ptr, Use::Write)],
            true,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: the group's own one-element f32 buffer on its device, alive with the group.
                unsafe {
                    (api.all_reduce)(
                        ptr,
                        ptr,
                        1,
                        ffi::data_type::FLOAT32,
                        ffi::red_op::SUM,
                        comm,
                        stream,
                    )
                }
            },
        )
    }
}

/// The NCCL function a collective calls, as the stream sanitizer names it.
fn nccl_name(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::AllReduce | CollectiveKind::Barrier => "ncclAllReduce",
        CollectiveKind::Broadcast => "ncclBroadcast",
        CollectiveKind::AllGather => "ncclAllGather",
        CollectiveKind::ReduceScatter => "ncclReduceScatter",
    }
}

/// A fresh copy of `t` on its device (made on the compute stream, before the collective).
fn staged(t: &Tensor) -> tandem_core::Result<Tensor> {
    let copy = Tensor::empty(t.dims(), t.dtype(), t.device())?;
    copy.copy_(t)?;
    Ok(copy)
}

fn tensor_error(rank: usize, collective: &'static str, e: tandem_core::Error) -> DistError {
    DistError::tensor(rank, collective, e)
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
