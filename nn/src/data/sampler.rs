//! Samplers: the order in which an epoch visits a dataset's indices.
//!
//! A sampler is a pure function of the epoch number, so every epoch's order can be reproduced
//! (and, in distributed training, agreed on by every rank without communication).

use tandem_core::Generator;

/// Chooses the sample indices of each epoch, in order.
pub trait Sampler: Send + Sync {
    /// How many indices [`Sampler::indices`] returns per epoch.
    fn len(&self) -> usize;

    /// Whether an epoch is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indices of epoch `epoch`, in visiting order.
    fn indices(&self, epoch: u64) -> Vec<usize>;
}

/// Every index `0..len`, in order, every epoch.
#[derive(Clone, Copy, Debug)]
pub struct SequentialSampler {
    len: usize,
}

impl SequentialSampler {
    /// A sampler over a dataset of `len` samples.
    pub fn new(len: usize) -> Self {
        SequentialSampler { len }
    }
}

impl Sampler for SequentialSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self, _epoch: u64) -> Vec<usize> {
        (0..self.len).collect()
    }
}

/// A random permutation of `0..len`, different each epoch and fixed by `seed + epoch`.
#[derive(Clone, Copy, Debug)]
pub struct RandomSampler {
    len: usize,
    seed: u64,
}

impl RandomSampler {
    /// A sampler over `len` samples whose permutations derive from `seed`.
    pub fn new(len: usize, seed: u64) -> Self {
        RandomSampler { len, seed }
    }

    /// The base seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl Sampler for RandomSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        Generator::new(self.seed.wrapping_add(epoch)).shuffle(&mut order);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_sampler_is_a_permutation_that_changes_per_epoch_and_repeats_per_seed() {
        let s = RandomSampler::new(100, 5);
        let (e0, e1) = (s.indices(0), s.indices(1));
        let mut sorted = e0.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(e0, e1);
        assert_eq!(e0, RandomSampler::new(100, 5).indices(0));
        // Epoch e of seed s is epoch 0 of seed s + e.
        assert_eq!(e1, RandomSampler::new(100, 6).indices(0));
    }

    #[test]
    fn sequential_sampler_visits_in_order() {
        assert_eq!(SequentialSampler::new(4).indices(7), vec![0, 1, 2, 3]);
    }
}
