//! Coalesced broadcasts: many small tensors sent as one flat buffer per dtype.
//!
//! DDP broadcasts a model's buffers (BatchNorm running statistics: three small tensors per
//! layer) before every forward. One collective per tensor pays the link's latency dozens of
//! times per step — on a cluster network that is milliseconds — so the tensors are packed
//! into one contiguous buffer per dtype, broadcast once, and unpacked on the receiving ranks.
//! The flat buffers live on the tensors' device; packing and unpacking are copies on its
//! compute stream, which the collective is ordered after (and the unpacking after the
//! collective's [`Work::wait`](crate::Work::wait)).

use tandem_core::layout::contiguous_strides;
use tandem_core::{DType, Device, Layout, Shape, Tensor};

use crate::error::{DistError, Result};
use crate::process_group::ProcessGroup;

/// Tensors of one dtype and their places in a flat buffer.
struct Pack {
    flat: Tensor,
    /// (the tensor, the view of its place in `flat`)
    members: Vec<(Tensor, Tensor)>,
}

/// A fixed set of tensors broadcast together, one collective per dtype.
pub(crate) struct CoalescedBroadcast {
    packs: Vec<Pack>,
}

impl CoalescedBroadcast {
    /// Lays out `tensors` in one flat buffer per dtype (in order of first appearance).
    pub(crate) fn new(rank: usize, tensors: &[Tensor]) -> Result<Self> {
        let mut dtypes: Vec<DType> = Vec::new();
        for t in tensors {
            if !dtypes.contains(&t.dtype()) {
                dtypes.push(t.dtype());
            }
        }
        let mut packs = Vec::with_capacity(dtypes.len());
        for dtype in dtypes {
            let of_dtype: Vec<&Tensor> = tensors.iter().filter(|t| t.dtype() == dtype).collect();
            let (flat, places) = flat_views(&of_dtype, dtype).map_err(|e| tensor_error(rank, e))?;
            let members = of_dtype.into_iter().cloned().zip(places).collect();
            packs.push(Pack { flat, members });
        }
        Ok(CoalescedBroadcast { packs })
    }

    /// Copies `root`'s tensors into every rank's tensors: one broadcast per dtype.
    pub(crate) fn broadcast(&self, group: &dyn ProcessGroup, root: usize) -> Result<()> {
        let rank = group.rank();
        if rank == root {
            for pack in &self.packs {
                for (tensor, place) in &pack.members {
                    place.copy_(tensor).map_err(|e| tensor_error(rank, e))?;
                }
            }
        }
        let mut works = Vec::with_capacity(self.packs.len());
        for pack in &self.packs {
            works.push(group.broadcast(&pack.flat, root)?);
        }
        for work in works {
            work.wait()?;
        }
        if rank != root {
            for pack in &self.packs {
                for (tensor, place) in &pack.members {
                    tensor.copy_(place).map_err(|e| tensor_error(rank, e))?;
                }
            }
        }
        Ok(())
    }
}

/// A zeroed flat buffer of `dtype` holding `tensors` one after the other, on their device, and
/// a contiguous view of each tensor's place in it (DDP's buckets and coalesced broadcasts).
pub(crate) fn flat_views(
    tensors: &[&Tensor],
    dtype: DType,
) -> tandem_core::Result<(Tensor, Vec<Tensor>)> {
    let device = tensors.first().map_or(Device::Cpu, |t| t.device());
    for t in tensors {
        t.device().same_as(device, "flat_views")?;
    }
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    let flat = Tensor::zeros(&[total], dtype, device)?;
    let mut offset = 0;
    let mut views = Vec::with_capacity(tensors.len());
    for t in tensors {
        let shape = Shape::from_slice(t.dims());
        let layout = Layout::from_parts(shape.clone(), contiguous_strides(&shape), offset);
        views.push(flat.view_detached(layout)?);
        offset += t.numel();
    }
    Ok((flat, views))
}

fn tensor_error(rank: usize, e: tandem_core::Error) -> DistError {
    DistError::tensor(rank, "broadcast (coalesced)", e)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::process_group::threads::ThreadProcessGroup;

    #[test]
    fn every_rank_ends_with_the_roots_tensors_of_every_dtype() {
        let world = 3;
        let groups = ThreadProcessGroup::new_group(world).unwrap();
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::spawn(move || {
                    let g: Arc<dyn ProcessGroup> = Arc::new(g);
                    let r = g.rank() as f32;
                    let a =
                        Tensor::from_vec(vec![r; 6], &[2, 3], tandem_core::Device::Cpu).unwrap();
                    let b = Tensor::from_vec(vec![r as i64 * 7], &[], tandem_core::Device::Cpu)
                        .unwrap();
                    let c =
                        Tensor::from_vec(vec![r + 0.5; 4], &[4], tandem_core::Device::Cpu).unwrap();
                    let packed =
                        CoalescedBroadcast::new(g.rank(), &[a.clone(), b.clone(), c.clone()])
                            .unwrap();
                    packed.broadcast(g.as_ref(), 1).unwrap();
                    (
                        a.to_vec::<f32>().unwrap(),
                        b.to_vec::<i64>().unwrap(),
                        c.to_vec::<f32>().unwrap(),
                    )
                })
            })
            .collect();
        for h in handles {
            let (a, b, c) = h.join().unwrap();
            assert_eq!(a, vec![1.0; 6]);
            assert_eq!(b, vec![7]);
            assert_eq!(c, vec![1.5; 4]);
        }
    }
}
