//! The bf16 convolution on AMX tiles (`crate::cpu::amx`): forward, the input gradient (for
//! unit strides as a forward convolution of the output gradient with the flipped, transposed
//! weights) and the weight gradient. Every product is exact
//! and every sum f32 inside the tiles; each result is rounded once to bf16.
//!
//! **Forward.** Each sample is copied once into a zero-padded channels-last buffer whose
//! pixels hold `cp` channels (the channel count rounded up to the depth of one tile step, `kc`
//! ≤ 32 channels). Output pixels are taken 16 at a time (a *segment*, one tile's rows). The
//! input rows a segment needs for one kernel tap are then 16 equally spaced runs of `kc`
//! channels in that buffer — exactly what one strided tile load reads, so no patch matrix is
//! ever built. With unit strides the segments run over a virtual output grid as wide as the
//! padded input (`Wp`): consecutive virtual pixels are consecutive input pixels for every tap,
//! a segment may span output rows, and the `Wp − OW` virtual columns of each row are computed
//! and dropped (2 of 34 at 32×32). With other strides a segment stays within one output row.
//! The weights are packed once per call into the pair-interleaved tiles `tdpbf16ps` takes,
//! 16 output channels per block; a tile step is one tap and one chunk of `kc` channels.
//!
//! **Weight gradient.** `dW[o, c, a, b] = Σ dy[o, p] · x[c, p + tap(a, b)]` over the output
//! pixels `p` of every sample: per sample the padded input is laid out channel-major on the
//! same virtual grid (so one tap's operand is 16 channels × 32 consecutive virtual pixels, a
//! tile load), and the output gradient is packed once, pair-interleaved over virtual pixels,
//! zero in the dropped columns. Strided layers gather each tap's input values at the output
//! pixels instead, and their virtual grid is the output itself. Accumulator tiles `[16 channels × 16 output channels]` for
//! every tap and block pair live in a per-thread f32 buffer across samples; each thread takes
//! a contiguous range of samples and the partial sums are added in range order, so the result
//! does not depend on scheduling.
//!
//! **Input gradient of strided layers** ([`input_grad_scatter`]): the output gradient's pixel
//! tiles times each tap's weights, added into the input pixels the tap reached.

use std::arch::x86_64::*;

use rayon::prelude::*;
use tandem_core::half::bf16;
use tandem_core::{MemoryFormat, Result};

use crate::conv2d::shape::Geometry;
use crate::cpu::amx::{Amx, TileConfig, Tiles};
use crate::cpu::memory::{self, Scratch};
use crate::cpu::transpose16::transpose16;

/// The op named in allocation errors.
const OP: &str = "conv2d";
/// Rows of a tile: output pixels of a segment, channels of a block.
const ROWS: usize = 16;
/// Virtual pixels per step of the weight gradient (64 bytes of bf16 per tile row).
const VSTEP: usize = 32;

/// A dense `[N, C, H, W]` bf16 operand read in its storage order.
#[derive(Clone, Copy)]
pub(crate) struct Dense<'a> {
    pub values: &'a [bf16],
    pub format: MemoryFormat,
    /// `[N, C, H, W]`.
    pub dims: [usize; 4],
}

impl Dense<'_> {
    fn sample_len(&self) -> usize {
        self.dims[1] * self.dims[2] * self.dims[3]
    }

    /// Calls `f(c, h, w, value)` for every element of sample `n`, in storage order.
    fn for_each(&self, n: usize, mut f: impl FnMut(usize, usize, usize, bf16)) {
        let [_, c, h, w] = self.dims;
        let s = &self.values[n * self.sample_len()..(n + 1) * self.sample_len()];
        match self.format {
            MemoryFormat::ChannelsLast => {
                for (i, px) in s.chunks_exact(c.max(1)).enumerate() {
                    let (y, x) = (i / w, i % w);
                    px.iter().enumerate().for_each(|(ci, &v)| f(ci, y, x, v));
                }
            }
            MemoryFormat::Contiguous => {
                for (ci, plane) in s.chunks_exact((h * w).max(1)).enumerate() {
                    for (y, row) in plane.chunks_exact(w.max(1)).enumerate() {
                        row.iter().enumerate().for_each(|(x, &v)| f(ci, y, x, v));
                    }
                }
            }
        }
    }
}

/// The operands of one run of the tile product: up to 4 left operands (tile rows: output
/// pixels or input channels) and up to 2 right operands (16 output channels each); step `s`
/// reads the left ones at `a[i] + a_offsets[s]` and the right ones at `b[j] + s·b_step`.
struct Operands<'a> {
    a: [*const u8; 4],
    mb: usize,
    a_stride: usize,
    a_offsets: &'a [usize],
    b: [*const u8; 2],
    nb: usize,
    b_step: usize,
}

/// Right-operand tile rows are 64 bytes apart (16 pairs).
const B_STRIDE: usize = 64;

/// Runs `ops` on the tiles: accumulator `i·nb + j` (tile `i·nb + j`) gets `Σ_s A_i(s) · B_j(s)`.
/// Left operands go through tiles 4 and 5, right ones through 6 and 7.
///
/// # Safety
/// Every tile load of every step must stay inside the buffers the pointers come from (the
/// shapes are the configured ones), and `mb·nb ≤ 4`, `mb ≤ 4`, `nb ≤ 2`.
unsafe fn run(t: &Tiles, ops: &Operands) {
    let (a, b, st) = (ops.a, ops.b, ops.a_stride);
    for (s, &off) in ops.a_offsets.iter().enumerate() {
        let bo = s * ops.b_step;
        match (ops.mb, ops.nb) {
            (_, 1) => {
                t.load::<6>(b[0].add(bo), B_STRIDE);
                t.load::<4>(a[0].add(off), st);
                t.dot::<0, 4, 6>();
                if ops.mb > 1 {
                    t.load::<5>(a[1].add(off), st);
                    t.dot::<1, 5, 6>();
                }
                if ops.mb > 2 {
                    t.load::<4>(a[2].add(off), st);
                    t.dot::<2, 4, 6>();
                }
                if ops.mb > 3 {
                    t.load::<5>(a[3].add(off), st);
                    t.dot::<3, 5, 6>();
                }
            }
            (1, _) => {
                t.load::<4>(a[0].add(off), st);
                t.load::<6>(b[0].add(bo), B_STRIDE);
                t.load::<7>(b[1].add(bo), B_STRIDE);
                t.dot::<0, 4, 6>();
                t.dot::<1, 4, 7>();
            }
            _ => {
                t.load::<4>(a[0].add(off), st);
                t.load::<5>(a[1].add(off), st);
                t.load::<6>(b[0].add(bo), B_STRIDE);
                t.load::<7>(b[1].add(bo), B_STRIDE);
                t.dot::<0, 4, 6>();
                t.dot::<1, 4, 7>();
                t.dot::<2, 5, 6>();
                t.dot::<3, 5, 7>();
            }
        }
    }
}

