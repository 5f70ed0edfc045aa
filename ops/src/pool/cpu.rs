//! CPU kernels of the 2-D pools. Every pool is described by its windows: for each output row
//! and column, the (already clipped) range of input rows and columns it covers. Planes (one per
//! sample and channel) are independent and run in parallel when the input is large (and the
//! rayon pool has more than one thread). Max pooling over 2×2 windows with stride 2 and no
//! padding goes to the branch-free kernels of [`super::max2x2`].

use rayon::prelude::*;
use tandem_core::{alloc, FloatElement};

use super::max2x2;
use crate::util::parallel;

/// The input ranges that each output row and column of a pool covers, clipped to the input.
#[derive(Clone, Debug)]
pub(crate) struct Windows {
    /// Input rows `[start, end)` of each output row.
    pub rows: Vec<(usize, usize)>,
    /// Input columns `[start, end)` of each output column.
    pub cols: Vec<(usize, usize)>,
    /// What an average divides by: `Some(k)` for a fixed count (padding included), `None` for
    /// the number of elements in the window.
    pub divisor: Option<usize>,
}

impl Windows {
    fn out_pixels(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// Whether these are the windows of `MaxPool2d(2)`: 2×2, stride 2, no padding.
    fn is_two_by_two(&self) -> bool {
        let tiles = |ranges: &[(usize, usize)]| {
            ranges
                .iter()
                .enumerate()
                .all(|(i, &(a, b))| a == 2 * i && b == 2 * i + 2)
        };
        tiles(&self.rows) && tiles(&self.cols)
    }

    fn divisor_of(&self, rows: (usize, usize), cols: (usize, usize)) -> usize {
        self.divisor
            .unwrap_or((rows.1 - rows.0) * (cols.1 - cols.0))
    }
}

/// Runs `f(plane_index, out_plane)` over chunks of `out_per` elements, in parallel when
/// `work` (elements touched) is large.
fn for_each_plane<T: Send>(
    out: &mut [T],
    out_per: usize,
    work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if out_per == 0 {
        return;
    }
    if parallel(work) {
        out.par_chunks_mut(out_per)
            .enumerate()
            .for_each(|(p, o)| f(p, o));
    } else {
        out.chunks_mut(out_per)
            .enumerate()
            .for_each(|(p, o)| f(p, o));
    }
}

/// Max over each window of each `[h, w]` plane of `x`. Returns the maxima and, when
/// `keep_indices`, the index within its plane of the first maximal element of each window
/// (NaN counts as maximal, as in PyTorch).
pub(crate) fn max_forward<T: FloatElement>(
    x: &[T],
    (h, w): (usize, usize),
    win: &Windows,
    keep_indices: bool,
) -> (Vec<T>, Vec<u32>) {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = x.len().checked_div(in_per).unwrap_or(0);
    // Both paths write every value (the cache holds only tensor element types, so the
    // indices come from the system).
    let mut values = alloc::uninit::<T>(planes * out_per);
    let mut indices = vec![0u32; if keep_indices { planes * out_per } else { 0 }];
    if out_per == 0 {
        return (values, indices);
    }
    if win.is_two_by_two() {
        let (vals, idx) = (&mut values[..], &mut indices[..]);
        if parallel(x.len()) {
            // Tasks of whole planes, a few per thread.
            let per_task = planes.div_ceil(rayon::current_num_threads() * 4);
            let idx_per_task = if keep_indices { per_task * out_per } else { 0 };
            let idx_chunks: Vec<&mut [u32]> = if keep_indices {
                idx.chunks_mut(idx_per_task).collect()
            } else {
                (0..planes.div_ceil(per_task))
                    .map(|_| &mut [][..])
                    .collect()
            };
            vals.par_chunks_mut(per_task * out_per)
                .zip(x.par_chunks(per_task * in_per))
                .zip(idx_chunks)
                .for_each(|((v, xs), i)| max2x2::forward(xs, (h, w), v, i));
        } else {
            max2x2::forward(x, (h, w), vals, idx);
        }
        return (values, indices);
    }
    let plane_max = |p: usize, vals: &mut [T], mut idx: Option<&mut [u32]>| {
        let plane = &x[p * in_per..(p + 1) * in_per];
        let mut k = 0;
        for &(r0, r1) in &win.rows {
            for &(c0, c1) in &win.cols {
                let (best, at) = window_max(plane, w, (r0, r1), (c0, c1));
                vals[k] = best;
                if let Some(idx) = idx.as_deref_mut() {
                    idx[k] = at as u32;
                }
                k += 1;
            }
        }
    };
    match (keep_indices, parallel(x.len())) {
        (true, true) => values
            .par_chunks_mut(out_per)
            .zip(indices.par_chunks_mut(out_per))
            .enumerate()
            .for_each(|(p, (v, i))| plane_max(p, v, Some(i))),
        (true, false) => values
            .chunks_mut(out_per)
            .zip(indices.chunks_mut(out_per))
            .enumerate()
            .for_each(|(p, (v, i))| plane_max(p, v, Some(i))),
        (false, _) => for_each_plane(&mut values, out_per, x.len(), |p, v| plane_max(p, v, None)),
    }
    (values, indices)
}

/// The first maximal element of one window of a `w`-wide plane and its index in the plane
/// (a NaN wins and ends the search, as in PyTorch).
#[inline(always)]
fn window_max<T: FloatElement>(
    plane: &[T],
    w: usize,
    (r0, r1): (usize, usize),
    (c0, c1): (usize, usize),
) -> (T, usize) {
    let (mut best, mut at) = (T::neg_infinity(), r0 * w + c0);
    for r in r0..r1 {
        let row = &plane[r * w..(r + 1) * w];
        for (c, &v) in row.iter().enumerate().take(c1).skip(c0) {
            // A NaN wins for good, as in PyTorch.
            if v > best || v.is_nan() {
                (best, at) = (v, r * w + c);
                if v.is_nan() {
                    return (best, at);
                }
            }
        }
    }
    (best, at)
}

/// Routes each output gradient to the input element its window's maximum came from.
pub(crate) fn max_backward<T: FloatElement>(
    g: &[T],
    indices: &[u32],
    (h, w): (usize, usize),
    win: &Windows,
) -> Vec<T> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = alloc::zeroed::<T>(planes * in_per);
    for_each_plane(&mut gx, in_per, g.len(), |p, plane| {
        let range = p * out_per..(p + 1) * out_per;
        for (&gv, &i) in g[range.clone()].iter().zip(&indices[range]) {
            plane[i as usize] += gv;
        }
    });
    gx
}

