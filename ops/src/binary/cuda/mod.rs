//! The binary ops on a CUDA device (`binary.cu`): one launch per op, writing a fresh dense
//! output. Same-shape dense operands take the kernels' dense form (128-bit packs when aligned);
//! broadcast or strided operands are read through their layouts, a broadcast dim having stride
//! 0, so nothing is expanded or copied first.
//!
//! The output's memory format follows the CPU's rule (`cpu::output_format`): channels-last
//! operands give a channels-last output, computed in its storage order (see
//! [`run_into_new`]).
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::{MemoryFormat, Result, Tensor};

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
        super::cpu::output_format(a, b, shape),
        &[(a, &la), (b, &lb)],
        |out, x| binary_launch(kind, out, x[0], x[1]),
    )
}

/// `max(0, a + b)` of two tensors of one shape, in `a`'s format when `a` is dense in one.
pub(crate) fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    run_into_new(
        "add_relu",
        a.dims(),
        a.dtype(),
        a.device(),
        a.dense_format().unwrap_or(MemoryFormat::Contiguous),
        &[(a, a.layout()), (b, b.layout())],
        |out, x| add_relu_launch(out, x[0], x[1]),
    )
}

/// `x ∘ c` for a scalar `c`, in `x`'s format when `x` is dense in one.
pub(crate) fn scalar(kind: ScalarKind, x: &Tensor, c: f64) -> Result<Tensor> {
    run_into_new(
        kind.name(),
        x.dims(),
        x.dtype(),
        x.device(),
        x.dense_format().unwrap_or(MemoryFormat::Contiguous),
        &[(x, x.layout())],
        |out, v| scalar_launch(kind, out, v[0], c),
    )
}
