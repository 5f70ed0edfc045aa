//! The unary ops and their backward on a CUDA device (`unary.cu`): one launch each, writing a
//! fresh dense output. Dense inputs take the kernels' dense form (128-bit packs when aligned),
//! strided ones are read through their layouts.
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::{Result, Tensor};

use super::shape::UnaryKind;
use crate::elementwise_plan::run_into_new;
use launch::{backward_name, unary_backward_launch, unary_launch};

/// `kind(x)` as a fresh tensor on `x`'s device.
pub(crate) fn forward(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    run_into_new(
        kind.name(),
        x.dims(),
        x.dtype(),
        x.device(),
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
        &[(g, g.layout()), (saved, saved.layout())],
        |out, v| unary_backward_launch(kind, out, v[0], v[1]),
    )
}
