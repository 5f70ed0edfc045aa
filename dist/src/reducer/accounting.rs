//! The reducer's self-check: every synchronised backward reduces every bucket exactly once, and
//! a `no_sync` backward reduces none. A bucket skipped (its gradients stay this rank's own, and
//! the ranks' models drift apart silently) or reduced twice (its gradients are scaled wrongly)
//! is an error naming the bucket and its parameters. The check is a counter per bucket, bumped
//! at each launch and compared when the backward finishes: cheap enough to stay on.

use super::bucket::Bucket;
use crate::DistError;

/// A fault the tests inject into bucket launches, to see the check catch it.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BucketFault {
    /// Bucket `n` is never launched.
    Skip(usize),
    /// Bucket `n` is launched twice.
    Twice(usize),
}

/// How many times bucket `b` is launched when it is complete: once, unless a test injected a
/// fault.
pub(super) fn launches(_fault: Option<&BucketFault>, _b: usize) -> usize {
    #[cfg(test)]
    match _fault {
        Some(BucketFault::Skip(s)) if *s == _b => return 0,
        Some(BucketFault::Twice(t)) if *t == _b => return 2,
        _ => {}
    }
    1
}

/// The test-only fault type outside tests: none can be set.
#[cfg(not(test))]
pub(super) type BucketFault = std::convert::Infallible;

/// The first bucket reduced other than as expected in the backward that just finished:
/// exactly once in a synchronised backward (`sync_backward` is its 0-based number), never in a
/// `no_sync` one (`None`). Buckets launch in order, so one whose parameters did not all become
/// ready holds back the later ones: those not launched are the unused-parameter check's
/// concern, and only a second reduction of them is reported here. `paths` names each
/// parameter.
pub(super) fn check(
    rank: usize,
    buckets: &[Bucket],
    sync_backward: Option<u64>,
    paths: impl Fn(usize) -> String,
) -> Option<DistError> {
    let held_back = buckets
        .iter()
        .position(|b| b.pending > 0)
        .unwrap_or(buckets.len());
    let (bucket, b) = buckets
        .iter()
        .enumerate()
        .find(|&(i, b)| match sync_backward {
            Some(_) => b.reductions > 1 || (b.reductions == 0 && i < held_back),
            None => b.reductions != 0,
        })?;
    Some(DistError::BucketReducedWrongly {
        rank,
        bucket,
        reductions: b.reductions,
        expected: u32::from(sync_backward.is_some()),
        backward: match sync_backward {
            Some(n) => format!("synchronised backward #{n}"),
            None => "a no_sync backward".to_string(),
        },
        params: b.params.iter().map(|&p| paths(p)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Device, Tensor};

    fn bucket(params: Vec<usize>, pending: usize, reductions: u32) -> Bucket {
        Bucket {
            buffer: Tensor::zeros(&[1], DType::F32, Device::Cpu).unwrap(),
            params,
            pending,
            reductions,
        }
    }

    fn path(p: usize) -> String {
        format!("layer{p}.weight")
    }

    #[test]
    fn a_no_sync_backward_must_reduce_no_bucket() {
        let quiet = [bucket(vec![0], 0, 0), bucket(vec![1, 2], 0, 0)];
        assert!(check(0, &quiet, None, path).is_none());
        let reduced = [bucket(vec![0], 0, 0), bucket(vec![1, 2], 0, 1)];
        let err = check(3, &reduced, None, path).unwrap().to_string();
        assert!(
            err.contains("rank 3")
                && err.contains("bucket 1 was reduced 1 time(s) in a no_sync backward")
                && err.contains("(expected 0)")
                && err.contains("layer1.weight, layer2.weight"),
            "{err}"
        );
    }

    #[test]
    fn buckets_held_back_by_an_unused_parameter_are_left_to_that_check() {
        // Bucket 1 waits for a parameter that got no gradient, so bucket 2 never launched:
        // the unused-parameter error reports it, not this one.
        let held = [
            bucket(vec![0], 0, 1),
            bucket(vec![1], 1, 0),
            bucket(vec![2], 0, 0),
        ];
        assert!(check(0, &held, Some(4), path).is_none());
        let twice = [bucket(vec![0], 0, 2), bucket(vec![1], 1, 0)];
        let err = check(0, &twice, Some(4), path).unwrap().to_string();
        assert!(
            err.contains("bucket 0 was reduced 2 time(s) in synchronised backward #4"),
            "{err}"
        );
    }
}
