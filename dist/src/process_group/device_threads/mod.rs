//! The device-threads backend: ranks are threads of one process sharing ONE CUDA device, so the
//! multi-rank paths (DDP's equivalence suite above all) run on a machine with a single GPU.
//!
//! Each rank has its own comm stream on the device. A collective on device tensors runs in
//! three steps, all issued by the calling thread:
//!
//! 1. **Snapshot.** The rank's comm stream waits on an event recorded on the device's compute
//!    stream (so it sees what was written there), copies its contribution into fresh device
//!    memory allocated in the comm stream's order, and records a *ready* event.
//! 2. **Rendezvous.** The rank posts the snapshot and its ready event on the group's board
//!    (`board.rs`, shared with the threads backend) under the collective's sequence number and
//!    descriptor, and waits — on the host — until every rank has posted the same collective. A
//!    different descriptor is a mismatch naming both ranks; a rank that left or failed is named;
//!    nothing waits longer than the group's timeout.
//! 3. **Result.** The comm stream waits on every other rank's ready event (a device-side wait),
//!    then one kernel computes this rank's result from all snapshots in rank order
//!    (`device_group.cu`: the same reduction on every rank, hence bit-identical results), and a
//!    *done* event is recorded. The [`Work`] completes when the device passes it.
//!
//! The host never waits for device work inside a collective: it waits only for the other ranks'
//! threads to *issue* the collective. That host rendezvous is also what keeps the device free of
//! deadlocks: all ranks share the device's compute stream, and a comm stream that waited on the
//! device for a peer's future work could stall that stream behind work the peer has not issued
//! yet; here every device-side wait refers to an event that was already recorded. The price is
//! that issuing a collective blocks until every rank has issued it, so each rank must issue from
//! its own thread (ranks are threads, as the name says).
//!
//! Memory: snapshots are marked as used on every reader's comm stream
//! ([`Tensor::record_stream`]) and freed when the last reader has issued its read; the caller's
//! tensors are marked as used on the comm stream, so dropping them early is safe.
//!
//! CPU tensors are accepted too: their snapshots are host copies and the result is computed on
//! the calling thread (as in the threads backend) once every rank has posted, so such a
//! collective is complete when the call returns. A group created on [`Device::Cpu`] works on CPU
//! tensors only; its comm stream is the calling thread.

pub mod kernels;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tandem_core::cuda::device_pointer;
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::layout::contiguous_strides;
use tandem_core::{Device, Event, Layout, Shape, Stream, Tensor};

use super::board::Board;
use super::host::{self, Target};
use super::progress::{self, Progress};
use super::reduce::AlignedBuf;
use super::{
    describe_all_gather, describe_all_reduce, describe_barrier, describe_broadcast,
    describe_reduce_scatter, invalid, tensor_error, CollectiveDesc, CollectiveKind, GroupConfig,
    ProcessGroup, ReduceOp, Work,
};
use crate::stream_ops::{copy_on, empty_on, launch_on};
use crate::{DistError, Result};
use kernels::{gather_ranks_launch, reduce_ranks_launch, Span, MAX_GROUP_RANKS};

/// One rank's contribution to one collective.
#[derive(Default)]
struct Contribution {
    /// A host snapshot (CPU tensors).
    host: Option<AlignedBuf>,
    /// A device snapshot, flat (device tensors).
    device: Option<Tensor>,
    /// Recorded on the rank's comm stream after its snapshot (device collectives and barriers).
    ready: Option<Event>,
}

/// One rank of a group whose ranks are threads of this process sharing one device. Create a
/// whole group with [`DeviceThreadGroup::new_group`] and hand one handle to each thread.
pub struct DeviceThreadGroup {
    rank: usize,
    device: Device,
    board: Arc<Board<Arc<Contribution>>>,
    /// This rank's comm stream: a CUDA stream of the device (the calling thread for a CPU
    /// group).
    comm: Stream,
    /// The device's compute stream, which every collective is ordered after.
    compute: Stream,
    /// The next sequence number; held while a collective is issued, so that sequence numbers
    /// and the comm stream's order agree.
    next_seq: Mutex<u64>,
    /// The first failure; later collectives are refused with [`DistError::GroupBroken`].
    broken: Arc<Mutex<Option<DistError>>>,
    /// A host thread that completes each [`Work`] once the device has passed its done event, in
    /// issue order.
    watcher: Stream,
    /// The last collective completed, for the message of a peer that finds this rank gone.
    completed: Arc<AtomicU64>,
    timeout: Duration,
    /// Every rank's progress (this rank's at `rank`), for the diagnosis of a timeout.
    everyone: Arc<Vec<Arc<Progress>>>,
}

