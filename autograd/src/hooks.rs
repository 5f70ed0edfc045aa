//! Registering the two hooks that are the whole contract between autograd and `dist`.
//!
//! * A **gradient-ready** hook on a leaf runs exactly once per backward pass that reaches it,
//!   the moment the leaf's gradient is final — after every contribution (a parameter used
//!   twice in forward included) has been accumulated into `.grad`. It receives the leaf, the
//!   gradient and an event on the compute stream. Hooks on different leaves run in the order
//!   their gradients become final: reverse layer order for a feed-forward network.
//! * A **backward-finished** hook runs once, after the whole backward, for every backward that
//!   reaches at least one of the leaves it was registered on.
//!
//! Hooks run on the thread that called backward. An error returned by a hook stops the
//! backward and is returned from it.

use std::sync::Arc;

use tandem_core::graph::{BackwardFinishedHook, BackwardSummary, GradReadyHook, HookId};
use tandem_core::{Error, GradReady, Result, Tensor};

/// A registration; [`HookHandle::remove`] takes the hook off every leaf it was put on.
#[derive(Clone)]
pub struct HookHandle {
    id: HookId,
    leaves: Vec<Tensor>,
}

impl HookHandle {
    /// This registration's id.
    pub fn id(&self) -> HookId {
        self.id
    }

    /// Unregisters the hook.
    pub fn remove(self) {
        for leaf in &self.leaves {
            leaf.hooks().lock().remove(self.id);
        }
    }
}

fn check_leaf(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.is_leaf() || !t.requires_grad() {
        return Err(Error::invalid(
            op,
            format!("hooks go on leaf tensors that require grad (parameters); got {t:?}"),
        ));
    }
    Ok(())
}

/// Runs `hook` each time `param`'s gradient becomes final in a backward pass.
pub fn register_grad_ready_hook(
    param: &Tensor,
    hook: impl Fn(&GradReady) -> Result<()> + Send + Sync + 'static,
) -> Result<HookHandle> {
    check_leaf("register_grad_ready_hook", param)?;
    let id = HookId::fresh();
    let hook: GradReadyHook = Arc::new(hook);
    param.hooks().lock().grad_ready.push((id, hook));
    Ok(HookHandle {
        id,
        leaves: vec![param.clone()],
    })
}

/// Runs `hook` once after each backward pass that reached any of `params`.
pub fn register_backward_finished_hook(
    params: &[Tensor],
    hook: impl Fn(&BackwardSummary) -> Result<()> + Send + Sync + 'static,
) -> Result<HookHandle> {
    for p in params {
        check_leaf("register_backward_finished_hook", p)?;
    }
    let id = HookId::fresh();
    let hook: BackwardFinishedHook = Arc::new(hook);
    for p in params {
        p.hooks().lock().backward_finished.push((id, hook.clone()));
    }
    Ok(HookHandle {
        id,
        leaves: params.to_vec(),
    })
}
