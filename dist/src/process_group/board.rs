//! The rendezvous board of the in-process backends (ranks as threads of one process).
//!
//! Each collective is a rendezvous on a shared board: every rank posts its contribution under
//! the collective's sequence number and descriptor, waits until all ranks have posted, and
//! takes every rank's contribution in rank order. What a contribution is depends on the
//! backend — a host snapshot of the tensor (`threads`), or a device snapshot and the event after
//! which it is written (`device_threads`) — so the board is generic over it. A post whose
//! descriptor differs from this rank's is a mismatch naming both; a rank whose handle was
//! dropped is reported as having left; the first rank to fail marks the board so that the
//! others fail at once naming it; nothing waits longer than the group's timeout.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::CollectiveDesc;
use crate::error::fmt_left_after;
use crate::{DistError, Result};

/// One rank's contribution to one collective.
struct Post<D> {
    seq: u64,
    desc: CollectiveDesc,
    data: D,
    /// Ranks that have not taken it yet; removed when it reaches 0.
    unread: usize,
}

struct State<D> {
    posts: Vec<VecDeque<Post<D>>>,
    /// `Some(completed)` once a rank's handle was dropped after `completed` collectives.
    left: Vec<Option<u64>>,
    /// The first rank that failed, and its error.
    failed: Option<(usize, DistError)>,
}

/// The board shared by every rank of one in-process group.
pub(crate) struct Board<D> {
    /// The backend's handle type, for messages (`ThreadProcessGroup`).
    handle: &'static str,
    world: usize,
    timeout: Duration,
    state: Mutex<State<D>>,
    changed: Condvar,
}

impl<D: Clone> Board<D> {
    /// An empty board for `world` ranks whose rendezvous give up after `timeout`; `handle`
    /// names the backend's handle type in messages.
    pub(crate) fn new(handle: &'static str, world: usize, timeout: Duration) -> Self {
        Board {
            handle,
            world,
            timeout,
            state: Mutex::new(State {
                posts: (0..world).map(|_| VecDeque::new()).collect(),
                left: vec![None; world],
                failed: None,
            }),
            changed: Condvar::new(),
        }
    }

    /// Number of ranks.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Posts `data` as `rank`'s contribution to collective `seq` and waits (at most the
    /// timeout) for everyone's; returns them in rank order.
    pub(crate) fn exchange(
        &self,
        rank: usize,
        seq: u64,
        desc: &CollectiveDesc,
        data: D,
    ) -> Result<Vec<D>> {
        let world = self.world;
        let mut state = self.state.lock();
        state.posts[rank].push_back(Post {
            seq,
            desc: *desc,
            data,
            unread: world,
        });
        self.changed.notify_all();
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut missing = Vec::new();
            for q in 0..world {
                match state.posts[q].iter().find(|p| p.seq == seq) {
                    Some(post) if post.desc != *desc => {
                        return Err(DistError::Mismatch {
                            rank,
                            peer: q,
                            seq,
                            their_seq: seq,
                            ours: desc.to_string(),
                            theirs: post.desc.to_string(),
                        })
                    }
                    Some(_) => {}
                    None => missing.push(q),
                }
            }
            if missing.is_empty() {
                break;
            }
            // The root cause first: a rank that left is named directly, not through the first
            // rank that noticed.
            let gone: Vec<(usize, u64)> = missing
                .iter()
                .filter_map(|&q| state.left[q].map(|c| (q, c)))
                .collect();
            if let Some(&(q, completed)) = gone.first() {
                return Err(DistError::PeerLost {
                    rank,
                    peers: gone.iter().map(|g| g.0).collect(),
                    collective: desc.to_string(),
                    seq,
                    cause: format!(
                        "rank {q} left the group (its {} was dropped) {}; it never issued \
                         collective #{seq}",
                        self.handle,
                        fmt_left_after(completed)
                    ),
                });
            }
            if let Some((peer, err)) = &state.failed {
                if *peer != rank {
                    return Err(DistError::PeerAborted {
                        rank,
                        peer: *peer,
                        collective: desc.to_string(),
                        seq,
                        message: err.to_string(),
                    });
                }
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return Err(DistError::Timeout {
                    rank,
                    collective: desc.to_string(),
                    seq,
                    timeout: self.timeout,
                    waiting_for: missing,
                    diagnosis: None,
                });
            }
        }
        let mut all = Vec::with_capacity(world);
        for q in 0..world {
            let queue = &mut state.posts[q];
            let Some(at) = queue.iter().position(|p| p.seq == seq) else {
                return Err(DistError::internal(
                    format!("rank {rank}: {desc}"),
                    "post vanished",
                ));
            };
            all.push(queue[at].data.clone());
            queue[at].unread -= 1;
            if queue[at].unread == 0 {
                queue.remove(at);
            }
        }
        Ok(all)
    }

    /// Records that `rank` failed with `err` (the first failure wins) and wakes the waiters,
    /// which then fail naming it.
    pub(crate) fn fail(&self, rank: usize, err: &DistError) {
        let mut state = self.state.lock();
        state.failed.get_or_insert_with(|| (rank, err.clone()));
        self.changed.notify_all();
    }

    /// Records that `rank`'s handle was dropped after `completed` collectives.
    pub(crate) fn leave(&self, rank: usize, completed: u64) {
        let mut state = self.state.lock();
        state.left[rank] = Some(completed);
        self.changed.notify_all();
    }
}
