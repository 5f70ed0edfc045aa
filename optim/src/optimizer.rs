//! The [`Optimizer`] trait every optimizer implements, and the checks they share.
//!
//! A training step is `optimizer.zero_grad()?; loss.backward()?; optimizer.step()?`. The
//! optimizer holds the parameters (clones of the model's tensor handles, so updates are seen by
//! the model) and its own state, which [`Optimizer::state`] exposes by name for checkpoints.

use std::collections::HashSet;

use tandem_core::Tensor;

use crate::{Error, Result};

/// Updates parameters from their gradients.
///
/// Implementations update in place, outside autograd, and skip parameters whose gradient is
/// `None` (they took no part in the last backward).
pub trait Optimizer: Send {
    /// The optimizer's name for messages (`"SGD"`).
    fn name(&self) -> &'static str;

    /// The parameters being optimized, in the order they were given.
    fn parameters(&self) -> &[Tensor];

    /// Applies one update to every parameter that has a gradient.
    fn step(&mut self) -> Result<()>;

    /// Number of completed [`Optimizer::step`] calls.
    fn step_count(&self) -> u64;

    /// The current learning rate.
    fn learning_rate(&self) -> f64;

    /// Changes the learning rate (for schedules). Errors if `lr` is negative or not finite.
    fn set_learning_rate(&mut self, lr: f64) -> Result<()>;

    /// The optimizer's state as named tensors, for checkpoints: per-parameter entries are
    /// named `"{index}.{what}"` (for example `"3.momentum_buffer"`), plus `"step"` (an i64
    /// scalar). The tensors are the live buffers; copy them before mutating.
    fn state(&self) -> Vec<(String, Tensor)>;

    /// Restores state produced by [`Optimizer::state`] of an optimizer over parameters of the
    /// same shapes.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()>;

    /// Sets every existing gradient to zero *in place*. The gradient tensors themselves are
    /// kept, so a gradient that is a view into a communication bucket stays one.
    fn zero_grad(&mut self) -> Result<()> {
        let _profile = tandem_core::profile::scope("zero_grad", tandem_core::profile::Phase::Other);
        for p in self.parameters() {
            if let Some(g) = p.grad() {
                g.zero_()?;
            }
        }
        Ok(())
    }

    /// Drops every gradient (`grad = None`), releasing its memory; the next backward allocates
    /// fresh gradients.
    fn zero_grad_set_to_none(&mut self) -> Result<()> {
        for p in self.parameters() {
            p.set_grad(None)?;
        }
        Ok(())
    }
}

/// Checks that `params` are distinct floating-point leaves that require grad.
pub(crate) fn check_parameters(optimizer: &'static str, params: &[Tensor]) -> Result<()> {
    let mut seen = HashSet::new();
    for (index, p) in params.iter().enumerate() {
        if !p.is_leaf() {
            return Err(Error::parameter(
                optimizer,
                index,
                p,
                "is not a leaf tensor (it was computed by an op); optimize the leaf it came from",
            ));
        }
        if !p.requires_grad() {
            return Err(Error::parameter(
                optimizer,
                index,
                p,
                "does not require grad, so it never receives a gradient",
            ));
        }
        if !p.dtype().is_float() {
            return Err(Error::parameter(
                optimizer,
                index,
                p,
                "is not a floating-point tensor",
            ));
        }
        if !seen.insert(p.id()) {
            return Err(Error::parameter(
                optimizer,
                index,
                p,
                "appears more than once in the parameter list; it would be updated twice",
            ));
        }
    }
    Ok(())
}

/// Checks a learning rate.
pub(crate) fn check_learning_rate(optimizer: &'static str, lr: f64) -> Result<()> {
    if !lr.is_finite() || lr < 0.0 {
        return Err(Error::InvalidConfig {
            optimizer,
            msg: format!("learning rate must be finite and >= 0, got {lr}"),
        });
    }
    Ok(())
}

/// What an update kernel works on: the parameter's gradient and a contiguous tensor holding the
/// parameter's values (the parameter itself, or a copy to write back with [`write_back`]).
pub(crate) struct UpdateOperands {
    pub grad: Tensor,
    pub target: Tensor,
}

/// The operands for updating parameter `index`, or `None` when it has no gradient. The kernels
/// borrow several buffers at once, so the gradient is made contiguous and never shares the
/// parameter's buffer.
pub(crate) fn update_operands(
    optimizer: &'static str,
    index: usize,
    param: &Tensor,
) -> Result<Option<UpdateOperands>> {
    let Some(grad) = param.grad() else {
        return Ok(None);
    };
    if grad.dims() != param.dims() || grad.dtype() != param.dtype() {
        return Err(Error::parameter(
            optimizer,
            index,
            param,
            format!(
                "gradient {:?} {} does not match the parameter",
                grad.dims(),
                grad.dtype()
            ),
        ));
    }
    let grad = if grad.is_contiguous() && !grad.storage().same_buffer(param.storage()) {
        grad
    } else {
        grad.copy_detached()?
    };
    let target = if param.is_contiguous() {
        param.clone()
    } else {
        param.copy_detached()?
    };
    Ok(Some(UpdateOperands { grad, target }))
}

/// Copies an updated `target` back into a non-contiguous `param`.
pub(crate) fn write_back(param: &Tensor, target: &Tensor) -> Result<()> {
    if !target.same_tensor(param) {
        param.copy_(target)?;
    }
    Ok(())
}
