//! The SGD step on the CPU: a host loop per parameter, in the parameter's dtype.

use tandem_core::{with_float_type, Error as TensorError, FloatElement, Tensor};

use super::{SgdConfig, SgdUpdate, NAME};
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

/// One SGD update of a contiguous parameter, in its dtype.
fn update_in_place<T: FloatElement>(
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
    let mut p = param.write_slice::<T>()?;
    let g = grad.read_slice::<T>()?;
    let mut buf_guard = match buffer {
        Some(b) => Some(b.write_slice::<T>()?),
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
