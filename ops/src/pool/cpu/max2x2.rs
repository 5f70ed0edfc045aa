//! The branch-free kernels of the max pool that matters most: 2×2 windows, stride 2, no
//! padding (`MaxPool2d(2)`, as in LeNet-5 and VGG).
//!
//! The windows tile the plane, so output `(i, j)` reads input rows `2i, 2i+1` and columns
//! `2j, 2j+1`. The maximum is a small tree of selects: each row's pair first, then the two pair
//! winners. With "take the later one when it is larger, or when it is a NaN and the earlier one
//! is not", the tree picks the same element as a left-to-right scan in row-major window order
//! (the first NaN if there is one, else the first maximum), and it compiles to compares and
//! blends instead of the unpredictable branches of a scan over ReLU outputs. (The backward is
//! the general scatter by index into a zeroed buffer: with output rows of 14 or 5 windows, a
//! select-per-element rewrite measured slower.)

use tandem_core::FloatElement;

use crate::cpu::simd::wide_simd_fn;

/// Whether `later` replaces `earlier` as the running maximum: it is larger, or it is a NaN
/// and `earlier` is not (a NaN wins for good).
#[inline(always)]
fn replaces<T: FloatElement>(earlier: T, later: T) -> bool {
    // `v == v` / `v != v` are the NaN tests, written as compares so that they vectorise
    #[allow(clippy::eq_op)]
    let (earlier_is_number, later_is_nan) = (earlier == earlier, later != later);
    (later > earlier || later_is_nan) && earlier_is_number
}

/// The winner of a pair and the winner's offset (0 for `a`, `step` for `b`).
#[inline(always)]
fn pair<T: FloatElement>(a: T, b: T, step: u32) -> (T, u32) {
    if replaces(a, b) {
        (b, step)
    } else {
        (a, 0)
    }
}

/// Max pooling of whole `[h, w]` planes of `x` into `values` (and, when `indices` is not
/// empty, the index within its plane of each maximum).
#[inline(always)]
fn forward_planes<T: FloatElement>(
    x: &[T],
    (h, w): (usize, usize),
    values: &mut [T],
    indices: &mut [u32],
) {
    let (oh, ow) = (h / 2, w / 2);
    let (in_per, out_per) = (h * w, oh * ow);
    if out_per == 0 {
        return;
    }
    for (p, vals) in values.chunks_exact_mut(out_per).enumerate() {
        let plane = &x[p * in_per..(p + 1) * in_per];
        for (i, vrow) in vals.chunks_exact_mut(ow).enumerate() {
            let top = &plane[2 * i * w..][..2 * ow];
            let bottom = &plane[(2 * i + 1) * w..][..2 * ow];
            if indices.is_empty() {
                for ((v, t), b) in vrow
                    .iter_mut()
                    .zip(top.chunks_exact(2))
                    .zip(bottom.chunks_exact(2))
                {
                    let (upper, _) = pair(t[0], t[1], 1);
                    let (lower, _) = pair(b[0], b[1], 1);
                    *v = pair(upper, lower, 1).0;
                }
            } else {
                let irow = &mut indices[p * out_per + i * ow..][..ow];
                let row_start = (2 * i * w) as u32;
                let mut column = row_start;
                for (((v, at), t), b) in vrow
                    .iter_mut()
                    .zip(irow.iter_mut())
                    .zip(top.chunks_exact(2))
                    .zip(bottom.chunks_exact(2))
                {
                    let (upper, du) = pair(t[0], t[1], 1);
                    let (lower, dl) = pair(b[0], b[1], 1);
                    let (best, down) = pair(upper, lower, w as u32);
                    *v = best;
                    *at = column + down + if down == 0 { du } else { dl };
                    column += 2;
                }
            }
        }
    }
}

wide_simd_fn!(
    /// 2×2/stride-2 max pooling of whole planes: `x` holds `values.len() / (h/2 · w/2)`
    /// planes of `[h, w]`; `indices` is empty (no indices kept) or as long as `values`.
    pub(crate) fn forward[T: FloatElement](
        x: &[T],
        hw: (usize, usize),
        values: &mut [T],
        indices: &mut [u32]
    ) = forward_planes
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Left-to-right scan of one window in row-major order: the first NaN, else the first
    /// maximum.
    fn scan(window: [(f64, u32); 4]) -> (f64, u32) {
        let mut best = window[0];
        for &(v, at) in &window[1..] {
            if best.0.is_nan() {
                break;
            }
            if v.is_nan() || v > best.0 {
                best = (v, at);
            }
        }
        best
    }

    #[test]
    fn select_tree_picks_what_a_scan_picks_for_ties_and_nans() {
        let choices = [0.0, 1.0, f64::NAN, -1.0];
        // every window over the four choices, on a 3×5 plane (odd sizes leave a border)
        for code in 0..256u32 {
            let v: Vec<f64> = (0..4)
                .map(|k| choices[(code >> (2 * k)) as usize & 3])
                .collect();
            let mut x = vec![-7.0f64; 15];
            let (r, c) = (0usize, 2usize);
            x[r * 5 + c] = v[0];
            x[r * 5 + c + 1] = v[1];
            x[(r + 1) * 5 + c] = v[2];
            x[(r + 1) * 5 + c + 1] = v[3];
            let (mut vals, mut idx) = (vec![0.0; 2], vec![0u32; 2]);
            forward(&x, (3, 5), &mut vals, &mut idx);
            let want = scan([(v[0], 2), (v[1], 3), (v[2], 7), (v[3], 8)]);
            assert_eq!(idx[1], want.1, "window {v:?}");
            assert!(vals[1] == want.0 || (vals[1].is_nan() && want.0.is_nan()));
            let mut plain = vec![0.0; 2];
            forward(&x, (3, 5), &mut plain, &mut []);
            assert!(plain[1] == want.0 || (plain[1].is_nan() && want.0.is_nan()));
        }
    }
}
