//! The scalars of one Adam(W) update, shared by the CPU kernel (`adam`) and the CUDA launch
//! plan (`multi_tensor::plans`) so both use the very same values. A module of its own so that
//! `multi_tensor` does not import `adam`, which launches through it.

use crate::AdamConfig;

/// The scalars of one update, computed once in f64 as PyTorch does on the host.
pub(crate) struct UpdateRule {
    pub(crate) lr: f64,
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) eps: f64,
    /// Weight decay added to the gradient (Adam), or 0.
    pub(crate) l2: f64,
    /// Factor the parameter is multiplied by first (AdamW), or 1.
    pub(crate) shrink: f64,
    pub(crate) amsgrad: bool,
    /// `lr / (1 - beta1^t)`.
    pub(crate) step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    pub(crate) bias_correction2_sqrt: f64,
}

impl UpdateRule {
    /// The scalars of update number `step` (from 1) with `cfg`; `decoupled` for AdamW.
    pub(crate) fn new(cfg: &AdamConfig, decoupled: bool, step: u64) -> Self {
        let (beta1, beta2) = cfg.betas;
        let t = step.min(i32::MAX as u64) as i32;
        let (l2, shrink) = if decoupled {
            (0.0, 1.0 - cfg.lr * cfg.weight_decay)
        } else {
            (cfg.weight_decay, 1.0)
        };
        UpdateRule {
            lr: cfg.lr,
            beta1,
            beta2,
            eps: cfg.eps,
            l2,
            shrink,
            amsgrad: cfg.amsgrad,
            step_size: cfg.lr / (1.0 - beta1.powi(t)),
            bias_correction2_sqrt: (1.0 - beta2.powi(t)).sqrt(),
        }
    }

    /// Whether the L2 penalty is added to the gradient.
    pub(crate) fn decays(&self) -> bool {
        self.l2 != 0.0
    }

    /// Whether the parameter is shrunk (decoupled decay that changes something).
    pub(crate) fn shrinks(&self) -> bool {
        self.shrink != 1.0 && self.lr != 0.0
    }
}
