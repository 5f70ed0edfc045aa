//! CPU kernels of conv2d. For f32 on AVX-512 CPUs the forward is an implicit gemm over the
//! padded input (`implicit.rs`), and so is the input gradient with unit strides, computed as a
//! forward convolution of the output gradient (see `transposed`); the weight gradient reads
//! its columns in place from a padded channels-last copy of the input (`pixel_rows.rs`) or
//! through the implicit gemm. Elsewhere (f64, other CPUs, the strided input gradient) the
//! columns are built explicitly (im2col) and multiplied by gemm or the register-blocked kernel
//! of `tile_product.rs`, and col2im turns `Wᵀ·g` back into an input gradient. At one rayon
//! thread everything runs on the caller. The 3×3, unit-stride, undilated layers with at least
//! 16 input and output channels (f32, AVX-512) take Winograd F(2×2, 3×3) instead
//! (`winograd.rs`) for the forward, and so for the input gradient, and for the weight gradient.
//!
//! The batch is split into one contiguous chunk per rayon thread; each chunk owns its scratch
//! buffers (from the caching allocator) and its partial weight/bias gradients, which are
//! summed at the end, so no thread writes where another reads. Where columns are built, each
//! sample's output pixels are processed in tiles small enough that a tile's column matrix
//! stays in cache from the moment it is written to the moment gemm reads it: the columns are
//! the largest data a convolution touches (`C·kh·kw` times the input), and streaming them
//! through memory costs as much as the products themselves.

use std::sync::OnceLock;

use rayon::prelude::*;
use tandem_core::{alloc, FloatElement};

use super::im2col::{tile_bounds, Im2col};
use super::implicit::Implicit;
use super::pixel_rows::PixelRows;
use super::tile_product::{self, TileShape};
use super::winograd::Winograd;
use crate::matmul::cpu::{gemm_into, MatRef};

/// Aim for a tile's column matrix of about this many elements (32 KiB of f32: L1-sized).
const TILE_ELEMENTS: usize = 8192;

/// Tiles are at least this many pixels wide: narrower products lose gemm efficiency.
const MIN_TILE_PIXELS: usize = 64;

/// Element types of the convolution kernels: f32 has the AVX-512 kernels of
/// `tile_product.rs` and `implicit.rs`, f64 always takes the gemm path.
pub(crate) trait ConvElement: FloatElement {
    /// The forward tile product with the register-blocked kernel of `tile_product.rs` (see
    /// there for the layouts); false (nothing written) where that kernel does not apply.
    fn tile_product(
        _s: TileShape,
        _wt: &[Self],
        _cols: &[Self],
        _bias: Option<&[Self]>,
        _out: &mut [Self],
    ) -> bool {
        false
    }
    /// One sample's forward through the implicit gemm of `implicit.rs` (see
    /// [`Implicit::sample`]); false where it does not apply (the output is then incomplete).
    fn implicit_sample(
        _plan: &Implicit,
        _wt: &[Self],
        _bias: Option<&[Self]>,
        _x: &[Self],
        _padded: &mut [Self],
        _tile: &mut [Self],
        _out: &mut [Self],
    ) -> bool {
        false
    }
    /// Adds one sample's weight gradient, transposed, through the implicit gemm (see
    /// [`Implicit::weight_sample`]); false (nothing added) where it does not apply.
    fn implicit_weight_sample(
        _plan: &Implicit,
        _x: &[Self],
        _gy: &[Self],
        _padded: &mut [Self],
        _spread: &mut [Self],
        _gw_t: &mut [Self],
    ) -> bool {
        false
    }
    /// The whole forward by Winograd F(2×2, 3×3) (see `winograd.rs`); false where it does
    /// not apply (the output is then incomplete).
    fn winograd_forward(
        _g: &Geometry,
        _x: &[Self],
        _w: &[Self],
        _bias: Option<&[Self]>,
        _out: &mut [Self],
    ) -> bool {
        false
    }
    /// The weight gradient (`[O, C, 3, 3]`) by Winograd F(2×2, 3×3) (see `winograd.rs`);
    /// None where it does not apply.
    fn winograd_weight(_g: &Geometry, _x: &[Self], _gy: &[Self]) -> Option<Vec<Self>> {
        None
    }
}

