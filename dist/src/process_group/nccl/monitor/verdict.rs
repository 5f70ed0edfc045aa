//! [`Monitor::assess`]: turning what the heartbeats say into a verdict for the watchdog, one
//! concern at a time — the store, every other rank, the neighbour's collectives, this rank's
//! collective in flight (see the parent module's docs for the verdicts).

use std::time::{Duration, Instant};

use super::super::record::{decode_desc, HistoryEntry, PeerState, DESC_BYTES};
use super::{InFlight, Inner, Local, Monitor, PeerView, FAILED_EXCHANGES};
use crate::error::fmt_left_after;
use crate::process_group::progress::{diagnose, Position};
use crate::DistError;

/// Where this rank stands when a verdict is made: what every error names.
struct At {
    rank: usize,
    /// The collective in flight, or "the next collective".
    collective: String,
    seq: u64,
}

impl At {
    /// `peers` are lost to this rank, because of `cause`.
    fn lost(&self, peers: Vec<usize>, cause: String) -> DistError {
        DistError::PeerLost {
            rank: self.rank,
            peers,
            collective: self.collective.clone(),
            seq: self.seq,
            cause,
        }
    }
}

impl Monitor {
    /// The verdict on the group as this rank sees it now (see the module docs), or `None`
    /// while all is well. `in_flight` is this rank's oldest unfinished collective; `timeout`
    /// the group's collective timeout.
    pub(crate) fn assess(
        &self,
        now: Instant,
        in_flight: Option<InFlight>,
        timeout: Duration,
    ) -> Option<DistError> {
        let inner = &self.inner;
        let (issued, local_state) = {
            let local = inner.local.lock();
            (local.issued, local.state.clone())
        };
        if matches!(local_state, PeerState::Failed(_)) {
            return None; // already failed; the watchdog knows why
        }
        let at = match &in_flight {
            Some(f) => At {
                rank: inner.rank,
                collective: f.desc.to_string(),
                seq: f.seq,
            },
            None => At {
                rank: inner.rank,
                collective: "the next collective".to_string(),
                seq: issued + 1,
            },
        };
        if let Some(err) = store_verdict(inner, &at, now) {
            return Some(err);
        }
        let peers = inner.peers.lock().clone();
        for (peer, view) in peers.iter().enumerate() {
            if peer == inner.rank {
                continue;
            }
            if let Some(err) = peer_verdict(inner, &at, now, peer, view, in_flight) {
                return Some(err);
            }
        }
        if let Some(err) = self.compare_with_neighbour() {
            return Some(err);
        }
        let f = in_flight?;
        let started = f.started_at?;
        (now.saturating_duration_since(started) > timeout)
            .then(|| timeout_verdict(inner, at, &peers, f.seq, timeout))
    }

    /// Compares this rank's collectives with its neighbour's latest history.
    fn compare_with_neighbour(&self) -> Option<DistError> {
        let inner = &self.inner;
        if inner.world < 2 {
            return None;
        }
        let peer = (inner.rank + 1) % inner.world;
        let theirs = match inner.neighbour_history.lock().clone()? {
            Ok(h) => h,
            Err(problem) => {
                let local = inner.local.lock();
                return Some(DistError::Protocol {
                    rank: inner.rank,
                    peer,
                    collective: "the next collective".into(),
                    seq: local.issued + 1,
                    problem: format!("its collective history in the store is malformed: {problem}"),
                });
            }
        };
        let local = inner.local.lock();
        let (seq, ours, theirs, exact) = find_divergence(&local, &theirs)?;
        let show = |code: &[u8; DESC_BYTES]| {
            decode_desc(code).map_or_else(|e| format!("<{e}>"), |d| d.to_string())
        };
        let mut their_text = show(&theirs);
        if !exact {
            their_text.push_str(&format!(
                " (their collectives already differed from this rank's before #{seq})"
            ));
        }
        Some(DistError::Mismatch {
            rank: inner.rank,
            peer,
            seq,
            their_seq: seq,
            ours: show(&ours),
            theirs: their_text,
        })
    }
}

/// The store: unreachable for too long, or too many failed exchanges in a row.
fn store_verdict(inner: &Inner, at: &At, now: Instant) -> Option<DistError> {
    let link = inner.link.lock();
    let silent = now.saturating_duration_since(link.last_ok);
    if silent <= inner.timing.stale_after && link.failures < FAILED_EXCHANGES {
        return None;
    }
    let why = link
        .error
        .clone()
        .unwrap_or_else(|| format!("no answer for {:.1} s", silent.as_secs_f64()));
    let rank = at.rank;
    Some(match inner.store_owner {
        Some(owner) if owner != rank => at.lost(
            vec![owner],
            format!(
                "lost the rendezvous store, which rank {owner} serves ({why}): rank {owner} has \
                 exited or is unreachable"
            ),
        ),
        _ => DistError::Store {
            addr: inner.store.addr().to_string(),
            op: format!(
                "heartbeat of rank {rank} during {} (collective #{})",
                at.collective, at.seq
            ),
            detail: why,
        },
    })
}

