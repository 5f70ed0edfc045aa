//! The backward engine.
//!
//! `backward` walks the graph from the output, counts for every node and leaf how many
//! gradient contributions it will receive, and then runs nodes as soon as all of theirs have
//! arrived. Among ready nodes the most recently recorded runs first, which gives reverse
//! topological order — reverse layer order for a feed-forward network — so the last layer's
//! parameters become ready first. A node's incoming gradient is dropped once the node has run,
//! so intermediate gradients live only as long as needed.
//!
//! When the last contribution to a leaf has arrived it is accumulated into the leaf's `.grad`
//! and the leaf's gradient-ready hooks run; after the walk, each backward-finished hook of the
//! reached leaves runs once. The event a gradient-ready hook receives is recorded only for a
//! leaf that has such a hook, into an event object the stream module reuses across backwards
//! ([`tandem_core::stream::events_created`] counts new ones).

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use tandem_core::graph::{BackwardSummary, HookId};
use tandem_core::profile::{self, Phase};
use tandem_core::{
    DType, Device, Edge, Error, GradReady, MemoryFormat, Node, Result, Stream, Tensor, TensorId,
};

use crate::grad_mode::NoGradGuard;

/// Options of a backward pass.
#[derive(Clone, Debug, Default)]
pub struct BackwardOptions {
    /// Keep the saved tensors so that backward can run through the graph again.
    pub retain_graph: bool,
}

/// Adds `new` to an optional running sum, reusing the sum's buffer when nothing else holds it.
fn accumulate(sum: Option<Tensor>, new: Tensor) -> Result<Tensor> {
    match sum {
        None => Ok(new),
        // Half-precision contributions (several uses of an autocast copy) are summed in f32
        // and rounded once: on the CPU by the in-place half sum below (each element widened,
        // added and rounded), elsewhere through f32 copies.
        Some(s) if matches!(s.dtype(), DType::F16 | DType::BF16) && s.device() != Device::Cpu => {
            let total = s.to_dtype(DType::F32)?;
            total.add_(&new.to_dtype(DType::F32)?)?;
            total.to_dtype(s.dtype())
        }
        Some(s) => {
            // Any dense layout may be summed into (channels-last contributions stay so).
            let s = if s.is_exclusive() && s.dense_format().is_some() {
                s
            } else {
                // A copy in the sum's own dense format (row-major when it has none), so that
                // adding a contribution of the same format walks both in storage order.
                let format = s.dense_format().unwrap_or(MemoryFormat::Contiguous);
                let owned = Tensor::empty_in(s.dims(), s.dtype(), s.device(), format)?;
                owned.copy_(&s)?;
                owned
            };
            s.add_(&new)?;
            Ok(s)
        }
    }
}

struct HeapEntry(Arc<Node>);

impl PartialEq for HeapEntry {
    fn eq(&self, other: &Self) -> bool {
        self.0.sequence() == other.0.sequence()
    }
}
impl Eq for HeapEntry {}
impl PartialOrd for HeapEntry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeapEntry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.sequence().cmp(&other.0.sequence())
    }
}

struct LeafState {
    leaf: Tensor,
    remaining: usize,
    pending: Option<Tensor>,
}

fn node_key(node: &Arc<Node>) -> *const Node {
    Arc::as_ptr(node)
}

