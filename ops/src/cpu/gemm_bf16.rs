//! bf16 × bf16 → f32 matrix products: the kernel of the BF16 matmul and convolutions.
//!
//! Where the CPU has AVX512-BF16, [`gemm_bf16`] packs both operands into the pair-interleaved
//! layout that `vdpbf16ps` reads (each 32-bit lane holds the bf16 values of two consecutive
//! `k`, the even one in the low half) and runs a register-blocked micro-kernel of
//! [`MR`] rows × [`NR`] columns whose accumulators are f32: `vdpbf16ps` multiplies the pairs
//! exactly and adds both products to the f32 lane. Elsewhere (the plain path) the operands are
//! widened to f32 and multiplied by the f32 gemm. Either way the result is f32 (the caller
//! rounds it once to bf16, or keeps it where it wants f32, as weight gradients do).
//!
//! The blocking is Goto's: the columns in blocks of [`NC`], the depth in blocks of [`KC`] pairs
//! (one block of packed B, `KC × NC` pairs, stays in L2), the rows in blocks of [`MC`] (one
//! block of packed A); the micro-kernel walks one `KC × NR` panel of B (in L1) against the
//! `MR`-row panels of A. Depth blocks after the first add to the f32 result, so the sum is f32
//! throughout.

use tandem_core::half::bf16;

use crate::cpu::gemm::{gemm_into, MatRef, GEMM_PARALLEL_WORK};

/// Rows of the micro-kernel's tile.
pub(crate) const MR: usize = 8;
/// Columns of the micro-kernel's tile: two 16-lane registers.
pub(crate) const NR: usize = 32;
/// Pairs of `k` in one depth block.
const KC: usize = 128;
/// Rows in one block of packed A.
const MC: usize = 96;
/// Columns in one block of packed B (a multiple of `NR`).
const NC: usize = 1024;

/// Proof that this CPU has AVX-512F and AVX512-BF16: only [`Path::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dpbf16 {
    _detected: (),
}

/// Which kernel a bf16 product runs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Path {
    /// The `vdpbf16ps` micro-kernel.
    Dpbf16(Dpbf16),
    /// bf16 widened to f32, then the f32 gemm.
    Plain,
}

impl Path {
    /// The fastest path this CPU has.
    pub(crate) fn detect() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
            {
                return Path::Dpbf16(Dpbf16 { _detected: () });
            }
        }
        Path::Plain
    }
}

/// A bf16 matrix inside a slice (element `(i, j)` at `offset + i·rs + j·cs`).
#[derive(Clone, Copy)]
pub(crate) struct Bf16Mat<'a> {
    pub data: &'a [bf16],
    pub at: MatRef,
}

impl<'a> Bf16Mat<'a> {
    /// A dense row-major matrix with `cols` columns at the start of `data` (the tests' way to
    /// describe operands; the ops describe tensors' strides directly).
    #[cfg(test)]
    pub(crate) fn row_major(data: &'a [bf16], cols: usize) -> Self {
        Bf16Mat {
            data,
            at: MatRef::row_major(0, cols),
        }
    }

    /// The transposed matrix (same storage).
    #[cfg(test)]
    pub(crate) fn t(self) -> Self {
        Bf16Mat {
            data: self.data,
            at: self.at.t(),
        }
    }

    /// Whether every element of a `rows × cols` matrix lies inside the slice.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || self.at.offset + (rows - 1) * self.at.rs + (cols - 1) * self.at.cs < self.data.len()
    }
}

/// `dst = a · b`, or `dst += a · b` when `accumulate`: `a` is `m × k`, `b` is `k × n` (bf16),
/// `dst` is `m × n` f32, row-major with row stride `ld` (`ld ≥ n`). `parallel` lets the product
/// split over the rayon pool when it is large (pass false inside a parallel loop).
///
/// Panics when an operand or `dst` is smaller than its sizes say (callers pass matrices they
/// built).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_bf16(
    path: Path,
    (m, n, k): (usize, usize, usize),
    a: Bf16Mat<'_>,
    b: Bf16Mat<'_>,
    dst: &mut [f32],
    ld: usize,
    accumulate: bool,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ld >= n && (m - 1) * ld + n <= dst.len(),
        "gemm_bf16: dst out of bounds"
    );
    assert!(
        a.fits(m, k) && b.fits(k, n),
        "gemm_bf16: operand out of bounds"
    );
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(ld).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    match path {
        Path::Plain => plain(m, n, k, a, b, dst, ld, accumulate, parallel),
        Path::Dpbf16(cpu) => {
            let view = DstView {
                ptr: dst.as_mut_ptr(),
                ld,
            };
            let threads = rayon::current_num_threads();
            let work = m.saturating_mul(n).saturating_mul(k);
            if parallel && threads > 1 && work >= GEMM_PARALLEL_WORK {
                split_over_pool(cpu, (m, n, k), a, b, view, accumulate, threads);
            } else {
                // SAFETY: `dst` is a unique borrow holding the `m × n` matrix (asserted above).
                unsafe { blocked(cpu, (m, n, k), a, b, view, accumulate) };
            }
        }
    }
}

