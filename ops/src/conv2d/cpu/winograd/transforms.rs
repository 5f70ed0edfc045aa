//! The AVX-512 tile transforms of Winograd F(2×2, 3×3), 16 tiles a vector over a chunk's long
//! rows (see the parent module): the input transform `V = Bᵀ·d·B`, the output transform
//! `Y = Aᵀ·M·A` and, for the weight gradient, its adjoint `dM = A·dY·Aᵀ`.
//!
//! Tile `j` of a long row covers columns `2j..2j + 4` of the input rows (`2j, 2j + 1` of the
//! output rows), so a vector of 16 tiles reads 34 consecutive columns: its even and odd columns
//! are picked out of two pairs of loads by two-source permutes, after which each of the 16
//! transformed values is a handful of vector additions.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::super::tile_product;

/// `v[ξ·xi_stride + j] = (Bᵀ·d_j·B)[ξ]` for the tiles `j < tiles` (a multiple of 16), where
/// `d_j` is columns `2j..2j + 4` of the four long rows `rows[i·row_len..]` and
/// `Bᵀ = [[1, 0, −1, 0], [0, 1, 1, 0], [0, −1, 1, 0], [0, 1, 0, −1]]`.
pub(super) fn input_tiles(
    rows: &[f32],
    row_len: usize,
    tiles: usize,
    v: &mut [f32],
    xi_stride: usize,
) {
    assert!(tiles.is_multiple_of(16) && tile_product::available());
    if tiles == 0 {
        return;
    }
    assert!(row_len >= 2 * tiles + 2 && rows.len() >= 3 * row_len + 2 * tiles + 2);
    assert!(v.len() >= 15 * xi_stride + tiles && xi_stride >= tiles);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted); the loads reach `3·row_len + 2·tiles + 1` and the
    // stores `15·xi_stride + tiles − 1`, inside the slices by the assertions.
    unsafe {
        input_avx512(rows.as_ptr(), row_len, tiles, v.as_mut_ptr(), xi_stride)
    }
}

/// The output transform of one output channel: for the tiles `j < tiles` (a multiple of 16)
/// with `M_j[ξ] = m[ξ·xi_stride + j]`, writes `Y_j = Aᵀ·M_j·A + bias`,
/// `Aᵀ = [[1, 1, 1, 0], [0, 1, −1, −1]]`, as columns `2j, 2j + 1` of the long output rows
/// `top` and `bottom`.
pub(super) fn output_tiles(
    m: &[f32],
    xi_stride: usize,
    tiles: usize,
    bias: f32,
    top: &mut [f32],
    bottom: &mut [f32],
) {
    assert!(tiles.is_multiple_of(16) && tile_product::available());
    if tiles == 0 {
        return;
    }
    assert!(
        m.len() >= 15 * xi_stride + tiles && top.len() >= 2 * tiles && bottom.len() >= 2 * tiles
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted); the loads reach `15·xi_stride + tiles − 1` and the
    // stores `2·tiles − 1`, inside the slices by the assertions.
    unsafe {
        output_avx512(
            m.as_ptr(),
            xi_stride,
            tiles,
            bias,
            top.as_mut_ptr(),
            bottom.as_mut_ptr(),
        )
    }
}

/// The adjoint of [`output_tiles`] for one output channel: from the long output-gradient rows
/// `top` and `bottom` (columns `2j, 2j + 1` for tile `j`), writes
/// `dm[ξ·xi_stride + j] = (A·dY_j·Aᵀ)[ξ]` for the tiles `j < tiles` (a multiple of 16).
pub(super) fn output_adjoint_tiles(
    top: &[f32],
    bottom: &[f32],
    tiles: usize,
    dm: &mut [f32],
    xi_stride: usize,
) {
    assert!(tiles.is_multiple_of(16) && tile_product::available());
    if tiles == 0 {
        return;
    }
    assert!(top.len() >= 2 * tiles && bottom.len() >= 2 * tiles);
    assert!(dm.len() >= 15 * xi_stride + tiles && xi_stride >= tiles);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted); the loads reach `2·tiles − 1` and the stores
    // `15·xi_stride + tiles − 1`, inside the slices by the assertions.
    unsafe {
        adjoint_avx512(
            top.as_ptr(),
            bottom.as_ptr(),
            tiles,
            dm.as_mut_ptr(),
            xi_stride,
        )
    }
}

