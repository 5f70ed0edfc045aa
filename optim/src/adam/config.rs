//! [`AdamConfig`]: the hyper-parameters of Adam and AdamW, their defaults and their checks.

use crate::optimizer::check_learning_rate;
use crate::{Error, Result};

/// Hyper-parameters of [`Adam`](super::Adam) and [`AdamW`](super::AdamW). Defaults: `lr` 1e-3, `betas` (0.9, 0.999),
/// `eps` 1e-8, `weight_decay` 0 ([`AdamConfig::adamw`] has 1e-2), `amsgrad` off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Decay rates of the first and second moment estimates, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability (> 0).
    pub eps: f64,
    /// Weight decay (>= 0): an L2 penalty added to the gradient for [`Adam`](super::Adam), a decoupled
    /// shrinking of the parameter for [`AdamW`](super::AdamW).
    pub weight_decay: f64,
    /// Use the maximum of all second-moment estimates so far (AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

impl AdamConfig {
    /// The defaults with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        AdamConfig {
            lr,
            ..Default::default()
        }
    }

    /// PyTorch's `AdamW` defaults with learning rate `lr`: those of Adam with
    /// `weight_decay` 1e-2.
    pub fn adamw(lr: f64) -> Self {
        AdamConfig {
            lr,
            weight_decay: 1e-2,
            ..Default::default()
        }
    }

    /// The same config with betas `(beta1, beta2)`.
    pub fn with_betas(self, beta1: f64, beta2: f64) -> Self {
        AdamConfig {
            betas: (beta1, beta2),
            ..self
        }
    }

    /// The same config with `eps`.
    pub fn with_eps(self, eps: f64) -> Self {
        AdamConfig { eps, ..self }
    }

    /// The same config with weight decay `weight_decay`.
    pub fn with_weight_decay(self, weight_decay: f64) -> Self {
        AdamConfig {
            weight_decay,
            ..self
        }
    }

    /// The same config with AMSGrad switched on or off.
    pub fn with_amsgrad(self, amsgrad: bool) -> Self {
        AdamConfig { amsgrad, ..self }
    }

    /// Checks the values, naming what is wrong; `optimizer` is the name used in the error.
    pub(crate) fn validate_for(&self, optimizer: &'static str) -> Result<()> {
        check_learning_rate(optimizer, self.lr)?;
        let invalid = |msg: String| Err(Error::InvalidConfig { optimizer, msg });
        for (which, beta) in [("betas.0", self.betas.0), ("betas.1", self.betas.1)] {
            if !(0.0..1.0).contains(&beta) {
                return invalid(format!("{which} must be in [0, 1), got {beta}"));
            }
        }
        if !self.eps.is_finite() || self.eps <= 0.0 {
            return invalid(format!("eps must be finite and > 0, got {}", self.eps));
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return invalid(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ));
        }
        Ok(())
    }
}
