//! The forward and the weight gradient of a convolution as implicit gemms: no column matrix
//! is built.
//!
//! Pad a sample once into `[C, H + 2·ph, W + 2·pw]` and number the output pixels over the
//! padded width, `q = oh·Wp + ow`. With unit strides the column-matrix entry of kernel tap
//! `(c, ki, kj)` at pixel `q` is then `padded[c·Hp·Wp + ki·dh·Wp + kj·dw + q]`: every row of
//! the column matrix is a contiguous run of the padded sample starting at one offset per tap.
//! Strides other than 1 are brought back to that case by storing each padded channel as its
//! `sh·sw` phase planes (rows `≡ a mod sh`, columns `≡ b mod sw`), in which a tap reads a
//! unit-stride window. With unit strides neighbouring rows share their pad columns where the
//! output rows still fit (`Wp = W + pw`, see [`shares_pad_columns`]), which takes `pw` wasted
//! columns off every output row. The register-blocked kernel (`tile_product.rs`) reads
//! those rows in place from a table of the offsets, so the only data movement left is the
//! padding copy (the size of the input, where im2col writes `kh·kw` times that) and dropping
//! the columns past each output row, which are computed along with the others and discarded
//! when the tile is copied into the output. The weight gradient reads the same rows as its left operand
//! against the output gradient spread into `[q, O]` order.

use tandem_core::FloatElement;

use super::im2col::copy_run;
use super::tile_product::{self, Avx512, TileShape};
use crate::conv2d::shape::Geometry;
use crate::cpu::simd::wide_simd_method;

/// Tiles are at most this many output columns wide (whole output rows, over the padded
/// width, unless one row is wider): the tile's output block `[O, width]` then stays in L1/L2
/// until it is compacted.
const TILE_COLUMNS: usize = 544;

/// Output rows per tile for an output of `out_h` rows of `out_w` pixels stored `wp` apart:
/// among near-equal tilings with tiles of at most [`TILE_COLUMNS`] columns, the one with the
/// fewest 16-lane vectors in all (the kernel computes whole vectors, so a tile whose width
/// just passes a multiple of 16 wastes most of one), fewer tiles on a tie.
fn tile_rows(out_h: usize, out_w: usize, wp: usize) -> usize {
    let fewest = out_h.div_ceil((TILE_COLUMNS / wp).max(1));
    let vectors = |rows: usize| {
        (0..out_h)
            .step_by(rows)
            .map(|oh| ((rows.min(out_h - oh) - 1) * wp + out_w).div_ceil(16))
            .sum::<usize>()
    };
    (fewest..=out_h.min(4 * fewest))
        .map(|tiles| out_h.div_ceil(tiles))
        .min_by_key(|&rows| (vectors(rows), out_h.div_ceil(rows)))
        .unwrap_or(1)
}

/// The implicit-gemm plan of one unit-stride geometry: padded sizes, the row offsets of the
/// column matrix and the tiling of the output rows.
pub(crate) struct Implicit {
    cpu: Avx512,
    g: Geometry,
    /// Padded height and width.
    hp: usize,
    wp: usize,
    /// Offset of row `(c·kh + ki)·kw + kj` of the column matrix inside the padded sample.
    rows: Vec<usize>,
    /// Output rows per tile.
    tile_rows: usize,
}

impl Implicit {
    /// The plan for `g`, or None where it does not apply: strides other than 1, or a CPU
    /// without the AVX-512 kernel.
    pub(crate) fn new(g: &Geometry) -> Option<Self> {
        let cpu = tile_product::avx512()?;
        if g.out_h == 0 || g.out_w == 0 {
            return None;
        }
        let (sh, sw) = g.stride;
        let (hp, mut wp) = (
            (g.in_h + 2 * g.padding.0).div_ceil(sh),
            (g.in_w + 2 * g.padding.1).div_ceil(sw),
        );
        if shares_pad_columns(g) {
            wp = g.in_w + g.padding.1;
        }
        let (kh, kw) = g.kernel;
        let mut rows = Vec::with_capacity(g.in_channels * kh * kw);
        for c in 0..g.in_channels {
            for ki in 0..kh {
                for kj in 0..kw {
                    let (y, z) = (ki * g.dilation.0, kj * g.dilation.1);
                    let phase = (c * sh + y % sh) * sw + z % sw;
                    rows.push(phase * hp * wp + y / sh * wp + z / sw);
                }
            }
        }
        // Near-equal tiles of whole output rows.
        Some(Implicit {
            cpu,
            g: *g,
            hp,
            wp,
            rows,
            tile_rows: tile_rows(g.out_h, g.out_w, wp),
        })
    }

