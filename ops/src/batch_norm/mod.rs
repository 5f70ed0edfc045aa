//! Batch normalization over the channel dim (dim 1) of `[N, C]` or `[N, C, ...]` inputs, with
//! fused forward and backward kernels and the running statistics updated in place.
//!
//! Training normalises with the batch statistics (biased variance) and folds
//! `running = (1 − momentum)·running + momentum·batch_stat` into the running mean and the running
//! variance (the latter with the unbiased batch variance, as PyTorch does). Evaluation normalises
//! with the running statistics. The backward is the closed form
//! `grad_x = (w/σ)·(g − mean(g) − x̂·mean(g·x̂))` per channel in training, `g·w/σ_running` in
//! evaluation.
//!
//! [`batch_norm_relu`] is `max(0, batch_norm(x))` in the same passes: the forward clamps as it
//! normalises, and the backward zeroes the output gradient where the normalised value
//! `z = x·w/σ + (b − mean·w/σ)` was not positive — `z` recomputed from the saved input with the
//! forward's own per-channel constants, so the mask is exactly the forward's and no output or
//! mask tensor is kept.
//!
//! [`batch_norm_add_relu`] is `max(0, batch_norm(x) + residual)`, the join of a ResNet block,
//! in the same passes: the residual is added in the output pass, and since its mask cannot be
//! recomputed from `x`, the backward masks the output gradient by the saved output inside the
//! gradient reduction, writing the residual's gradient there for the input-gradient pass.
//!
//! An f16 or bf16 input with f32 weight, bias and running statistics (what autocast leaves)
//! runs on the CPU's native half passes (`cpu/half.rs`): statistics and gradient sums in
//! f32/f64, the output and x's and the residual's gradients in x's dtype, the parameters'
//! gradients in f32, and no full-size f32 copy. Other half cases (CUDA, half parameters) go
//! through f32 copies.
//!
//! Every phase runs on the CPU (`cpu/`) and on CUDA devices (`cuda.rs`, with the kernels of
//! `batch_norm.cu` launched through the plans of [`cuda::launch`]).

#[cfg(test)]
mod add_relu_tests;
mod cpu;
pub mod cuda;
pub mod phases;
#[cfg(test)]
mod relu_tests;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{Error, Result, Tensor};

use crate::checks::{float_or_half, same_dtype_device};
use phases::{
    ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, Count, GradMask, GradSums, Normalization,
    NormalizationArgs, RunningUpdate,
};
pub use shape::{Dims, Epilogue};

/// Checks that a per-channel argument is `[C]` with the input's dtype and device.
fn check_channel_param(op: &'static str, name: &str, x: &Tensor, t: Option<&Tensor>) -> Result<()> {
    let Some(t) = t else { return Ok(()) };
    if x.dtype().is_half() {
        // The native half path takes f32 parameters and buffers (see `native_half`).
        x.device().same_as(t.device(), op)?;
        if t.dtype() != tandem_core::DType::F32 {
            return Err(Error::DTypeMismatch {
                op,
                lhs: x.dtype(),
                rhs: t.dtype(),
            });
        }
    } else {
        same_dtype_device(op, x, t)?;
    }
    let c = x.dims()[1];
    if t.dims() != [c] {
        return Err(Error::shape(
            op,
            format!(
                "{name} has shape {:?} but input {:?} has {c} channels (need [{c}])",
                t.dims(),
                x.dims()
            ),
        ));
    }
    Ok(())
}

/// The parameters, buffers and settings of one batch-norm call (see [`batch_norm`]).
#[derive(Clone, Copy, Debug)]
pub struct BatchNormArgs<'a> {
    /// Running mean `[C]`, updated in place in training; needed in evaluation.
    pub running_mean: Option<&'a Tensor>,
    /// Running (unbiased) variance `[C]`, updated in place in training; needed in evaluation.
    pub running_var: Option<&'a Tensor>,
    /// Per-channel scale `[C]`; ones when absent.
    pub weight: Option<&'a Tensor>,
    /// Per-channel shift `[C]`; zeros when absent.
    pub bias: Option<&'a Tensor>,
    /// Normalise with the batch statistics (and update the running ones), or with the running
    /// statistics.
    pub training: bool,
    /// Weight of the batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance before the square root (≥ 0).
    pub eps: f64,
}

