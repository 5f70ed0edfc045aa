//! Linear's bias gradient on a CUDA device: the column sums of the output gradient, one cuBLAS
//! `gemv` against a vector of ones (the products themselves go through matmul's batched
//! product, which also fuses the forward's bias).

use tandem_core::{Result, Tensor};

use crate::matmul::cuda::sum_rows_into;

/// The column sums of `g` viewed as `[rows, cols]` (`cols` its last dim) on CUDA: linear's
/// bias gradient, as a dense `[cols]` tensor.
pub(crate) fn column_sums(op: &'static str, g: &Tensor) -> Result<Tensor> {
    let cols = g.dims().last().copied().unwrap_or(1);
    let rows = g.numel().checked_div(cols).unwrap_or(0);
    let out = Tensor::empty(&[cols], g.dtype(), g.device())?;
    let g = g.contiguous_detached()?;
    sum_rows_into(op, &g, rows, cols, &out, false)?;
    Ok(out)
}
