//! The channels-last batch-norm passes for f16/bf16 inputs whose channel count is a multiple
//! of 16, in AVX-512: each pass reads the halves and widens them in registers, 16 channels of
//! one row (pixel) per vector, so no f32 copy of any operand is made, not even a unit-sized
//! one (the general half passes of `half.rs` widen every operand into scratch first).
//!
//! The arithmetic is the f32 passes' (`nhwc.rs`): the per-element maps are the same f32
//! operations in the same order (separate multiply and add, the ReLU that keeps NaN and −0),
//! rounded once by the same conversion instructions, so their results are the f32 op's on the
//! widened values bit for bit; the per-channel sums accumulate in f32 over blocks of
//! [`nhwc::FOLD_ROWS`] rows, then in f64, over the same tasks, so they differ from the general
//! path's only in the order of the f32 additions within a block.

use tandem_core::{HalfElement, Result};

use super::nhwc;

/// Whether these passes run for `c` channels on this CPU.
pub(crate) fn applies(c: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        c > 0 && c.is_multiple_of(16) && x86::supported()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = c;
        false
    }
}

/// Per-channel mean and biased variance of `x` (`[rows, c]`): the sums, then the squared
/// deviations from the mean. Only when [`applies`].
pub(crate) fn moments<H: HalfElement>(x: &[H], c: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.len() / c;
    if rows == 0 {
        return (vec![0.0; c], vec![0.0; c]);
    }
    let sums = nhwc::channel_sums::<1>(rows, c, |first, n, acc| {
        x86::sum_rows(&x[first * c..(first + n) * c], c, None, acc)
    });
    let mean: Vec<f64> = sums.iter().map(|s| s / rows as f64).collect();
    let mean_f32: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
    let squares = nhwc::channel_sums::<1>(rows, c, |first, n, acc| {
        x86::sum_rows(&x[first * c..(first + n) * c], c, Some(&mean_f32), acc)
    });
    let var = squares.iter().map(|s| s / rows as f64).collect();
    (mean, var)
}

