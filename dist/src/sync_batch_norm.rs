//! `SyncBatchNorm`: batch normalisation whose statistics cover the global batch.
//!
//! Under DDP, plain BatchNorm normalises each rank's B/N samples with that rank's own
//! statistics. SyncBatchNorm runs batch norm's phases (`tandem_ops::batch_norm::phases`) with
//! an all-reduce between them: in forward, each rank's statistics (as additive sums: count,
//! Σx, Σx²) are all-reduced so every rank normalises with the statistics of all B samples; in
//! backward, the per-channel sums Σg and Σg·(x − mean) are all-reduced so the input gradient is
//! the full-batch one. It has no batch-norm arithmetic of its own, runs where the input is
//! (the CPU too, which PyTorch's refuses), and fuses the ReLU and the residual join of a
//! ResNet block as `BatchNorm2d` does. The weight and bias gradients stay local sums; DDP
//! averages them like any other gradient. [`convert_sync_batch_norm`] swaps a model's
//! `BatchNorm2d` layers for it, sharing their parameters and buffers.

use std::sync::Arc;

use tandem_autograd::record_fn;
use tandem_core::{DType, Tensor};
use tandem_nn::BatchNorm2d;
use tandem_nn::{Forward, Fused, Module};
use tandem_ops::batch_norm::phases::{
    self, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, GradMask, GradSums, NormalizationArgs,
    RunningUpdate, Statistics,
};
use tandem_ops::batch_norm::{BatchNormArgs, Epilogue};

use crate::{CollectiveLabel, ProcessGroup, ReduceOp};

/// Batch normalisation with statistics all-reduced over a process group. It wraps a
/// [`BatchNorm2d`], whose parameters, buffers, settings and train/eval flag it uses as they are.
#[derive(Module)]
#[module(fused)]
pub struct SyncBatchNorm {
    #[module(delegate)]
    bn: Arc<BatchNorm2d>,
    group: Arc<dyn ProcessGroup>,
}

impl SyncBatchNorm {
    /// A SyncBatchNorm over `group` sharing everything of `bn`.
    pub fn new(bn: Arc<BatchNorm2d>, group: Arc<dyn ProcessGroup>) -> Self {
        SyncBatchNorm { bn, group }
    }

    fn input_error(&self, msg: String) -> tandem_nn::Error {
        tandem_nn::Error::input("SyncBatchNorm", msg)
    }

    /// The forward with `epilogue` fused onto the output.
    fn run(&self, x: &Tensor, epilogue: Epilogue<'_>) -> tandem_nn::Result<Tensor> {
        if x.dtype().is_half() {
            // Mixed precision: statistics, their all-reduce and the gradients in f32 (the
            // parameters and running statistics are f32), the output in x's dtype.
            let residual = match epilogue {
                Epilogue::AddRelu(r) => Some(tandem_ops::low_precision::widen(r)?),
                _ => None,
            };
            return tandem_ops::low_precision::via_f32(x.dtype(), &[x], |w| {
                let epilogue = match &residual {
                    Some(r) => Epilogue::AddRelu(r),
                    None => epilogue,
                };
                self.run(&w[0], epilogue)
            });
        }
        let bn = &self.bn;
        if x.rank() < 2 || x.dims()[1] != bn.num_features() {
            return Err(self.input_error(format!(
                "expected input [N, {}, …], got shape {:?}",
                bn.num_features(),
                x.dims()
            )));
        }
        let config = bn.config();
        if !self.is_training() && config.track_running_stats {
            // Evaluation uses the running statistics: nothing to synchronise.
            let args = BatchNormArgs {
                running_mean: bn.running_mean(),
                running_var: bn.running_var(),
                weight: bn.weight(),
                bias: bn.bias(),
                training: false,
                momentum: config.momentum,
                eps: config.eps,
            };
            return Ok(tandem_ops::batch_norm::batch_norm_fused(
                x, epilogue, &args,
            )?);
        }
        // Contiguous once: every phase, forward and backward, reads the input.
        let xc = x.contiguous_detached()?;
        let stats = self.global_statistics(x, &xc)?;
        let norm = phases::normalization(&NormalizationArgs {
            mean: &stats.mean,
            var: &stats.var,
            weight: bn.weight(),
            bias: bn.bias(),
            eps: config.eps,
        })?;
        // A batch of no samples (a joined rank's shadow step) has nothing to normalise; the
        // device kernels are not asked to handle it.
        let out = if xc.numel() == 0 {
            Tensor::zeros(xc.dims(), xc.dtype(), xc.device())?
        } else {
            phases::apply(&ApplyArgs {
                x: &xc,
                norm: &norm,
                epilogue,
            })?
        };
        self.record_backward(x, out, xc, norm, stats.count, epilogue)
    }

