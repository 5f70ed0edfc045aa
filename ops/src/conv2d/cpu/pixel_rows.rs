//! The column matrix transposed — one row per output pixel — built for the weight gradient.
//!
//! `grad_W = g · colsᵀ` is a product whose depth is the number of pixels. gemm runs it several
//! times faster when the column operand is laid out pixel-major (its rows are then read
//! straight into the kernels instead of being repacked), so the backward builds that layout
//! directly. Entries are ordered `(ki, kj, c)` within a row: from a zero-padded channels-last
//! copy of the sample, each kernel row `ki` of a pixel is then one contiguous run of `kw·C`
//! elements (`C` when the width is dilated). With unit strides those runs of consecutive
//! pixels overlap in the padded copy, `C` apart, so the f32 kernel reads them there and nothing
//! is copied out ([`PixelRows::spread`]). The caller maps the resulting gradient back to the
//! `[O, C, kh, kw]` order ([`PixelRows::to_weight_order`]).
//!
//! Two weight-gradient algorithms are built on it: [`PixelRows::weight_sample_in_place`]
//! (unit strides, dense kernel rows, the AVX-512 tile kernel) and
//! [`PixelRows::weight_sample`] (any geometry: rows copied out tile by tile).

use tandem_core::{FloatElement, Result};

use super::im2col::copy_run;
use super::tile_product::TileShape;
use super::ConvElement;
use crate::conv2d::shape::Geometry;
use crate::cpu::gemm::{gemm_into, MatRef};
use crate::cpu::simd::wide_simd_method;

/// Builder of pixel-major column matrices for one geometry.
pub(crate) struct PixelRows {
    g: Geometry,
    /// Padded height and width.
    hp: usize,
    wp: usize,
}

impl PixelRows {
    /// Whether this layout pays off: the runs it copies (`kw·C` elements) must be long enough.
    pub(crate) fn suits(g: &Geometry) -> bool {
        let run = if g.dilation.1 == 1 {
            g.kernel.1 * g.in_channels
        } else {
            g.in_channels
        };
        run >= 16
    }

    pub(crate) fn new(g: &Geometry) -> Self {
        PixelRows {
            g: *g,
            hp: g.in_h + 2 * g.padding.0,
            wp: g.in_w + 2 * g.padding.1,
        }
    }

    /// Elements of one sample's padded channels-last copy.
    pub(crate) fn padded_len(&self) -> usize {
        self.hp * self.wp * self.g.in_channels
    }

    wide_simd_method!(
        /// Writes sample `x` (`[C, H, W]`) as `[H + 2·ph, W + 2·pw, C]` with zero borders.
        pub(crate) fn pad_channels_last = PixelRows::pad_sample(&self, x: &[T], xh: &mut [T])
    );

    #[inline(always)]
    fn pad_sample<T: FloatElement>(&self, x: &[T], xh: &mut [T]) {
        let g = &self.g;
        let c_n = g.in_channels;
        let xh = &mut xh[..self.padded_len()];
        xh.fill(T::ZERO);
        for ih in 0..g.in_h {
            let dst_row =
                &mut xh[((ih + g.padding.0) * self.wp + g.padding.1) * c_n..][..g.in_w * c_n];
            for c in 0..c_n {
                let src = &x[(c * g.in_h + ih) * g.in_w..][..g.in_w];
                dst_row[c..]
                    .iter_mut()
                    .step_by(c_n)
                    .zip(src)
                    .for_each(|(d, &s)| *d = s);
            }
        }
    }

    wide_simd_method!(
        /// Writes the rows of output pixels `first..first + count` of a sample's pixel-major
        /// column matrix (`C·kh·kw` entries a row, ordered `(ki, kj, c)`) into `rows`, from its
        /// padded channels-last copy `xh`.
        pub(crate) fn fill = PixelRows::fill_rows(
            &self, xh: &[T], rows: &mut [T], first: usize, count: usize
        )
    );

