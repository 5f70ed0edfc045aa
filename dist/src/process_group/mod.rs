//! The `ProcessGroup` trait — the collectives data-parallel training needs — and what its
//! backends share: reduce ops, collective descriptors, the group configuration, argument
//! validation and the comm-stream queue that numbers and orders collectives.
//!
//! Every collective is asynchronous. Issuing one validates the arguments on the calling thread,
//! gives the collective the group's next sequence number, queues it on the group's comm
//! stream and returns a [`Work`] at once; the comm stream runs collectives one after another in
//! issue order, in place on the tensors' storage. All ranks must issue the same collectives in
//! the same order — each one carries `(sequence number, kind, dtype, element count)` so a rank
//! that disagrees is reported instead of corrupting data.

mod board;
pub(crate) mod codes;
pub mod device_threads;
mod host;
pub mod nccl;
pub(crate) mod progress;
pub(crate) mod reduce;
pub mod tcp;
pub mod threads;
mod work;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use parking_lot::Mutex;
use tandem_core::{DType, Device, Stream, Tensor};

pub use progress::{with_collective_label, CollectiveLabel};
pub use work::Work;

use crate::{DistError, Result};

/// The largest world size tandem accepts. The TCP backend connects every pair of ranks, so a
/// rank holds a connection to each other rank; a larger `WORLD_SIZE` is refused before anything
/// proportional to it is allocated. Defined here, where the
/// backends check it, and re-exported by `rendezvous`, which checks `WORLD_SIZE` against it.
pub const MAX_WORLD_SIZE: usize = 65536;

/// How `all_reduce` and `reduce_scatter` combine the ranks' contributions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks: the sum divided by the world size.
    Avg,
    /// Element-wise maximum (NaN wins).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
}

impl ReduceOp {
    /// The lower-case name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which collective was issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// [`ProcessGroup::all_reduce`].
    AllReduce,
    /// [`ProcessGroup::broadcast`].
    Broadcast,
    /// [`ProcessGroup::all_gather`].
    AllGather,
    /// [`ProcessGroup::reduce_scatter`].
    ReduceScatter,
    /// [`ProcessGroup::barrier`].
    Barrier,
}

impl CollectiveKind {
    /// The method name, e.g. `all_reduce`.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Barrier => "barrier",
        }
    }
}

/// What one rank issued; every rank must issue the same descriptor under the same sequence
/// number. Displayed as in error messages, e.g. `all_reduce(f32, 100, sum)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CollectiveDesc {
    /// The collective.
    pub kind: CollectiveKind,
    /// The element type (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Elements per rank: the tensor of `all_reduce`/`broadcast`, the input of `all_gather`,
    /// the output of `reduce_scatter`; 0 for a barrier.
    pub numel: u64,
    /// The reduce op of `all_reduce`/`reduce_scatter`.
    pub op: Option<ReduceOp>,
    /// The root of `broadcast`.
    pub root: Option<u32>,
}

impl CollectiveDesc {
    /// Bytes of the whole buffer the collective works on: the tensor of `all_reduce` and
    /// `broadcast`, the output of `all_gather`, the input of `reduce_scatter`.
    pub fn total_bytes(&self, world_size: usize) -> usize {
        let per_rank = self.numel as usize * self.dtype.map_or(0, DType::size_in_bytes);
        match self.kind {
            CollectiveKind::AllGather | CollectiveKind::ReduceScatter => per_rank * world_size,
            _ => per_rank,
        }
    }
}

impl fmt::Display for CollectiveDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.kind.name();
        let dtype = self.dtype.map_or("none", DType::name);
        match self.kind {
            CollectiveKind::Barrier => write!(f, "barrier()"),
            CollectiveKind::AllReduce => {
                write!(
                    f,
                    "{name}({dtype}, {}, {})",
                    self.numel,
                    self.op.map_or("none", ReduceOp::name)
                )
            }
            CollectiveKind::Broadcast => {
                write!(
                    f,
                    "{name}({dtype}, {}, root {})",
                    self.numel,
                    self.root.unwrap_or(0)
                )
            }
            CollectiveKind::AllGather => write!(f, "{name}({dtype}, {} per rank)", self.numel),
            CollectiveKind::ReduceScatter => write!(
                f,
                "{name}({dtype}, {} per rank, {})",
                self.numel,
                self.op.map_or("none", ReduceOp::name)
            ),
        }
    }
}

