//! The error type of `tandem-dist`.
//!
//! A distributed failure is only useful if it says *where*: every variant raised by a
//! collective names the rank that reports it, the collective (with its dtype and element
//! count) and the collective's sequence number, and, when another rank is to blame, that rank.
//! Errors are `Clone` because one failure is handed to every waiter of a work handle and is
//! remembered by a broken group as the cause of every later failure; the lower-level errors they
//! wrap (an [`std::io::Error`], a [`tandem_core::Error`], a [`tandem_nn::Error`]) are therefore shared behind an `Arc`
//! and kept whole as the error's [`source`](std::error::Error::source), so a caller can still
//! match on an `io::ErrorKind` or a tensor error's variant.
//!
//! The variants fall into groups: rendezvous and launching (`Env`, `Store`, `StoreTimeout`,
//! `Connect`, `SetupTimeout`, `Launch`, `Io`), collectives (`InvalidArgument` …
//! `GroupBroken`), configuration mistakes a user fixes in their code (`Config`), and failures
//! of what DDP wraps: the user's model (`Model`), the tensor layer under dist's own
//! bookkeeping (`Tensor`), the ranks holding different models (`ModelMismatch`), and gradients
//! that did not arrive as expected (`UnusedParameters`, `GradientReadyTwice`,
//! `BucketReducedWrongly`). `Internal` is a
//! bug in tandem.

use std::sync::Arc;
use std::time::Duration;

/// Result alias used across `tandem-dist`.
pub type Result<T> = std::result::Result<T, DistError>;

/// What went wrong in rendezvous, a collective or the launcher.
///
/// Its `Debug` is its message and the errors it wraps
/// ([`tandem_core::error::write_report`]): `fn main() -> Result<(), Box<dyn Error>>` and
/// `unwrap()` print the advice (the `find_unused_parameters` hint of
/// [`UnusedParameters`](DistError::UnusedParameters)), not the fields.
#[derive(Clone, thiserror::Error)]
pub enum DistError {
    /// A launcher environment variable is missing or malformed.
    #[error("environment variable {name}: {problem}")]
    Env {
        /// The variable, e.g. `WORLD_SIZE`.
        name: String,
        /// What is wrong with it and how to fix it.
        problem: String,
    },

    /// A request to the rendezvous store failed.
    #[error("rendezvous store at {addr}: {op}: {detail}")]
    Store {
        /// The store's address.
        addr: String,
        /// The request, e.g. `get "tandem/default/addr/3"`.
        op: String,
        /// What failed.
        detail: String,
    },

