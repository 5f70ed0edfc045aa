//! The column matrix of a convolution (im2col) and its adjoint (col2im).
//!
//! Row `(c·kh + ki)·kw + kj` of a sample's column matrix holds, for every output pixel, the
//! input element that kernel tap `(c, ki, kj)` reads there (zero in the padding). Which input
//! runs land where depends only on the geometry, so it is worked out once per call as a table
//! of runs; filling the matrix for each sample is then a tight loop of copies. With unit
//! strides and an output as wide as the input ("same" padding, as in 3×3/pad-1 and 5×5/pad-2
//! layers) a whole row is one shifted copy of the input plane, followed by zeroing the few
//! entries that wrapped around a row edge.
//!
//! Three algorithms are built on the table, one per pass ([`Im2col::forward_sample`],
//! [`Im2col::weight_sample`], [`Im2col::input_sample`]): each tile of columns is filled,
//! multiplied, and (for the input gradient) added back, while it is still in cache.

use tandem_core::FloatElement;

use super::tile_product::TileShape;
use super::ConvElement;
use crate::conv2d::shape::Geometry;
use crate::cpu::gemm::{gemm_into, MatRef};
use crate::cpu::simd::wide_simd_method;

/// For a kernel tap at offset `tap` (= k·dilation), the output positions `[lo, hi)` whose input
/// position `o·stride + tap − pad` falls inside `[0, len)`.
fn valid_span(tap: usize, pad: usize, stride: usize, len: usize, out_len: usize) -> (usize, usize) {
    let lo = if tap >= pad {
        0
    } else {
        (pad - tap).div_ceil(stride)
    };
    let hi = if len + pad > tap {
        (len + pad - tap).div_ceil(stride)
    } else {
        0
    };
    let lo = lo.min(out_len);
    (lo, hi.clamp(lo, out_len))
}

/// The bounds of the tiles of `pixels` output pixels in tiles of `width` (the last one
/// shorter): tile `t` covers pixels `bounds[t]..bounds[t + 1]`; there is at least one tile.
pub(crate) fn tile_bounds(pixels: usize, width: usize) -> Vec<usize> {
    let width = width.clamp(1, pixels.max(1));
    let tiles = pixels.div_ceil(width).max(1);
    (0..=tiles).map(|t| (t * width).min(pixels)).collect()
}

/// `len` entries of row `row` of a tile of the column matrix, starting at pixel `pixel` of the
/// tile; for a copy they come from input offset `src` onward (every `step`-th element).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    row: usize,
    pixel: usize,
    src: usize,
    len: usize,
}

/// The runs of one tile (a range of output pixels): copies, then zero runs applied after them.
#[derive(Default)]
struct Tile {
    copies: Vec<Run>,
    zeros: Vec<Run>,
}

/// The im2col table of one geometry, split into tiles of output pixels so that one tile's
/// column matrix (`C·kh·kw` rows × tile width) stays in the L1/L2 cache between being written
/// and being read by gemm.
pub(crate) struct Im2col {
    /// Tile `t` covers output pixels `bounds[t]..bounds[t + 1]`.
    bounds: Vec<usize>,
    tiles: Vec<Tile>,
    step: usize,
}

impl Im2col {
    /// Works out the runs of `g`, with the output pixels split into tiles of `width` pixels
    /// (the last one shorter).
    pub(crate) fn new(g: &Geometry, width: usize) -> Self {
        let (kh, kw) = g.kernel;
        let (ow, pixels, plane) = (g.out_w, g.out_h * g.out_w, g.in_h * g.in_w);
        let bounds = tile_bounds(pixels, width);
        let shift = g.stride == (1, 1) && g.out_w == g.in_w;
        let mut table = Im2col {
            tiles: (1..bounds.len()).map(|_| Tile::default()).collect(),
            bounds,
            step: if shift { 1 } else { g.stride.1 },
        };
        let rows: Vec<_> = (0..kh)
            .map(|ki| valid_span(ki * g.dilation.0, g.padding.0, g.stride.0, g.in_h, g.out_h))
            .collect();
        let cols: Vec<_> = (0..kw)
            .map(|kj| valid_span(kj * g.dilation.1, g.padding.1, g.stride.1, g.in_w, g.out_w))
            .collect();
        for c in 0..g.in_channels {
            for (ki, &(h_lo, h_hi)) in rows.iter().enumerate() {
                for (kj, &(w_lo, w_hi)) in cols.iter().enumerate() {
                    let row = (c * kh + ki) * kw + kj;
                    if h_lo == h_hi || w_lo == w_hi {
                        table.zero(row, 0, pixels);
                        continue;
                    }
                    // Input offset of output pixel (oh, w_lo) of this tap.
                    let src_at = |oh: usize| {
                        let ih = oh * g.stride.0 + ki * g.dilation.0 - g.padding.0;
                        let iw = w_lo * g.stride.1 + kj * g.dilation.1 - g.padding.1;
                        c * plane + ih * g.in_w + iw
                    };
                    if shift {
                        // One copy from the first to the last valid pixel; the entries in
                        // between that wrapped past a row edge are zeroed afterwards.
                        let (a, b) = (h_lo * ow + w_lo, (h_hi - 1) * ow + w_hi);
                        table.copy(row, a, b, src_at(h_lo));
                    }
                    table.zero(row, 0, h_lo * ow);
                    for oh in h_lo..h_hi {
                        table.zero(row, oh * ow, oh * ow + w_lo);
                        if !shift {
                            table.copy(row, oh * ow + w_lo, oh * ow + w_hi, src_at(oh));
                        }
                        table.zero(row, oh * ow + w_hi, (oh + 1) * ow);
                    }
                    table.zero(row, h_hi * ow, pixels);
                }
            }
        }
        table
    }

