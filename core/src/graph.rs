//! The data of the autograd graph: nodes, edges and the hooks a leaf carries.
//!
//! A [`Node`] is recorded by every differentiable op whose inputs require grad; it owns what
//! its backward needs (a [`BackwardOp`]) and one edge per input. The engine that walks these
//! nodes, and the functions users call to register hooks, live in `tandem-autograd`; they are
//! defined here only because a [`Tensor`] points at the node that produced it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::{Event, Result, Tensor, TensorId};

/// The backward of one op: turns the gradient of its output into gradients of its inputs.
pub trait BackwardOp: Send + Sync {
    /// The op's name, used in error messages and traces.
    fn name(&self) -> &'static str;

    /// Gradients with respect to each input, in the order the inputs were recorded. `None`
    /// means "no gradient flows to this input" (it does not require grad, or the op is
    /// piecewise constant there).
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// Where a gradient goes next: the node that produced an input, or a leaf that accumulates it.
#[derive(Clone)]
pub enum Edge {
    /// An intermediate result; its node runs once every consumer has delivered.
    Node(Arc<Node>),
    /// A leaf tensor that requires grad (a parameter); its gradient accumulates into `.grad`.
    Leaf(Tensor),
}

static NEXT_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// One recorded op in the graph.
pub struct Node {
    sequence: u64,
    name: &'static str,
    op: Mutex<Option<Box<dyn BackwardOp>>>,
    inputs: Vec<Option<Edge>>,
}

impl Node {
    /// Records a node. `inputs[i]` is the edge to input `i`, `None` if it needs no gradient.
    pub fn new(op: Box<dyn BackwardOp>, inputs: Vec<Option<Edge>>) -> Arc<Self> {
        Arc::new(Node {
            sequence: NEXT_SEQUENCE.fetch_add(1, Ordering::Relaxed),
            name: op.name(),
            op: Mutex::new(Some(op)),
            inputs,
        })
    }

    /// Creation order; later nodes run earlier in backward (reverse layer order).
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The op's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The edges to this node's inputs.
    pub fn inputs(&self) -> &[Option<Edge>] {
        &self.inputs
    }

    /// Runs the backward. With `retain` false the saved state is released afterwards, and a
    /// second backward through this node is an error.
    pub fn run_backward(&self, grad_output: &Tensor, retain: bool) -> Result<Vec<Option<Tensor>>> {
        let mut slot = self.op.lock();
        let op = slot.as_ref().ok_or_else(|| {
            crate::Error::autograd(format!(
                "backward through `{}` a second time, but its saved tensors were freed after the \
                 first backward; pass retain_graph = true to the first backward",
                self.name
            ))
        })?;
        let grads = op.backward(grad_output)?;
        if grads.len() != self.inputs.len() {
            return Err(crate::Error::autograd(format!(
                "`{}` returned {} gradients for {} inputs",
                self.name,
                grads.len(),
                self.inputs.len()
            )));
        }
        if !retain {
            slot.take();
        }
        Ok(grads)
    }
}

/// What a gradient-ready hook receives: the leaf, its final gradient for this backward, and an
/// event on the compute stream after which the gradient's memory holds the final values.
pub struct GradReady {
    /// The leaf (parameter) whose gradient is final.
    pub param: Tensor,
    /// The accumulated gradient (`param.grad()`).
    pub grad: Tensor,
    /// Completes when the gradient has been written on the compute stream.
    pub event: Event,
}

/// What a backward-finished hook receives.
pub struct BackwardSummary {
    /// Ids of the leaves that received a gradient in this backward.
    pub reached: HashSet<TensorId>,
}

/// A gradient-ready hook.
pub type GradReadyHook = Arc<dyn Fn(&GradReady) -> Result<()> + Send + Sync>;

/// A backward-finished hook.
pub type BackwardFinishedHook = Arc<dyn Fn(&BackwardSummary) -> Result<()> + Send + Sync>;

/// Identifies one registration; a finished hook registered on many leaves shares one id and
/// runs once per backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HookId(pub u64);

static NEXT_HOOK: AtomicU64 = AtomicU64::new(1);

impl HookId {
    /// A fresh id.
    pub fn fresh() -> Self {
        HookId(NEXT_HOOK.fetch_add(1, Ordering::Relaxed))
    }
}

/// The hooks registered on one leaf.
#[derive(Default)]
pub struct LeafHooks {
    /// Run, in registration order, when the leaf's gradient is final.
    pub grad_ready: Vec<(HookId, GradReadyHook)>,
    /// Run once per backward that reaches this leaf, after the whole backward.
    pub backward_finished: Vec<(HookId, BackwardFinishedHook)>,
}

impl LeafHooks {
    /// Removes every hook registered under `id`.
    pub fn remove(&mut self, id: HookId) {
        self.grad_ready.retain(|(h, _)| *h != id);
        self.backward_finished.retain(|(h, _)| *h != id);
    }
}
