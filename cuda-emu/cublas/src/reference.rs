//! The reference products the emulated cuBLAS runs: plain loops over column-major matrices, in
//! cuBLAS's semantics, written for the emulator (not tandem's CPU matmul, so a wrong leading
//! dimension or transpose flag in tandem's glue gives a different answer, not the same one).
//!
//! Element `(i, j)` of a stored matrix with leading dimension `ld` is at `i + j·ld` elements
//! from its start. `op(A)` is `A` or `Aᵀ`: with `trans`, `op(A)(i, p)` is the stored `A(p, i)`.
//! `beta == 0` never reads `C` (a NaN there does not propagate), and `alpha == 0` or `k == 0`
//! never reads `A` or `B`, as the reference BLAS does.

use half::{bf16, f16};

/// An element type of a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// IEEE half (`CUDA_R_16F`).
    F16,
    /// bfloat16 (`CUDA_R_16BF`).
    BF16,
    /// f32 (`CUDA_R_32F`).
    F32,
    /// f64 (`CUDA_R_64F`).
    F64,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F16 | Elem::BF16 => 2,
            Elem::F32 => 4,
            Elem::F64 => 8,
        }
    }

    /// Reads the element at `addr` (exactly, as f64).
    ///
    /// # Safety
    /// `addr` must be readable for `self.size()` bytes (alignment is not required).
    unsafe fn load(self, addr: u64) -> f64 {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Elem::F16 => f16::from_bits((addr as *const u16).read_unaligned()).to_f64(),
                Elem::BF16 => bf16::from_bits((addr as *const u16).read_unaligned()).to_f64(),
                Elem::F32 => (addr as *const f32).read_unaligned() as f64,
                Elem::F64 => (addr as *const f64).read_unaligned(),
            }
        }
    }

    /// Writes `value` at `addr`, rounded to the element type (from f32 for the f32 compute
    /// type, so an f16 output is rounded once, from the f32 result, as cuBLAS does).
    ///
    /// # Safety
    /// `addr` must be writable for `self.size()` bytes.
    unsafe fn store(self, addr: u64, value: f64, compute: Compute) {
        let v32 = value as f32;
        // SAFETY: the caller's contract.
        unsafe {
            match (self, compute) {
                (Elem::F16, _) => (addr as *mut u16).write_unaligned(f16::from_f32(v32).to_bits()),
                (Elem::BF16, _) => {
                    (addr as *mut u16).write_unaligned(bf16::from_f32(v32).to_bits())
                }
                (Elem::F32, _) => (addr as *mut f32).write_unaligned(v32),
                (Elem::F64, Compute::F32) => (addr as *mut f64).write_unaligned(v32 as f64),
                (Elem::F64, Compute::F64) => (addr as *mut f64).write_unaligned(value),
            }
        }
    }
}

/// The type products are accumulated and scaled in (cuBLAS's compute type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    /// Accumulate and scale in f32 (`S` calls and the `CUBLAS_COMPUTE_32F*` types).
    F32,
    /// Accumulate and scale in f64 (`D` calls and `CUBLAS_COMPUTE_64F*`).
    F64,
}

/// One matrix operand: its start, element type, leading dimension (in elements), whether it is
/// used transposed, and the distance between batch entries (in elements).
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    /// Device address of the first element of batch entry 0.
    pub ptr: u64,
    /// Element type.
    pub elem: Elem,
    /// Leading dimension: elements between the starts of two stored columns.
    pub ld: usize,
    /// Used transposed (`CUBLAS_OP_T` or `CUBLAS_OP_C`).
    pub trans: bool,
    /// Elements between the starts of two batch entries (0: every entry uses the same matrix).
    pub stride: i64,
}

impl Operand {
    /// The address of stored element `(row, col)` of batch entry `b`.
    fn at(&self, b: usize, row: usize, col: usize) -> u64 {
        let index = b as i64 * self.stride + (row + col * self.ld) as i64;
        (self.ptr as i64 + index * self.elem.size() as i64) as u64
    }

