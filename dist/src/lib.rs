//! `tandem-dist`: process groups for data-parallel training — rendezvous, collectives over
//! NCCL (one process per GPU), TCP and threads, DDP, and the `tandem-run` launcher.
//!
//! # The process-group model
//!
//! A data-parallel job runs **one process per device**. Each process is a *rank* in
//! `0..world_size`; together the ranks form a [`ProcessGroup`] that offers the collectives
//! training needs: [`all_reduce`](ProcessGroup::all_reduce) (sum, average, max, min),
//! [`broadcast`](ProcessGroup::broadcast), [`all_gather`](ProcessGroup::all_gather),
//! [`reduce_scatter`](ProcessGroup::reduce_scatter) and [`barrier`](ProcessGroup::barrier).
//!
//! **Rendezvous.** Ranks find each other through a small TCP key-value [store] served
//! at `MASTER_ADDR:MASTER_PORT` (by rank 0, or by the launcher). [`init_from_env`] reads who
//! this process is from the variables torchrun, `tandem-run`, SLURM or Open MPI set
//! ([`rendezvous`]), joins the store, publishes this rank's listening address and connects to
//! every other rank:
//!
//! ```no_run
//! use std::sync::Arc;
//! use tandem_core::{DType, Device, Tensor};
//! use tandem_dist::{init_from_env, ProcessGroup, ReduceOp};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg: Arc<dyn ProcessGroup> = init_from_env()?; // e.g. under `tandem-run --nproc-per-node 4`
//! let grads = Tensor::ones(&[1024], DType::F32, Device::Cpu)?;
//! let work = pg.all_reduce(&grads, ReduceOp::Avg)?; // returns at once
//! // … keep computing …
//! work.wait()?; // grads now hold the mean over ranks, identical on every rank
//! # Ok(()) }
//! ```
//!
//! **Asynchronous, stream-ordered collectives.** Every collective returns a [`Work`] at once
//! and runs later on the group's *comm stream* (a worker thread for CPU backends), in issue
//! order, in place on the tensors' storage. The caller overlaps its own computation and blocks
//! only in [`Work::wait`]; stream-ordered code can instead wait on [`Work::event`]. Groups are
//! `Send + Sync` and cheap to issue from any thread, so a DDP reducer can launch bucket
//! all-reduces from inside backward hooks.
//!
//! **Backends.** [`NcclProcessGroup`] is the backend for GPUs: one process per GPU, collectives
//! run by NVIDIA's NCCL on a CUDA comm stream, ordered after the compute stream by events so the
//! host never waits, with a watchdog and heartbeats that turn a dead, hung or mismatched rank
//! into an error naming it instead of a hang ([`NcclConfig`]; `--backend nccl` or
//! [`Backend::Nccl`] at rendezvous). [`TcpProcessGroup`] connects separate processes on one or many hosts (Linux),
//! in a full mesh of TCP connections. Small messages (≤ 64 KiB by default) go directly from
//! every rank to every rank, for latency. Large ones go around a ring (reduce-scatter then
//! all-gather; a chain for broadcast) in pipelined chunks, driven by one non-blocking event loop
//! per rank so that sending, receiving and reducing overlap. When every rank runs on one host
//! (checked at set-up), large messages instead move through shared-memory segments that each
//! rank creates and the others map read-only, with TCP only synchronising
//! ([`GroupConfig::same_host_copy`]). Every connection proves the job secret ([`auth`]).
//! [`ThreadProcessGroup`] runs ranks as threads of one process and exchanges through shared
//! memory; it is for tests. [`DeviceThreadGroup`] runs ranks as threads sharing one CUDA
//! device, each with its own comm stream, reducing with device kernels ordered by CUDA events:
//! multi-rank training (DDP's equivalence suite) on a machine with a single GPU. Reductions combine contributions in a fixed order, so every rank
//! ends with bit-identical results; f16/bf16 reduce in f32 precision per element. The
//! [`testing::conformance`] suite checks a backend against a serial f64 reference.
//!
//! **Sequence numbers and mismatches.** Collectives are numbered per group (#1, #2, …) and every
//! rank must issue the same ones in the same order. Each message carries the sequence number,
//! the collective, its dtype and element count; a rank that receives something else reports
//! both sides — `rank 1 issued all_reduce(f32, 100, sum) as collective #3 but rank 0 issued
//! broadcast(f32, 100, root 0)` — instead of corrupting data. Malformed or oversized frames are
//! rejected before any payload is read.
//!
//! **Timeouts and failures.** No collective waits for ever: each fails after
//! [`GroupConfig::timeout`] (default 300 s). Failures are detected much sooner when they can be
//! seen: a rank whose process dies closes its connections, and every rank that needs it fails
//! at once with a [`DistError`] naming it and the collective's sequence number; a failing rank
//! tells its peers (an *abort* frame) so they fail too and learn the cause; a rank that drops
//! its group says goodbye, so ranks still waiting for it learn that it left. After a failure
//! the group is broken and refuses further collectives ([`DistError::GroupBroken`]), like an
//! aborted NCCL communicator: restart the job. A timeout carries a diagnosis gathered from
//! every rank's last issued and completed collective (labelled through
//! [`with_collective_label`]): which rank diverged and where, e.g. `rank 2 is at all_reduce #118
//! (bucket 3) … while ranks 0, 1, 3 wait at all_reduce #119 (SyncBatchNorm statistics)`.
//!
//! **Launching.** `tandem-run --nproc-per-node N -- PROGRAM ARGS…` ([`launch`]) starts N local
//! ranks with the environment set, serves the store, prefixes each rank's output with
//! `[rank K] `, and stops the whole job when one rank fails, naming it.
//!
//! **Uneven inputs.** [`DistributedDataParallel::join`] lets ranks with different numbers of
//! batches finish: a rank whose loop has ended shadows the others' collectives (SyncBatchNorm's
//! included) with zero contributions until all are done ([`join`]).

