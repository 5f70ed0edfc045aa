//! The [`Module`] trait: what every layer and model implements.
//!
//! A module computes `forward(x)`, owns parameters and buffers, and may hold child modules
//! under names. Everything is reached through `&self` — the train/eval flag is an atomic,
//! containers keep their children behind a lock — so a model can be shared as
//! `Arc<dyn Module>` across threads and wrapped by distributed training.
//!
//! Parameters and buffers are enumerated by a visitor in a fixed order that matches PyTorch's:
//! a module's own tensors in registration order, then each child's, depth first, with dotted
//! paths (`features.0.weight`, `classifier.4.bias`, `bn1.running_mean`).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tandem_core::{Device, Tensor};

use crate::{Error, Result};

/// Whether a module tensor is a trainable parameter or a buffer (state that is saved and
/// synchronised but not optimized, such as BatchNorm's running statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A leaf tensor that requires grad and is updated by an optimizer.
    Parameter,
    /// Module state without gradient.
    Buffer,
}

/// A module's train/eval flag, settable through `&self`. New modules are in training mode.
#[derive(Debug)]
pub struct TrainingFlag(AtomicBool);

impl TrainingFlag {
    /// A flag in training mode.
    pub fn new() -> Self {
        TrainingFlag(AtomicBool::new(true))
    }

    /// Whether the module is in training mode.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Switches between training (`true`) and evaluation (`false`).
    pub fn set(&self, training: bool) {
        self.0.store(training, Ordering::Relaxed)
    }
}

impl Default for TrainingFlag {
    fn default() -> Self {
        Self::new()
    }
}

/// Access to a module as [`Any`], so code holding `dyn Module` can recognise a concrete layer
/// (for example to swap every `BatchNorm2d` for a synchronised one). Implemented for every
/// module; nothing to write by hand. Prefer the helpers on `dyn Module` (`is`,
/// `downcast_ref`, `downcast_arc`).
pub trait AsAny {
    /// `self` as `&dyn Any`, for `downcast_ref`.
    fn as_any(&self) -> &dyn Any;
    /// `self` as `Arc<dyn Any>`, for `Arc::downcast`.
    fn into_any_arc(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

// Bounded on `Module` (not every `Any`) so that `Arc<dyn Module>` itself is not `AsAny`:
// `arc.as_any()` then reaches the module inside instead of the `Arc`.
impl<T: Module + Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any_arc(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

impl dyn Module {
    /// Whether this module is a `T`.
    pub fn is<T: Module + Any>(&self) -> bool {
        self.as_any().is::<T>()
    }

    /// This module as a `T`, if it is one.
    pub fn downcast_ref<T: Module + Any>(&self) -> Option<&T> {
        self.as_any().downcast_ref::<T>()
    }

    /// This shared module as an `Arc<T>`, or itself back if it is not a `T`.
    pub fn downcast_arc<T: Module + Any>(
        self: Arc<Self>,
    ) -> std::result::Result<Arc<T>, Arc<Self>> {
        if self.is::<T>() {
            Ok(self
                .into_any_arc()
                .downcast::<T>()
                .unwrap_or_else(|_| unreachable!("type checked above")))
        } else {
            Err(self)
        }
    }
}

/// Joins a prefix and a name with a dot (`""` + `"weight"` = `"weight"`).
pub fn join_path(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A layer or a model.
///
/// Implement [`forward`](Module::forward) and [`training_flag`](Module::training_flag); a
/// module with parameters or buffers implements [`visit_own`](Module::visit_own), a container
/// implements [`children`](Module::children) (and [`replace_child`](Module::replace_child) if
/// its children can be swapped). Everything else is derived.
pub trait Module: AsAny + Send + Sync {
    /// Computes the module's output for input `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// The module's train/eval flag.
    fn training_flag(&self) -> &TrainingFlag;

    /// `relu(forward(x))`. A module that can apply the ReLU inside its own output pass
    /// ([`BatchNorm2d`](crate::BatchNorm2d)) overrides this to save the separate pass over
    /// memory; the result is the same either way, so any module can stand where a fused one
    /// is expected.
    fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tandem_ops::relu(&self.forward(x)?)?)
    }

    /// `relu(forward(x) + residual)`: the join of a residual block. A module that can add the
    /// residual and apply the ReLU inside its own output pass
    /// ([`BatchNorm2d`](crate::BatchNorm2d)) overrides this; any other module (a synchronised
    /// batch norm, say) runs `add_relu(forward(x), residual)`, with the same result.
    fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        Ok(tandem_ops::add_relu(&self.forward(x)?, residual)?)
    }

    /// The type's short name for messages and printing (`"Conv2d"`).
    fn type_name(&self) -> &'static str {
        let full = std::any::type_name::<Self>();
        let base = full.split('<').next().unwrap_or(full);
        base.rsplit("::").next().unwrap_or(base)
    }

    /// Calls `visitor(name, kind, tensor)` for each tensor this module owns directly (not
    /// those of its children), in registration order.
    fn visit_own(&self, visitor: &mut dyn FnMut(&str, ParamKind, &Tensor)) {
        let _ = visitor;
    }

