//! The binary ops on a CUDA device (`binary.cu`): one launch per op, writing a fresh dense
//! output. Same-shape dense operands take the kernels' dense form (128-bit packs when aligned);
//! broadcast or strided operands are read through their layouts, a broadcast dim having stride
//! 0, so nothing is expanded or copied first.
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::{Result, Tensor};

use super::shape::{BinaryKind, ScalarKind};
use crate::elementwise_plan::run_into_new;
use launch::{add_relu_launch, binary_launch, scalar_launch};

/// `a ∘ b` broadcast to `shape` (already checked), as a fresh tensor on their device.
pub(crate) fn binary(
    op: &'static str,
    kind: BinaryKind,
    a: &Tensor,
    b: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
    let la = a.layout().expand(op, shape)?;
    let lb = b.layout().expand(op, shape)?;
    run_into_new(
        op,
        shape,
        a.dtype(),
        a.device(),
        &[(a, &la), (b, &lb)],
        |out, x| binary_launch(kind, out, x[0], x[1]),
    )
}

/// `max(0, a + b)` of two tensors of one shape.
pub(crate) fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    run_into_new(
        "add_relu",
        a.dims(),
        a.dtype(),
        a.device(),
        &[(a, a.layout()), (b, b.layout())],
        |out, x| add_relu_launch(out, x[0], x[1]),
    )
}

/// `x ∘ c` for a scalar `c`.
pub(crate) fn scalar(kind: ScalarKind, x: &Tensor, c: f64) -> Result<Tensor> {
    run_into_new(
        kind.name(),
        x.dims(),
        x.dtype(),
        x.device(),
        &[(x, x.layout())],
        |out, v| scalar_launch(kind, out, v[0], c),
    )
}
