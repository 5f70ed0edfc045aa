//! Reductions of a slice in 8 independent lanes (sum, maximum, sum of exponentials): they
//! vectorise, and round less than one running sum. Softmax and the losses use them.

use tandem_core::FloatElement;

use super::exp::ExpFloat;

/// Sum of a slice in 8 independent lanes (vectorises; rounds less than one running sum).
pub(crate) fn lanes_sum<T: FloatElement>(v: &[T]) -> T {
    let mut lanes = [T::ZERO; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    lanes.iter().fold(T::ZERO, |a, &b| a + b) + rest.iter().fold(T::ZERO, |a, &b| a + b)
}

/// `Σ e^(v − shift)` over a slice, in 8 lanes so that the exponentials vectorise.
pub(crate) fn lanes_sum_exp<T: ExpFloat>(v: &[T], shift: T) -> T {
    let mut lanes = [T::ZERO; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] += (c[i] - shift).exp_fast();
        }
    }
    let tail = rest
        .iter()
        .fold(T::ZERO, |a, &b| a + (b - shift).exp_fast());
    lanes.iter().fold(T::ZERO, |a, &b| a + b) + tail
}

/// Maximum of a non-empty slice in 8 lanes (NaNs are skipped; they poison the sum later).
pub(crate) fn lanes_max<T: FloatElement>(v: &[T]) -> T {
    let pick = |a: T, b: T| if b > a { b } else { a };
    let mut lanes = [T::neg_infinity(); 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lanes[i] = pick(lanes[i], c[i]);
        }
    }
    rest.iter().fold(
        lanes.iter().fold(T::neg_infinity(), |a, &b| pick(a, b)),
        |a, &b| pick(a, b),
    )
}
