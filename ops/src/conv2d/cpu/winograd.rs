//! Winograd F(2×2, 3×3) convolution for f32 on AVX-512 CPUs: the 3×3, unit-stride,
//! undilated layers of residual networks, forward (and so the input gradient, which `cpu.rs`
//! runs as a forward convolution) and weight gradient.
//!
//! Each 2×2 output tile `Y` of output channel `o` is `Aᵀ·[Σ_c U(o, c) ⊙ V(c)]·A` with the
//! transformed weights `U = G·g·Gᵀ` (4×4 from a 3×3 kernel) and the transformed input tile
//! `V = Bᵀ·d·B` (4×4 from the 4×4 input patch `d` under the tile): 16 products a tile and
//! input channel where direct convolution does 36, and the transforms only add, subtract and
//! halve, so f32 results stay within a few ulps of the direct sum. The sum over channels is,
//! for each of the 16 positions `ξ` of the 4×4 tile, a matrix product `M[ξ] = U[ξ]·V[ξ]`
//! (`O × C` by `C × tiles`), which runs on the register-blocked kernel of `tile_product.rs`.
//!
//! Tiles are taken in chunks of whole tile rows, across samples, sized so that a chunk's
//! transformed input `V[16][C][T]` and products `M[16][O][T]` stay in L2 (the 8×8 layers have
//! only 16 tiles a sample, far too few for a wide product). Within a chunk the tile rows are
//! laid end to end as one long row: a tile row of `tw` tiles reads `2·tw + 2` padded input
//! columns, so with one extra (discarded) tile per row every tile of the chunk starts two
//! columns after the previous one, and the transforms run 16 tiles a vector with no gathers.
//! The weight gradient runs the same algorithm backwards: `dM = A·dY·Aᵀ` per tile,
//! `dU[ξ] = Σ_tiles dM[ξ]·V[ξ]ᵀ`, `dW = Gᵀ·dU·G` — the exact gradient of the forward.

use rayon::prelude::*;
use tandem_core::{alloc, Result};

use super::tile_product::{self, Avx512, TileShape};
use super::OP;
use crate::conv2d::shape::Geometry;
use crate::cpu::memory::{self, Scratch};
use crate::cpu::parallel::parallel;

mod dot;
mod transforms;

use dot::{accumulator_index, accumulator_len, weight_products};
use transforms::{
    copy_row, gather_rows, input_tiles, output_adjoint_tiles, output_tiles, weight_tiles, PAD_ROW,
};

/// Aim for a chunk's transformed input and products of about this many bytes together, a
/// quarter of a 2 MiB L2 (measured: 1 MiB was as fast for 32 and 64 channels, but slower for
/// 16, whose wider chunks read more input rows at once).
const CHUNK_BYTES: usize = 1 << 19;

/// Input and output channels from which Winograd is used: it measured faster than the
/// implicit gemm from 16 channels (1.1–1.2× at 16, 1.4× at 32, 1.7× at 64); below 16 the
/// products are too thin to pay.
const MIN_CHANNELS: usize = 16;

/// The weight gradient takes chunks of at least this many tiles: its products reduce their
/// partial sums once a chunk, which costs as much as 3 of their vector steps (16 tiles each).
const MIN_WEIGHT_TILES: usize = 128;

/// Positions of a transformed 4×4 tile.
const XI: usize = 16;

/// Extra elements between the blocks of `V` and `M` of successive positions `ξ`: with
/// power-of-two block sizes the 16 streams a transform reads or writes at once would fall
/// into the same few L1 sets.
const SKEW: usize = 16;

/// The Winograd plan of one geometry: its tiling and how many tile rows a chunk takes.
#[derive(Clone, Copy)]
pub(crate) struct Winograd {
    cpu: Avx512,
    g: Geometry,
    /// Tiles down and across one sample's output.
    tiles_h: usize,
    tiles_w: usize,
    /// Tile rows per chunk.
    chunk_rows: usize,
}

/// One chunk: `rows` tile rows from `first_row`, whose `rows·(tw + 1)` tiles (one discarded
/// per row) are stored `stride` apart in `V` and `M` (a whole number of vectors).
#[derive(Clone, Copy)]
struct Chunk {
    /// First tile row, counted over the samples of the caller's range.
    first_row: usize,
    /// Tile rows.
    rows: usize,
    /// Tiles (columns of `V` and `M`) computed, a multiple of 16.
    stride: usize,
}

