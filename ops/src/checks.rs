//! Input checks shared by the ops, with errors that name the op: dtypes, devices and ranks.

use tandem_core::{DType, Error, Result, Tensor};

/// Checks that two inputs share a dtype and a device.
pub(crate) fn same_dtype_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    a.device().same_as(b.device(), op)?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// Checks that `t` has a float dtype the kernels compute in (f32 or f64).
pub(crate) fn float_dtype(op: &'static str, t: &Tensor) -> Result<DType> {
    match t.dtype() {
        DType::F32 | DType::F64 => Ok(t.dtype()),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64",
        }),
    }
}

/// Checks that `t` has a float dtype an op accepts through mixed precision: f32 and f64, or
/// the 16-bit storage floats f16 and bf16 (which such ops compute in f32).
pub(crate) fn float_or_half(op: &'static str, t: &Tensor) -> Result<DType> {
    match t.dtype() {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(t.dtype()),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64, f16, bf16",
        }),
    }
}
