//! How far a GPU result may be from the CPU's, derived from how the two computations round.
//!
//! Both devices run the same IEEE operations for copies, casts, max/argmax and one addition or
//! multiplication of two values: those agree to the last bit and are compared exactly. Three
//! things make results differ, and each bound below names which one it covers:
//!
//! - **Order of addition.** A sum of `len` terms is added in 8 lanes then in order on the CPU,
//!   in a warp-shuffle tree on the GPU (`reduce.cu`). Any order of any tree is within
//!   γ(len − 1)·Σ|x| of the exact sum (Higham, *Accuracy and Stability of Numerical
//!   Algorithms*, §4.2; γ(k) = k·u / (1 − k·u), u = ε/2), so the two are within twice that.
//! - **Math libraries.** exp, log, tanh and pow are CUDA's on the GPU and tandem's polynomial
//!   or the C library's on the CPU; each is within a few ulp of the true value, not equal.
//! - **Cancellation downstream.** A backward formula such as `1 − y²` turns a few ulp of
//!   difference in `y` into a large relative difference where `y²` is close to 1: those bounds
//!   are relative to the magnitudes that go in, not to the result.
//!
//! Pure `std`, so the host harness (`cuda-harness/tests`) includes this file too.

/// The machine epsilon (the gap between 1 and the next number) of a dtype of `bytes` bytes:
/// f32 for 4, f64 for 8.
pub fn epsilon_of_size(bytes: usize) -> f64 {
    match bytes {
        4 => f32::EPSILON as f64,
        8 => f64::EPSILON,
        other => panic!("no float dtype of {other} bytes"),
    }
}

/// How far apart two floating-point sums of the same `len` terms may be when they add in
/// different orders: `2·γ(len − 1)·abs_sum`, `abs_sum` being Σ|x| over the terms and `eps` the
/// dtype's epsilon. 0 for fewer than two terms (a single term is added to 0 exactly).
pub fn sum_order_bound(len: usize, abs_sum: f64, eps: f64) -> f64 {
    if len < 2 {
        return 0.0;
    }
    let k = (len - 1) as f64;
    let u = eps / 2.0;
    assert!(k * u < 0.5, "{len} terms are too many for a rounding bound");
    2.0 * (k * u / (1.0 - k * u)) * abs_sum
}

/// How far `scale · Σx` may be between two devices: the order-of-addition bound scaled, plus
/// one rounding of the product on each side.
pub fn scaled_sum_bound(len: usize, abs_sum: f64, scale: f64, result: f64, eps: f64) -> f64 {
    sum_order_bound(len, abs_sum, eps) * scale.abs() + eps * result.abs()
}

/// sigmoid's backward `(g·y)·(1 − y)` when the saved outputs `y ∈ [0, 1]` of the two sides
/// differ by up to `forward_ulps` ulp. `g·y` then differs by `(F + 1)·ε` relative, `1 − y`
/// by `F·ε·y` absolute (exact for y ≥ ½, one rounding below), and the product rounds once on
/// each side: `ε·|g|·|y|·(F·|y| + (F + 3)·|1 − y|) ≤ (F + 3)·ε·|g|·|y|`. Near saturation
/// (y → 1) the result is tiny while the difference stays `F·ε·|g|`: a bound relative to the
/// result would fail there.
pub fn sigmoid_backward_bound(g: f64, y: f64, forward_ulps: f64, eps: f64) -> f64 {
    (forward_ulps + 3.0) * eps * g.abs() * y.abs()
}

/// tanh's backward `g·(1 − y²)` (y² rounded before the subtraction) when the saved outputs
/// `y ∈ [−1, 1]` differ by up to `forward_ulps` ulp: `y²` then differs by `(2F + 1)·ε·y²`,
/// the subtraction and the product round once on each side, so the results are within
/// `ε·|g|·((2F + 1)·y² + 2·|1 − y²|)`; one more ε of each kind is headroom. Where `y²` is close
/// to 1 this is far more than a few ulp of the (tiny) result.
pub fn tanh_backward_bound(g: f64, y: f64, forward_ulps: f64, eps: f64) -> f64 {
    let y2 = y * y;
    eps * g.abs() * ((2.0 * forward_ulps + 2.0) * y2 + 3.0 * (1.0 - y2).abs())
}

/// Whether `got` is within `bound` of `want`: equal (NaN matching NaN, infinities matching
/// exactly) or finite and at most `bound` apart.
pub fn within(got: f64, want: f64, bound: f64) -> bool {
    if got == want || (got.is_nan() && want.is_nan()) {
        return true;
    }
    got.is_finite() && want.is_finite() && (got - want).abs() <= bound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_vanish_where_the_results_must_be_exact() {
        assert_eq!(sum_order_bound(1, 3.0, f32::EPSILON as f64), 0.0);
        assert_eq!(sum_order_bound(0, 0.0, f32::EPSILON as f64), 0.0);
        let b = sum_order_bound(9, 1.0, f32::EPSILON as f64);
        assert!(
            b > 7.9 * f32::EPSILON as f64 && b < 8.1 * f32::EPSILON as f64,
            "{b}"
        );
        assert!(within(f64::NAN, f64::NAN, 0.0));
        assert!(!within(f64::INFINITY, f64::MAX, 1e300));
    }
}
