//! How a batched product of strided row-major matrices becomes cuBLAS calls (which are
//! column-major): the planning half of the CUDA matrix products, pure and tested on the host
//! against an emulation of cuBLAS's contract.
//!
//! A row-major `C = A·B` (`m×n`) is the column-major `Cᵀ = Bᵀ·Aᵀ`, so cuBLAS gets `B` as its
//! first operand and `A` as its second, with `M = n` and `N = m`. A strided operand is read in
//! place when one of its dims has stride 1 and the other a leading dimension at least as large
//! as the first dim's size (a row-major matrix, or a transposed view of one); otherwise the
//! caller makes it dense first. The batch becomes a strided-batched call where every operand's
//! batch dims collapse to one stride; a batch of matrices times one matrix folds into the rows
//! of a single product, and a sum over the whole batch (the gradient of a broadcast operand)
//! folds into the contraction where the operands allow it.

use smallvec::SmallVec;
use tandem_core::{Error, Result};

/// A strided matrix: element `(i, j)` at `offset + i·rs + j·cs` (in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mat {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Stride between rows.
    pub rs: usize,
    /// Stride between columns.
    pub cs: usize,
    /// Offset of element `(0, 0)`.
    pub offset: usize,
}

/// An operand of a batched product: its matrix for batch entry 0 and the stride of each batch
/// dim (0 where the operand is broadcast along it).
#[derive(Clone, Debug)]
pub(crate) struct Operand {
    /// The matrix of batch entry 0 (already transposed where the product transposes it).
    pub mat: Mat,
    /// One stride per dim of the full batch.
    pub batch_strides: SmallVec<[usize; 6]>,
}

/// How cuBLAS reads a row-major matrix `M` when the call needs `Mᵀ`: `trans` = false reads
/// the memory as the column-major `Mᵀ` directly (rows dense, `ld` = row stride), `trans` =
/// true reads it as the column-major `M` (columns dense, `ld` = column stride) and transposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ColMajor {
    /// Whether cuBLAS transposes what it reads (`CUBLAS_OP_T`).
    pub trans: bool,
    /// The leading dimension.
    pub ld: usize,
}

/// `Mᵀ` as cuBLAS can read it in place, or `None` when `m` needs a dense copy first.
pub(crate) fn transposed_operand(m: Mat) -> Option<ColMajor> {
    let (r, c) = (m.rows, m.cols);
    if (m.cs == 1 || c <= 1) && (m.rs >= c.max(1) || r <= 1) {
        let ld = if r <= 1 { c.max(1) } else { m.rs };
        return Some(ColMajor { trans: false, ld });
    }
    if (m.rs == 1 || r <= 1) && (m.cs >= r.max(1) || c <= 1) {
        let ld = if c <= 1 { r.max(1) } else { m.cs };
        return Some(ColMajor { trans: true, ld });
    }
    None
}

/// One cuBLAS `gemm` (or strided-batched `gemm` when `batch > 1`) in cuBLAS's terms:
/// `C[i] = op(A[i])·op(B[i]) (+ C[i] when accumulate)` for `i < batch`, column-major, `A` at
/// element `a_offset + i·stride_a` and likewise `B` and `C`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GemmCall {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `op(A)` and `C`.
    pub m: i32,
    /// Columns of `op(B)` and `C`.
    pub n: i32,
    /// The contraction.
    pub k: i32,
    /// Leading dimension of `A`.
    pub lda: i32,
    /// Leading dimension of `B`.
    pub ldb: i32,
    /// Leading dimension of `C`.
    pub ldc: i32,
    /// Offset of `A[0]`, in elements.
    pub a_offset: usize,
    /// Offset of `B[0]`, in elements.
    pub b_offset: usize,
    /// Offset of `C[0]`, in elements.
    pub c_offset: usize,
    /// Distance between consecutive `A[i]`.
    pub stride_a: i64,
    /// Distance between consecutive `B[i]`.
    pub stride_b: i64,
    /// Distance between consecutive `C[i]`.
    pub stride_c: i64,
    /// Products in the call (1: a plain `gemm`).
    pub batch: i32,
    /// `beta = 1` (accumulate onto `C`) rather than `beta = 0`.
    pub accumulate: bool,
}