    #[inline(always)]
    fn fill_rows<T: FloatElement>(&self, xh: &[T], rows: &mut [T], first: usize, count: usize) {
        let g = &self.g;
        let (kh, kw, c_n) = (g.kernel.0, g.kernel.1, g.in_channels);
        let patch = c_n * kh * kw;
        for (i, dst) in rows[..count * patch]
            .chunks_exact_mut(patch.max(1))
            .enumerate()
        {
            let (oh, ow) = ((first + i) / g.out_w, (first + i) % g.out_w);
            for ki in 0..kh {
                let ih = oh * g.stride.0 + ki * g.dilation.0;
                let at = (ih * self.wp + ow * g.stride.1) * c_n;
                let dst = &mut dst[ki * kw * c_n..(ki + 1) * kw * c_n];
                if g.dilation.1 == 1 {
                    copy_run(dst, &xh[at..at + kw * c_n]);
                } else {
                    for kj in 0..kw {
                        let from = at + kj * g.dilation.1 * c_n;
                        copy_run(&mut dst[kj * c_n..(kj + 1) * c_n], &xh[from..from + c_n]);
                    }
                }
            }
        }
    }

    /// Whether the weight gradient can read the padded channels-last sample in place
    /// ([`PixelRows::spread`]): unit strides and a dense kernel row.
    pub(crate) fn in_place(&self) -> bool {
        self.g.stride == (1, 1) && self.g.dilation.1 == 1
    }

    /// Output pixels over the padded width, `q = oh·Wp + ow`, up to the last one.
    pub(crate) fn columns(&self) -> usize {
        (self.g.out_h - 1) * self.wp + self.g.out_w
    }

    /// Elements of the spread output gradient of [`PixelRows::spread`].
    pub(crate) fn spread_len(&self) -> usize {
        self.g.out_channels * self.columns()
    }

    /// Offset in the padded channels-last sample of the first pixel row of kernel row `ki`.
    pub(crate) fn kernel_row(&self, ki: usize) -> usize {
        ki * self.g.dilation.0 * self.wp * self.g.in_channels
    }

    wide_simd_method!(
        /// Writes the output gradient `gy` (`[O, OH, OW]`) as `[O, q]` over the padded width
        /// (zero in the columns past each output row). With unit strides, pixel `q`'s row of
        /// the pixel-major column matrix is then, for each kernel row `ki`, the `kw·C` padded
        /// channels-last elements from `(q + ki·dh·Wp)·C` on: the rows of consecutive pixels
        /// overlap in place, so the weight gradient reads them there, `C` apart, instead of
        /// copying them out.
        pub(crate) fn spread = PixelRows::spread_gradient(&self, gy: &[T], spread: &mut [T])
    );

    #[inline(always)]
    fn spread_gradient<T: FloatElement>(&self, gy: &[T], spread: &mut [T]) {
        let g = &self.g;
        let (ow, pixels, columns) = (g.out_w, g.out_h * g.out_w, self.columns());
        for (o, dst) in spread[..self.spread_len()]
            .chunks_exact_mut(columns)
            .enumerate()
        {
            let src = &gy[o * pixels..][..pixels];
            for (oh, row) in src.chunks_exact(ow).enumerate() {
                let at = oh * self.wp;
                copy_run(&mut dst[at..at + ow], row);
                if oh + 1 < g.out_h {
                    dst[at + ow..at + self.wp].fill(T::ZERO);
                }
            }
        }
    }