    /// Elements of the padded sample (0 when there is no padding: the sample is read as is).
    /// With shared pad columns the last row of the last channel reads `pw` zeros past its
    /// plane.
    pub(crate) fn padded_len(&self) -> usize {
        let g = &self.g;
        if g.padding == (0, 0) && g.stride == (1, 1) {
            0
        } else if shares_pad_columns(g) {
            g.in_channels * self.hp * self.wp + g.padding.1
        } else {
            g.in_channels * g.stride.0 * g.stride.1 * self.hp * self.wp
        }
    }

    /// Elements of the output tile buffer: `O` rows of the widest tile.
    pub(crate) fn tile_len(&self) -> usize {
        self.g.out_channels * ((self.tile_rows - 1) * self.wp + self.g.out_w)
    }

    /// One sample's output `[O, OH, OW]` into `out`, from its input `x` (`[C, H, W]`), the
    /// weights transposed (`wt`, `[C·kh·kw, O]`) and the bias; `padded` and `tile` are scratch
    /// of [`Implicit::padded_len`] and [`Implicit::tile_len`] elements. Writes every element of
    /// `out`.
    pub(crate) fn sample(
        &self,
        wt: &[f32],
        bias: Option<&[f32]>,
        x: &[f32],
        padded: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) {
        let g = &self.g;
        let src: &[f32] = if self.padded_len() == 0 {
            x
        } else {
            self.pad(x, padded);
            &padded[..self.padded_len()]
        };
        let mut oh = 0;
        while oh < g.out_h {
            let count = self.tile_rows.min(g.out_h - oh);
            let width = (count - 1) * self.wp + g.out_w;
            let shape = TileShape {
                o_n: g.out_channels,
                depth: self.rows.len(),
                width,
                a_rs: 1,
                a_cs: g.out_channels,
                b_rs: 0,
                out_stride: width,
                accumulate: false,
            };
            let b = &src[oh * self.wp..];
            tile_product::product_rows(self.cpu, shape, wt, b, &self.rows, bias, tile);
            self.compact(tile, out, oh, count);
            oh += count;
        }
    }

    /// Columns of the implicit column matrix: the output pixels over the padded width.
    pub(crate) fn columns(&self) -> usize {
        (self.g.out_h - 1) * self.wp + self.g.out_w
    }

    /// Elements of the transposed output-gradient buffer of [`Implicit::weight_sample`].
    pub(crate) fn spread_len(&self) -> usize {
        self.columns() * self.g.out_channels
    }

    /// Adds one sample's weight gradient, transposed (`[C·kh·kw, O]`), onto `gw_t`:
    /// `gw_t[r, o] += Σ_q cols[r, q] · gy[o, q]`, with the column matrix read in place from the
    /// padded input (`x`, `[C, H, W]`) and the output gradient `gy` (`[O, OH, OW]`) spread
    /// into `[q, O]` order (zero in the columns past each output row). `padded` and `spread`
    /// are scratch of [`Implicit::padded_len`] and [`Implicit::spread_len`] elements.
    pub(crate) fn weight_sample(
        &self,
        x: &[f32],
        gy: &[f32],
        padded: &mut [f32],
        spread: &mut [f32],
        gw_t: &mut [f32],
    ) {
        let g = &self.g;
        let src: &[f32] = if self.padded_len() == 0 {
            x
        } else {
            self.pad(x, padded);
            &padded[..self.padded_len()]
        };
        self.spread(gy, spread);
        let shape = TileShape {
            o_n: self.rows.len(),
            depth: self.columns(),
            width: g.out_channels,
            a_rs: 0,
            a_cs: 1,
            b_rs: g.out_channels,
            out_stride: g.out_channels,
            accumulate: true,
        };
        tile_product::product_a_rows(self.cpu, shape, src, &self.rows, spread, gw_t);
    }

    wide_simd_method!(
        /// Writes the output gradient `gy` (`[O, OH, OW]`) as `[q, O]` over the padded width,
        /// zero in the columns `OW..Wp` of each output row.
        fn spread = Implicit::spread_gradient(&self, gy: &[T], spread: &mut [T])
    );