    /// Keys did not appear in the rendezvous store in time.
    #[error(
        "rendezvous store at {addr}: timed out after {timeout:?} waiting for {}; are all \
         ranks started, with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT?",
        fmt_list(keys)
    )]
    StoreTimeout {
        /// The store's address.
        addr: String,
        /// The keys that were still missing.
        keys: Vec<String>,
        /// How long the caller waited.
        timeout: Duration,
    },

    /// Connecting the ranks of a process group to each other failed.
    #[error("rank {rank}: setting up the process group failed: {detail}")]
    Connect {
        /// The rank that was connecting.
        rank: usize,
        /// What failed.
        detail: String,
    },

    /// Setting up a process group timed out waiting for other ranks: they did not publish
    /// their addresses, connect, or finish their handshakes in time.
    #[error("rank {rank}: setting up the process group failed: {detail}")]
    SetupTimeout {
        /// The rank that was waiting.
        rank: usize,
        /// The ranks it was still waiting for.
        waiting_for: Vec<usize>,
        /// What it waited for, and since when.
        detail: String,
    },

    /// A collective was called with arguments it cannot accept. Detected before the collective
    /// is issued, so it consumes no sequence number.
    #[error("rank {rank}: {collective}: {problem}")]
    InvalidArgument {
        /// The calling rank.
        rank: usize,
        /// The collective, e.g. `all_gather`.
        collective: &'static str,
        /// What is wrong.
        problem: String,
    },

    /// Two ranks issued different collectives (or the same one with different dtypes, sizes,
    /// reduce ops or roots) under one sequence number.
    #[error("{}", fmt_mismatch(*rank, *peer, *seq, *their_seq, ours, theirs))]
    Mismatch {
        /// The rank reporting the mismatch.
        rank: usize,
        /// The rank that disagrees.
        peer: usize,
        /// The sequence number of the collective on this rank.
        seq: u64,
        /// The sequence number the peer gave its collective (differs from `seq` when the ranks
        /// issued different numbers of collectives).
        their_seq: u64,
        /// What this rank issued, e.g. `all_reduce(f32, 100, sum)`.
        ours: String,
        /// What the peer issued.
        theirs: String,
    },

    /// Peers went away during a collective: their connection closed or was reset, or (threads
    /// backend) their group handle was dropped.
    #[error("rank {rank}: {collective} (collective #{seq}) failed: {cause}")]
    PeerLost {
        /// The rank reporting the loss.
        rank: usize,
        /// The ranks that went away.
        peers: Vec<usize>,
        /// The collective in progress.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// How they went away.
        cause: String,
    },

    /// A collective did not finish within the group's timeout.
    #[error(
        "rank {rank}: {collective} (collective #{seq}) timed out after {timeout:?} waiting for \
         {}{}",
        fmt_ranks(waiting_for),
        diagnosis.as_ref().map_or_else(String::new, |d| format!(". Diagnosis: {d}"))
    )]
    Timeout {
        /// The rank that gave up.
        rank: usize,
        /// The collective in progress.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// The configured timeout.
        timeout: Duration,
        /// The ranks this rank was still waiting for.
        waiting_for: Vec<usize>,
        /// Which ranks diverged and where, from the positions of the ranks that reported
        /// theirs (see [`CollectiveLabel`](crate::CollectiveLabel)); `None` when none was made.
        diagnosis: Option<String>,
    },

    /// Another rank failed and told this one, so this collective cannot complete.
    #[error(
        "rank {rank}: {collective} (collective #{seq}) aborted because rank {peer} failed: \
         {message}"
    )]
    PeerAborted {
        /// The rank receiving the report.
        rank: usize,
        /// The rank that failed and reported it.
        peer: usize,
        /// The collective in progress here.
        collective: String,
        /// Its sequence number here.
        seq: u64,
        /// The failed rank's own error message.
        message: String,
    },

    /// Bytes from a peer that are not a valid frame (bad magic, truncated, oversized, out of
    /// order). The connection cannot be trusted afterwards.
    #[error(
        "rank {rank}: {collective} (collective #{seq}): malformed data from rank {peer}: {problem}"
    )]
    Protocol {
        /// The receiving rank.
        rank: usize,
        /// The sending rank.
        peer: usize,
        /// The collective in progress.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// What is wrong with the bytes.
        problem: String,
    },

    /// The group failed earlier; like an aborted NCCL communicator it cannot run collectives
    /// any more. Create a new group (in practice: restart the job).
    #[error(
        "rank {rank}: {collective} (collective #{seq}) not run: the process group is broken by an \
         earlier failure: {cause}"
    )]
    GroupBroken {
        /// The calling rank.
        rank: usize,
        /// The collective that was refused.
        collective: String,
        /// Its sequence number.
        seq: u64,
        /// The failure that broke the group.
        cause: Box<DistError>,
    },

    /// An operating-system error (binding, spawning, signals, starting a thread, polling a
    /// socket).
    #[error("{}{context}: {source}", fmt_rank_prefix(*rank))]
    Io {
        /// The rank that hit it; `None` outside a rank (the launcher, the store's server).
        rank: Option<usize>,
        /// What was being done.
        context: String,
        /// The OS error, with its [`std::io::ErrorKind`].
        #[source]
        source: Arc<std::io::Error>,
    },

    /// A broken invariant inside tandem (a bug, never the user's input): a panicking collective,
    /// state that cannot occur. The message says where.
    #[error("{context}: internal error: {problem}")]
    Internal {
        /// Where it happened (rank, collective, sequence number).
        context: String,
        /// What was found.
        problem: String,
    },

    /// A setting that cannot work (a [`DdpConfig`](crate::DdpConfig) value, parameters on a
    /// device the process group cannot reach, a group too large for its backend). Fix the
    /// program; retrying does not help.
    #[error("rank {rank}: {problem}")]
    Config {
        /// The reporting rank.
        rank: usize,
        /// What is wrong and how to fix it.
        problem: String,
    },

    /// DistributedDataParallel found that the ranks hold different models.
    #[error("rank {rank}: DistributedDataParallel: the model differs across ranks: {detail}")]
    ModelMismatch {
        /// The reporting rank.
        rank: usize,
        /// The first difference, naming the ranks and the parameter.
        detail: String,
    },

    /// The previous backward produced no gradient for some parameters, so their buckets could
    /// not be reduced.
    #[error(
        "rank {rank}: DistributedDataParallel: the previous backward produced no gradient for {}; \
         if parts of the model are legitimately unused in some iterations, set \
         DdpConfig::find_unused_parameters = true; otherwise make every parameter take part in the loss",
        paths.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ")
    )]
    UnusedParameters {
        /// The reporting rank.
        rank: usize,
        /// Module paths of the parameters without gradient.
        paths: Vec<String>,
    },

    /// A synchronised backward ran through a forward that did not go through
    /// [`DistributedDataParallel::forward`](crate::DistributedDataParallel::forward), typically
    /// `ddp.module().forward(x)`. The gradients were reduced, but the buffer broadcast and the
    /// checks of the previous step that only DDP's forward does were skipped.
    #[error(
        "rank {rank}: DistributedDataParallel: this backward ran through a forward that did not go \
         through DistributedDataParallel::forward (was `ddp.module().forward(..)` called?): the \
         gradients were reduced, but rank 0's buffers were not broadcast and the previous step's \
         unused parameters and collectives were not checked; call `ddp.forward(..)` instead, or \
         wrap a backward that should not synchronise in `ddp.no_sync(..)`"
    )]
    ForwardBypassed {
        /// The reporting rank.
        rank: usize,
    },

    /// A parameter's gradient became ready twice in one backward.
    #[error("rank {rank}: DistributedDataParallel: the gradient of `{path}` arrived twice in one backward")]
    GradientReadyTwice {
        /// The reporting rank.
        rank: usize,
        /// The parameter's module path.
        path: String,
    },

    /// DDP's self-check of a backward found a gradient bucket reduced other than exactly once
    /// in a synchronised backward (or at all in a `no_sync` one): the gradients of its
    /// parameters are not the average over ranks the optimizer expects.
    #[error(
        "rank {rank}: DistributedDataParallel: gradient bucket {bucket} was reduced {reductions} \
         time(s) in {backward} (expected {expected}); its parameters: {}. Their gradients are \
         not the ranks' {}; this is a bug in a communication hook or in tandem",
        params.join(", "),
        if *expected == 0 { "local sums" } else { "reduction" }
    )]
    BucketReducedWrongly {
        /// The reporting rank.
        rank: usize,
        /// The bucket's index.
        bucket: usize,
        /// How many reductions were issued for it.
        reductions: u32,
        /// How many were expected: 1 in a synchronised backward, 0 in a `no_sync` one.
        expected: u32,
        /// Which backward, e.g. `synchronised backward #3`.
        backward: String,
        /// The module paths of the bucket's parameters.
        params: Vec<String>,
    },

    /// The wrapped model failed (its forward, or a layer's own error).
    #[error("rank {rank}: {context}: {source}")]
    Model {
        /// The reporting rank.
        rank: usize,
        /// What was being done, e.g. `forward of the wrapped module`.
        context: String,
        /// The model's error (a layer's, or the tensor layer's under it).
        #[source]
        source: Arc<tandem_nn::Error>,
    },

    /// The tensor layer failed under dist's own work: reading or writing a collective's tensors,
    /// a gradient bucket, a kernel on a communication stream.
    #[error("rank {rank}: {context}: {source}")]
    Tensor {
        /// The reporting rank.
        rank: usize,
        /// What was being done: the collective (`all_reduce`), or e.g. ``moving the gradient of
        /// `fc.weight` into its bucket``.
        context: String,
        /// The tensor layer's error (a shape, dtype or device mismatch, a CUDA error, …).
        #[source]
        source: Arc<tandem_core::Error>,
    },

    /// The launcher was misused or a launched rank failed.
    #[error("tandem-run: {0}")]
    Launch(String),

    /// The NCCL library cannot be used: it is missing, too old, or lacks a function.
    #[error("NCCL is not available: {0}")]
    NcclUnavailable(String),

    /// An NCCL call failed, or NCCL reported an asynchronous error.
    #[error("rank {rank}: NCCL: {op}: {detail}")]
    Nccl {
        /// The reporting rank.
        rank: usize,
        /// What was being done, e.g. `all_reduce(f32, 100, sum) (collective #3)`.
        op: String,
        /// NCCL's status and message.
        detail: String,
    },
}

