//! [`Sequential`]: children applied one after another.

use std::sync::Arc;

use parking_lot::RwLock;
use tandem_core::Tensor;

use crate::module::replace_in_list;
use crate::{Error, Result};
use crate::{Module, TrainingFlag};

/// A chain of modules: `forward(x)` feeds `x` through each child in order.
///
/// Children added with [`Sequential::add`] are named by position (`"0"`, `"1"`, …, as in
/// PyTorch), so parameters get paths like `3.weight`; [`Sequential::add_named`] gives a child
/// a name (`features`, `classifier`). A child can later be swapped with
/// [`Sequential::replace`] (for example a `BatchNorm2d` for a synchronised one); the list
/// sits behind a lock so that works through `&self` on a shared model.
///
/// An error in a child comes back wrapped with the child's path, e.g.
/// ``in module `features.3` (Conv2d): …``.
#[derive(Default)]
pub struct Sequential {
    children: RwLock<Vec<(String, Arc<dyn Module>)>>,
    training: TrainingFlag,
}

impl Sequential {
    /// An empty chain (the identity).
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `module`, named by its position (`"0"`, `"1"`, …: the number of children
    /// before it). Cannot fail: names made only of digits are reserved for positional
    /// children ([`Sequential::add_named`] refuses them), so the position's name is always
    /// free, whatever was added before.
    // The builder reads like PyTorch's `nn.Sequential(...)`; it is not `std::ops::Add`.
    #[allow(clippy::should_implement_trait)]
    pub fn add(self, module: impl Module + 'static) -> Self {
        self.add_shared(Arc::new(module))
    }

    /// Appends an already shared module, named by its position; cannot fail, like
    /// [`Sequential::add`].
    pub fn add_shared(mut self, module: Arc<dyn Module>) -> Self {
        let children = self.children.get_mut();
        let name = children.len().to_string();
        children.push((name, module));
        self
    }

    /// Appends `module` under `name`. Returns `Result` because a user's name can be invalid:
    /// errors if it is empty, contains a dot (dots separate the parts of a parameter path), is
    /// made only of digits (reserved for positional children, so [`Sequential::add`] never
    /// collides) or is already taken.
    pub fn add_named(mut self, name: &str, module: impl Module + 'static) -> Result<Self> {
        let children = self.children.get_mut();
        let problem = if name.is_empty() || name.contains('.') {
            Some("must be non-empty and contain no '.'")
        } else if name.bytes().all(|b| b.is_ascii_digit()) {
            Some("is a number; numbers name positional children (use `add`)")
        } else if children.iter().any(|(n, _)| n == name) {
            Some("is already taken")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(Error::config(
                "Sequential",
                format!("child name `{name}` {problem}"),
            ));
        }
        children.push((name.to_string(), Arc::new(module)));
        Ok(self)
    }

    /// Number of children.
    pub fn len(&self) -> usize {
        self.children.read().len()
    }

    /// Whether there are no children.
    pub fn is_empty(&self) -> bool {
        self.children.read().is_empty()
    }

    /// The child named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Module>> {
        self.children
            .read()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, m)| m.clone())
    }

    /// Replaces the child `name` by `module`, returning the old one. Errors naming the
    /// existing children if there is no such child.
    pub fn replace(&self, name: &str, module: Arc<dyn Module>) -> Result<Arc<dyn Module>> {
        let mut children = self.children.write();
        replace_in_list("Sequential::replace", &mut children, name, module)
    }
}

// Written by hand, not derived: its children are a list that grows with `add` and is named at
// run time (positions or `add_named`), not fixed fields.
impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // A snapshot, so no lock is held while children run.
        let children = self.children.read().clone();
        let mut out = x.clone();
        for (name, child) in &children {
            out = child
                .forward(&out)
                .map_err(|e| e.in_module(name, child.type_name()))?;
        }
        Ok(out)
    }

    fn training_flag(&self) -> &TrainingFlag {
        &self.training
    }

    fn children(&self) -> Vec<(String, Arc<dyn Module>)> {
        self.children.read().clone()
    }

    fn replace_child(&self, name: &str, module: Arc<dyn Module>) -> Result<Arc<dyn Module>> {
        self.replace(name, module)
    }
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_map();
        for (name, child) in self.children.read().iter() {
            list.entry(name, &child.type_name());
        }
        list.finish()
    }
}
