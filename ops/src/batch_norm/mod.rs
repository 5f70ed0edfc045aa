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

#[cfg(test)]
mod add_relu_tests;
mod cpu;
#[cfg(test)]
mod relu_tests;
#[cfg(test)]
mod timing;

use tandem_autograd::record_fn;
use tandem_core::{with_float_type, DType, Error, Result, Tensor};

use crate::util::{float_dtype, same_dtype_device};
use cpu::Dims;

/// Checks that a per-channel argument is `[C]` with the input's dtype and device.
fn check_channel_param(op: &'static str, name: &str, x: &Tensor, t: Option<&Tensor>) -> Result<()> {
    let Some(t) = t else { return Ok(()) };
    same_dtype_device(op, x, t)?;
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
    let epilogue = Epilogue::Plain;
    batch_norm_fused(
        x,
        epilogue,
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    )
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
    let epilogue = Epilogue::Relu;
    batch_norm_fused(
        x,
        epilogue,
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    )
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
    let epilogue = Epilogue::AddRelu(residual);
    batch_norm_fused(
        x,
        epilogue,
        running_mean,
        running_var,
        weight,
        bias,
        training,
        momentum,
        eps,
    )
}

/// What is fused onto batch norm's output (see [`batch_norm_fused`]).
#[derive(Clone, Copy, Debug)]
pub enum Epilogue<'a> {
    /// Nothing: [`batch_norm`].
    Plain,
    /// A ReLU: [`batch_norm_relu`].
    Relu,
    /// A residual add and then a ReLU: [`batch_norm_add_relu`].
    AddRelu(&'a Tensor),
}

impl Epilogue<'_> {
    /// The op's name (in errors and the profiler) and its backward's.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Epilogue::Plain => ("batch_norm", "batch_norm_backward"),
            Epilogue::Relu => ("batch_norm_relu", "batch_norm_relu_backward"),
            Epilogue::AddRelu(_) => ("batch_norm_add_relu", "batch_norm_add_relu_backward"),
        }
    }
}

