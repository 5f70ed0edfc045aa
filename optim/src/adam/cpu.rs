//! The Adam(W) step on the CPU: a host loop per parameter, in the parameter's dtype.

use tandem_core::{with_float_type, Error as TensorError, FloatElement, Tensor};

use super::{AdamConfig, AdamUpdate, UpdateRule};
use crate::optimizer::LaidOutState;
use crate::Result;

/// Updates every parameter of `updates` (all in host memory), each at its own step count.
pub(super) fn update(
    name: &'static str,
    updates: &[&AdamUpdate],
    cfg: &AdamConfig,
    decoupled: bool,
) -> Result<()> {
    for u in updates {
        let rule = UpdateRule::new(cfg, decoupled, u.step);
        with_float_type!(name, u.target.dtype(), T => {
            update_in_place::<T>(&u.target, &u.grad, u, &rule)
        })?;
    }
    Ok(())
}

/// One Adam(W) update of a parameter dense in some format (row-major, or channels-last) with a
/// gradient dense in the same format, in its dtype, in storage order; the moments are laid out
/// like the parameter first ([`LaidOutState`]).
fn update_in_place<T: FloatElement>(
    param: &Tensor,
    grad: &Tensor,
    state: &AdamUpdate,
    rule: &UpdateRule,
) -> std::result::Result<(), TensorError> {
    let m = LaidOutState::new(&state.exp_avg, param)?;
    let v = LaidOutState::new(&state.exp_avg_sq, param)?;
    let v_max = match &state.max_exp_avg_sq {
        Some(t) if rule.amsgrad => Some(LaidOutState::new(t, param)?),
        _ => None,
    };
    update_dense::<T>(
        param,
        grad,
        [m.tensor(), v.tensor()],
        v_max.as_ref().map(LaidOutState::tensor),
        rule,
    )?;
    m.finish()?;
    v.finish()?;
    v_max.map_or(Ok(()), LaidOutState::finish)
}

/// [`update_in_place`] once every operand is dense in the parameter's format.
fn update_dense<T: FloatElement>(
    param: &Tensor,
    grad: &Tensor,
    [exp_avg, exp_avg_sq]: [&Tensor; 2],
    max_exp_avg_sq: Option<&Tensor>,
    rule: &UpdateRule,
) -> std::result::Result<(), TensorError> {
    let c = |v: f64| T::from_f64(v);
    let (one_minus_beta1, beta2, one_minus_beta2) =
        (c(1.0 - rule.beta1), c(rule.beta2), c(1.0 - rule.beta2));
    let (l2, shrink, eps) = (c(rule.l2), c(rule.shrink), c(rule.eps));
    let (step_size, bias_correction2_sqrt) = (c(rule.step_size), c(rule.bias_correction2_sqrt));
    let mut p = param.write_dense_slice::<T>()?;
    let g = grad.read_dense_slice::<T>()?;
    let mut m = exp_avg.write_dense_slice::<T>()?;
    let mut v = exp_avg_sq.write_dense_slice::<T>()?;
    let mut v_max = match max_exp_avg_sq {
        Some(t) => Some(t.write_dense_slice::<T>()?),
        None => None,
    };
    let decay = rule.decays();
    let shrinks = rule.shrinks();
    for i in 0..p.len() {
        let mut gi = g[i];
        if decay {
            gi += l2 * p[i];
        }
        if shrinks {
            p[i] *= shrink;
        }
        let mi = m[i];
        m[i] = mi + one_minus_beta1 * (gi - mi);
        v[i] = beta2 * v[i] + one_minus_beta2 * gi * gi;
        let second = match v_max.as_deref_mut() {
            Some(v_max) => {
                if v[i] > v_max[i] {
                    v_max[i] = v[i];
                }
                v_max[i]
            }
            None => v[i],
        };
        let denom = second.sqrt() / bias_correction2_sqrt + eps;
        p[i] -= step_size * (m[i] / denom);
    }
    Ok(())
}
