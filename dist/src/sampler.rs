//! `DistributedSampler`: splits each epoch's samples into disjoint, equal shards, one per rank.
//!
//! Every rank computes the same permutation of the dataset from a shared seed and the epoch
//! number (no communication), then takes every `world_size`-th index starting at its rank. The
//! epoch is padded by repeating its first indices (or, with `drop_last`, cut) to a multiple of
//! the world size, so every rank runs the same number of steps — a rank that ran one step more
//! would wait for ever in its extra all-reduce.
//!
//! With a global batch B, give each rank's loader a batch of B / world_size.
//!
//! That padding is right for training and wrong for evaluation: the repeated samples are
//! counted twice, so a metric would depend on the number of ranks. [`DistributedEvalSampler`]
//! is the evaluation split: every sample goes to exactly one rank, nothing is repeated or cut,
//! and the ranks' counts may differ by one (a rank may have none at all).
//!
//! [`DistributedUnpaddedSampler`] is the training split without padding: the same shuffled
//! permutation as `DistributedSampler`, strided over the ranks, but nothing repeated, so the
//! ranks' counts (and then their batch counts) may differ. Train with it inside
//! [`DistributedDataParallel::join`](crate::DistributedDataParallel::join), which lets the ranks
//! with fewer batches finish without hanging the others.

use tandem_core::Generator;
use tandem_nn::data::Sampler;

use crate::{DistError, Result};

/// Gives rank `rank` of `world_size` its shard of each epoch.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    dataset_len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
}

impl DistributedSampler {
    /// A sampler over `dataset_len` samples for `rank` of `world_size`, reshuffled every epoch
    /// from `seed` when `shuffle` is set.
    pub fn new(
        dataset_len: usize,
        world_size: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
    ) -> Result<Self> {
        check_rank("DistributedSampler", world_size, rank)?;
        Ok(DistributedSampler {
            dataset_len,
            world_size,
            rank,
            shuffle,
            seed,
            drop_last: false,
        })
    }

    /// Cut the epoch to a multiple of the world size instead of padding it.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    fn total(&self) -> usize {
        if self.drop_last {
            self.dataset_len / self.world_size * self.world_size
        } else {
            self.dataset_len.div_ceil(self.world_size) * self.world_size
        }
    }
}

/// Checks that `rank` is one of `world_size` ranks, or names the sampler in the error.
fn check_rank(sampler: &'static str, world_size: usize, rank: usize) -> Result<()> {
    if world_size == 0 || rank >= world_size {
        return Err(DistError::InvalidArgument {
            rank,
            collective: sampler,
            problem: format!("rank {rank} is not in 0..{world_size}"),
        });
    }
    Ok(())
}

/// The epoch's visiting order of all `dataset_len` samples, the same on every rank: shuffled
/// from `seed + epoch`, or in order.
fn epoch_order(dataset_len: usize, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
    let mut all: Vec<usize> = (0..dataset_len).collect();
    if shuffle {
        Generator::new(seed.wrapping_add(epoch)).shuffle(&mut all);
    }
    all
}

impl Sampler for DistributedSampler {
    fn len(&self) -> usize {
        self.total() / self.world_size
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        let all = epoch_order(self.dataset_len, self.shuffle, self.seed, epoch);
        let total = self.total();
        if all.is_empty() {
            return Vec::new();
        }
        let padded: Vec<usize> = all.iter().cycle().take(total).copied().collect();
        padded
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }
}

/// Gives rank `rank` of `world_size` its exact share of each training epoch: no padding, nothing
/// dropped.
///
/// The contract: every rank computes the same order of the `n` samples for an epoch (shuffled
/// from `seed + epoch` as [`DistributedSampler`] does, with the same seed on every rank; in
/// order without `shuffle`) and takes the positions `rank`, `rank + w`, `rank + 2w`, … of it.
/// So each sample of the epoch is on exactly one rank, once; rank `r` has `n / w` samples plus
/// one if `r < n % w` ([`DistributedUnpaddedSampler::shard_len`]), the counts differing by at
/// most one; a rank has none when `w > n`. When `w` divides `n` the shards are exactly
/// `DistributedSampler`'s.
///
/// With per-rank batches of `b`, rank `r` then runs `ceil(count_r / b)` steps, which may differ
/// between ranks: train inside
/// [`DistributedDataParallel::join`](crate::DistributedDataParallel::join), or the ranks with
/// more steps wait for the others in their extra all-reduce until the group's timeout.
#[derive(Clone, Debug)]
pub struct DistributedUnpaddedSampler {
    dataset_len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
}