/// Accumulator tile `i` from (`load`) or to (`store`) 16 rows of 16 f32 at `p`.
///
/// # Safety
/// `p` must point to 256 f32 (readable for `load`, writable for `store`).
unsafe fn acc(t: &Tiles, i: usize, p: *mut f32, store: bool) {
    let p8 = p.cast::<u8>();
    match (i, store) {
        (0, false) => t.load::<0>(p8, B_STRIDE),
        (1, false) => t.load::<1>(p8, B_STRIDE),
        (2, false) => t.load::<2>(p8, B_STRIDE),
        (3, false) => t.load::<3>(p8, B_STRIDE),
        (0, true) => t.store::<0>(p8, B_STRIDE),
        (1, true) => t.store::<1>(p8, B_STRIDE),
        (2, true) => t.store::<2>(p8, B_STRIDE),
        _ => t.store::<3>(p8, B_STRIDE),
    }
}

/// The four accumulators zeroed.
fn zero_accumulators(t: &Tiles) {
    t.zero::<0>();
    t.zero::<1>();
    t.zero::<2>();
    t.zero::<3>();
}

/// Left operands per run for `nb` right ones: 4 with one, 2 with two.
fn rows_per_run(nb: usize) -> usize {
    if nb == 1 {
        4
    } else {
        2
    }
}

/// `x` rounded up to a multiple of `m`.
fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// How a forward run walks its output pixels.
#[derive(Clone, Copy)]
enum Walk {
    /// Unit strides: segments over the virtual grid of width `Wp`.
    Virtual,
    /// Other strides: segments inside one output row.
    Rows,
}

/// The plan of a forward run: depths, padded sizes, tile steps and segments.
struct ForwardPlan {
    g: Geometry,
    /// Channels per tile step (even, ≤ 32) and per padded pixel (a multiple of `kc`).
    kc: usize,
    cp: usize,
    /// Padded input width and the padded sample buffer's length (with the slack the last
    /// segment's dropped rows read).
    wp: usize,
    buffer: usize,
    walk: Walk,
    /// Element offset of each step (tap, chunk) from a segment's base, and the same in bytes
    /// (what the tile loads take).
    offsets: Vec<usize>,
    offset_bytes: Vec<usize>,
    /// Each segment's first output pixel `(oh, ow)` (virtual `ow` may pass `OW`) and base.
    segments: Vec<((usize, usize), usize)>,
    /// Elements between a segment's rows.
    row_step: usize,
    blocks: usize,
}

impl ForwardPlan {
    fn new(g: &Geometry) -> ForwardPlan {
        let kc = round_up(g.in_channels, 2).min(32);
        let cp = round_up(g.in_channels, kc);
        let (hp, wp) = (g.in_h + 2 * g.padding.0, g.in_w + 2 * g.padding.1);
        let (kh, kw) = g.kernel;
        let mut offsets = Vec::with_capacity(kh * kw * (cp / kc));
        for a in 0..kh {
            for b in 0..kw {
                for q in 0..cp / kc {
                    offsets.push((a * g.dilation.0 * wp + b * g.dilation.1) * cp + q * kc);
                }
            }
        }
        let (walk, row_step, segments) = if g.stride == (1, 1) {
            let last = (g.out_h - 1) * wp + g.out_w;
            let segs = (0..last)
                .step_by(ROWS)
                .map(|v| ((v / wp, v % wp), v * cp))
                .collect();
            (Walk::Virtual, cp, segs)
        } else {
            let mut segs = Vec::new();
            for oh in 0..g.out_h {
                for ow in (0..g.out_w).step_by(ROWS) {
                    segs.push(((oh, ow), (oh * g.stride.0 * wp + ow * g.stride.1) * cp));
                }
            }
            (Walk::Rows, g.stride.1 * cp, segs)
        };
        let last_base = segments.last().map_or(0, |s| s.1);
        let reach = last_base + (ROWS - 1) * row_step + offsets.last().copied().unwrap_or(0) + kc;
        ForwardPlan {
            g: *g,
            kc,
            cp,
            wp,
            buffer: (hp * wp * cp).max(reach),
            walk,
            offset_bytes: offsets.iter().map(|&e| e * 2).collect(),
            offsets,
            segments,
            row_step,
            blocks: g.out_channels.div_ceil(ROWS),
        }
    }

    fn config(&self) -> TileConfig {
        let mut c = TileConfig::new();
        for t in 0..4 {
            c = c.tile(t, ROWS, 64);
        }
        c.tile(4, ROWS, self.kc * 2)
            .tile(5, ROWS, self.kc * 2)
            .tile(6, self.kc / 2, 64)
            .tile(7, self.kc / 2, 64)
    }

    /// The output pixel of row `r` of the segment starting at `(oh, ow)`, if it is a real one.
    fn pixel(&self, (oh, ow): (usize, usize), r: usize) -> Option<usize> {
        let (oh, ow) = match self.walk {
            Walk::Virtual => {
                let v = oh * self.wp + ow + r;
                (v / self.wp, v % self.wp)
            }
            Walk::Rows => (oh, ow + r),
        };
        (oh < self.g.out_h && ow < self.g.out_w).then_some(oh * self.g.out_w + ow)
    }

    /// The weights as right-operand tiles: block `j`, step `s` (tap, chunk) holds `kc / 2`
    /// rows of 16 pairs, `w(o, c, a, b)` giving the weight (zeros past `O` and `C`).
    fn pack(&self, w: &impl Fn(usize, usize, usize, usize) -> bf16) -> Result<Scratch<bf16>> {
        let g = &self.g;
        let (kh, kw) = g.kernel;
        let steps = self.offsets.len();
        let tile = self.kc * ROWS;
        let mut scratch = Scratch::zeroed(OP, self.blocks * steps * tile)?;
        let packed = &mut scratch.buf;
        for j in 0..self.blocks {
            for o in j * ROWS..((j + 1) * ROWS).min(g.out_channels) {
                for a in 0..kh {
                    for b in 0..kw {
                        for c in 0..g.in_channels {
                            let s = (a * kw + b) * (self.cp / self.kc) + c / self.kc;
                            let k = c % self.kc;
                            let at = (j * steps + s) * tile + (k / 2) * 32 + (o % ROWS) * 2 + k % 2;
                            packed[at] = w(o, c, a, b);
                        }
                    }
                }
            }
        }
        Ok(scratch)
    }
}

/// Copies sample `n` of `x` into `buf`: zero-padded by `pad`, channels-last with `cp` channels
/// per pixel and rows `wp` pixels long. `buf` starts zeroed; every sample writes the same
/// positions, so the padding stays zero without clearing it again.
fn pad_channels_last(
    x: &Dense,
    n: usize,
    pad: (usize, usize),
    wp: usize,
    cp: usize,
    buf: &mut [bf16],
) {
    let [_, c, _, w] = x.dims;
    if x.format == MemoryFormat::ChannelsLast && cp == c {
        let s = &x.values[n * x.sample_len()..(n + 1) * x.sample_len()];
        for (y, row) in s.chunks_exact((w * c).max(1)).enumerate() {
            let at = ((y + pad.0) * wp + pad.1) * cp;
            buf[at..at + w * c].copy_from_slice(row);
        }
        return;
    }
    x.for_each(n, |ci, y, xx, v| {
        buf[((y + pad.0) * wp + xx + pad.1) * cp + ci] = v
    });
}

