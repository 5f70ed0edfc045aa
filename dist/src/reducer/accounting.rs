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