/// The plain path: both operands widened to dense f32 matrices, then the f32 gemm.
#[allow(clippy::too_many_arguments)]
fn plain(
    m: usize,
    n: usize,
    k: usize,
    a: Bf16Mat<'_>,
    b: Bf16Mat<'_>,
    dst: &mut [f32],
    ld: usize,
    accumulate: bool,
    parallel: bool,
) {
    let widen = |x: &Bf16Mat<'_>, rows: usize, cols: usize| -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            out.extend((0..cols).map(|j| x.data[x.at.offset + i * x.at.rs + j * x.at.cs].to_f32()));
        }
        out
    };
    let (a32, b32) = (widen(&a, m, k), widen(&b, k, n));
    gemm_into(
        (m, n, k),
        dst,
        MatRef {
            offset: 0,
            rs: ld,
            cs: 1,
        },
        &a32,
        MatRef::row_major(0, k),
        &b32,
        MatRef::row_major(0, n),
        accumulate,
        parallel,
    );
}

/// Where the f32 result goes: element `(i, j)` at `ptr + i·ld + j`.
#[derive(Clone, Copy)]
struct DstView {
    ptr: *mut f32,
    ld: usize,
}

// SAFETY: a view is only sent to pool threads by `split_over_pool`, which gives each thread a
// disjoint block of the matrix.
unsafe impl Send for DstView {}
// SAFETY: as for `Send`: threads never touch the same elements through a shared view.
unsafe impl Sync for DstView {}

/// Runs the product as one task per pool thread, each over its own rows (when there are
/// enough) or columns of `dst`.
#[allow(clippy::too_many_arguments)]
fn split_over_pool(
    cpu: Dpbf16,
    (m, n, k): (usize, usize, usize),
    a: Bf16Mat<'_>,
    b: Bf16Mat<'_>,
    dst: DstView,
    accumulate: bool,
    threads: usize,
) {
    use rayon::prelude::*;
    let by_rows = m >= threads * MC.min(4 * MR) || m >= n;
    let (len, unit) = if by_rows { (m, MR) } else { (n, NR) };
    let step = len.div_ceil(threads).div_ceil(unit) * unit;
    (0..len.div_ceil(step)).into_par_iter().for_each(|t| {
        let (start, end) = (t * step, ((t + 1) * step).min(len));
        let (mut a, mut b, mut view) = (a, b, dst);
        let (rows, cols) = if by_rows {
            a.at.offset += start * a.at.rs;
            // SAFETY: `start < m`, so the offset stays inside the asserted `m × n` matrix.
            view.ptr = unsafe { view.ptr.add(start * view.ld) };
            (end - start, n)
        } else {
            b.at.offset += start * b.at.cs;
            // SAFETY: `start < n`, inside the matrix as above.
            view.ptr = unsafe { view.ptr.add(start) };
            (m, end - start)
        };
        // SAFETY: each task writes only its own rows (or columns) of `dst`, which
        // `gemm_bf16` holds as a unique borrow for the whole call.
        unsafe { blocked(cpu, (rows, cols, k), a, b, view, accumulate) };
    });
}

/// The blocked product on the calling thread.
///
/// # Safety
/// `dst` must address a writable `m × n` matrix that nothing else touches during the call;
/// `a` and `b` must fit their sizes.
unsafe fn blocked(
    cpu: Dpbf16,
    (m, n, k): (usize, usize, usize),
    a: Bf16Mat<'_>,
    b: Bf16Mat<'_>,
    dst: DstView,
    accumulate: bool,
) {
    let pairs = k.div_ceil(2);
    PACKED.with(|packed| {
        let (pa, pb) = &mut *packed.borrow_mut();
        grow(pb, KC.min(pairs) * NC.min(n.div_ceil(NR) * NR));
        grow(pa, KC.min(pairs) * MC.min(m.div_ceil(MR) * MR));
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { blocks(cpu, (m, n, k), a, b, dst, accumulate, pa, pb) };
    });
}