/// Rounds `acc + bias` to bf16 into `dst` (at most 16 values).
fn round_into(acc: &[f32], bias: &[f32], dst: &mut [bf16]) {
    for ((d, &a), &b) in dst.iter_mut().zip(acc).zip(bias) {
        *d = bf16::from_f32(a + b);
    }
}

/// [`round_into`] for a full row of 16 with AVX512-BF16 (round to nearest even, as
/// `bf16::from_f32`).
///
/// # Safety
/// The CPU must have AVX-512F and AVX512-BF16 (an [`Amx`] proves it); `acc`, `bias` and `dst`
/// must hold 16 values.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn round_into16(acc: &[f32], bias: &[f32], dst: &mut [bf16]) {
    let v = _mm512_add_ps(
        _mm512_loadu_ps(acc.as_ptr()),
        _mm512_loadu_ps(bias.as_ptr()),
    );
    let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
    _mm256_storeu_si256(dst.as_mut_ptr().cast(), h);
}

/// A forward convolution on AMX: `x` `[N, C, H, W]` (either dense format), the weights
/// through `w(o, c, a, b)`, an optional f32 bias; the output `[N, O, OH, OW]` as bf16 values
/// in `out_format`'s storage order.
pub(crate) fn forward(
    amx: Amx,
    x: Dense,
    g: &Geometry,
    w: &(impl Fn(usize, usize, usize, usize) -> bf16 + Sync),
    bias: Option<&[f32]>,
    out_format: MemoryFormat,
) -> Result<Vec<bf16>> {
    let plan = ForwardPlan::new(g);
    let packed = plan.pack(w)?;
    let (o, pixels) = (g.out_channels, g.out_pixels());
    let mut out = memory::uninit::<bf16>(OP, g.batch * pixels * o)?;
    if out.is_empty() {
        return Ok(out);
    }
    let mut bias16 = vec![0f32; plan.blocks * ROWS];
    if let Some(b) = bias {
        bias16[..o].copy_from_slice(b);
    }
    let config = plan.config();
    let run_sample = |buf: &mut Scratch<bf16>, (n, out): (usize, &mut [bf16])| {
        pad_channels_last(&x, n, g.padding, plan.wp, plan.cp, &mut buf.buf);
        forward_sample(
            amx,
            &plan,
            &config,
            &buf.buf,
            &packed.buf,
            &bias16,
            out_format,
            out,
        );
    };
    per_sample(
        &mut out,
        pixels * o,
        || Scratch::zeroed(OP, plan.buffer),
        run_sample,
    )?;
    Ok(out)
}

/// Runs `f(scratch, (n, chunk))` for each sample's `chunk` of `out` (`len` values each): on the
/// rayon pool when there are several threads and samples, each worker with its own scratch
/// from `init`, else on the caller with one.
fn per_sample<S: Send>(
    out: &mut [bf16],
    len: usize,
    init: impl Fn() -> Result<S> + Sync + Send,
    f: impl Fn(&mut S, (usize, &mut [bf16])) + Sync + Send,
) -> Result<()> {
    if rayon::current_num_threads() > 1 && out.len() > len {
        out.par_chunks_mut(len).enumerate().try_for_each_init(
            || init().map(Some),
            |scratch, item| {
                match scratch {
                    Ok(Some(s)) => f(s, item),
                    // The worker's scratch could not be made: hand its error on once.
                    Ok(None) => {}
                    Err(_) => return std::mem::replace(scratch, Ok(None)).map(|_| ()),
                }
                Ok(())
            },
        )
    } else {
        let mut scratch = init()?;
        out.chunks_mut(len)
            .enumerate()
            .for_each(|item| f(&mut scratch, item));
        Ok(())
    }
}

/// One sample of [`forward`]: `xp` the padded channels-last input, `out` the sample's output.
#[allow(clippy::too_many_arguments)]
fn forward_sample(
    amx: Amx,
    plan: &ForwardPlan,
    config: &TileConfig,
    xp: &[bf16],
    packed: &[bf16],
    bias: &[f32],
    out_format: MemoryFormat,
    out: &mut [bf16],
) {
    let tiles = Tiles::configure(amx, config);
    let steps = plan.offsets.len();
    let mut accs = [[0f32; 256]; 4];
    for j0 in (0..plan.blocks).step_by(2) {
        let nb = (plan.blocks - j0).min(2);
        let mb = rows_per_run(nb);
        let b_of = |j: usize| {
            packed[(j0 + j.min(nb - 1)) * steps * plan.kc * ROWS..]
                .as_ptr()
                .cast()
        };
        for group in plan.segments.chunks(mb) {
            let a_of = |i: usize| xp[group[i.min(group.len() - 1)].1..].as_ptr().cast::<u8>();
            let ops = Operands {
                a: [a_of(0), a_of(1), a_of(2), a_of(3)],
                mb: group.len(),
                a_stride: plan.row_step * 2,
                a_offsets: &plan.offset_bytes,
                b: [b_of(0), b_of(1)],
                nb,
                b_step: plan.kc * ROWS * 2,
            };
            zero_accumulators(&tiles);
            // SAFETY: the plan's buffer length covers the last segment's last row at the
            // last step (`ForwardPlan::new`'s reach), and each block holds `steps` tiles of
            // `kc / 2` rows of 64 bytes.
            unsafe {
                run(&tiles, &ops);
                for (i, a) in accs.iter_mut().enumerate().take(group.len() * nb) {
                    acc(&tiles, i, a.as_mut_ptr(), true);
                }
            }
            for (i, seg) in group.iter().enumerate() {
                for j in 0..nb {
                    let tile = &accs[i * nb + j];
                    write_tile(amx, plan, seg.0, j0 + j, tile, bias, out_format, out);
                }
            }
        }
    }
}

/// Writes accumulator `tile` (segment at `start` × output block `j`) plus the bias to the
/// sample's output, dropping the virtual rows.
#[allow(clippy::too_many_arguments)]
fn write_tile(
    _amx: Amx,
    plan: &ForwardPlan,
    start: (usize, usize),
    j: usize,
    tile: &[f32; 256],
    bias: &[f32],
    format: MemoryFormat,
    out: &mut [bf16],
) {
    let o = plan.g.out_channels;
    let (lo, hi) = (j * ROWS, ((j + 1) * ROWS).min(o));
    let bias = &bias[lo..lo + ROWS];
    let pixels = plan.g.out_pixels();
    for r in 0..ROWS {
        let Some(p) = plan.pixel(start, r) else {
            continue;
        };
        let row = &tile[r * ROWS..(r + 1) * ROWS];
        match format {
            MemoryFormat::ChannelsLast if hi - lo == ROWS => {
                // SAFETY: `_amx` proves AVX-512F and AVX512-BF16; all three hold 16 values.
                unsafe { round_into16(row, bias, &mut out[p * o + lo..p * o + hi]) }
            }
            MemoryFormat::ChannelsLast => round_into(row, bias, &mut out[p * o + lo..p * o + hi]),
            MemoryFormat::Contiguous => {
                for k in 0..hi - lo {
                    out[(lo + k) * pixels + p] = bf16::from_f32(row[k] + bias[k]);
                }
            }
        }
    }
}