impl DistributedUnpaddedSampler {
    /// The unpadded shard of `dataset_len` samples for `rank` of `world_size`, reshuffled every
    /// epoch from `seed` when `shuffle` is set.
    ///
    /// Errors if `rank` is not in `0..world_size`.
    pub fn new(
        dataset_len: usize,
        world_size: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
    ) -> Result<Self> {
        check_rank("DistributedUnpaddedSampler", world_size, rank)?;
        Ok(DistributedUnpaddedSampler {
            dataset_len,
            world_size,
            rank,
            shuffle,
            seed,
        })
    }

    /// How many samples rank `rank` of `world_size` gets of `dataset_len`: `dataset_len /
    /// world_size`, plus one for the first `dataset_len % world_size` ranks (0 for a rank out
    /// of range). Every rank can compute every other's, without communication.
    pub fn shard_len(dataset_len: usize, world_size: usize, rank: usize) -> usize {
        if rank >= world_size {
            return 0;
        }
        dataset_len / world_size + usize::from(rank < dataset_len % world_size)
    }
}

impl Sampler for DistributedUnpaddedSampler {
    fn len(&self) -> usize {
        Self::shard_len(self.dataset_len, self.world_size, self.rank)
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        epoch_order(self.dataset_len, self.shuffle, self.seed, epoch)
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }
}

/// Gives rank `rank` of `world_size` its part of an evaluation set: every sample belongs to
/// exactly one rank, with no padding and nothing dropped.
///
/// The split is contiguous: with `n` samples and `w` ranks, rank `r` gets `n / w` samples,
/// plus one if `r < n % w` (the first ranks take the remainder), starting right after rank
/// `r - 1`'s last; so the ranks' counts differ by at most one and a rank has none when `w > n`.
/// The order within a rank is sequential and the same every epoch (evaluation does not shuffle).
///
/// Evaluating each rank's part and summing the counts over the ranks
/// ([`crate::metrics::all_reduce_accuracy`], [`crate::metrics::evaluate_across_ranks`]) gives
/// exactly the metric of one process evaluating the whole set, for any number of ranks. The
/// ranks' uneven batch counts need no join: evaluation (eval mode, `no_grad`) runs none of
/// DDP's gradient collectives, and `SyncBatchNorm` in eval mode normalises with its running
/// statistics and issues no collective (unless built without `track_running_stats`, which
/// uses batch statistics in eval mode too and so synchronises every batch: do not evaluate
/// such a model on uneven shards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedEvalSampler {
    start: usize,
    end: usize,
}

impl DistributedEvalSampler {
    /// The part of `dataset_len` samples that rank `rank` of `world_size` evaluates.
    ///
    /// Errors if `rank` is not in `0..world_size`.
    pub fn new(dataset_len: usize, world_size: usize, rank: usize) -> Result<Self> {
        check_rank("DistributedEvalSampler", world_size, rank)?;
        let (base, extra) = (dataset_len / world_size, dataset_len % world_size);
        let start = rank * base + rank.min(extra);
        let end = start + base + usize::from(rank < extra);
        Ok(DistributedEvalSampler { start, end })
    }

    /// The dataset indices of this rank's part, `start..end`.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }
}

impl DistributedSampler {
    /// The evaluation split of `dataset_len` samples for `rank` of `world_size`: see
    /// [`DistributedEvalSampler`] (no padding, every sample on exactly one rank).
    pub fn for_evaluation(
        dataset_len: usize,
        world_size: usize,
        rank: usize,
    ) -> Result<DistributedEvalSampler> {
        DistributedEvalSampler::new(dataset_len, world_size, rank)
    }
}

impl Sampler for DistributedEvalSampler {
    fn len(&self) -> usize {
        self.end - self.start
    }