/// Batch normalization of `x` per channel (dim 1).
///
/// `y = (x − mean) / sqrt(var + eps) · weight + bias`, where in training `mean`/`var` are the
/// batch statistics over every dim but 1 (biased variance) and `running_mean`/`running_var`
/// (when given) are updated in place as `running = (1 − momentum)·running + momentum·stat`
/// (unbiased variance for `running_var`); in evaluation (`training = false`) the running
/// statistics are used and left unchanged. `weight` defaults to ones and `bias` to zeros. The
/// running statistics are buffers: they receive no gradient.
///
/// # Shapes
/// - `x`: `[N, C]` or `[N, C, ...]` (e.g. `[N, C, H, W]`); output: same as `x`;
/// - `running_mean`, `running_var`, `weight`, `bias`: `[C]`.
///
/// Errors (naming the shapes) when a per-channel tensor is not `[C]`, when training sees only
/// one value per channel, or when evaluation has no running statistics.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let args = BatchNormArgs {
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    };
    batch_norm_fused(x, Epilogue::Plain, &args)
}

/// `max(0, batch_norm(x))`: [`batch_norm`] (same arguments, shapes, running-statistics update
/// and errors) with a ReLU on its output, fused into its passes.
///
/// The forward writes the clamped values as it normalises; the backward masks the output
/// gradient where the normalised value was not positive (the gradient at exactly 0 is 0, as
/// for `relu`) inside batch norm's own reduction and input-gradient pass. It saves nothing
/// beyond what `batch_norm` saves. Profiled and recorded as `"batch_norm_relu"`.
///
/// # Shapes
/// - `x`: `[N, C]` or `[N, C, ...]`; output: same as `x`;
/// - `running_mean`, `running_var`, `weight`, `bias`: `[C]`.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_relu(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let args = BatchNormArgs {
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    };
    batch_norm_fused(x, Epilogue::Relu, &args)
}

/// `max(0, batch_norm(x) + residual)`: [`batch_norm`] (same arguments, shapes,
/// running-statistics update and errors) with a residual added and a ReLU applied, fused into
/// its passes — the join of a ResNet block.
///
/// The forward writes `max(0, scale·x + shift + residual)` as it normalises. The backward
/// masks the output gradient where the output is positive (the gradient at exactly 0 is 0, as
/// for `relu`) in the same pass as batch norm's gradient reduction; that masked gradient is
/// the residual's gradient and feeds batch norm's input-gradient pass. The output is saved
/// for the mask (the next layer keeps it alive anyway). Profiled and recorded as
/// `"batch_norm_add_relu"`.
///
/// # Shapes
/// - `x`, `residual`: `[N, C]` or `[N, C, ...]`, the same shape; output: same as `x`;
/// - `running_mean`, `running_var`, `weight`, `bias`: `[C]`.
///
/// Errors (naming the op and both shapes) when `residual`'s shape differs from `x`'s, and
/// when its dtype or device does.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_add_relu(
    x: &Tensor,
    residual: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let args = BatchNormArgs {
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    };
    batch_norm_fused(x, Epilogue::AddRelu(residual), &args)
}