/// The input gradient of any layer on AMX, as a product and a scatter: each tile of 16 output
/// pixels of `dy` (channels-last, `ko` output channels per step) times the weights of one tap
/// and 16 input channels gives those pixels' contributions to 16 channels of the input pixels
/// that tap reached, which are added into an f32 copy of the sample's input gradient; the sum
/// is rounded once to bf16 in `out_format`'s order. `w` is the row-major `[O, C, kh, kw]`
/// weight. (Unit-stride layers take the cheaper [`forward`] of the flipped weights instead:
/// `Geometry::input_gradient_as_forward`.)
pub(crate) fn input_grad_scatter(
    amx: Amx,
    dy: Dense,
    g: &Geometry,
    w: &[bf16],
    out_format: MemoryFormat,
) -> Result<Vec<bf16>> {
    let (o, c, (kh, kw)) = (g.out_channels, g.in_channels, g.kernel);
    let ko = round_up(o, 2).min(32);
    let op = round_up(o, ko);
    let chunks = op / ko;
    let cblocks = c.div_ceil(ROWS);
    let nblocks = kh * kw * cblocks;
    let tile = ko * ROWS;
    // Right operands: block (tap, channel block), step (output-channel chunk).
    let mut scratch = Scratch::zeroed(OP, nblocks * chunks * tile)?;
    let packed = &mut scratch.buf;
    for t in 0..kh * kw {
        for ci in 0..c {
            let j = t * cblocks + ci / ROWS;
            for oi in 0..o {
                let (q, k) = (oi / ko, oi % ko);
                let at = (j * chunks + q) * tile + (k / 2) * 32 + (ci % ROWS) * 2 + k % 2;
                packed[at] = w[(oi * c + ci) * kh * kw + t];
            }
        }
    }
    let pixels = g.out_pixels();
    let in_sample = c * g.in_h * g.in_w;
    let mut out = memory::uninit::<bf16>(OP, g.batch * in_sample)?;
    if out.is_empty() {
        return Ok(out);
    }
    let config = TileConfig::new()
        .tile(0, ROWS, 64)
        .tile(1, ROWS, 64)
        .tile(2, ROWS, 64)
        .tile(3, ROWS, 64)
        .tile(4, ROWS, ko * 2)
        .tile(5, ROWS, ko * 2)
        .tile(6, ko / 2, 64)
        .tile(7, ko / 2, 64);
    let offsets: Vec<usize> = (0..chunks).map(|q| q * ko * 2).collect();
    let scatter = Scatter {
        g,
        cblocks,
        packed: &scratch.buf,
        chunks,
        ko,
        op,
        offsets: &offsets,
    };
    let init = || -> Result<(Scratch<bf16>, Scratch<f32>)> {
        Ok((
            Scratch::zeroed(OP, (pixels + ROWS) * op)?,
            Scratch::zeroed(OP, in_sample)?,
        ))
    };
    let run_sample = |bufs: &mut (Scratch<bf16>, Scratch<f32>), (n, out): (usize, &mut [bf16])| {
        let (dyp, dx) = (&mut bufs.0.buf, &mut bufs.1.buf);
        pad_channels_last(&dy, n, (0, 0), g.out_w, op, dyp);
        dx.fill(0.0);
        let tiles = Tiles::configure(amx, &config);
        scatter.sample(&tiles, dyp, dx);
        drop(tiles);
        store_sample(dx, [c, g.in_h, g.in_w], out_format, out);
    };
    per_sample(&mut out, in_sample, init, run_sample)?;
    Ok(out)
}

/// The fixed operands of [`input_grad_scatter`].
struct Scatter<'a> {
    g: &'a Geometry,
    cblocks: usize,
    packed: &'a [bf16],
    chunks: usize,
    ko: usize,
    /// Channels per pixel of the output-gradient buffer.
    op: usize,
    offsets: &'a [usize],
}

impl Scatter<'_> {
    /// One sample: `dyp` its output gradient (channels-last, `op` per pixel, 16 rows of
    /// slack), `dx` its input gradient (f32, channels-last) to add into.
    fn sample(&self, tiles: &Tiles, dyp: &[bf16], dx: &mut [f32]) {
        let g = self.g;
        let pixels = g.out_pixels();
        let nblocks = g.kernel.0 * g.kernel.1 * self.cblocks;
        let segments: Vec<usize> = (0..pixels).step_by(ROWS).collect();
        let mut accs = [[0f32; 256]; 4];
        for j0 in (0..nblocks).step_by(2) {
            let nb = (nblocks - j0).min(2);
            let mb = rows_per_run(nb);
            let b_of = |j: usize| {
                self.packed[(j0 + j.min(nb - 1)) * self.chunks * self.ko * ROWS..]
                    .as_ptr()
                    .cast()
            };
            for group in segments.chunks(mb) {
                let a_of = |i: usize| {
                    dyp[group[i.min(group.len() - 1)] * self.op..]
                        .as_ptr()
                        .cast()
                };
                let ops = Operands {
                    a: [a_of(0), a_of(1), a_of(2), a_of(3)],
                    mb: group.len(),
                    a_stride: self.op * 2,
                    a_offsets: self.offsets,
                    b: [b_of(0), b_of(1)],
                    nb,
                    b_step: self.ko * ROWS * 2,
                };
                zero_accumulators(tiles);
                // SAFETY: `dyp` has 16 rows of slack past the last pixel, so every segment's
                // 16 rows of `op` channels are inside; each right block holds `chunks` tiles.
                unsafe {
                    run(tiles, &ops);
                    for (i, a) in accs.iter_mut().enumerate().take(group.len() * nb) {
                        acc(tiles, i, a.as_mut_ptr(), true);
                    }
                }
                for (i, &p0) in group.iter().enumerate() {
                    for j in 0..nb {
                        self.add_tile(&accs[i * nb + j], p0, j0 + j, dx);
                    }
                }
            }
        }
    }

    /// Adds accumulator `tile` (output pixels `p0..p0 + 16` × block `j` = (tap, channel
    /// block)) into the input pixels the tap reaches.
    fn add_tile(&self, tile: &[f32; 256], p0: usize, j: usize, dx: &mut [f32]) {
        let g = self.g;
        let c = g.in_channels;
        let (t, cb) = (j / self.cblocks, j % self.cblocks);
        let (a, b) = (t / g.kernel.1, t % g.kernel.1);
        let (lo, hi) = (cb * ROWS, ((cb + 1) * ROWS).min(c));
        for r in 0..ROWS.min(g.out_pixels() - p0) {
            let (oh, ow) = ((p0 + r) / g.out_w, (p0 + r) % g.out_w);
            let y = (oh * g.stride.0 + a * g.dilation.0).wrapping_sub(g.padding.0);
            let x = (ow * g.stride.1 + b * g.dilation.1).wrapping_sub(g.padding.1);
            if y >= g.in_h || x >= g.in_w {
                continue;
            }
            let at = (y * g.in_w + x) * c;
            let row = &tile[r * ROWS..r * ROWS + hi - lo];
            dx[at + lo..at + hi]
                .iter_mut()
                .zip(row)
                .for_each(|(d, &v)| *d += v);
        }
    }
}