thread_local! {
    /// Each thread's packed A and B blocks, kept between products: a fresh buffer of this size
    /// is a fresh mapping, whose page faults cost as much as the packing.
    static PACKED: std::cell::RefCell<(Vec<u32>, Vec<u32>)> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

/// Makes `v` at least `len` long.
fn grow(v: &mut Vec<u32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}

/// The loops of [`blocked`] over packed blocks in `pa` and `pb` (large enough for one block of
/// each).
///
/// # Safety
/// As for [`blocked`].
#[allow(clippy::too_many_arguments)]
unsafe fn blocks(
    cpu: Dpbf16,
    (m, n, k): (usize, usize, usize),
    a: Bf16Mat<'_>,
    b: Bf16Mat<'_>,
    dst: DstView,
    accumulate: bool,
    pa: &mut [u32],
    pb: &mut [u32],
) {
    let pairs = k.div_ceil(2);
    for j0 in (0..n).step_by(NC) {
        let nc = NC.min(n - j0);
        for p0 in (0..pairs).step_by(KC) {
            let kc = KC.min(pairs - p0);
            pack_b(&b, (2 * p0, k), (j0, nc), kc, pb);
            let add = accumulate || p0 > 0;
            for i0 in (0..m).step_by(MC) {
                let mc = MC.min(m - i0);
                pack_a(&a, (2 * p0, k), (i0, mc), kc, pa);
                for jr in (0..nc).step_by(NR) {
                    let panel_b = &pb[jr * kc..][..kc * NR];
                    for ir in (0..mc).step_by(MR) {
                        let panel_a = &pa[ir * kc..][..kc * MR];
                        let rows = MR.min(mc - ir);
                        let cols = NR.min(nc - jr);
                        // SAFETY: the tile `(i0 + ir, j0 + jr)` of `rows × cols` lies inside
                        // the `m × n` matrix the caller vouches for.
                        let out = unsafe { dst.ptr.add((i0 + ir) * dst.ld + j0 + jr) };
                        tile(cpu, panel_a, panel_b, kc, out, dst.ld, (rows, cols), add);
                    }
                }
            }
        }
    }
}

/// Packs the pairs `k0/2 .. k0/2 + kc` of columns `j0 .. j0 + nc` of `b` into panels of `NR`
/// columns: panel `q` holds, for each pair `p`, `NR` lanes `(b[k0+2p][j], b[k0+2p+1][j])`, the
/// even `k` in the low half; rows past `k` and columns past `nc` are zero.
fn pack_b(
    b: &Bf16Mat<'_>,
    ks: (usize, usize),
    (j0, nc): (usize, usize),
    kc: usize,
    out: &mut [u32],
) {
    let by_k = Strided {
        k_step: b.at.rs,
        lane_step: b.at.cs,
    };
    for (q, panel) in out.chunks_mut(kc * NR).take(nc.div_ceil(NR)).enumerate() {
        let lanes = (j0 + q * NR, NR.min(nc - q * NR));
        pack_pairs::<NR>(b.data, b.at.offset, by_k, ks, lanes, kc, panel);
    }
}

/// Packs the pairs `k0/2 .. k0/2 + kc` of rows `i0 .. i0 + mc` of `a` into panels of `MR`
/// rows: panel `q` holds, for each pair `p`, `MR` values `(a[i][k0+2p], a[i][k0+2p+1])`; rows
/// past `mc` and the `k` past the end are zero.
fn pack_a(
    a: &Bf16Mat<'_>,
    ks: (usize, usize),
    (i0, mc): (usize, usize),
    kc: usize,
    out: &mut [u32],
) {
    let by_k = Strided {
        k_step: a.at.cs,
        lane_step: a.at.rs,
    };
    for (q, panel) in out.chunks_mut(kc * MR).take(mc.div_ceil(MR)).enumerate() {
        let lanes = (i0 + q * MR, MR.min(mc - q * MR));
        pack_pairs::<MR>(a.data, a.at.offset, by_k, ks, lanes, kc, panel);
    }
}

/// How an operand steps along the depth `k` and along the lanes of a panel (the rows of A,
/// the columns of B).
#[derive(Clone, Copy)]
struct Strided {
    k_step: usize,
    lane_step: usize,
}

/// One panel of `W` lanes: `out[p·W + l] = (x[k0+2p, l0+l], x[k0+2p+1, l0+l])` (as bits, the
/// even `k` low) for `p < kc` and `l < len`, where `x[kk, l]` is at
/// `offset + kk·k_step + l·lane_step`; zero past `k` and past `len`.
///
/// Either stride may be 1 (B row-major, A transposed: two contiguous runs interleaved; A
/// row-major, B transposed: each pair is adjacent), so each case walks memory in order.
#[allow(clippy::too_many_arguments)]
fn pack_pairs<const W: usize>(
    data: &[bf16],
    offset: usize,
    s: Strided,
    (k0, k): (usize, usize),
    (l0, len): (usize, usize),
    kc: usize,
    out: &mut [u32],
) {
    let bits = |i: usize| u32::from(data[i].to_bits());
    let at = |kk: usize, l: usize| offset + kk * s.k_step + (l0 + l) * s.lane_step;
    let full_pairs = (k - k0).min(2 * kc) / 2;
    if s.k_step == 1 {
        // Each lane's pairs are adjacent: walk lane by lane.
        for l in 0..len {
            let row = &data[at(k0, l)..][..2 * full_pairs];
            for (p, pair) in row.chunks_exact(2).enumerate() {
                out[p * W + l] = u32::from(pair[0].to_bits()) | u32::from(pair[1].to_bits()) << 16;
            }
        }
    } else {
        for p in 0..full_pairs {
            let lanes = &mut out[p * W..][..len];
            let (r0, r1) = (at(k0 + 2 * p, 0), at(k0 + 2 * p + 1, 0));
            if s.lane_step == 1 {
                let (lo, hi) = (&data[r0..][..len], &data[r1..][..len]);
                for ((d, lo), hi) in lanes.iter_mut().zip(lo).zip(hi) {
                    *d = u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16;
                }
            } else {
                for (l, d) in lanes.iter_mut().enumerate() {
                    *d = bits(r0 + l * s.lane_step) | bits(r1 + l * s.lane_step) << 16;
                }
            }
        }
    }
    // The odd last `k` (its pair's high half zero), the pairs past the end, the lanes past len.
    for p in full_pairs..kc {
        let kk = k0 + 2 * p;
        for l in 0..W {
            out[p * W + l] = if kk < k && l < len {
                bits(at(kk, l))
            } else {
                0
            };
        }
    }
    if len < W {
        for p in 0..full_pairs {
            out[p * W + len..(p + 1) * W].fill(0);
        }
    }
}

/// One `rows × cols` tile (at most `MR × NR`) of the result from one A panel and one B panel
/// of `kc` pairs, stored to (or, with `add`, added to) `out` with row stride `ld`.
#[allow(clippy::too_many_arguments)]
fn tile(
    _cpu: Dpbf16,
    a: &[u32],
    b: &[u32],
    kc: usize,
    out: *mut f32,
    ld: usize,
    (rows, cols): (usize, usize),
    add: bool,
) {
    assert!(a.len() >= kc * MR && b.len() >= kc * NR);
    let mut acc = [[0f32; NR]; MR];
    // SAFETY: the `Dpbf16` proof says the CPU has AVX-512F and AVX512-BF16; the kernel reads
    // `kc·MR` values of `a` and `kc·NR` of `b` (asserted) and writes only `acc`.
    unsafe { kernel(a.as_ptr(), b.as_ptr(), kc, &mut acc) };
    for (i, row) in acc.iter().enumerate().take(rows) {
        // SAFETY: the caller (`blocked`) passes a tile of `rows × cols` inside the matrix it
        // holds uniquely, so these `cols` elements of row `i` are valid and unaliased.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.add(i * ld), cols) };
        if add {
            dst.iter_mut().zip(row).for_each(|(d, &v)| *d += v);
        } else {
            dst.copy_from_slice(&row[..cols]);
        }
    }
}

/// The micro-kernel: `acc[i][j] = Σₚ a[p][i]·b[p][j]` over `kc` pairs with `vdpbf16ps`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16; `a` must hold `kc·MR` values and `b` `kc·NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, acc: &mut [[f32; NR]; MR]) {
    use std::arch::x86_64::*;
    let mut c = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..kc {
        // SAFETY: `p < kc`, so the two B registers and the MR broadcast values are inside the
        // panels (the caller's contract); `__m512i` and `__m512bh` are both 64 bytes of plain
        // bits, so the transmutes reinterpret without changing them.
        unsafe {
            let bp = b.add(p * NR) as *const __m512i;
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(1)));
            let ap = a.add(p * MR);
            for (i, ci) in c.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
                ci[0] = _mm512_dpbf16_ps(ci[0], av, b0);
                ci[1] = _mm512_dpbf16_ps(ci[1], av, b1);
            }
        }
    }
    for (row, ci) in acc.iter_mut().zip(&c) {
        // SAFETY: each row of `acc` holds `NR` = 32 f32, the two 16-lane stores.
        unsafe {
            _mm512_storeu_ps(row.as_mut_ptr(), ci[0]);
            _mm512_storeu_ps(row.as_mut_ptr().add(16), ci[1]);
        }
    }
}