/// [`batch_norm`], [`batch_norm_relu`] or [`batch_norm_add_relu`], chosen by `epilogue`, with
/// their arguments in one struct: for callers (a layer) that pick the fusion at run time. Same
/// semantics, shapes and errors as the op it stands for.
///
/// It runs the [`phases`] in a row — statistics (and the running update) in training,
/// normalization, apply — and records a backward that runs the backward reduce and the
/// backward apply.
pub fn batch_norm_fused(
    x: &Tensor,
    epilogue: Epilogue<'_>,
    args: &BatchNormArgs<'_>,
) -> Result<Tensor> {
    if x.dtype().is_half() && !native_half(x, epilogue, args) {
        return fused_via_f32(x, epilogue, args);
    }
    let op = epilogue.name();
    let _profile = tandem_core::profile::scope(op, tandem_core::profile::Phase::Forward);
    validate(op, x, epilogue, args)?;
    let count = x.numel() / x.dims()[1].max(1);
    // Dense once: every phase, forward and backward, reads the input. The phases of both
    // devices read a channels-last input as it is (channel-innermost passes, channels-last
    // output).
    let xc = if x.layout().is_channels_last() {
        x.detach()
    } else {
        x.contiguous_detached()?
    };
    let norm = forward_normalization(op, x, &xc, count, args)?;
    let out = phases::apply(&ApplyArgs {
        x: &xc,
        norm: &norm,
        epilogue,
    })?;
    // With a residual, the backward's mask is `y > 0` of the output itself.
    let residual = match epilogue {
        Epilogue::AddRelu(r) => Some(r),
        _ => None,
    };
    let saved = Saved {
        saved_out: residual.is_some().then(|| out.detach()),
        relu: matches!(epilogue, Epilogue::Relu),
        needs: Needs {
            x: x.requires_grad(),
            residual: residual.is_some_and(|t| t.requires_grad()),
            weight: args.weight.is_some_and(|t| t.requires_grad()),
            bias: args.bias.is_some_and(|t| t.requires_grad()),
        },
        has_weight: args.weight.is_some(),
        has_bias: args.bias.is_some(),
        param_dtype: args.weight.or(args.bias).map_or(x.dtype(), |t| t.dtype()),
        training: args.training,
        count,
        xc,
        norm,
    };
    let mut inputs = vec![x];
    inputs.extend(residual);
    inputs.extend(args.weight);
    inputs.extend(args.bias);
    Ok(record_fn(out, &inputs, op, move || {
        move |g: &Tensor| saved.backward(g)
    }))
}

/// Whether a half `x` runs the native one-pass half passes (`cpu/half.rs`): on the CPU, with
/// f32 weight, bias and running statistics (as autocast leaves them; any may be absent) and a
/// residual of x's dtype. Anything else goes through f32 copies ([`fused_via_f32`]).
fn native_half(x: &Tensor, epilogue: Epilogue<'_>, args: &BatchNormArgs<'_>) -> bool {
    let cpu = tandem_core::Device::Cpu;
    let f32_param = |t: Option<&Tensor>| {
        t.is_none_or(|t| t.dtype() == tandem_core::DType::F32 && t.device() == cpu)
    };
    let residual_ok = match epilogue {
        Epilogue::AddRelu(r) => r.dtype() == x.dtype() && r.device() == cpu,
        _ => true,
    };
    x.device() == cpu
        && residual_ok
        && [args.running_mean, args.running_var, args.weight, args.bias]
            .into_iter()
            .all(f32_param)
}

/// [`batch_norm_fused`] of an f16 or bf16 `x`: statistics, normalization and gradients in f32
/// (x, a half residual and half parameters widened, recorded), the output rounded once to x's
/// dtype. The running statistics are updated in f32; half ones (a model converted whole to a
/// half dtype) are widened for the update and rounded back.
fn fused_via_f32(x: &Tensor, epilogue: Epilogue<'_>, args: &BatchNormArgs<'_>) -> Result<Tensor> {
    use crate::low_precision::widen;
    // f32 running statistics are updated where they are; half ones through an f32 copy.
    let wide_running = |t: Option<&Tensor>| -> Result<Option<Tensor>> {
        t.map(|t| match t.dtype().is_half() {
            true => t.to_dtype(tandem_core::DType::F32),
            false => Ok(t.clone()),
        })
        .transpose()
    };
    let (mean, var) = (
        wide_running(args.running_mean)?,
        wide_running(args.running_var)?,
    );
    let weight = args.weight.map(widen).transpose()?;
    let bias = args.bias.map(widen).transpose()?;
    let residual = match epilogue {
        Epilogue::AddRelu(r) => Some(widen(r)?),
        _ => None,
    };
    let out = crate::low_precision::via_f32(x.dtype(), &[x], |w| {
        let wide_args = BatchNormArgs {
            running_mean: mean.as_ref(),
            running_var: var.as_ref(),
            weight: weight.as_ref(),
            bias: bias.as_ref(),
            ..*args
        };
        let epilogue = match &residual {
            Some(r) => Epilogue::AddRelu(r),
            None => epilogue,
        };
        batch_norm_fused(&w[0], epilogue, &wide_args)
    })?;
    if args.training {
        for (dst, wide) in [(args.running_mean, &mean), (args.running_var, &var)] {
            if let (Some(dst), Some(wide)) = (dst, wide) {
                if dst.dtype().is_half() {
                    dst.copy_(&wide.to_dtype(dst.dtype())?)?;
                }
            }
        }
    }
    Ok(out)
}

