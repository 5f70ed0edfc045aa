//! How an op puts its output into the graph.
//!
//! An op computes its output without autograd, then calls [`record`] with its inputs and a
//! constructor for its backward. The backward (and the tensors it saves) is only built when
//! some input requires grad and recording is on, so inference pays nothing.

use tandem_core::{BackwardOp, Edge, Node, Result, Tensor};

use crate::grad_mode::is_grad_enabled;

/// Whether an op over `inputs` must record a node.
pub fn needs_grad(inputs: &[&Tensor]) -> bool {
    is_grad_enabled() && inputs.iter().any(|t| t.requires_grad())
}

/// The edge through which a gradient reaches `input`, if it needs one.
pub fn edge_to(input: &Tensor) -> Option<Edge> {
    if !input.requires_grad() {
        None
    } else if let Some(node) = input.grad_fn() {
        Some(Edge::Node(node.clone()))
    } else {
        Some(Edge::Leaf(input.clone()))
    }
}

/// Returns `output` as the result of an op over `inputs`, recording a node whose backward is
/// built by `make_backward` when any input requires grad.
pub fn record<B: BackwardOp + 'static>(
    output: Tensor,
    inputs: &[&Tensor],
    make_backward: impl FnOnce() -> B,
) -> Tensor {
    if !needs_grad(inputs) {
        return output;
    }
    let edges = inputs.iter().map(|t| edge_to(t)).collect();
    output.with_grad_fn(Node::new(Box::new(make_backward()), edges))
}

/// A backward written as a closure over what it saved.
pub struct FnBackward<F> {
    name: &'static str,
    f: F,
}

impl<F> FnBackward<F>
where
    F: Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    /// A backward named `name` that computes input gradients with `f`.
    pub fn new(name: &'static str, f: F) -> Self {
        FnBackward { name, f }
    }
}

impl<F> BackwardOp for FnBackward<F>
where
    F: Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Tensor>>> {
        (self.f)(grad_output)
    }
}

/// Records an op whose backward is the closure `f`.
pub fn record_fn<F>(
    output: Tensor,
    inputs: &[&Tensor],
    name: &'static str,
    f: impl FnOnce() -> F,
) -> Tensor
where
    F: Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    record(output, inputs, || FnBackward::new(name, f()))
}