/// A sample's f32 channels-last `values` (`[h, w, c]`) rounded to bf16 into `out` in
/// `format`'s order.
fn store_sample(values: &[f32], [c, h, w]: [usize; 3], format: MemoryFormat, out: &mut [bf16]) {
    match format {
        MemoryFormat::ChannelsLast => {
            out.iter_mut()
                .zip(values)
                .for_each(|(o, &v)| *o = bf16::from_f32(v));
        }
        MemoryFormat::Contiguous => {
            for (p, px) in values.chunks_exact(c.max(1)).enumerate() {
                for (ci, &v) in px.iter().enumerate() {
                    out[ci * h * w + p] = bf16::from_f32(v);
                }
            }
        }
    }
}

/// The plan of a weight-gradient run.
///
/// Unit strides use the virtual grid (a tap is an offset into one padded channel-major
/// copy). Other strides gather, per sample, every tap's input values at the output pixels
/// (`taps` blocks of `cblocks·16` rows of `row` values; a tap's offset is its block), and the
/// virtual grid is then the output itself.
struct WeightPlan {
    g: Geometry,
    wp: usize,
    /// Virtual pixels per sample, a multiple of [`VSTEP`], and the channel-major row length.
    vpad: usize,
    row: usize,
    cblocks: usize,
    oblocks: usize,
    taps: Vec<usize>,
    gathered: bool,
    /// Byte offset of each step (32 virtual pixels) along a left operand's rows.
    offsets: Vec<usize>,
    /// Left operands: (tap, channel block) pairs; their accumulators are per output block.
    lefts: Vec<(usize, usize)>,
}

impl WeightPlan {
    fn new(g: &Geometry) -> WeightPlan {
        let (kh, kw) = g.kernel;
        let cblocks = g.in_channels.div_ceil(ROWS);
        let gathered = g.stride != (1, 1);
        let wp = if gathered {
            g.out_w
        } else {
            g.in_w + 2 * g.padding.1
        };
        let vpad = round_up(g.out_h * wp, VSTEP);
        let (taps, row): (Vec<usize>, usize) = if gathered {
            (
                (0..kh * kw).map(|t| t * cblocks * ROWS * vpad).collect(),
                vpad,
            )
        } else {
            let taps: Vec<usize> = (0..kh * kw)
                .map(|t| (t / kw) * g.dilation.0 * wp + (t % kw) * g.dilation.1)
                .collect();
            let hp = g.in_h + 2 * g.padding.0;
            let row = (hp * wp).max(vpad + taps.last().copied().unwrap_or(0));
            (taps, row)
        };
        WeightPlan {
            g: *g,
            wp,
            vpad,
            row,
            cblocks,
            oblocks: g.out_channels.div_ceil(ROWS),
            offsets: (0..vpad / VSTEP).map(|s| s * VSTEP * 2).collect(),
            lefts: (0..taps.len())
                .flat_map(|t| (0..cblocks).map(move |cb| (t, cb)))
                .collect(),
            taps,
            gathered,
        }
    }

    /// Accumulator tiles: one per (tap, channel block, output block).
    fn tiles(&self) -> usize {
        self.taps.len() * self.cblocks * self.oblocks
    }

    /// Length of the per-sample input buffer.
    fn input_len(&self) -> usize {
        let blocks = if self.gathered { self.taps.len() } else { 1 };
        blocks * self.cblocks * ROWS * self.row
    }

    /// Sample `n`'s input, channel-major: padded over the virtual grid (unit strides), or
    /// each tap's values at the output pixels (zeros outside the image).
    /// `buf` starts zeroed; every sample writes the same positions, so the padding and the
    /// dropped pixels stay zero without clearing it again.
    fn input(&self, _amx: Amx, x: &Dense, n: usize, buf: &mut [bf16]) {
        let g = &self.g;
        let (ph, pw) = g.padding;
        if !self.gathered {
            let (c, w) = (x.dims[1], x.dims[3]);
            if x.format == MemoryFormat::ChannelsLast && c > 0 && w > 0 {
                let sample = &x.values[n * x.sample_len()..(n + 1) * x.sample_len()];
                for (y, row) in sample.chunks_exact(w * c).enumerate() {
                    let at = (y + ph) * self.wp + pw;
                    // Whole 16-pixel × 16-channel blocks by the vector transpose, the rest
                    // (narrow images, odd channel counts) value by value.
                    let (wb, cb) = (w / ROWS * ROWS, c / ROWS * ROWS);
                    for x0 in (0..wb).step_by(ROWS) {
                        for c0 in (0..cb).step_by(ROWS) {
                            let src = row[x0 * c + c0..].as_ptr().cast::<u16>();
                            let dst = buf[c0 * self.row + at + x0..]
                                [..(ROWS - 1) * self.row + ROWS]
                                .as_mut_ptr()
                                .cast::<u16>();
                            // SAFETY: `_amx` proves AVX-512F/BW; the block's 16 source rows
                            // (pixels `x0..x0 + 16` of this image row, channels `c0..c0 + 16`)
                            // and 16 destination rows (channels, `row` apart, 16 values from
                            // `at + x0`) are inside `row` and `buf`.
                            unsafe { transpose16(src, c, dst, self.row) };
                        }
                    }
                    for (ci, dst) in buf.chunks_exact_mut(self.row).take(c).enumerate() {
                        if ci < cb {
                            // Only the pixels past the whole blocks are left.
                            if wb == w {
                                continue;
                            }
                            let dst = &mut dst[at + wb..at + w];
                            dst.iter_mut()
                                .zip(row[wb * c + ci..].iter().step_by(c))
                                .for_each(|(d, &v)| *d = v);
                            continue;
                        }
                        let dst = &mut dst[at..at + w];
                        dst.iter_mut()
                            .zip(row[ci..].iter().step_by(c))
                            .for_each(|(d, &v)| *d = v);
                    }
                }
                return;
            }
            x.for_each(n, |c, y, xx, v| {
                buf[c * self.row + (y + ph) * self.wp + xx + pw] = v
            });
            return;
        }
        let (kh, kw) = g.kernel;
        let block = self.cblocks * ROWS * self.row;
        let sample = &x.values[n * x.sample_len()..(n + 1) * x.sample_len()];
        let (c, h, w) = (x.dims[1], x.dims[2], x.dims[3]);
        // Strides of (channel, row, column) in the sample's storage.
        let (sc, sy, sx) = match x.format {
            MemoryFormat::ChannelsLast => (1, w * c, c),
            MemoryFormat::Contiguous => (h * w, w, 1),
        };
        for (t, tap) in buf.chunks_exact_mut(block).take(kh * kw).enumerate() {
            let (a, b) = (t / kw, t % kw);
            for oh in 0..g.out_h {
                let y = (oh * g.stride.0 + a * g.dilation.0).wrapping_sub(ph);
                if y >= h {
                    continue;
                }
                for ow in 0..g.out_w {
                    let xx = (ow * g.stride.1 + b * g.dilation.1).wrapping_sub(pw);
                    if xx >= w {
                        continue;
                    }
                    let (from, to) = (y * sy + xx * sx, oh * self.wp + ow);
                    for ci in 0..c {
                        tap[ci * self.row + to] = sample[from + ci * sc];
                    }
                }
            }
        }
    }