    /// Number of tiles.
    pub(crate) fn tile_count(&self) -> usize {
        self.tiles.len()
    }

    /// First output pixel and width of tile `t`.
    pub(crate) fn tile(&self, t: usize) -> (usize, usize) {
        (self.bounds[t], self.bounds[t + 1] - self.bounds[t])
    }

    /// The widest tile.
    pub(crate) fn max_tile_width(&self) -> usize {
        (0..self.tiles.len())
            .map(|t| self.tile(t).1)
            .max()
            .unwrap_or(0)
    }

    /// The tile holding output pixel `pixel`.
    fn tile_of(&self, pixel: usize) -> usize {
        self.bounds.partition_point(|&b| b <= pixel) - 1
    }

    /// Records that pixels `start..end` of `row` copy the input from `src` on, split at tiles.
    fn copy(&mut self, row: usize, mut start: usize, end: usize, mut src: usize) {
        while start < end {
            let t = self.tile_of(start);
            let stop = end.min(self.bounds[t + 1]);
            self.tiles[t].copies.push(Run {
                row,
                pixel: start - self.bounds[t],
                src,
                len: stop - start,
            });
            src += (stop - start) * self.step;
            start = stop;
        }
    }

    /// Records that pixels `start..end` of `row` are zero, split at tiles and merged with the
    /// previous zero run where they touch.
    fn zero(&mut self, row: usize, mut start: usize, end: usize) {
        while start < end {
            let t = self.tile_of(start);
            let stop = end.min(self.bounds[t + 1]);
            let pixel = start - self.bounds[t];
            let zeros = &mut self.tiles[t].zeros;
            match zeros.last_mut() {
                Some(last) if last.row == row && last.pixel + last.len >= pixel => {
                    last.len = last.len.max(stop - self.bounds[t] - last.pixel);
                }
                _ => zeros.push(Run {
                    row,
                    pixel,
                    src: 0,
                    len: stop - start,
                }),
            }
            start = stop;
        }
    }

    wide_simd_method!(
        /// Writes tile `t` of sample `x`'s column matrix (`[C, H, W]` in, `[C·kh·kw, width]` out,
        /// row-major).
        pub(crate) fn fill = Im2col::fill_tile(&self, t: usize, x: &[T], cols: &mut [T])
    );

    #[inline(always)]
    fn fill_tile<T: FloatElement>(&self, t: usize, x: &[T], cols: &mut [T]) {
        let width = self.tile(t).1;
        let tile = &self.tiles[t];
        for r in &tile.copies {
            let dst = &mut cols[r.row * width + r.pixel..][..r.len];
            if self.step == 1 {
                copy_run(dst, &x[r.src..r.src + r.len]);
            } else {
                dst.iter_mut()
                    .zip(x[r.src..].iter().step_by(self.step))
                    .for_each(|(d, &s)| *d = s);
            }
        }
        for r in &tile.zeros {
            zero_run(&mut cols[r.row * width + r.pixel..][..r.len]);
        }
    }

    wide_simd_method!(
        /// The adjoint of [`Im2col::fill`]: adds tile `t` of a column matrix back onto the input
        /// positions it was read from (`gx` is one sample's `[C, H, W]` gradient). Entries that
        /// stand for padding are dropped; `cols` is scratch and gets overwritten there.
        pub(crate) fn add_back = Im2col::add_back_tile(&self, t: usize, cols: &mut [T], gx: &mut [T])
    );

