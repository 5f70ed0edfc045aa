//! An AVX-512 f32 kernel for the products of a convolution over one tile of output pixels:
//! the forward's `out = W · cols (+ b)` and the weight gradient's `grad_W += g · rows`.
//!
//! The convolution products are short and wide: few output channels (6–64), a depth of
//! `C·kh·kw` (25–576) and one tile of pixels. A general gemm packs both operands for every such
//! call, which costs as much as the arithmetic here. The column tile is already laid out the
//! way a kernel wants to read it (one contiguous row per depth index), and the weights are few,
//! so this kernel reads both in place: for a block of up to 6 output channels × 64 pixels it
//! keeps 24 accumulators in registers, and for each depth index loads 4 vectors of the column
//! row and broadcasts 6 weights. Bias initialises the accumulators; the result is stored, not
//! added, so the output needs no clearing first.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Output channels × 16-lane vectors of pixels per register block: 8 × 3 where the channels
/// come in eights (no ragged block) or the tile is one vector wide, else 6 × 4; either keeps
/// up to 24 accumulators in registers.
const BLOCK_O: usize = 6;
const BLOCK_V: usize = 4;
const WIDE_BLOCK_O: usize = 8;
const WIDE_BLOCK_V: usize = 3;
/// Depth indices per pass over the channel blocks.
const DEPTH_CHUNK: usize = 160;

/// Where a register block sits: pixels from `p`, channels from `o`, and its depth range.
#[derive(Clone)]
struct Block {
    p: usize,
    o: usize,
    depth: std::ops::Range<usize>,
}

/// Proof that this CPU has AVX-512F, so that the kernels of this file (and the algorithms
/// built on them: the implicit GEMM, Winograd) can run. Only [`avx512`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    _detected: (),
}

/// Whether this CPU has AVX-512F (for the assertions of kernels that do not take the proof).
pub(crate) fn available() -> bool {
    avx512().is_some()
}

/// The proof that [`product`] can run on this CPU, or None.
pub(crate) fn avx512() -> Option<Avx512> {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f").then_some(Avx512 { _detected: () })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// The shapes of one tile product `out (+)= A · B`: `A` is `o_n × depth` with element `(o, k)`
/// at `a[o·a_rs + k·a_cs]`, `B` is `depth × width` row-major with rows `b_rs` apart, and the
/// output rows are `out_stride` apart.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileShape {
    pub o_n: usize,
    pub depth: usize,
    pub width: usize,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b_rs: usize,
    pub out_stride: usize,
    /// Add to the output rather than overwrite it.
    pub accumulate: bool,
}

impl TileShape {
    /// One past the largest index of `a`, `b` and `out` the product touches.
    fn extents(&self) -> (usize, usize, usize) {
        if self.o_n == 0 || self.width == 0 {
            return (0, 0, 0);
        }
        let last = |rows: usize, rs: usize, cols: usize, cs: usize| {
            if rows == 0 || cols == 0 {
                0
            } else {
                (rows - 1) * rs + (cols - 1) * cs + 1
            }
        };
        (
            last(self.o_n, self.a_rs, self.depth, self.a_cs),
            last(self.depth, self.b_rs, self.width, 1),
            last(self.o_n, self.out_stride, self.width, 1),
        )
    }
}

