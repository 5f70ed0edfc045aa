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
        if world_size == 0 || rank >= world_size {
            return Err(DistError::InvalidArgument {
                rank,
                collective: "DistributedSampler",
                problem: format!("rank {rank} is not in 0..{world_size}"),
            });
        }
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

impl Sampler for DistributedSampler {
    fn len(&self) -> usize {
        self.total() / self.world_size
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            Generator::new(self.seed.wrapping_add(epoch)).shuffle(&mut all);
        }
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
        if world_size == 0 || rank >= world_size {
            return Err(DistError::InvalidArgument {
                rank,
                collective: "DistributedEvalSampler",
                problem: format!("rank {rank} is not in 0..{world_size}"),
            });
        }
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
