//! Schedules: what each rank sends to and receives from each peer, in order, for one
//! collective — the algorithms of the TCP backend as plain data.
//!
//! A plan is computed independently and identically by every rank from the collective's
//! descriptor, the world size and the group configuration. The transport then executes it:
//! sends leave in order per peer, each possibly waiting until a given number of receives has
//! completed (that is how the ring forwards a chunk right after reducing it); receives arrive in
//! order per peer and land in the main buffer, or in scratch to be reduced into it. Keeping the
//! schedule separate from the sockets makes the algorithms testable without a network — the
//! tests here simulate a whole world of ranks exchanging bytes by the plans.
//!
//! * **direct** (small messages, barrier): every rank sends its data straight to every rank
//!   that needs it; reductions then fold all contributions in rank order.
//! * **ring** (large `all_reduce`, `reduce_scatter`, `all_gather`): reduce-scatter and/or
//!   all-gather around the ring `r → r+1`, each of the `world` segments cut into chunks so that
//!   sending chunk k+1 overlaps with receiving and reducing chunk k. Each segment is reduced
//!   exactly once, by the ring, then copied, so every rank ends with identical bits.
//! * **chain** (large `broadcast`): the root sends chunks to the next rank, which forwards each
//!   chunk as soon as it has it.

use std::collections::VecDeque;
use std::ops::Range;

use super::frame::{Algorithm, MAX_DATA_PAYLOAD};
use crate::process_group::{CollectiveDesc, CollectiveKind, GroupConfig, ReduceOp};

/// One frame to send to a peer: bytes `range` of the main buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SendItem {
    pub range: Range<usize>,
    /// The frame may leave only once this many receives (over all peers) have completed.
    pub needs_recvs: usize,
}

/// Where a received payload lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dest {
    /// At this byte offset of the main buffer.
    Main(usize),
    /// At this byte offset of the scratch buffer.
    Scratch(usize),
}

/// One frame expected from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecvItem {
    pub len: usize,
    pub dest: Dest,
    /// After arrival, combine the (scratch) payload into the main buffer at this offset.
    pub reduce_into: Option<usize>,
    /// After combining, divide that main range by the world size (the end of an average).
    pub divide: bool,
}

/// What to do once every frame has moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Nothing.
    Nothing,
    /// Copy main `own..own+len` into scratch slot `rank`, then fold scratch slots `0..world` (each
    /// `len` bytes) in rank order into main `own..own+len`.
    FoldSlots { own: usize, len: usize },
}

/// The complete schedule of one rank for one collective.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub algorithm: Algorithm,
    /// Index of the first frame to each peer (plans run in phases number their frames on).
    pub first_index: u64,
    /// Per peer rank, the frames to send to it in order (empty for this rank).
    pub sends: Vec<VecDeque<SendItem>>,
    /// Per peer rank, the frames to receive from it in order.
    pub recvs: Vec<VecDeque<RecvItem>>,
    /// Bytes of scratch the plan needs.
    pub scratch_len: usize,
    pub finish: Finish,
}

impl Plan {
    fn empty(algorithm: Algorithm, world: usize) -> Self {
        Plan {
            algorithm,
            first_index: 0,
            sends: vec![VecDeque::new(); world],
            recvs: vec![VecDeque::new(); world],
            scratch_len: 0,
            finish: Finish::Nothing,
        }
    }

    /// Total number of receives in the plan.
    #[cfg(test)]
    pub(crate) fn recv_count(&self) -> usize {
        self.recvs.iter().map(VecDeque::len).sum()
    }
}

/// The algorithm every rank uses for `desc`; `same_host` says whether all ranks can copy from
/// each other's memory (agreed by all ranks when the group was set up).
pub(crate) fn choose_algorithm(
    desc: &CollectiveDesc,
    world: usize,
    config: &GroupConfig,
    same_host: bool,
) -> Algorithm {
    // A direct frame carries a whole message, so it must stay under the frame size cap.
    let direct_limit = config.small_message_bytes.min(MAX_DATA_PAYLOAD as usize);
    if desc.kind == CollectiveKind::Barrier || world <= 1 || desc.total_bytes(world) <= direct_limit
    {
        return Algorithm::Direct;
    }
    if same_host {
        return Algorithm::SameHost;
    }
    match desc.kind {
        CollectiveKind::Broadcast => Algorithm::Chain,
        _ => Algorithm::Ring,
    }
}