/// Computes the gradient of `root` with respect to every leaf that requires grad, accumulating
/// into their `.grad`. `grad` defaults to 1 for a one-element `root`.
pub fn backward(root: &Tensor, grad: Option<&Tensor>, options: &BackwardOptions) -> Result<()> {
    if !root.requires_grad() {
        return Err(Error::autograd(
            "backward on a tensor that does not require grad: no parameter it was computed from \
             requires grad (or it was computed under no_grad)",
        ));
    }
    let seed = match grad {
        Some(g) => {
            if g.dims() != root.dims() || g.dtype() != root.dtype() {
                return Err(Error::shape(
                    "backward",
                    format!(
                        "gradient {:?} {} does not match output {:?} {}",
                        g.dims(),
                        g.dtype(),
                        root.dims(),
                        root.dtype()
                    ),
                ));
            }
            g.detach()
        }
        None => {
            if root.numel() != 1 {
                return Err(Error::shape(
                    "backward",
                    format!(
                        "a gradient can only be implied for a one-element output, not {:?}; pass one",
                        root.dims()
                    ),
                ));
            }
            root.ones_like()?
        }
    };
    let _no_grad = NoGradGuard::new();
    // Gradients follow the dtypes the forward chose; this pass frees the graph the autocast
    // weight cache's copies belong to.
    let _no_autocast = crate::autocast::AutocastGuard::disabled();
    crate::autocast::clear_weight_cache();
    let compute = Stream::compute(root.device())?;

    // Count the contributions every node and leaf will receive.
    let root_edge = match root.grad_fn() {
        Some(n) => Edge::Node(n.clone()),
        None => Edge::Leaf(root.clone()),
    };
    let mut walk = Walk::default();
    walk.count(&root_edge);
    let mut stack = vec![root_edge.clone()];
    let mut visited: HashSet<*const Node> = HashSet::new();
    while let Some(edge) = stack.pop() {
        if let Edge::Node(node) = edge {
            if !visited.insert(node_key(&node)) {
                continue;
            }
            for input in node.inputs().iter().flatten() {
                walk.count(input);
                if let Edge::Node(_) = input {
                    stack.push(input.clone());
                }
            }
        }
    }

    walk.deliver(&root_edge, Some(seed), &compute)?;
    while let Some(HeapEntry(node)) = walk.ready.pop() {
        let grad_out = walk.take_pending(&node);
        let grads = match &grad_out {
            Some(g) => {
                let _profile = profile::scope(node.name(), Phase::Backward);
                node.run_backward(g, options.retain_graph)?
            }
            None => vec![None; node.inputs().len()],
        };
        drop(grad_out);
        // An input that needs no gradient has no edge; a gradient computed for it is dropped.
        for (input, grad) in node.inputs().iter().zip(grads) {
            if let Some(edge) = input {
                walk.deliver(edge, grad, &compute)?;
            }
        }
    }

    // Each backward-finished hook once, in registration order.
    let mut finished: BTreeMap<HookId, tandem_core::graph::BackwardFinishedHook> = BTreeMap::new();
    for state in walk.leaves.values() {
        for (id, hook) in &state.leaf.hooks().lock().backward_finished {
            finished.entry(*id).or_insert_with(|| hook.clone());
        }
    }
    let summary = BackwardSummary {
        reached: walk.reached,
    };
    for hook in finished.values() {
        hook(&summary)?;
    }
    Ok(())
}

/// The state of one backward walk: what every node and leaf still waits for, the gradients
/// gathered for them so far, and the nodes ready to run.
#[derive(Default)]
struct Walk {
    nodes: HashMap<*const Node, NodeState>,
    leaves: BTreeMap<TensorId, LeafState>,
    ready: BinaryHeap<HeapEntry>,
    reached: HashSet<TensorId>,
}

#[derive(Default)]
struct NodeState {
    remaining: usize,
    pending: Option<Tensor>,
}

impl Walk {
    /// Counts one future contribution through `edge`.
    fn count(&mut self, edge: &Edge) {
        match edge {
            Edge::Node(n) => self.nodes.entry(node_key(n)).or_default().remaining += 1,
            Edge::Leaf(t) => {
                self.leaves
                    .entry(t.id())
                    .or_insert_with(|| LeafState {
                        leaf: t.clone(),
                        remaining: 0,
                        pending: None,
                    })
                    .remaining += 1
            }
        }
    }

    /// The gradient gathered for `node` (released from the walk).
    fn take_pending(&mut self, node: &Arc<Node>) -> Option<Tensor> {
        self.nodes
            .get_mut(&node_key(node))
            .and_then(|state| state.pending.take())
    }

