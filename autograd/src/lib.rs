//! `tandem-autograd`: reverse-mode automatic differentiation.
//!
//! Ops record nodes with [`record()`]; [`backward`] runs them in reverse topological order,
//! accumulates leaf gradients, and emits the two events distributed training is built on:
//! a **gradient-ready** event per parameter the moment its gradient is final, and a
//! **backward-finished** event once per pass (see [`hooks`]). Nothing here knows about
//! communication. [`gradcheck()`] verifies any op's backward against finite differences.

#![warn(missing_docs)]

pub mod autocast;
pub mod engine;
pub mod grad_mode;
pub mod gradcheck;
pub mod hooks;
pub mod record;

pub use autocast::{autocast, autocast_dtype, AutocastGuard};
pub use engine::{backward, BackwardOptions, TensorBackward};
pub use grad_mode::{is_grad_enabled, no_grad, NoGradGuard};
pub use gradcheck::{gradcheck, GradcheckOptions};
pub use hooks::{register_backward_finished_hook, register_grad_ready_hook, HookHandle};
pub use record::{edge_to, needs_grad, record, record_fn, FnBackward};
pub use tandem_core::graph::BackwardSummary;
pub use tandem_core::GradReady;

#[cfg(test)]
mod tests;
