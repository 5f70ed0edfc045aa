//! Seedable random numbers for tensor creation, initialisation, dropout and shuffling.
//!
//! A [`Generator`] is a ChaCha8 stream: the same seed gives the same numbers on every platform
//! and release. Each thread also has a default generator (seed it with [`manual_seed`]), used
//! by layer initialisation, so ranks running as threads never share one.

use std::cell::RefCell;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// A seedable random number generator.
#[derive(Clone, Debug)]
pub struct Generator {
    rng: ChaCha8Rng,
}

impl Generator {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Generator {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform sample in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.rng.gen::<f64>()
    }

    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        StandardNormal.sample(&mut self.rng)
    }

    /// A uniform integer in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.rng.gen_range(0..n)
    }

    /// A fresh 64-bit value, for seeding other generators.
    pub fn next_u64(&mut self) -> u64 {
        self.rng.gen()
    }

    /// Shuffles a slice in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

thread_local! {
    static DEFAULT: RefCell<Generator> = RefCell::new(Generator::new(0x007a_4de3));
}

/// Re-seeds this thread's default generator.
pub fn manual_seed(seed: u64) {
    DEFAULT.with(|g| *g.borrow_mut() = Generator::new(seed));
}

/// Runs `f` with this thread's default generator.
pub fn with_default_generator<R>(f: impl FnOnce(&mut Generator) -> R) -> R {
    DEFAULT.with(|g| f(&mut g.borrow_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let (mut a, mut b) = (Generator::new(7), Generator::new(7));
        for _ in 0..10 {
            assert_eq!(a.uniform(), b.uniform());
        }
        let mut v: Vec<usize> = (0..10).collect();
        a.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    }
}
