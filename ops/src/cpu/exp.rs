//! The exponential the CPU kernels use: the float type's own for f64, and for f32 a
//! branch-free polynomial that vectorises (softmax, cross entropy, sigmoid and exp go through
//! it).

use tandem_core::FloatElement;

/// A float type together with the exponential the kernels use.
///
/// f64 uses the standard library's `exp`. f32 uses [`exp_f32`], written so that the compiler
/// turns a loop of it into vector code (the C library's `expf` is a scalar call per element);
/// softmax, cross entropy, sigmoid and exp all go through it.
pub(crate) trait ExpFloat: FloatElement {
    /// `e^self`.
    fn exp_fast(self) -> Self;
}

impl ExpFloat for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
}

impl ExpFloat for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
}

/// `e^x` in f32 within 2 ulp over the whole range (denormal results included; `exp(±∞)` is
/// `∞`/`0`, NaN stays NaN), branch-free so that loops over it vectorise.
///
/// `x = n·ln2 + r` with `n` an integer and `|r| ≤ ln2/2`; `e^r` is its Taylor series to `r⁷`
/// (truncation below 6e-9 relative) and `2ⁿ` is built from exponent bits in two halves, so
/// that neither half leaves the normal range even when the product is denormal or infinite.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // 1.5·2²³: adding it rounds to an integer that lands in the low mantissa bits
    const SHIFTER: f32 = 12_582_912.0;
    // ln 2 split in a 9-bit head (products with n ≤ 150 stay exact) and a tail
    const LN2_HI: f32 = 0.693_359_4; // 355/512
    const LN2_LO: f32 = -2.121_944_4e-4;
    // beyond these e^x is ∞ / 0 in f32; clamping keeps n small (and lets NaN through)
    let x = x.clamp(-104.0, 88.8);
    let shifted = x * std::f32::consts::LOG2_E + SHIFTER;
    let n_float = shifted - SHIFTER;
    let n = (shifted.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let r = (x - n_float * LN2_HI) - n_float * LN2_LO;
    // Estrin's scheme: pairs of terms in parallel, so the dependency chain is short
    let r2 = r * r;
    let r4 = r2 * r2;
    let low = (1.0 + r) + r2 * (0.5 + r * (1.0 / 6.0));
    let high = (1.0 / 24.0 + r * (1.0 / 120.0)) + r2 * (1.0 / 720.0 + r * (1.0 / 5040.0));
    let p = low + r4 * high;
    let half = n >> 1;
    let rest = n.wrapping_sub(half);
    let two_to = |k: i32| f32::from_bits((k.wrapping_add(127) as u32) << 23);
    p * two_to(half) * two_to(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorisable_f32_exp_is_within_two_ulp_everywhere() {
        // every 2⁻¹² step over the range where e^x is a finite non-zero f32, plus the ends
        let mut x = -104.0f32;
        while x < 89.0 {
            let got = exp_f32(x);
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
                let ulp = 2f64.powi(want.log2().floor() as i32 - 23);
                assert!(
                    ((got as f64) - want).abs() <= 2.0 * ulp,
                    "exp({x}) = {got}, want {want}"
                );
            } else if want < f32::MIN_POSITIVE as f64 {
                // denormal results: one denormal step of error
                assert!(
                    ((got as f64) - want).abs() <= 1.5e-45,
                    "exp({x}) = {got}, want {want}"
                );
            } else {
                assert_eq!(got, f32::INFINITY, "exp({x})");
            }
            x += 1.0 / 4096.0;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1000.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-f32::NAN).is_nan());
    }
}
