//! CPU kernels of the matrix products: a safe wrapper over `gemm::gemm` for strided matrices,
//! and the batched product (with broadcast batch dims, optionally summed into a smaller batch)
//! that matmul, its backward and linear are built on.
//!
//! Operands are read in place through their layouts (a transposed operand is just swapped
//! strides), so no operand is copied. Where the batch can be folded into the rows of a single
//! product (a batch of matrices times one matrix) or into its contraction (the gradient of a
//! broadcast operand), one large gemm replaces many small ones.

use rayon::prelude::*;
use smallvec::SmallVec;
use tandem_core::{with_float_type, Element, FloatElement, Result, Tensor};

/// Products with at least this many multiply-adds let gemm split the work over threads.
const GEMM_PARALLEL_WORK: usize = 1 << 18;

/// Where a matrix sits in a slice: element `(i, j)` is at `offset + i·rs + j·cs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatRef {
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl MatRef {
    /// A dense row-major matrix with `cols` columns starting at `offset`.
    pub fn row_major(offset: usize, cols: usize) -> Self {
        MatRef {
            offset,
            rs: cols,
            cs: 1,
        }
    }

    /// The transposed matrix (same storage, swapped strides).
    pub fn t(self) -> Self {
        MatRef {
            offset: self.offset,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// One past the largest index a `rows × cols` matrix touches (0 when it is empty).
    fn extent(self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            0
        } else {
            self.offset + (rows - 1) * self.rs + (cols - 1) * self.cs + 1
        }
    }
}

/// Whether gemm may use the rayon pool for an `m × k · k × n` product.
fn parallelism(m: usize, n: usize, k: usize, allow: bool) -> gemm::Parallelism {
    let work = m.saturating_mul(n).saturating_mul(k);
    if allow && work >= GEMM_PARALLEL_WORK && rayon::current_num_threads() > 1 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`; `dst` is `m × n`, `lhs` is
/// `m × k`, `rhs` is `k × n`. `parallel` lets gemm use the rayon pool for large products
/// (pass false when already inside a parallel loop).
///
/// `dst` must map distinct `(i, j)` to distinct elements (every caller passes a dense matrix).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into<T: FloatElement>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    d: MatRef,
    lhs: &[T],
    l: MatRef,
    rhs: &[T],
    r: MatRef,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(d.extent(m, n) <= dst.len(), "gemm_into: dst out of bounds");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[d.offset + i * d.rs + j * d.cs] = T::ZERO;
                }
            }
        }
        return;
    }
    assert!(l.extent(m, k) <= lhs.len(), "gemm_into: lhs out of bounds");
    assert!(r.extent(k, n) <= rhs.len(), "gemm_into: rhs out of bounds");
    // SAFETY: the asserts above keep every index gemm forms (offset + i·rs + j·cs inside the
    // stated sizes) within the three slices; `dst` is a unique borrow, so it aliases neither
    // operand; `T` is f32 or f64 (the only `FloatElement`s), which gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(d.offset),
            d.cs as isize,
            d.rs as isize,
            accumulate,
            lhs.as_ptr().add(l.offset),
            l.cs as isize,
            l.rs as isize,
            rhs.as_ptr().add(r.offset),
            r.cs as isize,
            r.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism(m, n, k, parallel),
        )
    }
}

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
    let (st, dims) = (t.layout().strides(), t.dims());
    let lead = batch.len() + 2 - rank;
    let batch_strides = (0..batch.len())
        .map(|d| {
            if d < lead || dims[d - lead] == 1 {
                0
            } else {
                st[d - lead]
            }
        })
        .collect();
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
        let bias_values: Option<Vec<T>> = match bias {
            Some(b) => Some(b.to_vec::<T>()?),
            None => None,
        };
        let gx = x.storage().read_host("matmul")?;
        let gy_own;
        let ys: &[T] = if y.storage().same_buffer(x.storage()) {
            T::slice(&gx).expect("dtype checked")
        } else {
            gy_own = y.storage().read_host("matmul")?;
            T::slice(&gy_own).expect("dtype checked")
        };
        let xs: &[T] = T::slice(&gx).expect("dtype checked");
        let lhs = operand(x, xs, batch, tx);
        let rhs = operand(y, ys, batch, ty);
        let out = product_kernel(&lhs, &rhs, (m, n, k), batch, out_batch, bias_values.as_deref());
        let mut shape: Vec<usize> = out_batch.to_vec();
        shape.extend([m, n]);
        Tensor::from_vec(out, &shape, x.device())
    })
}

fn product_kernel<T: FloatElement>(
    lhs: &Operand<'_, T>,
    rhs: &Operand<'_, T>,
    (m, n, k): (usize, usize, usize),
    batch: &[usize],
    out_batch: &[usize],
    bias: Option<&[T]>,
) -> Vec<T> {
    let out_count: usize = out_batch.iter().product();
    let batch_count: usize = batch.iter().product();
    // Every element is written by the products below unless there is nothing to multiply.
    let mut out = if k == 0 || batch_count == 0 {
        tandem_core::alloc::zeroed(out_count * m * n)
    } else {
        tandem_core::alloc::uninit(out_count * m * n)
    };
    if let Some(b) = bias {
        out.chunks_mut(n.max(1))
            .for_each(|row| row.copy_from_slice(b));
    }
    let accumulate = bias.is_some();
    if out.is_empty() {
        return out;
    }
    if batch_count == 0 {
        return out;
    }
    let dense = MatRef::row_major(0, n);
    let reduced = out_count != batch_count;

    if !reduced {
        // Fold the batch into the rows: a batch of matrices times one matrix is one product
        // with `batch·m` rows.
        let rhs_fixed = rhs.batch_strides.iter().all(|&s| s == 0);
        if batch_count > 1 && rhs_fixed && lhs.batch_extends(batch, m, lhs.mat.rs) {
            let l = lhs.at(&vec![0; batch.len()]);
            gemm_into(
                (batch_count * m, n, k),
                &mut out,
                dense,
                lhs.data,
                l,
                rhs.data,
                rhs.mat,
                accumulate,
                true,
            );
            return out;
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
        return out;
    }

    // Reduction over broadcast batch dims. When the whole batch is summed and both operands'
    // batch dims continue their contraction dim, the sum is one product with `batch·k` depth.
    if out_count == 1
        && lhs.batch_extends(batch, k, lhs.mat.cs)
        && rhs.batch_extends(batch, k, rhs.mat.rs)
    {
        let zero = vec![0; batch.len()];
        gemm_into(
            (m, n, batch_count * k),
            &mut out,
            dense,
            lhs.data,
            lhs.at(&zero),
            rhs.data,
            rhs.at(&zero),
            accumulate,
            true,
        );
        return out;
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
            &mut out,
            MatRef::row_major(off, n),
            lhs.data,
            lhs.at(&idx),
            rhs.data,
            rhs.at(&idx),
            true,
            true,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_into_reads_transposed_operands_and_accumulates() {
        // lhs = [[1, 2], [3, 4]] stored column-major; rhs = [[5, 6], [7, 8]] row-major.
        let lhs = [1.0f64, 3.0, 2.0, 4.0];
        let rhs = [5.0f64, 6.0, 7.0, 8.0];
        let mut dst = [1.0f64; 4];
        gemm_into(
            (2, 2, 2),
            &mut dst,
            MatRef::row_major(0, 2),
            &lhs,
            MatRef::row_major(0, 2).t(),
            &rhs,
            MatRef::row_major(0, 2),
            true,
            false,
        );
        assert_eq!(dst, [20.0, 23.0, 44.0, 51.0]);
        gemm_into(
            (2, 2, 0),
            &mut dst,
            MatRef::row_major(0, 2),
            &lhs,
            MatRef::row_major(0, 2),
            &rhs,
            MatRef::row_major(0, 2),
            false,
            false,
        );
        assert_eq!(dst, [0.0; 4]);
    }
}
