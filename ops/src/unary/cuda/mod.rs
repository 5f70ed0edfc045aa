//! The unary ops and their backward on a CUDA device (`unary.cu`): one launch each, writing a
//! fresh dense output. Dense inputs take the kernels' dense form (128-bit packs when aligned),
//! strided ones are read through their layouts.
//!
//! Outputs keep the memory format of a dense input (channels-last in, channels-last out,
//! computed in storage order), as the CPU kernels do; strided inputs give row-major outputs.
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::{MemoryFormat, Result, Tensor};

use super::shape::UnaryKind;
use crate::elementwise_plan::run_into_new;
use launch::{backward_name, unary_backward_launch, unary_launch};

/// `kind(x)` as a fresh tensor on `x`'s device, in `x`'s format when `x` is dense in one.
pub(crate) fn forward(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    run_into_new(
        kind.name(),
        x.dims(),
        x.dtype(),
        x.device(),
        x.dense_format().unwrap_or(MemoryFormat::Contiguous),
        &[(x, x.layout())],
        |out, v| unary_launch(kind, out, v[0]),
    )
}

/// The gradient of `kind`'s input from `g` and the saved tensor.
pub(crate) fn backward(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    let op = backward_name(kind);
    if saved.dims() != g.dims() {
        return Err(tandem_core::Error::shape(
            op,
            format!("gradient {:?} vs saved tensor {:?}", g.dims(), saved.dims()),
        ));
    }
    run_into_new(
        op,
        g.dims(),
        g.dtype(),
        g.device(),
        backward_format(kind, g, saved),
        &[(g, g.layout()), (saved, saved.layout())],
        |out, v| unary_backward_launch(kind, out, v[0], v[1]),
    )
}

/// The memory format of `kind`'s input gradient, as the CPU kernels choose it: that of `g`
/// when only `g` is read (neg, and pow_scalar with exponent 0 or 1), else that of the first of
/// `g` and `saved` dense in one; row-major when none is.
fn backward_format(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> MemoryFormat {
    let reads_only_g =
        matches!(kind, UnaryKind::Neg) || matches!(kind, UnaryKind::Pow(p) if p == 0.0 || p == 1.0);
    let format = if reads_only_g {
        g.dense_format()
    } else {
        g.dense_format().or(saved.dense_format())
    };
    format.unwrap_or(MemoryFormat::Contiguous)
}
