//! Mixed precision for every float op other than the autocast ops (matmul, linear, conv2d):
//! f16 and bf16 inputs with PyTorch's semantics — compute in f32 (every accumulation in f32),
//! return the input's dtype, and give each input a gradient of its own dtype.
//!
//! The general path runs the op's f32 kernel between recorded casts: the half inputs are
//! widened to f32 (exact), the f32 op runs and records its own backward, and its output is
//! rounded once to the half dtype. Autograd sees `cast → op → cast`, so the backward rounds the
//! incoming gradient's widening back out (exact) and the input gradient is rounded once to the
//! input's dtype. The hot memory-bound ops of a ResNet step (relu, add, add_relu) have native
//! CPU loops instead that load halves, compute in f32 and store halves in one pass
//! (`cpu/half.rs`), and so has the batch-norm family (`batch_norm/cpu/half.rs`: f32 parameters
//! and statistics, half input, output and gradients, both layouts).
//!
//! Binary ops promote mixed float dtypes as PyTorch does: the same dtype stays, a half with
//! f32 or with the other half gives f32, anything with f64 gives f64.

use tandem_autograd::record_fn;
use tandem_core::{DType, Error, Result, Tensor};

/// `x` converted to `dtype`, recorded in the graph: the backward converts the gradient to
/// `x`'s dtype. Returns `x` itself when it already has `dtype`.
pub(crate) fn cast_recorded(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let from = x.dtype();
    if from == dtype {
        return Ok(x.clone());
    }
    let out = x.to_dtype(dtype)?;
    Ok(record_fn(out, &[x], "cast", move || {
        move |g: &Tensor| Ok(vec![Some(g.to_dtype(from)?)])
    }))
}

/// `x` widened to f32 (recorded: the gradient comes back in `x`'s dtype) when it is a half
/// (f16, bf16); any other tensor as it is.
pub fn widen(x: &Tensor) -> Result<Tensor> {
    if x.dtype().is_half() {
        cast_recorded(x, DType::F32)
    } else {
        Ok(x.clone())
    }
}

/// Runs the f32 op `f` on `inputs` with every half among them widened to f32, and rounds its
/// output once to `out` (recorded, so the gradients come back in each input's dtype). For ops
/// outside this crate built on its phases (SyncBatchNorm), hence generic over the error type.
pub fn via_f32<E: From<Error>>(
    out: DType,
    inputs: &[&Tensor],
    f: impl FnOnce(&[Tensor]) -> std::result::Result<Tensor, E>,
) -> std::result::Result<Tensor, E> {
    let wide = inputs
        .iter()
        .map(|t| widen(t))
        .collect::<Result<Vec<_>>>()?;
    Ok(cast_recorded(&f(&wide)?, out)?)
}

/// The dtype of a binary op between float dtypes `a` and `b` (PyTorch's promotion): `a` when
/// they agree, f64 when either is f64, else f32. `None` when either is not a float.
pub(crate) fn promote(a: DType, b: DType) -> Option<DType> {
    if !a.is_float() || !b.is_float() {
        return None;
    }
    Some(if a == b {
        a
    } else if a == DType::F64 || b == DType::F64 {
        DType::F64
    } else {
        DType::F32
    })
}

/// The mixed-precision path of a binary op: `Some` when either input is a half and both are
/// floats. Both inputs are cast (recorded) to the promoted dtype — f32 in place of a half —
/// `f` runs on them, and its output is rounded to the promoted dtype. `None` leaves the inputs
/// to the op's own checks (which name the op, the dtypes and the devices).
pub(crate) fn binary_via(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    if !a.dtype().is_half() && !b.dtype().is_half() {
        return None;
    }
    let out = promote(a.dtype(), b.dtype())?;
    Some(promoted(a, b, out, f))
}

/// `f` on `a` and `b` cast (recorded) to `out`'s compute dtype (f32 for a half), its output
/// rounded to `out`.
fn promoted(
    a: &Tensor,
    b: &Tensor,
    out: DType,
    f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let compute = if out.is_half() { DType::F32 } else { out };
    let (a, b) = (cast_recorded(a, compute)?, cast_recorded(b, compute)?);
    cast_recorded(&f(&a, &b)?, out)
}
