//! Parameters a backward did not reach, under `find_unused_parameters`.
//!
//! Every bucket must be reduced on every rank, so a parameter this rank's backward did not
//! reach still contributes to its bucket: its current gradient, or zero when it has none (a
//! parameter reached on some ranks but not others thereby gets the right average, as one
//! process on the full batch would compute it). But a parameter that *no* rank reached must
//! not change: one process would leave its `.grad` as it was — `None` stays `None`, so the
//! optimizer skips it, and weight decay or momentum do not move it — and so does PyTorch's
//! DDP. To know which parameters no rank reached, the ranks add up their per-parameter "used"
//! flags in one small all-reduce, issued after every bucket so all ranks issue the same
//! sequence of collectives; the gradients of the parameters nobody used are then put back
//! exactly as they were before the reduction.

use tandem_core::{Device, Tensor};

use super::bucket::Slot;
use crate::{CollectiveLabel, DistError, ProcessGroup, ReduceOp, Result, Work};

/// What this rank's backward left unreached, and their gradients from before the reduction.
pub(crate) struct UnreachedHere {
    /// Per parameter: whether this rank's backward reached it.
    used: Vec<bool>,
    /// Per unreached parameter: its index and its gradient before this step's reduction.
    previous: Vec<(usize, Previous)>,
}

/// A gradient as it was before the reduction touched it.
enum Previous {
    /// No gradient.
    None,
    /// The gradient was the bucket view; these are its values.
    View(Tensor),
    /// The gradient was a tensor of its own (set by the user), left untouched.
    Own(Tensor),
}

/// Whether `grad` is exactly the parameter's view into its bucket.
pub(crate) fn is_slot_view(grad: &Tensor, view: &Tensor) -> bool {
    grad.storage().same_buffer(view.storage()) && grad.layout() == view.layout()
}

impl UnreachedHere {
    /// Records which parameters this rank's backward reached (`ready`), saves the gradients of
    /// the others, and puts each other's contribution in its bucket slot: its current gradient,
    /// or zero when it has none. The caller then marks them ready.
    pub fn prepare(
        rank: usize,
        params: &[(String, Tensor)],
        slots: &[Slot],
        ready: &[bool],
    ) -> Result<Self> {
        let mut previous = Vec::new();
        for (i, (path, param)) in params.iter().enumerate() {
            if ready[i] {
                continue;
            }
            let err = |e| {
                DistError::tensor(
                    rank,
                    format!("keeping the gradient of unused parameter `{path}`"),
                    e,
                )
            };
            let view = &slots[i].view;
            let before = match param.grad() {
                None => {
                    view.zero_().map_err(err)?;
                    Previous::None
                }
                Some(g) if is_slot_view(&g, view) => {
                    Previous::View(g.copy_detached().map_err(err)?)
                }
                Some(g) => {
                    view.copy_(&g).map_err(err)?;
                    Previous::Own(g)
                }
            };
            param.set_grad(Some(view.clone())).map_err(err)?;
            previous.push((i, before));
        }
        Ok(UnreachedHere {
            used: ready.to_vec(),
            previous,
        })
    }

    /// Starts the all-reduce that counts, per parameter, the ranks whose backward reached it
    /// (on `device`, the parameters' device, which every backend reaches). Every rank calls
    /// this after launching its last bucket. A rank shadowing the others inside
    /// `DistributedDataParallel::join` (`shadow`) counts as using nothing: its backward of an
    /// empty batch reaches parameters without having data for them.
    pub fn count_users(
        &self,
        group: &dyn ProcessGroup,
        device: Device,
        shadow: bool,
    ) -> Result<(Tensor, Work)> {
        let rank = group.rank();
        let flags: Vec<f32> = self
            .used
            .iter()
            .map(|&u| (u && !shadow) as u8 as f32)
            .collect();
        let counts = Tensor::from_vec(flags, &[self.used.len()], device)
            .map_err(|e| DistError::tensor(rank, "counting the users of each parameter", e))?;
        let work = crate::with_collective_label(CollectiveLabel::UnusedParameterAgreement, || {
            group.all_reduce(&counts, ReduceOp::Sum)
        })?;
        Ok((counts, work))
    }

    /// Once the buckets are reduced and `counts` (from [`UnreachedHere::count_users`]) is
    /// complete on the compute stream: gives every parameter that no rank reached its gradient
    /// back, bit for bit. Reads the counts on the host.
    pub fn restore_unused_everywhere(
        self,
        rank: usize,
        counts: &Tensor,
        params: &[(String, Tensor)],
        slots: &[Slot],
    ) -> Result<()> {
        let counts = counts
            .to_vec::<f32>()
            .map_err(|e| DistError::tensor(rank, "reading the users of each parameter", e))?;
        for (i, before) in self.previous {
            if counts[i] != 0.0 {
                continue;
            }
            let param = &params[i].1;
            match before {
                Previous::None => param.set_grad(None),
                Previous::View(values) => slots[i].view.copy_(&values),
                Previous::Own(grad) => param.set_grad(Some(grad)),
            }
            .map_err(|e| {
                DistError::tensor(
                    rank,
                    format!(
                        "restoring the gradient of unused parameter `{}`",
                        params[i].0
                    ),
                    e,
                )
            })?;
        }
        Ok(())
    }
}