    fn indices(&self, _epoch: u64) -> Vec<usize> {
        self.range().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluation_shards_cover_every_sample_once_without_padding() {
        for len in (0..=20).chain([99, 100, 101, 1000]) {
            for world in 1..=9 {
                let shards: Vec<Vec<usize>> = (0..world)
                    .map(|r| {
                        let s = DistributedSampler::for_evaluation(len, world, r).unwrap();
                        let indices = s.indices(0);
                        assert_eq!(indices.len(), s.len(), "len {len} world {world} rank {r}");
                        assert_eq!(indices, s.indices(7), "the same every epoch");
                        indices
                    })
                    .collect();
                let all = shards.concat();
                assert_eq!(
                    all,
                    (0..len).collect::<Vec<_>>(),
                    "len {len} world {world}: contiguous, in order, disjoint and covering"
                );
                for (r, shard) in shards.iter().enumerate() {
                    let want = len / world + usize::from(r < len % world);
                    assert_eq!(shard.len(), want, "len {len} world {world} rank {r}");
                }
            }
        }
        let empty = DistributedEvalSampler::new(3, 5, 4).unwrap();
        assert!(empty.is_empty() && empty.indices(0).is_empty());
        assert!(DistributedEvalSampler::new(10, 4, 4).is_err());
        assert!(DistributedEvalSampler::new(10, 0, 0).is_err());
    }

    #[test]
    fn shards_are_disjoint_equal_and_cover_the_epoch() {
        for world in [1, 2, 3, 4, 8] {
            let shards: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    DistributedSampler::new(100, world, r, true, 7)
                        .unwrap()
                        .indices(3)
                })
                .collect();
            let len = shards[0].len();
            assert!(shards.iter().all(|s| s.len() == len), "world {world}");
            let mut all: Vec<usize> = shards.concat();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), 100, "world {world}: every sample is visited");
            if 100 % world == 0 {
                assert_eq!(len * world, 100, "no padding needed");
            }
        }
    }

    /// Every rank's shard of epoch `epoch` of `len` samples over `world` ranks.
    fn unpadded_shards(len: usize, world: usize, seed: u64, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|r| {
                let s = DistributedUnpaddedSampler::new(len, world, r, true, seed).unwrap();
                let indices = s.indices(epoch);
                assert_eq!(indices.len(), s.len(), "len {len} world {world} rank {r}");
                indices
            })
            .collect()
    }

    #[test]
    fn unpadded_shards_cover_every_sample_exactly_once_with_counts_differing_by_at_most_one() {
        for len in (0..=20).chain([99, 100, 101, 1000]) {
            for world in 1..=9 {
                let shards = unpadded_shards(len, world, 3, 2);
                let mut all = shards.concat();
                all.sort_unstable();
                assert_eq!(
                    all,
                    (0..len).collect::<Vec<_>>(),
                    "len {len} world {world}: disjoint, covering, nothing repeated"
                );
                for (r, shard) in shards.iter().enumerate() {
                    let want = len / world + usize::from(r < len % world);
                    assert_eq!(shard.len(), want, "len {len} world {world} rank {r}");
                    assert_eq!(
                        DistributedUnpaddedSampler::shard_len(len, world, r),
                        want,
                        "len {len} world {world} rank {r}"
                    );
                }
                let (most, least) = (
                    shards.iter().map(Vec::len).max().unwrap_or(0),
                    shards.iter().map(Vec::len).min().unwrap_or(0),
                );
                assert!(most - least <= 1, "len {len} world {world}");
            }
        }
        assert_eq!(DistributedUnpaddedSampler::shard_len(10, 4, 4), 0);
        assert!(DistributedUnpaddedSampler::new(10, 4, 4, true, 1).is_err());
        assert!(DistributedUnpaddedSampler::new(10, 0, 0, true, 1).is_err());
    }

    #[test]
    fn unpadded_shards_share_one_order_per_seed_and_epoch_and_match_the_padded_when_even() {
        // The same seed and epoch give every rank the same permutation: rank r's k-th sample
        // is the permutation's position r + k·w, on every rank and in every construction.
        let (len, world) = (101, 4);
        let order: Vec<usize> = {
            let shards = unpadded_shards(len, world, 9, 5);
            (0..len).map(|p| shards[p % world][p / world]).collect()
        };
        assert_eq!(order, epoch_order(len, true, 9, 5));
        assert_eq!(
            unpadded_shards(len, world, 9, 5),
            unpadded_shards(len, world, 9, 5)
        );
        assert_ne!(
            unpadded_shards(len, world, 9, 5),
            unpadded_shards(len, world, 9, 6)
        );
        assert_ne!(
            unpadded_shards(len, world, 9, 5),
            unpadded_shards(len, world, 8, 5)
        );
        // Without shuffling: the positions in order.
        let s = DistributedUnpaddedSampler::new(10, 3, 1, false, 0).unwrap();
        assert_eq!(s.indices(4), vec![1, 4, 7]);
        // When the world size divides the set, nothing would be padded: the same shards.
        for r in 0..4 {
            let padded = DistributedSampler::new(100, 4, r, true, 7).unwrap();
            let unpadded = DistributedUnpaddedSampler::new(100, 4, r, true, 7).unwrap();
            assert_eq!(padded.indices(3), unpadded.indices(3), "rank {r}");
        }
    }

    #[test]
    fn each_epoch_reshuffles_and_drop_last_cuts() {
        let s = DistributedSampler::new(10, 4, 1, true, 1).unwrap();
        assert_ne!(s.indices(0), s.indices(1));
        assert_eq!(s.indices(5), s.indices(5));
        assert_eq!(s.len(), 3);
        let cut = s.clone().drop_last(true);
        assert_eq!(cut.len(), 2);
        assert_eq!(cut.indices(0).len(), 2);
        assert!(DistributedSampler::new(10, 4, 4, true, 1).is_err());
    }
}