impl fmt::Debug for DeviceThreadGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceThreadGroup(rank {} of {} on {})",
            self.rank,
            self.board.world(),
            self.device
        )
    }
}

impl DeviceThreadGroup {
    /// A group of `world_size` ranks on `device` with the default configuration; element `k` is
    /// rank `k`. Errors when the device cannot be used (no CUDA driver or device).
    pub fn new_group(device: Device, world_size: usize) -> Result<Vec<DeviceThreadGroup>> {
        Self::new_group_with(device, world_size, &GroupConfig::default())
    }

    /// A group of `world_size` ranks on `device`; only `config.timeout` applies to this backend.
    pub fn new_group_with(
        device: Device,
        world_size: usize,
        config: &GroupConfig,
    ) -> Result<Vec<DeviceThreadGroup>> {
        if world_size == 0 {
            return Err(DistError::config(
                0,
                "DeviceThreadGroup: a group needs at least one rank",
            ));
        }
        if world_size > MAX_GROUP_RANKS {
            return Err(DistError::config(
                0,
                format!(
                    "DeviceThreadGroup: {world_size} ranks; a group sharing one device has at \
                     most {MAX_GROUP_RANKS}"
                ),
            ));
        }
        let setup =
            |rank| move |e| DistError::tensor(rank, format!("DeviceThreadGroup on {device}"), e);
        device.ensure_available().map_err(setup(0))?;
        let board = Arc::new(Board::new("DeviceThreadGroup", world_size, config.timeout));
        let everyone: Arc<Vec<Arc<Progress>>> =
            Arc::new((0..world_size).map(|_| Arc::default()).collect());
        (0..world_size)
            .map(|rank| {
                let comm = match device {
                    Device::Cpu => Stream::compute(device),
                    Device::Cuda(_) => {
                        Stream::new_on(device, &format!("tandem-device-threads-comm-{rank}"))
                    }
                }
                .map_err(setup(rank))?;
                let name = format!("tandem-device-threads-done-{rank}");
                let watcher = Stream::worker(&name)
                    .map_err(|e| DistError::rank_io(rank, format!("starting thread {name}"), e))?;
                Ok(DeviceThreadGroup {
                    rank,
                    device,
                    board: board.clone(),
                    comm,
                    compute: Stream::compute(device).map_err(setup(rank))?,
                    next_seq: Mutex::new(1),
                    broken: Arc::new(Mutex::new(None)),
                    watcher,
                    completed: Arc::new(AtomicU64::new(0)),
                    timeout: config.timeout,
                    everyone: everyone.clone(),
                })
            })
            .collect()
    }

    /// The device the group's comm streams belong to.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the collective's tensors are on the group's device (`true`) or the CPU
    /// (`false`); anything else is refused.
    fn on_device(&self, desc: &CollectiveDesc, tensors: &[(&str, &Tensor)]) -> Result<bool> {
        let mut on_device = self.device != Device::Cpu && tensors.is_empty();
        for (what, t) in tensors {
            match t.device() {
                Device::Cpu => {}
                d if d == self.device => on_device = true,
                d => {
                    return Err(invalid(
                        self.rank,
                        desc.kind.name(),
                        format!(
                            "{what} is on {d}; this group works on {} (and on CPU tensors)",
                            self.device
                        ),
                    ))
                }
            }
        }
        Ok(on_device)
    }