    #[inline(always)]
    fn spread_gradient<T: FloatElement>(&self, gy: &[T], spread: &mut [T]) {
        let g = &self.g;
        let (o_n, ow, pixels) = (g.out_channels, g.out_w, g.out_h * g.out_w);
        let spread = &mut spread[..self.spread_len()];
        for oh in 0..g.out_h {
            let row = &mut spread[oh * self.wp * o_n..];
            for (j, dst) in row[..ow * o_n].chunks_exact_mut(o_n).enumerate() {
                for (o, d) in dst.iter_mut().enumerate() {
                    *d = gy[o * pixels + oh * ow + j];
                }
            }
            if oh + 1 < g.out_h {
                row[ow * o_n..self.wp * o_n].fill(T::ZERO);
            }
        }
    }

    wide_simd_method!(
        /// Writes sample `x` (`[C, H, W]`) as `[C, H + 2·ph, W + 2·pw]` with zero borders, or
        /// with strides other than 1 as its `sh·sw` phase planes a channel (see the module
        /// doc).
        fn pad = Implicit::pad_sample(&self, x: &[T], padded: &mut [T])
    );

    #[inline(always)]
    fn pad_sample<T: FloatElement>(&self, x: &[T], padded: &mut [T]) {
        let g = &self.g;
        let (ph, pw) = g.padding;
        if g.stride != (1, 1) {
            return self.pad_phases(x, padded);
        }
        let plane = self.hp * self.wp;
        let padded = &mut padded[..self.padded_len()];
        let (planes, tail) = padded.split_at_mut(g.in_channels * plane);
        // Past the last plane: the right padding of its last row (shared pad columns).
        tail.fill(T::ZERO);
        for (c, dst) in planes.chunks_exact_mut(plane).enumerate() {
            dst[..ph * self.wp].fill(T::ZERO);
            for ih in 0..g.in_h {
                let row = &mut dst[(ph + ih) * self.wp..][..self.wp];
                row[..pw].fill(T::ZERO);
                copy_run(
                    &mut row[pw..pw + g.in_w],
                    &x[(c * g.in_h + ih) * g.in_w..][..g.in_w],
                );
                // Empty with shared pad columns: the next row's left padding serves.
                row[pw + g.in_w..].fill(T::ZERO);
            }
            dst[(ph + g.in_h) * self.wp..].fill(T::ZERO);
        }
    }

    /// The strided layout of [`Implicit::pad`]: padded row `y`, column `z` of channel `c`
    /// goes to phase plane `(c, y mod sh, z mod sw)` at `(y / sh, z / sw)`.
    #[inline(always)]
    fn pad_phases<T: FloatElement>(&self, x: &[T], padded: &mut [T]) {
        let g = &self.g;
        let ((sh, sw), (ph, pw)) = (g.stride, g.padding);
        let plane = self.hp * self.wp;
        let padded = &mut padded[..self.padded_len()];
        padded.fill(T::ZERO);
        for c in 0..g.in_channels {
            for ih in 0..g.in_h {
                let y = ih + ph;
                let src = &x[(c * g.in_h + ih) * g.in_w..][..g.in_w];
                let row = y / sh * self.wp;
                if sw == 2 {
                    // Pairs of input columns go to the two column phases side by side: a
                    // deinterleaving loop the compiler vectorises.
                    let pair_plane = (c * sh + y % sh) * sw * plane;
                    let (even, odd) = padded[pair_plane..][..2 * plane].split_at_mut(plane);
                    let (first, second, at) = if pw % 2 == 0 {
                        (&mut even[row..], &mut odd[row..], pw / 2)
                    } else {
                        (&mut odd[row..], &mut even[row..], pw / 2)
                    };
                    // Input column 2k lands at phase column k + pw/2 of the first row and
                    // 2k + 1 at k + (pw + 1)/2 of the second.
                    let second_at = pw.div_ceil(2);
                    let pairs = src.chunks_exact(2);
                    let last = pairs.remainder().first().copied();
                    let n = pairs.len();
                    for ((a, b), pair) in first[at..at + n]
                        .iter_mut()
                        .zip(&mut second[second_at..second_at + n])
                        .zip(pairs)
                    {
                        *a = pair[0];
                        *b = pair[1];
                    }
                    if let Some(v) = last {
                        first[at + n] = v;
                    }
                    continue;
                }
                for b in 0..sw {
                    // Input columns `iw ≡ b − pw (mod sw)` land in column phase `b`.
                    let first = (b + sw - pw % sw) % sw;
                    let phase = (c * sh + y % sh) * sw + b;
                    let dst = &mut padded[phase * plane + row..][..self.wp];
                    for (iw, &v) in src.iter().enumerate().skip(first).step_by(sw) {
                        dst[(iw + pw) / sw] = v;
                    }
                }
            }
        }
    }