/// Mean over each window of each `[h, w]` plane of `x` (divided by `win.divisor`).
pub(crate) fn avg_forward<T: FloatElement>(
    x: &[T],
    (h, w): (usize, usize),
    win: &Windows,
) -> Vec<T> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = x.len().checked_div(in_per).unwrap_or(0);
    // Every element is written.
    let mut out = alloc::uninit::<T>(planes * out_per);
    for_each_plane(&mut out, out_per, x.len(), |p, o| {
        let plane = &x[p * in_per..(p + 1) * in_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let mut acc = T::ZERO;
                for r in rows.0..rows.1 {
                    acc = plane[r * w + cols.0..r * w + cols.1]
                        .iter()
                        .fold(acc, |a, &v| a + v);
                }
                o[k] = acc / T::from_f64(win.divisor_of(rows, cols) as f64);
                k += 1;
            }
        }
    });
    out
}

/// Spreads each output gradient evenly (by the same divisor) over its window.
pub(crate) fn avg_backward<T: FloatElement>(
    g: &[T],
    (h, w): (usize, usize),
    win: &Windows,
) -> Vec<T> {
    let (in_per, out_per) = (h * w, win.out_pixels());
    let planes = g.len().checked_div(out_per).unwrap_or(0);
    let mut gx = alloc::zeroed::<T>(planes * in_per);
    for_each_plane(&mut gx, in_per, g.len() + planes * in_per, |p, plane| {
        let gp = &g[p * out_per..(p + 1) * out_per];
        let mut k = 0;
        for &rows in &win.rows {
            for &cols in &win.cols {
                let share = gp[k] / T::from_f64(win.divisor_of(rows, cols) as f64);
                for r in rows.0..rows.1 {
                    plane[r * w + cols.0..r * w + cols.1]
                        .iter_mut()
                        .for_each(|v| *v += share);
                }
                k += 1;
            }
        }
    });
    gx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_keeps_the_first_maximum_and_propagates_nan() {
        let win = Windows {
            rows: vec![(0, 2)],
            cols: vec![(0, 2)],
            divisor: None,
        };
        let (v, i) = max_forward(&[1.0f64, 3.0, 3.0, 0.0], (2, 2), &win, true);
        assert_eq!((v, i), (vec![3.0], vec![1]));
        let (v, i) = max_forward(&[1.0f64, f64::NAN, 3.0, 0.0], (2, 2), &win, true);
        assert!(v[0].is_nan());
        assert_eq!(i, vec![1]);
    }
}