    /// The direct children, by name, in registration order.
    fn children(&self) -> Vec<(String, Arc<dyn Module>)> {
        Vec::new()
    }

    /// Replaces the child `name` by `module` and returns the old child. Containers whose
    /// children can be swapped (like [`Sequential`](crate::Sequential)) implement this; the
    /// default is an error naming this module's type.
    fn replace_child(&self, name: &str, module: Arc<dyn Module>) -> Result<Arc<dyn Module>> {
        let _ = module;
        Err(Error::config(
            "Module::replace_child",
            format!(
                "{} does not support replacing its child `{name}`",
                self.type_name()
            ),
        ))
    }

    /// Visits every tensor of this module and its descendants with its dotted path below
    /// `prefix`: own tensors first, then each child's, depth first.
    fn visit(&self, prefix: &str, visitor: &mut dyn FnMut(&str, ParamKind, &Tensor)) {
        self.visit_own(&mut |name, kind, t| visitor(&join_path(prefix, name), kind, t));
        for (name, child) in self.children() {
            child.visit(&join_path(prefix, &name), visitor);
        }
    }

    /// Every parameter and buffer with its path and kind (what a checkpoint saves).
    fn named_tensors(&self) -> Vec<(String, ParamKind, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, kind, t| {
            out.push((name.to_string(), kind, t.clone()))
        });
        out
    }

    /// Every parameter with its dotted path, in registration order.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, kind, t| {
            if kind == ParamKind::Parameter {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    /// Every parameter, in registration order (what an optimizer takes).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// Every buffer with its dotted path, in registration order.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |name, kind, t| {
            if kind == ParamKind::Buffer {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    /// Moves every parameter and buffer of this module and its descendants (and their
    /// gradients) to `device`, in place. Each tensor keeps its identity, so hooks, optimizers
    /// and wrappers made before the move keep working with the moved tensors; views of a
    /// parameter move with it. An error names the tensor by its dotted path.
    fn to_device(&self, device: Device) -> Result<()> {
        for (path, _, t) in self.named_tensors() {
            t.move_to_device(device)
                .map_err(|e| Error::from(e).in_module(&path, self.type_name()))?;
        }
        Ok(())
    }

    /// The device of the module's first parameter or buffer (the CPU for a module without any).
    fn device(&self) -> Device {
        self.named_tensors()
            .first()
            .map_or(Device::Cpu, |(_, _, t)| t.device())
    }

    /// Total number of parameter elements.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|p| p.numel()).sum()
    }

    /// Every descendant module with its dotted path, depth first (parents before their
    /// children); the module itself is not included.
    fn named_modules(&self) -> Vec<(String, Arc<dyn Module>)> {
        let mut out = Vec::new();
        for (name, child) in self.children() {
            let below = child.named_modules();
            out.push((name.clone(), child));
            out.extend(
                below
                    .into_iter()
                    .map(|(path, m)| (join_path(&name, &path), m)),
            );
        }
        out
    }

    /// Switches this module and all its descendants to training (`true`) or evaluation
    /// (`false`) mode; this changes what Dropout and BatchNorm do.
    fn set_training(&self, training: bool) {
        self.training_flag().set(training);
        for (_, child) in self.children() {
            child.set_training(training);
        }
    }

    /// Whether this module is in training mode.
    fn is_training(&self) -> bool {
        self.training_flag().get()
    }

    /// Shorthand for `set_training(true)`.
    fn train(&self) {
        self.set_training(true)
    }

    /// Shorthand for `set_training(false)`.
    fn eval(&self) {
        self.set_training(false)
    }
}

/// Puts `module` in `slot` (that of the child `name`) and returns the old child, or, without
/// a slot, an error naming `owner` and the existing children `names`: the body of a
/// container's [`Module::replace_child`].
pub(crate) fn replace_named(
    owner: &'static str,
    names: Vec<String>,
    slot: Option<&mut Arc<dyn Module>>,
    name: &str,
    module: Arc<dyn Module>,
) -> Result<Arc<dyn Module>> {
    match slot {
        Some(slot) => Ok(std::mem::replace(slot, module)),
        None => Err(Error::config(
            owner,
            format!("no child named `{name}`; children are {names:?}"),
        )),
    }
}

/// [`replace_named`] for children kept as a list of `(name, module)`.
pub(crate) fn replace_in_list(
    owner: &'static str,
    children: &mut [(String, Arc<dyn Module>)],
    name: &str,
    module: Arc<dyn Module>,
) -> Result<Arc<dyn Module>> {
    let names = children.iter().map(|(n, _)| n.clone()).collect();
    let slot = children
        .iter_mut()
        .find(|(n, _)| n == name)
        .map(|(_, slot)| slot);
    replace_named(owner, names, slot, name, module)
}

/// Makes `t` a parameter: a leaf that requires grad.
pub(crate) fn parameter(t: Tensor) -> Result<Tensor> {
    Ok(t.with_requires_grad()?)
}