/// `out[o·out_stride + p] (+)= bias[o] + Σ_k A(o, k) · b[k·b_rs + p]` for `o < o_n`,
/// `p < width` (see [`TileShape`]).
///
/// # Panics
/// When a slice is too short for the shape: the callers size them from the same geometry, so
/// that would be a bug in this crate, and the check keeps it from reading out of bounds.
pub(crate) fn product(
    _cpu: Avx512,
    s: TileShape,
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let (a_end, b_end, out_end) = s.extents();
    let fits = a.len() >= a_end
        && b.len() >= b_end
        && out.len() >= out_end
        && bias.is_none_or(|b| b.len() >= s.o_n)
        && (s.o_n <= 1 || s.width <= s.out_stride);
    assert!(fits, "tile product: operands too short for {s:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (the `Avx512` proof), and `fits` bounds every index the
    // kernel forms by the extents of the three matrices; distinct output rows do not overlap
    // (width ≤ out_stride), and `out` is a unique borrow.
    unsafe {
        product_avx512::<false, false>(
            s,
            a.as_ptr(),
            b.as_ptr(),
            NO_TABLES,
            bias,
            out.as_mut_ptr(),
        );
    }
}

/// Like [`product`], but row `k` of `B` starts at `b[rows[k]]` (`s.b_rs` is not used): the
/// rows of an implicit column matrix, read straight from the padded input they overlap in.
pub(crate) fn product_rows(
    _cpu: Avx512,
    s: TileShape,
    a: &[f32],
    b: &[f32],
    rows: &[usize],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let (a_end, _, out_end) = s.extents();
    let b_fits = s.o_n == 0
        || s.width == 0
        || (rows.len() >= s.depth && rows[..s.depth].iter().all(|&r| r + s.width <= b.len()));
    let fits = a.len() >= a_end
        && b_fits
        && out.len() >= out_end
        && bias.is_none_or(|b| b.len() >= s.o_n)
        && (s.o_n <= 1 || s.width <= s.out_stride);
    assert!(fits, "tile product: operands too short for {s:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (the `Avx512` proof); `fits` bounds the indices into `a` and
    // `out` as in `product`, and every row of `B` the kernel reads (`rows[k] + p` for
    // `k < depth`, `p < width`) inside `b`; `out` is a unique borrow.
    unsafe {
        let tables = Tables {
            a_rows: &[],
            b_rows: rows,
        };
        product_avx512::<false, true>(s, a.as_ptr(), b.as_ptr(), tables, bias, out.as_mut_ptr());
    }
}

/// Like [`product`], but row `i` of `A` starts at `a[rows[i]]` (`s.a_rs` is not used): an
/// implicit column matrix as the left operand, its rows read straight from the padded input.
pub(crate) fn product_a_rows(
    _cpu: Avx512,
    s: TileShape,
    a: &[f32],
    rows: &[usize],
    b: &[f32],
    out: &mut [f32],
) {
    let (_, b_end, out_end) = s.extents();
    let a_span = match s.depth {
        0 => 0,
        d => (d - 1) * s.a_cs + 1,
    };
    let a_fits = s.o_n == 0
        || s.width == 0
        || s.depth == 0
        || (rows.len() >= s.o_n && rows[..s.o_n].iter().all(|&r| r + a_span <= a.len()));
    let fits = a_fits
        && b.len() >= b_end
        && out.len() >= out_end
        && (s.o_n <= 1 || s.width <= s.out_stride);
    assert!(fits, "tile product: operands too short for {s:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (the `Avx512` proof); `fits` bounds every element of `A` the
    // kernel reads (`rows[i] + k·a_cs` for `i < o_n`, `k < depth`) inside `a`, and the indices
    // into `b` and `out` as in `product`; `out` is a unique borrow.
    unsafe {
        let tables = Tables {
            a_rows: rows,
            b_rows: &[],
        };
        product_avx512::<true, false>(s, a.as_ptr(), b.as_ptr(), tables, None, out.as_mut_ptr());
    }
}

/// Row-offset tables of the operands (used by the kernels instantiated with them).
#[derive(Clone, Copy)]
struct Tables<'a> {
    a_rows: &'a [usize],
    b_rows: &'a [usize],
}

const NO_TABLES: Tables<'static> = Tables {
    a_rows: &[],
    b_rows: &[],
};

/// The mask of the first `n` (≤ 16) lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn product_avx512<const A_TABLE: bool, const B_TABLE: bool>(
    s: TileShape,
    a: *const f32,
    b: *const f32,
    tables: Tables,
    bias: Option<&[f32]>,
    out: *mut f32,
) {
    // One vector of pixels takes eight channels a block too (any remainder has a kernel):
    // six accumulators could not hide the latency of the multiply-adds.
    let (block_o, block_v) = if s.o_n.is_multiple_of(WIDE_BLOCK_O) || s.width <= 16 {
        (WIDE_BLOCK_O, WIDE_BLOCK_V)
    } else {
        (BLOCK_O, BLOCK_V)
    };
    // The depth is taken in chunks whose slices of both operands stay in L1 while every
    // channel block reads them.
    let chunks = s.depth.div_ceil(DEPTH_CHUNK).max(1);
    let chunk = s.depth.div_ceil(chunks);
    let mut p = 0;
    while p < s.width {
        let rem = s.width - p;
        // Vectors left; four are better taken as two pairs than as three and a single.
        let left = rem.div_ceil(16);
        let nv = if left % block_v == 1 && left > block_v {
            2
        } else {
            left.min(block_v)
        };
        let masks: [__mmask16; BLOCK_V] =
            std::array::from_fn(|v| lanes(rem.saturating_sub(v * 16)));
        for c in 0..chunks {
            let depth = (c * chunk)..((c + 1) * chunk).min(s.depth);
            let mut o = 0;
            while o < s.o_n {
                let mo = (s.o_n - o).min(block_o);
                let at = Block {
                    p,
                    o,
                    depth: depth.clone(),
                };
                macro_rules! run {
                    ($($v:literal $m:literal),*) => {
                        match (nv, mo) {
                            $(($v, $m) => block::<$v, $m, A_TABLE, B_TABLE>(s, a, b, tables, bias, out, at, &masks),)*
                            _ => {}
                        }
                    };
                }
                run!(1 1, 1 2, 1 3, 1 4, 1 5, 1 6, 2 1, 2 2, 2 3, 2 4, 2 5, 2 6,
                 3 1, 3 2, 3 3, 3 4, 3 5, 3 6, 4 1, 4 2, 4 3, 4 4, 4 5, 4 6,
                 1 7, 1 8, 2 8, 3 8);
                o += mo;
            }
        }
        p += nv * 16;
    }
}