/// Never called: a `Dpbf16` proof exists only on x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: *const u32, _: *const u32, _: usize, _: &mut [[f32; NR]; MR]) {
    unreachable!("no AVX512-BF16 off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about [-2, 2), rounded to bf16.
    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
            })
            .collect()
    }

    /// Checks `gemm_bf16` on `path` against an f64 product of the same (bf16) values, for `a`
    /// row-major or transposed in storage, `b` likewise, with and without accumulation.
    fn check(path: Path, (m, n, k): (usize, usize, usize), parallel: bool) {
        let (a, b) = (values(m * k, 1 + m as u64), values(k * n, 7 + n as u64));
        for (ta, tb) in [(false, false), (true, true), (false, true)] {
            let am = if ta {
                Bf16Mat::row_major(&a, m).t()
            } else {
                Bf16Mat::row_major(&a, k)
            };
            let bm = if tb {
                Bf16Mat::row_major(&b, k).t()
            } else {
                Bf16Mat::row_major(&b, n)
            };
            let ld = n + 3;
            let mut dst = vec![0.5f32; m * ld];
            gemm_bf16(path, (m, n, k), am, bm, &mut dst, ld, true, parallel);
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut scale) = (0.5f64, 0.5f64);
                    for p in 0..k {
                        let x = f64::from(am.data[am.at.offset + i * am.at.rs + p * am.at.cs]);
                        let y = f64::from(bm.data[bm.at.offset + p * bm.at.rs + j * bm.at.cs]);
                        exact += x * y;
                        scale += (x * y).abs();
                    }
                    let got = f64::from(dst[i * ld + j]);
                    assert!(
                        (got - exact).abs() <= 1e-5 * scale + 1e-6,
                        "{path:?} {m}x{n}x{k} (ta {ta}, tb {tb}) at ({i}, {j}): {got} vs {exact}"
                    );
                }
                assert!(
                    dst[i * ld + n..(i + 1) * ld].iter().all(|&v| v == 0.5),
                    "wrote past n"
                );
            }
        }
        let mut dst = vec![9.0f32; m * n];
        let am = Bf16Mat::row_major(&a, k);
        gemm_bf16(
            path,
            (m, n, k),
            am,
            Bf16Mat::row_major(&b, n),
            &mut dst,
            n,
            false,
            parallel,
        );
        let mut again = vec![0.0f32; m * n];
        gemm_bf16(
            path,
            (m, n, k),
            am,
            Bf16Mat::row_major(&b, n),
            &mut again,
            n,
            false,
            false,
        );
        assert_eq!(dst, again, "overwrite and serial results differ");
    }

    const SHAPES: [(usize, usize, usize); 9] = [
        (1, 1, 1),
        (1, 1, 7),
        (3, 5, 2),
        (8, 32, 16),
        (9, 33, 17),
        (17, 70, 263),
        (64, 100, 576),
        (130, 1030, 300),
        (5, 3, 0),
    ];

    #[test]
    fn plain_path_matches_f64_reference() {
        for s in SHAPES {
            check(Path::Plain, s, false);
        }
    }

    #[test]
    fn dpbf16_path_matches_f64_reference() {
        match Path::detect() {
            Path::Dpbf16(cpu) => {
                for s in SHAPES {
                    check(Path::Dpbf16(cpu), s, false);
                }
            }
            Path::Plain => eprintln!("no AVX512-BF16 on this CPU: only the plain path checked"),
        }
    }

    #[test]
    fn parallel_split_matches_serial() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            for s in [(130, 1030, 300), (16, 3000, 144), (300, 40, 90)] {
                check(Path::detect(), s, true);
                check(Path::Plain, s, true);
            }
        });
    }
}
