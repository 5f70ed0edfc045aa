//! A safe wrapper over `gemm::gemm` for strided matrices: the matrix products of matmul,
//! linear and the convolutions' column products.

use tandem_core::FloatElement;

/// Products with at least this many multiply-adds let gemm split the work over threads.
pub(crate) const GEMM_PARALLEL_WORK: usize = 1 << 18;

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