    /// Issues a collective: `input` is this rank's contribution (none for a barrier or a
    /// broadcast from another rank), `target` where its result goes.
    fn collective(
        &self,
        desc: CollectiveDesc,
        tensors: &[(&str, &Tensor)],
        input: Option<&Tensor>,
        target: Target,
    ) -> Result<Work> {
        let on_device = self.on_device(&desc, tensors)?;
        let mut next = self.next_seq.lock();
        let seq = *next;
        *next += 1;
        let work = Work::new(seq, desc);
        self.everyone[self.rank].issued(seq, desc);
        let earlier = self.broken.lock().clone();
        let outcome = match earlier {
            Some(cause) => Err(DistError::GroupBroken {
                rank: self.rank,
                collective: desc.to_string(),
                seq,
                cause: Box::new(cause),
            }),
            None => {
                let mut run = if on_device {
                    self.run_on_device(seq, &desc, input, &target)
                } else {
                    self.run_on_host(seq, &desc, input, &target).map(|()| None)
                };
                if let Err(DistError::Timeout { diagnosis, .. }) = &mut run {
                    // Every rank's position is in this process: no rank can fail to report.
                    let positions: Vec<_> = (self.everyone.iter().enumerate())
                        .map(|(q, p)| (q, p.position()))
                        .collect();
                    *diagnosis = Some(progress::diagnose(&positions));
                }
                if let Err(e) = &run {
                    self.board.fail(self.rank, e);
                    self.broken.lock().get_or_insert_with(|| e.clone());
                }
                run
            }
        };
        self.complete(&work, outcome);
        drop(next);
        Ok(work)
    }

    /// Completes `work`, in issue order, on the watcher thread: at once for a failure or a host
    /// collective, after the device passed the done event otherwise.
    fn complete(&self, work: &Work, outcome: Result<Option<Event>>) {
        let (rank, seq, desc) = (self.rank, work.sequence_number(), work.collective());
        let (done_work, completed, broken) =
            (work.clone(), self.completed.clone(), self.broken.clone());
        let progress = self.everyone[rank].clone();
        let (timeout, device) = (self.timeout, self.device);
        let finish = move || {
            if let Device::Cuda(ordinal) = device {
                // Querying an event needs the device's context current on this thread; a
                // failure here shows in the query below.
                let _ = tandem_core::cuda::device(ordinal).and_then(|d| d.bind("device group"));
            }
            let result = outcome.and_then(|done| match done {
                None => Ok(()),
                Some(event) => match event.wait_timeout(timeout) {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(DistError::tensor(
                        rank,
                        format!("{desc} (collective #{seq})"),
                        tandem_core::Error::Cuda {
                            op: "device group",
                            device,
                            detail: format!(
                                "the device did not finish the collective within {timeout:?}"
                            ),
                        },
                    )),
                    Err(e) => Err(DistError::tensor(
                        rank,
                        format!("{desc} (collective #{seq})"),
                        e,
                    )),
                },
            });
            match &result {
                Ok(()) => {
                    completed.store(seq, Ordering::SeqCst);
                    progress.completed(seq);
                }
                Err(e) => {
                    broken.lock().get_or_insert_with(|| e.clone());
                }
            }
            done_work.finish(result);
        };
        // A host worker runs every job it is given (inline once its thread is gone).
        if self.watcher.enqueue(finish).is_err() {
            work.finish(Err(DistError::internal(
                format!("rank {rank}: {desc} (collective #{seq})"),
                "the completion thread refused the job",
            )));
        }
    }

    /// The host path: snapshots in host memory, the result computed here once every rank has
    /// posted.
    fn run_on_host(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
        input: Option<&Tensor>,
        target: &Target,
    ) -> Result<()> {
        let rank = self.rank;
        let data = match input {
            Some(t) => host::snapshot(t).map_err(|e| tensor_error(rank, desc, e))?,
            None => AlignedBuf::default(),
        };
        let mine = Contribution {
            host: Some(data),
            ..Contribution::default()
        };
        let all = self.board.exchange(rank, seq, desc, Arc::new(mine))?;
        let mut bytes = Vec::with_capacity(all.len());
        for (q, c) in all.iter().enumerate() {
            match &c.host {
                Some(b) => bytes.push(b.bytes()),
                None => {
                    return Err(placement_mismatch(
                        rank,
                        q,
                        seq,
                        desc,
                        Device::Cpu,
                        self.device,
                    ))
                }
            }
        }
        host::apply(rank, desc, target, &bytes)
    }

    /// The device path (see the module comment); returns the done event.
    fn run_on_device(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
        input: Option<&Tensor>,
        target: &Target,
    ) -> Result<Option<Event>> {
        let (rank, comm) = (self.rank, &self.comm);
        let err = |e| tensor_error(rank, desc, e);
        // 1. Snapshot, after what the compute stream wrote.
        let mine = self.snapshot(desc, input)?;
        // 2. Rendezvous.
        let all = self.board.exchange(rank, seq, desc, Arc::new(mine))?;
        // 3. After every rank's snapshot, this rank's result.
        let snaps = self.wait_for_snapshots(seq, desc, &all)?;
        self.combine(seq, desc, target, &snaps)?;
        Ok(Some(comm.record_event().map_err(err)?))
    }

