//! Walking two strided operands together in row-major order (broadcasting kernels).

use smallvec::SmallVec;

/// Calls `f(i, ia, ib)` for every element `i` (row-major) of `shape`, with the storage index of
/// the matching element of two operands laid out by `(strides, offset)`.
pub(crate) fn for_each_index2(
    shape: &[usize],
    (sa, oa): (&[usize], usize),
    (sb, ob): (&[usize], usize),
    mut f: impl FnMut(usize, usize, usize),
) {
    let n: usize = shape.iter().product();
    if n == 0 {
        return;
    }
    let rank = shape.len();
    let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, rank);
    let (mut pa, mut pb) = (oa, ob);
    for i in 0..n {
        f(i, pa, pb);
        for d in (0..rank).rev() {
            idx[d] += 1;
            pa += sa[d];
            pb += sb[d];
            if idx[d] < shape[d] {
                break;
            }
            pa -= sa[d] * shape[d];
            pb -= sb[d] * shape[d];
            idx[d] = 0;
        }
    }
}
