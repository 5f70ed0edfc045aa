//! Conversions between f32 and the 16-bit floats (bf16, f16) over host slices, vectorised:
//! what `to_dtype` runs between those dtypes, and what the ops' half kernels use to widen a
//! block of halves into an f32 scratch buffer and to round it back.
//!
//! The instructions are chosen at run time ([`Path::detect`]): bf16 rounds with AVX512-BF16's
//! `vcvtneps2bf16` where the CPU has it, f16 converts with AVX-512F's (or F16C's) `vcvtph2ps` /
//! `vcvtps2ph`; widening bf16 is a 16-bit shift in every path. The plain path is scalar code
//! (the bf16 bit operations still auto-vectorise). Every path rounds to nearest, ties to even,
//! and keeps NaN a NaN; they agree bit for bit except that `vcvtneps2bf16` flushes f32
//! subnormal inputs (below 2^-126 in magnitude, far below any activation or gradient a
//! bf16 step produces) to a zero of the same sign, as PyTorch's vectorised bf16 rounding does
//! on such CPUs.

use half::{bf16, f16};

/// Which instructions a conversion runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The widest this CPU has: AVX-512 (with AVX512-BF16 for rounding to bf16), else F16C
    /// for f16 (bf16 then takes the plain path).
    Vector,
    /// Scalar code, on any CPU.
    Plain,
}

/// Which vector extensions this CPU has, as the conversions use them.
#[derive(Clone, Copy, Debug)]
struct Features {
    avx512f: bool,
    avx512bf16: bool,
    f16c: bool,
}

impl Features {
    /// Detected once per call (the standard library caches the CPU's answer).
    fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            let avx512f = std::arch::is_x86_feature_detected!("avx512f");
            Features {
                avx512f,
                avx512bf16: avx512f && std::arch::is_x86_feature_detected!("avx512bf16"),
                f16c: std::arch::is_x86_feature_detected!("avx")
                    && std::arch::is_x86_feature_detected!("f16c"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features {
            avx512f: false,
            avx512bf16: false,
            f16c: false,
        }
    }
}

/// A 16-bit float whose slices convert to and from f32 slices.
pub trait HalfSlice: Sized + Copy {
    /// `dst[i] = src[i]` widened to f32 (exact), on `path`. Panics when the lengths differ.
    fn widen_on(path: Path, src: &[Self], dst: &mut [f32]);
    /// `dst[i] = src[i]` rounded to this type (nearest, ties to even), on `path`. Panics when
    /// the lengths differ.
    fn narrow_on(path: Path, src: &[f32], dst: &mut [Self]);
}

/// `dst[i] = src[i]` widened to f32, on the widest instructions this CPU has.
pub fn widen<H: HalfSlice>(src: &[H], dst: &mut [f32]) {
    H::widen_on(Path::Vector, src, dst)
}

/// `dst[i] = src[i]` rounded to `H` (nearest, ties to even), on the widest instructions this
/// CPU has.
pub fn narrow<H: HalfSlice>(src: &[f32], dst: &mut [H]) {
    H::narrow_on(Path::Vector, src, dst)
}

/// Checks the lengths of a conversion's slices (a caller's bug, not a user error).
fn same_len(src: usize, dst: usize) {
    assert_eq!(
        src, dst,
        "half conversion: source and destination lengths differ"
    );
}

/// bf16 → f32: the bits moved to the top half.
#[inline(always)]
fn bf16_load(h: bf16) -> f32 {
    f32::from_bits((h.to_bits() as u32) << 16)
}

/// f32 → bf16, nearest with ties to even, NaN kept a quiet NaN; branch-free so it vectorises.
#[inline(always)]
fn bf16_store(v: f32) -> bf16 {
    let x = v.to_bits();
    // Adding 0x7fff plus the kept lowest bit rounds to nearest with ties to even; a carry
    // into the exponent is the correct rounding up (to the next binade, or to infinity).
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
    let quiet = ((x >> 16) as u16) | 0x0040;
    bf16::from_bits(if nan { quiet } else { rounded })
}

/// The scalar bf16 loops (inlined into the vector-feature functions too).
#[inline(always)]
fn bf16_widen_plain(src: &[bf16], dst: &mut [f32]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &s)| *d = bf16_load(s));
}

#[inline(always)]
fn bf16_narrow_plain(src: &[f32], dst: &mut [bf16]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &s)| *d = bf16_store(s));
}

