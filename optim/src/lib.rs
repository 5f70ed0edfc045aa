//! `tandem-optim`: optimizers that update parameters from their accumulated gradients.
//!
//! An [`Optimizer`] owns handles to the parameters it updates (leaf tensors that require
//! grad) and any per-parameter state (momentum buffers). Updates happen in place and are never
//! recorded by autograd, and [`Optimizer::zero_grad`] zeroes gradients in place so that a
//! gradient living inside a communication bucket (distributed training) stays where it is.
//!
//! Alongside the optimizers ([`Sgd`], [`Adam`], [`AdamW`]) live learning-rate schedules
//! ([`schedule`], driven by a [`Scheduler`]), gradient clipping ([`clip_grad_norm`]) and the
//! gradient scaler for f16 mixed precision ([`GradScaler`], see [`scaler`]).
//!
//! Every update, clipping and `zero_grad` dispatches once on the parameters' device: host loops
//! on the CPU, fused multi-tensor kernels on a CUDA device ([`multi_tensor`]: one launch per
//! dtype updates every parameter). Optimizer state lives on its parameter's device and follows
//! it when the model moves; `state()` hands out the live tensors, which a checkpoint saves from
//! any device, and `load_state` copies saved state to the parameters' device.

#![warn(missing_docs)]

pub mod adam;
pub mod clip;
pub mod error;
mod grouping;
pub mod multi_tensor;
pub mod optimizer;
pub mod scaler;
pub mod schedule;
pub mod sgd;
mod update_rule;
mod zero_grad;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::clip_grad_norm;
pub use error::{Error, Result};
pub use optimizer::Optimizer;
pub use scaler::{GradScaler, GradScalerConfig, StepOutcome};
pub use schedule::{
    Chained, CosineAnnealingLr, LinearWarmup, LrSchedule, MultiStepLr, Scheduler, SequentialLr,
    StepLr,
};
pub use sgd::{Sgd, SgdConfig};