/// Settings of a process group. Every rank must use the same values (the algorithm a
/// collective uses depends on them; a rank whose settings differ is reported as sending
/// unexpected frames).
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Longest time one collective may take before it fails with
    /// [`DistError::Timeout`]. Default: 300 s (PyTorch's default is 30 min; a hung job
    /// should surface sooner). A peer that exits is detected at once, not after the timeout.
    pub timeout: Duration,
    /// Longest time rendezvous and connecting to the other ranks may take. Default: 300 s.
    pub connect_timeout: Duration,
    /// Collectives on buffers of at most this many bytes use the low-latency algorithms
    /// (every rank exchanges directly with every other) instead of the ring. Default: 64 KiB.
    pub small_message_bytes: usize,
    /// Size of the pieces the ring algorithms cut a message into, so that sending one piece
    /// overlaps with receiving and reducing the previous. Default: 256 KiB.
    pub chunk_bytes: usize,
    /// Size of each TCP socket's send and receive buffer in bytes; 0 leaves them to the
    /// kernel's autotuning. Default: 0.
    pub socket_buffer_bytes: usize,
    /// When every rank runs on one host (checked when the group is set up: every rank must
    /// reach every other's abstract Unix-domain socket), large collectives move through
    /// shared-memory segments — each rank writes only its own, sealed segment, which the others
    /// map read-only — using TCP only to synchronise. Set to `false` to always use the TCP
    /// ring. Default: true. Groups of more than 128 ranks always use the ring.
    pub same_host_copy: bool,
    /// Name of the group; groups sharing a rendezvous store need distinct names.
    /// Default: `"default"`.
    pub name: String,
    /// While connecting, a rank that is still waiting for other ranks, or for the rendezvous
    /// store to answer, says so on stderr, naming them, this often. Default: 30 s.
    pub wait_log_interval: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(300),
            small_message_bytes: 64 << 10,
            chunk_bytes: 256 << 10,
            socket_buffer_bytes: 0,
            same_host_copy: true,
            name: "default".to_string(),
            wait_log_interval: Duration::from_secs(30),
        }
    }
}

/// A group of ranks that run collectives together.
///
/// One rank per process (per device) in real training; the `threads` backend runs ranks as
/// threads for tests. Every method returns with a [`Work`] without waiting for the data; the
/// collective runs on the group's comm stream ([`ProcessGroup::comm_stream`]) in issue order,
/// in place on the tensors' storage, so the tensors must not be read or written until the work
/// completes. Tensors must be contiguous and on a device the backend works on (the CPU for TCP
/// and threads); the reductions support f32, f64, f16 and bf16 (half types reduce in f32
/// precision per element), `broadcast` and `all_gather` every dtype. Empty tensors and sizes
/// not divisible by the world size are fine.
///
/// Safe to call from any thread: issuing takes a short lock that fixes the sequence number and
/// the stream order together. Hold a group as `Arc<dyn ProcessGroup>` to share it.
pub trait ProcessGroup: Send + Sync + fmt::Debug {
    /// This process's rank, in `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// The backend's name: `"nccl"` ([`NcclProcessGroup`](crate::NcclProcessGroup)), `"tcp"`,
    /// `"threads"` or `"device-threads"`.
    fn backend(&self) -> &'static str;

    /// The stream collectives run on. Work issued to it before a collective (for example
    /// `comm_stream().wait_event(&grad_ready)`) runs before that collective.
    fn comm_stream(&self) -> &Stream;

    /// Reduces `tensor` element-wise over all ranks with `op`; every rank receives the
    /// bit-identical result in `tensor`.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work>;

    /// Copies `tensor` of rank `root` into `tensor` on every rank.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work>;

    /// Gathers every rank's `input` into `output` (`world_size × input.numel()` elements,
    /// rank-major: rank k's input lands at elements `k·n .. (k+1)·n`).
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work>;

    /// Reduces `input` (`world_size × output.numel()` elements) over ranks and leaves block
    /// `rank` of the result in `output`. `input` is not modified.
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work>;

    /// Completes once every rank has issued the barrier.
    fn barrier(&self) -> Result<Work>;
}

// ---- argument validation (shared by the backends) -----------------------------------------

pub(crate) fn invalid(
    rank: usize,
    collective: &'static str,
    problem: impl Into<String>,
) -> DistError {
    DistError::InvalidArgument {
        rank,
        collective,
        problem: problem.into(),
    }
}