/// What the CUDA product does for a batched product.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// These operands (left, right) must be made dense first; then plan again.
    Copy(bool, bool),
    /// Run these calls into the dense output; when `zero_first`, the output must be zeroed
    /// (or hold the bias) first, because every call accumulates.
    Gemms {
        /// The calls, in order.
        calls: Vec<GemmCall>,
        /// Whether the output must be initialised before the calls.
        zero_first: bool,
    },
    /// The whole batch sums into one output matrix and the operands do not fold: compute the
    /// unreduced product into a temporary `[batch, m, n]` and sum its matrices.
    SumThroughTemporary,
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid(
            op,
            format!(
                "{what} {v} exceeds cuBLAS's 32-bit sizes (at most {})",
                i32::MAX
            ),
        )
    })
}

fn long(op: &'static str, what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::invalid(op, format!("{what} {v} exceeds 64 bits")))
}

/// If offset `f·s` reaches every entry of the batch dims `sizes` (strides `strides`) for the
/// flat index `f`, returns `s` (0 when the operand is the same for every entry).
pub(crate) fn uniform_stride(sizes: &[usize], strides: &[usize]) -> Option<usize> {
    let mut step: Option<usize> = None;
    let mut expected = 0;
    for (&size, &stride) in sizes.iter().zip(strides).rev() {
        if size == 1 {
            continue;
        }
        match step {
            None => {
                step = Some(stride);
                expected = stride.checked_mul(size)?;
            }
            Some(_) => {
                if stride != expected {
                    return None;
                }
                expected = expected.checked_mul(size)?;
            }
        }
    }
    Some(step.unwrap_or(0))
}

/// Row-major strides of a dense array of `sizes`.
fn dense_strides(sizes: &[usize], inner: usize) -> SmallVec<[usize; 6]> {
    let mut out: SmallVec<[usize; 6]> = SmallVec::from_elem(0, sizes.len());
    let mut acc = inner;
    for d in (0..sizes.len()).rev() {
        out[d] = acc;
        acc = acc.saturating_mul(sizes[d]);
    }
    out
}

/// The offset of batch entry `idx` of an operand.
fn batch_offset(strides: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(strides).map(|(i, s)| i * s).sum()
}

fn unravel(mut i: usize, shape: &[usize], out: &mut [usize]) {
    for d in (0..shape.len()).rev() {
        out[d] = i % shape[d];
        i /= shape[d];
    }
}

/// The single call `Cᵀ = op(Bᵀ)·op(Aᵀ)` for one product (or a strided batch of them) of a
/// left `m×k` matrix `a` and a right `k×n` matrix `b` into a dense `m×n` output at
/// `c_offset`; `None` when an operand needs a copy.
#[allow(clippy::too_many_arguments)]
fn call(
    op: &'static str,
    a: Mat,
    b: Mat,
    c_offset: usize,
    strides: (usize, usize, usize),
    batch: usize,
    accumulate: bool,
) -> Result<Option<GemmCall>> {
    let (Some(ca), Some(cb)) = (transposed_operand(a), transposed_operand(b)) else {
        return Ok(None);
    };
    let (m, k, n) = (a.rows, a.cols, b.cols);
    Ok(Some(GemmCall {
        trans_a: cb.trans,
        trans_b: ca.trans,
        m: int(op, "the product's column count", n)?,
        n: int(op, "the product's row count", m)?,
        k: int(op, "the contraction", k)?,
        lda: int(op, "a leading dimension", cb.ld)?,
        ldb: int(op, "a leading dimension", ca.ld)?,
        ldc: int(op, "a leading dimension", n.max(1))?,
        a_offset: b.offset,
        b_offset: a.offset,
        c_offset,
        stride_a: long(op, "a batch stride", strides.1)?,
        stride_b: long(op, "a batch stride", strides.0)?,
        stride_c: long(op, "a batch stride", strides.2)?,
        batch: int(op, "the batch", batch)?,
        accumulate,
    }))
}