/// One other rank, as its heartbeat shows it: malformed, failed, left or gone while this rank
/// waits for it, or silent for too long.
fn peer_verdict(
    inner: &Inner,
    at: &At,
    now: Instant,
    peer: usize,
    view: &PeerView,
    in_flight: Option<InFlight>,
) -> Option<DistError> {
    if let Some(problem) = &view.malformed {
        return Some(DistError::Protocol {
            rank: at.rank,
            peer,
            collective: at.collective.clone(),
            seq: at.seq,
            problem: format!("its heartbeat in the store is malformed: {problem}"),
        });
    }
    let beat = view.beat.as_ref()?;
    let waits_for_it = in_flight.is_some_and(|f| f.seq > beat.done);
    match &beat.state {
        PeerState::Failed(message) => Some(DistError::PeerAborted {
            rank: at.rank,
            peer,
            collective: at.collective.clone(),
            seq: at.seq,
            message: message.clone(),
        }),
        PeerState::Left if waits_for_it => Some(at.lost(
            vec![peer],
            format!("rank {peer} left the group {}", fmt_left_after(beat.done)),
        )),
        PeerState::Gone => {
            let since = view.gone_since.unwrap_or(now);
            (waits_for_it && now.saturating_duration_since(since) >= inner.timing.gone_grace).then(
                || {
                    at.lost(
                        vec![peer],
                        format!(
                            "rank {peer}'s process exited (its connection to the rendezvous \
                             store closed) {}",
                            fmt_left_after(beat.done)
                        ),
                    )
                },
            )
        }
        PeerState::Running => {
            let silent = now.saturating_duration_since(view.changed_at);
            (silent > inner.timing.stale_after).then(|| {
                at.lost(
                    vec![peer],
                    format!(
                        "no heartbeat from rank {peer} for {:.1} s: its process is stopped or \
                         hung, or its host is unreachable (it had issued collective #{} and \
                         finished #{})",
                        silent.as_secs_f64(),
                        beat.issued,
                        beat.done
                    ),
                )
            })
        }
        PeerState::Left => None,
    }
}

/// This rank's collective `seq` ran longer than `timeout`: waiting for the ranks that have not
/// issued it, else those that have not started it, else those that have not finished it.
fn timeout_verdict(
    inner: &Inner,
    at: At,
    peers: &[PeerView],
    seq: u64,
    timeout: Duration,
) -> DistError {
    let rank = at.rank;
    let others = || (0..inner.world).filter(move |&p| p != rank);
    let progress = |p: usize| {
        peers[p]
            .beat
            .as_ref()
            .map(|b| (b.issued, b.started, b.done))
    };
    let mut waiting_for: Vec<usize> = others()
        .filter(|&p| progress(p).is_some_and(|(i, _, _)| i < seq))
        .collect();
    if waiting_for.is_empty() {
        waiting_for = others()
            .filter(|&p| progress(p).is_some_and(|(_, s, _)| s < seq))
            .collect();
    }
    if waiting_for.is_empty() {
        waiting_for = others()
            .filter(|&p| progress(p).is_none_or(|(_, _, d)| d < seq))
            .collect();
    }
    let diagnosis = Some(diagnose_from_beats(inner, peers, seq));
    DistError::Timeout {
        rank,
        collective: at.collective,
        seq: at.seq,
        timeout,
        waiting_for,
        diagnosis,
    }
}

/// Which ranks diverged and where, from the heartbeats (every rank's last issued and last
/// finished collective, at most one interval old), described with this rank's own records
/// (every rank issues the same collective under a sequence number, or the neighbours' check
/// says otherwise).
fn diagnose_from_beats(inner: &Inner, peers: &[PeerView], seq: u64) -> String {
    let progress = &inner.progress;
    let position = |issued: u64, done: u64| match (issued, done) {
        (0, _) => Position::Fresh,
        (i, d) if i > d => Position::Waiting {
            seq: d + 1,
            what: progress.describe(d + 1),
        },
        (i, _) => Position::Idle {
            seq: i,
            what: progress.describe(i),
        },
    };
    let own = {
        let local = inner.local.lock();
        position(local.issued, local.done)
    };
    let positions: Vec<(usize, Position)> = (0..inner.world)
        .map(|p| {
            let reported = match peers.get(p).and_then(|v| v.beat.as_ref()) {
                _ if p == inner.rank => own.clone(),
                Some(beat) if matches!(beat.state, PeerState::Running) => {
                    position(beat.issued, beat.done)
                }
                _ => Position::Unreported { seq },
            };
            (p, reported)
        })
        .collect();
    diagnose(&positions)
}

/// The first collective at which `theirs` (a neighbour's published history) and this rank's
/// history differ: `(seq, our descriptor, theirs, exact)`, where `exact` is false when the
/// descriptors at that point are equal and only the chain hashes say that an earlier
/// collective, older than what both still remember, differed.
fn find_divergence(
    local: &Local,
    theirs: &[HistoryEntry],
) -> Option<(u64, [u8; DESC_BYTES], [u8; DESC_BYTES], bool)> {
    for entry in theirs {
        let Some(mine) = local.entry(entry.seq) else {
            continue;
        };
        if mine.hash != entry.hash {
            return Some((entry.seq, mine.desc, entry.desc, mine.desc != entry.desc));
        }
    }
    None
}
