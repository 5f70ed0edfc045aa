//! The autocast policy at the entry of the ops (the scope itself is
//! `tandem_autograd::autocast`). Inside a scope of dtype `d` (bf16 or f16):
//!
//! - **lower-precision list** — [`matmul`](crate::matmul()), [`linear`](crate::linear()),
//!   [`conv2d`](crate::conv2d()): every f32 operand is cast to `d` ([`lower`]; a parameter
//!   through the scope's weight cache, so it is cast once per scope), operands already in a
//!   low dtype stay as they are, f64 is left alone (as PyTorch does); the op computes with f32
//!   accumulation and returns `d`.
//! - **f32 list** — [`softmax`](crate::softmax()), [`log_softmax`](crate::log_softmax()),
//!   [`cross_entropy`](crate::cross_entropy()), [`nll_loss`](crate::nll_loss()),
//!   [`mse_loss`](crate::mse_loss()), [`exp`](crate::exp()), [`log`](crate::log()),
//!   [`pow_scalar`](crate::pow_scalar()), [`sum`](crate::sum()) and
//!   [`sum_all`](crate::sum_all()): f16/bf16 inputs are cast to f32 ([`to_f32`]), so these ops
//!   compute and return f32.
//! - every other op runs in the dtype of its inputs.
//!
//! The lists are PyTorch's (`torch.amp` documentation, "Autocast Op Reference"), restricted to
//! tandem's ops. Its CPU lower-precision list has `conv2d`, `bmm`, `mm`, `linalg_vecdot`,
//! `baddbmm`, `addmm`, `addbmm`, `linear`, `matmul`, ... and its CUDA one `conv2d`, `linear`,
//! `matmul`, `mm`, `bmm`, `addmm`, ...; its CPU f32 list has `mse_loss`, `nll_loss`,
//! `cross_entropy_loss`, `kl_div`, `l1_loss`, ... and its CUDA f32 list `softmax`,
//! `log_softmax`, `cross_entropy`, `nll_loss`, `mse_loss`, `exp`, `log`, `pow`, `sum`, `prod`,
//! `norm`, `layer_norm`, `group_norm`, .... tandem has one scope for both devices and applies
//! the union of the two f32 lists on both (the CUDA entries guard against overflow and lost
//! precision in `exp`, `log`, `pow` and long sums, which a CPU suffers as much). `mean` is on
//! neither list: it computes in f32 internally and returns its input's dtype. Batch norm, on
//! neither list either, keeps f32 statistics and parameters with a low-precision input.
//!
//! Ops call these helpers first thing and use what they return in place of their arguments;
//! outside a scope both return their argument unchanged.

use tandem_autograd::autocast::{autocast_dtype, cached_cast};
use tandem_core::{DType, Device, Error, Result, Tensor};

use crate::cast::cast;

/// An operand of an op on the lower-precision list: cast to the scope's dtype if it is f32
/// (a parameter through the weight cache), otherwise unchanged.
pub(crate) fn lower(t: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(dtype) if t.dtype() == DType::F32 => cached_cast(t, dtype, |p| cast(p, dtype)),
        _ => Ok(t.clone()),
    }
}

/// [`lower`] for an optional operand (a bias).
pub(crate) fn lower_opt(t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(lower).transpose()
}

/// An input of an op on the f32 list: cast to f32 inside a scope if it is f16 or bf16,
/// otherwise unchanged.
pub(crate) fn to_f32(t: &Tensor) -> Result<Tensor> {
    if autocast_dtype().is_some() && is_low(t.dtype()) {
        cast(t, DType::F32)
    } else {
        Ok(t.clone())
    }
}

/// Whether `dtype` is one of the half-precision float formats.
pub(crate) fn is_low(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// Checks the dtype of a matrix op's operand (matmul, linear, conv2d): f32 or f64 anywhere,
/// f16 or bf16 on the CPU (computed through f32; the CUDA kernels for them are not there yet).
pub(crate) fn matrix_dtype(op: &'static str, t: &Tensor) -> Result<DType> {
    match (t.dtype(), t.device()) {
        (DType::F32 | DType::F64, _) => Ok(t.dtype()),
        (DType::F16 | DType::BF16, Device::Cpu) => Ok(t.dtype()),
        (dtype @ (DType::F16 | DType::BF16), Device::Cuda(_)) => Err(Error::UnsupportedDType {
            op,
            dtype,
            supported: "f32, f64 on CUDA devices (f16 and bf16 run on the CPU only)",
        }),
        (dtype, _) => Err(Error::UnsupportedDType {
            op,
            dtype,
            supported: "f32, f64, f16, bf16",
        }),
    }
}

#[cfg(test)]
mod tests;
