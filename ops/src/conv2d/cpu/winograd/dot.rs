//! The products of the Winograd weight gradient, `dU[ξ] += dM[ξ]·V[ξ]ᵀ`: both operands hold
//! the tiles contiguously (`[O][T]` and `[C][T]`), so each entry is a dot product over the
//! tiles. A register block of 4 output × 4 input channels keeps 16 vectors of partial sums
//! (16 multiply-adds for every 8 vector loads) and folds them, at the end of the chunk, into
//! one vector of the 16 sums by a transposing reduction.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::super::tile_product;

/// Channels of a register block along each side.
pub(super) const BLOCK: usize = 4;

/// Elements of the accumulator that [`weight_products`] adds to: for each of the 16 positions,
/// one 16-value block per pair of 4-channel blocks.
pub(super) fn accumulator_len(o_n: usize, c_n: usize) -> usize {
    16 * o_n.div_ceil(BLOCK) * c_n.div_ceil(BLOCK) * BLOCK * BLOCK
}

/// Where `dU[ξ][o][c]` sits in the accumulator of [`weight_products`].
pub(super) fn accumulator_index(xi: usize, o: usize, c: usize, c_n: usize, o_n: usize) -> usize {
    let (ob_n, cb_n) = (o_n.div_ceil(BLOCK), c_n.div_ceil(BLOCK));
    (((xi * ob_n + o / BLOCK) * cb_n + c / BLOCK) * BLOCK + o % BLOCK) * BLOCK + c % BLOCK
}

/// `acc[ξ, o, c] += Σ_{j < tiles} dm[ξ·m_xi + o·tiles + j] · v[ξ·v_xi + c·tiles + j]` for all
/// 16 positions, `o < o_n`, `c < c_n` (`tiles` a multiple of 16; the accumulator laid out as
/// [`accumulator_index`] says).
#[allow(clippy::too_many_arguments)]
pub(super) fn weight_products(
    dm: &[f32],
    m_xi: usize,
    v: &[f32],
    v_xi: usize,
    tiles: usize,
    o_n: usize,
    c_n: usize,
    acc: &mut [f32],
) {
    assert!(tile_product::available() && tiles.is_multiple_of(16));
    if tiles == 0 || o_n == 0 || c_n == 0 {
        return;
    }
    assert!(dm.len() >= 15 * m_xi + o_n * tiles && v.len() >= 15 * v_xi + c_n * tiles);
    assert!(acc.len() >= accumulator_len(o_n, c_n));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F is present (asserted). Row indices are clamped below `o_n` and `c_n`,
    // so the loads reach at most `15·m_xi + o_n·tiles − 1` and `15·v_xi + c_n·tiles − 1`; the
    // accumulator blocks lie below `accumulator_len`. All inside the slices by the assertions.
    unsafe {
        products_avx512(
            dm.as_ptr(),
            m_xi,
            v.as_ptr(),
            v_xi,
            tiles,
            o_n,
            c_n,
            acc.as_mut_ptr(),
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn products_avx512(
    dm: *const f32,
    m_xi: usize,
    v: *const f32,
    v_xi: usize,
    tiles: usize,
    o_n: usize,
    c_n: usize,
    acc: *mut f32,
) {
    let (ob_n, cb_n) = (o_n.div_ceil(BLOCK), c_n.div_ceil(BLOCK));
    for xi in 0..16 {
        for ob in 0..ob_n {
            // Past the last channel a block repeats it; those sums are never read.
            let a: [*const f32; BLOCK] =
                std::array::from_fn(|i| dm.add(xi * m_xi + (BLOCK * ob + i).min(o_n - 1) * tiles));
            for cb in 0..cb_n {
                let b: [*const f32; BLOCK] = std::array::from_fn(|k| {
                    v.add(xi * v_xi + (BLOCK * cb + k).min(c_n - 1) * tiles)
                });
                let mut sums = [_mm512_setzero_ps(); BLOCK * BLOCK];
                for j in (0..tiles).step_by(16) {
                    let x: [__m512; BLOCK] = std::array::from_fn(|k| _mm512_loadu_ps(b[k].add(j)));
                    for i in 0..BLOCK {
                        let y = _mm512_loadu_ps(a[i].add(j));
                        for k in 0..BLOCK {
                            sums[BLOCK * i + k] = _mm512_fmadd_ps(y, x[k], sums[BLOCK * i + k]);
                        }
                    }
                }
                let dst = acc.add(((xi * ob_n + ob) * cb_n + cb) * BLOCK * BLOCK);
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), lane_sums(sums)));
            }
        }
    }
}

/// Lane `l` of the result is the sum of the 16 lanes of `x[l]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lane_sums(x: [__m512; 16]) -> __m512 {
    // Pairs within 128-bit lanes: each lane of b[i] holds partial sums of x[2i] (even
    // positions) and x[2i + 1] (odd positions).
    let b: [__m512; 8] = std::array::from_fn(|i| {
        let (p, q) = (x[2 * i], x[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q))
    });
    // Then quadruples: each 128-bit lane of c[i] holds partial sums of x[4i..4i + 4].
    let c: [__m512; 4] = std::array::from_fn(|i| {
        let (p, q) = (_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(p, q));
        let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(p, q));
        _mm512_add_ps(lo, hi)
    });
    // Across the 128-bit lanes, twice.
    let fold = |p: __m512, q: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(p, q),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q),
        )
    };
    let d = [fold(c[0], c[1]), fold(c[2], c[3])];
    fold(d[0], d[1])
}
