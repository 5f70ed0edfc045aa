//! `tandem-optim`: optimizers that update parameters from their accumulated gradients.
//!
//! An [`Optimizer`] owns handles to the parameters it updates (leaf tensors that require
//! grad) and any per-parameter state (momentum buffers). Updates happen in place and are never
//! recorded by autograd, and [`Optimizer::zero_grad`] zeroes gradients in place so that a
//! gradient living inside a communication bucket (distributed training) stays where it is.

pub mod error;
pub mod optimizer;
pub mod sgd;

pub use error::{Error, Result};
pub use optimizer::Optimizer;
pub use sgd::{Sgd, SgdConfig};