/// Rank `rank`'s plan for `desc`. The main buffer is the tensor (`all_reduce`, `broadcast`), the
/// output (`all_gather`, with this rank's input already copied into block `rank`) or a copy of
/// the input (`reduce_scatter`, whose result is left in block `rank`).
pub(crate) fn plan(rank: usize, world: usize, desc: &CollectiveDesc, config: &GroupConfig) -> Plan {
    let algorithm = choose_algorithm(desc, world, config, false);
    let elem = desc.dtype.map_or(1, |d| d.size_in_bytes());
    let n = desc.numel as usize;
    let chunk_bytes = config.chunk_bytes.clamp(elem, MAX_DATA_PAYLOAD as usize);
    match (algorithm, desc.kind) {
        (Algorithm::Direct, kind) => {
            direct(rank, world, kind, desc.root.unwrap_or(0) as usize, n * elem)
        }
        (Algorithm::Chain, _) => chain(
            rank,
            world,
            desc.root.unwrap_or(0) as usize,
            n,
            elem,
            chunk_bytes,
        ),
        (Algorithm::Ring, CollectiveKind::AllReduce) => {
            let bounds: Vec<usize> = (0..=world).map(|k| k * n / world).collect();
            ring(
                rank,
                world,
                &bounds,
                elem,
                chunk_bytes,
                true,
                true,
                desc.op == Some(ReduceOp::Avg),
            )
        }
        (Algorithm::Ring, CollectiveKind::ReduceScatter) => {
            let bounds: Vec<usize> = (0..=world).map(|k| k * n).collect();
            ring(
                rank,
                world,
                &bounds,
                elem,
                chunk_bytes,
                true,
                false,
                desc.op == Some(ReduceOp::Avg),
            )
        }
        (Algorithm::Ring | Algorithm::SameHost, _) => {
            let bounds: Vec<usize> = (0..=world).map(|k| k * n).collect();
            ring(rank, world, &bounds, elem, chunk_bytes, false, true, false)
        }
    }
}

/// A synchronisation phase of the same-host algorithm, numbered `phase`: with `bytes > 0` an
/// all-gather of `bytes` per rank (main holds one slot per rank), with `bytes == 0` a barrier.
pub(crate) fn same_host_phase(rank: usize, world: usize, bytes: usize, phase: u64) -> Plan {
    let kind = if bytes > 0 {
        CollectiveKind::AllGather
    } else {
        CollectiveKind::Barrier
    };
    let mut p = direct(rank, world, kind, 0, bytes);
    p.algorithm = Algorithm::SameHost;
    p.first_index = phase;
    p
}

/// Direct exchange; `bytes` is the per-rank message (the whole tensor for `all_reduce` and
/// `broadcast`, one block for `all_gather` and `reduce_scatter`).
fn direct(rank: usize, world: usize, kind: CollectiveKind, root: usize, bytes: usize) -> Plan {
    let mut p = Plan::empty(Algorithm::Direct, world);
    let peers = (0..world).filter(|&q| q != rank);
    let send = |range: Range<usize>| SendItem {
        range,
        needs_recvs: 0,
    };
    let recv = |dest: Dest| RecvItem {
        len: bytes,
        dest,
        reduce_into: None,
        divide: false,
    };
    match kind {
        CollectiveKind::AllReduce => {
            for q in peers {
                p.sends[q].push_back(send(0..bytes));
                p.recvs[q].push_back(recv(Dest::Scratch(q * bytes)));
            }
            p.scratch_len = world * bytes;
            p.finish = Finish::FoldSlots { own: 0, len: bytes };
        }
        CollectiveKind::ReduceScatter => {
            for q in peers {
                p.sends[q].push_back(send(q * bytes..(q + 1) * bytes));
                p.recvs[q].push_back(recv(Dest::Scratch(q * bytes)));
            }
            p.scratch_len = world * bytes;
            p.finish = Finish::FoldSlots {
                own: rank * bytes,
                len: bytes,
            };
        }
        CollectiveKind::AllGather => {
            for q in peers {
                p.sends[q].push_back(send(rank * bytes..(rank + 1) * bytes));
                p.recvs[q].push_back(recv(Dest::Main(q * bytes)));
            }
        }
        CollectiveKind::Broadcast => {
            if rank == root {
                for q in peers {
                    p.sends[q].push_back(send(0..bytes));
                }
            } else {
                p.recvs[root].push_back(recv(Dest::Main(0)));
            }
        }
        CollectiveKind::Barrier => {
            for q in peers {
                p.sends[q].push_back(send(0..0));
                p.recvs[q].push_back(RecvItem {
                    len: 0,
                    dest: Dest::Scratch(0),
                    reduce_into: None,
                    divide: false,
                });
            }
        }
    }
    p
}