    /// Delivers one contribution (`None`: nothing flows, but the contribution is accounted
    /// for) through `edge`; a node whose last contribution arrived becomes ready, a leaf whose
    /// last one arrived is finalised.
    fn deliver(&mut self, edge: &Edge, grad: Option<Tensor>, compute: &Stream) -> Result<()> {
        match edge {
            Edge::Node(node) => {
                let state = self
                    .nodes
                    .get_mut(&node_key(node))
                    .expect("counted during discovery");
                if let Some(g) = grad {
                    state.pending = Some(accumulate(state.pending.take(), g)?);
                }
                state.remaining -= 1;
                if state.remaining == 0 {
                    self.ready.push(HeapEntry(node.clone()));
                }
            }
            Edge::Leaf(leaf) => {
                let state = self
                    .leaves
                    .get_mut(&leaf.id())
                    .expect("counted during discovery");
                if let Some(g) = grad {
                    if g.dims() != leaf.dims() {
                        return Err(Error::autograd(format!(
                            "gradient of shape {:?} delivered to a leaf of shape {:?}",
                            g.dims(),
                            leaf.dims()
                        )));
                    }
                    state.pending = Some(accumulate(state.pending.take(), g)?);
                }
                state.remaining -= 1;
                if state.remaining == 0 {
                    if let Some(g) = state.pending.take() {
                        finalize_leaf(&state.leaf, g, compute)?;
                        self.reached.insert(leaf.id());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Accumulates the leaf's gradient for this pass into `.grad` and runs its ready hooks.
fn finalize_leaf(leaf: &Tensor, grad: Tensor, compute: &Stream) -> Result<()> {
    let grad = if grad.dtype() != leaf.dtype() {
        grad.to_dtype(leaf.dtype())?
    } else {
        grad
    };
    let total = match leaf.grad() {
        // Accumulate in place: the existing gradient may be a view into a communication
        // bucket, which must keep receiving the values.
        Some(existing) => {
            existing.add_(&grad)?;
            existing
        }
        None => {
            let owned = owned_like(leaf, grad)?;
            leaf.set_grad(Some(owned.clone()))?;
            owned
        }
    };
    let hooks: Vec<_> = leaf
        .hooks()
        .lock()
        .grad_ready
        .iter()
        .map(|(_, h)| h.clone())
        .collect();
    if hooks.is_empty() {
        // Nobody asks for the event: recording one per parameter per backward costs host time
        // (a CUDA event each) for nothing.
        return Ok(());
    }
    // The stream's event objects are pooled: a backward reuses those of the last one once its
    // hooks have let go of them.
    let event = compute.record_event()?;
    let ready = GradReady {
        param: leaf.clone(),
        grad: total,
        event,
    };
    for hook in hooks {
        hook(&ready)?;
    }
    Ok(())
}

/// The first gradient of `leaf` in a buffer of its own, laid out in the leaf's memory format
/// (PyTorch's gradient layout contract: a channels-last parameter gets a channels-last
/// gradient, so that storage-order consumers pair elements up): `grad` itself when it already
/// is, otherwise a copy. The incoming tensor may share storage with a tensor of the graph.
fn owned_like(leaf: &Tensor, grad: Tensor) -> Result<Tensor> {
    let format = leaf.dense_format().unwrap_or(MemoryFormat::Contiguous);
    if grad.is_exclusive() && grad.layout().offset() == 0 && grad.dense_format() == Some(format) {
        return Ok(grad);
    }
    let owned = Tensor::empty_in(grad.dims(), grad.dtype(), grad.device(), format)?;
    owned.copy_(&grad)?;
    Ok(owned)
}

/// `tensor.backward()` and friends.
pub trait TensorBackward {
    /// Backward from a one-element output, freeing the graph afterwards.
    fn backward(&self) -> Result<()>;
    /// Backward with an explicit output gradient and options.
    fn backward_with(&self, grad: Option<&Tensor>, options: &BackwardOptions) -> Result<()>;
}

impl TensorBackward for Tensor {
    fn backward(&self) -> Result<()> {
        backward(self, None, &BackwardOptions::default())
    }

    fn backward_with(&self, grad: Option<&Tensor>, options: &BackwardOptions) -> Result<()> {
        backward(self, grad, options)
    }
}
