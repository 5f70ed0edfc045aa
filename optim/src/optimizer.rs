//! The [`Optimizer`] trait every optimizer implements, and the checks they share.
//!
//! A training step is `optimizer.zero_grad()?; loss.backward()?; optimizer.step()?`. The
//! optimizer holds the parameters (clones of the model's tensor handles, so updates are seen by
//! the model) and its own state, which [`Optimizer::state`] exposes by name for checkpoints.
//!
//! Per-element state (momentum buffers, moment estimates) lives on its parameter's device. A
//! parameter moved since its state was made (`Tensor::move_to_device`, `Module::to_device`)
//! takes its state along at the next step (`follow_parameter`); state loaded from a
//! checkpoint is copied to the parameter's device (`state_for_parameter`).

use std::collections::HashSet;

use tandem_core::{Device, MemoryFormat, Tensor};

pub(crate) use crate::grouping::by_device;
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
    ///
    /// On a CUDA device the gradients of each dtype are zeroed by one multi-tensor launch.
    fn zero_grad(&mut self) -> Result<()> {
        let _profile = tandem_core::profile::scope("zero_grad", tandem_core::profile::Phase::Other);
        crate::zero_grad::zero_grads(self.parameters())
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

/// Checks that `params` is not empty and holds distinct floating-point leaves that require
/// grad.
pub(crate) fn check_parameters(optimizer: &'static str, params: &[Tensor]) -> Result<()> {
    if params.is_empty() {
        return Err(Error::EmptyParameterList { optimizer });
    }
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

/// What an update kernel works on: the parameter's gradient and a dense tensor holding the
/// parameter's values (the parameter itself, or a copy to write back with [`write_back`]), and
/// the device they are on (read once: the step dispatches on it).
pub(crate) struct UpdateOperands {
    pub grad: Tensor,
    pub target: Tensor,
    pub device: Device,
}

/// The operands for updating parameter `index`, or `None` when it has no gradient. The kernels
/// borrow several buffers at once and work in storage order (the updates are elementwise), so
/// the target is dense and the gradient dense in the same format, never sharing the
/// parameter's buffer: a channels-last parameter in host memory is its own target with a
/// channels-last gradient (copied only when it arrives otherwise); any other parameter that is
/// not row-major is updated through a row-major copy written back with [`write_back`].
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
    let device = param.device();
    if grad.device() != device {
        return Err(Error::parameter(
            optimizer,
            index,
            param,
            format!(
                "its gradient is on {} but the parameter is on {device}",
                grad.device()
            ),
        ));
    }
    let format = match param.dense_format() {
        Some(MemoryFormat::ChannelsLast) if device == Device::Cpu => MemoryFormat::ChannelsLast,
        _ => MemoryFormat::Contiguous,
    };
    let grad = if grad.storage().same_buffer(param.storage()) {
        grad.copy_detached()?.contiguous_in(format)?
    } else {
        grad.contiguous_in(format)?
    };
    let target = if param.is_contiguous_in(format) {
        param.clone()
    } else {
        param.copy_detached()?
    };
    Ok(Some(UpdateOperands {
        grad,
        target,
        device,
    }))
}

/// Copies an updated `target` back into a non-contiguous `param`.
pub(crate) fn write_back(param: &Tensor, target: &Tensor) -> Result<()> {
    if !target.same_tensor(param) {
        param.copy_(target)?;
    }
    Ok(())
}

/// A fresh zero state tensor (momentum, moments) for `param`, laid out like its update `target`
/// on the CPU, so that the update runs in storage order.
pub(crate) fn zero_state(param: &Tensor, target: &Tensor, device: Device) -> Result<Tensor> {
    let zeros = Tensor::zeros(param.dims(), param.dtype(), device)?;
    Ok(match target.dense_format() {
        Some(format) if device == Device::Cpu => zeros.contiguous_in(format)?,
        _ => zeros,
    })
}

/// A state tensor (momentum, moments) ready for a storage-order update beside `target`: the
/// state itself when it is laid out like `target` or can be re-laid out so in place (it keeps
/// its identity), else a copy in `target`'s format that [`LaidOutState::finish`] copies back.
/// A state from a checkpoint comes back row-major; a parameter converted to channels-last after
/// its state was made is the other way round.
pub(crate) struct LaidOutState {
    tensor: Tensor,
    copy_back_to: Option<Tensor>,
}

impl LaidOutState {
    pub(crate) fn new(state: &Tensor, target: &Tensor) -> tandem_core::Result<Self> {
        let format = target.dense_format().unwrap_or(MemoryFormat::Contiguous);
        if state.dense_format() == Some(format) || state.to_memory_format_(format).is_ok() {
            return Ok(LaidOutState {
                tensor: state.clone(),
                copy_back_to: None,
            });
        }
        Ok(LaidOutState {
            tensor: state.contiguous_in(format)?,
            copy_back_to: Some(state.clone()),
        })
    }

    /// The tensor to update, dense in the target's format.
    pub(crate) fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// Writes an updated copy back into the state.
    pub(crate) fn finish(self) -> tandem_core::Result<()> {
        match self.copy_back_to {
            Some(state) => state.copy_(&self.tensor),
            None => Ok(()),
        }
    }
}

/// Moves a state tensor of parameter `index` to `device`, the parameter's, when the parameter
/// has moved since the state was made. The move is in place ([`Tensor::move_to_device`]), so
/// the state keeps its identity (handles from `momentum_buffer`, `exp_avg`, … stay valid).
#[inline]
pub(crate) fn follow_parameter(
    optimizer: &'static str,
    index: usize,
    param: &Tensor,
    device: Device,
    state: &Tensor,
) -> Result<()> {
    if state.device() == device {
        return Ok(());
    }
    let from = state.device();
    state.move_to_device(device).map_err(|e| {
        Error::parameter(
            optimizer,
            index,
            param,
            format!("moving its optimizer state from {from} to the parameter's {device}: {e}"),
        )
    })
}

/// A fresh copy of loaded state `tensor` on `param`'s device (a checkpoint's tensors are in
/// host memory; the state of a CUDA parameter lives on its device).
pub(crate) fn state_for_parameter(tensor: &Tensor, param: &Tensor) -> Result<Tensor> {
    if tensor.device() == param.device() {
        Ok(tensor.copy_detached()?)
    } else {
        Ok(tensor.to_device(param.device())?)
    }
}

/// Errors when two tensors of a fused update's table share memory: the kernel updates every
/// parameter at once, so (unlike the CPU's one-after-the-other loop) overlapping parameters,
/// gradients or states would race. `param_of` maps a table position to the parameter's index
/// and tensor.
pub(crate) fn check_disjoint<'a>(
    optimizer: &'static str,
    table: &crate::multi_tensor::TensorTable,
    param_of: impl Fn(usize) -> (usize, &'a Tensor),
) -> Result<()> {
    let Some((a, b)) = table.first_overlap() else {
        return Ok(());
    };
    let (first, _) = param_of(a);
    let (index, param) = param_of(b);
    let what = if first == index {
        "its gradient or optimizer state shares memory with the parameter or with each other"
            .to_string()
    } else {
        format!(
            "it (or its gradient or state) shares memory with parameter {first}; a fused CUDA \
             step updates all parameters at once, so they must not overlap"
        )
    };
    Err(Error::parameter(optimizer, index, param, what))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Storage};

    fn labelled_on_cuda(numel: usize) -> Tensor {
        let storage = Storage::host_memory_labelled(
            tandem_core::storage::CpuStorage::F32(vec![0.0; numel]),
            Device::Cuda(0),
        );
        Tensor::from_storage(storage, tandem_core::Layout::contiguous(&[numel])).unwrap()
    }

    #[test]
    fn state_on_another_device_is_moved_to_the_parameter_and_failures_name_it() {
        let param = Tensor::zeros(&[4], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        // State already beside its parameter: nothing to do.
        let state = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
        follow_parameter("SGD", 3, &param, Device::Cpu, &state).unwrap();
        assert_eq!(state.device(), Device::Cpu);
        // State elsewhere is moved; this machine cannot read the labelled memory, so the move
        // fails, and the error says what was attempted for which parameter.
        let away = labelled_on_cuda(4);
        let err = follow_parameter("SGD", 3, &param, Device::Cpu, &away)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("SGD: parameter 3") && err.contains("from cuda:0 to the parameter's cpu"),
            "{err}"
        );
        // Loading state onto the parameter's device copies it there (here: a copy on the CPU).
        let loaded = state_for_parameter(&state, &param).unwrap();
        assert!(!loaded.storage().same_buffer(state.storage()));
        assert!(state_for_parameter(&away, &param).is_err());
    }
}