fn check_tensor(rank: usize, collective: &'static str, what: &str, t: &Tensor) -> Result<()> {
    if !t.is_contiguous() {
        return Err(invalid(
            rank,
            collective,
            format!(
                "{what} {:?} is not contiguous; collectives work in place on contiguous storage \
                 (call contiguous() and copy the result back)",
                t.dims()
            ),
        ));
    }
    Ok(())
}

/// Refuses tensors outside host memory, for the backends that work on CPU tensors only (checked
/// after the arguments themselves, like them before the collective takes a sequence number).
pub(crate) fn require_cpu(
    rank: usize,
    desc: &CollectiveDesc,
    tensors: &[(&str, &Tensor)],
) -> Result<()> {
    match tensors.iter().find(|(_, t)| t.device() != Device::Cpu) {
        Some((what, t)) => Err(invalid(
            rank,
            desc.kind.name(),
            format!(
                "{what} is on {}; this backend works on CPU tensors",
                t.device()
            ),
        )),
        None => Ok(()),
    }
}

fn check_reducible(rank: usize, collective: &'static str, t: &Tensor) -> Result<()> {
    if !reduce::is_reducible(t.dtype()) {
        return Err(invalid(
            rank,
            collective,
            format!(
                "cannot reduce {} tensors (supported: f32, f64, f16, bf16)",
                t.dtype()
            ),
        ));
    }
    Ok(())
}

/// Checks `all_reduce` arguments; returns the descriptor.
pub(crate) fn describe_all_reduce(
    rank: usize,
    tensor: &Tensor,
    op: ReduceOp,
) -> Result<CollectiveDesc> {
    check_tensor(rank, "all_reduce", "tensor", tensor)?;
    check_reducible(rank, "all_reduce", tensor)?;
    Ok(CollectiveDesc {
        kind: CollectiveKind::AllReduce,
        dtype: Some(tensor.dtype()),
        numel: tensor.numel() as u64,
        op: Some(op),
        root: None,
    })
}

/// Checks `broadcast` arguments; returns the descriptor.
pub(crate) fn describe_broadcast(
    rank: usize,
    world: usize,
    tensor: &Tensor,
    root: usize,
) -> Result<CollectiveDesc> {
    check_tensor(rank, "broadcast", "tensor", tensor)?;
    if root >= world {
        return Err(invalid(
            rank,
            "broadcast",
            format!("root {root} is not a rank of a group of {world}"),
        ));
    }
    Ok(CollectiveDesc {
        kind: CollectiveKind::Broadcast,
        dtype: Some(tensor.dtype()),
        numel: tensor.numel() as u64,
        op: None,
        root: Some(root as u32),
    })
}

fn check_pair(
    rank: usize,
    collective: &'static str,
    input: &Tensor,
    output: &Tensor,
) -> Result<()> {
    check_tensor(rank, collective, "input", input)?;
    check_tensor(rank, collective, "output", output)?;
    if input.device() != output.device() {
        return Err(invalid(
            rank,
            collective,
            format!(
                "input is on {} but output is on {}",
                input.device(),
                output.device()
            ),
        ));
    }
    if input.dtype() != output.dtype() {
        return Err(invalid(
            rank,
            collective,
            format!(
                "input is {} but output is {}",
                input.dtype(),
                output.dtype()
            ),
        ));
    }
    Ok(())
}

/// Checks that `bigger` has `world × smaller` elements (without overflowing on absurd sizes).
fn check_world_multiple(
    rank: usize,
    world: usize,
    collective: &'static str,
    (bigger_name, bigger): (&str, &Tensor),
    (smaller_name, smaller): (&str, &Tensor),
) -> Result<()> {
    if Some(bigger.numel()) != world.checked_mul(smaller.numel()) {
        return Err(invalid(
            rank,
            collective,
            format!(
                "{bigger_name} has {} elements but must have world_size × {smaller_name} = \
                 {world} × {} = {}",
                bigger.numel(),
                smaller.numel(),
                world.saturating_mul(smaller.numel())
            ),
        ));
    }
    Ok(())
}

