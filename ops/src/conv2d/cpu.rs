//! CPU kernels of conv2d: im2col + gemm forward, and a fused backward that rebuilds the
//! columns for the weight gradient and turns `Wᵀ·g` back into an input gradient (col2im), or,
//! with unit strides, computes that gradient as a forward convolution (see `transposed`).
//! Where `tile_product.rs` applies (f32, AVX-512) it replaces gemm for the forward and the
//! pixel-major weight-gradient products. At one rayon thread everything runs on the caller.
//!
//! The batch is split into one contiguous chunk per rayon thread; each chunk owns its column
//! buffer (per-thread scratch kept between calls) and its partial weight/bias gradients, which
//! are summed at the end, so no thread writes where another reads. Each sample's output pixels
//! are processed in tiles small enough that a tile's column matrix stays in cache from the
//! moment it is written to the moment gemm reads it: the columns are the largest data a
//! convolution touches (`C·kh·kw` times the input), and streaming them through memory costs as
//! much as the products themselves.

use std::cell::Cell;

use rayon::prelude::*;
use tandem_core::FloatElement;

use super::im2col::Im2col;
use super::pixel_rows::PixelRows;
use super::tile_product::{self, TileShape};
use crate::matmul::cpu::{gemm_into, MatRef};

/// Aim for a tile's column matrix of about this many elements (32 KiB of f32: L1-sized).
const TILE_ELEMENTS: usize = 8192;

/// Tiles are at least this many pixels wide: narrower products lose gemm efficiency.
const MIN_TILE_PIXELS: usize = 64;

/// Scratch buffers larger than this many elements are freed after use rather than kept.
const MAX_KEPT_SCRATCH: usize = 1 << 23;

/// Element types with per-thread scratch buffers: the column tile (slot 0) and the padded
/// channels-last sample (slot 1) are reused from call to call instead of being allocated (and
/// page-faulted in) each time.
pub(crate) trait ScratchElement: FloatElement {
    /// Takes the buffer of `slot` out of this thread's store (empty if none is kept).
    fn take_buffer(slot: usize) -> Vec<Self>;
    /// Returns a buffer to `slot`, keeping the larger of it and whatever is there.
    fn keep_buffer(slot: usize, buf: Vec<Self>);
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
}

macro_rules! scratch_element {
    ($t:ty, $store:ident $(, $tile:item)?) => {
        thread_local! {
            static $store: [Cell<Vec<$t>>; 2] = const { [Cell::new(Vec::new()), Cell::new(Vec::new())] };
        }
        impl ScratchElement for $t {
            fn take_buffer(slot: usize) -> Vec<Self> {
                $store.with(|s| s[slot].take())
            }
            fn keep_buffer(slot: usize, buf: Vec<Self>) {
                if buf.len() > MAX_KEPT_SCRATCH {
                    return;
                }
                $store.with(|s| {
                    let other = s[slot].take();
                    s[slot].set(if other.len() > buf.len() { other } else { buf });
                });
            }
            $($tile)?
        }
    };
}
scratch_element!(
    f32,
    SCRATCH_F32,
    fn tile_product(
        s: TileShape,
        wt: &[f32],
        cols: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) -> bool {
        tile_product::product(s, wt, cols, bias, out)
    }
);
scratch_element!(f64, SCRATCH_F64);

/// A scratch buffer of at least `len` elements (contents unspecified), returned to this
/// thread's store on drop. Taking it out of the store (rather than borrowing) keeps a nested
/// use on the same thread — rayon may run another task while gemm waits — from conflicting.
struct Scratch<T: ScratchElement> {
    slot: usize,
    buf: Vec<T>,
}

impl<T: ScratchElement> Scratch<T> {
    fn new(slot: usize, len: usize) -> Self {
        let mut buf = T::take_buffer(slot);
        if buf.len() < len {
            buf.resize(len, T::ZERO);
        }
        Scratch { slot, buf }
    }
}