    /// Sample `n`'s output gradient as right-operand tiles: block `j` holds `vpad / 2` rows of
    /// 16 pairs of consecutive virtual pixels (zeros at dropped pixels).
    /// `buf` starts zeroed and the same positions are written for every sample (as
    /// [`WeightPlan::input`]).
    fn grad(&self, _amx: Amx, dy: &Dense, n: usize, buf: &mut [bf16]) {
        let half = self.vpad / 2;
        let (o, w) = (dy.dims[1], dy.dims[3]);
        if dy.format == MemoryFormat::ChannelsLast && o > 0 && w > 0 {
            let sample = &dy.values[n * dy.sample_len()..(n + 1) * dy.sample_len()];
            let virt = |p: usize| (p / w) * self.wp + p % w;
            let mut p = 0;
            while p < sample.len() / o {
                let vp = virt(p);
                // Two real pixels that make one pair: their 16-channel runs interleave into
                // one 64-byte row of every whole block with one permute each.
                if vp % 2 == 0 && p + 1 < sample.len() / o && virt(p + 1) == vp + 1 {
                    let (a, b) = (
                        &sample[p * o..(p + 1) * o],
                        &sample[(p + 1) * o..(p + 2) * o],
                    );
                    for j in 0..o / ROWS {
                        let at = (j * half + vp / 2) * 32;
                        let dst = &mut buf[at..at + 32];
                        let (a, b) = (&a[j * ROWS..(j + 1) * ROWS], &b[j * ROWS..(j + 1) * ROWS]);
                        // SAFETY: `_amx` proves AVX-512F/BW; `a` and `b` hold 16 values and
                        // `dst` 32.
                        unsafe { interleave16(a, b, dst) };
                    }
                    for (k, (&va, &vb)) in a.iter().zip(b).enumerate().skip(o / ROWS * ROWS) {
                        let at = ((k / ROWS) * half + vp / 2) * 32 + (k % ROWS) * 2;
                        buf[at] = va;
                        buf[at + 1] = vb;
                    }
                    p += 2;
                    continue;
                }
                for (k, &v) in sample[p * o..(p + 1) * o].iter().enumerate() {
                    buf[((k / ROWS) * half + vp / 2) * 32 + (k % ROWS) * 2 + vp % 2] = v;
                }
                p += 1;
            }
            return;
        }
        dy.for_each(n, |o, y, xx, v| {
            let vp = y * self.wp + xx;
            buf[((o / ROWS) * half + vp / 2) * 32 + (o % ROWS) * 2 + vp % 2] = v;
        });
    }
}

/// `dst = [a0, b0, a1, b1, …, a15, b15]`: two pixels' 16-channel runs as one row of pairs.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW; `a` and `b` must hold 16 values, `dst` 32.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn interleave16(a: &[bf16], b: &[bf16], dst: &mut [bf16]) {
    const PAIRS: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut k = 0;
        while k < 16 {
            idx[2 * k] = k as u16;
            idx[2 * k + 1] = 32 + k as u16;
            k += 1;
        }
        idx
    };
    let va = _mm512_castsi256_si512(_mm256_loadu_si256(a.as_ptr().cast()));
    let vb = _mm512_castsi256_si512(_mm256_loadu_si256(b.as_ptr().cast()));
    let idx = _mm512_loadu_si512(PAIRS.as_ptr().cast());
    _mm512_storeu_si512(
        dst.as_mut_ptr().cast(),
        _mm512_permutex2var_epi16(va, idx, vb),
    );
}

/// The weight gradient of a convolution on AMX: `x` `[N, C, H, W]`, `dy`
/// `[N, O, OH, OW]` (either dense format); the result `[O, C, kh, kw]` in f32, row-major.
pub(crate) fn weight_grad(amx: Amx, x: Dense, dy: Dense, g: &Geometry) -> Result<Vec<f32>> {
    let plan = WeightPlan::new(g);
    let threads = rayon::current_num_threads().clamp(1, g.batch.max(1));
    let per = g.batch.div_ceil(threads).max(1);
    let ranges: Vec<(usize, usize)> = (0..g.batch)
        .step_by(per)
        .map(|n0| (n0, (n0 + per).min(g.batch)))
        .collect();
    let part = |&(n0, n1): &(usize, usize)| -> Result<Scratch<f32>> {
        let mut sums = Scratch::<f32>::zeroed(OP, plan.tiles() * 256)?;
        let mut xt = Scratch::<bf16>::zeroed(OP, plan.input_len())?;
        let mut dyp = Scratch::<bf16>::zeroed(OP, plan.oblocks * plan.vpad * ROWS)?;
        let (xt, dyp) = (&mut xt.buf, &mut dyp.buf);
        for n in n0..n1 {
            plan.input(amx, &x, n, xt);
            plan.grad(amx, &dy, n, dyp);
            weight_grad_sample(amx, &plan, xt, dyp, &mut sums.buf);
        }
        Ok(sums)
    };
    let parts: Vec<Scratch<f32>> = if ranges.len() > 1 {
        ranges.par_iter().map(part).collect::<Result<_>>()?
    } else {
        ranges.iter().map(part).collect::<Result<_>>()?
    };
    let mut total = Scratch::<f32>::zeroed(OP, plan.tiles() * 256)?;
    for p in &parts {
        total.buf.iter_mut().zip(&p.buf).for_each(|(t, &v)| *t += v);
    }
    let total = &total.buf;
    let (c, o, taps) = (g.in_channels, g.out_channels, plan.taps.len());
    let mut dw = memory::zeroed::<f32>(OP, o * c * taps)?;
    for (t, cb, ob) in (0..taps).flat_map(|t| {
        (0..plan.cblocks).flat_map(move |cb| (0..plan.oblocks).map(move |ob| (t, cb, ob)))
    }) {
        let tile = &total[((t * plan.cblocks + cb) * plan.oblocks + ob) * 256..][..256];
        for ci in cb * ROWS..((cb + 1) * ROWS).min(c) {
            for oi in ob * ROWS..((ob + 1) * ROWS).min(o) {
                dw[(oi * c + ci) * taps + t] = tile[(ci % ROWS) * ROWS + oi % ROWS];
            }
        }
    }
    Ok(dw)
}