impl Winograd {
    /// The plan for `g`, or None where Winograd does not apply or would not win: kernels other
    /// than 3×3, strides or dilations other than 1, fewer than [`MIN_CHANNELS`] input or output
    /// channels, or a CPU without AVX-512F.
    pub(crate) fn new(g: &Geometry) -> Option<Self> {
        Self::with_min_channels(g, MIN_CHANNELS)
    }

    /// [`Winograd::new`] with another channel threshold (the tests run any channel count).
    fn with_min_channels(g: &Geometry, min_channels: usize) -> Option<Self> {
        let cpu = tile_product::avx512()?;
        let suits = g.kernel == (3, 3)
            && g.stride == (1, 1)
            && g.dilation == (1, 1)
            && g.in_channels >= min_channels.max(1)
            && g.out_channels >= min_channels.max(1)
            && g.batch > 0
            && g.out_h > 0
            && g.out_w > 0;
        if !suits {
            return None;
        }
        let (tiles_h, tiles_w) = (g.out_h.div_ceil(2), g.out_w.div_ceil(2));
        let tile_bytes = XI * 4 * (g.in_channels + g.out_channels);
        let chunk_rows = (CHUNK_BYTES / tile_bytes / (tiles_w + 1)).max(1);
        Some(Winograd {
            cpu,
            g: *g,
            tiles_h,
            tiles_w,
            chunk_rows,
        })
    }

    /// Padded input columns a tile row reads (and output columns it writes, past the last
    /// tile's): `2·(tw + 1)`, one discarded tile per row.
    fn segment(&self) -> usize {
        2 * (self.tiles_w + 1)
    }

    /// The largest tile stride of a chunk.
    fn max_stride(&self) -> usize {
        (self.chunk_rows * (self.tiles_w + 1)).next_multiple_of(16)
    }

    /// Elements of each long input row: the loads of the last vector of tiles reach two
    /// columns past `2·stride`.
    fn row_len(&self) -> usize {
        (2 * self.max_stride()).max(self.chunk_rows * self.segment()) + 32
    }

