//! Where each rank stands in its sequence of collectives, and the diagnosis of a hang built from
//! every rank's position.
//!
//! Every group remembers, cheaply (one short lock per collective, a ring of the last
//! [`RECENT`] records), its last issued and last completed collective: sequence number,
//! descriptor and the label the caller gave it ([`with_collective_label`]: DDP labels its bucket
//! all-reduces "bucket 3", SyncBatchNorm its statistics). When a collective times out, the
//! backend gathers the positions of the ranks it can reach — directly for ranks that are
//! threads of one process, through the rendezvous store (key `tandem/progress/<group>/<rank>`,
//! a bounded wait) for processes — and [`diagnose`] says which ranks diverged and where, e.g.
//! `rank 2 is at all_reduce #118 (bucket 3; f32 × 1024), completed, and has issued nothing
//! since, while ranks 0, 1, 3 wait at all_reduce #119 (SyncBatchNorm statistics; f32 × 64)`.

use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{CollectiveDesc, CollectiveKind};
use crate::error::fmt_ranks;
use crate::store::TcpStore;

/// How many issued collectives a rank remembers (enough for the buckets of one backward that
/// are in flight at once in any realistic model; older ones are described by number only).
const RECENT: usize = 64;
/// Longest description of a position kept in the store.
const MAX_POSITION_BYTES: usize = 512;
/// Most ranks whose positions a diagnosis gathers through the store.
const MAX_GATHERED: usize = 1024;
/// Most groups of ranks at other positions than the reference that a diagnosis names.
const MAX_GROUPS_NAMED: usize = 8;

/// What a collective is for, shown in hang diagnoses next to its sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveLabel {
    /// DDP's all-reduce of gradient bucket `n`.
    Bucket(usize),
    /// SyncBatchNorm's all-reduce of the batch statistics.
    SyncBatchNormStatistics,
    /// DDP's broadcast of rank 0's bucket order (after the first backward).
    BucketOrderBroadcast,
    /// DDP's all-reduce counting which ranks used each parameter (`find_unused_parameters`).
    UnusedParameterAgreement,
    /// Anything else, named by the caller.
    Named(&'static str),
}

impl fmt::Display for CollectiveLabel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveLabel::Bucket(b) => write!(f, "bucket {b}"),
            CollectiveLabel::SyncBatchNormStatistics => f.write_str("SyncBatchNorm statistics"),
            CollectiveLabel::BucketOrderBroadcast => f.write_str("bucket-order broadcast"),
            CollectiveLabel::UnusedParameterAgreement => f.write_str("unused-parameter agreement"),
            CollectiveLabel::Named(name) => f.write_str(name),
        }
    }
}

thread_local! {
    /// The label of the collectives this thread issues now (see [`with_collective_label`]).
    static LABEL: Cell<Option<CollectiveLabel>> = const { Cell::new(None) };
}

/// Runs `f` with every collective it issues on this thread, on any group, labelled `label` in
/// hang diagnoses (the innermost label wins; the previous one is restored afterwards, also when
/// `f` panics). Labels change nothing else: ranks need not agree on them.
pub fn with_collective_label<R>(label: CollectiveLabel, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<CollectiveLabel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LABEL.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(LABEL.with(|l| l.replace(Some(label))));
    f()
}

/// The label set on this thread, if any.
pub(crate) fn current_label() -> Option<CollectiveLabel> {
    LABEL.with(Cell::get)
}

/// One issued collective.
#[derive(Clone, Copy, Debug)]
struct Record {
    seq: u64,
    desc: CollectiveDesc,
    label: Option<CollectiveLabel>,
}

impl Record {
    /// `all_reduce #119 (SyncBatchNorm statistics; f32 × 64)`.
    fn describe(&self) -> String {
        let name = self.desc.kind.name();
        let size = match (self.desc.kind, self.desc.dtype) {
            (CollectiveKind::Barrier, _) | (_, None) => String::new(),
            (_, Some(dtype)) => format!("{} × {}", dtype.name(), self.desc.numel),
        };
        match (self.label, size.is_empty()) {
            (Some(label), true) => format!("{name} #{} ({label})", self.seq),
            (Some(label), false) => format!("{name} #{} ({label}; {size})", self.seq),
            (None, true) => format!("{name} #{}", self.seq),
            (None, false) => format!("{name} #{} ({size})", self.seq),
        }
    }
}