tandem_core::debug_as_display!(DistError);

impl DistError {
    /// An [`DistError::Io`] from an OS error met outside a rank (the launcher, the store's
    /// server); see [`DistError::rank_io`] for one a rank meets.
    pub(crate) fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        DistError::Io {
            rank: None,
            context: context.into(),
            source: Arc::new(err),
        }
    }

    /// An [`DistError::Io`] from an OS error that `rank` met while doing `context`.
    pub(crate) fn rank_io(rank: usize, context: impl Into<String>, err: std::io::Error) -> Self {
        DistError::Io {
            rank: Some(rank),
            context: context.into(),
            source: Arc::new(err),
        }
    }

    /// A [`DistError::Internal`]: `problem` found while doing `context`.
    pub(crate) fn internal(context: impl Into<String>, problem: impl Into<String>) -> Self {
        DistError::Internal {
            context: context.into(),
            problem: problem.into(),
        }
    }

    /// A [`DistError::Config`] reported by `rank`.
    pub(crate) fn config(rank: usize, problem: impl Into<String>) -> Self {
        DistError::Config {
            rank,
            problem: problem.into(),
        }
    }

    /// A [`DistError::Model`]: the wrapped model failed while doing `context`.
    pub(crate) fn model(rank: usize, context: impl Into<String>, err: tandem_nn::Error) -> Self {
        DistError::Model {
            rank,
            context: context.into(),
            source: Arc::new(err),
        }
    }

    /// A [`DistError::Tensor`]: the tensor layer failed while dist was doing `context`.
    pub(crate) fn tensor(rank: usize, context: impl Into<String>, err: tandem_core::Error) -> Self {
        DistError::Tensor {
            rank,
            context: context.into(),
            source: Arc::new(err),
        }
    }

    /// An [`DistError::Env`] for variable `name`.
    pub(crate) fn env(name: &str, problem: impl Into<String>) -> Self {
        DistError::Env {
            name: name.to_string(),
            problem: problem.into(),
        }
    }

    /// The ranks this error blames, if any (the peer that went away, disagreed, sent garbage,
    /// or that this rank was waiting for).
    pub fn blamed_ranks(&self) -> Vec<usize> {
        match self {
            DistError::Mismatch { peer, .. }
            | DistError::PeerAborted { peer, .. }
            | DistError::Protocol { peer, .. } => vec![*peer],
            DistError::PeerLost { peers, .. } => peers.clone(),
            DistError::Timeout { waiting_for, .. }
            | DistError::SetupTimeout { waiting_for, .. } => waiting_for.clone(),
            DistError::GroupBroken { cause, .. } => cause.blamed_ranks(),
            _ => Vec::new(),
        }
    }

    /// The hang diagnosis a timed-out collective carries: which ranks diverged and where.
    pub fn diagnosis(&self) -> Option<&str> {
        match self {
            DistError::Timeout { diagnosis, .. } => diagnosis.as_deref(),
            DistError::GroupBroken { cause, .. } => cause.diagnosis(),
            _ => None,
        }
    }
}