    #[inline(always)]
    fn add_back_tile<T: FloatElement>(&self, t: usize, cols: &mut [T], gx: &mut [T]) {
        let width = self.tile(t).1;
        let tile = &self.tiles[t];
        for r in &tile.zeros {
            zero_run(&mut cols[r.row * width + r.pixel..][..r.len]);
        }
        for r in &tile.copies {
            let src = &cols[r.row * width + r.pixel..][..r.len];
            if self.step == 1 {
                gx[r.src..r.src + r.len]
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, &s)| *d += s);
            } else {
                gx[r.src..]
                    .iter_mut()
                    .step_by(self.step)
                    .zip(src)
                    .for_each(|(d, &s)| *d += s);
            }
        }
    }
}

impl Im2col {
    /// One sample's forward, `out = W · im2col(x) + b` (`xn` `[C, H, W]`, `out` `[O, OH, OW]`,
    /// every element written): tile by tile, the columns filled into `cols` (`C·kh·kw` times
    /// the widest tile) and multiplied by the tile kernel where `kernels` is given (reading the
    /// transposed weights `wt`, `[C·kh·kw, O]`), else by gemm (reading `w`, `[O, C·kh·kw]`;
    /// `parallel_gemm` lets it use the pool).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_sample<T: ConvElement>(
        &self,
        kernels: Option<T::Kernels>,
        g: &Geometry,
        (w, wt): (&[T], &[T]),
        bias: Option<&[T]>,
        xn: &[T],
        cols: &mut [T],
        out: &mut [T],
        parallel_gemm: bool,
    ) {
        let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
        // gemm adds the product onto the bias (the tile kernel stores bias + product).
        if let (Some(b), None) = (bias, kernels) {
            out.chunks_mut(pixels).zip(b).for_each(|(p, &v)| p.fill(v));
        }
        for t in 0..self.tile_count() {
            let (first, width) = self.tile(t);
            self.fill(t, xn, cols);
            match kernels {
                Some(k) => {
                    let shape = TileShape {
                        o_n,
                        depth: patch,
                        width,
                        a_rs: 1,
                        a_cs: o_n,
                        b_rs: width,
                        out_stride: pixels,
                        accumulate: false,
                    };
                    T::tile_product(k, shape, wt, cols, bias, &mut out[first..]);
                }
                None => gemm_into(
                    (o_n, width, patch),
                    out,
                    MatRef {
                        offset: first,
                        rs: pixels,
                        cs: 1,
                    },
                    w,
                    MatRef::row_major(0, patch),
                    cols,
                    MatRef::row_major(0, width),
                    bias.is_some(),
                    parallel_gemm,
                ),
            }
        }
    }

    /// Adds one sample's weight gradient, transposed (`[C·kh·kw, O]`), onto `gw_t`: tile by
    /// tile, the columns of `xn` filled into `cols` and multiplied with the output gradient
    /// `gn` (`[O, OH, OW]`) by gemm.
    pub(crate) fn weight_sample<T: ConvElement>(
        &self,
        g: &Geometry,
        xn: &[T],
        gn: &[T],
        cols: &mut [T],
        gw_t: &mut [T],
        parallel_gemm: bool,
    ) {
        let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
        for t in 0..self.tile_count() {
            let (first, width) = self.tile(t);
            // Accumulated transposed ([C·kh·kw, O]): gemm then streams the column matrix
            // along its rows, much faster for these thin products.
            self.fill(t, xn, cols);
            gemm_into(
                (o_n, patch, width),
                gw_t,
                MatRef::row_major(0, o_n).t(),
                gn,
                MatRef {
                    offset: first,
                    rs: pixels,
                    cs: 1,
                },
                cols,
                MatRef::row_major(0, width).t(),
                true,
                parallel_gemm,
            );
        }
    }

    /// Adds one sample's input gradient onto `gx` (`[C, H, W]`): tile by tile, `Wᵀ·g` of the
    /// output gradient `gn` into `cols` — by the tile kernel where `kernels` is given, else by
    /// gemm — then added back to the input positions it was read from (col2im).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn input_sample<T: ConvElement>(
        &self,
        kernels: Option<T::Kernels>,
        g: &Geometry,
        w: &[T],
        gn: &[T],
        cols: &mut [T],
        gx: &mut [T],
        parallel_gemm: bool,
    ) {
        let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
        for t in 0..self.tile_count() {
            let (first, width) = self.tile(t);
            // `[C·kh·kw, width]`. Rows of Wᵀ are columns of W: unit row step, `C·kh·kw`
            // between terms.
            match kernels {
                Some(k) => {
                    let shape = TileShape {
                        o_n: patch,
                        depth: o_n,
                        width,
                        a_rs: 1,
                        a_cs: patch,
                        b_rs: pixels,
                        out_stride: width,
                        accumulate: false,
                    };
                    T::tile_product(k, shape, w, &gn[first..], None, cols);
                }
                None => gemm_into(
                    (patch, width, o_n),
                    cols,
                    MatRef::row_major(0, width),
                    w,
                    MatRef::row_major(0, patch).t(),
                    gn,
                    MatRef {
                        offset: first,
                        rs: pixels,
                        cs: 1,
                    },
                    false,
                    parallel_gemm,
                ),
            }
            self.add_back(t, cols, gx);
        }
    }
}