#[derive(Default)]
struct ProgressState {
    /// The last [`RECENT`] issued collectives, oldest first.
    recent: VecDeque<Record>,
    /// Sequence number of the last issued collective (0: none yet).
    issued: u64,
    /// Sequence number of the last completed collective (0: none yet).
    completed: u64,
}

/// One rank's last issued and last completed collective.
#[derive(Default)]
pub(crate) struct Progress {
    state: Mutex<ProgressState>,
}

impl Progress {
    /// Notes that collective `seq` was issued, labelled with this thread's label.
    pub(crate) fn issued(&self, seq: u64, desc: CollectiveDesc) {
        let label = current_label();
        let mut state = self.state.lock();
        if state.recent.len() == RECENT {
            state.recent.pop_front();
        }
        state.recent.push_back(Record { seq, desc, label });
        state.issued = state.issued.max(seq);
    }

    /// Notes that collective `seq` completed successfully.
    pub(crate) fn completed(&self, seq: u64) {
        let mut state = self.state.lock();
        state.completed = state.completed.max(seq);
    }

    /// Describes collective `seq` as this rank issued it (by number only when forgotten).
    pub(crate) fn describe(&self, seq: u64) -> String {
        let state = self.state.lock();
        describe_in(&state, seq)
    }

    /// Where this rank stands now.
    pub(crate) fn position(&self) -> Position {
        let state = self.state.lock();
        if state.issued > state.completed {
            let seq = state.completed + 1;
            Position::Waiting {
                seq,
                what: describe_in(&state, seq),
            }
        } else if state.issued == 0 {
            Position::Fresh
        } else {
            Position::Idle {
                seq: state.issued,
                what: describe_in(&state, state.issued),
            }
        }
    }
}

fn describe_in(state: &ProgressState, seq: u64) -> String {
    state
        .recent
        .iter()
        .rev()
        .find(|r| r.seq == seq)
        .map_or_else(|| format!("collective #{seq}"), Record::describe)
}

/// Where a rank stands, as it reports it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Position {
    /// It issued no collective yet.
    Fresh,
    /// Its collectives up to `seq` completed and it issued no later one.
    Idle {
        /// Its last collective.
        seq: u64,
        /// That collective, described.
        what: String,
    },
    /// It waits for collective `seq` (issued, not completed).
    Waiting {
        /// The collective it waits for.
        seq: u64,
        /// That collective, described.
        what: String,
    },
    /// It did not report; the reporter waited for it at collective `seq` (0: unknown).
    Unreported {
        /// The collective the reporter waited for it at, 0 if none.
        seq: u64,
    },
}

impl Position {
    /// The text kept in the store: `waiting <seq> <what>`, `idle <seq> <what>` or `fresh`.
    pub(crate) fn encode(&self) -> String {
        let mut text = match self {
            Position::Fresh | Position::Unreported { .. } => "fresh".to_string(),
            Position::Idle { seq, what } => format!("idle {seq} {what}"),
            Position::Waiting { seq, what } => format!("waiting {seq} {what}"),
        };
        let mut cut = text.len().min(MAX_POSITION_BYTES);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text
    }

    /// Reads what [`Position::encode`] wrote; `None` for anything else.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Position> {
        let text = std::str::from_utf8(bytes).ok()?;
        if text == "fresh" {
            return Some(Position::Fresh);
        }
        let (state, rest) = text.split_once(' ')?;
        let (seq, what) = rest.split_once(' ')?;
        let (seq, what) = (seq.parse().ok()?, what.to_string());
        match state {
            "idle" => Some(Position::Idle { seq, what }),
            "waiting" => Some(Position::Waiting { seq, what }),
            _ => None,
        }
    }

    /// `wait at …` / `is at …` for `n` ranks.
    fn phrase(&self, n: usize, waited_at: &str) -> String {
        let (is, wait, has) = if n == 1 {
            ("is", "waits", "has")
        } else {
            ("are", "wait", "have")
        };
        match self {
            Position::Fresh => format!("{has} issued no collective yet"),
            Position::Idle { what, .. } => {
                format!("{is} at {what}, completed, and {has} issued nothing since")
            }
            Position::Waiting { what, .. } => format!("{wait} at {what}"),
            Position::Unreported { seq: 0 } => {
                "did not report (stopped, hung, or busy outside collectives)".to_string()
            }
            Position::Unreported { .. } => format!(
                "did not report and never joined {waited_at}: stopped, hung, or issued fewer \
                 collectives (its last is an earlier one)"
            ),
        }
    }
}

