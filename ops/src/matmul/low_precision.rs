//! The batched product of f16/bf16 operands on the CPU: the operands (and the bias) are
//! converted to f32, multiplied by the f32 kernels and the result is rounded once to the low
//! dtype — exactly "low-precision inputs, f32 accumulation". BF16 operands take the native
//! bf16 GEMM instead (`cpu::bf16`), which accumulates in f32 the same way.

use tandem_core::{DType, Result, Tensor};

use super::cpu;
use crate::autocast::is_low;

/// [`cpu::batched_product`] for operands of which at least one is f16 or bf16; the result has
/// that low dtype (the public ops have checked that their operands share a dtype; a backward
/// pairs the output gradient with a saved operand, and whatever float dtype the gradient
/// arrives in is read exactly in f32).
#[allow(clippy::too_many_arguments)]
pub(crate) fn batched_product(
    op: &'static str,
    x: &Tensor,
    tx: bool,
    y: &Tensor,
    ty: bool,
    batch: &[usize],
    out_batch: &[usize],
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    // BF16 operands (and bias) go to the bf16 GEMM (AVX512-BF16 where the CPU has it).
    if let Some(out) = cpu::bf16::batched_product(op, x, tx, y, ty, batch, out_batch, bias)? {
        return Ok(out);
    }
    let low = if is_low(x.dtype()) {
        x.dtype()
    } else {
        y.dtype()
    };
    let wide = |t: &Tensor| t.to_dtype(DType::F32);
    let bias = bias.map(wide).transpose()?;
    let out = cpu::batched_product(
        op,
        &wide(x)?,
        tx,
        &wide(y)?,
        ty,
        batch,
        out_batch,
        bias.as_ref(),
    )?;
    out.to_dtype(low)
}
