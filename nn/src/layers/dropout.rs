//! Dropout with a per-layer, reseedable generator.

use parking_lot::Mutex;
use tandem_core::rng::{with_default_generator, GENERATOR_STATE_BYTES};
use tandem_core::{Generator, Tensor};

use crate::{Error, Result};
use crate::{Forward, Module, TrainingFlag};

/// How to build a [`Dropout`]: the drop probability in [`DropoutConfig::new`], then
/// [`DropoutConfig::init`].
///
/// ```
/// # use tandem_nn::DropoutConfig;
/// let dropout = DropoutConfig::new(0.5).init()?;
/// assert_eq!(dropout.p(), 0.5);
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutConfig {
    /// Probability of zeroing each element during training, in `[0, 1)`.
    pub p: f64,
}

impl DropoutConfig {
    /// Dropout with probability `p`.
    pub fn new(p: f64) -> Self {
        DropoutConfig { p }
    }

    /// The layer, its generator seeded from the thread's default generator. Errors (naming
    /// `Dropout` and the value) if `p` is outside `[0, 1)`.
    pub fn init(&self) -> Result<Dropout> {
        let p = self.p;
        if !(0.0..1.0).contains(&p) {
            return Err(Error::config(
                "Dropout",
                format!("probability must be in [0, 1), got {p}"),
            ));
        }
        let seed = with_default_generator(|g| g.next_u64());
        Ok(Dropout {
            p,
            generator: Mutex::new(Generator::new(seed)),
            training: TrainingFlag::new(),
        })
    }
}

/// Zeroes each element with probability `p` during training and scales the survivors by
/// `1 / (1 − p)` (inverted dropout); the identity in evaluation mode.
///
/// Built with [`DropoutConfig`]. Each layer owns a generator, seeded at construction from the thread's default generator
/// (so `manual_seed` before building a model fixes every mask) and reseedable with
/// [`Dropout::reseed`].
///
/// # Shapes
/// Any input; the output has its shape.
#[derive(Debug, Module)]
pub struct Dropout {
    p: f64,
    generator: Mutex<Generator>,
    training: TrainingFlag,
}

impl Dropout {
    /// The drop probability.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Restarts this layer's masks from `seed`.
    pub fn reseed(&self, seed: u64) {
        *self.generator.lock() = Generator::new(seed);
    }

    /// The state of this layer's generator (for checkpoints; see
    /// [`rng_state`](crate::checkpoint::rng_state)).
    pub fn generator_state(&self) -> [u8; GENERATOR_STATE_BYTES] {
        self.generator.lock().state()
    }

    /// Puts this layer's generator in a state [`Dropout::generator_state`] returned, so the
    /// next masks are the ones drawn after it.
    pub fn set_generator_state(&self, state: &[u8; GENERATOR_STATE_BYTES]) {
        *self.generator.lock() = Generator::from_state(state);
    }
}

impl Forward for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let training = self.is_training();
        let mut generator = self.generator.lock();
        Ok(tandem_ops::dropout(x, self.p, training, &mut generator)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Device};

    #[test]
    fn dropout_zeroes_and_rescales_in_training_and_is_identity_in_eval() {
        let layer = DropoutConfig::new(0.25).init().unwrap();
        let x = Tensor::ones(&[4000], DType::F32, Device::Cpu).unwrap();
        let y = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
        let kept = y.iter().filter(|&&v| v != 0.0).count();
        assert!(y.iter().all(|&v| v == 0.0 || (v - 4.0 / 3.0).abs() < 1e-6));
        assert!((kept as f64 / 4000.0 - 0.75).abs() < 0.03, "kept {kept}");
        layer.eval();
        assert_eq!(
            layer.forward(&x).unwrap().to_vec::<f32>().unwrap(),
            vec![1.0; 4000]
        );
    }

    #[test]
    fn reseeding_repeats_the_masks() {
        let layer = DropoutConfig::new(0.5).init().unwrap();
        let x = Tensor::ones(&[64], DType::F32, Device::Cpu).unwrap();
        layer.reseed(3);
        let a = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
        let b = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
        layer.reseed(3);
        let c = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
        assert_ne!(a, b);
        assert_eq!(a, c);
    }

    #[test]
    fn dropout_probability_must_be_below_one() {
        let err = DropoutConfig::new(1.0).init().unwrap_err().to_string();
        assert!(err.contains("Dropout") && err.contains("got 1"), "{err}");
        assert!(DropoutConfig::new(-0.1).init().is_err());
        assert!(DropoutConfig::new(f64::NAN).init().is_err());
        assert!(DropoutConfig::new(0.0).init().is_ok());
    }
}
