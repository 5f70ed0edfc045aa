//! `DistributedSampler`: splits each epoch's samples into disjoint, equal shards, one per rank.
//!
//! Every rank computes the same permutation of the dataset from a shared seed and the epoch
//! number (no communication), then takes every `world_size`-th index starting at its rank. The
//! epoch is padded by repeating its first indices (or, with `drop_last`, cut) to a multiple of
//! the world size, so every rank runs the same number of steps — a rank that ran one step more
//! would wait for ever in its extra all-reduce.
//!
//! With a global batch B, give each rank's loader a batch of B / world_size.

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

#[cfg(test)]
mod tests {
    use super::*;

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
