//! `tandem-optim`: optimizers that update parameters from their accumulated gradients.
//!
//! An [`Optimizer`] owns handles to the parameters it updates (leaf tensors that require
//! grad) and any per-parameter state (momentum buffers). Updates happen in place and are never
//! recorded by autograd, and [`Optimizer::zero_grad`] zeroes gradients in place so that a
//! gradient living inside a communication bucket (distributed training) stays where it is.
//!
//! Alongside the optimizers ([`Sgd`], [`Adam`], [`AdamW`]) live learning-rate schedules
//! ([`schedule`], driven by a [`Scheduler`]) and gradient clipping ([`clip_grad_norm`]).

pub mod adam;
pub mod clip;
pub mod error;
pub mod optimizer;
pub mod schedule;
pub mod sgd;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::clip_grad_norm;
pub use error::{Error, Result};
pub use optimizer::Optimizer;
pub use schedule::{
    Chained, CosineAnnealingLr, LinearWarmup, LrSchedule, MultiStepLr, Scheduler, Sequential,
    StepLr,
};
pub use sgd::{Sgd, SgdConfig};
