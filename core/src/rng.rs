//! Seedable random numbers for tensor creation, initialisation, dropout and shuffling.
//!
//! A [`Generator`] is a ChaCha8 stream: the same seed gives the same numbers on every platform
//! and release. Each thread also has a default generator (seed it with [`manual_seed`]), used
//! by layer initialisation, so ranks running as threads never share one.

use std::cell::RefCell;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// Bytes of a [`Generator::state`].
pub const GENERATOR_STATE_BYTES: usize = 56;

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

    /// The generator's complete state: from it, [`Generator::from_state`] makes a generator
    /// that continues with exactly the numbers this one would draw next (for checkpoints).
    /// Layout: the 32-byte ChaCha seed, the stream (u64, little-endian) and the position in
    /// the stream in 32-bit words (u128, little-endian).
    pub fn state(&self) -> [u8; GENERATOR_STATE_BYTES] {
        let mut out = [0u8; GENERATOR_STATE_BYTES];
        out[..32].copy_from_slice(&self.rng.get_seed());
        out[32..40].copy_from_slice(&self.rng.get_stream().to_le_bytes());
        out[40..].copy_from_slice(&self.rng.get_word_pos().to_le_bytes());
        out
    }

    /// A generator in the state [`Generator::state`] returned.
    pub fn from_state(state: &[u8; GENERATOR_STATE_BYTES]) -> Self {
        let mut seed = [0u8; 32];
        seed.copy_from_slice(&state[..32]);
        let mut stream = [0u8; 8];
        stream.copy_from_slice(&state[32..40]);
        let mut word_pos = [0u8; 16];
        word_pos.copy_from_slice(&state[40..]);
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(u64::from_le_bytes(stream));
        rng.set_word_pos(u128::from_le_bytes(word_pos));
        Generator { rng }
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

    #[test]
    fn a_generator_rebuilt_from_its_state_continues_the_same_sequence() {
        // Positions inside a block, at a block edge (a u64 straddling two blocks) and fresh.
        for draws in [0usize, 1, 7, 15, 31, 32, 33, 100] {
            let mut a = Generator::new(42);
            for _ in 0..draws {
                a.below(1000);
            }
            // An odd number of 32-bit words, so the next u64 straddles a word boundary.
            a.rng.gen::<u32>();
            let mut b = Generator::from_state(&a.state());
            for _ in 0..50 {
                assert_eq!(a.next_u64(), b.next_u64(), "after {draws} draws");
                assert_eq!(a.normal().to_bits(), b.normal().to_bits());
            }
        }
    }
}
