//! Uneven inputs: [`DistributedDataParallel::join`] lets ranks with fewer batches finish early
//! without hanging the others.
//!
//! Every collective of DDP (and of [`SyncBatchNorm`](crate::SyncBatchNorm)) needs every rank. A
//! rank whose data runs out stops issuing them, so without `join` the ranks still training wait
//! for it until the group's timeout (an error naming the rank, not a hang). Inside `join`:
//!
//! ```text
//! active rank, each forward:   all-reduce [active flags | sync | need shape] ─► forward, backward
//! joined rank, until all done: all-reduce [0 …]  ─► shadow step: forward + backward of an
//!                                                    EMPTY batch (0 samples) through DDP
//! every rank, at the end:      broadcast parameters and buffers from the last active rank
//! ```
//!
//! **How a joined rank shadows.** It runs the *same code* as the active ranks — DDP's forward,
//! the wrapped module's forward, backward — on a batch of zero samples shaped like the active
//! ranks' inputs (`[0, d1, d2, …]`, the dims after the batch dim and the dtype of this rank's last
//! input, or of the first active rank's when this rank has none). So it issues exactly the
//! collectives they issue, in the same order, without recording or replaying anything: the
//! step's flag all-reduce, the bucket-order broadcast after the first step, the buffer broadcast,
//! each SyncBatchNorm layer's statistics all-reduce in forward and its gradient-sums all-reduce in
//! backward (interleaved with the bucket all-reduces exactly as on the active ranks, since the
//! graph is the same), the bucket all-reduces and the unused-parameter count. Its contributions
//! are zero: its gradients are cleared before each shadow backward and the empty batch adds
//! nothing to them, and SyncBatchNorm contributes a zero count (see `sync_batch_norm.rs`), so the
//! active ranks' statistics are exactly those of their own samples. Requirements: the wrapped
//! module must accept a batch of zero samples along dim 0, and take the same path for it (no
//! data-dependent control flow between ranks); every `ddp.forward` inside `join` must be a
//! training step, followed by one backward (evaluate through `ddp.module()` under `no_grad`).
//! Steps inside [`no_sync`](DistributedDataParallel::no_sync) are shadowed without
//! synchronising, as the active ranks do.
//!
//! **The divisor.** By default ([`JoinDivisor::InitialWorldSize`], PyTorch's
//! `divide_by_initial_world_size=True`) gradients are still divided by the world size N when
//! only k < N ranks are active: each step's gradient is the sum over the active ranks' samples
//! divided by N, i.e. k/N of the average over the active ranks — as if the missing ranks had
//! contributed zero gradients. With a learning rate tuned for N full ranks this shrinks the last
//! steps' updates by k/N. [`JoinDivisor::ActiveRanks`] divides by k instead: each step is the
//! mean over the ranks that still have data, so the update keeps its size (the learning rate
//! stays right per step, but the last samples weigh more than their share of the epoch).
//! Under [`GradReduction::Sum`](crate::GradReduction::Sum) nothing is divided.
//!
//! **At the end** every rank has finished; parameters and buffers are broadcast from the lowest
//! rank that was active in the last step (the joined ranks did not run the optimizer while
//! shadowing, so their parameters are stale; their optimizer state, e.g. momentum, stays so).

use std::sync::atomic::Ordering;

use tandem_core::{DType, Tensor};

use crate::coalesce::CoalescedBroadcast;
use crate::{DistError, DistributedDataParallel, ReduceOp, Result};

/// What the gradients are divided by while some ranks have joined (under
/// [`GradReduction::Mean`](crate::GradReduction::Mean)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JoinDivisor {
    /// The world size, also when fewer ranks are active (PyTorch's default): joined ranks count
    /// as zero gradients, so the last steps' updates shrink by active/world.
    #[default]
    InitialWorldSize,
    /// The number of ranks active in the step: the mean over the ranks that still have data.
    ActiveRanks,
}

/// Settings of [`DistributedDataParallel::join`]; every rank must use the same.
#[derive(Clone, Copy, Debug, Default)]
pub struct JoinConfig {
    /// What gradients are divided by. Default: [`JoinDivisor::InitialWorldSize`].
    pub divisor: JoinDivisor,
}

/// The join context of one rank, while `join` runs.
pub(crate) struct JoinSession {
    config: JoinConfig,
    /// The dims after the batch dim and the dtype of the inputs, once known.
    input: Option<(Vec<usize>, DType)>,
    /// The lowest rank active in the last step that had an active rank (the final sync's root).
    last_root: usize,
}