/// One register block: output channels `o..o + MO`, pixels `p..p + 16·NV` (masked), over one
/// range of the depth (accumulating onto the output after the first). With `B_TABLE`, row `k`
/// of `B` starts at `b + b_rows[k]`, else at `b + k·b_rs`; with `A_TABLE`, row `i` of `A` at
/// `a + a_rows[i]`, else at `a + i·a_rs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const NV: usize, const MO: usize, const A_TABLE: bool, const B_TABLE: bool>(
    s: TileShape,
    a: *const f32,
    b: *const f32,
    tables: Tables,
    bias: Option<&[f32]>,
    out: *mut f32,
    at: Block,
    masks: &[__mmask16; BLOCK_V],
) {
    let Block { p, o, depth } = at;
    let first = depth.start == 0;
    let mut acc = [[_mm512_setzero_ps(); NV]; MO];
    if s.accumulate || !first {
        for (i, row) in acc.iter_mut().enumerate() {
            let src = out.add((o + i) * s.out_stride + p);
            for v in 0..NV {
                row[v] = _mm512_maskz_loadu_ps(masks[v], src.add(16 * v));
            }
        }
    }
    if let Some(bias) = bias.filter(|_| first) {
        for (i, row) in acc.iter_mut().enumerate() {
            let bv = _mm512_set1_ps(bias[o + i]);
            for v in row.iter_mut() {
                *v = _mm512_add_ps(*v, bv);
            }
        }
    }
    let mut bp = b.add(if B_TABLE { 0 } else { depth.start * s.b_rs } + p);
    let mut ap = a.add(if A_TABLE { 0 } else { o * s.a_rs } + depth.start * s.a_cs);
    // With a table, the rows of A in this block start at these offsets from `ap`.
    let a_rows: [usize; MO] = std::array::from_fn(|i| {
        if A_TABLE {
            *tables.a_rows.get_unchecked(o + i)
        } else {
            i * s.a_rs
        }
    });
    for k in depth {
        if B_TABLE {
            bp = b.add(*tables.b_rows.get_unchecked(k) + p);
        }
        let mut x = [_mm512_setzero_ps(); NV];
        for v in 0..NV {
            x[v] = _mm512_maskz_loadu_ps(masks[v], bp.add(16 * v));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let wi = _mm512_set1_ps(*ap.add(a_rows[i]));
            for v in 0..NV {
                row[v] = _mm512_fmadd_ps(wi, x[v], row[v]);
            }
        }
        if !B_TABLE {
            bp = bp.wrapping_add(s.b_rs);
        }
        ap = ap.wrapping_add(s.a_cs);
    }
    for (i, row) in acc.iter().enumerate() {
        let dst = out.add((o + i) * s.out_stride + p);
        for v in 0..NV {
            _mm512_mask_storeu_ps(dst.add(16 * v), masks[v], row[v]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_products_match_an_f64_sum_for_ragged_blocks() {
        let Some(cpu) = avx512() else {
            return;
        };
        let cases = [
            (16, 144, 64, 1024, false, false),
            (6, 25, 100, 100, false, false),
            (13, 7, 37, 40, true, false),
            (24, 9, 70, 75, false, true),
            (5, 20, 150, 150, true, true),
            (8, 300, 50, 60, false, false),
            (7, 200, 33, 33, true, true),
            // One vector wide: blocks of eight channels with a remainder of 7 and of 3.
            (15, 30, 16, 16, true, false),
            (27, 40, 9, 12, false, true),
        ];
        for (o_n, depth, width, stride, accumulate, a_rows) in cases {
            let a: Vec<f32> = (0..depth * o_n)
                .map(|i| ((i * 7) % 11) as f32 - 5.0)
                .collect();
            let b: Vec<f32> = (0..depth * (width + 3))
                .map(|i| ((i * 3) % 13) as f32 - 6.0)
                .collect();
            let bias: Vec<f32> = (0..o_n).map(|i| i as f32 * 0.5).collect();
            let mut out = vec![-7.0f32; (o_n - 1) * stride + width];
            // A stored `[depth, o_n]` (as the forward's weights) or `[o_n, depth]`.
            let (a_rs, a_cs) = if a_rows { (depth, 1) } else { (1, o_n) };
            let shape = TileShape {
                o_n,
                depth,
                width,
                a_rs,
                a_cs,
                b_rs: width + 3,
                out_stride: stride,
                accumulate,
            };
            product(cpu, shape, &a, &b, Some(&bias), &mut out);
            for o in 0..o_n {
                for p in 0..width {
                    let start = if accumulate { -7.0 } else { 0.0 };
                    let want = start
                        + bias[o] as f64
                        + (0..depth)
                            .map(|k| a[o * a_rs + k * a_cs] as f64 * b[k * (width + 3) + p] as f64)
                            .sum::<f64>();
                    assert_eq!(out[o * stride + p] as f64, want, "o {o} p {p}");
                }
                // Pixels past the tile are left alone.
                if o + 1 < o_n && width < stride {
                    assert_eq!(out[o * stride + width], -7.0);
                }
            }
        }
    }
}