    /// The chunks of `rows` tile rows.
    fn chunks(&self, rows: usize) -> impl Iterator<Item = Chunk> + '_ {
        (0..rows).step_by(self.chunk_rows).map(move |first_row| {
            let count = self.chunk_rows.min(rows - first_row);
            Chunk {
                first_row,
                rows: count,
                stride: (count * (self.tiles_w + 1)).next_multiple_of(16),
            }
        })
    }

    /// `U[ξ][c][o] = (G·w[o, c]·Gᵀ)[ξ]` for the weights `w` (`[O, C, 3, 3]`).
    fn transform_weights(&self, w: &[f32]) -> Result<Vec<f32>> {
        let (c_n, o_n) = (self.g.in_channels, self.g.out_channels);
        let mut u = memory::uninit::<f32>(OP, XI * c_n * o_n)?;
        weight_tiles(w, c_n, o_n, &mut u);
        Ok(u)
    }

    /// The forward `out = conv(x, w) + bias` (`x` `[N, C, H, W]`, `w` `[O, C, 3, 3]`, `out`
    /// `[N, O, OH, OW]`): writes every element of `out`. Errors only when scratch memory
    /// cannot be had.
    ///
    /// # Panics
    /// When a slice is shorter than the geometry needs (a bug of the caller).
    pub(crate) fn forward(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> Result<()> {
        let g = &self.g;
        let (in_per, out_per) = (
            g.in_channels * g.in_h * g.in_w,
            g.out_channels * g.out_h * g.out_w,
        );
        let fits = x.len() >= g.batch * in_per
            && w.len() >= g.out_channels * g.in_channels * 9
            && out.len() >= g.batch * out_per
            && bias.is_none_or(|b| b.len() >= g.out_channels);
        assert!(fits, "Winograd forward: slices too short for {g:?}");
        let u = self.transform_weights(w)?;
        let out = &mut out[..g.batch * out_per];
        let threads = rayon::current_num_threads();
        let done = if parallel(out.len()) && g.batch > 1 {
            let per = g.batch.div_ceil(threads);
            out.par_chunks_mut(per * out_per)
                .enumerate()
                .try_for_each(|(i, part)| {
                    let n0 = i * per;
                    let xs = &x[n0 * in_per..(n0 + part.len() / out_per) * in_per];
                    self.forward_samples(xs, &u, bias, part)
                })
        } else {
            self.forward_samples(&x[..g.batch * in_per], &u, bias, out)
        };
        alloc::recycle(u);
        done
    }

    /// The forward of the samples `x` (whole samples) into `out`, chunk by chunk.
    fn forward_samples(
        &self,
        x: &[f32],
        u: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> Result<()> {
        let g = &self.g;
        let (c_n, o_n) = (g.in_channels, g.out_channels);
        let samples = x.len() / (c_n * g.in_h * g.in_w);
        let stride = self.max_stride();
        let mut v_buf = Scratch::new(OP, XI * (c_n * stride + SKEW) + 16)?;
        let mut m_buf = Scratch::new(OP, XI * (o_n * stride + SKEW) + 16)?;
        let mut rows_buf = Scratch::zeroed(OP, 4 * self.row_len() + 16)?;
        let mut out_buf = Scratch::new(OP, 4 * stride + 16)?;
        let (rows, out_rows) = (aligned(&mut rows_buf), aligned(&mut out_buf));
        let (v, m) = (aligned(&mut v_buf), aligned(&mut m_buf));
        let mut sources = Vec::with_capacity(4 * self.chunk_rows);
        for chunk in self.chunks(samples * self.tiles_h) {
            let t = chunk.stride;
            let (v_xi, m_xi) = (c_n * t + SKEW, o_n * t + SKEW);
            self.transform_input(x, chunk, &mut sources, rows, v);
            for xi in 0..XI {
                let shape = TileShape {
                    o_n,
                    depth: c_n,
                    width: t,
                    a_rs: 1,
                    a_cs: o_n,
                    b_rs: t,
                    out_stride: t,
                    accumulate: false,
                };
                let (a, b) = (&u[xi * c_n * o_n..], &v[xi * v_xi..]);
                tile_product::product(self.cpu, shape, a, b, None, &mut m[xi * m_xi..]);
            }
            for o in 0..o_n {
                let b = bias.map_or(0.0, |b| b[o]);
                let (top, bottom) = out_rows.split_at_mut(2 * stride);
                output_tiles(&m[o * t..], m_xi, t, b, top, bottom);
                self.scatter_rows(chunk, o, top, bottom, out);
            }
        }
        Ok(())
    }

    /// `V` of the tiles of `chunk` (`v[ξ·(C·t + SKEW) + c·t + j]`, `t = chunk.stride`) from
    /// the samples `x`; `sources` and `rows` are scratch.
    fn transform_input(
        &self,
        x: &[f32],
        chunk: Chunk,
        sources: &mut Vec<usize>,
        rows: &mut [f32],
        v: &mut [f32],
    ) {
        let g = &self.g;
        let t = chunk.stride;
        let plane = g.in_h * g.in_w;
        let (width, shift, seg) = (g.in_w, g.padding.1, self.segment());
        self.row_sources(chunk, sources);
        for c in 0..g.in_channels {
            // Channel c: the same rows, one plane on.
            gather_rows(
                &x[c * plane..],
                sources,
                4,
                width,
                shift,
                seg,
                rows,
                self.row_len(),
            );
            input_tiles(
                rows,
                self.row_len(),
                t,
                &mut v[c * t..],
                g.in_channels * t + SKEW,
            );
        }
    }

    /// The weight gradient `dW[o, c, a, b] = Σ gy[n, o, i, j] · x[n, c, i + a − ph, j + b − pw]`
    /// (`[O, C, 3, 3]`) of the forward, from the input `x` and the output gradient `gy`. Errors
    /// only when scratch memory cannot be had.
    ///
    /// # Panics
    /// When a slice is shorter than the geometry needs (a bug of the caller).
    pub(crate) fn weight_gradient(&self, x: &[f32], gy: &[f32]) -> Result<Vec<f32>> {
        let g = &self.g;
        let (c_n, o_n) = (g.in_channels, g.out_channels);
        let (in_per, out_per) = (c_n * g.in_h * g.in_w, o_n * g.out_h * g.out_w);
        assert!(
            x.len() >= g.batch * in_per && gy.len() >= g.batch * out_per,
            "Winograd weight gradient: slices too short for {g:?}"
        );
        let plan = Winograd {
            chunk_rows: self
                .chunk_rows
                .max(MIN_WEIGHT_TILES.div_ceil(self.tiles_w + 1)),
            ..*self
        };
        // Each part takes its own `dU` through the (linear) weight transform, so that with
        // several threads the transforms run in parallel and the merge adds `9/16` as much.
        let part = |n0: usize, n1: usize| -> Result<Vec<f32>> {
            let du = plan.weight_samples(
                &x[n0 * in_per..n1 * in_per],
                &gy[n0 * out_per..n1 * out_per],
            )?;
            let gw = self.weight_adjoint(&du);
            alloc::recycle(du);
            gw
        };
        let partials: Vec<Vec<f32>> = if parallel(g.batch * out_per) && g.batch > 1 {
            let per = g.batch.div_ceil(rayon::current_num_threads());
            (0..g.batch.div_ceil(per))
                .into_par_iter()
                .map(|i| part(i * per, ((i + 1) * per).min(g.batch)))
                .collect::<Result<_>>()?
        } else {
            vec![part(0, g.batch)?]
        };
        let mut parts = partials.into_iter();
        // `Winograd::new` refuses an empty batch, so there is at least one part.
        let mut total = parts.next().unwrap_or_default();
        for p in parts {
            total.iter_mut().zip(&p).for_each(|(t, &v)| *t += v);
            alloc::recycle(p);
        }
        Ok(total)
    }

    /// `dW = Gᵀ·dU·G` (`[O, C, 3, 3]`) of `dU` laid out as the accumulator of `dot.rs`.
    fn weight_adjoint(&self, total: &[f32]) -> Result<Vec<f32>> {
        let (c_n, o_n) = (self.g.in_channels, self.g.out_channels);
        // dW = Gᵀ·dU·G, G = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]].
        let adjoint = |d: [f32; 4]| {
            [
                d[0] + 0.5 * (d[1] + d[2]),
                0.5 * (d[1] - d[2]),
                0.5 * (d[1] + d[2]) + d[3],
            ]
        };
        let mut gw = memory::uninit::<f32>(OP, o_n * c_n * 9)?;
        let xi_stride = accumulator_len(o_n, c_n) / XI;
        for o in 0..o_n {
            for c in 0..c_n {
                let at = accumulator_index(0, o, c, c_n, o_n);
                let du = |i: usize, j: usize| total[at + (4 * i + j) * xi_stride];
                // Gᵀ·dU column by column, then ·G along each row.
                let cols: [[f32; 3]; 4] =
                    std::array::from_fn(|j| adjoint(std::array::from_fn(|i| du(i, j))));
                let dst = &mut gw[(o * c_n + c) * 9..][..9];
                for a in 0..3 {
                    dst[3 * a..3 * a + 3]
                        .copy_from_slice(&adjoint(std::array::from_fn(|j| cols[j][a])));
                }
            }
        }
        Ok(gw)
    }

    /// `dU` of the samples `x` with output gradient `gy`, laid out as the accumulator of
    /// `dot.rs`: `dM = A·dY·Aᵀ` per tile, `dU[ξ] += dM[ξ]·V[ξ]ᵀ` chunk by chunk.
    fn weight_samples(&self, x: &[f32], gy: &[f32]) -> Result<Vec<f32>> {
        let g = &self.g;
        let (c_n, o_n, oh, ow) = (g.in_channels, g.out_channels, g.out_h, g.out_w);
        let samples = x.len() / (c_n * g.in_h * g.in_w);
        let stride = self.max_stride();
        let (row_len, seg) = (self.row_len(), self.segment());
        let mut acc = memory::zeroed(OP, accumulator_len(o_n, c_n))?;
        let (mut v_buf, mut m_buf) = (
            Scratch::new(OP, XI * (c_n * stride + SKEW) + 16)?,
            Scratch::new(OP, XI * (o_n * stride + SKEW) + 16)?,
        );
        let mut rows_buf = Scratch::zeroed(OP, 4 * row_len + 16)?;
        let mut grad_buf = Scratch::zeroed(OP, 2 * row_len + 16)?;
        let (rows, grad_rows) = (aligned(&mut rows_buf), aligned(&mut grad_buf));
        let (v, dm) = (aligned(&mut v_buf), aligned(&mut m_buf));
        let mut sources = Vec::with_capacity(4 * self.chunk_rows);
        let mut grad_sources = Vec::with_capacity(2 * self.chunk_rows);
        for chunk in self.chunks(samples * self.tiles_h) {
            let t = chunk.stride;
            let (v_xi, m_xi) = (c_n * t + SKEW, o_n * t + SKEW);
            self.transform_input(x, chunk, &mut sources, rows, v);
            grad_sources.clear();
            for r in chunk.first_row..chunk.first_row + chunk.rows {
                let (n, ty) = (r / self.tiles_h, r % self.tiles_h);
                let top = (n * o_n * oh + 2 * ty) * ow;
                grad_sources.push(top);
                grad_sources.push(if 2 * ty + 1 < oh { top + ow } else { PAD_ROW });
            }
            for o in 0..o_n {
                gather_rows(
                    &gy[o * oh * ow..],
                    &grad_sources,
                    2,
                    ow,
                    0,
                    seg,
                    grad_rows,
                    row_len,
                );
                let (top, bottom) = grad_rows.split_at_mut(row_len);
                // The tiles past the chunk's rows (up to a whole vector) get a zero gradient.
                top[chunk.rows * seg..2 * t].fill(0.0);
                bottom[chunk.rows * seg..2 * t].fill(0.0);
                output_adjoint_tiles(top, bottom, t, &mut dm[o * t..], m_xi);
            }
            weight_products(dm, m_xi, v, v_xi, t, o_n, c_n, &mut acc);
        }
        Ok(acc)
    }

    /// Where the four long input rows of `chunk` read, for channel 0 of the samples `x`: for
    /// tile row `ty` of sample `n`, the offset of input row `2·ty + i − ph` of `x[n, 0]`
    /// ([`PAD_ROW`] outside the input), for `i < 4`.
    fn row_sources(&self, chunk: Chunk, sources: &mut Vec<usize>) {
        let g = &self.g;
        let (h, w) = (g.in_h, g.in_w);
        sources.clear();
        for r in chunk.first_row..chunk.first_row + chunk.rows {
            let (n, ty) = (r / self.tiles_h, r % self.tiles_h);
            for i in 0..4 {
                let y = (2 * ty + i).wrapping_sub(g.padding.0);
                sources.push(if y < h {
                    (n * g.in_channels * h + y) * w
                } else {
                    PAD_ROW
                });
            }
        }
    }

    /// Copies the two long output rows of channel `o` (see [`output_tiles`]) into `out`
    /// (`[n, O, OH, OW]` over the caller's samples).
    fn scatter_rows(&self, chunk: Chunk, o: usize, top: &[f32], bottom: &[f32], out: &mut [f32]) {
        let g = &self.g;
        let (oh, ow) = (g.out_h, g.out_w);
        let seg = self.segment();
        for s in 0..chunk.rows {
            let r = chunk.first_row + s;
            let (n, ty) = (r / self.tiles_h, r % self.tiles_h);
            let plane = &mut out[(n * g.out_channels + o) * oh * ow..][..oh * ow];
            copy_row(&top[s * seg..], &mut plane[2 * ty * ow..], ow);
            if 2 * ty + 1 < oh {
                copy_row(&bottom[s * seg..], &mut plane[(2 * ty + 1) * ow..], ow);
            }
        }
    }
}

/// A scratch buffer (allocated 16 elements longer than needed) from its first 64-byte
/// aligned element on: the vector loads and stores then never straddle cache lines.
fn aligned(scratch: &mut Scratch<f32>) -> &mut [f32] {
    let skip = scratch.buf.as_ptr().align_offset(64).min(16);
    &mut scratch.buf[skip..]
}

#[cfg(test)]
mod tests;
