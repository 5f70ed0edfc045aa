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
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use tandem_core::{Device, MemoryFormat, Tensor};

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

/// The computation of a module written with `#[derive(Module)]`: what PyTorch's `forward`
/// is. The derive makes it the module's [`Module::forward`].
pub trait Forward {
    /// Computes the module's output for input `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// A module that can finish its own output pass with a ReLU, or with a residual add and a
/// ReLU (a batch norm: one pass over memory instead of two or three). Optional: containers
/// reach it through [`Child::forward_relu`] and [`Child::forward_add_relu`], which fall back to
/// separate ops for any other module, with the same result.
pub trait Fused: Module {
    /// `relu(forward(x))`.
    fn forward_relu(&self, x: &Tensor) -> Result<Tensor>;

    /// `relu(forward(x) + residual)`: the join of a residual block.
    fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor>;
}

/// A child module held by a `#[derive(Module)]` struct: visited, named after its field, and
/// replaceable through `&self` (so tandem-dist's `convert_sync_batch_norm` can swap a batch
/// norm on a shared model). `forward` runs on a snapshot, so no lock is held while the child
/// runs, and wraps an error with the child's path.
pub struct Child {
    module: RwLock<Arc<dyn Module>>,
    name: OnceLock<Box<str>>,
}

impl Child {
    /// A child holding `module`.
    pub fn new(module: impl Module + 'static) -> Self {
        Self::shared(Arc::new(module))
    }

    /// A child holding an already shared module.
    pub fn shared(module: Arc<dyn Module>) -> Self {
        Child {
            module: RwLock::new(module),
            name: OnceLock::new(),
        }
    }

    /// The module now held (a snapshot: a later [`replace`](Child::replace) does not change
    /// it).
    pub fn get(&self) -> Arc<dyn Module> {
        self.module.read().clone()
    }

    /// Puts `module` in place of the one held and returns the old one.
    pub fn replace(&self, module: Arc<dyn Module>) -> Arc<dyn Module> {
        std::mem::replace(&mut *self.module.write(), module)
    }

    /// The held module as a `T`, if it is one.
    pub fn downcast<T: Module + Any>(&self) -> Option<Arc<T>> {
        self.get().downcast_arc::<T>().ok()
    }

    /// The child's name (its field's), once its parent has named it.
    pub fn name(&self) -> &str {
        self.name.get().map_or("", |n| n)
    }

    /// Names the child (the first name given sticks). Called by the derived code.
    #[doc(hidden)]
    #[inline]
    pub fn bind_name(&self, name: &str) {
        if self.name.get().is_none() {
            let _ = self.name.set(name.into());
        }
    }

    /// [`bind_name`](Child::bind_name) with a name built only when needed.
    #[doc(hidden)]
    #[inline]
    pub fn bind_name_with(&self, name: impl FnOnce() -> String) {
        if self.name.get().is_none() {
            let _ = self.name.set(name().into());
        }
    }

    /// `e` wrapped with this child's path; unchanged while the child has no name yet (a child
    /// run by hand before its parent ever ran or was visited), rather than an empty path.
    fn in_path(&self, m: &dyn Module, e: Error) -> Error {
        match self.name() {
            "" => e,
            name => e.in_module(name, m.type_name()),
        }
    }

    /// The child's output for `x`; an error names the child's path.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let m = self.get();
        m.forward(x).map_err(|e| self.in_path(m.as_ref(), e))
    }

    /// `relu(forward(x))`, in the child's own output pass where it is [`Fused`].
    pub fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        let m = self.get();
        let out = match m.fused() {
            Some(f) => f.forward_relu(x),
            None => m.forward(x).and_then(|y| Ok(tandem_ops::relu(&y)?)),
        };
        out.map_err(|e| self.in_path(m.as_ref(), e))
    }

    /// `relu(forward(x) + residual)`, in the child's own output pass where it is [`Fused`].
    pub fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let m = self.get();
        let out = match m.fused() {
            Some(f) => f.forward_add_relu(x, residual),
            None => m
                .forward(x)
                .and_then(|y| Ok(tandem_ops::add_relu(&y, residual)?)),
        };
        out.map_err(|e| self.in_path(m.as_ref(), e))
    }
}

impl<M: Module + 'static> From<M> for Child {
    fn from(module: M) -> Self {
        Child::new(module)
    }
}

impl From<Arc<dyn Module>> for Child {
    fn from(module: Arc<dyn Module>) -> Self {
        Child::shared(module)
    }
}

impl std::fmt::Debug for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Child({} `{}`)", self.get().type_name(), self.name())
    }
}

/// The error of a derived [`Module::replace_child`] for a name it does not have.
#[doc(hidden)]
pub fn no_such_child(m: &dyn Module, name: &str) -> Error {
    let names: Vec<String> = m.children().into_iter().map(|(n, _)| n).collect();
    Error::config(
        "Module::replace_child",
        format!(
            "{} has no child named `{name}`; its children are {names:?}",
            m.type_name()
        ),
    )
}