/// Says which ranks diverged and where, from every rank's position (`None`: the rank did not
/// report). The largest group of ranks at the same position is the reference; the others are
/// named first, e.g. `rank 2 is at all_reduce #118 (bucket 3), completed, and has issued
/// nothing since, while ranks 0, 1, 3 wait at all_reduce #119 (SyncBatchNorm statistics)`.
pub(crate) fn diagnose(positions: &[(usize, Position)]) -> String {
    let mut groups: BTreeMap<&Position, Vec<usize>> = BTreeMap::new();
    for (rank, position) in positions {
        groups.entry(position).or_default().push(*rank);
    }
    // The reference: the most ranks; among equals, the furthest along.
    let reference = groups
        .iter()
        .filter(|(p, _)| !matches!(p, Position::Unreported { .. }))
        .max_by_key(|(p, ranks)| (ranks.len(), sequence(p)))
        .map(|(p, _)| (*p).clone());
    let waited_at = positions
        .iter()
        .find_map(|(_, p)| match p {
            Position::Waiting { seq, what } => Some((*seq, what.clone())),
            _ => None,
        })
        .map_or_else(String::new, |(_, what)| what);
    let say = |p: &Position, ranks: &[usize]| {
        format!("{} {}", fmt_ranks(ranks), p.phrase(ranks.len(), &waited_at))
    };
    let mut diverged: Vec<String> = groups
        .iter()
        .filter(|(p, _)| Some(**p) != reference.as_ref())
        .map(|(p, ranks)| say(p, ranks))
        .collect();
    // Bounded, however scattered the ranks are.
    if diverged.len() > MAX_GROUPS_NAMED {
        let more = diverged.len() - MAX_GROUPS_NAMED;
        diverged.truncate(MAX_GROUPS_NAMED);
        diverged.push(format!("{more} more groups of ranks elsewhere"));
    }
    match (reference, diverged.is_empty()) {
        (Some(r), true) if groups[&r].len() > 1 => format!("all of {}", say(&r, &groups[&r])),
        (Some(r), true) => say(&r, &groups[&r]),
        (Some(r), false) => format!("{}, while {}", diverged.join("; "), say(&r, &groups[&r])),
        (None, _) => diverged.join("; "),
    }
}

fn sequence(p: &Position) -> u64 {
    match p {
        Position::Idle { seq, .. } | Position::Waiting { seq, .. } => *seq,
        Position::Fresh | Position::Unreported { .. } => 0,
    }
}

/// The store key of `rank`'s position in group `group`.
fn key(group: &str, rank: usize) -> String {
    format!("tandem/progress/{group}/{rank}")
}

/// Leaves `position` in the store for the other ranks' diagnoses, without waiting behind the
/// application on a busy connection (a failing path must not block).
pub(crate) fn post(store: &TcpStore, group: &str, rank: usize, position: &Position) {
    let _ = store.try_set(&key(group, rank), position.encode().as_bytes());
}