impl ConvElement for f32 {
    fn winograd_forward(
        g: &Geometry,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> bool {
        Winograd::new(g).is_some_and(|plan| plan.forward(x, w, bias, out))
    }
    fn winograd_weight(g: &Geometry, x: &[f32], gy: &[f32]) -> Option<Vec<f32>> {
        Winograd::new(g)?.weight_gradient(x, gy)
    }
    fn tile_product(
        s: TileShape,
        wt: &[f32],
        cols: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> bool {
        tile_product::product(s, wt, cols, bias, out)
    }
    fn implicit_sample(
        plan: &Implicit,
        wt: &[f32],
        bias: Option<&[f32]>,
        x: &[f32],
        padded: &mut [f32],
        tile: &mut [f32],
        out: &mut [f32],
    ) -> bool {
        plan.sample(wt, bias, x, padded, tile, out)
    }
    fn implicit_weight_sample(
        plan: &Implicit,
        x: &[f32],
        gy: &[f32],
        padded: &mut [f32],
        spread: &mut [f32],
        gw_t: &mut [f32],
    ) -> bool {
        plan.weight_sample(x, gy, padded, spread, gw_t)
    }
}

impl ConvElement for f64 {}

/// A scratch buffer of `len` elements (contents unspecified) from the caching allocator,
/// handed back to it on drop.
struct Scratch<T: ConvElement> {
    buf: Vec<T>,
}

impl<T: ConvElement> Scratch<T> {
    fn new(len: usize) -> Self {
        Scratch {
            buf: alloc::uninit(len),
        }
    }
}

impl<T: ConvElement> Drop for Scratch<T> {
    fn drop(&mut self) {
        alloc::recycle(std::mem::take(&mut self.buf));
    }
}

/// Sizes of one convolution, validated by `conv2d`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub batch: usize,
    pub in_channels: usize,
    pub in_h: usize,
    pub in_w: usize,
    pub out_channels: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub out_h: usize,
    pub out_w: usize,
}

impl Geometry {
    /// Rows of the column matrix: `C·kh·kw`.
    fn patch(&self) -> usize {
        self.in_channels * self.kernel.0 * self.kernel.1
    }
    fn out_pixels(&self) -> usize {
        self.out_h * self.out_w
    }
    fn in_per_sample(&self) -> usize {
        self.in_channels * self.in_h * self.in_w
    }
    fn out_per_sample(&self) -> usize {
        self.out_channels * self.out_pixels()
    }
}

/// How a call splits its work: `chunk` samples per parallel task and tiles of `tile_width`
/// output pixels per sample; gemm itself only goes parallel when the batch is too small to
/// split.
#[derive(Clone, Copy, Debug)]
struct Plan {
    chunk: usize,
    tile_width: usize,
    parallel_gemm: bool,
}

impl Plan {
    fn new(g: &Geometry) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let n = g.batch.max(1);
        let (chunk, parallel_gemm) = if threads > 1 && n >= threads {
            (n.div_ceil(threads), false)
        } else {
            (n, true)
        };
        let width = (TILE_ELEMENTS / g.patch().max(1)).max(MIN_TILE_PIXELS);
        // Near-equal tiles (aligning them to the tile kernel's register blocks measured slower:
        // the wider tiles fall out of L1).
        let tiles = (g.out_pixels() / width).max(1);
        Plan {
            chunk,
            tile_width: g.out_pixels().div_ceil(tiles),
            parallel_gemm,
        }
    }
}

/// Whether `T::tile_product` runs (f32 on a CPU with AVX-512F): an empty product tells.
fn direct_kernel<T: ConvElement>() -> bool {
    let empty = TileShape {
        o_n: 0,
        depth: 0,
        width: 0,
        a_rs: 0,
        a_cs: 0,
        b_rs: 0,
        out_stride: 0,
        accumulate: false,
    };
    T::tile_product(empty, &[], &[], None, &mut [])
}

/// Forward: `out[n] = W · im2col(x[n]) + b`, `x` `[N, C, H, W]`, `w` `[O, C·kh·kw]`, result
/// `[N, O, OH, OW]` as a flat vector. Winograd F(2×2, 3×3) where it applies and wins.
pub(crate) fn forward<T: ConvElement>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
) -> Vec<T> {
    forward_with(x, w, bias, g, true)
}