/// [`batch_norm`], [`batch_norm_relu`] or [`batch_norm_add_relu`], chosen by `epilogue`, with
/// their arguments: for callers (a layer) that pick the fusion at run time. Same semantics,
/// shapes and errors as the op it stands for.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_fused(
    x: &Tensor,
    epilogue: Epilogue<'_>,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let (op, backward_op) = epilogue.names();
    let _profile = tandem_core::profile::scope(op, tandem_core::profile::Phase::Forward);
    let relu = matches!(epilogue, Epilogue::Relu);
    float_dtype(op, x)?;
    if x.rank() < 2 {
        return Err(Error::shape(
            op,
            format!("need input [N, C] or [N, C, ...], got {:?}", x.dims()),
        ));
    }
    check_channel_param(op, "running_mean", x, running_mean)?;
    check_channel_param(op, "running_var", x, running_var)?;
    check_channel_param(op, "weight", x, weight)?;
    check_channel_param(op, "bias", x, bias)?;
    let residual = match epilogue {
        Epilogue::AddRelu(r) => {
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
            Some(r)
        }
        _ => None,
    };
    if eps.is_nan() || eps < 0.0 {
        return Err(Error::invalid(
            op,
            format!("eps must be non-negative, got {eps}"),
        ));
    }
    let d = Dims {
        n: x.dims()[0],
        c: x.dims()[1],
        l: x.dims()[2..].iter().product(),
    };
    let count = d.n * d.l;

    let xc = x.contiguous_detached()?;
    let (mean, var) = if training {
        if count <= 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "training needs more than one value per channel, got input {:?}",
                    x.dims()
                ),
            ));
        }
        let (mean, var) =
            with_float_type!(op, x.dtype(), T => Ok(cpu::moments::<T>(&xc.read_slice::<T>()?, d)))?;
        let unbiased = count as f64 / (count - 1) as f64;
        update_running(running_mean, &mean, momentum, 1.0)?;
        update_running(running_var, &var, momentum, unbiased)?;
        (mean, var)
    } else {
        match (running_mean, running_var) {
            (Some(m), Some(v)) => (m.to_vec_f64()?, v.to_vec_f64()?),
            _ => {
                return Err(Error::invalid(
                    op,
                    format!(
                        "evaluation (training = false) needs running_mean and running_var for input {:?}",
                        x.dims()
                    ),
                ))
            }
        }
    };
    let invstd: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let w: Vec<f64> = match weight {
        Some(w) => w.to_vec_f64()?,
        None => vec![1.0; d.c],
    };
    let b: Vec<f64> = match bias {
        Some(b) => b.to_vec_f64()?,
        None => vec![0.0; d.c],
    };
    let scale: Vec<f64> = (0..d.c).map(|c| w[c] * invstd[c]).collect();
    let shift: Vec<f64> = (0..d.c).map(|c| b[c] - mean[c] * scale[c]).collect();
    let rc = residual.map(|r| r.contiguous_detached()).transpose()?;
    let out = with_float_type!(op, x.dtype(), T => {
        let xs = xc.read_slice::<T>()?;
        let y = match &rc {
            Some(rc) => {
                let rs = rc.read_slice::<T>()?;
                cpu::normalize::<T>(&xs, d, &scale, &shift, cpu::Epilogue::AddRelu(&rs))
            }
            None if relu => cpu::normalize::<T>(&xs, d, &scale, &shift, cpu::Epilogue::Relu),
            None => cpu::normalize::<T>(&xs, d, &scale, &shift, cpu::Epilogue::Plain),
        };
        Tensor::from_vec(y, x.dims(), x.device())
    })?;
    // With a residual, the backward's mask is `y > 0` of the output itself.
    let saved_out = residual.is_some().then(|| out.detach());

    let needs = (
        x.requires_grad(),
        residual.is_some_and(|t| t.requires_grad()),
        weight.is_some_and(|t| t.requires_grad()),
        bias.is_some_and(|t| t.requires_grad()),
    );
    let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
    let mut inputs = vec![x];
    inputs.extend(residual);
    inputs.extend(weight);
    inputs.extend(bias);
    Ok(record_fn(out, &inputs, op, move || {
        move |g: &Tensor| {
            let gc = g.contiguous_detached()?;
            // The gradient batch norm itself sees: g, or behind an add+ReLU the masked g
            // (which is also the residual's gradient).
            let (g_bn, sum_g, sum_g_centered) = match &saved_out {
                Some(y) => with_float_type!(backward_op, g.dtype(), T => {
                    let (gs, ys, xs) =
                        (gc.read_slice::<T>()?, y.read_slice::<T>()?, xc.read_slice::<T>()?);
                    let (masked, sum_g, sum_gc) = cpu::masked_grad_sums::<T>(&gs, &ys, &xs, d, &mean);
                    Ok((Tensor::from_vec(masked, xc.dims(), g.device())?, sum_g, sum_gc))
                })?,
                None => {
                    let (sum_g, sum_gc) = with_float_type!(backward_op, g.dtype(), T => {
                        let mask = relu.then(|| cpu::affine_coefs::<T>(&scale, &shift));
                        let (gs, xs) = (gc.read_slice::<T>()?, xc.read_slice::<T>()?);
                        Ok(cpu::grad_sums::<T>(&gs, &xs, d, &mean, mask.as_deref()))
                    })?;
                    (gc, sum_g, sum_gc)
                }
            };
            // Σ g·x̂ per channel.
            let sum_g_xhat: Vec<f64> = (0..d.c).map(|c| sum_g_centered[c] * invstd[c]).collect();
            let grad_x = if needs.0 {
                let m = count as f64;
                // w/σ per channel: the forward's scale
                let a: &[f64] = &scale;
                let (slope, offset): (Vec<f64>, Vec<f64>) = if training {
                    (0..d.c)
                        .map(|c| {
                            let slope = -a[c] * invstd[c] * sum_g_xhat[c] / m;
                            (slope, -a[c] * sum_g[c] / m - slope * mean[c])
                        })
                        .unzip()
                } else {
                    (vec![0.0; d.c], vec![0.0; d.c])
                };
                Some(with_float_type!(backward_op, g.dtype(), T => {
                    let mask = relu.then(|| cpu::affine_coefs::<T>(&scale, &shift));
                    let (gs, xs) = (g_bn.read_slice::<T>()?, xc.read_slice::<T>()?);
                    let gx = cpu::grad_input::<T>(&gs, &xs, d, a, &slope, &offset, mask.as_deref());
                    Tensor::from_vec(gx, xc.dims(), g.device())
                })?)
            } else {
                None
            };
            let per_channel = |values: &[f64]| -> Result<Tensor> {
                Tensor::from_vec(values.to_vec(), &[d.c], g.device())?.to_dtype(g.dtype())
            };
            let mut grads = vec![grad_x];
            if saved_out.is_some() {
                grads.push(needs.1.then_some(g_bn));
            }
            if has_weight {
                grads.push(if needs.2 {
                    Some(per_channel(&sum_g_xhat)?)
                } else {
                    None
                });
            }
            if has_bias {
                grads.push(if needs.3 {
                    Some(per_channel(&sum_g)?)
                } else {
                    None
                });
            }
            Ok(grads)
        }
    }))
}

/// `running = (1 − momentum)·running + momentum·factor·stat`, in place.
fn update_running(
    running: Option<&Tensor>,
    stat: &[f64],
    momentum: f64,
    factor: f64,
) -> Result<()> {
    let Some(r) = running else { return Ok(()) };
    let old = r.to_vec_f64()?;
    let new: Vec<f64> = old
        .iter()
        .zip(stat)
        .map(|(o, s)| (1.0 - momentum) * o + momentum * factor * s)
        .collect();
    let update = Tensor::from_vec(new, r.dims(), r.device())?;
    let update = if r.dtype() == DType::F64 {
        update
    } else {
        update.to_dtype(r.dtype())?
    };
    r.copy_(&update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::Device;

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