    /// This rank's contribution: a copy of `input` on the comm stream, taken after what the
    /// compute stream wrote, and the event that marks it ready.
    fn snapshot(&self, desc: &CollectiveDesc, input: Option<&Tensor>) -> Result<Contribution> {
        let (rank, comm) = (self.rank, &self.comm);
        let err = |e| tensor_error(rank, desc, e);
        let written = self.compute.record_event().map_err(err)?;
        comm.wait_event(&written).map_err(err)?;
        let snapshot = match input {
            Some(t) => {
                let flat_in = flat(t).map_err(err)?;
                let snap = empty_on("snapshot", comm, &[t.numel()], t.dtype()).map_err(err)?;
                copy_on(comm, &snap, &flat_in).map_err(err)?;
                Some(snap)
            }
            None => None,
        };
        Ok(Contribution {
            device: snapshot,
            ready: Some(comm.record_event().map_err(err)?),
            host: None,
        })
    }

    /// Makes the comm stream wait for every other rank's snapshot; returns the snapshots in
    /// rank order.
    fn wait_for_snapshots<'a>(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
        all: &'a [Arc<Contribution>],
    ) -> Result<Vec<Option<&'a Tensor>>> {
        let (rank, comm) = (self.rank, &self.comm);
        let err = |e| tensor_error(rank, desc, e);
        let mut snaps = Vec::with_capacity(all.len());
        for (q, c) in all.iter().enumerate() {
            let Some(ready) = &c.ready else {
                return Err(placement_mismatch(
                    rank,
                    q,
                    seq,
                    desc,
                    self.device,
                    Device::Cpu,
                ));
            };
            if q != rank {
                comm.wait_event(ready).map_err(err)?;
            }
            if let Some(s) = &c.device {
                s.record_stream(comm).map_err(err)?;
            }
            snaps.push(c.device.as_ref());
        }
        Ok(snaps)
    }

    /// This rank's result of the collective from the ranks' snapshots `snaps`, on the comm
    /// stream.
    fn combine(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
        target: &Target,
        snaps: &[Option<&Tensor>],
    ) -> Result<()> {
        let (rank, comm) = (self.rank, &self.comm);
        let err = |e| tensor_error(rank, desc, e);
        let spans = |need: bool| -> Result<Vec<Span>> {
            snaps
                .iter()
                .enumerate()
                .map(|(q, s)| match s {
                    Some(s) => span(s).map_err(err),
                    None if !need => Ok(Span { ptr: 0, len: 0 }),
                    None => Err(placement_mismatch(
                        rank,
                        q,
                        seq,
                        desc,
                        self.device,
                        Device::Cpu,
                    )),
                })
                .collect()
        };
        let dtype = desc.dtype;
        match (target, dtype) {
            (Target::AllReduce(t), Some(dtype)) => {
                let out = flat(t).map_err(err)?;
                let sources = spans(true)?;
                let op = desc.op.unwrap_or(ReduceOp::Sum);
                let launch = reduce_ranks_launch(
                    dtype,
                    span(&out).map_err(err)?,
                    &sources,
                    t.numel(),
                    0,
                    op,
                )
                .map_err(err)?;
                self.launch(&launch, &out, &sources, t.numel())
                    .map_err(err)?;
            }
            (Target::ReduceScatter(output), Some(dtype)) => {
                let out = flat(output).map_err(err)?;
                let sources = spans(true)?;
                let n = output.numel();
                let op = desc.op.unwrap_or(ReduceOp::Sum);
                let launch = reduce_ranks_launch(
                    dtype,
                    span(&out).map_err(err)?,
                    &sources,
                    n * snaps.len(),
                    rank * n,
                    op,
                )
                .map_err(err)?;
                self.launch(&launch, &out, &sources, n).map_err(err)?;
            }
            (Target::AllGather(output), Some(dtype)) => {
                let out = flat(output).map_err(err)?;
                let sources = spans(true)?;
                let launch =
                    gather_ranks_launch(dtype, span(&out).map_err(err)?, &sources).map_err(err)?;
                self.launch(&launch, &out, &sources, output.numel())
                    .map_err(err)?;
            }
            (Target::Broadcast { tensor, root }, _) if rank != *root => {
                let Some(source) = snaps.get(*root).copied().flatten() else {
                    return Err(placement_mismatch(
                        rank,
                        *root,
                        seq,
                        desc,
                        self.device,
                        Device::Cpu,
                    ));
                };
                copy_on(comm, &flat(tensor).map_err(err)?, source).map_err(err)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Runs `launch` on the comm stream, writing `out` (marked as used there) from the ranks'
    /// snapshots `sources`.
    fn launch(
        &self,
        launch: &tandem_core::cuda::launch::Launch,
        out: &Tensor,
        sources: &[Span],
        numel: usize,
    ) -> tandem_core::Result<()> {
        out.record_stream(&self.comm)?;
        let (dev, _) = device_pointer("device group", out)?;
        if numel > 0 && sanitizer::enabled() {
            // The kernel reaches the snapshots through a table, not through declared arguments:
            // declare the reads for the stream sanitizer.
            if let Some(cuda) = self.comm.cuda_stream() {
                let reads: Vec<(u64, Use)> = sources
                    .iter()
                    .filter(|s| s.len > 0)
                    .map(|s| (s.ptr, Use::Read))
                    .collect();
                sanitizer::access(dev.device(), cuda, &launch.kernel, &reads)?;
            }
        }
        launch_on(&dev, &self.comm, launch, numel)
    }
}

/// A flat, contiguous view of a contiguous tensor (collectives work on elements, not shapes).
fn flat(t: &Tensor) -> tandem_core::Result<Tensor> {
    let shape = Shape::from_slice(&[t.numel()]);
    let strides = contiguous_strides(&shape);
    t.view_detached(Layout::from_parts(shape, strides, t.layout().offset()))
}

/// The device span of a flat device tensor.
fn span(t: &Tensor) -> tandem_core::Result<Span> {
    let (_, base) = device_pointer("device group", t)?;
    let offset = (t.layout().offset() * t.dtype().size_in_bytes()) as u64;
    Ok(Span {
        ptr: if t.numel() == 0 { base } else { base + offset },
        len: t.numel(),
    })
}

/// Two ranks issued the same collective on tensors of different devices.
fn placement_mismatch(
    rank: usize,
    peer: usize,
    seq: u64,
    desc: &CollectiveDesc,
    ours: Device,
    theirs: Device,
) -> DistError {
    DistError::Mismatch {
        rank,
        peer,
        seq,
        their_seq: seq,
        ours: format!("{desc} on {ours}"),
        theirs: format!("{desc} on {theirs}"),
    }
}

impl ProcessGroup for DeviceThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.board.world()
    }

    fn backend(&self) -> &'static str {
        "device-threads"
    }

    fn comm_stream(&self) -> &Stream {
        &self.comm
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_all_reduce(self.rank, tensor, op)?;
        self.collective(
            desc,
            &[("tensor", tensor)],
            Some(tensor),
            Target::AllReduce(tensor.clone()),
        )
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let desc = describe_broadcast(self.rank, self.board.world(), tensor, root)?;
        let input = (self.rank == root).then_some(tensor);
        let target = Target::Broadcast {
            tensor: tensor.clone(),
            root,
        };
        self.collective(desc, &[("tensor", tensor)], input, target)
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        let desc = describe_all_gather(self.rank, self.board.world(), input, output)?;
        let tensors = [("input", input), ("output", output)];
        self.collective(
            desc,
            &tensors,
            Some(input),
            Target::AllGather(output.clone()),
        )
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_reduce_scatter(self.rank, self.board.world(), input, output, op)?;
        let tensors = [("input", input), ("output", output)];
        self.collective(
            desc,
            &tensors,
            Some(input),
            Target::ReduceScatter(output.clone()),
        )
    }

    fn barrier(&self) -> Result<Work> {
        let desc = describe_barrier();
        debug_assert_eq!(desc.kind, CollectiveKind::Barrier);
        self.collective(desc, &[], None, Target::Barrier)
    }
}

impl Drop for DeviceThreadGroup {
    fn drop(&mut self) {
        // Every Work issued here completes before the rank is marked as gone. Waiting on a host
        // worker cannot fail, and its jobs never hold a group handle, so this cannot be the
        // watcher's own thread.
        let _ = self.watcher.synchronize();
        self.board
            .leave(self.rank, self.completed.load(Ordering::SeqCst));
    }
}

#[cfg(test)]
mod tests;