    /// Reads `op(X)(i, j)` of batch entry `b`.
    ///
    /// # Safety
    /// The element must be readable.
    unsafe fn op(&self, b: usize, i: usize, j: usize) -> f64 {
        let (row, col) = if self.trans { (j, i) } else { (i, j) };
        // SAFETY: the caller's contract.
        unsafe { self.elem.load(self.at(b, row, col)) }
    }
}

/// `C = alpha·op(A)·op(B) + beta·C` for each of `batch` entries: `op(A)` is `m × k`, `op(B)`
/// is `k × n`, `C` is `m × n` (`c.trans` is ignored).
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// Number of batch entries.
    pub batch: usize,
    /// Scale of the product.
    pub alpha: f64,
    /// Scale of `C`'s old value (0: `C` is not read).
    pub beta: f64,
    /// The left matrix.
    pub a: Operand,
    /// The right matrix.
    pub b: Operand,
    /// The output matrix.
    pub c: Operand,
    /// The type the product is accumulated and scaled in.
    pub compute: Compute,
}

/// Runs the product.
///
/// # Safety
/// Every element of every matrix the product touches must be readable (A, B; C when
/// `beta != 0`) and writable (C); the emulated cuBLAS checks the ranges before it enqueues.
pub unsafe fn gemm(g: &Gemm) {
    for b in 0..g.batch {
        for j in 0..g.n {
            for i in 0..g.m {
                let product = if g.alpha == 0.0 || g.k == 0 {
                    0.0
                } else {
                    // SAFETY (both arms): the caller's contract covers op(A) row i and op(B)
                    // column j of this batch entry.
                    match g.compute {
                        Compute::F64 => {
                            let mut acc = 0.0f64;
                            for p in 0..g.k {
                                acc += unsafe { g.a.op(b, i, p) * g.b.op(b, p, j) };
                            }
                            acc
                        }
                        Compute::F32 => {
                            let mut acc = 0.0f32;
                            for p in 0..g.k {
                                let (x, y) = unsafe { (g.a.op(b, i, p), g.b.op(b, p, j)) };
                                acc += x as f32 * y as f32;
                            }
                            acc as f64
                        }
                    }
                };
                let at = g.c.at(b, i, j);
                let value = match g.compute {
                    Compute::F64 => {
                        let mut v = g.alpha * product;
                        if g.beta != 0.0 {
                            // SAFETY: C is readable (the caller's contract).
                            v += g.beta * unsafe { g.c.elem.load(at) };
                        }
                        v
                    }
                    Compute::F32 => {
                        let mut v = g.alpha as f32 * product as f32;
                        if g.beta != 0.0 {
                            // SAFETY: as above.
                            v += g.beta as f32 * unsafe { g.c.elem.load(at) } as f32;
                        }
                        v as f64
                    }
                };
                // SAFETY: C is writable (the caller's contract).
                unsafe { g.c.elem.store(at, value, g.compute) };
            }
        }
    }
}

/// A vector operand: start, element count and increment (negative increments walk backwards
/// from the end, as in BLAS).
#[derive(Clone, Copy, Debug)]
pub struct Vector {
    /// Device address of the vector's storage.
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
    /// Elements between two consecutive elements (never 0; negative walks backwards).
    pub inc: i64,
}

impl Vector {
    /// The address of logical element `i`.
    pub fn at(&self, i: usize, size: usize) -> u64 {
        let step = if self.inc > 0 {
            i as i64 * self.inc
        } else {
            (self.len - 1 - i) as i64 * -self.inc
        };
        (self.ptr as i64 + step * size as i64) as u64
    }
}