    /// The statistics of the group's whole batch: this rank's sums (count, Σx, Σx²) of `xc`
    /// (the contiguous `x`) all-reduced; updates the running statistics with them.
    fn global_statistics(&self, x: &Tensor, xc: &Tensor) -> tandem_nn::Result<Statistics> {
        let bn = &self.bn;
        let statistics_error = |e: tandem_core::Error| {
            self.input_error(format!(
                "batch statistics over the group failed for input {:?}: {e}",
                x.dims()
            ))
        };
        if xc.numel() == 0 {
            // A batch of no samples (a rank that has joined, shadowing the others inside
            // `DistributedDataParallel::join`) contributes a zero count and zero sums, so the
            // group's statistics are exactly those of the other ranks' samples. The local
            // statistics of no samples would be 0/0.
            let sums = Tensor::zeros(&[1 + 2 * bn.num_features()], DType::F64, x.device())?;
            return self.reduce_statistics(x, sums);
        }
        let local = phases::statistics(xc)?;
        // The group's count is the sum of the ranks' counts. The host knows only its own: on
        // one process that is the group's, checked here at once; otherwise `from_sums` checks
        // the reduced count — on the CPU as it reads it, on a GPU on the device (reported at
        // the next host read), because reading it would block the host on the all-reduce in
        // every layer of every forward. PyTorch likewise checks only the local size, and only
        // for a group of one.
        if let (1, Some(count)) = (self.group.world_size(), local.count.on_host()) {
            phases::check_count(count as f64).map_err(statistics_error)?;
        }
        let sums = local.to_sums()?;
        self.reduce_statistics(x, sums)
    }

    /// All-reduces this rank's statistics `sums` (`[count, Σx…, Σx²…]`) of input `x` and updates
    /// the running statistics with the group's.
    fn reduce_statistics(&self, x: &Tensor, sums: Tensor) -> tandem_nn::Result<Statistics> {
        let bn = &self.bn;
        let statistics_error = |e: tandem_core::Error| {
            self.input_error(format!(
                "batch statistics over the group failed for input {:?}: {e}",
                x.dims()
            ))
        };
        crate::with_collective_label(CollectiveLabel::SyncBatchNormStatistics, || {
            self.group.all_reduce(&sums, ReduceOp::Sum)
        })
        .and_then(|w| w.wait())
        .map_err(|e| core_err("forward statistics", e))?;
        // On a GPU the count stays on the device: nothing here waits for the all-reduce.
        let stats = Statistics::from_sums(&sums).map_err(statistics_error)?;
        if let (Some(running_mean), Some(running_var)) = (bn.running_mean(), bn.running_var()) {
            phases::update_running(&RunningUpdate {
                running_mean: Some(running_mean),
                running_var: Some(running_var),
                stats: &stats,
                momentum: bn.config().momentum,
            })?;
            bn.count_training_batch()?;
        }
        Ok(stats)
    }