/// The normalization constants of a forward: from the batch statistics in training (after
/// folding them into the running statistics), from the running statistics in evaluation.
fn forward_normalization(
    op: &'static str,
    x: &Tensor,
    xc: &Tensor,
    count: usize,
    args: &BatchNormArgs<'_>,
) -> Result<Normalization> {
    let stats = if args.training {
        if count <= 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "training needs more than one value per channel, got input {:?}",
                    x.dims()
                ),
            ));
        }
        let stats = phases::statistics(xc)?;
        phases::update_running(&RunningUpdate {
            running_mean: args.running_mean,
            running_var: args.running_var,
            stats: &stats,
            momentum: args.momentum,
        })?;
        Some(stats)
    } else {
        None
    };
    let (mean, var) = match (&stats, args.running_mean, args.running_var) {
        (Some(s), _, _) => (&s.mean, &s.var),
        (None, Some(m), Some(v)) => (m, v),
        _ => {
            return Err(Error::invalid(
                op,
                format!(
                "evaluation (training = false) needs running_mean and running_var for input {:?}",
                x.dims()
            ),
            ))
        }
    };
    phases::normalization(&NormalizationArgs {
        mean,
        var,
        weight: args.weight,
        bias: args.bias,
        eps: args.eps,
    })
}

/// Which inputs of a batch-norm op want a gradient.
#[derive(Clone, Copy, Debug)]
struct Needs {
    x: bool,
    residual: bool,
    weight: bool,
    bias: bool,
}

/// What a batch-norm op's backward reads, kept by its forward.
struct Saved {
    /// The dense input (row-major or channels-last).
    xc: Tensor,
    /// The forward's normalization constants.
    norm: Normalization,
    /// The output, behind an add+ReLU (its mask is `y > 0`).
    saved_out: Option<Tensor>,
    /// Whether a ReLU (without a residual) follows batch norm.
    relu: bool,
    needs: Needs,
    has_weight: bool,
    has_bias: bool,
    /// The dtype of the weight and bias gradients: the parameters' (f32 under a half input).
    param_dtype: tandem_core::DType,
    training: bool,
    /// Values per channel.
    count: usize,
}

impl Saved {
    /// The gradients of the recorded inputs (x, the residual, weight, bias: those present)
    /// from the output gradient `g`.
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let mask = match (&self.saved_out, self.relu) {
            (Some(y), _) => GradMask::Output(y),
            (None, true) => GradMask::Relu,
            (None, false) => GradMask::None,
        };
        let GradSums { sums, grad: masked } = phases::backward_reduce(&BackwardReduceArgs {
            grad: g,
            x: &self.xc,
            norm: &self.norm,
            mask,
        })?;
        // The gradient batch norm itself sees: g, or behind an add+ReLU the masked g
        // (which is also the residual's gradient).
        let g_bn = masked.as_ref().unwrap_or(g);
        let grad_x = if self.needs.x {
            Some(phases::backward_apply(&BackwardApplyArgs {
                grad: g_bn,
                x: &self.xc,
                norm: &self.norm,
                sums: &sums,
                count: &Count::Host(self.count),
                training: self.training,
                relu_mask: self.relu,
            })?)
        } else {
            None
        };
        let needs = self.needs;
        let (grad_w, grad_b) = if (self.has_weight && needs.weight) || (self.has_bias && needs.bias)
        {
            let (w, b) = phases::parameter_gradients(&sums, &self.norm, self.param_dtype)?;
            (needs.weight.then_some(w), needs.bias.then_some(b))
        } else {
            (None, None)
        };
        let mut grads = vec![grad_x];
        if self.saved_out.is_some() {
            grads.push(if needs.residual { masked } else { None });
        }
        if self.has_weight {
            grads.push(grad_w);
        }
        if self.has_bias {
            grads.push(grad_b);
        }
        Ok(grads)
    }
}