/// Checks `all_gather` arguments; returns the descriptor.
pub(crate) fn describe_all_gather(
    rank: usize,
    world: usize,
    input: &Tensor,
    output: &Tensor,
) -> Result<CollectiveDesc> {
    check_pair(rank, "all_gather", input, output)?;
    check_world_multiple(
        rank,
        world,
        "all_gather",
        ("output", output),
        ("input", input),
    )?;
    Ok(CollectiveDesc {
        kind: CollectiveKind::AllGather,
        dtype: Some(input.dtype()),
        numel: input.numel() as u64,
        op: None,
        root: None,
    })
}

/// Checks `reduce_scatter` arguments; returns the descriptor.
pub(crate) fn describe_reduce_scatter(
    rank: usize,
    world: usize,
    input: &Tensor,
    output: &Tensor,
    op: ReduceOp,
) -> Result<CollectiveDesc> {
    check_pair(rank, "reduce_scatter", input, output)?;
    check_reducible(rank, "reduce_scatter", input)?;
    check_world_multiple(
        rank,
        world,
        "reduce_scatter",
        ("input", input),
        ("output", output),
    )?;
    Ok(CollectiveDesc {
        kind: CollectiveKind::ReduceScatter,
        dtype: Some(output.dtype()),
        numel: output.numel() as u64,
        op: Some(op),
        root: None,
    })
}

/// The descriptor of a barrier.
pub(crate) fn describe_barrier() -> CollectiveDesc {
    CollectiveDesc {
        kind: CollectiveKind::Barrier,
        dtype: None,
        numel: 0,
        op: None,
        root: None,
    }
}

/// A tensor-layer error met while running a collective, as a `DistError`.
pub(crate) fn tensor_error(
    rank: usize,
    desc: &CollectiveDesc,
    err: tandem_core::Error,
) -> DistError {
    DistError::tensor(rank, desc.kind.name(), err)
}

// ---- the comm-stream queue ------------------------------------------------------------------

/// Numbers collectives and runs them in order on a comm stream; remembers the first failure,
/// after which the group refuses further collectives with [`DistError::GroupBroken`].
pub(crate) struct CommQueue {
    rank: usize,
    stream: Stream,
    /// The stream's thread, learnt from its first job.
    worker: Arc<OnceLock<ThreadId>>,
    next_seq: Mutex<u64>,
    broken: Arc<Mutex<Option<DistError>>>,
    /// The last issued and completed collectives, for hang diagnoses.
    progress: Arc<progress::Progress>,
}

impl CommQueue {
    /// A queue on a fresh worker stream named after the backend and rank.
    pub(crate) fn new(backend: &str, rank: usize) -> Result<Self> {
        let name = format!("tandem-{backend}-comm-{rank}");
        let stream = Stream::worker(&name)
            .map_err(|e| DistError::rank_io(rank, format!("starting comm stream {name}"), e))?;
        let worker = Arc::new(OnceLock::new());
        let learn = worker.clone();
        stream
            .enqueue(move || {
                let _ = learn.set(std::thread::current().id());
            })
            .map_err(|e| DistError::tensor(rank, format!("starting comm stream {name}"), e))?;
        Ok(CommQueue {
            rank,
            stream,
            worker,
            next_seq: Mutex::new(1),
            broken: Arc::new(Mutex::new(None)),
            progress: Arc::default(),
        })
    }

    /// Waits for every collective issued so far — unless called from the comm stream itself
    /// (a job holding the last handle to its group), which cannot wait for itself.
    pub(crate) fn drain(&self) {
        if self.worker.get() != Some(&std::thread::current().id()) {
            // A host worker stream: waiting on it cannot fail.
            let _ = self.stream.synchronize();
        }
    }

    /// The comm stream.
    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// This rank's last issued and completed collectives.
    pub(crate) fn progress(&self) -> &Arc<progress::Progress> {
        &self.progress
    }