/// Runs at most this long are copied or zeroed inline; longer ones go to `memcpy`/`memset`.
const SHORT_RUN: usize = 64;

/// Copies `src` into `dst` (same length). Most runs are 1–60 elements (one output row of one
/// kernel tap, a padding border, one pixel's kernel row); constant-size pieces keep those clear of the C library's
/// call overhead.
#[inline(always)]
pub(crate) fn copy_run<T: Copy>(dst: &mut [T], src: &[T]) {
    let len = dst.len();
    let (mut d, mut s) = (dst, &src[..len]);
    while d.len() >= 16 {
        d[..16].copy_from_slice(&s[..16]);
        (d, s) = (&mut d[16..], &s[16..]);
    }
    if d.len() >= 8 {
        d[..8].copy_from_slice(&s[..8]);
        (d, s) = (&mut d[8..], &s[8..]);
    }
    if d.len() >= 4 {
        d[..4].copy_from_slice(&s[..4]);
        (d, s) = (&mut d[4..], &s[4..]);
    }
    if d.len() >= 2 {
        d[..2].copy_from_slice(&s[..2]);
        (d, s) = (&mut d[2..], &s[2..]);
    }
    if let (Some(x), Some(&y)) = (d.first_mut(), s.first()) {
        *x = y;
    }
}

/// Sets `dst` to zero; like [`copy_run`], short runs are written inline.
#[inline(always)]
fn zero_run<T: FloatElement>(dst: &mut [T]) {
    if dst.len() > SHORT_RUN {
        dst.fill(T::ZERO);
        return;
    }
    let mut d = dst;
    while d.len() >= 8 {
        d[..8].fill(T::ZERO);
        d = &mut d[8..];
    }
    if d.len() >= 4 {
        d[..4].fill(T::ZERO);
        d = &mut d[4..];
    }
    if d.len() >= 2 {
        d[..2].fill(T::ZERO);
        d = &mut d[2..];
    }
    if let Some(v) = d.first_mut() {
        *v = T::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_spans_cover_exactly_the_in_bounds_outputs() {
        for (tap, pad, stride, len) in [(0, 2, 1, 5), (4, 2, 1, 5), (2, 1, 2, 7), (6, 0, 3, 6)] {
            let out_len = (len + 2 * pad) / stride + 1;
            let (lo, hi) = valid_span(tap, pad, stride, len, out_len);
            for o in 0..out_len {
                let pos = (o * stride + tap) as isize - pad as isize;
                let inside = pos >= 0 && pos < len as isize;
                assert_eq!(inside, o >= lo && o < hi, "tap {tap} pad {pad} o {o}");
            }
        }
    }

    #[test]
    fn short_runs_copy_and_zero_every_length() {
        for len in 0..40usize {
            let src: Vec<f64> = (0..len).map(|i| i as f64 + 1.0).collect();
            let mut dst = vec![-1.0; len];
            copy_run(&mut dst, &src);
            assert_eq!(dst, src);
            zero_run(&mut dst);
            assert!(dst.iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn zero_runs_merge_within_a_tile_and_split_across_tiles() {
        let g = Geometry {
            batch: 1,
            in_channels: 1,
            in_h: 4,
            in_w: 4,
            out_channels: 1,
            kernel: (1, 1),
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            out_h: 4,
            out_w: 4,
        };
        let mut table = Im2col::new(&g, 8);
        table.tiles.iter_mut().for_each(|t| *t = Tile::default());
        table.zero(0, 0, 3);
        table.zero(0, 3, 5);
        table.zero(0, 6, 7);
        table.zero(1, 7, 12);
        let spans = |t: usize| -> Vec<_> {
            table.tiles[t]
                .zeros
                .iter()
                .map(|r| (r.row, r.pixel, r.len))
                .collect()
        };
        assert_eq!(spans(0), vec![(0, 0, 5), (0, 6, 1), (1, 7, 1)]);
        assert_eq!(spans(1), vec![(1, 0, 4)]);
        table.copy(2, 6, 10, 100);
        let copies: Vec<_> = table
            .tiles
            .iter()
            .flat_map(|t| t.copies.iter().map(|r| (r.pixel, r.src, r.len)))
            .collect();
        assert_eq!(copies, vec![(6, 100, 2), (0, 102, 2)]);
    }
}
