//! `SyncBatchNorm`: batch normalisation whose statistics cover the global batch.
//!
//! Under DDP, plain BatchNorm normalises each rank's B/N samples with that rank's own
//! statistics. SyncBatchNorm all-reduces per-channel sums (Σx, Σx², count) in forward so every
//! rank normalises with the statistics of all B samples, and all-reduces Σg and Σg·x̂ in
//! backward so the input gradient is the full-batch one. It runs on the CPU too (PyTorch's
//! refuses to). The weight and bias gradients stay local sums; DDP averages them like any
//! other gradient. [`convert_sync_batch_norm`] swaps a model's `BatchNorm2d` layers for it,
//! sharing their parameters and buffers.

use std::sync::Arc;

use tandem_autograd::record_fn;
use tandem_core::{Device, Tensor};
use tandem_nn::module::{Module, ParamKind, TrainingFlag};
use tandem_nn::BatchNorm2d;

use crate::{ProcessGroup, ReduceOp};

/// Batch normalisation with statistics all-reduced over a process group. It wraps a
/// [`BatchNorm2d`], whose parameters, buffers, settings and train/eval flag it uses as they are.
pub struct SyncBatchNorm {
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
}

fn core_err(
    context: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> tandem_core::Error {
    tandem_core::Error::external(format!("SyncBatchNorm {context}"), e)
}

/// Per-channel sums over `[N, C, rest…]` data: returns Σ f(i) for each channel.
fn channel_sums(
    values: &[f64],
    n: usize,
    c: usize,
    inner: usize,
    f: impl Fn(usize, f64) -> f64,
) -> Vec<f64> {
    let mut sums = vec![0.0; c];
    for i in 0..n {
        for (ch, sum) in sums.iter_mut().enumerate() {
            let base = (i * c + ch) * inner;
            *sum += values[base..base + inner]
                .iter()
                .enumerate()
                .map(|(k, &v)| f(base + k, v))
                .sum::<f64>();
        }
    }
    sums
}

impl Module for SyncBatchNorm {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        if x.rank() < 2 || x.dims()[1] != self.bn.num_features() {
            return Err(self.input_error(format!(
                "expected input [N, {}, …], got shape {:?}",
                self.bn.num_features(),
                x.dims()
            )));
        }
        let training = self.is_training();
        if !training && self.bn.config().track_running_stats {
            // Evaluation uses the running statistics: nothing to synchronise.
            return Ok(tandem_ops::batch_norm(
                x,
                self.bn.running_mean(),
                self.bn.running_var(),
                self.bn.weight(),
                self.bn.bias(),
                false,
                self.bn.config().momentum,
                self.bn.config().eps,
            )?);
        }
        let (n, c) = (x.dims()[0], x.dims()[1]);
        let inner: usize = x.dims()[2..].iter().product();
        let xs = x.to_vec_f64()?;
        let local_sum = channel_sums(&xs, n, c, inner, |_, v| v);
        let local_sq = channel_sums(&xs, n, c, inner, |_, v| v * v);
        let mut packed = local_sum;
        packed.extend(local_sq);
        packed.push((n * inner) as f64);
        let stats = Tensor::from_vec(packed, &[2 * c + 1], Device::Cpu)?;
        self.group
            .all_reduce(&stats, ReduceOp::Sum)
            .and_then(|w| w.wait())
            .map_err(|e| core_err("forward statistics", e))?;
        let stats = stats.to_vec::<f64>()?;
        let count = stats[2 * c];
        if count <= 1.0 {
            return Err(self.input_error(format!(
                "batch statistics need more than one value per channel, got {count} in total"
            )));
        }
        let mean: Vec<f64> = (0..c).map(|ch| stats[ch] / count).collect();
        let var: Vec<f64> = (0..c)
            .map(|ch| (stats[c + ch] / count - mean[ch] * mean[ch]).max(0.0))
            .collect();
        let invstd: Vec<f64> = var
            .iter()
            .map(|v| 1.0 / (v + self.bn.config().eps).sqrt())
            .collect();

        if let (Some(rm), Some(rv)) = (self.bn.running_mean(), self.bn.running_var()) {
            let m = self.bn.config().momentum;
            let unbiased = count / (count - 1.0);
            let new_mean: Vec<f64> = rm
                .to_vec_f64()?
                .iter()
                .zip(&mean)
                .map(|(r, b)| (1.0 - m) * r + m * b)
                .collect();
            let new_var: Vec<f64> = rv
                .to_vec_f64()?
                .iter()
                .zip(&var)
                .map(|(r, b)| (1.0 - m) * r + m * b * unbiased)
                .collect();
            rm.copy_(&Tensor::from_vec(new_mean, &[c], Device::Cpu)?.to_dtype(rm.dtype())?)?;
            rv.copy_(&Tensor::from_vec(new_var, &[c], Device::Cpu)?.to_dtype(rv.dtype())?)?;
            if let Some(count) = self.bn.num_batches_tracked() {
                count.write_slice::<i64>()?[0] += 1;
            }
        }

        let w: Vec<f64> = match self.bn.weight() {
            Some(w) => w.to_vec_f64()?,
            None => vec![1.0; c],
        };
        let b: Vec<f64> = match self.bn.bias() {
            Some(b) => b.to_vec_f64()?,
            None => vec![0.0; c],
        };
        let channel = move |idx: usize| (idx / inner) % c;
        let xhat: Vec<f64> = xs
            .iter()
            .enumerate()
            .map(|(i, &v)| (v - mean[channel(i)]) * invstd[channel(i)])
            .collect();
        let y: Vec<f64> = xhat
            .iter()
            .enumerate()
            .map(|(i, &h)| h * w[channel(i)] + b[channel(i)])
            .collect();
        let out = Tensor::from_vec(y, x.dims(), Device::Cpu)?.to_dtype(x.dtype())?;

        let mut inputs: Vec<&Tensor> = vec![x];
        inputs.extend(self.bn.weight());
        inputs.extend(self.bn.bias());
        let (has_w, has_b) = (self.bn.weight().is_some(), self.bn.bias().is_some());
        let group = self.group.clone();
        let dtype = x.dtype();
        let dims = x.dims().to_vec();
        Ok(record_fn(out, &inputs, "sync_batch_norm", move || {
            move |g: &Tensor| {
                let gs = g.to_vec_f64()?;
                let sum_g = channel_sums(&gs, n, c, inner, |_, v| v);
                let sum_gx = channel_sums(&gs, n, c, inner, |k, v| v * xhat[k]);
                let mut packed = sum_g.clone();
                packed.extend(sum_gx.iter().copied());
                let global = Tensor::from_vec(packed, &[2 * c], Device::Cpu)?;
                group
                    .all_reduce(&global, ReduceOp::Sum)
                    .and_then(|w| w.wait())
                    .map_err(|e| core_err("backward", e))?;
                let global = global.to_vec::<f64>()?;
                let grad_x: Vec<f64> = gs
                    .iter()
                    .enumerate()
                    .map(|(i, &gv)| {
                        let ch = channel(i);
                        w[ch]
                            * invstd[ch]
                            * (gv - global[ch] / count - xhat[i] * global[c + ch] / count)
                    })
                    .collect();
                let mut grads = vec![Some(
                    Tensor::from_vec(grad_x, &dims, Device::Cpu)?.to_dtype(dtype)?,
                )];
                if has_w {
                    grads.push(Some(
                        Tensor::from_vec(sum_gx.clone(), &[c], Device::Cpu)?.to_dtype(dtype)?,
                    ));
                }
                if has_b {
                    grads.push(Some(
                        Tensor::from_vec(sum_g.clone(), &[c], Device::Cpu)?.to_dtype(dtype)?,
                    ));
                }
                Ok(grads)
            }
        }))
    }

    fn training_flag(&self) -> &TrainingFlag {
        self.bn.training_flag()
    }

    fn visit_own(&self, visitor: &mut dyn FnMut(&str, ParamKind, &Tensor)) {
        self.bn.visit_own(visitor);
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