/// Lane indices of the even and of the odd elements of two concatenated vectors.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn deinterleave_indices() -> (__m512i, __m512i) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (even, odd)
}

/// Lane indices interleaving two vectors, lanes 0–7 and lanes 8–15.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn interleave_indices() -> (__m512i, __m512i) {
    let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    (low, high)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn input_avx512(rows: *const f32, row_len: usize, tiles: usize, v: *mut f32, xs: usize) {
    let (even, odd) = deinterleave_indices();
    for j in (0..tiles).step_by(16) {
        // Columns 2j..2j + 16, 2j + 16..2j + 32 (for d0, d1 of each tile) and the same two
        // columns on (for d2, d3).
        let offsets = [2 * j, 2 * j + 16, 2 * j + 2, 2 * j + 18];
        // Bᵀ·d down the columns: t[i][l] for row combination i and load l.
        let mut t = [[_mm512_setzero_ps(); 4]; 4];
        for (l, &at) in offsets.iter().enumerate() {
            let d: [__m512; 4] =
                std::array::from_fn(|i| _mm512_loadu_ps(rows.add(i * row_len + at)));
            t[0][l] = _mm512_sub_ps(d[0], d[2]);
            t[1][l] = _mm512_add_ps(d[1], d[2]);
            t[2][l] = _mm512_sub_ps(d[2], d[1]);
            t[3][l] = _mm512_sub_ps(d[1], d[3]);
        }
        for (i, r) in t.iter().enumerate() {
            // Columns 0..4 of each tile of this row combination.
            let x0 = _mm512_permutex2var_ps(r[0], even, r[1]);
            let x1 = _mm512_permutex2var_ps(r[0], odd, r[1]);
            let x2 = _mm512_permutex2var_ps(r[2], even, r[3]);
            let x3 = _mm512_permutex2var_ps(r[2], odd, r[3]);
            let dst = v.add(4 * i * xs + j);
            _mm512_storeu_ps(dst, _mm512_sub_ps(x0, x2));
            _mm512_storeu_ps(dst.add(xs), _mm512_add_ps(x1, x2));
            _mm512_storeu_ps(dst.add(2 * xs), _mm512_sub_ps(x2, x1));
            _mm512_storeu_ps(dst.add(3 * xs), _mm512_sub_ps(x1, x3));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn output_avx512(
    m: *const f32,
    xs: usize,
    tiles: usize,
    bias: f32,
    top: *mut f32,
    bottom: *mut f32,
) {
    let (low, high) = interleave_indices();
    let b = _mm512_set1_ps(bias);
    for j in (0..tiles).step_by(16) {
        let at = |xi: usize| _mm512_loadu_ps(m.add(xi * xs + j));
        // Aᵀ·M: s[a][k].
        let s: [[__m512; 4]; 2] = [
            std::array::from_fn(|k| _mm512_add_ps(_mm512_add_ps(at(k), at(4 + k)), at(8 + k))),
            std::array::from_fn(|k| _mm512_sub_ps(_mm512_sub_ps(at(4 + k), at(8 + k)), at(12 + k))),
        ];
        for (a, dst) in [top, bottom].into_iter().enumerate() {
            let r = &s[a];
            let y0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(r[0], r[1]), r[2]), b);
            let y1 = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(r[1], r[2]), r[3]), b);
            let dst = dst.add(2 * j);
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(y0, low, y1));
            _mm512_storeu_ps(dst.add(16), _mm512_permutex2var_ps(y0, high, y1));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn adjoint_avx512(
    top: *const f32,
    bottom: *const f32,
    tiles: usize,
    dm: *mut f32,
    xs: usize,
) {
    let (even, odd) = deinterleave_indices();
    for j in (0..tiles).step_by(16) {
        // dY row a, columns 0 and 1 of each tile.
        let split = |row: *const f32| {
            let (lo, hi) = (
                _mm512_loadu_ps(row.add(2 * j)),
                _mm512_loadu_ps(row.add(2 * j + 16)),
            );
            (
                _mm512_permutex2var_ps(lo, even, hi),
                _mm512_permutex2var_ps(lo, odd, hi),
            )
        };
        let (y00, y01) = split(top);
        let (y10, y11) = split(bottom);
        // dY·Aᵀ along each row: columns [y0, y0 + y1, y0 − y1, −y1].
        let across = |y0: __m512, y1: __m512| {
            [
                y0,
                _mm512_add_ps(y0, y1),
                _mm512_sub_ps(y0, y1),
                _mm512_sub_ps(_mm512_setzero_ps(), y1),
            ]
        };
        let (r0, r1) = (across(y00, y01), across(y10, y11));
        // A·(dY·Aᵀ) down the columns: rows [r0, r0 + r1, r0 − r1, −r1].
        for k in 0..4 {
            let dst = dm.add(k * xs + j);
            _mm512_storeu_ps(dst, r0[k]);
            _mm512_storeu_ps(dst.add(4 * xs), _mm512_add_ps(r0[k], r1[k]));
            _mm512_storeu_ps(dst.add(8 * xs), _mm512_sub_ps(r0[k], r1[k]));
            _mm512_storeu_ps(dst.add(12 * xs), _mm512_sub_ps(_mm512_setzero_ps(), r1[k]));
        }
    }
}

/// No source row: a row of the padding.
pub(super) const PAD_ROW: usize = usize::MAX;

/// Lays out `k` long rows: long row `i` (at `rows[i·row_len..]`) gets, for each segment `s`,
/// `seg` columns at `s·seg` with `src[sources[k·s + i] + q − shift]` in columns
/// `shift ≤ q < shift + width` and zeros elsewhere (all zeros where the source is
/// [`PAD_ROW`]). Writes zeros up to the next multiple of 16 past each segment, so segments
/// are written in order and the last one's overhang must fit in `row_len`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_rows(
    src: &[f32],
    sources: &[usize],
    k: usize,
    width: usize,
    shift: usize,
    seg: usize,
    rows: &mut [f32],
    row_len: usize,
) {
    assert!(tile_product::available() && k > 0 && sources.len().is_multiple_of(k));
    let segments = sources.len() / k;
    assert!(segments == 0 || (segments - 1) * seg + seg.next_multiple_of(16) <= row_len);
    assert!(rows.len() >= k * row_len);
    // Every source row lies inside `src` (a fold, not `all`: it vectorises).
    let last = src.len().checked_sub(width);
    assert!(last.is_some_and(|last| sources
        .iter()
        .fold(true, |ok, &at| ok & (at == PAD_ROW || at <= last))));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted). Stores reach `(k − 1)·row_len + (segments −
    // 1)·seg + seg.next_multiple_of(16) − 1 < rows.len()`; a source lane is read only where
    // `0 ≤ q − shift < width` (the mask; masked-off lanes are not accessed), inside the row of
    // `width` elements at `sources[k]`, checked above. Pointers are formed by wrapping
    // arithmetic.
    unsafe {
        gather_avx512(
            src.as_ptr(),
            sources,
            k,
            width,
            shift,
            seg,
            rows.as_mut_ptr(),
            row_len,
        )
    }
}