/// [`forward`], with Winograd allowed or not (`winograd: false` keeps to the implicit gemm
/// and im2col paths, for timing comparisons).
pub(crate) fn forward_with<T: ConvElement>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
    winograd: bool,
) -> Vec<T> {
    let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let mut out = alloc::uninit::<T>(g.batch * out_per);
    if out.is_empty() {
        return out;
    }
    if winograd && T::winograd_forward(g, x, w, bias, &mut out) {
        return out;
    }
    let plan = Plan::new(g);
    // The im2col table is only worked out where a sample needs it.
    let table = OnceLock::new();
    let weights = MatRef::row_major(0, patch);
    // The register-blocked kernel reads the weights transposed, `[C·kh·kw, O]`.
    let direct = direct_kernel::<T>();
    let implicit = if direct { Implicit::new(g) } else { None };
    let mut wt = alloc::uninit::<T>(if direct { patch * o_n } else { 0 });
    for (i, v) in wt.iter_mut().enumerate() {
        *v = w[(i % o_n) * patch + i / o_n];
    }
    let run_chunk = |ci: usize, out_chunk: &mut [T]| {
        let mut padded = Scratch::<T>::new(implicit.as_ref().map_or(0, |p| p.padded_len()));
        let mut tile = Scratch::<T>::new(implicit.as_ref().map_or(0, |p| p.tile_len()));
        let mut cols_buf = Scratch::<T>::new(0);
        for (s, dst) in out_chunk.chunks_mut(out_per).enumerate() {
            let xn = &x[(ci * plan.chunk + s) * in_per..][..in_per];
            if let Some(p) = &implicit {
                if T::implicit_sample(p, &wt, bias, xn, &mut padded.buf, &mut tile.buf, dst) {
                    continue;
                }
            }
            let table = table.get_or_init(|| Im2col::new(g, plan.tile_width));
            let cols_len = patch * table.max_tile_width();
            if cols_buf.buf.len() < cols_len {
                cols_buf = Scratch::new(cols_len);
            }
            let cols = &mut cols_buf.buf[..];
            // gemm adds the product onto the bias (the tile kernel stores bias + product).
            if let Some(b) = bias {
                dst.chunks_mut(pixels).zip(b).for_each(|(p, &v)| p.fill(v));
            }
            for t in 0..table.tile_count() {
                let (first, width) = table.tile(t);
                table.fill(t, xn, cols);
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
                if direct && T::tile_product(shape, &wt, cols, bias, &mut dst[first..]) {
                    continue;
                }
                gemm_into(
                    (o_n, width, patch),
                    dst,
                    MatRef {
                        offset: first,
                        rs: pixels,
                        cs: 1,
                    },
                    w,
                    weights,
                    cols,
                    MatRef::row_major(0, width),
                    bias.is_some(),
                    plan.parallel_gemm,
                );
            }
        }
    };
    if rayon::current_num_threads() > 1 && plan.chunk < g.batch {
        out.par_chunks_mut(plan.chunk * out_per)
            .enumerate()
            .for_each(|(ci, chunk)| run_chunk(ci, chunk));
    } else {
        out.chunks_mut(plan.chunk * out_per)
            .enumerate()
            .for_each(|(ci, chunk)| run_chunk(ci, chunk));
    }
    alloc::recycle(wt);
    out
}

/// Which gradients the backward must produce.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Needs {
    pub input: bool,
    pub weight: bool,
    pub bias: bool,
}

/// Gradients produced by [`backward`] (flat, in the layouts of x, weight and bias).
pub(crate) struct Grads<T> {
    pub input: Option<Vec<T>>,
    pub weight: Option<Vec<T>>,
    pub bias: Option<Vec<T>>,
}

/// Backward of [`forward`] for the output gradient `gy` (`[N, O, OH, OW]`, contiguous):
/// `grad_x[n] = col2im(Wᵀ·gy[n])`, `grad_W = Σₙ gy[n]·im2col(x[n])ᵀ`, `grad_b = Σ gy`.
pub(crate) fn backward<T: ConvElement>(
    x: &[T],
    w: &[T],
    gy: &[T],
    g: &Geometry,
    needs: Needs,
) -> Grads<T> {
    backward_with(x, w, gy, g, needs, true)
}