/// Element range `[start, end)` cut into `chunks` near-equal pieces; piece `j` in bytes.
fn piece(start: usize, end: usize, chunks: usize, j: usize, elem: usize) -> Range<usize> {
    let len = end - start;
    (start + len * j / chunks) * elem..(start + len * (j + 1) / chunks) * elem
}

/// Pipelined broadcast along the chain `root → root+1 → …`.
fn chain(
    rank: usize,
    world: usize,
    root: usize,
    n: usize,
    elem: usize,
    chunk_bytes: usize,
) -> Plan {
    let mut p = Plan::empty(Algorithm::Chain, world);
    let chunks = (n * elem).div_ceil(chunk_bytes).max(1);
    let position = (rank + world - root) % world;
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    for j in 0..chunks {
        let range = piece(0, n, chunks, j, elem);
        if position > 0 {
            p.recvs[prev].push_back(RecvItem {
                len: range.len(),
                dest: Dest::Main(range.start),
                reduce_into: None,
                divide: false,
            });
        }
        if position + 1 < world {
            let needs_recvs = if position == 0 { 0 } else { j + 1 };
            p.sends[next].push_back(SendItem { range, needs_recvs });
        }
    }
    p
}

/// Ring reduce-scatter (if `reduce`) followed by ring all-gather (if `gather`) over the
/// segments `bounds[k]..bounds[k+1]` (elements). After the reduce-scatter rank r owns the fully
/// reduced segment r.
#[allow(clippy::too_many_arguments)]
fn ring(
    rank: usize,
    world: usize,
    bounds: &[usize],
    elem: usize,
    chunk_bytes: usize,
    reduce: bool,
    gather: bool,
    average: bool,
) -> Plan {
    let mut p = Plan::empty(Algorithm::Ring, world);
    let right = (rank + 1) % world;
    let left = (rank + world - 1) % world;
    let seg_bytes = (0..world)
        .map(|k| (bounds[k + 1] - bounds[k]) * elem)
        .max()
        .unwrap_or(0);
    let chunks = seg_bytes.div_ceil(chunk_bytes).max(1);
    let seg = |k: usize| (bounds[k % world], bounds[k % world + 1]);
    // Flat index of a step's chunk among all receives; a send of step s > 0 forwards what
    // the receive of step s-1 delivered, so it waits for that receive.
    let mut step = 0;
    let needs = |step: usize, j: usize| {
        if step == 0 {
            0
        } else {
            (step - 1) * chunks + j + 1
        }
    };
    if reduce {
        let mut scratch = 0;
        for s in 0..world - 1 {
            let (ss, se) = seg(rank + 2 * world - s - 1);
            let (rs, re) = seg(rank + 2 * world - s - 2);
            for j in 0..chunks {
                p.sends[right].push_back(SendItem {
                    range: piece(ss, se, chunks, j, elem),
                    needs_recvs: needs(step, j),
                });
                let range = piece(rs, re, chunks, j, elem);
                scratch = scratch.max(range.len());
                p.recvs[left].push_back(RecvItem {
                    len: range.len(),
                    dest: Dest::Scratch(0),
                    reduce_into: Some(range.start),
                    divide: average && s == world - 2,
                });
            }
            step += 1;
        }
        p.scratch_len = scratch;
    }
    if gather {
        for t in 0..world - 1 {
            let (ss, se) = seg(rank + world - t);
            let (rs, re) = seg(rank + 2 * world - t - 1);
            for j in 0..chunks {
                p.sends[right].push_back(SendItem {
                    range: piece(ss, se, chunks, j, elem),
                    needs_recvs: needs(step, j),
                });
                let range = piece(rs, re, chunks, j, elem);
                p.recvs[left].push_back(RecvItem {
                    len: range.len(),
                    dest: Dest::Main(range.start),
                    reduce_into: None,
                    divide: false,
                });
            }
            step += 1;
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process_group::reduce::{combine, divide, reduce_all};
    use tandem_core::DType;

    /// Runs the plans of a whole world without sockets: delivers every send to the matching
    /// receive in an order that respects dependencies; returns each rank's main buffer.
    fn simulate(
        desc: &CollectiveDesc,
        config: &GroupConfig,
        mut mains: Vec<Vec<f64>>,
    ) -> Vec<Vec<f64>> {
        let world = mains.len();
        let plans: Vec<Plan> = (0..world).map(|r| plan(r, world, desc, config)).collect();
        let mut scratch: Vec<Vec<f64>> = plans
            .iter()
            .map(|p| vec![0.0; p.scratch_len.div_ceil(8)])
            .collect();
        let mut sent = vec![vec![0usize; world]; world]; // sent[from][to]
        let mut recvd = vec![vec![0usize; world]; world]; // recvd[at][from]
        let mut done = vec![0usize; world];
        let op = desc.op.unwrap_or(ReduceOp::Sum);
        loop {
            let mut moved = false;
            for from in 0..world {
                for to in 0..world {
                    let Some(item) = plans[from].sends[to].get(sent[from][to]) else {
                        continue;
                    };
                    if done[from] < item.needs_recvs {
                        continue;
                    }
                    let r = &plans[to].recvs[from][recvd[to][from]];
                    assert_eq!(r.len, item.range.len(), "frame lengths agree");
                    let payload =
                        bytemuck::cast_slice::<f64, u8>(&mains[from])[item.range.clone()].to_vec();
                    match r.dest {
                        Dest::Main(o) => bytemuck::cast_slice_mut::<f64, u8>(&mut mains[to])
                            [o..o + r.len]
                            .copy_from_slice(&payload),
                        Dest::Scratch(o) => {
                            let s = bytemuck::cast_slice_mut::<f64, u8>(&mut scratch[to]);
                            s[o..o + r.len].copy_from_slice(&payload);
                            if let Some(off) = r.reduce_into {
                                let mut src = vec![0f64; r.len / 8];
                                bytemuck::cast_slice_mut::<f64, u8>(&mut src)
                                    .copy_from_slice(&payload);
                                let main = bytemuck::cast_slice_mut::<f64, u8>(&mut mains[to]);
                                combine(
                                    DType::F64,
                                    op,
                                    &mut main[off..off + r.len],
                                    bytemuck::cast_slice(&src),
                                )
                                .unwrap();
                                if r.divide {
                                    divide(DType::F64, &mut main[off..off + r.len], world).unwrap();
                                }
                            }
                        }
                    }
                    sent[from][to] += 1;
                    recvd[to][from] += 1;
                    done[to] += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for r in 0..world {
            assert_eq!(
                done[r],
                plans[r].recv_count(),
                "rank {r} received everything"
            );
            if let Finish::FoldSlots { own, len } = plans[r].finish {
                let main = bytemuck::cast_slice_mut::<f64, u8>(&mut mains[r]);
                let s = bytemuck::cast_slice_mut::<f64, u8>(&mut scratch[r]);
                s[r * len..(r + 1) * len].copy_from_slice(&main[own..own + len]);
                if len > 0 {
                    let slots: Vec<&[u8]> =
                        (0..world).map(|q| &s[q * len..(q + 1) * len]).collect();
                    reduce_all(DType::F64, op, &slots, &mut main[own..own + len]).unwrap();
                }
            }
        }
        mains
    }

    fn config(small: usize, chunk: usize) -> GroupConfig {
        GroupConfig {
            small_message_bytes: small,
            chunk_bytes: chunk,
            ..GroupConfig::default()
        }
    }

    fn value(rank: usize, i: usize) -> f64 {
        // Small integers: sums are exact in any order.
        ((rank * 7 + i * 3) % 11) as f64
    }

    #[test]
    fn ring_and_direct_all_reduce_match_the_serial_sum() {
        for world in [1, 2, 3, 4, 5, 8] {
            for n in [0, 1, 3, 7, 64, 1001] {
                for cfg in [config(0, 8), config(0, 24), config(1 << 20, 8)] {
                    let desc = CollectiveDesc {
                        kind: CollectiveKind::AllReduce,
                        dtype: Some(DType::F64),
                        numel: n as u64,
                        op: Some(ReduceOp::Avg),
                        root: None,
                    };
                    let mains = (0..world)
                        .map(|r| (0..n).map(|i| value(r, i)).collect())
                        .collect();
                    let got = simulate(&desc, &cfg, mains);
                    let want: Vec<f64> = (0..n)
                        .map(|i| (0..world).map(|r| value(r, i)).sum::<f64>() / world as f64)
                        .collect();
                    for (r, g) in got.iter().enumerate() {
                        for (a, b) in g.iter().zip(&want) {
                            assert!(
                                (a - b).abs() < 1e-12,
                                "world {world} n {n} rank {r}: {g:?} vs {want:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ring_reduce_scatter_and_all_gather_place_blocks_by_rank() {
        for world in [2, 3, 4, 8] {
            for m in [0, 1, 5, 33] {
                let cfg = config(0, 16);
                let rs = CollectiveDesc {
                    kind: CollectiveKind::ReduceScatter,
                    dtype: Some(DType::F64),
                    numel: m as u64,
                    op: Some(ReduceOp::Sum),
                    root: None,
                };
                let mains = (0..world)
                    .map(|r| (0..world * m).map(|i| value(r, i)).collect())
                    .collect();
                let got = simulate(&rs, &cfg, mains);
                for (r, g) in got.iter().enumerate() {
                    for i in 0..m {
                        let k = r * m + i;
                        let want: f64 = (0..world).map(|q| value(q, k)).sum();
                        assert_eq!(g[k], want, "reduce_scatter world {world} m {m} rank {r}");
                    }
                }
                let ag = CollectiveDesc {
                    kind: CollectiveKind::AllGather,
                    op: None,
                    ..rs
                };
                let mains = (0..world)
                    .map(|r| {
                        (0..world * m)
                            .map(|i| if i / m.max(1) == r { value(r, i) } else { -1.0 })
                            .collect()
                    })
                    .collect();
                for g in simulate(&ag, &cfg, mains) {
                    let want: Vec<f64> = (0..world * m).map(|i| value(i / m.max(1), i)).collect();
                    assert_eq!(g, want, "all_gather world {world} m {m}");
                }
            }
        }
    }

    #[test]
    fn chain_and_direct_broadcast_copy_the_root() {
        for world in [2, 3, 5] {
            for root in 0..world {
                for cfg in [config(0, 16), config(1 << 20, 16)] {
                    let desc = CollectiveDesc {
                        kind: CollectiveKind::Broadcast,
                        dtype: Some(DType::F64),
                        numel: 37,
                        op: None,
                        root: Some(root as u32),
                    };
                    let mains = (0..world)
                        .map(|r| (0..37).map(|i| value(r, i)).collect())
                        .collect();
                    for g in simulate(&desc, &cfg, mains) {
                        assert_eq!(g, (0..37).map(|i| value(root, i)).collect::<Vec<_>>());
                    }
                }
            }
        }
    }

    #[test]
    fn small_messages_and_barriers_go_direct_large_ones_around_the_ring() {
        let cfg = GroupConfig::default();
        let mut desc = CollectiveDesc {
            kind: CollectiveKind::AllReduce,
            dtype: Some(DType::F32),
            numel: 1024,
            op: Some(ReduceOp::Sum),
            root: None,
        };
        assert_eq!(choose_algorithm(&desc, 4, &cfg, false), Algorithm::Direct);
        desc.numel = 1 << 20;
        assert_eq!(choose_algorithm(&desc, 4, &cfg, false), Algorithm::Ring);
        desc.kind = CollectiveKind::Broadcast;
        assert_eq!(choose_algorithm(&desc, 4, &cfg, false), Algorithm::Chain);
        assert_eq!(
            choose_algorithm(&crate::process_group::describe_barrier(), 4, &cfg, true),
            Algorithm::Direct
        );
    }
}
