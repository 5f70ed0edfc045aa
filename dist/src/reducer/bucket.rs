//! Buckets: flat gradient buffers that group parameters for one all-reduce each.
//!
//! Parameters are assigned in a given order (reverse registration order at first, the observed
//! gradient-ready order after the first iteration), closing a bucket when the next parameter
//! would push it past its byte cap or has another dtype. The first bucket has a small cap so
//! that communication starts as soon as the last layers' gradients are ready. Each parameter's
//! `.grad` is a view into its bucket (from its first gradient on), so gradients are neither
//! copied in nor out.

use tandem_core::{DType, Tensor};

use crate::coalesce::flat_views;
use crate::{DistError, Result};

/// One bucket: a flat buffer and the parameters whose gradients live in it.
pub(crate) struct Bucket {
    /// The flat gradient buffer all-reduced as one message.
    pub buffer: Tensor,
    /// Indices (into the reducer's parameter list) of the parameters in this bucket.
    pub params: Vec<usize>,
    /// Parameters of this bucket still to become ready in the current backward.
    pub pending: usize,
    /// Reductions issued for this bucket in the current backward: exactly one per synchronised
    /// backward, none in a `no_sync` one (checked when the backward finishes).
    pub reductions: u32,
}

/// Where a parameter's gradient lives: its bucket and its view into the bucket's buffer.
#[derive(Clone)]
pub(crate) struct Slot {
    /// Index of the bucket.
    pub bucket: usize,
    /// The parameter-shaped view into the bucket (what `.grad` is set to).
    pub view: Tensor,
}

/// A complete bucket layout: the buckets and, per parameter, its slot.
pub(crate) struct BucketSet {
    pub buckets: Vec<Bucket>,
    pub slots: Vec<Slot>,
}

/// Splits `order` into groups of parameters whose gradients fit the caps.
pub(crate) fn assign(
    order: &[usize],
    bytes: &[usize],
    dtypes: &[DType],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut size = 0usize;
    for &p in order {
        let cap = if groups.is_empty() {
            first_cap_bytes
        } else {
            cap_bytes
        };
        let dtype_changes = current.first().is_some_and(|&q| dtypes[q] != dtypes[p]);
        if !current.is_empty() && (size + bytes[p] > cap || dtype_changes) {
            groups.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(p);
        size += bytes[p];
    }
    if !current.is_empty() {
        groups.push(current);
    }
    groups
}

/// Builds the buckets for `groups` (which together hold every parameter once) and points the
/// `.grad` of each parameter that has one at its slot, copying the gradient into its new view.
/// A parameter without a gradient keeps `None`.
pub(crate) fn build(
    rank: usize,
    params: &[(String, Tensor)],
    groups: &[Vec<usize>],
) -> Result<BucketSet> {
    let mut views: Vec<Option<Slot>> = vec![None; params.len()];
    let mut buckets = Vec::with_capacity(groups.len());
    for (b, group) in groups.iter().enumerate() {
        let members: Vec<&Tensor> = group.iter().map(|&p| &params[p].1).collect();
        let (buffer, places) = flat_views(&members, members[0].dtype())
            .map_err(|e| DistError::tensor(rank, format!("allocating gradient bucket {b}"), e))?;
        for (&p, view) in group.iter().zip(places) {
            let (path, tensor) = &params[p];
            // A parameter without a gradient keeps none (optimizers skip it, as they skip it
            // in one process); its first gradient moves into the view when it becomes ready.
            if let Some(g) = tensor.grad() {
                let context = || format!("moving the gradient of `{path}` into its bucket");
                view.copy_(&g)
                    .map_err(|e| DistError::tensor(rank, context(), e))?;
                tensor
                    .set_grad(Some(view.clone()))
                    .map_err(|e| DistError::tensor(rank, context(), e))?;
            }
            views[p] = Some(Slot { bucket: b, view });
        }
        buckets.push(Bucket {
            buffer,
            params: group.clone(),
            pending: group.len(),
            reductions: 0,
        });
    }
    let slots = views
        .into_iter()
        .enumerate()
        .map(|(p, slot)| {
            slot.ok_or_else(|| {
                DistError::internal(
                    format!("rank {rank}: DistributedDataParallel"),
                    format!("parameter `{}` is in no bucket", params[p].0),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(BucketSet { buckets, slots })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bucket_is_small_and_caps_are_respected() {
        // 6 params of 400 KiB in reverse order 5..0; first cap 1 MiB, then 1.2 MiB.
        let bytes = vec![400 << 10; 6];
        let dtypes = vec![DType::F32; 6];
        let groups = assign(&[5, 4, 3, 2, 1, 0], &bytes, &dtypes, 1 << 20, 1200 << 10);
        assert_eq!(groups, vec![vec![5, 4], vec![3, 2, 1], vec![0]]);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own_and_dtypes_never_mix() {
        let bytes = vec![10, 5000, 10, 10];
        let dtypes = vec![DType::F32, DType::F32, DType::F64, DType::F64];
        let groups = assign(&[0, 1, 2, 3], &bytes, &dtypes, 100, 100);
        assert_eq!(groups, vec![vec![0], vec![1], vec![2, 3]]);
    }
}