/// Plans `out = x·y (+ out when accumulate)` where `x` is `[batch.., m, k]`, `y` is
/// `[batch.., k, n]` (operands already transposed as the product needs, batch dims broadcast
/// through zero strides) and `out` is a dense `[out_batch.., m, n]` into which the batch
/// entries that `out_batch` broadcasts sum. The caller has handled empty products (`m`, `n`,
/// `k` or the batch 0).
pub(crate) fn plan(
    op: &'static str,
    x: &Operand,
    y: &Operand,
    batch: &[usize],
    out_batch: &[usize],
    accumulate: bool,
) -> Result<Plan> {
    let need = (
        transposed_operand(x.mat).is_none(),
        transposed_operand(y.mat).is_none(),
    );
    if need.0 || need.1 {
        return Ok(Plan::Copy(need.0, need.1));
    }
    let batch_count: usize = batch.iter().product();
    let out_count: usize = out_batch.iter().product();
    if out_count == batch_count {
        plan_batched(op, x, y, batch, accumulate)
    } else if out_count == 1 {
        plan_summed(op, x, y, batch, accumulate)
    } else {
        plan_partly_summed(op, x, y, batch, out_batch)
    }
}

/// The plan of calls (`None` for one that could not be made, which the operand checks rule
/// out), or a dense copy of both operands.
fn gemms(calls: Vec<Option<GemmCall>>, zero_first: bool) -> Plan {
    match calls.into_iter().collect::<Option<Vec<_>>>() {
        Some(calls) => Plan::Gemms { calls, zero_first },
        // Unreachable: both operands were checked and folding keeps their layout.
        None => Plan::Copy(true, true),
    }
}

/// [`plan`] where no batch entry sums: one output matrix per batch entry.
fn plan_batched(
    op: &'static str,
    x: &Operand,
    y: &Operand,
    batch: &[usize],
    accumulate: bool,
) -> Result<Plan> {
    let (m, n) = (x.mat.rows, y.mat.cols);
    let mn = m * n;
    let batch_count: usize = batch.iter().product();
    // Fold the batch into the rows: a batch of row-major matrices whose rows continue
    // from one entry to the next, times one matrix, is one product with batch·m rows.
    let y_fixed = y.batch_strides.iter().all(|&s| s == 0);
    if batch_count > 1 && y_fixed && x.mat.cs == 1 {
        if let Some(s) = uniform_stride(batch, &x.batch_strides) {
            if s != 0 && s == m * x.mat.rs {
                let rows = Mat {
                    rows: batch_count * m,
                    ..x.mat
                };
                if let Some(c) = call(op, rows, y.mat, 0, (0, 0, 0), 1, accumulate)? {
                    return Ok(gemms(vec![Some(c)], false));
                }
            }
        }
    }
    // The longest suffix of batch dims over which every operand has one stride runs as
    // one strided-batched call; the dims before it loop on the host.
    let out_strides = dense_strides(batch, mn);
    let split = (0..=batch.len())
        .find(|&p| {
            let tail = &batch[p..];
            uniform_stride(tail, &x.batch_strides[p..]).is_some()
                && uniform_stride(tail, &y.batch_strides[p..]).is_some()
        })
        .unwrap_or(batch.len());
    let (head, tail) = batch.split_at(split);
    let inner: usize = tail.iter().product();
    let sx = uniform_stride(tail, &x.batch_strides[split..]).unwrap_or(0);
    let sy = uniform_stride(tail, &y.batch_strides[split..]).unwrap_or(0);
    let outer: usize = head.iter().product();
    let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, head.len());
    let mut calls = Vec::new();
    for o in 0..outer {
        unravel(o, head, &mut idx);
        let a = Mat {
            offset: x.mat.offset + batch_offset(&x.batch_strides, &idx),
            ..x.mat
        };
        let b = Mat {
            offset: y.mat.offset + batch_offset(&y.batch_strides, &idx),
            ..y.mat
        };
        let c_offset = batch_offset(&out_strides, &idx);
        calls.push(call(op, a, b, c_offset, (sx, sy, mn), inner, accumulate)?);
    }
    Ok(gemms(calls, false))
}