/// A layer or a model.
///
/// # Writing a module
///
/// Derive it, and give the computation in [`Forward`]:
///
/// ```
/// use tandem_nn::{Child, Conv2dConfig, Forward, Module, Result, TrainingFlag};
/// use tandem_core::Tensor;
///
/// #[derive(Module)]
/// struct Residual {
///     conv: Child,
///     training: TrainingFlag,
/// }
///
/// impl Forward for Residual {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         Ok(tandem_ops::add(&self.conv.forward(x)?, x)?)
///     }
/// }
///
/// let block = Residual {
///     conv: Conv2dConfig::new(4, 4, 3).with_padding(1).init()?.into(),
///     training: TrainingFlag::new(),
/// };
/// let names: Vec<String> = block.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["conv.weight", "conv.bias"]);
/// # Ok::<(), tandem_nn::Error>(())
/// ```
///
/// `#[derive(Module)]` finds everything else from the fields, in field order (PyTorch's
/// registration order):
///
/// | field | is |
/// |---|---|
/// | `#[param] name: Tensor` (or `Option<Tensor>`) | a parameter `name` (trained, saved, synchronised) |
/// | `#[buffer] name: Tensor` (or `Option<Tensor>`) | a buffer `name` (saved, not trained) |
/// | `name: Child` | a child module `name`; its tensors are `name.…` |
/// | `name: Option<Child>` | a child that may be absent |
/// | `name: Vec<Child>` | children `name.0`, `name.1`, … (PyTorch's `ModuleList`) |
/// | `training: TrainingFlag` | the train/eval flag (exactly one) |
/// | `#[module(delegate)] inner: Arc<M>` | a module this one wraps: its flag, tensors and children are this one's |
/// | `#[module(skip)] …`, any other type | not part of the module (settings, counters) |
///
/// Parameters come before buffers, as in PyTorch's `state_dict`. A `Tensor` field without
/// `#[param]`/`#[buffer]`/`#[module(skip)]`, or a child held as a bare `Arc<dyn Module>`, is a
/// compile error: a forgotten child or tensor would otherwise be silently missing from the
/// optimizer, checkpoints, DDP, `to_device` and `eval()`. The derive also adds an inherent
/// `forward` that names the children for error messages (``in module `layer1.0.conv2`
/// (Conv2d): …``) and calls [`Forward::forward`]; `#[module(fused)]` on the struct says it
/// implements [`Fused`] too.
///
/// # By hand
///
/// A module whose children are not fixed fields ([`Sequential`](crate::Sequential)) implements
/// the trait itself: [`forward`](Module::forward) and [`training_flag`](Module::training_flag);
/// [`visit_own`](Module::visit_own) if it has tensors; [`children`](Module::children) and
/// [`replace_child`](Module::replace_child) if it has children. Everything else is provided.
pub trait Module: AsAny + Send + Sync {
    /// Computes the module's output for input `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// The module's train/eval flag.
    fn training_flag(&self) -> &TrainingFlag;

    /// This module as a [`Fused`] one, if it can apply a ReLU (and a residual add) inside its
    /// own output pass; `None` (the default) otherwise. [`Child::forward_relu`] and
    /// [`Child::forward_add_relu`] use it.
    fn fused(&self) -> Option<&dyn Fused> {
        None
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
            t.move_to_device(device).map_err(|e| Error::InTensor {
                path,
                module: self.type_name(),
                source: Box::new(e.into()),
            })?;
        }
        Ok(())
    }

    /// Re-lays out every 4-D parameter and buffer of this module and its descendants (and
    /// their gradients) in `format`, in place: PyTorch's `model.to(memory_format=...)`.
    /// Tensors of other ranks are left as they are (a linear layer's weight, a bias, batch
    /// norm's statistics), as PyTorch leaves them, so a whole model converts without error.
    ///
    /// Each tensor keeps its identity ([`Tensor::to_memory_format_`]): an optimizer, DDP or a
    /// hook made before the conversion keeps working with the converted parameters, and their
    /// gradients take the new format from then on. With `MemoryFormat::ChannelsLast`, the
    /// convolutions' weights are channels-last, which the NHWC kernels read natively; with
    /// `MemoryFormat::Contiguous` they go back to row-major. An error (a parameter that is a
    /// view sharing its storage, say) names the tensor by its dotted path; the tensors before it
    /// have been converted.
    fn to_memory_format(&self, format: MemoryFormat) -> Result<()> {
        for (path, _, t) in self.named_tensors() {
            if t.rank() != 4 {
                continue;
            }
            t.to_memory_format_(format).map_err(|e| Error::InTensor {
                path,
                module: self.type_name(),
                source: Box::new(e.into()),
            })?;
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