    /// Issues `run(seq)` as the next collective. `run` executes on the comm stream; an error it
    /// returns completes the work with that error and breaks the group.
    pub(crate) fn issue(
        &self,
        desc: CollectiveDesc,
        run: impl FnOnce(u64) -> Result<()> + Send + 'static,
    ) -> Work {
        let mut next = self.next_seq.lock();
        let seq = *next;
        *next += 1;
        let work = Work::new(seq, desc);
        self.progress.issued(seq, desc);
        let progress = self.progress.clone();
        let done = work.clone();
        let broken = self.broken.clone();
        let rank = self.rank;
        let failed = work.clone();
        let queued = self.stream.enqueue(move || {
            let earlier = broken.lock().clone();
            let result = match earlier {
                Some(cause) => Err(DistError::GroupBroken {
                    rank,
                    collective: desc.to_string(),
                    seq,
                    cause: Box::new(cause),
                }),
                None => {
                    let outcome =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(seq)))
                            .unwrap_or_else(|panic| {
                                let what = panic
                                    .downcast_ref::<&str>()
                                    .map(|s| s.to_string())
                                    .or_else(|| panic.downcast_ref::<String>().cloned())
                                    .unwrap_or_else(|| "a panic".to_string());
                                Err(DistError::internal(
                                    format!("rank {rank}: {desc} (collective #{seq})"),
                                    what,
                                ))
                            });
                    match &outcome {
                        Ok(()) => progress.completed(seq),
                        Err(e) => {
                            broken.lock().get_or_insert_with(|| e.clone());
                        }
                    }
                    outcome
                }
            };
            done.finish(result);
        });
        if let Err(e) = queued {
            failed.finish(Err(DistError::tensor(
                rank,
                format!("{desc} (collective #{seq}) could not be queued"),
                e,
            )));
        }
        drop(next);
        work
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_display_like_the_call_that_made_them() {
        let t = Tensor::zeros(&[10, 10], DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            describe_all_reduce(0, &t, ReduceOp::Sum)
                .unwrap()
                .to_string(),
            "all_reduce(f32, 100, sum)"
        );
        assert_eq!(
            describe_broadcast(0, 2, &t, 1).unwrap().to_string(),
            "broadcast(f32, 100, root 1)"
        );
        let out = Tensor::zeros(&[200], DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            describe_all_gather(0, 2, &t, &out).unwrap().to_string(),
            "all_gather(f32, 100 per rank)"
        );
        let small = Tensor::zeros(&[50], DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            describe_reduce_scatter(0, 2, &t, &small, ReduceOp::Avg)
                .unwrap()
                .to_string(),
            "reduce_scatter(f32, 50 per rank, avg)"
        );
        assert_eq!(describe_barrier().to_string(), "barrier()");
    }

    #[test]
    fn bad_arguments_are_named_errors() {
        let t = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let transposed = t
            .view_detached(t.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        let err = describe_all_reduce(1, &transposed, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 1") && err.contains("not contiguous"),
            "{err}"
        );
        let ints = Tensor::zeros(&[4], DType::I64, Device::Cpu).unwrap();
        let err = describe_all_reduce(0, &ints, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(err.contains("i64"), "{err}");
        assert!(
            describe_broadcast(0, 2, &ints, 0).is_ok(),
            "broadcast moves any dtype"
        );
        let err = describe_broadcast(0, 2, &t, 2).unwrap_err().to_string();
        assert!(err.contains("root 2"), "{err}");
        let out = Tensor::zeros(&[5], DType::F32, Device::Cpu).unwrap();
        let err = describe_all_gather(0, 2, &t, &out).unwrap_err().to_string();
        assert!(err.contains("2 × 6 = 12"), "{err}");
        let err = describe_reduce_scatter(0, 4, &t, &out, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(err.contains("4 × 5 = 20"), "{err}");
        let err = describe_all_gather(0, 1, &ints, &out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("input is i64 but output is f32"), "{err}");
    }

    #[test]
    fn a_failed_collective_breaks_the_queue_for_later_ones() {
        let queue = CommQueue::new("test", 0).unwrap();
        let first = queue.issue(describe_barrier(), |seq| {
            Err(DistError::Timeout {
                rank: 0,
                collective: "barrier()".into(),
                seq,
                timeout: Duration::from_secs(1),
                waiting_for: vec![1],
                diagnosis: None,
            })
        });
        let second = queue.issue(describe_barrier(), |_| Ok(()));
        assert_eq!((first.sequence_number(), second.sequence_number()), (1, 2));
        assert!(first.wait().is_err());
        let err = second.wait().unwrap_err().to_string();
        assert!(
            err.contains("collective #2") && err.contains("broken") && err.contains("rank 1"),
            "{err}"
        );
    }

    #[test]
    fn a_panicking_collective_fails_its_work_instead_of_hanging() {
        let queue = CommQueue::new("test", 0).unwrap();
        let work = queue.issue(describe_barrier(), |_| panic!("kaboom"));
        let err = work.wait().unwrap_err().to_string();
        assert!(err.contains("kaboom"), "{err}");
    }
}
