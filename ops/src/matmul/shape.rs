//! What both devices' products need to know about an operand's layout.

use tandem_core::Tensor;

/// The element stride of `t` (`[own_batch.., r, c]`) along each dim of the full `batch` it is
/// multiplied over: 0 where `t` has no such dim or broadcasts it (size 1), its own stride
/// otherwise.
pub(crate) fn batch_strides<C: FromIterator<usize>>(t: &Tensor, batch: &[usize]) -> C {
    let (st, dims) = (t.layout().strides(), t.dims());
    let lead = batch.len() + 2 - t.rank();
    (0..batch.len())
        .map(|d| {
            if d < lead || dims[d - lead] == 1 {
                0
            } else {
                st[d - lead]
            }
        })
        .collect()
}