/// Copies `src[..len]` into `dst[..len]` (a row of output tiles into the output).
pub(super) fn copy_row(src: &[f32], dst: &mut [f32], len: usize) {
    assert!(tile_product::available() && src.len() >= len && dst.len() >= len);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted); the masked loads and stores touch only indices
    // below `len`, inside both slices.
    unsafe {
        copy_row_avx512(src.as_ptr(), dst.as_mut_ptr(), len)
    }
}

/// The mask of lanes `lo..hi` (each at most 16).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lane_range(lo: usize, hi: usize) -> __mmask16 {
    let below = |n: usize| if n >= 16 { 0xffffu32 } else { (1u32 << n) - 1 };
    (below(hi) & !below(lo)) as __mmask16
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn gather_avx512(
    src: *const f32,
    sources: &[usize],
    k: usize,
    width: usize,
    shift: usize,
    seg: usize,
    rows: *mut f32,
    row_len: usize,
) {
    // The mask of vector v of a segment is the same for every row.
    let mask = |v: usize| {
        let q = 16 * v;
        lane_range(
            shift.saturating_sub(q).min(16),
            (shift + width).saturating_sub(q).min(16),
        )
    };
    let vectors = seg.div_ceil(16);
    // Hoisted out of the row loop (rows are short: recomputing the masks cost as much as the
    // copy); segments of more than `MASKS` vectors compute the rest as they go.
    const MASKS: usize = 8;
    let masks: [__mmask16; MASKS] = std::array::from_fn(mask);
    for (s, at) in sources.chunks_exact(k).enumerate() {
        for (i, &from) in at.iter().enumerate() {
            let dst = rows.add(i * row_len + s * seg);
            // A padding row reads nothing.
            let (row, all) = if from == PAD_ROW {
                (src, 0)
            } else {
                (src.wrapping_add(from).wrapping_sub(shift), 0xffff)
            };
            // Lane l of vector v reads src[from + 16v + l − shift]: the pointer may lie before
            // the row, but only lanes inside it are read.
            for v in 0..vectors {
                let m = masks.get(v).copied().unwrap_or_else(|| mask(v));
                let x = _mm512_maskz_loadu_ps(m & all, row.wrapping_add(16 * v));
                _mm512_storeu_ps(dst.add(16 * v), x);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_row_avx512(src: *const f32, dst: *mut f32, len: usize) {
    for q in (0..len).step_by(16) {
        let mask = lane_range(0, len - q);
        _mm512_mask_storeu_ps(dst.add(q), mask, _mm512_maskz_loadu_ps(mask, src.add(q)));
    }
}

/// The weight transform `u[(ξ·c_n + c)·o_n + o] = (G·w[o, c]·Gᵀ)[ξ]` for the weights `w`
/// (`[o_n, c_n, 3, 3]`), with `G = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]`: 16 output
/// channels a vector, their kernels gathered.
pub(super) fn weight_tiles(w: &[f32], c_n: usize, o_n: usize, u: &mut [f32]) {
    assert!(tile_product::available() && w.len() >= o_n * c_n * 9 && u.len() >= 16 * c_n * o_n);
    // Gather indices (lane · c_n · 9) must fit an i32.
    assert!(c_n
        .checked_mul(9 * 16)
        .is_some_and(|v| v <= i32::MAX as usize));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted). Lane l of a block at `o0` reads
    // `w[((o0 + l)·c_n + c)·9 + k]` only where `o0 + l < o_n` (masked gathers), below
    // `o_n·c_n·9`; stores (masked likewise) stay below `16·c_n·o_n`.
    unsafe {
        weight_avx512(w.as_ptr(), c_n, o_n, u.as_mut_ptr())
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weight_avx512(w: *const f32, c_n: usize, o_n: usize, u: *mut f32) {
    let step = (c_n * 9) as i32;
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(step),
    );
    let half = _mm512_set1_ps(0.5);
    let col = |a: __m512, b: __m512, c: __m512| {
        [
            a,
            _mm512_mul_ps(half, _mm512_add_ps(_mm512_add_ps(a, b), c)),
            _mm512_mul_ps(half, _mm512_add_ps(_mm512_sub_ps(a, b), c)),
            c,
        ]
    };
    for o0 in (0..o_n).step_by(16) {
        let mask = lane_range(0, o_n - o0);
        for c in 0..c_n {
            let base = w.add((o0 * c_n + c) * 9);
            let k: [__m512; 9] = std::array::from_fn(|t| {
                _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, index, base.add(t))
            });
            // G·k, column by column.
            let cols: [[__m512; 4]; 3] = std::array::from_fn(|j| col(k[j], k[3 + j], k[6 + j]));
            let rows = (0..4).map(|i| col(cols[0][i], cols[1][i], cols[2][i]));
            for (i, row) in rows.enumerate() {
                for (jj, &value) in row.iter().enumerate() {
                    let dst = u.add(((4 * i + jj) * c_n + c) * o_n + o0);
                    _mm512_mask_storeu_ps(dst, mask, value);
                }
            }
        }
    }
}
