//! CPU kernels of the matrix products: a safe wrapper over `gemm::gemm` for strided matrices,
//! and the batched product (with broadcast batch dims, optionally summed into a smaller batch)
//! that matmul, its backward and linear are built on.
//!
//! Operands are read in place through their layouts (a transposed operand is just swapped
//! strides), so no operand is copied. Where the batch can be folded into the rows of a single
//! product (a batch of matrices times one matrix) or into its contraction (the gradient of a
//! broadcast operand), one large gemm replaces many small ones.

// The product of BF16 operands by the bf16 GEMM.
pub(super) mod bf16;

use super::shape::batch_strides;
use rayon::prelude::*;
use smallvec::SmallVec;
use tandem_core::{checked_numel, with_float_type, FloatElement, Result, Tensor};

use crate::cpu::gemm::{gemm_into, MatRef, GEMM_PARALLEL_WORK};
use crate::cpu::memory::{self, host_slice};

/// One operand of a batched product: its storage, the stride of each (full) batch dim (0 where
/// it is broadcast) and the matrix of batch element 0.
struct Operand<'a, T> {
    data: &'a [T],
    batch_strides: SmallVec<[usize; 6]>,
    mat: MatRef,
}

impl<T> Operand<'_, T> {
    fn at(&self, batch_index: &[usize]) -> MatRef {
        let off: usize = batch_index
            .iter()
            .zip(&self.batch_strides)
            .map(|(i, s)| i * s)
            .sum();
        MatRef {
            offset: self.mat.offset + off,
            ..self.mat
        }
    }

    /// If the batch dims lie evenly after a matrix dim of `len` entries at stride `stride`
    /// (so batch and that dim form one longer dim of the same stride), returns true.
    fn batch_extends(&self, batch: &[usize], len: usize, stride: usize) -> bool {
        let mut expected = len * stride;
        for (&size, &s) in batch.iter().zip(&self.batch_strides).rev() {
            if size == 1 {
                continue;
            }
            if s != expected {
                return false;
            }
            expected *= size;
        }
        true
    }
}

/// Describes tensor `t` (dims `[batch_t..., r, c]`) as an operand of a product over the full
/// batch `batch`, transposed when `trans`.
fn operand<'a, T>(t: &Tensor, data: &'a [T], batch: &[usize], trans: bool) -> Operand<'a, T> {
    let rank = t.rank();
    let st = t.layout().strides();
    let batch_strides = batch_strides(t, batch);
    let mat = MatRef {
        offset: t.layout().offset(),
        rs: st[rank - 2],
        cs: st[rank - 1],
    };
    Operand {
        data,
        batch_strides,
        mat: if trans { mat.t() } else { mat },
    }
}

fn unravel(mut i: usize, shape: &[usize], out: &mut [usize]) {
    for d in (0..shape.len()).rev() {
        out[d] = i % shape[d];
        i /= shape[d];
    }
}

/// The batched product `op(x) · op(y)` where `op` transposes the last two dims when the flag
/// is set. `x` is `[bx..., m, k]` after `op`, `y` is `[by..., k, n]`; the batch dims broadcast
/// to `batch` (the caller has checked that they do and that the inner sizes agree). The result
/// has shape `[out_batch..., m, n]`, where `out_batch` broadcasts to `batch`; batch entries
/// that map to the same output entry are summed (this is how a broadcast operand's gradient
/// is reduced). `bias` (length `n`) is added to every row.
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
    with_float_type!(op, x.dtype(), T => {
        let xd = x.dims();
        let yd = y.dims();
        let (m, k) = if tx { (xd[xd.len() - 1], xd[xd.len() - 2]) } else { (xd[xd.len() - 2], xd[xd.len() - 1]) };
        let n = if ty { yd[yd.len() - 2] } else { yd[yd.len() - 1] };
        let mut shape: Vec<usize> = out_batch.to_vec();
        shape.extend([m, n]);
        let numel = checked_numel(op, &shape)?;
        let bias_values: Option<Vec<T>> = match bias {
            Some(b) => Some(memory::gather::<T>(op, b)?),
            None => None,
        };
        let gx = x.storage().read_host(op)?;
        let gy_own;
        let ys: &[T] = if y.storage().same_buffer(x.storage()) {
            host_slice::<T>(op, &gx)?
        } else {
            gy_own = y.storage().read_host(op)?;
            host_slice::<T>(op, &gy_own)?
        };
        let xs: &[T] = host_slice::<T>(op, &gx)?;
        let lhs = operand(x, xs, batch, tx);
        let rhs = operand(y, ys, batch, ty);
        let out = product_kernel(op, &lhs, &rhs, (m, n, k), (batch, out_batch), numel, bias_values.as_deref())?;
        Tensor::from_vec(out, &shape, x.device())
    })
}

