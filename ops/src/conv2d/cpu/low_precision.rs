//! conv2d with f16/bf16 tensors on the CPU: the inputs are converted to f32, the f32 kernels
//! run, and each result is rounded once to the low dtype — exactly "low-precision inputs, f32
//! accumulation". A native BF16 kernel can replace these functions without touching their
//! callers.

use tandem_core::{DType, Result, Tensor};

use crate::conv2d::shape::{Geometry, Needs};

fn wide(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(DType::F32)
}

/// The forward of conv2d on f16/bf16 CPU tensors (the caller checked that x, weight and bias
/// share the dtype): `[N, O, OH, OW]` in that dtype.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    let bias = bias.map(wide).transpose()?;
    super::conv2d(&wide(x)?, &wide(weight)?, bias.as_ref(), g)?.to_dtype(x.dtype())
}

/// The backward of conv2d on f16/bf16 CPU tensors: the gradients `needs` asks for, in the dtype
/// of `x` (the forward checked that the weight shares it; the output gradient is read in f32
/// whatever float dtype it arrives in).
pub(crate) fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<[Option<Tensor>; 3]> {
    let low = x.dtype();
    let grads = super::conv2d_backward(&wide(x)?, &wide(weight)?, &wide(grad)?, g, needs)?;
    let round = |t: Option<Tensor>| t.map(|t| t.to_dtype(low)).transpose();
    let [input, weight, bias] = grads;
    Ok([round(input)?, round(weight)?, round(bias)?])
}
