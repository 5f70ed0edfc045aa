//! The SGD step on the CPU: a host loop per parameter, in the parameter's dtype.

use tandem_core::{with_float_type, Error as TensorError, FloatElement, Tensor};

use super::{SgdConfig, SgdUpdate, NAME};
use crate::optimizer::LaidOutState;
use crate::Result;

/// Updates every parameter of `updates` (all in host memory).
pub(super) fn update(updates: &[&SgdUpdate], cfg: &SgdConfig) -> Result<()> {
    for u in updates {
        with_float_type!(NAME, u.target.dtype(), T => {
            update_in_place::<T>(&u.target, &u.grad, u.buffer.as_ref(), u.first, cfg)
        })?;
    }
    Ok(())
}

/// One SGD update of a parameter dense in some format (row-major, or channels-last) with a
/// gradient dense in the same format, in its dtype, in storage order; the momentum buffer is
/// laid out like the parameter first ([`LaidOutState`]).
fn update_in_place<T: FloatElement>(
    param: &Tensor,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    first: bool,
    cfg: &SgdConfig,
) -> std::result::Result<(), TensorError> {
    let Some(buffer) = buffer else {
        return update_dense::<T>(param, grad, None, first, cfg);
    };
    let buffer = LaidOutState::new(buffer, param)?;
    update_dense::<T>(param, grad, Some(buffer.tensor()), first, cfg)?;
    buffer.finish()
}

/// [`update_in_place`] once every operand is dense in the parameter's format.
fn update_dense<T: FloatElement>(
    param: &Tensor,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    first: bool,
    cfg: &SgdConfig,
) -> std::result::Result<(), TensorError> {
    let (lr, momentum, weight_decay) = (
        T::from_f64(cfg.lr),
        T::from_f64(cfg.momentum),
        T::from_f64(cfg.weight_decay),
    );
    let keep = T::from_f64(1.0 - cfg.dampening);
    let mut p = param.write_dense_slice::<T>()?;
    let g = grad.read_dense_slice::<T>()?;
    let mut buf_guard = match buffer {
        Some(b) => Some(b.write_dense_slice::<T>()?),
        None => None,
    };
    for i in 0..p.len() {
        let mut d = g[i];
        if cfg.weight_decay != 0.0 {
            d += weight_decay * p[i];
        }
        if let Some(buf) = buf_guard.as_deref_mut() {
            let b = if first {
                d
            } else {
                momentum * buf[i] + keep * d
            };
            buf[i] = b;
            d = if cfg.nesterov { d + momentum * b } else { b };
        }
        p[i] -= lr * d;
    }
    Ok(())
}