    wide_simd_method!(
        /// Copies the tile of output rows `oh..oh + count` (`[O, width]`, rows `Wp` apart
        /// within it) into the sample's output `[O, OH, OW]`, dropping the columns past `OW`.
        fn compact = Implicit::compact_tile(&self, tile: &[T], out: &mut [T], oh: usize, count: usize)
    );

    #[inline(always)]
    fn compact_tile<T: FloatElement>(&self, tile: &[T], out: &mut [T], oh: usize, count: usize) {
        let g = &self.g;
        let (ow, pixels) = (g.out_w, g.out_h * g.out_w);
        let width = (count - 1) * self.wp + ow;
        for (o, src) in tile[..g.out_channels * width]
            .chunks_exact(width)
            .enumerate()
        {
            let dst = &mut out[o * pixels + oh * ow..][..count * ow];
            for (r, d) in dst.chunks_exact_mut(ow).enumerate() {
                copy_run(d, &src[r * self.wp..][..ow]);
            }
        }
    }
}

/// Whether the padded rows of `g` can share their pad columns: with unit strides each stored
/// row is `[pw zeros, input row]`, `Wp = W + pw`, and a tap reading past the end of a row's
/// input lands in the next row's left zeros, which stand for its right padding (the first
/// `pw` elements of every plane are such zeros too). That takes `pw` columns of work off each
/// output row (20% on 8-pixel-wide images). It needs the output rows to fit in the stored
/// width, `OW ≤ W + pw`, that is `pw ≤ dw·(kw − 1)`.
fn shares_pad_columns(g: &Geometry) -> bool {
    g.stride == (1, 1) && g.padding.1 > 0 && g.padding.1 <= g.dilation.1 * (g.kernel.1 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct-loop convolution in f64 of one sample, `[O, OH, OW]`.
    fn direct(g: &Geometry, x: &[f32], w: &[f32], bias: &[f32]) -> Vec<f64> {
        let (kh, kw) = g.kernel;
        let mut out = Vec::new();
        for (o, &b) in bias.iter().enumerate().take(g.out_channels) {
            for i in 0..g.out_h {
                for j in 0..g.out_w {
                    let mut acc = b as f64;
                    for c in 0..g.in_channels {
                        for a in 0..kh {
                            for b in 0..kw {
                                let y = (i * g.stride.0 + a * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let z = (j * g.stride.1 + b * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                if y < 0 || z < 0 || y >= g.in_h as isize || z >= g.in_w as isize {
                                    continue;
                                }
                                let xi = (c * g.in_h + y as usize) * g.in_w + z as usize;
                                let wi = ((o * g.in_channels + c) * kh + a) * kw + b;
                                acc += x[xi] as f64 * w[wi] as f64;
                            }
                        }
                    }
                    out.push(acc);
                }
            }
        }
        out
    }

    #[test]
    fn tiles_cover_the_output_rows_within_the_width_limit_and_avoid_ragged_vectors() {
        for (out_h, out_w, wp) in [
            (32, 32, 33),
            (16, 16, 17),
            (8, 8, 9),
            (5, 700, 702),
            (1, 1, 1),
        ] {
            let rows = tile_rows(out_h, out_w, wp);
            assert!((1..=out_h).contains(&rows), "{out_h}x{out_w}");
            assert!(
                rows == 1 || (rows - 1) * wp + out_w <= TILE_COLUMNS,
                "{out_h}x{out_w}"
            );
        }
        // 32 rows over a stored width of 33: two tiles of 16 rows take 66 vectors, where four
        // of 8 would take 68 and three (11, 11, 10 rows) 67.
        assert_eq!(tile_rows(32, 32, 33), 16);
    }

    #[test]
    fn implicit_gemm_forward_and_weight_gradient_match_direct_loops_with_strides() {
        // (C, H, W, O, kh, kw, stride, padding, dilation)
        let cases = [
            (3, 32, 32, 16, 3, 3, (1, 1), (1, 1), (1, 1)),
            (16, 13, 9, 7, 3, 3, (1, 1), (1, 1), (1, 1)),
            (6, 14, 14, 16, 5, 5, (1, 1), (0, 0), (1, 1)),
            (2, 11, 12, 5, 3, 5, (1, 1), (2, 1), (2, 1)),
            (9, 40, 7, 24, 2, 3, (1, 1), (0, 2), (1, 2)),
            // Shared pad columns at their limit (pw = dw·(kw − 1)), past it (no sharing), and
            // on the 8-pixel images of ResNet-20.
            (5, 7, 6, 16, 3, 3, (1, 1), (2, 2), (1, 1)),
            (4, 6, 5, 8, 1, 1, (1, 1), (1, 1), (1, 1)),
            (24, 8, 8, 64, 3, 3, (1, 1), (1, 1), (1, 1)),
            // Strided: phase planes, odd padded sizes, taps of either parity.
            (16, 16, 16, 32, 3, 3, (2, 2), (1, 1), (1, 1)),
            (5, 13, 11, 9, 3, 2, (2, 3), (1, 2), (1, 1)),
            (4, 12, 15, 16, 3, 3, (3, 2), (2, 1), (2, 3)),
            (8, 9, 9, 8, 1, 1, (2, 2), (0, 0), (1, 1)),
        ];
        for (ci, &(c, h, w, o, kh, kw, stride, padding, dilation)) in cases.iter().enumerate() {
            let out_h = (h + 2 * padding.0 - dilation.0 * (kh - 1) - 1) / stride.0 + 1;
            let out_w = (w + 2 * padding.1 - dilation.1 * (kw - 1) - 1) / stride.1 + 1;
            let g = Geometry {
                batch: 1,
                in_channels: c,
                in_h: h,
                in_w: w,
                out_channels: o,
                kernel: (kh, kw),
                stride,
                padding,
                dilation,
                out_h,
                out_w,
            };
            let Some(plan) = Implicit::new(&g) else {
                return;
            };
            let x: Vec<f32> = (0..c * h * w)
                .map(|i| ((i * 7) % 19) as f32 * 0.25 - 2.0)
                .collect();
            let wts: Vec<f32> = (0..o * c * kh * kw)
                .map(|i| ((i * 5) % 11) as f32 * 0.5 - 2.5)
                .collect();
            let bias: Vec<f32> = (0..o).map(|i| i as f32 - 3.0).collect();
            let patch = c * kh * kw;
            let wt: Vec<f32> = (0..patch * o)
                .map(|i| wts[(i % o) * patch + i / o])
                .collect();
            // Stale values in the scratch must not leak into the result.
            let mut padded = vec![f32::NAN; plan.padded_len()];
            let mut tile = vec![f32::NAN; plan.tile_len()];
            let mut out = vec![f32::NAN; o * out_h * out_w];
            plan.sample(&wt, Some(&bias), &x, &mut padded, &mut tile, &mut out);
            let want = direct(&g, &x, &wts, &bias);
            for (k, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert_eq!(got as f64, want, "case {ci} element {k}");
            }
            // Weight gradient of the same geometry against the f64 sum over output pixels,
            // added onto a non-zero start.
            let gy: Vec<f32> = (0..o * out_h * out_w)
                .map(|i| ((i * 3) % 7) as f32 * 0.5 - 1.5)
                .collect();
            let mut spread = vec![f32::NAN; plan.spread_len()];
            let mut gw_t = vec![1.0f32; patch * o];
            plan.weight_sample(&x, &gy, &mut padded, &mut spread, &mut gw_t);
            let pixels = out_h * out_w;
            for (r, row) in gw_t.chunks(o).enumerate() {
                let (ch, ki, kj) = (r / (kh * kw), r / kw % kh, r % kw);
                for (oc, &got) in row.iter().enumerate() {
                    let mut want = 1.0f64;
                    for i in 0..out_h {
                        for j in 0..out_w {
                            let y = (i * stride.0 + ki * dilation.0) as isize - padding.0 as isize;
                            let z = (j * stride.1 + kj * dilation.1) as isize - padding.1 as isize;
                            if y < 0 || z < 0 || y >= h as isize || z >= w as isize {
                                continue;
                            }
                            let xi = (ch * h + y as usize) * w + z as usize;
                            want += x[xi] as f64 * gy[oc * pixels + i * out_w + j] as f64;
                        }
                    }
                    assert_eq!(got as f64, want, "case {ci} weight ({oc}, {r})");
                }
            }
        }
    }
}