    /// Adds one sample's weight gradient, `[O, (ki, kj, c)]`, onto `gw` with the column rows
    /// read in place from the padded channels-last sample (see [`PixelRows::spread`]): one
    /// tile product per kernel row. `xn` is the sample (`[C, H, W]`), `gn` its output gradient
    /// (`[O, OH, OW]`); `padded` and `spread` are scratch of [`PixelRows::padded_len`] and
    /// [`PixelRows::spread_len`] elements. Needs [`PixelRows::in_place`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn weight_sample_in_place<T: ConvElement>(
        &self,
        k: T::Kernels,
        xn: &[T],
        gn: &[T],
        padded: &mut [T],
        spread: &mut [T],
        gw: &mut [T],
    ) {
        let g = &self.g;
        self.pad_channels_last(xn, padded);
        self.spread(gn, spread);
        let (kh, kw, c_n) = (g.kernel.0, g.kernel.1, g.in_channels);
        let columns = self.columns();
        let shape = TileShape {
            o_n: g.out_channels,
            depth: columns,
            width: kw * c_n,
            a_rs: columns,
            a_cs: 1,
            b_rs: c_n,
            out_stride: g.patch(),
            accumulate: true,
        };
        // The last kernel row reads furthest: it is taken first.
        for ki in (0..kh).rev() {
            let b = &padded[self.kernel_row(ki)..];
            T::tile_product(k, shape, spread, b, None, &mut gw[ki * kw * c_n..]);
        }
    }

    /// Adds one sample's weight gradient, `[O, (ki, kj, c)]`, onto `gw`, the pixel-major column
    /// rows copied out tile by tile (tiles of output pixels `bounds[t]..bounds[t + 1]`) into
    /// `cols` and multiplied by the tile kernel where `kernels` is given, else by gemm
    /// (`parallel_gemm` lets it use the pool). `padded` is scratch of
    /// [`PixelRows::padded_len`] elements, `cols` of `C·kh·kw` times the widest tile.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn weight_sample<T: ConvElement>(
        &self,
        kernels: Option<T::Kernels>,
        xn: &[T],
        gn: &[T],
        bounds: &[usize],
        padded: &mut [T],
        cols: &mut [T],
        gw: &mut [T],
        parallel_gemm: bool,
    ) {
        let g = &self.g;
        let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
        self.pad_channels_last(xn, padded);
        for tile in bounds.windows(2) {
            let (first, width) = (tile[0], tile[1] - tile[0]);
            // grad_W [O, (ki, kj, c)] += g · rows, rows [width, C·kh·kw].
            self.fill(padded, cols, first, width);
            match kernels {
                Some(k) => {
                    let shape = TileShape {
                        o_n,
                        depth: width,
                        width: patch,
                        a_rs: pixels,
                        a_cs: 1,
                        b_rs: patch,
                        out_stride: patch,
                        accumulate: true,
                    };
                    T::tile_product(k, shape, &gn[first..], cols, None, gw);
                }
                None => gemm_into(
                    (o_n, patch, width),
                    gw,
                    MatRef::row_major(0, patch),
                    gn,
                    // This tile of g: [O, width] inside the sample's [O, OH·OW].
                    MatRef {
                        offset: first,
                        rs: pixels,
                        cs: 1,
                    },
                    cols,
                    MatRef::row_major(0, patch),
                    true,
                    parallel_gemm,
                ),
            }
        }
    }

    /// Moves a weight gradient from `[O, (ki, kj, c)]` order to `[O, C, kh, kw]`.
    pub(crate) fn to_weight_order<T: FloatElement>(&self, gw: &[T]) -> Result<Vec<T>> {
        let g = &self.g;
        let (kh, kw, c_n) = (g.kernel.0, g.kernel.1, g.in_channels);
        let patch = c_n * kh * kw;
        // Every element is written below.
        let mut out = crate::cpu::memory::uninit(super::OP, gw.len())?;
        for (o, row) in gw.chunks(patch.max(1)).enumerate() {
            for ki in 0..kh {
                for kj in 0..kw {
                    for c in 0..c_n {
                        out[o * patch + (c * kh + ki) * kw + kj] = row[(ki * kw + kj) * c_n + c];
                    }
                }
            }
        }
        Ok(out)
    }
}