/// One sample of [`weight_grad`]: adds its products to the accumulator tiles in `sums`.
fn weight_grad_sample(amx: Amx, plan: &WeightPlan, xt: &[bf16], dyp: &[bf16], sums: &mut [f32]) {
    // Every tile is 16 rows of 64 bytes here.
    const CONFIG: TileConfig = TileConfig::uniform(ROWS as u8, 64);
    let tiles = Tiles::configure(amx, &CONFIG);
    for j0 in (0..plan.oblocks).step_by(2) {
        let nb = (plan.oblocks - j0).min(2);
        let mb = rows_per_run(nb);
        let b_of = |j: usize| {
            dyp[(j0 + j.min(nb - 1)) * plan.vpad * ROWS..]
                .as_ptr()
                .cast()
        };
        for group in plan.lefts.chunks(mb) {
            let a_of = |i: usize| {
                let (t, cb) = group[i.min(group.len() - 1)];
                xt[cb * ROWS * plan.row + plan.taps[t]..]
                    .as_ptr()
                    .cast::<u8>()
            };
            let ops = Operands {
                a: [a_of(0), a_of(1), a_of(2), a_of(3)],
                mb: group.len(),
                a_stride: plan.row * 2,
                a_offsets: &plan.offsets,
                b: [b_of(0), b_of(1)],
                nb,
                b_step: B_STRIDE * ROWS,
            };
            let at = |i: usize, j: usize| {
                let (t, cb) = group[i];
                ((t * plan.cblocks + cb) * plan.oblocks + j0 + j) * 256
            };
            // SAFETY: every left operand's rows are `row` values long and start at most
            // `taps.last()` in, so `vpad` more values (the last step's end) stay inside the
            // row (`WeightPlan::new`); each right block holds `vpad / 2` rows of 64 bytes;
            // `sums` holds every accumulator tile.
            unsafe {
                for i in 0..group.len() {
                    for j in 0..nb {
                        acc(&tiles, i * nb + j, sums[at(i, j)..].as_mut_ptr(), false);
                    }
                }
                run(&tiles, &ops);
                for i in 0..group.len() {
                    for j in 0..nb {
                        acc(&tiles, i * nb + j, sums[at(i, j)..].as_mut_ptr(), true);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv2d::shape::Conv2dParams;
    use tandem_core::Generator;

    /// A layer: input `[n, c, h, w]`, `o` output channels, kernel, stride, padding, dilation.
    #[derive(Clone, Copy, Debug)]
    struct Layer {
        x: [usize; 4],
        o: usize,
        k: (usize, usize),
        stride: (usize, usize),
        pad: (usize, usize),
        dil: (usize, usize),
    }

    fn layer(x: [usize; 4], o: usize, k: usize, stride: usize, pad: usize) -> Layer {
        Layer {
            x,
            o,
            k: (k, k),
            stride: (stride, stride),
            pad: (pad, pad),
            dil: (1, 1),
        }
    }

    fn geometry(l: &Layer) -> Geometry {
        let p = Conv2dParams {
            stride: l.stride,
            padding: l.pad,
            dilation: l.dil,
        };
        Geometry::of("test", &l.x, &[l.o, l.x[1], l.k.0, l.k.1], &p).unwrap()
    }

    fn values(n: usize, g: &mut Generator) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f64(g.uniform() * 2.0 - 1.0))
            .collect()
    }

    /// `v` (row-major `[a, b, c, d]`) in `format`'s storage order.
    fn store(v: &[bf16], dims: [usize; 4], format: MemoryFormat) -> Vec<bf16> {
        let [_, c, h, w] = dims;
        if format == MemoryFormat::Contiguous {
            return v.to_vec();
        }
        let mut out = vec![bf16::ZERO; v.len()];
        for (i, &value) in v.iter().enumerate() {
            let (ni, ci, y, x) = (i / (c * h * w), (i / (h * w)) % c, (i / w) % h, i % w);
            out[((ni * h + y) * w + x) * c + ci] = value;
        }
        out
    }

    /// `v` in `format`'s storage order back to row-major.
    fn load(v: &[bf16], dims: [usize; 4], format: MemoryFormat) -> Vec<f64> {
        let [_, c, h, w] = dims;
        (0..v.len())
            .map(|i| {
                let (ni, ci, y, x) = (i / (c * h * w), (i / (h * w)) % c, (i / w) % h, i % w);
                let at = match format {
                    MemoryFormat::Contiguous => i,
                    MemoryFormat::ChannelsLast => ((ni * h + y) * w + x) * c + ci,
                };
                v[at].to_f64()
            })
            .collect()
    }

    /// The exact sums `Σ x·w` of every output, and of `|x·w|`, in f64 (row-major).
    fn reference(l: &Layer, g: &Geometry, x: &[bf16], w: &[bf16]) -> (Vec<f64>, Vec<f64>) {
        let [n, c, h, wd] = l.x;
        let size = n * l.o * g.out_pixels();
        let (mut y, mut a) = (vec![0.0; size], vec![0.0; size]);
        for ni in 0..n {
            for o in 0..l.o {
                for oh in 0..g.out_h {
                    for ow in 0..g.out_w {
                        let at = ((ni * l.o + o) * g.out_h + oh) * g.out_w + ow;
                        for ci in 0..c {
                            for kh in 0..l.k.0 {
                                for kw in 0..l.k.1 {
                                    let ih = (oh * l.stride.0 + kh * l.dil.0) as isize
                                        - l.pad.0 as isize;
                                    let iw = (ow * l.stride.1 + kw * l.dil.1) as isize
                                        - l.pad.1 as isize;
                                    if ih < 0 || iw < 0 || ih >= h as isize || iw >= wd as isize {
                                        continue;
                                    }
                                    let xv = x
                                        [((ni * c + ci) * h + ih as usize) * wd + iw as usize]
                                        .to_f64();
                                    let wv = w[((o * c + ci) * l.k.0 + kh) * l.k.1 + kw].to_f64();
                                    y[at] += xv * wv;
                                    a[at] += (xv * wv).abs();
                                }
                            }
                        }
                    }
                }
            }
        }
        (y, a)
    }

    /// `got` is `want` rounded once to bf16 after an f32 sum of `terms` products.
    fn close(what: &str, got: &[f64], want: &[f64], abs: &[f64], terms: usize) {
        for (i, ((&g, &w), &a)) in got.iter().zip(want).zip(abs).enumerate() {
            let bound = 2f64.powi(-8) * w.abs() + (terms as f64 + 2.0) * 2f64.powi(-24) * a + 1e-30;
            assert!(
                (g - w).abs() <= bound,
                "{what}: element {i}: {g} vs {w} (bound {bound})"
            );
        }
    }

    fn layers() -> Vec<Layer> {
        let mut dilated = layer([2, 16, 9, 11], 16, 3, 1, 2);
        dilated.dil = (2, 2);
        let mut oblong = layer([1, 5, 7, 12], 20, 3, 1, 1);
        oblong.k = (3, 2);
        oblong.pad = (1, 0);
        vec![
            layer([2, 3, 10, 10], 16, 3, 1, 1),
            layer([2, 16, 8, 8], 16, 3, 1, 1),
            layer([1, 32, 9, 7], 48, 3, 1, 1),
            layer([2, 40, 6, 6], 24, 3, 1, 1),
            layer([2, 16, 10, 10], 32, 3, 2, 1),
            layer([2, 16, 9, 9], 32, 1, 2, 0),
            layer([1, 64, 5, 5], 64, 1, 1, 0),
            // The virtual grid (8·8) fills the last step exactly: the last pixel's value is
            // the buffer's last.
            layer([2, 16, 8, 8], 16, 1, 1, 0),
            // Rows of at least 16 pixels: the weight gradient transposes whole 16 × 16 blocks
            // (with pixel and channel tails beside them).
            layer([2, 32, 5, 37], 16, 3, 1, 1),
            layer([1, 20, 4, 17], 16, 3, 1, 1),
            layer([1, 16, 3, 16], 16, 3, 1, 1),
            layer([1, 8, 20, 19], 8, 5, 1, 2),
            dilated,
            oblong,
        ]
    }

    #[test]
    fn forward_matches_the_exact_sums_rounded_once() {
        let Some(amx) = crate::cpu::amx::detect() else {
            eprintln!("no AMX-BF16 here: skipped");
            return;
        };
        let mut gen = Generator::new(3);
        for l in layers() {
            let g = geometry(&l);
            let x = values(l.x.iter().product(), &mut gen);
            let w = values(l.o * l.x[1] * l.k.0 * l.k.1, &mut gen);
            let bias: Vec<f32> = (0..l.o).map(|i| i as f32 * 0.25 - 1.0).collect();
            let (mut want, abs) = reference(&l, &g, &x, &w);
            let pixels = g.out_pixels();
            want.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v += bias[(i / pixels) % l.o] as f64);
            let (c, (kh, kw)) = (l.x[1], l.k);
            let wf = |o: usize, ci: usize, a: usize, b: usize| w[((o * c + ci) * kh + a) * kw + b];
            for (fin, fout) in [
                (MemoryFormat::ChannelsLast, MemoryFormat::ChannelsLast),
                (MemoryFormat::Contiguous, MemoryFormat::Contiguous),
                (MemoryFormat::Contiguous, MemoryFormat::ChannelsLast),
            ] {
                let xs = store(&x, l.x, fin);
                let src = Dense {
                    values: &xs,
                    format: fin,
                    dims: l.x,
                };
                let out = forward(amx, src, &g, &wf, Some(&bias), fout).unwrap();
                let got = load(&out, g.out_shape(), fout);
                let terms = c * kh * kw;
                close(
                    &format!("{l:?} {fin:?}->{fout:?}"),
                    &got,
                    &want,
                    &abs,
                    terms,
                );
            }
        }
    }

    #[test]
    fn gradients_match_the_exact_sums() {
        let Some(amx) = crate::cpu::amx::detect() else {
            eprintln!("no AMX-BF16 here: skipped");
            return;
        };
        let mut gen = Generator::new(5);
        for l in layers() {
            let g = geometry(&l);
            let [n, c, h, wd] = l.x;
            let x = values(l.x.iter().product(), &mut gen);
            let w = values(l.o * c * l.k.0 * l.k.1, &mut gen);
            let dy = values(n * l.o * g.out_pixels(), &mut gen);
            // Exact gradients: dx[n,c,ih,iw] and dw[o,c,a,b] as sums over the forward's terms.
            let (mut dx, mut dxa) = (vec![0.0; x.len()], vec![0.0; x.len()]);
            let (mut dw, mut dwa) = (vec![0.0; w.len()], vec![0.0; w.len()]);
            for ni in 0..n {
                for o in 0..l.o {
                    for oh in 0..g.out_h {
                        for ow in 0..g.out_w {
                            let d = dy[((ni * l.o + o) * g.out_h + oh) * g.out_w + ow].to_f64();
                            for ci in 0..c {
                                for a in 0..l.k.0 {
                                    for b in 0..l.k.1 {
                                        let ih = (oh * l.stride.0 + a * l.dil.0) as isize
                                            - l.pad.0 as isize;
                                        let iw = (ow * l.stride.1 + b * l.dil.1) as isize
                                            - l.pad.1 as isize;
                                        if ih < 0 || iw < 0 || ih >= h as isize || iw >= wd as isize
                                        {
                                            continue;
                                        }
                                        let xi =
                                            ((ni * c + ci) * h + ih as usize) * wd + iw as usize;
                                        let wi = ((o * c + ci) * l.k.0 + a) * l.k.1 + b;
                                        dx[xi] += d * w[wi].to_f64();
                                        dxa[xi] += (d * w[wi].to_f64()).abs();
                                        dw[wi] += d * x[xi].to_f64();
                                        dwa[wi] += (d * x[xi].to_f64()).abs();
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let (kh, kw) = l.k;
            for format in [MemoryFormat::ChannelsLast, MemoryFormat::Contiguous] {
                let dys = store(&dy, g.out_shape(), format);
                let dyd = Dense {
                    values: &dys,
                    format,
                    dims: g.out_shape(),
                };
                let xs = store(&x, l.x, format);
                let xd = Dense {
                    values: &xs,
                    format,
                    dims: l.x,
                };
                let what = format!("{l:?} {format:?}");
                let terms = l.o * kh * kw;
                if let Some(tg) = g.input_gradient_as_forward() {
                    let wf = |ci: usize, o: usize, a: usize, b: usize| {
                        w[((o * c + ci) * kh + kh - 1 - a) * kw + kw - 1 - b]
                    };
                    let got = forward(amx, dyd, &tg, &wf, None, format).unwrap();
                    close(
                        &format!("dx {what}"),
                        &load(&got, l.x, format),
                        &dx,
                        &dxa,
                        terms,
                    );
                }
                let got = input_grad_scatter(amx, dyd, &g, &w, format).unwrap();
                close(
                    &format!("dx scatter {what}"),
                    &load(&got, l.x, format),
                    &dx,
                    &dxa,
                    terms,
                );
                let got: Vec<f64> = weight_grad(amx, xd, dyd, &g)
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                // The weight gradient stays f32: no bf16 rounding, only the f32 sum's error.
                let terms = n * g.out_pixels();
                for (i, ((&gv, &wv), &a)) in got.iter().zip(&dw).zip(&dwa).enumerate() {
                    let bound = (terms as f64 + 2.0) * 2f64.powi(-24) * a + 1e-30;
                    assert!(
                        (gv - wv).abs() <= bound,
                        "dw {what}: element {i}: {gv} vs {wv}"
                    );
                }
            }
        }
    }
}