/// What every rank learned from a step's flag all-reduce.
struct StepPlan {
    /// The lowest active rank: buffers and the input shape come from it.
    root: usize,
    /// Whether the active ranks synchronise this step (false inside `no_sync`).
    sync: bool,
}

/// Most input dims the shape broadcast carries.
const MAX_INPUT_DIMS: usize = 8;
/// Dtypes by code, for the shape broadcast.
const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];

impl DistributedDataParallel {
    /// Runs `f` (this rank's training loop) so that ranks with different numbers of batches all
    /// finish: when `f` returns, this rank shadows the collectives of the ranks still training
    /// (with zero contributions) until every rank's `f` has returned, then every rank takes the
    /// parameters and buffers of the last active rank. Every rank must call `join` (with the same
    /// `config`) around its loop. See the [module docs](crate::join) for the divisor, the
    /// requirements on the model, and what is shadowed.
    ///
    /// Returns `f`'s value, or the first error of a shadow step or the final broadcast.
    pub fn join<R>(&self, config: JoinConfig, f: impl FnOnce() -> R) -> Result<R> {
        let rank = self.group.rank();
        {
            let mut session = self.join.lock();
            if session.is_some() {
                return Err(DistError::config(
                    rank,
                    "DistributedDataParallel::join: already inside a join",
                ));
            }
            *session = Some(JoinSession {
                config,
                input: None,
                last_root: 0,
            });
        }
        // Ends the session even when `f` panics.
        struct Reset<'a>(&'a DistributedDataParallel);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                *self.0.join.lock() = None;
                self.0.reducer.divisor.store(0, Ordering::Relaxed);
            }
        }
        let _reset = Reset(self);
        let out = f();
        self.shadow_until_all_joined()?;
        self.sync_final_model()?;
        Ok(out)
    }

    /// The buffers' broadcast root for a forward of `x`: inside `join`, the step's flag
    /// all-reduce runs first and the root is the lowest active rank; otherwise rank 0.
    pub(crate) fn join_notify(&self, x: &Tensor) -> Result<usize> {
        if self.join.lock().is_none() {
            return Ok(0);
        }
        match self.agree_step(Some(x))? {
            Some(plan) => Ok(plan.root),
            None => Err(DistError::internal(
                format!("rank {}: DistributedDataParallel::join", self.group.rank()),
                "no rank counted as active in a step this rank is active in",
            )),
        }
    }

    /// The step's flag all-reduce. `input` is this rank's input when it is active, `None` when
    /// it has joined. Returns `None` when no rank is active any more.
    fn agree_step(&self, input: Option<&Tensor>) -> Result<Option<StepPlan>> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let mut flags = vec![0f64; world + 2];
        {
            let mut guard = self.join.lock();
            let session = guard.as_mut().ok_or_else(|| not_in_join(rank))?;
            if let Some(x) = input {
                flags[rank] = 1.0;
                flags[world] = f64::from(u8::from(self.reducer.is_sync()));
                session.input = Some((x.dims().get(1..).unwrap_or(&[]).to_vec(), x.dtype()));
            } else if session.input.is_none() {
                flags[world + 1] = 1.0;
            }
        }
        let err = |e| DistError::tensor(rank, "join: agreeing on the active ranks", e);
        let device = self.group.comm_stream().device();
        let t = Tensor::from_vec(flags, &[world + 2], device).map_err(err)?;
        self.group.all_reduce(&t, ReduceOp::Sum)?.wait()?;
        let flags = t.to_vec::<f64>().map_err(err)?;
        let active: Vec<usize> = (0..world).filter(|&r| flags[r] > 0.5).collect();
        let Some(&root) = active.first() else {
            return Ok(None);
        };
        if flags[world + 1] > 0.5 {
            self.share_input_shape(root)?;
        }
        let mut guard = self.join.lock();
        let session = guard.as_mut().ok_or_else(|| not_in_join(rank))?;
        session.last_root = root;
        let divisor = match session.config.divisor {
            JoinDivisor::InitialWorldSize => 0,
            JoinDivisor::ActiveRanks => active.len(),
        };
        self.reducer.divisor.store(divisor, Ordering::Relaxed);
        Ok(Some(StepPlan {
            root,
            sync: flags[world] > 0.5,
        }))
    }

    /// Broadcasts the input's dims (after the batch dim) and dtype from `root`, for joined ranks
    /// that never saw an input (a rank with no batches at all).
    fn share_input_shape(&self, root: usize) -> Result<()> {
        let rank = self.group.rank();
        let mut desc = vec![0i64; 2 + MAX_INPUT_DIMS];
        let mut guard = self.join.lock();
        let session = guard.as_mut().ok_or_else(|| not_in_join(rank))?;
        if rank == root {
            if let Some((dims, dtype)) = &session.input {
                desc[0] = dims.len() as i64;
                desc[1] = DTYPES.iter().position(|d| d == dtype).unwrap_or(0) as i64;
                for (slot, &d) in desc[2..].iter_mut().zip(dims) {
                    *slot = d as i64;
                }
            }
        }
        drop(guard);
        let err = |e| DistError::tensor(rank, "join: sharing the input's shape", e);
        let device = self.group.comm_stream().device();
        let t = Tensor::from_vec(desc, &[2 + MAX_INPUT_DIMS], device).map_err(err)?;
        self.group.broadcast(&t, root)?.wait()?;
        let desc = t.to_vec::<i64>().map_err(err)?;
        let ndim = usize::try_from(desc[0]).unwrap_or(usize::MAX);
        if ndim > MAX_INPUT_DIMS {
            return Err(DistError::config(
                rank,
                format!(
                    "DistributedDataParallel::join: rank {root}'s input has {} dims after the \
                     batch dim; a rank without batches can shadow at most {MAX_INPUT_DIMS}",
                    desc[0]
                ),
            ));
        }
        let dims = desc[2..2 + ndim]
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(0))
            .collect();
        let dtype = usize::try_from(desc[1])
            .ok()
            .and_then(|c| DTYPES.get(c).copied())
            .unwrap_or(DType::F32);
        let mut guard = self.join.lock();
        let session = guard.as_mut().ok_or_else(|| not_in_join(rank))?;
        if session.input.is_none() {
            session.input = Some((dims, dtype));
        }
        Ok(())
    }

    /// A joined rank's loop: one shadow step per step of the active ranks, until none is left.
    fn shadow_until_all_joined(&self) -> Result<()> {
        let rank = self.group.rank();
        while let Some(plan) = self.agree_step(None)? {
            let (dims, dtype) = self
                .join
                .lock()
                .as_ref()
                .and_then(|s| s.input.clone())
                .ok_or_else(|| {
                    DistError::internal(
                        format!("rank {rank}: DistributedDataParallel::join"),
                        "no input shape to shadow with",
                    )
                })?;
            let step = || self.shadow_step(&dims, dtype, plan.root);
            self.reducer.shadowing.store(true, Ordering::Relaxed);
            let shadowed = if plan.sync {
                step()
            } else {
                self.no_sync(step)
            };
            self.reducer.shadowing.store(false, Ordering::Relaxed);
            shadowed?;
        }
        Ok(())
    }

    /// Forward and backward of an empty batch through DDP, contributing zero gradients.
    fn shadow_step(&self, dims: &[usize], dtype: DType, root: usize) -> Result<()> {
        let rank = self.group.rank();
        let err = |e| DistError::tensor(rank, "join: the shadow step of a joined rank", e);
        // The slots must hold zeros, not this rank's last gradients: with no gradient, autograd
        // hands over a fresh (zero) one that the reducer copies into the slot.
        for (_, p) in self.module.named_parameters() {
            p.set_grad(None).map_err(err)?;
        }
        let mut shape = vec![0usize];
        shape.extend_from_slice(dims);
        let device = self.group.comm_stream().device();
        let x = Tensor::zeros(&shape, dtype, device).map_err(err)?;
        let y = self.forward_from(&x, root)?;
        if y.requires_grad() {
            let seed = y.zeros_like().map_err(err)?;
            tandem_autograd::backward(&y, Some(&seed), &Default::default()).map_err(err)?;
        }
        Ok(())
    }

    /// Every rank takes the parameters and buffers of the lowest rank active in the last step.
    fn sync_final_model(&self) -> Result<()> {
        let rank = self.group.rank();
        if self.group.world_size() == 1 {
            return Ok(());
        }
        let root = self.join.lock().as_ref().map_or(0, |s| s.last_root);
        let everything: Vec<Tensor> = self
            .module
            .named_parameters()
            .into_iter()
            .chain(self.module.named_buffers())
            .map(|(_, t)| t)
            .collect();
        CoalescedBroadcast::new(rank, &everything)?.broadcast(self.group.as_ref(), root)
    }
}

fn not_in_join(rank: usize) -> DistError {
    DistError::internal(
        format!("rank {rank}: DistributedDataParallel::join"),
        "the join session ended while in use",
    )
}
