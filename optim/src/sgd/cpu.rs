//! The SGD step on the CPU: a host loop per parameter, in the parameter's dtype.

use tandem_core::{with_float_type, Error as TensorError, FloatElement, MemoryFormat, Tensor};

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

/// One SGD update of a parameter dense in some format (row-major, or channels-last) with a
/// gradient dense in the same format, in its dtype, in storage order. A momentum buffer laid
/// out otherwise (one loaded from a checkpoint, say) is re-laid out like the parameter first,
/// in place, or else updated through a copy.
fn update_in_place<T: FloatElement>(
    param: &Tensor,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    first: bool,
    cfg: &SgdConfig,
) -> std::result::Result<(), TensorError> {
    let format = param.dense_format();
    match buffer {
        Some(b) if b.dense_format() != format => {
            let format = format.unwrap_or(MemoryFormat::Contiguous);
            if b.to_memory_format_(format).is_err() {
                let copy = b.contiguous_in(format)?;
                update_dense::<T>(param, grad, Some(&copy), first, cfg)?;
                return b.copy_(&copy);
            }
            update_dense::<T>(param, grad, buffer, first, cfg)
        }
        _ => update_dense::<T>(param, grad, buffer, first, cfg),
    }
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