#![warn(missing_docs)]

pub mod auth;
mod coalesce;
pub mod ddp;
pub mod error;
pub mod failure_report;
pub mod join;
pub mod launch;
pub mod metrics;
pub mod nvtx_ranges;
pub mod process_group;
pub mod projection;
pub mod reducer;
pub mod rendezvous;
pub mod sampler;
pub mod store;
pub mod stragglers;
mod stream_ops;
pub mod sync_batch_norm;
pub mod testing;
pub mod timeline;

pub use auth::JobSecret;
pub use ddp::{DdpConfig, DistributedDataParallel};
pub use error::{DistError, Result};
pub use join::{JoinConfig, JoinDivisor};
pub use process_group::device_threads::DeviceThreadGroup;
pub use process_group::nccl::{NcclConfig, NcclProcessGroup};
pub use process_group::tcp::TcpProcessGroup;
pub use process_group::threads::ThreadProcessGroup;
pub use process_group::{
    with_collective_label, CollectiveDesc, CollectiveKind, CollectiveLabel, GroupConfig,
    ProcessGroup, ReduceOp, Work,
};
pub use reducer::autotune::{
    choose_cap, fit_link, AutoBuckets, BucketChoice, CapPrediction, ParamReady,
};
pub use reducer::comm_hook::{AllReduceHook, BucketReduction, CommHook, CompressionHook};
pub use reducer::telemetry::{BucketTiming, OverlapSummary, StepTiming, Telemetry};
pub use reducer::{GradReduction, LaunchRecord};
pub use rendezvous::{
    init_from_env, init_from_env_on, init_from_env_with, init_from_env_with_options,
    init_process_group, init_with_options, Backend, EnvSource, InitOptions, LaunchEnv,
};
pub use sampler::{DistributedEvalSampler, DistributedSampler, DistributedUnpaddedSampler};
pub use store::{StoreConfig, StoreServer, TcpStore};
pub use stragglers::{Straggler, StragglerKind, StragglerSummary};
pub use sync_batch_norm::{convert_sync_batch_norm, SyncBatchNorm};
pub use timeline::{merge_chrome_traces, Phase, Span, SpanKind, Timeline, Track};