impl<T: ScratchElement> Drop for Scratch<T> {
    fn drop(&mut self) {
        T::keep_buffer(self.slot, std::mem::take(&mut self.buf));
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
fn direct_kernel<T: ScratchElement>() -> bool {
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
/// `[N, O, OH, OW]` as a flat vector.
pub(crate) fn forward<T: ScratchElement>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
) -> Vec<T> {
    let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let mut out = vec![T::ZERO; g.batch * out_per];
    if out.is_empty() {
        return out;
    }
    let plan = Plan::new(g);
    let table = Im2col::new(g, plan.tile_width);
    let weights = MatRef::row_major(0, patch);
    // The register-blocked kernel reads the weights transposed, `[C·kh·kw, O]`.
    let direct = direct_kernel::<T>();
    let wt: Vec<T> = if direct {
        (0..patch * o_n)
            .map(|i| w[(i % o_n) * patch + i / o_n])
            .collect()
    } else {
        Vec::new()
    };
    let run_chunk = |ci: usize, out_chunk: &mut [T]| {
        let mut cols_buf = Scratch::<T>::new(0, patch * table.max_tile_width());
        let cols = &mut cols_buf.buf[..];
        for (s, dst) in out_chunk.chunks_mut(out_per).enumerate() {
            let xn = &x[(ci * plan.chunk + s) * in_per..][..in_per];
            if !direct {
                if let Some(b) = bias {
                    dst.chunks_mut(pixels).zip(b).for_each(|(p, &v)| p.fill(v));
                }
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
pub(crate) fn backward<T: ScratchElement>(
    x: &[T],
    w: &[T],
    gy: &[T],
    g: &Geometry,
    needs: Needs,
) -> Grads<T> {
    // With unit strides the input gradient is itself a convolution (see `transposed`), which
    // runs on the forward kernels and needs no col2im; it is computed after the loop below.
    let by_conv = needs.input.then(|| transposed(g)).flatten();
    let needs = Needs {
        input: needs.input && by_conv.is_none(),
        ..needs
    };
    let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let plan = Plan::new(g);
    let table = Im2col::new(g, plan.tile_width);
    // The weight gradient reads its columns pixel-major when that layout suits the geometry.
    let direct = direct_kernel::<T>();
    let pixel_rows = (needs.weight && PixelRows::suits(g)).then(|| PixelRows::new(g));
    let mut grad_x = if needs.input {
        vec![T::ZERO; g.batch * in_per]
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
        let mut gw = vec![T::ZERO; if needs.weight { o_n * patch } else { 0 }];
        let mut gb = vec![T::ZERO; if needs.bias { o_n } else { 0 }];
        let mut cols_buf = Scratch::<T>::new(0, patch * table.max_tile_width());
        let mut padded_buf =
            Scratch::<T>::new(1, pixel_rows.as_ref().map_or(0, |p| p.padded_len()));
        let cols = &mut cols_buf.buf[..];
        for s in 0..count {
            let xn = &x[(n0 + s) * in_per..][..in_per];
            let gn = &gy[(n0 + s) * out_per..][..out_per];
            if needs.bias {
                for (acc, plane) in gb.iter_mut().zip(gn.chunks(pixels)) {
                    *acc = plane.iter().fold(*acc, |a, &v| a + v);
                }
            }
            if let Some(rows) = &pixel_rows {
                rows.pad_channels_last(xn, &mut padded_buf.buf);
            }
            for t in 0..table.tile_count() {
                let (first, width) = table.tile(t);
                // This tile of g: [O, width] inside the sample's [O, OH·OW].
                let g_tile = MatRef {
                    offset: first,
                    rs: pixels,
                    cs: 1,
                };
                if let Some(rows) = &pixel_rows {
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
                } else if needs.weight {
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
                if let Some(gx) = gx_chunk.as_deref_mut() {
                    // The column buffer is free again: it now receives Wᵀ·g.
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
        grad_x = forward(gy, &flipped_weights(w, g), None, g2);
    }
    Grads {
        input: (needs.input || by_conv.is_some()).then_some(grad_x),
        weight: needs.weight.then(|| {
            let summed = sum_vectors(partials.iter().map(|p| &p.0), o_n * patch);
            match &pixel_rows {
                Some(rows) => rows.to_weight_order(&summed),
                None => {
                    // From [C·kh·kw, O] to [O, C·kh·kw].
                    let mut gw = vec![T::ZERO; o_n * patch];
                    for (r, row) in summed.chunks(o_n.max(1)).enumerate() {
                        row.iter()
                            .enumerate()
                            .for_each(|(o, &v)| gw[o * patch + r] = v);
                    }
                    gw
                }
            }
        }),
        bias: needs
            .bias
            .then(|| sum_vectors(partials.iter().map(|p| &p.1), o_n)),
    }
}

/// The geometry of the input gradient as a convolution, where that is cheap: for unit
/// strides, `grad_x = conv(g, W')` with `W'[c, o, a, b] = W[o, c, kh−1−a, kw−1−b]`
/// ([`flipped_weights`]), the same dilation and padding `dilation·(k − 1) − padding` (which
/// gives back the input size). None when a stride is not 1, the padding is larger than the
/// dilated kernel (the new padding would be negative), or the convolution would do much more
/// work than the product it replaces (its output is the input, larger than the output by the
/// kernel's overhang where the padding is small).
fn transposed(g: &Geometry) -> Option<Geometry> {
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
fn flipped_weights<T: FloatElement>(w: &[T], g: &Geometry) -> Vec<T> {
    let (kh, kw) = g.kernel;
    let (c_n, o_n) = (g.in_channels, g.out_channels);
    let mut out = Vec::with_capacity(w.len());
    for c in 0..c_n {
        for o in 0..o_n {
            for a in 0..kh {
                for b in 0..kw {
                    out.push(w[((o * c_n + c) * kh + kh - 1 - a) * kw + kw - 1 - b]);
                }
            }
        }
    }
    out
}

/// The elementwise sum of per-thread partial results.
fn sum_vectors<'a, T: FloatElement>(parts: impl Iterator<Item = &'a Vec<T>>, len: usize) -> Vec<T> {
    let mut total = vec![T::ZERO; len];
    for part in parts {
        total.iter_mut().zip(part).for_each(|(t, &v)| *t += v);
    }
    total
}