/// What a map computes per element from its operands (see `nhwc::Map`, whose f32 arithmetic
/// it repeats).
#[derive(Clone, Copy)]
pub(crate) enum HalfMap<'a, H> {
    /// `x·a + b`, then a ReLU when `relu`.
    Affine { relu: bool },
    /// `max(0, x·a + b + r)`.
    AffineAddRelu(&'a [H]),
    /// `g'·a + x·b + k`, with `g' = g` where `x·s + t > 0` when a mask is given.
    Gradient { x: &'a [H], masked: bool },
    /// `g` where `y > 0`, else 0.
    KeepPositive(&'a [H]),
}

/// The per-channel f32 constants of a map: `a`, `b`, `k` and a mask's `s`, `t` (absent ones
/// empty).
#[derive(Clone, Copy, Default)]
pub(crate) struct Constants<'a> {
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub k: &'a [f32],
    pub s: &'a [f32],
    pub t: &'a [f32],
}

/// The map of `u` (the input, or the output gradient), rounded to `H`. Only when
/// [`applies`].
pub(crate) fn map<H: HalfElement>(
    op: &'static str,
    u: &[H],
    c: usize,
    map: HalfMap<'_, H>,
    k: Constants<'_>,
) -> Result<Vec<H>> {
    nhwc::map_rows(op, u.len(), c, |first, out| {
        let range = first * c..first * c + out.len();
        x86::map_rows(&u[range.clone()], c, map, range.start, k, out)
    })
}

/// Per-channel `Σ g'` and `Σ g'·(x − mean)`, with `g' = g` where `x·s + t > 0` when `mask`
/// (`(s, t)` per channel) is given. Only when [`applies`].
pub(crate) fn grad_sums<H: HalfElement>(
    g: &[H],
    x: &[H],
    c: usize,
    mean: &[f64],
    mask: Option<(&[f32], &[f32])>,
) -> (Vec<f64>, Vec<f64>) {
    let rows = g.len() / c;
    let m: Vec<f32> = mean.iter().map(|&v| v as f32).collect();
    let sums = nhwc::channel_sums::<2>(rows, c, |first, n, acc| {
        let range = first * c..(first + n) * c;
        x86::grad_rows(&g[range.clone()], &x[range], c, &m, mask, acc)
    });
    let (sum_g, sum_gc) = sums.split_at(c);
    (sum_g.to_vec(), sum_gc.to_vec())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use tandem_core::{DType, HalfElement};

    use super::{Constants, HalfMap};
    use crate::batch_norm::cpu::nhwc::FOLD_ROWS;

    /// AVX-512F with AVX512-BF16 (for bf16's rounding instruction; f16's is AVX-512F's).
    pub(super) fn supported() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    /// 16 halves at `p`, widened (exact).
    ///
    /// # Safety
    /// 16 elements must be readable at `p`; AVX-512F must be enabled in the caller.
    #[inline(always)]
    unsafe fn load<H: HalfElement>(p: *const H) -> __m512 {
        // SAFETY: the caller's contract; the load is unaligned.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            if H::DTYPE == DType::BF16 {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            } else {
                _mm512_cvtph_ps(h)
            }
        }
    }

    /// `v` rounded to 16 halves at `p` (to nearest even, as `tandem_core::cpu::convert`'s
    /// vector path).
    ///
    /// # Safety
    /// 16 elements must be writable at `p`; AVX-512F and AVX512-BF16 must be enabled in the
    /// caller.
    #[inline(always)]
    unsafe fn store<H: HalfElement>(p: *mut H, v: __m512) {
        // SAFETY: the caller's contract; the store is unaligned.
        unsafe {
            let h: __m256i = if H::DTYPE == DType::BF16 {
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v))
            } else {
                _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
            };
            _mm256_storeu_si256(p.cast(), h);
        }
    }

    /// Adds the 16 f32 lanes of `v` into `acc[..16]` in f64.
    #[inline(always)]
    fn fold(v: __m512, acc: &mut [f64]) {
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 f32; the store is unaligned.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
        acc[..16]
            .iter_mut()
            .zip(lanes)
            .for_each(|(a, l)| *a += f64::from(l));
    }

    /// 16 per-channel f32 constants from `v[j..j + 16]`.
    #[inline(always)]
    fn constants(v: &[f32], j: usize) -> __m512 {
        let v = &v[j..j + 16];
        // SAFETY: `v` holds 16 f32; the load is unaligned.
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    }

    /// `Σ x` (or `Σ (x − m)²`) per channel of the rows of `x` (`[rows, c]`, `c` a multiple of
    /// 16) into `acc[..c]`: in f32 over [`FOLD_ROWS`] rows at a time, then in f64.
    pub(super) fn sum_rows<H: HalfElement>(x: &[H], c: usize, m: Option<&[f32]>, acc: &mut [f64]) {
        // SAFETY: `supported()` held when `applies` chose these passes.
        unsafe { sum_rows_avx512(x, c, m, acc) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn sum_rows_avx512<H: HalfElement>(
        x: &[H],
        c: usize,
        m: Option<&[f32]>,
        acc: &mut [f64],
    ) {
        for block in x.chunks(c * FOLD_ROWS) {
            for j in (0..c).step_by(16) {
                let mut s = _mm512_setzero_ps();
                let mean = m.map(|m| constants(m, j));
                for row in block[j..].chunks(c) {
                    // SAFETY: every row of the block holds the channels j..j + 16 (c is a
                    // multiple of 16 and the block whole rows).
                    let v = unsafe { load(row.as_ptr()) };
                    s = match mean {
                        None => _mm512_add_ps(s, v),
                        Some(mv) => {
                            let d = _mm512_sub_ps(v, mv);
                            _mm512_add_ps(s, _mm512_mul_ps(d, d))
                        }
                    };
                }
                fold(s, &mut acc[j..]);
            }
        }
    }

    /// Per-channel `Σ g'` into `acc[..c]` and `Σ g'·(x − m)` into `acc[c..2c]`, with `g' = g`
    /// where `x·s + t > 0` under `mask`.
    pub(super) fn grad_rows<H: HalfElement>(
        g: &[H],
        x: &[H],
        c: usize,
        m: &[f32],
        mask: Option<(&[f32], &[f32])>,
        acc: &mut [f64],
    ) {
        // SAFETY: `supported()` held when `applies` chose these passes.
        unsafe { grad_rows_avx512(g, x, c, m, mask, acc) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn grad_rows_avx512<H: HalfElement>(
        g: &[H],
        x: &[H],
        c: usize,
        m: &[f32],
        mask: Option<(&[f32], &[f32])>,
        acc: &mut [f64],
    ) {
        let (acc_g, acc_gc) = acc.split_at_mut(c);
        for (gb, xb) in g.chunks(c * FOLD_ROWS).zip(x.chunks(c * FOLD_ROWS)) {
            for j in (0..c).step_by(16) {
                let (mut sg, mut sgc) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                let mean = constants(m, j);
                let st = mask.map(|(s, t)| (constants(s, j), constants(t, j)));
                for (gr, xr) in gb[j..].chunks(c).zip(xb[j..].chunks(c)) {
                    // SAFETY: as in `sum_rows_avx512`, for both operands (laid out alike).
                    let (gv, xv) = unsafe { (load(gr.as_ptr()), load(xr.as_ptr())) };
                    let gv = match st {
                        None => gv,
                        Some((s, t)) => {
                            let z = _mm512_add_ps(_mm512_mul_ps(xv, s), t);
                            let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(z, _mm512_setzero_ps());
                            _mm512_maskz_mov_ps(keep, gv)
                        }
                    };
                    sg = _mm512_add_ps(sg, gv);
                    sgc = _mm512_add_ps(sgc, _mm512_mul_ps(gv, _mm512_sub_ps(xv, mean)));
                }
                fold(sg, &mut acc_g[j..]);
                fold(sgc, &mut acc_gc[j..]);
            }
        }
    }

    /// `out` = the map of the rows of `u`, whose first element is element `start` of the
    /// map's second operand.
    pub(super) fn map_rows<H: HalfElement>(
        u: &[H],
        c: usize,
        map: HalfMap<'_, H>,
        start: usize,
        k: Constants<'_>,
        out: &mut [H],
    ) {
        let second = match map {
            HalfMap::Affine { .. } => u,
            HalfMap::AffineAddRelu(v)
            | HalfMap::KeepPositive(v)
            | HalfMap::Gradient { x: v, .. } => &v[start..start + out.len()],
        };
        // SAFETY: `supported()` held when `applies` chose these passes.
        unsafe { map_rows_avx512(&u[..out.len()], second, c, map, k, out) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn map_rows_avx512<H: HalfElement>(
        u: &[H],
        v: &[H],
        c: usize,
        map: HalfMap<'_, H>,
        k: Constants<'_>,
        out: &mut [H],
    ) {
        let zero = _mm512_setzero_ps();
        // `z` where `z < 0` is false (NaN and −0 kept), else 0: the f32 passes' ReLU.
        let relu = |z: __m512| _mm512_maskz_mov_ps(!_mm512_cmp_ps_mask::<_CMP_LT_OQ>(z, zero), z);
        for j in (0..c).step_by(16) {
            let get = |v: &[f32]| if v.is_empty() { zero } else { constants(v, j) };
            let (a, b, kk, s, t) = (get(k.a), get(k.b), get(k.k), get(k.s), get(k.t));
            let rows = out[j..]
                .chunks_mut(c)
                .zip(u[j..].chunks(c))
                .zip(v[j..].chunks(c));
            for ((o, ur), vr) in rows {
                // SAFETY: every row holds the channels j..j + 16 of each operand (c is a
                // multiple of 16; all three are whole rows laid out alike).
                unsafe {
                    let uv = load(ur.as_ptr());
                    let y = match map {
                        HalfMap::Affine { relu: false } => _mm512_add_ps(_mm512_mul_ps(uv, a), b),
                        HalfMap::Affine { relu: true } => {
                            relu(_mm512_add_ps(_mm512_mul_ps(uv, a), b))
                        }
                        HalfMap::AffineAddRelu(_) => {
                            let z = _mm512_add_ps(_mm512_mul_ps(uv, a), b);
                            relu(_mm512_add_ps(z, load(vr.as_ptr())))
                        }
                        HalfMap::Gradient { masked, .. } => {
                            let xv = load(vr.as_ptr());
                            let gv = if masked {
                                let z = _mm512_add_ps(_mm512_mul_ps(xv, s), t);
                                _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(z, zero), uv)
                            } else {
                                uv
                            };
                            let p = _mm512_add_ps(_mm512_mul_ps(gv, a), _mm512_mul_ps(xv, b));
                            _mm512_add_ps(p, kk)
                        }
                        HalfMap::KeepPositive(_) => {
                            let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(load(vr.as_ptr()), zero);
                            _mm512_maskz_mov_ps(keep, uv)
                        }
                    };
                    store(o.as_mut_ptr(), y);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tandem_core::half::{bf16, f16};
    use tandem_core::Generator;

    use super::*;
    use crate::batch_norm::cpu::passes::Epilogue;

    /// `n` normal values (mean 0.3, deviation 1.5) rounded to `H`, with a few exact zeros, −0s
    /// and NaNs among them.
    fn values<H: HalfElement>(n: usize, seed: u64) -> Vec<H> {
        let mut g = Generator::new(seed);
        (0..n)
            .map(|i| match i % 97 {
                5 => H::from_f32(0.0),
                11 => H::from_f32(-0.0),
                13 if n > 1000 => H::from_f32(f32::NAN),
                _ => H::from_f32(0.3 + 1.5 * g.normal() as f32),
            })
            .collect()
    }

    fn widen<H: HalfElement>(v: &[H]) -> Vec<f32> {
        v.iter().map(|h| h.to_f32()).collect()
    }

    /// Bits of a half result, NaNs as one pattern (the rounding instructions and the `half`
    /// crate may quiet a NaN differently).
    fn bits<H: HalfElement>(v: &[H]) -> Vec<u64> {
        v.iter()
            .map(|h| {
                let f = h.to_f32();
                if f.is_nan() {
                    u64::MAX
                } else {
                    f.to_bits().into()
                }
            })
            .collect()
    }

    /// Every map equals the f32 pass on the widened operands, rounded once, bit for bit.
    fn maps_match<H: HalfElement>() {
        for c in [16, 32, 64] {
            let rows = 300;
            let len = rows * c;
            let (x, r, g) = (
                values::<H>(len, 1),
                values::<H>(len, 2),
                values::<H>(len, 3),
            );
            let (xf, rf, gf) = (widen(&x), widen(&r), widen(&g));
            let per = |k: f64| {
                (0..c)
                    .map(|j| k * (1.0 + j as f64 / 7.0))
                    .collect::<Vec<f64>>()
            };
            let (scale, shift, kk) = (per(0.7), per(-0.2), per(0.05));
            let mask: Vec<(f32, f32)> = scale
                .iter()
                .zip(&shift)
                .map(|(&s, &t)| (s as f32, t as f32))
                .collect();
            let (ms, mt): (Vec<f32>, Vec<f32>) = mask.iter().copied().unzip();
            let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
            let (a, b, k) = (f32s(&scale), f32s(&shift), f32s(&kk));
            let round = |v: Vec<f32>| v.into_iter().map(H::from_f32).collect::<Vec<H>>();
            let direct = |u: &[H], m, k| map("t", u, c, m, k).unwrap();
            let affine = Constants {
                a: &a,
                b: &b,
                ..Constants::default()
            };
            let gradient = Constants { k: &k, ..affine };
            let masked = Constants {
                s: &ms,
                t: &mt,
                ..gradient
            };
            let normalize =
                |e| round(nhwc::normalize::<f32>("t", &xf, c, &scale, &shift, e).unwrap());
            let grad_input = |m| {
                round(nhwc::grad_input::<f32>("t", &gf, &xf, c, &scale, &shift, &kk, m).unwrap())
            };
            let cases: Vec<(&str, Vec<H>, Vec<H>)> = vec![
                (
                    "affine",
                    direct(&x, HalfMap::Affine { relu: false }, affine),
                    normalize(Epilogue::Plain),
                ),
                (
                    "affine relu",
                    direct(&x, HalfMap::Affine { relu: true }, affine),
                    normalize(Epilogue::Relu),
                ),
                (
                    "affine add relu",
                    direct(&x, HalfMap::AffineAddRelu(&r), affine),
                    normalize(Epilogue::AddRelu(&rf)),
                ),
                (
                    "keep positive",
                    direct(&g, HalfMap::KeepPositive(&r), Constants::default()),
                    round(
                        nhwc::masked_grad_sums::<f32>("t", &gf, &rf, &xf, c, &scale)
                            .unwrap()
                            .0,
                    ),
                ),
                (
                    "gradient",
                    direct(
                        &g,
                        HalfMap::Gradient {
                            x: &x,
                            masked: false,
                        },
                        gradient,
                    ),
                    grad_input(None),
                ),
                (
                    "masked gradient",
                    direct(
                        &g,
                        HalfMap::Gradient {
                            x: &x,
                            masked: true,
                        },
                        masked,
                    ),
                    grad_input(Some(&mask)),
                ),
            ];
            for (name, got, want) in cases {
                assert_eq!(bits(&got), bits(&want), "{name}, {} c={c}", H::DTYPE);
            }
        }
    }

    /// The per-channel sums against f64 sums of the same (widened) values, within f32's
    /// rounding of the blocks.
    fn sums_match<H: HalfElement>() {
        for (c, rows) in [(16, 1000), (48, 77), (64, 300)] {
            let len = rows * c;
            // No NaN: sums are compared by value.
            let x: Vec<H> = values::<H>(len, 4)
                .into_iter()
                .map(|h| {
                    if h.to_f32().is_nan() {
                        H::from_f32(1.0)
                    } else {
                        h
                    }
                })
                .collect();
            let g: Vec<H> = values::<H>(len, 5)
                .into_iter()
                .map(|h| {
                    if h.to_f32().is_nan() {
                        H::from_f32(-1.0)
                    } else {
                        h
                    }
                })
                .collect();
            let col = |v: &[H], j: usize| {
                v.iter()
                    .skip(j)
                    .step_by(c)
                    .map(|h| h.to_f64())
                    .collect::<Vec<f64>>()
            };
            let (mean, var) = moments(&x, c);
            let mask_s: Vec<f32> = (0..c)
                .map(|j| if j % 2 == 0 { 1.0 } else { -0.5 })
                .collect();
            let mask_t: Vec<f32> = vec![0.1; c];
            let (sg, sgc) = grad_sums(&g, &x, c, &mean, Some((&mask_s, &mask_t)));
            for j in 0..c {
                let (xs, gs) = (col(&x, j), col(&g, j));
                let n = rows as f64;
                let m = xs.iter().sum::<f64>() / n;
                let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n;
                let scale: f64 = xs.iter().map(|x| x.abs()).sum::<f64>() / n;
                assert!(
                    (mean[j] - m).abs() <= 1e-6 * scale,
                    "{} c={c} mean {} vs {m}",
                    H::DTYPE,
                    mean[j]
                );
                assert!(
                    (var[j] - v).abs() <= 1e-5 * v,
                    "{} c={c} var {} vs {v}",
                    H::DTYPE,
                    var[j]
                );
                let kept: Vec<(f64, f64)> = gs
                    .iter()
                    .zip(&xs)
                    .map(|(&g, &x)| {
                        let z = x as f32 * mask_s[j] + mask_t[j];
                        (if z > 0.0 { g } else { 0.0 }, x)
                    })
                    .collect();
                let want_g: f64 = kept.iter().map(|p| p.0).sum();
                let want_gc: f64 = kept.iter().map(|(g, x)| g * (x - mean[j])).sum();
                let bound_g: f64 = kept.iter().map(|p| p.0.abs()).sum::<f64>() * 1e-6;
                let bound_gc: f64 = kept
                    .iter()
                    .map(|(g, x)| (g * (x - mean[j])).abs())
                    .sum::<f64>()
                    * 1e-6;
                assert!(
                    (sg[j] - want_g).abs() <= bound_g,
                    "{} c={c} Σg {} vs {want_g}",
                    H::DTYPE,
                    sg[j]
                );
                assert!(
                    (sgc[j] - want_gc).abs() <= bound_gc,
                    "{} c={c} Σg(x−m) {} vs {want_gc}",
                    H::DTYPE,
                    sgc[j]
                );
            }
        }
    }

    #[test]
    fn the_maps_equal_the_f32_passes_bit_for_bit_and_the_sums_f64_sums() {
        if !applies(16) {
            println!("skipped: this CPU lacks AVX-512F or AVX512-BF16");
            return;
        }
        maps_match::<bf16>();
        maps_match::<f16>();
        sums_match::<bf16>();
        sums_match::<f16>();
        assert!(!applies(8) && !applies(24) && !applies(0));
    }
}