impl From<DistError> for tandem_core::Error {
    fn from(err: DistError) -> Self {
        tandem_core::Error::external("collective", err)
    }
}

fn fmt_mismatch(
    rank: usize,
    peer: usize,
    seq: u64,
    their_seq: u64,
    ours: &str,
    theirs: &str,
) -> String {
    if seq == their_seq {
        format!("rank {peer} issued {theirs} as collective #{seq} but rank {rank} issued {ours}")
    } else {
        format!(
            "rank {peer} issued {theirs} as collective #{their_seq} but rank {rank} issued \
             {ours} as collective #{seq}: the ranks issued different numbers of collectives"
        )
    }
}

/// `rank 3: ` for an error a rank met, nothing otherwise.
fn fmt_rank_prefix(rank: Option<usize>) -> String {
    rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
}

/// `after collective #4`, or `before its first collective` for 0 completed collectives.
pub(crate) fn fmt_left_after(completed: u64) -> String {
    if completed == 0 {
        "before its first collective".to_string()
    } else {
        format!("after collective #{completed}")
    }
}

/// How many items of a list a message names before it says how many more there are.
const LISTED: usize = 8;

/// `49999997` as `49,999,997`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let head = digits.len() % 3;
    let mut groups: Vec<&str> = Vec::new();
    if head > 0 {
        groups.push(&digits[..head]);
    }
    groups.extend(
        digits.as_bytes()[head..]
            .chunks(3)
            .filter_map(|c| std::str::from_utf8(c).ok()),
    );
    groups.join(",")
}

