//! Collectives on host snapshots, shared by the in-process backends: each rank takes a snapshot
//! of its contribution, and once every rank's snapshot is at hand computes its own result from
//! all of them, in rank order (so every rank gets bit-identical results).

use tandem_core::Tensor;

use super::reduce::{self, with_tensor_bytes, with_tensor_bytes_mut, AlignedBuf};
use super::{tensor_error, CollectiveDesc};
use crate::{DistError, Result};

/// Where one rank's result of a collective goes.
#[derive(Clone)]
pub(crate) enum Target {
    /// `all_reduce`: the reduction, in place.
    AllReduce(Tensor),
    /// `broadcast`: the root's snapshot, unless this rank is the root.
    Broadcast { tensor: Tensor, root: usize },
    /// `all_gather`: every rank's snapshot, rank-major.
    AllGather(Tensor),
    /// `reduce_scatter`: block `rank` of the reduction.
    ReduceScatter(Tensor),
    /// `barrier`: nothing.
    Barrier,
}

/// A copy of a contiguous CPU tensor's bytes.
pub(crate) fn snapshot(t: &Tensor) -> tandem_core::Result<AlignedBuf> {
    with_tensor_bytes(t, |b| {
        let mut buf = AlignedBuf::default();
        buf.resize(b.len());
        buf.bytes_mut().copy_from_slice(b);
        buf
    })
}

/// `out = sources[0] ⊕ sources[1] ⊕ …` with the collective's dtype and op.
fn fold(rank: usize, desc: &CollectiveDesc, sources: &[&[u8]], out: &mut [u8]) -> Result<()> {
    let (Some(dtype), Some(op)) = (desc.dtype, desc.op) else {
        return Ok(());
    };
    if out.is_empty() {
        return Ok(());
    }
    reduce::reduce_all(dtype, op, sources, out)
        .map_err(|problem| DistError::internal(format!("rank {rank}: {desc}"), problem))
}

/// Writes `rank`'s result of `desc` into `target` from every rank's snapshot (`all`, in rank
/// order; empty for ranks that contribute nothing).
pub(crate) fn apply(
    rank: usize,
    desc: &CollectiveDesc,
    target: &Target,
    all: &[&[u8]],
) -> Result<()> {
    let terr = |e| tensor_error(rank, desc, e);
    let short = |q: usize, want: usize, got: usize| {
        DistError::internal(
            format!("rank {rank}: {desc}"),
            format!("rank {q}'s snapshot has {got} bytes, {want} expected"),
        )
    };
    match target {
        Target::AllReduce(t) => {
            with_tensor_bytes_mut(t, |out| fold(rank, desc, all, out)).map_err(terr)?
        }
        Target::Broadcast { tensor, root } => {
            if rank == *root {
                return Ok(());
            }
            with_tensor_bytes_mut(tensor, |out| match all.get(*root) {
                Some(src) if src.len() == out.len() => {
                    out.copy_from_slice(src);
                    Ok(())
                }
                other => Err(short(*root, out.len(), other.map_or(0, |s| s.len()))),
            })
            .map_err(terr)?
        }
        Target::AllGather(output) => with_tensor_bytes_mut(output, |out| {
            let block = out.len() / all.len().max(1);
            for (q, data) in all.iter().enumerate() {
                if data.len() != block {
                    return Err(short(q, block, data.len()));
                }
                out[q * block..(q + 1) * block].copy_from_slice(data);
            }
            Ok(())
        })
        .map_err(terr)?,
        Target::ReduceScatter(output) => with_tensor_bytes_mut(output, |out| {
            let block = out.len();
            let mut sources = Vec::with_capacity(all.len());
            for (q, b) in all.iter().enumerate() {
                let part = b
                    .get(rank * block..(rank + 1) * block)
                    .ok_or_else(|| short(q, all.len() * block, b.len()))?;
                sources.push(part);
            }
            fold(rank, desc, &sources, out)
        })
        .map_err(terr)?,
        Target::Barrier => Ok(()),
    }
}