/// [`plan`] where the whole batch sums into one output matrix.
fn plan_summed(
    op: &'static str,
    x: &Operand,
    y: &Operand,
    batch: &[usize],
    accumulate: bool,
) -> Result<Plan> {
    let k = x.mat.cols;
    let batch_count: usize = batch.iter().product();
    // The whole batch sums: when both operands' batch dims continue their contraction dim,
    // the sum is one product with batch·k depth.
    let sx = uniform_stride(batch, &x.batch_strides);
    let sy = uniform_stride(batch, &y.batch_strides);
    if sx == Some(k * x.mat.cs) && sy == Some(k * y.mat.rs) {
        let a = Mat {
            cols: batch_count * k,
            ..x.mat
        };
        let b = Mat {
            rows: batch_count * k,
            ..y.mat
        };
        if transposed_operand(a).is_some() && transposed_operand(b).is_some() {
            let c = call(op, a, b, 0, (0, 0, 0), 1, accumulate)?;
            return Ok(gemms(vec![c], false));
        }
    }
    Ok(Plan::SumThroughTemporary)
}

/// [`plan`] where some batch dims sum and others do not.
fn plan_partly_summed(
    op: &'static str,
    x: &Operand,
    y: &Operand,
    batch: &[usize],
    out_batch: &[usize],
) -> Result<Plan> {
    let mn = x.mat.rows * y.mat.cols;
    let batch_count: usize = batch.iter().product();
    // Some batch dims sum and others do not: accumulate each entry's product into its output.
    let lead = batch.len() - out_batch.len();
    let mut out_strides: SmallVec<[usize; 6]> = SmallVec::from_elem(0, batch.len());
    let mut acc = mn;
    for d in (0..batch.len()).rev() {
        let size = if d < lead { 1 } else { out_batch[d - lead] };
        out_strides[d] = if size == 1 { 0 } else { acc };
        acc *= size;
    }
    let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, batch.len());
    let mut calls = Vec::with_capacity(batch_count);
    for e in 0..batch_count {
        unravel(e, batch, &mut idx);
        let a = Mat {
            offset: x.mat.offset + batch_offset(&x.batch_strides, &idx),
            ..x.mat
        };
        let b = Mat {
            offset: y.mat.offset + batch_offset(&y.batch_strides, &idx),
            ..y.mat
        };
        let c_offset = batch_offset(&out_strides, &idx);
        calls.push(call(op, a, b, c_offset, (0, 0, 0), 1, true)?);
    }
    Ok(gemms(calls, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's documented contract for `gemm`/`gemmStridedBatched` (column-major), run on
    /// host memory: the independent reference the plans are executed against.
    fn emulate(call: &GemmCall, a: &[f64], b: &[f64], c: &mut [f64]) {
        let (m, n, k) = (call.m as usize, call.n as usize, call.k as usize);
        let (lda, ldb, ldc) = (call.lda as usize, call.ldb as usize, call.ldc as usize);
        assert!(
            lda >= if call.trans_a { k } else { m }.max(1),
            "lda {call:?}"
        );
        assert!(
            ldb >= if call.trans_b { n } else { k }.max(1),
            "ldb {call:?}"
        );
        assert!(ldc >= m.max(1), "ldc {call:?}");
        for i in 0..call.batch as usize {
            let ao = call.a_offset as i64 + i as i64 * call.stride_a;
            let bo = call.b_offset as i64 + i as i64 * call.stride_b;
            let co = call.c_offset as i64 + i as i64 * call.stride_c;
            for col in 0..n {
                for row in 0..m {
                    let mut s = 0.0;
                    for p in 0..k {
                        let av = if call.trans_a {
                            a[ao as usize + p + row * lda]
                        } else {
                            a[ao as usize + row + p * lda]
                        };
                        let bv = if call.trans_b {
                            b[bo as usize + col + p * ldb]
                        } else {
                            b[bo as usize + p + col * ldb]
                        };
                        s += av * bv;
                    }
                    let at = co as usize + row + col * ldc;
                    c[at] = if call.accumulate { c[at] + s } else { s };
                }
            }
        }
    }

    /// A batched operand over `storage` values 0.1·i: `[own_batch.., r, c]` at `strides`.
    struct Case {
        dims: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        trans: bool,
    }

    impl Case {
        fn dense(dims: &[usize], trans: bool) -> Case {
            let strides = dense_strides(dims, 1).to_vec();
            Case {
                dims: dims.to_vec(),
                strides,
                offset: 0,
                trans,
            }
        }

        fn transposed(dims: &[usize], trans: bool) -> Case {
            // A view of a dense [.., c, r] array with its last two dims swapped.
            let mut swapped = dims.to_vec();
            let r = dims.len();
            swapped.swap(r - 2, r - 1);
            let mut strides = dense_strides(&swapped, 1).to_vec();
            strides.swap(r - 2, r - 1);
            Case {
                dims: dims.to_vec(),
                strides,
                offset: 3,
                trans,
            }
        }

        fn storage_len(&self) -> usize {
            self.offset
                + self
                    .dims
                    .iter()
                    .zip(&self.strides)
                    .map(|(d, s)| d.saturating_sub(1) * s)
                    .sum::<usize>()
                + 1
        }

        /// The element at (batch index over own dims, i, j) after the transposition.
        fn at(&self, data: &[f64], bidx: &[usize], i: usize, j: usize) -> f64 {
            let r = self.dims.len();
            let (i, j) = if self.trans { (j, i) } else { (i, j) };
            let mut off = self.offset + i * self.strides[r - 2] + j * self.strides[r - 1];
            let lead = bidx.len() + 2 - r;
            for d in 0..r - 2 {
                let b = if self.dims[d] == 1 { 0 } else { bidx[d + lead] };
                off += b * self.strides[d];
            }
            data[off]
        }

        fn operand(&self, batch: &[usize]) -> Operand {
            let r = self.dims.len();
            let lead = batch.len() + 2 - r;
            let batch_strides = (0..batch.len())
                .map(|d| {
                    if d < lead || self.dims[d - lead] == 1 {
                        0
                    } else {
                        self.strides[d - lead]
                    }
                })
                .collect();
            let (mut rows, mut cols) = (self.dims[r - 2], self.dims[r - 1]);
            let (mut rs, mut cs) = (self.strides[r - 2], self.strides[r - 1]);
            if self.trans {
                std::mem::swap(&mut rows, &mut cols);
                std::mem::swap(&mut rs, &mut cs);
            }
            Operand {
                mat: Mat {
                    rows,
                    cols,
                    rs,
                    cs,
                    offset: self.offset,
                },
                batch_strides,
            }
        }

        fn densified(&self) -> Case {
            Case::dense(&self.dims, self.trans)
        }
    }

    /// Runs the plan of `x·y` over `batch` into `out_batch` on the emulation and compares it
    /// with direct loops; returns the plan's call count.
    fn check(x: Case, y: Case, batch: &[usize], out_batch: &[usize]) -> usize {
        let (mut x, mut y) = (x, y);
        let mut copies = 0;
        let plan = loop {
            match plan(
                "t",
                &x.operand(batch),
                &y.operand(batch),
                batch,
                out_batch,
                false,
            ) {
                Ok(Plan::Copy(cx, cy)) => {
                    copies += 1;
                    assert!(copies == 1, "a dense copy must plan without copies");
                    if cx {
                        x = x.densified();
                    }
                    if cy {
                        y = y.densified();
                    }
                }
                Ok(p) => break p,
                Err(e) => panic!("{e}"),
            }
        };
        let xm = x.operand(batch).mat;
        let (m, k, n) = (xm.rows, xm.cols, y.operand(batch).mat.cols);
        let xs: Vec<f64> = (0..x.storage_len()).map(|i| 0.1 * i as f64 - 1.0).collect();
        let ys: Vec<f64> = (0..y.storage_len())
            .map(|i| 0.7 - 0.05 * i as f64)
            .collect();
        let out_count: usize = out_batch.iter().product();
        let batch_count: usize = batch.iter().product();
        let mut got = vec![f64::NAN; out_count * m * n];
        let calls = match plan {
            Plan::Gemms { calls, zero_first } => {
                if zero_first {
                    got.iter_mut().for_each(|v| *v = 0.0);
                }
                for c in &calls {
                    emulate(c, &ys, &xs, &mut got);
                }
                calls.len()
            }
            Plan::SumThroughTemporary => {
                let mut temp = vec![f64::NAN; batch_count * m * n];
                let Plan::Gemms { calls, .. } =
                    plan_ok(&x.operand(batch), &y.operand(batch), batch, batch)
                else {
                    panic!("the unreduced product plans gemms")
                };
                for c in &calls {
                    emulate(c, &ys, &xs, &mut temp);
                }
                got.iter_mut().for_each(|v| *v = 0.0);
                for e in 0..batch_count {
                    for (g, t) in got.iter_mut().zip(&temp[e * m * n..]) {
                        *g += t;
                    }
                }
                calls.len() + 1
            }
            Plan::Copy(..) => unreachable!(),
        };
        // Direct loops.
        let mut want = vec![0.0; out_count * m * n];
        let lead = batch.len() - out_batch.len();
        let mut idx = vec![0; batch.len()];
        for e in 0..batch_count {
            unravel(e, batch, &mut idx);
            let mut o = 0;
            for d in 0..out_batch.len() {
                let i = if out_batch[d] == 1 { 0 } else { idx[d + lead] };
                o = o * out_batch[d] + i;
            }
            for i in 0..m {
                for j in 0..n {
                    let s: f64 = (0..k)
                        .map(|p| x.at(&xs, &idx, i, p) * y.at(&ys, &idx, p, j))
                        .sum();
                    want[(o * m + i) * n + j] += s;
                }
            }
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-9 * (1.0 + w.abs()),
                "batch {batch:?} → {out_batch:?}, element {i}: {g} vs {w}"
            );
        }
        calls
    }

    fn plan_ok(x: &Operand, y: &Operand, batch: &[usize], out_batch: &[usize]) -> Plan {
        plan("t", x, y, batch, out_batch, false).unwrap()
    }

    #[test]
    fn single_products_read_dense_and_transposed_operands_in_place() {
        for (tx, ty) in [(false, false), (true, false), (false, true), (true, true)] {
            let xd = if tx { [5, 3] } else { [3, 5] };
            let yd = if ty { [4, 5] } else { [5, 4] };
            assert_eq!(
                check(Case::dense(&xd, tx), Case::dense(&yd, ty), &[], &[]),
                1
            );
            assert_eq!(
                check(
                    Case::transposed(&xd, tx),
                    Case::transposed(&yd, ty),
                    &[],
                    &[]
                ),
                1
            );
        }
        // Vectors as one-row and one-column matrices.
        check(
            Case::dense(&[1, 6], false),
            Case::dense(&[6, 1], false),
            &[],
            &[],
        );
        check(
            Case::dense(&[7, 1], false),
            Case::dense(&[1, 3], false),
            &[],
            &[],
        );
    }

    #[test]
    fn batches_run_as_one_strided_call_or_fold_into_the_rows() {
        // [B, m, k]·[B, k, n]: one strided-batched call.
        let calls = check(
            Case::dense(&[4, 3, 5], false),
            Case::transposed(&[4, 5, 2], false),
            &[4],
            &[4],
        );
        assert_eq!(calls, 1);
        // [B, T, in]·Wᵀ (linear): folds into the rows.
        let x = Case::dense(&[2, 3, 3, 5], false);
        let y = Case::dense(&[4, 5], true);
        let plan = plan_ok(&x.operand(&[2, 3]), &y.operand(&[2, 3]), &[2, 3], &[2, 3]);
        match &plan {
            Plan::Gemms { calls, .. } => assert_eq!((calls.len(), calls[0].batch), (1, 1)),
            other => panic!("{other:?}"),
        }
        check(x, y, &[2, 3], &[2, 3]);
        // A broadcast left operand: a strided call with stride 0.
        assert_eq!(
            check(
                Case::dense(&[3, 5], false),
                Case::dense(&[6, 5, 2], false),
                &[6],
                &[6]
            ),
            1
        );
        // Mixed broadcasting ([2, 1] against [1, 3]) loops over the outer dim.
        assert_eq!(
            check(
                Case::dense(&[2, 1, 3, 4], false),
                Case::dense(&[3, 4, 2], false),
                &[2, 3],
                &[2, 3]
            ),
            2
        );
    }

    #[test]
    fn summed_batches_fold_into_the_contraction_or_go_through_a_temporary() {
        // grad_W of linear: gᵀ·x over [B, R, ·] folds into one product of depth B·R.
        let calls = check(
            Case::dense(&[3, 4, 2], true),
            Case::dense(&[3, 4, 5], false),
            &[3],
            &[],
        );
        assert_eq!(calls, 1);
        // The same with a transposed right operand, whose batch does not continue its
        // contraction dim: through a temporary.
        check(
            Case::dense(&[3, 4, 2], true),
            Case::transposed(&[3, 4, 5], false),
            &[3],
            &[],
        );
        // g·bᵀ summed over the batch: goes through a temporary.
        let calls = check(
            Case::dense(&[3, 2, 5], false),
            Case::dense(&[3, 4, 5], true),
            &[3],
            &[],
        );
        assert_eq!(calls, 2);
        // A partial sum ([2, 3] into [2, 1]): accumulating calls.
        check(
            Case::dense(&[2, 3, 2, 4], false),
            Case::dense(&[2, 3, 4, 3], false),
            &[2, 3],
            &[2, 1],
        );
        check(
            Case::dense(&[2, 3, 2, 4], false),
            Case::dense(&[2, 3, 4, 3], false),
            &[2, 3],
            &[3],
        );
    }

    #[test]
    fn operands_without_a_unit_stride_are_copied_once() {
        // A matrix expanded along its rows (row stride 0) and one with both strides > 1.
        let expanded = Case {
            dims: vec![4, 5],
            strides: vec![0, 1],
            offset: 0,
            trans: false,
        };
        check(expanded, Case::dense(&[5, 3], false), &[], &[]);
        let every_other = Case {
            dims: vec![3, 4],
            strides: vec![16, 2],
            offset: 1,
            trans: false,
        };
        check(Case::dense(&[2, 3], false), every_other, &[], &[]);
        assert_eq!(
            transposed_operand(Mat {
                rows: 4,
                cols: 5,
                rs: 3,
                cs: 1,
                offset: 0
            }),
            None,
            "rows that overlap cannot be a leading dimension"
        );
    }

    #[test]
    fn sizes_beyond_32_bits_are_errors_naming_the_op() {
        let huge = Operand {
            mat: Mat {
                rows: 1 << 31,
                cols: 2,
                rs: 2,
                cs: 1,
                offset: 0,
            },
            batch_strides: SmallVec::new(),
        };
        let small = Operand {
            mat: Mat {
                rows: 2,
                cols: 2,
                rs: 2,
                cs: 1,
                offset: 0,
            },
            batch_strides: SmallVec::new(),
        };
        let err = plan("matmul", &huge, &small, &[], &[], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("matmul") && err.contains("32-bit"), "{err}");
    }

    #[test]
    fn uniform_strides_skip_unit_dims_and_reject_gaps() {
        assert_eq!(uniform_stride(&[2, 1, 3], &[30, 7, 10]), Some(10));
        assert_eq!(uniform_stride(&[2, 3], &[0, 0]), Some(0));
        assert_eq!(uniform_stride(&[2, 3], &[12, 0]), None);
        assert_eq!(uniform_stride(&[], &[]), Some(0));
        assert_eq!(uniform_stride(&[2, 3], &[40, 10]), None);
    }
}