/// Formats `[3]` as `rank 3` and `[1, 2]` as `ranks 1, 2` for messages; a long list names its
/// first few and counts the rest (`ranks 0, 1, … and 49,999,992 more`), so that a message stays
/// short whatever the world size.
pub(crate) fn fmt_ranks(ranks: &[usize]) -> String {
    match ranks {
        [] => "no rank".to_string(),
        [one] => format!("rank {one}"),
        many => format!(
            "ranks {}",
            join_bounded(many.iter().map(|r| r.to_string()), many.len())
        ),
    }
}

/// A list of keys (or any names) for a message, bounded like [`fmt_ranks`].
fn fmt_list(items: &[String]) -> String {
    join_bounded(items.iter().map(|k| format!("{k:?}")), items.len())
}

fn join_bounded(items: impl Iterator<Item = String>, len: usize) -> String {
    let mut out: Vec<String> = items.take(LISTED).collect();
    if len > LISTED {
        let last = out.len() - 1;
        out[last] = format!("{} … and {} more", out[last], thousands(len - LISTED));
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_message_names_both_ranks_and_the_sequence_number() {
        let err = DistError::Mismatch {
            rank: 0,
            peer: 1,
            seq: 3,
            their_seq: 3,
            ours: "broadcast(f32, 100, root 0)".into(),
            theirs: "all_reduce(f32, 100, sum)".into(),
        };
        assert_eq!(
            err.to_string(),
            "rank 1 issued all_reduce(f32, 100, sum) as collective #3 but rank 0 issued \
             broadcast(f32, 100, root 0)"
        );
        assert_eq!(err.blamed_ranks(), vec![1]);
    }

    #[test]
    fn rank_lists_read_naturally() {
        assert_eq!(fmt_ranks(&[3]), "rank 3");
        assert_eq!(fmt_ranks(&[1, 2]), "ranks 1, 2");
        assert_eq!(fmt_ranks(&[]), "no rank");
        let many: Vec<usize> = (3..50_000_003).collect();
        let text = fmt_ranks(&many);
        assert_eq!(text, "ranks 3, 4, 5, 6, 7, 8, 9, 10 … and 49,999,992 more");
        let err = DistError::StoreTimeout {
            addr: "h:1".into(),
            keys: (0..4096)
                .map(|k| format!("tandem/default/addr/{k}"))
                .collect(),
            timeout: Duration::from_secs(1),
        };
        assert!(err.to_string().len() < 500, "{err}");
    }

    #[test]
    fn wrapped_errors_stay_reachable_as_sources() {
        use std::error::Error as _;
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let err = DistError::io("connecting to rank 1", refused);
        assert_eq!(err.to_string(), "connecting to rank 1: connection refused");
        let io = err
            .source()
            .and_then(|s| s.downcast_ref::<Arc<std::io::Error>>())
            .expect("the io::Error is the source");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        let err = DistError::rank_io(
            3,
            "connecting to rank 1 at 127.0.0.1:29500",
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        );
        assert_eq!(
            err.to_string(),
            "rank 3: connecting to rank 1 at 127.0.0.1:29500: connection refused"
        );
        assert!(matches!(err, DistError::Io { rank: Some(3), .. }));
        let io = err
            .source()
            .and_then(|s| s.downcast_ref::<Arc<std::io::Error>>())
            .expect("a rank's io::Error is the source too");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);

        let shape = tandem_core::Error::shape("copy_", "destination [2] vs source [3]");
        let err = DistError::tensor(
            0,
            "moving the gradient of `fc.weight` into its bucket",
            shape,
        );
        assert!(err
            .to_string()
            .starts_with("rank 0: moving the gradient of `fc.weight`"));
        let core = err
            .source()
            .and_then(|s| s.downcast_ref::<Arc<tandem_core::Error>>())
            .expect("the tensor error is the source");
        assert!(matches!(
            **core,
            tandem_core::Error::Shape { op: "copy_", .. }
        ));
        // Clones share the source.
        assert!(err.clone().source().is_some());

        let config = DistError::config(2, "DdpConfig: bucket_cap_mb (0) must be positive");
        assert_eq!(
            config.to_string(),
            "rank 2: DdpConfig: bucket_cap_mb (0) must be positive"
        );
        assert!(config.source().is_none());
    }

    #[test]
    fn debug_prints_the_message_with_its_advice() {
        let err = DistError::UnusedParameters {
            rank: 0,
            paths: vec!["branch.weight".into(), "branch.bias".into()],
        };
        let debug = format!("{err:?}");
        assert_eq!(debug, err.to_string());
        assert!(
            debug.contains("`branch.weight`, `branch.bias`")
                && debug.contains("DdpConfig::find_unused_parameters = true"),
            "{debug}"
        );
        // What `fn main() -> Result<(), Box<dyn Error>>` prints.
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert_eq!(format!("{boxed:?}"), debug);
        // A wrapped error that the message already quotes is not repeated.
        let err = DistError::rank_io(
            1,
            "connecting to rank 0",
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        );
        assert_eq!(
            format!("{err:?}"),
            "rank 1: connecting to rank 0: connection refused"
        );
    }

    #[test]
    fn broken_group_blames_the_original_culprit() {
        let cause = DistError::PeerLost {
            rank: 0,
            peers: vec![2],
            collective: "all_reduce(f32, 8, sum)".into(),
            seq: 4,
            cause: "rank 2 closed its connection".into(),
        };
        let err = DistError::GroupBroken {
            rank: 0,
            collective: "barrier()".into(),
            seq: 5,
            cause: Box::new(cause),
        };
        assert_eq!(err.blamed_ranks(), vec![2]);
        assert!(err.to_string().contains("rank 2 closed"), "{err}");
    }
}
