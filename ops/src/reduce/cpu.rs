//! CPU kernel of sum: reduced dims are moved last, then each output element sums a
//! contiguous block.

use rayon::prelude::*;
use tandem_core::{with_float_type, Element, FloatElement, Result, Tensor};

use crate::util::parallel;

/// Sum over `dims`, returning a tensor of shape `kept` (reduced dims of size 1).
pub(crate) fn sum_kept(x: &Tensor, dims: &[usize], kept: &[usize]) -> Result<Tensor> {
    let keep: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = keep.iter().chain(dims.iter()).copied().collect();
    let permuted = x.view_detached(x.layout().permute("sum", &perm)?)?;
    let c = permuted.contiguous_detached()?;
    let inner: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let outer: usize = keep.iter().map(|&d| x.dims()[d]).product();
    with_float_type!("sum", x.dtype(), T => {
        let data = c.read_slice::<T>()?;
        let out: Vec<T> = if inner == 0 {
            vec![T::ZERO; outer]
        } else if parallel(outer * inner) && outer > 1 {
            data.par_chunks(inner).map(block_sum::<T>).collect()
        } else {
            data.chunks(inner).map(block_sum::<T>).collect()
        };
        drop(data);
        Tensor::from_vec(out, kept, x.device())
    })
}

/// Pairwise-ish summation in 8 lanes: vectorises, and loses less precision than one running
/// sum over long blocks.
fn block_sum<T: FloatElement>(block: &[T]) -> T {
    let mut lanes = [T::ZERO; 8];
    let chunks = block.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    let mut total = T::ZERO;
    for l in lanes {
        total += l;
    }
    for &r in rest {
        total += r;
    }
    total
}
