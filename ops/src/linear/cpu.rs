//! CPU kernel of linear's bias gradient: the column sums of the output gradient. The products
//! themselves go through matmul's batched product.

use tandem_core::{with_float_type, DType, FloatElement, Result, Tensor};

use crate::cpu::memory;

/// [`column_sums`] of an f16/bf16 gradient: summed in f32, rounded once to its dtype.
pub(crate) fn low_precision_column_sums(g: &Tensor) -> Result<Tensor> {
    column_sums(&g.to_dtype(DType::F32)?)?.to_dtype(g.dtype())
}

/// Sums the rows of `g` viewed as `[rows, cols]` (`cols` = its last dim): the gradient of a
/// bias added to every row.
pub(crate) fn column_sums(g: &Tensor) -> Result<Tensor> {
    with_float_type!("linear_backward", g.dtype(), T => {
        let cols = g.dims().last().copied().unwrap_or(1);
        let g = memory::contiguous("linear_backward", g)?;
        let values = g.read_slice::<T>()?;
        Tensor::from_vec(sum_rows::<T>(&values, cols)?, &[cols], g.device())
    })
}

fn sum_rows<T: FloatElement>(values: &[T], cols: usize) -> Result<Vec<T>> {
    let mut acc = memory::zeroed::<T>("linear_backward", cols)?;
    if cols == 0 {
        return Ok(acc);
    }
    for row in values.chunks_exact(cols) {
        acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
    }
    Ok(acc)
}