/// Checks the input, the per-channel arguments, the residual and `eps` of a batch-norm op.
fn validate(
    op: &'static str,
    x: &Tensor,
    epilogue: Epilogue<'_>,
    args: &BatchNormArgs<'_>,
) -> Result<()> {
    float_or_half(op, x)?;
    if x.rank() < 2 {
        return Err(Error::shape(
            op,
            format!("need input [N, C] or [N, C, ...], got {:?}", x.dims()),
        ));
    }
    check_channel_param(op, "running_mean", x, args.running_mean)?;
    check_channel_param(op, "running_var", x, args.running_var)?;
    check_channel_param(op, "weight", x, args.weight)?;
    check_channel_param(op, "bias", x, args.bias)?;
    if let Epilogue::AddRelu(r) = epilogue {
        same_dtype_device(op, x, r)?;
        if r.dims() != x.dims() {
            return Err(Error::shape(
                op,
                format!(
                    "residual has shape {:?} but input has shape {:?} (they must match)",
                    r.dims(),
                    x.dims()
                ),
            ));
        }
    }
    if args.eps.is_nan() || args.eps < 0.0 {
        return Err(Error::invalid(
            op,
            format!("eps must be non-negative, got {}", args.eps),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device};

    /// Direct-loop reference: per-channel batch mean and biased variance of `[N, C, L]` values.
    fn naive_moments(v: &[f64], n: usize, c: usize, l: usize) -> (Vec<f64>, Vec<f64>) {
        let mut mean = vec![0.0; c];
        let mut var = vec![0.0; c];
        for ch in 0..c {
            let vals: Vec<f64> = (0..n)
                .flat_map(|i| (0..l).map(move |j| (i, j)))
                .map(|(i, j)| v[(i * c + ch) * l + j])
                .collect();
            mean[ch] = vals.iter().sum::<f64>() / vals.len() as f64;
            var[ch] = vals.iter().map(|x| (x - mean[ch]).powi(2)).sum::<f64>() / vals.len() as f64;
        }
        (mean, var)
    }

    fn vec_tensor(v: Vec<f64>) -> Tensor {
        let n = v.len();
        Tensor::from_vec(v, &[n], Device::Cpu).unwrap()
    }

    #[test]
    fn training_forward_and_running_stats_match_direct_loops() {
        // the last shape is large enough for the parallel kernels
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let cases = [
            (vec![4usize, 3, 2, 5], 10usize),
            (vec![6, 3], 1),
            (vec![9, 3, 40, 40], 1600),
        ];
        for (shape, l) in cases {
            pool.install(|| check_training_forward(&shape, l));
        }
    }

    fn check_training_forward(shape: &[usize], l: usize) {
        let (n, c) = (shape[0], shape[1]);
        let x = rand_f64(shape, 1);
        let w = rand_f64(&[c], 2);
        let b = rand_f64(&[c], 3);
        let rm = vec_tensor(vec![0.5, -0.25, 1.0]);
        let rv = vec_tensor(vec![2.0, 1.0, 0.5]);
        let (old_m, old_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
        let eps = 1e-5;
        let y = batch_norm(&x, Some(&rm), Some(&rv), Some(&w), Some(&b), true, 0.1, eps).unwrap();
        let xv = x.to_vec_f64().unwrap();
        let (wv, bv) = (w.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
        let (mean, var) = naive_moments(&xv, n, c, l);
        let yv = y.to_vec_f64().unwrap();
        for (i, &xe) in xv.iter().enumerate() {
            let ch = (i / l) % c;
            let want = (xe - mean[ch]) / (var[ch] + eps).sqrt() * wv[ch] + bv[ch];
            assert!((yv[i] - want).abs() < 1e-12, "{i}: {} vs {want}", yv[i]);
        }
        let m = (n * l) as f64;
        let (new_m, new_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
        for ch in 0..c {
            let want_m = 0.9 * old_m[ch] + 0.1 * mean[ch];
            let want_v = 0.9 * old_v[ch] + 0.1 * var[ch] * m / (m - 1.0);
            assert!((new_m[ch] - want_m).abs() < 1e-12);
            assert!((new_v[ch] - want_v).abs() < 1e-12);
        }
    }

    #[test]
    fn eval_forward_uses_running_stats_and_leaves_them_alone() {
        let x = rand_f64(&[2, 3, 4], 4);
        let rm = vec_tensor(vec![0.1, -0.2, 0.3]);
        let rv = vec_tensor(vec![1.5, 0.5, 2.5]);
        let y = batch_norm(&x, Some(&rm), Some(&rv), None, None, false, 0.1, 1e-3).unwrap();
        let (xv, yv) = (x.to_vec_f64().unwrap(), y.to_vec_f64().unwrap());
        let (m, v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
        for (i, &xe) in xv.iter().enumerate() {
            let ch = (i / 4) % 3;
            assert!((yv[i] - (xe - m[ch]) / (v[ch] + 1e-3).sqrt()).abs() < 1e-12);
        }
        assert_eq!(rm.to_vec_f64().unwrap(), vec![0.1, -0.2, 0.3]);
    }

    #[test]
    fn f32_training_forward_is_normalised() {
        let mut gen = tandem_core::Generator::new(5);
        let x = Tensor::randn(&[8, 4, 6, 6], 3.0, 2.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let y = batch_norm(&x, None, None, None, None, true, 0.1, 1e-5).unwrap();
        let (mean, var) = naive_moments(&y.to_vec_f64().unwrap(), 8, 4, 36);
        for ch in 0..4 {
            assert!(
                mean[ch].abs() < 1e-5 && (var[ch] - 1.0).abs() < 1e-3,
                "{mean:?} {var:?}"
            );
        }
    }

    #[test]
    fn gradcheck_batch_norm_training_and_eval() {
        let bn_train =
            |t: &[Tensor]| batch_norm(&t[0], None, None, Some(&t[1]), Some(&t[2]), true, 0.1, 1e-5);
        check(
            bn_train,
            &[
                rand_f64(&[4, 3, 2, 3], 10),
                rand_f64(&[3], 11),
                rand_f64(&[3], 12),
            ],
        );
        check(
            bn_train,
            &[
                rand_f64(&[5, 4], 13),
                rand_f64(&[4], 14),
                rand_f64(&[4], 15),
            ],
        );
        check(
            bn_train,
            &[
                rand_f64_noncontiguous(&[3, 2, 4, 3], 16),
                rand_f64(&[2], 17),
                rand_f64(&[2], 18),
            ],
        );
        let (rm, rv) = (vec_tensor(vec![0.0; 3]), vec_tensor(vec![1.0; 3]));
        check(
            |t| batch_norm(&t[0], Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5),
            &[rand_f64(&[3, 3, 5], 19)],
        );
        let (rm, rv) = (
            vec_tensor(vec![0.2, -0.1, 0.4]),
            vec_tensor(vec![0.8, 1.3, 2.0]),
        );
        check(
            |t| {
                batch_norm(
                    &t[0],
                    Some(&rm),
                    Some(&rv),
                    Some(&t[1]),
                    Some(&t[2]),
                    false,
                    0.1,
                    1e-5,
                )
            },
            &[
                rand_f64_noncontiguous(&[2, 3, 4], 20),
                rand_f64(&[3], 21),
                rand_f64(&[3], 22),
            ],
        );
    }

    #[test]
    fn bad_inputs_are_errors_naming_the_op_and_shapes() {
        let x = Tensor::zeros(&[2, 4, 5, 5], DType::F32, Device::Cpu).unwrap();
        let short = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
        let ok = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
        let err = batch_norm(&x, Some(&short), Some(&ok), None, None, true, 0.1, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("batch_norm:") && err.contains("[3]") && err.contains("[2, 4, 5, 5]"),
            "{err}"
        );
        let err = batch_norm(&x, Some(&ok), Some(&short), None, None, false, 0.1, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("running_var") && err.contains("[3]"), "{err}");
        let v = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
        assert!(batch_norm(&v, None, None, None, None, true, 0.1, 1e-5).is_err());
        let single = Tensor::zeros(&[1, 4], DType::F32, Device::Cpu).unwrap();
        let err = batch_norm(&single, None, None, None, None, true, 0.1, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[1, 4]"), "{err}");
        assert!(batch_norm(&x, None, None, None, None, false, 0.1, 1e-5).is_err());
        let f64_stats = Tensor::zeros(&[4], DType::F64, Device::Cpu).unwrap();
        assert!(batch_norm(&x, Some(&f64_stats), None, None, None, true, 0.1, 1e-5).is_err());
    }
}