    /// Records the backward of `out` (the forward of `x`, contiguous as `xc`, normalised by
    /// `norm` with the group's `count`): the per-channel gradient sums are all-reduced so that
    /// the input's gradient is the full batch's.
    fn record_backward(
        &self,
        x: &Tensor,
        out: Tensor,
        xc: Tensor,
        norm: phases::Normalization,
        count: phases::Count,
        epilogue: Epilogue<'_>,
    ) -> tandem_nn::Result<Tensor> {
        let bn = &self.bn;
        let residual = match epilogue {
            Epilogue::AddRelu(r) => Some(r),
            _ => None,
        };
        // With a residual, the backward's mask is `y > 0` of the output itself.
        let saved_out = residual.is_some().then(|| out.detach());
        let relu = matches!(epilogue, Epilogue::Relu);
        let mut inputs: Vec<&Tensor> = vec![x];
        inputs.extend(residual);
        inputs.extend(bn.weight());
        inputs.extend(bn.bias());
        let (has_w, has_b) = (bn.weight().is_some(), bn.bias().is_some());
        let group = self.group.clone();
        Ok(record_fn(out, &inputs, "sync_batch_norm", move || {
            move |g: &Tensor| {
                let mask = match (&saved_out, relu) {
                    (Some(y), _) => GradMask::Output(y),
                    (None, true) => GradMask::Relu,
                    (None, false) => GradMask::None,
                };
                let GradSums { sums, grad: masked } = if xc.numel() == 0 {
                    // No samples (a joined rank's shadow step): zero sums for the all-reduce,
                    // and no kernel over an empty batch (on a GPU it would leave the sums
                    // unwritten).
                    empty_batch_sums(&xc, g, saved_out.is_some())?
                } else {
                    phases::backward_reduce(&BackwardReduceArgs {
                        grad: g,
                        x: &xc,
                        norm: &norm,
                        mask,
                    })?
                };
                // The parameters' gradients are this rank's own sums (DDP averages them); the
                // input's gradient needs the group's.
                let (grad_w, grad_b) = phases::parameter_gradients(&sums, &norm, g.dtype())?;
                let label = CollectiveLabel::Named("SyncBatchNorm gradient statistics");
                crate::with_collective_label(label, || group.all_reduce(&sums, ReduceOp::Sum))
                    .and_then(|w| w.wait())
                    .map_err(|e| core_err("backward", e))?;
                let g_bn = masked.as_ref().unwrap_or(g);
                let grad_x = if xc.numel() == 0 {
                    Tensor::zeros(xc.dims(), g.dtype(), xc.device())?
                } else {
                    phases::backward_apply(&BackwardApplyArgs {
                        grad: g_bn,
                        x: &xc,
                        norm: &norm,
                        sums: &sums,
                        count: &count,
                        training: true,
                        relu_mask: relu,
                    })?
                };
                let mut grads = vec![Some(grad_x)];
                if saved_out.is_some() {
                    grads.push(masked);
                }
                if has_w {
                    grads.push(Some(grad_w));
                }
                if has_b {
                    grads.push(Some(grad_b));
                }
                Ok(grads)
            }
        }))
    }
}

/// The gradient sums of a batch of no samples: `[2, C]` zeros, and an empty masked gradient
/// when the backward has a residual.
fn empty_batch_sums(x: &Tensor, g: &Tensor, residual: bool) -> tandem_core::Result<GradSums> {
    let c = x.dims()[1];
    let sums = Tensor::zeros(&[2, c], DType::F64, x.device())?;
    let grad = if residual {
        Some(Tensor::zeros(g.dims(), g.dtype(), g.device())?)
    } else {
        None
    };
    Ok(GradSums { sums, grad })
}

fn core_err(
    context: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> tandem_core::Error {
    tandem_core::Error::external(format!("SyncBatchNorm {context}"), e)
}

impl Forward for SyncBatchNorm {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        self.run(x, Epilogue::Plain)
    }
}

impl Fused for SyncBatchNorm {
    /// `relu(forward(x))` in batch norm's own passes.
    fn forward_relu(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        self.run(x, Epilogue::Relu)
    }

    /// `relu(forward(x) + residual)` in batch norm's own passes.
    fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> tandem_nn::Result<Tensor> {
        self.run(x, Epilogue::AddRelu(residual))
    }
}