/// Posts this rank's `own` position and gathers, for at most `bound`, the positions of the
/// other ranks (of the first [`MAX_GATHERED`]) from the store; a rank in `waited_for` that did
/// not report is shown as never having joined collective `seq`.
pub(crate) fn gather(
    store: &TcpStore,
    group: &str,
    (rank, world): (usize, usize),
    own: Position,
    (seq, waited_for): (u64, &[usize]),
    bound: Duration,
) -> Vec<(usize, Position)> {
    // A connection of its own: the rank's usual one may be busy with the application's wait.
    let own_store = TcpStore::connect_with_secret(store.addr(), bound, store.secret().cloned());
    let store = own_store.as_ref().ok();
    if let Some(store) = store {
        post(store, group, rank, &own);
    }
    let ranks: Vec<usize> = (0..world.min(MAX_GATHERED)).collect();
    let keys: Vec<String> = ranks.iter().map(|&q| key(group, q)).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + bound;
    let mut found: Vec<Option<Position>> = vec![None; ranks.len()];
    while let Some(store) = store {
        if let Ok(values) = store.get_many(&keys, MAX_POSITION_BYTES) {
            for (slot, value) in found.iter_mut().zip(values) {
                if let Some(position) = value.as_deref().and_then(Position::decode) {
                    *slot = Some(position);
                }
            }
        }
        if found.iter().all(Option::is_some) || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks
        .into_iter()
        .zip(found)
        .map(|(q, p)| {
            let p = match p {
                _ if q == rank => own.clone(),
                Some(p) => p,
                None if waited_for.contains(&q) => Position::Unreported { seq },
                None => Position::Unreported { seq: 0 },
            };
            (q, p)
        })
        .collect()
}

/// How long a rank whose collective timed out after `timeout` waits for the others' positions:
/// long enough for the ranks that time out at about the same moment, never long.
pub(crate) fn gather_bound(timeout: Duration) -> Duration {
    timeout.clamp(Duration::from_millis(200), Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process_group::describe_barrier;
    use crate::ReduceOp;
    use tandem_core::DType;

    fn all_reduce(numel: u64) -> CollectiveDesc {
        CollectiveDesc {
            kind: CollectiveKind::AllReduce,
            dtype: Some(DType::F32),
            numel,
            op: Some(ReduceOp::Sum),
            root: None,
        }
    }

    #[test]
    fn positions_follow_issue_and_completion_with_the_callers_label() {
        let progress = Progress::default();
        assert_eq!(progress.position(), Position::Fresh);
        with_collective_label(CollectiveLabel::Bucket(3), || {
            progress.issued(1, all_reduce(4))
        });
        assert_eq!(current_label(), None, "the label is scoped");
        let waiting = progress.position();
        assert_eq!(
            waiting,
            Position::Waiting {
                seq: 1,
                what: "all_reduce #1 (bucket 3; f32 × 4)".into()
            }
        );
        progress.completed(1);
        progress.issued(2, describe_barrier());
        progress.completed(2);
        let idle = progress.position();
        assert_eq!(
            idle,
            Position::Idle {
                seq: 2,
                what: "barrier #2".into()
            }
        );
        for p in [waiting, idle, Position::Fresh] {
            assert_eq!(Position::decode(p.encode().as_bytes()), Some(p));
        }
    }

    #[test]
    fn the_diagnosis_names_the_diverged_rank_and_where_the_others_wait() {
        let behind = Position::Idle {
            seq: 118,
            what: "all_reduce #118 (bucket 3)".into(),
        };
        let ahead = Position::Waiting {
            seq: 119,
            what: "all_reduce #119 (SyncBatchNorm statistics)".into(),
        };
        let positions = [
            (0, ahead.clone()),
            (1, ahead.clone()),
            (2, behind),
            (3, ahead.clone()),
        ];
        assert_eq!(
            diagnose(&positions),
            "rank 2 is at all_reduce #118 (bucket 3), completed, and has issued nothing since, \
             while ranks 0, 1, 3 wait at all_reduce #119 (SyncBatchNorm statistics)"
        );
        let silent = [(0, ahead.clone()), (1, Position::Unreported { seq: 119 })];
        let text = diagnose(&silent);
        assert!(
            text.starts_with("rank 1 did not report and never joined all_reduce #119")
                && text
                    .ends_with("while rank 0 waits at all_reduce #119 (SyncBatchNorm statistics)"),
            "{text}"
        );
        assert!(diagnose(&[(0, ahead.clone()), (1, ahead)]).starts_with("all of ranks 0, 1 wait"));
    }
}