/// [`backward`], with Winograd allowed or not (see [`forward_with`]).
pub(crate) fn backward_with<T: ConvElement>(
    x: &[T],
    w: &[T],
    gy: &[T],
    g: &Geometry,
    needs: Needs,
    winograd: bool,
) -> Grads<T> {
    // The weight gradient by Winograd where it applies; the loop below then skips it.
    let winograd_gw = (needs.weight && winograd)
        .then(|| T::winograd_weight(g, x, gy))
        .flatten();
    // With unit strides the input gradient is itself a convolution (see `transposed`), which
    // runs on the forward kernels and needs no col2im; it is computed after the loop below.
    let by_conv = needs.input.then(|| transposed(g)).flatten();
    let needs = Needs {
        input: needs.input && by_conv.is_none(),
        weight: needs.weight && winograd_gw.is_none(),
        ..needs
    };
    let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let plan = Plan::new(g);
    // The im2col table is only worked out where a sample needs it.
    let table = OnceLock::new();
    let bounds = tile_bounds(pixels, plan.tile_width);
    let direct = direct_kernel::<T>();
    // With f32 on AVX-512 the weight gradient reads its pixel-major columns in place from the
    // padded channels-last sample where it can (unit strides, see `PixelRows::spread`), else
    // runs as an implicit gemm where the output channels fill a vector (and the output is not
    // small); otherwise it builds
    // its columns pixel-major where that layout suits the geometry, else from im2col tiles.
    let rows_layout = (needs.weight && PixelRows::suits(g)).then(|| PixelRows::new(g));
    let in_place = direct && rows_layout.as_ref().is_some_and(|p| p.in_place());
    let implicit = if direct && needs.weight && !in_place && o_n >= 16 {
        // Over few pixels (small depth) its register blocks are loaded and stored too often
        // for their work; pixel-major columns, where they suit, are faster there.
        Implicit::new(g).filter(|p| rows_layout.is_none() || p.columns() >= 128)
    } else {
        None
    };
    let pixel_rows = if implicit.is_some() {
        None
    } else {
        rows_layout
    };
    let mut grad_x = if needs.input {
        alloc::zeroed(g.batch * in_per)
    } else {
        Vec::new()
    };
    let chunks = g.batch.div_ceil(plan.chunk);
    let x_chunks: Vec<Option<&mut [T]>> = if needs.input && in_per > 0 {
        grad_x.chunks_mut(plan.chunk * in_per).map(Some).collect()
    } else {
        (0..chunks).map(|_| None).collect()
    };
    let run_chunk = |(ci, mut gx_chunk): (usize, Option<&mut [T]>)| {
        let n0 = ci * plan.chunk;
        let count = plan.chunk.min(g.batch - n0);
        let mut gw = alloc::zeroed(if needs.weight { o_n * patch } else { 0 });
        let mut gb = alloc::zeroed(if needs.bias { o_n } else { 0 });
        let mut cols_buf = Scratch::<T>::new(0);
        let padded_len = match (&implicit, &pixel_rows) {
            (Some(p), _) => p.padded_len(),
            (None, Some(p)) => p.padded_len(),
            (None, None) => 0,
        };
        let mut padded_buf = Scratch::<T>::new(padded_len);
        let spread_len = match (&implicit, &pixel_rows) {
            (Some(p), _) => p.spread_len(),
            (None, Some(p)) if in_place => p.spread_len(),
            _ => 0,
        };
        let mut spread = Scratch::<T>::new(spread_len);
        for s in 0..count {
            let xn = &x[(n0 + s) * in_per..][..in_per];
            let gn = &gy[(n0 + s) * out_per..][..out_per];
            if needs.bias {
                for (acc, plane) in gb.iter_mut().zip(gn.chunks(pixels)) {
                    *acc += plane_sum(plane);
                }
            }
            let mut weight_done = implicit.as_ref().is_some_and(|p| {
                T::implicit_weight_sample(p, xn, gn, &mut padded_buf.buf, &mut spread.buf, &mut gw)
            });
            if let Some(rows) = pixel_rows.as_ref().filter(|_| needs.weight) {
                rows.pad_channels_last(xn, &mut padded_buf.buf);
                if in_place {
                    rows.spread(gn, &mut spread.buf);
                    weight_done =
                        rows_in_place::<T>(rows, g, &spread.buf, &padded_buf.buf, &mut gw);
                }
            }
            let weight_by_tiles = needs.weight && !weight_done;
            if !weight_by_tiles && gx_chunk.is_none() {
                continue;
            }
            let table = (gx_chunk.is_some() || (weight_by_tiles && pixel_rows.is_none()))
                .then(|| table.get_or_init(|| Im2col::new(g, plan.tile_width)));
            let widest = bounds.windows(2).map(|b| b[1] - b[0]).max().unwrap_or(0);
            if cols_buf.buf.len() < patch * widest {
                cols_buf = Scratch::new(patch * widest);
            }
            let cols = &mut cols_buf.buf[..];
            for (t, tile) in bounds.windows(2).enumerate() {
                let (first, width) = (tile[0], tile[1] - tile[0]);
                // This tile of g: [O, width] inside the sample's [O, OH·OW].
                let g_tile = MatRef {
                    offset: first,
                    rs: pixels,
                    cs: 1,
                };
                if !weight_by_tiles {
                } else if let Some(rows) = &pixel_rows {
                    // grad_W [O, (ki, kj, c)] += g · rows, rows [width, C·kh·kw].
                    rows.fill(&padded_buf.buf, cols, first, width);
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
                    if !(direct && T::tile_product(shape, &gn[first..], cols, None, &mut gw)) {
                        gemm_into(
                            (o_n, patch, width),
                            &mut gw,
                            MatRef::row_major(0, patch),
                            gn,
                            g_tile,
                            cols,
                            MatRef::row_major(0, patch),
                            true,
                            plan.parallel_gemm,
                        );
                    }
                } else if let Some(table) = table {
                    // Accumulated transposed ([C·kh·kw, O]): gemm then streams the column
                    // matrix along its rows, much faster for these thin products.
                    table.fill(t, xn, cols);
                    gemm_into(
                        (o_n, patch, width),
                        &mut gw,
                        MatRef::row_major(0, o_n).t(),
                        gn,
                        g_tile,
                        cols,
                        MatRef::row_major(0, width).t(),
                        true,
                        plan.parallel_gemm,
                    );
                }
                if let (Some(gx), Some(table)) = (gx_chunk.as_deref_mut(), table) {
                    // The column buffer is free again: it now receives Wᵀ·g, `[C·kh·kw,
                    // width]`, by the register-blocked kernel where it runs and the depth
                    // (output channels) is small; gemm measured as fast from 32 up. Rows of Wᵀ
                    // are columns of W: unit row step, `C·kh·kw` between terms.
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
                    if !(direct && o_n <= 16 && T::tile_product(shape, w, &gn[first..], None, cols))
                    {
                        gemm_into(
                            (patch, width, o_n),
                            cols,
                            MatRef::row_major(0, width),
                            w,
                            MatRef::row_major(0, patch).t(),
                            gn,
                            g_tile,
                            false,
                            plan.parallel_gemm,
                        );
                    }
                    table.add_back(t, cols, &mut gx[s * in_per..(s + 1) * in_per]);
                }
            }
        }
        (gw, gb)
    };
    // At one thread the calling thread does the work: a parallel iterator would hand it to the
    // pool and wait.
    let partials: Vec<(Vec<T>, Vec<T>)> = if rayon::current_num_threads() > 1 && chunks > 1 {
        x_chunks
            .into_par_iter()
            .enumerate()
            .map(|(ci, c)| run_chunk((ci, c)))
            .collect()
    } else {
        x_chunks
            .into_iter()
            .enumerate()
            .map(|(ci, c)| run_chunk((ci, c)))
            .collect()
    };
    if let Some(g2) = &by_conv {
        let flipped = flipped_weights(w, g);
        alloc::recycle(std::mem::replace(
            &mut grad_x,
            forward_with(gy, &flipped, None, g2, winograd),
        ));
        alloc::recycle(flipped);
    }
    let grads = Grads {
        input: (needs.input || by_conv.is_some()).then_some(grad_x),
        weight: winograd_gw.or_else(|| {
            needs.weight.then(|| {
                let summed = sum_vectors(partials.iter().map(|p| &p.0), o_n * patch);
                let gw = match &pixel_rows {
                    Some(rows) => rows.to_weight_order(&summed),
                    None => {
                        // From [C·kh·kw, O] to [O, C·kh·kw].
                        let mut gw = alloc::uninit(o_n * patch);
                        for (r, row) in summed.chunks(o_n.max(1)).enumerate() {
                            row.iter()
                                .enumerate()
                                .for_each(|(o, &v)| gw[o * patch + r] = v);
                        }
                        gw
                    }
                };
                alloc::recycle(summed);
                gw
            })
        }),
        bias: needs
            .bias
            .then(|| sum_vectors(partials.iter().map(|p| &p.1), o_n)),
    };
    for (gw, gb) in partials {
        alloc::recycle(gw);
        alloc::recycle(gb);
    }
    grads
}