/// Replaces every `BatchNorm2d` in `module` (or `module` itself) by a [`SyncBatchNorm`] over
/// `group` that shares its parameters and buffers. Containers must support
/// `Module::replace_child` (as `Sequential` does).
pub fn convert_sync_batch_norm(
    module: Arc<dyn Module>,
    group: Arc<dyn ProcessGroup>,
) -> tandem_nn::Result<Arc<dyn Module>> {
    let module = match module.downcast_arc::<BatchNorm2d>() {
        Ok(bn) => return Ok(Arc::new(SyncBatchNorm::new(bn, group))),
        Err(module) => module,
    };
    for (name, child) in module.children() {
        match child.downcast_arc::<BatchNorm2d>() {
            Ok(bn) => {
                module.replace_child(&name, Arc::new(SyncBatchNorm::new(bn, group.clone())))?;
            }
            Err(child) => {
                convert_sync_batch_norm(child, group.clone())?;
            }
        }
    }
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadProcessGroup;
    use tandem_core::{DType, Device, Generator};
    use tandem_nn::BatchNormConfig;

    /// Rows `start..start + len` of the batch dim, as a fresh tensor.
    fn rows(t: &Tensor, start: usize, len: usize) -> Tensor {
        let v = t.to_vec::<f32>().unwrap();
        let per: usize = t.dims()[1..].iter().product();
        let mut shape = t.dims().to_vec();
        shape[0] = len;
        Tensor::from_vec(
            v[start * per..(start + len) * per].to_vec(),
            &shape,
            Device::Cpu,
        )
        .unwrap()
    }

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let mut g = Generator::new(seed);
        Tensor::randn(shape, 0.3, 1.0, DType::F32, Device::Cpu, &mut g).unwrap()
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (k, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{what} element {k}: {a} vs {b}"
            );
        }
    }

    /// What one run of a fused layer gives: the output, and the gradients of the input, the
    /// residual, the weight and the bias.
    struct Run {
        y: Vec<f32>,
        grads: [Vec<f32>; 4],
        /// The dtypes of the output and of the input's gradient.
        dtypes: (DType, Option<DType>),
    }

    fn run(
        layer: &dyn Fused,
        bn: &BatchNorm2d,
        x: &Tensor,
        r: &Tensor,
        g: &Tensor,
        add: bool,
    ) -> Run {
        let (x, r) = (
            x.detach().with_requires_grad().unwrap(),
            r.detach().with_requires_grad().unwrap(),
        );
        let y = if add {
            layer.forward_add_relu(&x, &r).unwrap()
        } else {
            layer.forward_relu(&x).unwrap()
        };
        tandem_autograd::backward(&y, Some(g), &Default::default()).unwrap();
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        let grad = |t: &Tensor| t.grad().map_or(vec![], |g| f32s(&g));
        let grads = [
            grad(&x),
            grad(&r),
            grad(bn.weight().unwrap()),
            grad(bn.bias().unwrap()),
        ];
        for t in [bn.weight().unwrap(), bn.bias().unwrap()] {
            t.set_grad(None).unwrap();
        }
        Run {
            y: f32s(&y),
            grads,
            dtypes: (y.dtype(), x.grad().map(|g| g.dtype())),
        }
    }

    /// A batch norm of `c` channels whose weight and bias are not the identity.
    fn batch_norm(c: usize) -> Arc<BatchNorm2d> {
        let bn = BatchNormConfig::new(c).init().unwrap();
        bn.weight().unwrap().copy_(&randn(&[c], 7)).unwrap();
        bn.bias().unwrap().copy_(&randn(&[c], 8)).unwrap();
        Arc::new(bn)
    }

    #[test]
    fn fused_epilogues_on_two_ranks_match_the_full_batch_forward_and_backward() {
        let (n, c) = (6, 3);
        let x = randn(&[n, c, 4, 5], 1);
        let r = randn(&[n, c, 4, 5], 2);
        let g = randn(&[n, c, 4, 5], 3);
        for add in [false, true] {
            let full_bn = batch_norm(c);
            let want = run(full_bn.as_ref(), &full_bn, &x, &r, &g, add);
            let groups = ThreadProcessGroup::new_group(2).unwrap();
            let per_rank: Vec<Run> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, group)| {
                        let (x, r, g) = (&x, &r, &g);
                        s.spawn(move || {
                            let bn = batch_norm(c);
                            let sync = SyncBatchNorm::new(bn.clone(), Arc::new(group));
                            let half = n / 2;
                            let (xs, rs, gs) = (
                                rows(x, rank * half, half),
                                rows(r, rank * half, half),
                                rows(g, rank * half, half),
                            );
                            run(&sync, &bn, &xs, &rs, &gs, add)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let what = if add { "add+relu" } else { "relu" };
            let y: Vec<f32> = per_rank.iter().flat_map(|p| p.y.clone()).collect();
            assert_close(&format!("{what} output"), &y, &want.y);
            for (i, name) in ["input", "residual"].iter().enumerate() {
                if !add && i == 1 {
                    continue;
                }
                let got: Vec<f32> = per_rank.iter().flat_map(|p| p.grads[i].clone()).collect();
                assert_close(&format!("{what} {name} gradient"), &got, &want.grads[i]);
            }
            // The parameters' gradients are each rank's own sums: together the full batch's.
            for (i, name) in [(2, "weight"), (3, "bias")] {
                let summed: Vec<f32> = (0..c)
                    .map(|k| per_rank.iter().map(|p| p.grads[i][k]).sum())
                    .collect();
                assert_close(&format!("{what} {name} gradient"), &summed, &want.grads[i]);
            }
        }
    }

    /// Mixed precision: a bf16 input (and residual) on two ranks normalises with f32 statistics
    /// all-reduced in f32, returns bf16 and gets bf16 gradients: the full-batch f32 layer's
    /// results on the rounded inputs, rounded once (bf16's unit roundoff 2⁻⁸, relative), the
    /// f32 parameters' gradients to f32 precision.
    #[test]
    fn a_bf16_input_on_two_ranks_matches_the_f32_full_batch_rounded_once() {
        let (n, c) = (4, 2);
        let round = |t: Tensor| {
            t.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        };
        let x = round(randn(&[n, c, 3, 3], 11));
        let r = round(randn(&[n, c, 3, 3], 12));
        let g = round(randn(&[n, c, 3, 3], 13));
        let bf16 = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
        let within_bf16 = |what: &str, got: &[f32], want: &[f32]| {
            for (k, (a, b)) in got.iter().zip(want).enumerate() {
                let tol = b.abs() / 256.0 + 1e-4 * (1.0 + b.abs());
                assert!((a - b).abs() <= tol, "{what} element {k}: {a} vs {b}");
            }
        };
        for add in [false, true] {
            let full_bn = batch_norm(c);
            let want = run(full_bn.as_ref(), &full_bn, &x, &r, &g, add);
            let groups = ThreadProcessGroup::new_group(2).unwrap();
            let per_rank: Vec<Run> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, group)| {
                        let (x, r, g) = (&x, &r, &g);
                        s.spawn(move || {
                            let bn = batch_norm(c);
                            let sync = SyncBatchNorm::new(bn.clone(), Arc::new(group));
                            let half = n / 2;
                            let (xs, rs, gs) = (
                                bf16(rows(x, rank * half, half)),
                                bf16(rows(r, rank * half, half)),
                                bf16(rows(g, rank * half, half)),
                            );
                            run(&sync, &bn, &xs, &rs, &gs, add)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for p in &per_rank {
                assert_eq!(p.dtypes, (DType::BF16, Some(DType::BF16)), "add {add}");
            }
            let y: Vec<f32> = per_rank.iter().flat_map(|p| p.y.clone()).collect();
            within_bf16("output", &y, &want.y);
            let gx: Vec<f32> = per_rank.iter().flat_map(|p| p.grads[0].clone()).collect();
            within_bf16("input gradient", &gx, &want.grads[0]);
            if add {
                let gr: Vec<f32> = per_rank.iter().flat_map(|p| p.grads[1].clone()).collect();
                within_bf16("residual gradient", &gr, &want.grads[1]);
            }
            for (i, name) in [(2, "weight"), (3, "bias")] {
                let summed: Vec<f32> = (0..c)
                    .map(|k| per_rank.iter().map(|p| p.grads[i][k]).sum())
                    .collect();
                assert_close(&format!("{name} gradient"), &summed, &want.grads[i]);
            }
        }
    }
}