impl HalfSlice for bf16 {
    fn widen_on(path: Path, src: &[bf16], dst: &mut [f32]) {
        same_len(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if path == Path::Vector && Features::detect().avx512f {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { x86::bf16_widen_avx512(src, dst) };
        }
        let _ = path;
        bf16_widen_plain(src, dst)
    }

    fn narrow_on(path: Path, src: &[f32], dst: &mut [bf16]) {
        same_len(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if path == Path::Vector {
            let f = Features::detect();
            if f.avx512bf16 {
                // SAFETY: the CPU has AVX-512F and AVX512-BF16, checked just above.
                return unsafe { x86::bf16_narrow_avx512bf16(src, dst) };
            }
            if f.avx512f {
                // SAFETY: the CPU has AVX-512F, checked just above.
                return unsafe { x86::bf16_narrow_avx512(src, dst) };
            }
        }
        let _ = path;
        bf16_narrow_plain(src, dst)
    }
}

impl HalfSlice for f16 {
    fn widen_on(path: Path, src: &[f16], dst: &mut [f32]) {
        same_len(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if path == Path::Vector {
            let f = Features::detect();
            if f.avx512f {
                // SAFETY: the CPU has AVX-512F, checked just above.
                return unsafe { x86::f16_widen_avx512(src, dst) };
            }
            if f.f16c {
                // SAFETY: the CPU has AVX and F16C, checked just above.
                return unsafe { x86::f16_widen_f16c(src, dst) };
            }
        }
        let _ = path;
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }

    fn narrow_on(path: Path, src: &[f32], dst: &mut [f16]) {
        same_len(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if path == Path::Vector {
            let f = Features::detect();
            if f.avx512f {
                // SAFETY: the CPU has AVX-512F, checked just above.
                return unsafe { x86::f16_narrow_avx512(src, dst) };
            }
            if f.f16c {
                // SAFETY: the CPU has AVX and F16C, checked just above.
                return unsafe { x86::f16_narrow_f16c(src, dst) };
            }
        }
        let _ = path;
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = f16::from_f32(s));
    }
}

/// The x86 vector loops. Each converts whole vectors in place and the tail (fewer than one
/// vector) through a zero-padded stack vector, so that every element goes through the same
/// instruction whatever its position.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Runs `f(src_chunk, dst_chunk)` on `W`-element chunks, the last one padded to `W` with
    /// `S::default()` in a stack buffer.
    #[inline(always)]
    fn chunked<S: Copy + Default, D: Copy + Default, const W: usize>(
        src: &[S],
        dst: &mut [D],
        mut f: impl FnMut(&[S; W], &mut [D; W]),
    ) {
        let mut s = src.chunks_exact(W);
        let mut d = dst.chunks_exact_mut(W);
        for (s, d) in (&mut s).zip(&mut d) {
            f(
                s.try_into().expect("W elements"),
                d.try_into().expect("W elements"),
            );
        }
        let (rs, rd) = (s.remainder(), d.into_remainder());
        if !rs.is_empty() {
            let mut sbuf = [S::default(); W];
            let mut dbuf = [D::default(); W];
            sbuf[..rs.len()].copy_from_slice(rs);
            f(&sbuf, &mut dbuf);
            rd.copy_from_slice(&dbuf[..rd.len()]);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_widen_avx512(src: &[bf16], dst: &mut [f32]) {
        chunked::<bf16, f32, 16>(src, dst, |s, d| {
            // SAFETY: `s` holds 16 bf16 (32 bytes) and `d` 16 f32 (64 bytes); both loads and
            // stores are unaligned; AVX-512F is enabled on this function.
            unsafe {
                let h = _mm256_loadu_si256(s.as_ptr() as *const __m256i);
                let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
                _mm512_storeu_ps(d.as_mut_ptr(), _mm512_castsi512_ps(w));
            }
        })
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn bf16_narrow_avx512bf16(src: &[f32], dst: &mut [bf16]) {
        chunked::<f32, bf16, 16>(src, dst, |s, d| {
            // SAFETY: `s` holds 16 f32 and `d` 16 bf16 (32 bytes); unaligned loads and
            // stores; AVX-512F and AVX512-BF16 are enabled on this function.
            unsafe {
                let v = _mm512_loadu_ps(s.as_ptr());
                let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
                _mm256_storeu_si256(d.as_mut_ptr() as *mut __m256i, h);
            }
        })
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_narrow_avx512(src: &[f32], dst: &mut [bf16]) {
        // The branch-free scalar rounding, auto-vectorised for AVX-512.
        super::bf16_narrow_plain(src, dst)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_widen_avx512(src: &[f16], dst: &mut [f32]) {
        chunked::<f16, f32, 16>(src, dst, |s, d| {
            // SAFETY: 16 f16 (32 bytes) in, 16 f32 out; unaligned; AVX-512F is enabled.
            unsafe {
                let h = _mm256_loadu_si256(s.as_ptr() as *const __m256i);
                _mm512_storeu_ps(d.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        })
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_narrow_avx512(src: &[f32], dst: &mut [f16]) {
        chunked::<f32, f16, 16>(src, dst, |s, d| {
            // SAFETY: 16 f32 in, 16 f16 (32 bytes) out; unaligned; AVX-512F is enabled.
            unsafe {
                let v = _mm512_loadu_ps(s.as_ptr());
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                _mm256_storeu_si256(d.as_mut_ptr() as *mut __m256i, h);
            }
        })
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_widen_f16c(src: &[f16], dst: &mut [f32]) {
        chunked::<f16, f32, 8>(src, dst, |s, d| {
            // SAFETY: 8 f16 (16 bytes) in, 8 f32 out; unaligned; AVX and F16C are enabled.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        })
    }

    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_narrow_f16c(src: &[f32], dst: &mut [f16]) {
        chunked::<f32, f16, 8>(src, dst, |s, d| {
            // SAFETY: 8 f32 in, 8 f16 (16 bytes) out; unaligned; AVX and F16C are enabled.
            unsafe {
                let v = _mm256_loadu_ps(s.as_ptr());
                let h = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(v);
                _mm_storeu_si128(d.as_mut_ptr() as *mut __m128i, h);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 values around every bf16/f16 neighbourhood: exact halves, just above, halfway,
    /// just below the next, plus zeros, infinities, NaN and subnormals.
    fn probe_values() -> Vec<f32> {
        let mut v = Vec::new();
        for hi in (0..=u16::MAX).step_by(7) {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                v.push(f32::from_bits(((hi as u32) << 16) | lo));
            }
        }
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            65504.0,
            65520.0,
        ]);
        v.extend([6.0e-8, 3.0e-8, 2.9e-8, -6.1e-5, 1e-40, -1e-40]);
        v
    }

    fn is_f32_subnormal(v: f32) -> bool {
        v != 0.0 && v.abs() < f32::MIN_POSITIVE
    }

    /// Every path, every length around the vector widths (tails), widens every bf16 and f16
    /// bit pattern exactly as the `half` crate does.
    #[test]
    fn widening_is_exact_on_every_path_and_tail() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for path in [Path::Vector, Path::Plain] {
            for len in [0usize, 1, 7, 8, 15, 16, 17, 33, all.len()] {
                let b: Vec<bf16> = all[..len].iter().map(|&x| bf16::from_bits(x)).collect();
                let h: Vec<f16> = all[..len].iter().map(|&x| f16::from_bits(x)).collect();
                let (mut wb, mut wh) = (vec![0.0f32; len], vec![0.0f32; len]);
                bf16::widen_on(path, &b, &mut wb);
                f16::widen_on(path, &h, &mut wh);
                for i in 0..len {
                    let (eb, eh) = (b[i].to_f32(), h[i].to_f32());
                    assert!(wb[i].to_bits() == eb.to_bits() || (wb[i].is_nan() && eb.is_nan()));
                    assert!(wh[i].to_bits() == eh.to_bits() || (wh[i].is_nan() && eh.is_nan()));
                }
            }
        }
    }

    /// Every path rounds to nearest with ties to even as the `half` crate does, NaN stays
    /// NaN, and AVX512-BF16's flush of f32 subnormals gives a zero of the same sign.
    #[test]
    fn narrowing_rounds_to_nearest_even_on_every_path_and_tail() {
        let probe = probe_values();
        for path in [Path::Vector, Path::Plain] {
            for len in [1usize, 5, 8, 16, 17, 31, probe.len()] {
                let src = &probe[probe.len() - len..];
                let mut b = vec![bf16::ZERO; len];
                let mut h = vec![f16::ZERO; len];
                bf16::narrow_on(path, src, &mut b);
                f16::narrow_on(path, src, &mut h);
                for (i, &v) in src.iter().enumerate() {
                    let (eb, eh) = (bf16::from_f32(v), f16::from_f32(v));
                    if v.is_nan() {
                        assert!(b[i].is_nan() && h[i].is_nan(), "{path:?} NaN");
                        continue;
                    }
                    assert_eq!(h[i].to_bits(), eh.to_bits(), "{path:?} f16 of {v:e}");
                    let flushed = is_f32_subnormal(v)
                        && b[i].to_f32() == 0.0
                        && b[i].is_sign_negative() == v.is_sign_negative();
                    assert!(
                        b[i].to_bits() == eb.to_bits() || flushed,
                        "{path:?} bf16 of {v:e}: {:#x} vs {:#x}",
                        b[i].to_bits(),
                        eb.to_bits()
                    );
                }
            }
        }
    }
}