/// Adds one sample's weight gradient, `[O, (ki, kj, c)]`, onto `gw` with the column rows
/// read in place from the padded channels-last sample (see `PixelRows::spread`): one tile
/// product per kernel row. False (nothing added) where the kernel does not apply.
fn rows_in_place<T: ConvElement>(
    rows: &PixelRows,
    g: &Geometry,
    spread: &[T],
    padded: &[T],
    gw: &mut [T],
) -> bool {
    let (kh, kw, c_n) = (g.kernel.0, g.kernel.1, g.in_channels);
    let columns = rows.columns();
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
    // The last kernel row reads furthest: once it fits, every other one does.
    (0..kh).rev().all(|ki| {
        let b = &padded[rows.kernel_row(ki)..];
        T::tile_product(shape, spread, b, None, &mut gw[ki * kw * c_n..])
    })
}

/// The geometry of the input gradient as a convolution, where that is cheap: for unit
/// strides, `grad_x = conv(g, W')` with `W'[c, o, a, b] = W[o, c, kh−1−a, kw−1−b]`
/// ([`flipped_weights`]), the same dilation and padding `dilation·(k − 1) − padding` (which
/// gives back the input size). None when a stride is not 1, the padding is larger than the
/// dilated kernel (the new padding would be negative), or the convolution would do much more
/// work than the product it replaces (its output is the input, larger than the output by the
/// kernel's overhang where the padding is small).
pub(crate) fn transposed(g: &Geometry) -> Option<Geometry> {
    let span = |k: usize, d: usize| (k - 1) * d;
    let (sh, sw) = (
        span(g.kernel.0, g.dilation.0),
        span(g.kernel.1, g.dilation.1),
    );
    let small_overhang = 4 * g.in_h * g.in_w <= 5 * g.out_pixels();
    // Few input channels make the transposed product too narrow to be efficient.
    if g.in_channels < 8
        || g.stride != (1, 1)
        || g.padding.0 > sh
        || g.padding.1 > sw
        || !small_overhang
    {
        return None;
    }
    Some(Geometry {
        batch: g.batch,
        in_channels: g.out_channels,
        in_h: g.out_h,
        in_w: g.out_w,
        out_channels: g.in_channels,
        kernel: g.kernel,
        stride: (1, 1),
        padding: (sh - g.padding.0, sw - g.padding.1),
        dilation: g.dilation,
        out_h: g.in_h,
        out_w: g.in_w,
    })
}