/// The product into a fresh buffer of `numel` (`= out_count·m·n`, checked) elements.
fn product_kernel<T: FloatElement>(
    op: &'static str,
    lhs: &Operand<'_, T>,
    rhs: &Operand<'_, T>,
    (m, n, k): (usize, usize, usize),
    (batch, out_batch): (&[usize], &[usize]),
    numel: usize,
    bias: Option<&[T]>,
) -> Result<Vec<T>> {
    let out_count: usize = out_batch.iter().product();
    let batch_count: usize = batch.iter().product();
    // Every element is written by the products below unless there is nothing to multiply.
    let mut out = if k == 0 || batch_count == 0 {
        memory::zeroed(op, numel)?
    } else {
        memory::uninit(op, numel)?
    };
    if let Some(b) = bias {
        out.chunks_mut(n.max(1))
            .for_each(|row| row.copy_from_slice(b));
    }
    let accumulate = bias.is_some();
    if out.is_empty() {
        return Ok(out);
    }
    if batch_count == 0 {
        return Ok(out);
    }
    if out_count == batch_count {
        batched_products(lhs, rhs, (m, n, k), batch, &mut out, accumulate);
    } else {
        summed_products(
            lhs,
            rhs,
            (m, n, k),
            (batch, out_batch),
            &mut out,
            accumulate,
        );
    }
    Ok(out)
}

/// The products of a batch that does not sum (`out` holds one `m×n` matrix per batch entry).
fn batched_products<T: FloatElement>(
    lhs: &Operand<'_, T>,
    rhs: &Operand<'_, T>,
    (m, n, k): (usize, usize, usize),
    batch: &[usize],
    out: &mut [T],
    accumulate: bool,
) {
    let batch_count: usize = batch.iter().product();
    let dense = MatRef::row_major(0, n);
    // Fold the batch into the rows: a batch of matrices times one matrix is one product
    // with `batch·m` rows.
    let rhs_fixed = rhs.batch_strides.iter().all(|&s| s == 0);
    if batch_count > 1 && rhs_fixed && lhs.batch_extends(batch, m, lhs.mat.rs) {
        let l = lhs.at(&vec![0; batch.len()]);
        gemm_into(
            (batch_count * m, n, k),
            out,
            dense,
            lhs.data,
            l,
            rhs.data,
            rhs.mat,
            accumulate,
            true,
        );
        return;
    }
    let work = m * n * k;
    let run = |b: usize, dst: &mut [T], parallel: bool| {
        let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, batch.len());
        unravel(b, batch, &mut idx);
        gemm_into(
            (m, n, k),
            dst,
            dense,
            lhs.data,
            lhs.at(&idx),
            rhs.data,
            rhs.at(&idx),
            accumulate,
            parallel,
        );
    };
    if batch_count > 1 && work < GEMM_PARALLEL_WORK {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(b, dst)| run(b, dst, false));
    } else {
        out.chunks_mut(m * n)
            .enumerate()
            .for_each(|(b, dst)| run(b, dst, true));
    }
}

/// The products of a batch whose broadcast batch dims sum into `out`.
fn summed_products<T: FloatElement>(
    lhs: &Operand<'_, T>,
    rhs: &Operand<'_, T>,
    (m, n, k): (usize, usize, usize),
    (batch, out_batch): (&[usize], &[usize]),
    out: &mut [T],
    accumulate: bool,
) {
    let out_count: usize = out_batch.iter().product();
    let batch_count: usize = batch.iter().product();
    let dense = MatRef::row_major(0, n);
    // Reduction over broadcast batch dims. When the whole batch is summed and both operands'
    // batch dims continue their contraction dim, the sum is one product with `batch·k` depth.
    if out_count == 1
        && lhs.batch_extends(batch, k, lhs.mat.cs)
        && rhs.batch_extends(batch, k, rhs.mat.rs)
    {
        let zero = vec![0; batch.len()];
        gemm_into(
            (m, n, batch_count * k),
            out,
            dense,
            lhs.data,
            lhs.at(&zero),
            rhs.data,
            rhs.at(&zero),
            accumulate,
            true,
        );
        return;
    }
    // General case: accumulate each batch entry's product into its output entry.
    let lead = batch.len() - out_batch.len();
    let mut out_strides: SmallVec<[usize; 6]> = SmallVec::from_elem(0, batch.len());
    let mut acc = m * n;
    for d in (0..batch.len()).rev() {
        let size = if d < lead { 1 } else { out_batch[d - lead] };
        out_strides[d] = if size == 1 { 0 } else { acc };
        acc *= size;
    }
    let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, batch.len());
    for b in 0..batch_count {
        unravel(b, batch, &mut idx);
        let off: usize = idx.iter().zip(&out_strides).map(|(i, s)| i * s).sum();
        gemm_into(
            (m, n, k),
            out,
            MatRef::row_major(off, n),
            lhs.data,
            lhs.at(&idx),
            rhs.data,
            rhs.at(&idx),
            true,
            true,
        );
    }
}