/// `y = alpha·op(A)·x + beta·y` with `A` stored `m × n` (f32 or f64 throughout).
#[derive(Clone, Copy, Debug)]
pub struct Gemv {
    /// Rows of `A` as stored.
    pub m: usize,
    /// Columns of `A` as stored.
    pub n: usize,
    /// Scale of the product.
    pub alpha: f64,
    /// Scale of `y`'s old value (0: `y` is not read).
    pub beta: f64,
    /// The matrix (`trans` picks `op(A)`; `stride` is unused).
    pub a: Operand,
    /// The input vector (`op(A)`'s column count long).
    pub x: Vector,
    /// The output vector (`op(A)`'s row count long).
    pub y: Vector,
    /// The type the product is accumulated and scaled in.
    pub compute: Compute,
}

/// Runs the matrix-vector product.
///
/// # Safety
/// As for [`gemm`]: A and x readable, y readable (when `beta != 0`) and writable.
pub unsafe fn gemv(g: &Gemv) {
    let (rows, cols) = if g.a.trans { (g.n, g.m) } else { (g.m, g.n) };
    let elem = g.a.elem;
    let size = elem.size();
    for i in 0..rows {
        let product = if g.alpha == 0.0 {
            0.0
        } else {
            let mut acc64 = 0.0f64;
            let mut acc32 = 0.0f32;
            for p in 0..cols {
                // SAFETY: A and x are readable (the caller's contract).
                let (a, x) = unsafe { (g.a.op(0, i, p), elem.load(g.x.at(p, size))) };
                acc64 += a * x;
                acc32 += a as f32 * x as f32;
            }
            match g.compute {
                Compute::F64 => acc64,
                Compute::F32 => acc32 as f64,
            }
        };
        let at = g.y.at(i, size);
        let value = match g.compute {
            Compute::F64 => {
                let mut v = g.alpha * product;
                if g.beta != 0.0 {
                    // SAFETY: y is readable.
                    v += g.beta * unsafe { elem.load(at) };
                }
                v
            }
            Compute::F32 => {
                let mut v = g.alpha as f32 * product as f32;
                if g.beta != 0.0 {
                    // SAFETY: y is readable.
                    v += g.beta as f32 * unsafe { elem.load(at) } as f32;
                }
                v as f64
            }
        };
        // SAFETY: y is writable.
        unsafe { elem.store(at, value, g.compute) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (values with few bits, so f32 sums are exact enough).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % 17) as f64 / 4.0 - 2.0
            })
            .collect()
    }

    /// The naive product, written independently of [`gemm`]: build op(A) and op(B) as dense
    /// row-major arrays first, then multiply.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: &[f64],
        lda: usize,
        ta: bool,
        b: &[f64],
        ldb: usize,
        tb: bool,
        alpha: f64,
        beta: f64,
        c: &[f64],
        ldc: usize,
    ) -> Vec<f64> {
        let mut opa = vec![0.0; m * k];
        for i in 0..m {
            for p in 0..k {
                opa[i * k + p] = if ta { a[p + i * lda] } else { a[i + p * lda] };
            }
        }
        let mut opb = vec![0.0; k * n];
        for p in 0..k {
            for j in 0..n {
                opb[p * n + j] = if tb { b[j + p * ldb] } else { b[p + j * ldb] };
            }
        }
        let mut out = c.to_vec();
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| opa[i * k + p] * opb[p * n + j]).sum();
                let old = if beta == 0.0 {
                    0.0
                } else {
                    beta * c[i + j * ldc]
                };
                out[i + j * ldc] = alpha * s + old;
            }
        }
        out
    }

    #[test]
    fn every_transpose_with_padded_leading_dimensions_matches_the_naive_product() {
        let (m, n, k) = (3, 4, 5);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for pad in [0, 2] {
                let (ar, ac) = if ta { (k, m) } else { (m, k) };
                let (br, bc) = if tb { (n, k) } else { (k, n) };
                let (lda, ldb, ldc) = (ar + pad, br + pad + 1, m + pad);
                let a = values(lda * ac, 1);
                let b = values(ldb * bc, 2);
                for (alpha, beta) in [(1.0, 0.0), (0.5, 2.0), (-1.5, 1.0)] {
                    let c0 = values(ldc * n, 3);
                    let want = naive(m, n, k, &a, lda, ta, &b, ldb, tb, alpha, beta, &c0, ldc);
                    for compute in [Compute::F64, Compute::F32] {
                        let elem = if compute == Compute::F64 {
                            Elem::F64
                        } else {
                            Elem::F32
                        };
                        let (a, b, mut c) = match elem {
                            Elem::F64 => (bytes64(&a), bytes64(&b), bytes64(&c0)),
                            _ => (bytes32(&a), bytes32(&b), bytes32(&c0)),
                        };
                        let g = Gemm {
                            m,
                            n,
                            k,
                            batch: 1,
                            alpha,
                            beta,
                            a: op(a.as_ptr(), elem, lda, ta, 0),
                            b: op(b.as_ptr(), elem, ldb, tb, 0),
                            c: op(c.as_mut_ptr(), elem, ldc, false, 0),
                            compute,
                        };
                        // SAFETY: the buffers hold every element the product touches.
                        unsafe { gemm(&g) };
                        let got = read(&mut c, elem);
                        assert_eq!(
                            got, want,
                            "ta {ta} tb {tb} pad {pad} {alpha} {beta} {elem:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn strided_batches_use_their_own_matrices() {
        let (m, n, k, batch) = (2, 3, 4, 3);
        let (sa, sb, sc) = (m * k + 1, k * n + 3, m * n + 2);
        let a = values(sa * batch, 4);
        let b = values(sb * batch, 5);
        let c0 = values(sc * batch, 6);
        let (ab, bb, mut cb) = (bytes64(&a), bytes64(&b), bytes64(&c0));
        let g = Gemm {
            m,
            n,
            k,
            batch,
            alpha: 1.0,
            beta: 1.0,
            a: op(ab.as_ptr(), Elem::F64, m, false, sa as i64),
            b: op(bb.as_ptr(), Elem::F64, k, false, sb as i64),
            c: op(cb.as_mut_ptr(), Elem::F64, m, false, sc as i64),
            compute: Compute::F64,
        };
        // SAFETY: as above.
        unsafe { gemm(&g) };
        let got = read(&mut cb, Elem::F64);
        for e in 0..batch {
            let want = naive(
                m,
                n,
                k,
                &a[e * sa..],
                m,
                false,
                &b[e * sb..],
                k,
                false,
                1.0,
                1.0,
                &c0[e * sc..e * sc + m * n],
                m,
            );
            assert_eq!(&got[e * sc..e * sc + m * n], &want[..], "batch entry {e}");
            // The gap between entries is untouched.
            assert_eq!(
                &got[e * sc + m * n..(e + 1) * sc],
                &c0[e * sc + m * n..(e + 1) * sc]
            );
        }
    }

    #[test]
    fn beta_zero_does_not_read_c_and_leaves_the_padding_alone() {
        let (m, n, k, ldc) = (2, 2, 3, 4);
        let a = bytes32(&values(m * k, 7));
        let b = bytes32(&values(k * n, 8));
        let mut c = bytes32(&vec![f64::NAN; ldc * n]);
        let g = Gemm {
            m,
            n,
            k,
            batch: 1,
            alpha: 1.0,
            beta: 0.0,
            a: op(a.as_ptr(), Elem::F32, m, false, 0),
            b: op(b.as_ptr(), Elem::F32, k, false, 0),
            c: op(c.as_mut_ptr(), Elem::F32, ldc, false, 0),
            compute: Compute::F32,
        };
        // SAFETY: as above.
        unsafe { gemm(&g) };
        let got = read(&mut c, Elem::F32);
        for j in 0..n {
            for i in 0..ldc {
                assert_eq!(
                    got[i + j * ldc].is_nan(),
                    i >= m,
                    "C({i}, {j}) = {}",
                    got[i + j * ldc]
                );
            }
        }
    }

    #[test]
    fn half_inputs_accumulate_in_f32_and_round_the_output_once() {
        // 1 + 3·2⁻¹¹ is not an f16 (its spacing at 1 is 2⁻¹⁰) but is an f32: an f16
        // accumulator would round it, the f32 compute type keeps it.
        let k = 4;
        let a: Vec<u16> = [1.0f32, 2f32.powi(-11), 2f32.powi(-11), 2f32.powi(-11)]
            .iter()
            .map(|&v| f16::from_f32(v).to_bits())
            .collect();
        let b: Vec<u16> = vec![f16::ONE.to_bits(); k];
        let mut c32 = [0f32; 1];
        let g = Gemm {
            m: 1,
            n: 1,
            k,
            batch: 1,
            alpha: 1.0,
            beta: 0.0,
            a: Operand {
                ptr: a.as_ptr() as u64,
                elem: Elem::F16,
                ld: 1,
                trans: false,
                stride: 0,
            },
            b: Operand {
                ptr: b.as_ptr() as u64,
                elem: Elem::F16,
                ld: k,
                trans: false,
                stride: 0,
            },
            c: Operand {
                ptr: c32.as_mut_ptr() as u64,
                elem: Elem::F32,
                ld: 1,
                trans: false,
                stride: 0,
            },
            compute: Compute::F32,
        };
        // SAFETY: the arrays hold the 1×4, 4×1 and 1×1 matrices.
        unsafe { gemm(&g) };
        assert_eq!(c32[0], 1.0 + 3.0 * 2f32.powi(-11));
    }

    #[test]
    fn gemv_matches_the_naive_product_with_negative_increments() {
        let (m, n, lda) = (3, 2, 4);
        let a = values(lda * n, 9);
        for trans in [false, true] {
            let (xl, yl) = if trans { (m, n) } else { (n, m) };
            let x = values(2 * xl, 10);
            let y0 = values(3 * yl, 11);
            let (ab, xb, mut yb) = (bytes64(&a), bytes64(&x), bytes64(&y0));
            let g = Gemv {
                m,
                n,
                alpha: 2.0,
                beta: 0.5,
                a: op(ab.as_ptr(), Elem::F64, lda, trans, 0),
                x: Vector {
                    ptr: xb.as_ptr() as u64,
                    len: xl,
                    inc: 2,
                },
                y: Vector {
                    ptr: yb.as_ptr() as u64,
                    len: yl,
                    inc: -3,
                },
                compute: Compute::F64,
            };
            // SAFETY: the buffers hold every element touched.
            unsafe { gemv(&g) };
            let got = read(&mut yb, Elem::F64);
            for i in 0..yl {
                let s: f64 = (0..xl)
                    .map(|p| {
                        let aij = if trans {
                            a[p + i * lda]
                        } else {
                            a[i + p * lda]
                        };
                        aij * x[2 * p]
                    })
                    .sum();
                let at = (yl - 1 - i) * 3;
                assert_eq!(got[at], 2.0 * s + 0.5 * y0[at], "trans {trans} y[{i}]");
            }
        }
    }

    fn bytes64(v: &[f64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn bytes32(v: &[f64]) -> Vec<u8> {
        v.iter().flat_map(|&x| (x as f32).to_ne_bytes()).collect()
    }

    fn read(v: &mut [u8], elem: Elem) -> Vec<f64> {
        v.chunks(elem.size())
            .map(|c| match elem {
                Elem::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
                _ => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            })
            .collect()
    }

    fn op(ptr: *const u8, elem: Elem, ld: usize, trans: bool, stride: i64) -> Operand {
        Operand {
            ptr: ptr as u64,
            elem,
            ld,
            trans,
            stride,
        }
    }
}