/// `W'[c, o, a, b] = W[o, c, kh−1−a, kw−1−b]`: the weights of [`transposed`].
pub(crate) fn flipped_weights<T: FloatElement>(w: &[T], g: &Geometry) -> Vec<T> {
    let (kh, kw) = g.kernel;
    let (c_n, o_n) = (g.in_channels, g.out_channels);
    let mut out = alloc::uninit(w.len());
    let mut at = 0;
    for c in 0..c_n {
        for o in 0..o_n {
            for a in 0..kh {
                for b in 0..kw {
                    out[at] = w[((o * c_n + c) * kh + kh - 1 - a) * kw + kw - 1 - b];
                    at += 1;
                }
            }
        }
    }
    out
}

/// The sum of `values` over 16 independent partial sums: a single running sum would wait
/// for each addition to finish before the next (four cycles an element), and would not
/// vectorise.
fn plane_sum<T: FloatElement>(values: &[T]) -> T {
    let mut lanes = [T::ZERO; 16];
    let chunks = values.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &v)| *l += v);
    }
    tail.iter().zip(&mut lanes).for_each(|(&v, l)| *l += v);
    lanes.iter().fold(T::ZERO, |a, &l| a + l)
}

/// The elementwise sum of per-thread partial results.
fn sum_vectors<'a, T: FloatElement>(parts: impl Iterator<Item = &'a Vec<T>>, len: usize) -> Vec<T> {
    let mut total = alloc::zeroed(len);
    for part in parts {
        total.iter_mut().zip(part).for_each(|(t, &v)| *t += v);
    }
    total
}
