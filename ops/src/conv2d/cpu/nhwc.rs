//! The channels-last (NHWC) convolution: an implicit GEMM over pixel rows that reads and
//! writes NHWC storage directly, for f32 and f64.
//!
//! In NHWC an output pixel is the dot product of its receptive field — `kh·kw` runs of `C`
//! contiguous input channels — with each output channel's weights laid out `[O, kh, kw, C]`
//! (a channels-last weight's own storage). So a tile of output pixels is one matrix product:
//! the tile's rows of the patch matrix (`[pixels, kh·kw·C]`, copied run by run, zeros outside
//! the image; for a 1×1 unit-stride unpadded layer the input itself) times the weights
//! transposed, written straight into the NHWC output rows. The weight gradient is the output
//! gradient's tile transposed times the same patch rows; the input gradient multiplies the
//! output gradient by the weights and scatters the patch rows back into the input's pixels.
//!
//! Samples are independent: the forward and the input gradient run one rayon task per sample
//! (no two write the same pixels); the weight gradient gives each thread a contiguous range of
//! samples and its own partial sums, added in range order, so the result does not depend on
//! scheduling. Nothing is converted to NCHW: only the (small) weight is re-laid out when it is
//! not channels-last already.

use rayon::prelude::*;
use tandem_core::{FloatElement, MemoryFormat, Result, Tensor};

use crate::conv2d::shape::{Geometry, Needs};
use crate::cpu::gemm::{gemm_into, MatRef};
use crate::cpu::memory;

/// The op named in allocation errors.
const OP: &str = "conv2d";

/// Output pixels whose patch rows are built at once: the tile's rows (`TILE · kh·kw·C`
/// elements) stay in cache between being written and being multiplied.
const TILE: usize = 128;

/// Whether conv2d takes the channels-last path: the input or the weight is channels-last (as
/// PyTorch picks the convolution's memory format), in f32 or f64.
pub(crate) fn wants(x: &Tensor, weight: &Tensor) -> bool {
    matches!(x.dtype(), tandem_core::DType::F32 | tandem_core::DType::F64)
        && (x.memory_format() == MemoryFormat::ChannelsLast
            || weight.memory_format() == MemoryFormat::ChannelsLast)
}

/// Whether the patch matrix is the input itself (1×1 kernel, unit stride, no padding).
fn patch_is_input(g: &Geometry) -> bool {
    g.kernel == (1, 1) && g.stride == (1, 1) && g.padding == (0, 0)
}

/// Writes rows `p0..p0 + rows.len() / patch` of one sample's patch matrix: row `p` holds the
/// receptive field of output pixel `p` as `kh·kw` runs of `C` channels (zeros outside).
fn gather_rows<T: FloatElement>(x: &[T], g: &Geometry, p0: usize, rows: &mut [T]) {
    let c = g.in_channels;
    let (kh, kw) = g.kernel;
    for (i, row) in rows.chunks_exact_mut(kh * kw * c).enumerate() {
        let p = p0 + i;
        let (oh, ow) = (p / g.out_w, p % g.out_w);
        for a in 0..kh {
            let ih = (oh * g.stride.0 + a * g.dilation.0) as isize - g.padding.0 as isize;
            for b in 0..kw {
                let iw = (ow * g.stride.1 + b * g.dilation.1) as isize - g.padding.1 as isize;
                let dst = &mut row[(a * kw + b) * c..(a * kw + b + 1) * c];
                if ih < 0 || iw < 0 || ih >= g.in_h as isize || iw >= g.in_w as isize {
                    dst.fill(T::ZERO);
                } else {
                    let at = (ih as usize * g.in_w + iw as usize) * c;
                    dst.copy_from_slice(&x[at..at + c]);
                }
            }
        }
    }
}

/// Adds the patch rows `rows` (starting at output pixel `p0`) back into one sample's input
/// gradient `dx` (NHWC): the transpose of [`gather_rows`].
fn scatter_rows<T: FloatElement>(rows: &[T], g: &Geometry, p0: usize, dx: &mut [T]) {
    let c = g.in_channels;
    let (kh, kw) = g.kernel;
    for (i, row) in rows.chunks_exact(kh * kw * c).enumerate() {
        let p = p0 + i;
        let (oh, ow) = (p / g.out_w, p % g.out_w);
        for a in 0..kh {
            let ih = (oh * g.stride.0 + a * g.dilation.0) as isize - g.padding.0 as isize;
            for b in 0..kw {
                let iw = (ow * g.stride.1 + b * g.dilation.1) as isize - g.padding.1 as isize;
                if ih < 0 || iw < 0 || ih >= g.in_h as isize || iw >= g.in_w as isize {
                    continue;
                }
                let at = (ih as usize * g.in_w + iw as usize) * c;
                let src = &row[(a * kw + b) * c..(a * kw + b + 1) * c];
                for (d, &s) in dx[at..at + c].iter_mut().zip(src) {
                    *d += s;
                }
            }
        }
    }
}

/// Runs `f(sample, index)` for every sample: on the rayon pool when there is more than one
/// sample and thread, else on the caller. `f` gets whether it may let gemm go parallel
/// (only when the samples run one after another).
fn per_sample<A: Send, B: Send>(
    a: Vec<A>,
    b: Vec<B>,
    f: impl Fn(usize, A, B, bool) -> Result<()> + Sync + Send,
) -> Result<()> {
    if a.len() > 1 && rayon::current_num_threads() > 1 {
        a.into_par_iter()
            .zip(b)
            .enumerate()
            .try_for_each(|(n, (a, b))| f(n, a, b, false))
    } else {
        let inner = rayon::current_num_threads() > 1;
        a.into_iter()
            .zip(b)
            .enumerate()
            .try_for_each(|(n, (a, b))| f(n, a, b, inner))
    }
}

/// The forward on NHWC slices: `x` `[N, H, W, C]`, `w` `[O, kh, kw, C]`, result
/// `[N, OH, OW, O]` (flat).
fn forward<T: FloatElement>(x: &[T], w: &[T], bias: Option<&[T]>, g: &Geometry) -> Result<Vec<T>> {
    let (k, patch, pixels) = (g.out_channels, g.patch(), g.out_pixels());
    let mut out = memory::uninit::<T>(OP, g.batch * pixels * k)?;
    if out.is_empty() {
        return Ok(out);
    }
    let in_sample = g.in_h * g.in_w * g.in_channels;
    let outs: Vec<&mut [T]> = out.chunks_mut(pixels * k).collect();
    let xs: Vec<&[T]> = x.chunks(in_sample.max(1)).take(g.batch).collect();
    // The weights as the right operand `[patch, O]`: `w` is `[O, patch]` row-major.
    let rhs = MatRef::row_major(0, patch).t();
    per_sample(outs, xs, |_, out, x, par| {
        // Scratch hands its buffer back to the cache when dropped.
        let rows_len = if patch_is_input(g) {
            0
        } else {
            TILE.min(pixels) * patch
        };
        let mut rows = memory::Scratch::<T>::new(OP, rows_len)?;
        let rows = &mut rows.buf;
        for p0 in (0..pixels).step_by(TILE) {
            let m = TILE.min(pixels - p0);
            let dst = &mut out[p0 * k..(p0 + m) * k];
            if let Some(b) = bias {
                dst.chunks_exact_mut(k).for_each(|r| r.copy_from_slice(b));
            }
            let lhs: &[T] = if patch_is_input(g) {
                &x[p0 * patch..(p0 + m) * patch]
            } else {
                gather_rows(x, g, p0, &mut rows[..m * patch]);
                &rows[..m * patch]
            };
            let (l, d) = (MatRef::row_major(0, patch), MatRef::row_major(0, k));
            gemm_into((m, k, patch), dst, d, lhs, l, w, rhs, bias.is_some(), par);
        }
        Ok(())
    })?;
    Ok(out)
}

/// The input gradient on NHWC slices: `dy` `[N, OH, OW, O]`, `w` `[O, kh, kw, C]`, result
/// `[N, H, W, C]` (flat).
fn input_grad<T: FloatElement>(dy: &[T], w: &[T], g: &Geometry) -> Result<Vec<T>> {
    let (k, patch, pixels) = (g.out_channels, g.patch(), g.out_pixels());
    let in_sample = g.in_h * g.in_w * g.in_channels;
    let mut dx = memory::zeroed::<T>(OP, g.batch * in_sample)?;
    if dx.is_empty() || pixels == 0 {
        return Ok(dx);
    }
    let dxs: Vec<&mut [T]> = dx.chunks_mut(in_sample).collect();
    let dys: Vec<&[T]> = dy.chunks(pixels * k).collect();
    per_sample(dxs, dys, |_, dx, dy, par| {
        let mut rows = memory::Scratch::<T>::new(OP, TILE.min(pixels) * patch)?;
        let rows = &mut rows.buf;
        for p0 in (0..pixels).step_by(TILE) {
            let m = TILE.min(pixels - p0);
            let lhs = &dy[p0 * k..(p0 + m) * k];
            let (l, r, d) = (
                MatRef::row_major(0, k),
                MatRef::row_major(0, patch),
                MatRef::row_major(0, patch),
            );
            if patch_is_input(g) {
                let dst = &mut dx[p0 * patch..(p0 + m) * patch];
                gemm_into((m, patch, k), dst, d, lhs, l, w, r, false, par);
            } else {
                let dst = &mut rows[..m * patch];
                gemm_into((m, patch, k), dst, d, lhs, l, w, r, false, par);
                scatter_rows(&rows[..m * patch], g, p0, dx);
            }
        }
        Ok(())
    })?;
    Ok(dx)
}

/// The weight gradient `[O, kh, kw, C]` (flat) on NHWC slices `x` and `dy`: each thread sums
/// a contiguous range of samples into its own buffer; the buffers are added in range order.
fn weight_grad<T: FloatElement>(x: &[T], dy: &[T], g: &Geometry) -> Result<Vec<T>> {
    let (k, patch, pixels) = (g.out_channels, g.patch(), g.out_pixels());
    let in_sample = g.in_h * g.in_w * g.in_channels;
    let threads = rayon::current_num_threads().clamp(1, g.batch.max(1));
    let per = g.batch.div_ceil(threads).max(1);
    let ranges: Vec<(usize, usize)> = (0..g.batch)
        .step_by(per)
        .map(|s| (s, (s + per).min(g.batch)))
        .collect();
    let partial = |(s, e): (usize, usize), par: bool| -> Result<Vec<T>> {
        let mut dw = memory::zeroed::<T>(OP, k * patch)?;
        let rows_len = if patch_is_input(g) {
            0
        } else {
            TILE.min(pixels) * patch
        };
        let mut rows = memory::Scratch::<T>::new(OP, rows_len)?;
        let rows = &mut rows.buf;
        for n in s..e {
            let xn = &x[n * in_sample..(n + 1) * in_sample];
            let dyn_ = &dy[n * pixels * k..(n + 1) * pixels * k];
            for p0 in (0..pixels).step_by(TILE) {
                let m = TILE.min(pixels - p0);
                let rhs: &[T] = if patch_is_input(g) {
                    &xn[p0 * patch..(p0 + m) * patch]
                } else {
                    gather_rows(xn, g, p0, &mut rows[..m * patch]);
                    &rows[..m * patch]
                };
                // dw[O, patch] += dyᵀ[O, m] · rows[m, patch].
                let l = MatRef::row_major(p0 * k, k).t();
                let (r, d) = (MatRef::row_major(0, patch), MatRef::row_major(0, patch));
                gemm_into((k, patch, m), &mut dw, d, dyn_, l, rhs, r, true, par);
            }
        }
        Ok(dw)
    };
    let mut parts: Vec<Vec<T>> = if ranges.len() > 1 {
        ranges
            .par_iter()
            .map(|&r| partial(r, false))
            .collect::<Result<_>>()?
    } else {
        ranges
            .iter()
            .map(|&r| partial(r, rayon::current_num_threads() > 1))
            .collect::<Result<_>>()?
    };
    let Some(mut total) = (!parts.is_empty()).then(|| parts.remove(0)) else {
        return memory::zeroed::<T>(OP, k * patch);
    };
    for p in parts {
        total.iter_mut().zip(&p).for_each(|(t, &v)| *t += v);
        // The partial sums came from the cache: hand them back.
        tandem_core::alloc::recycle(p);
    }
    Ok(total)
}

/// `t` in `format` (a copy when it is not already).
fn in_format(t: Tensor, format: MemoryFormat) -> Result<Tensor> {
    t.contiguous_in(format)
}

/// The forward of conv2d on the channels-last path: the output `[N, O, OH, OW]` is
/// channels-last.
pub(crate) fn conv2d<T: FloatElement>(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    let cl = MemoryFormat::ChannelsLast;
    let (xc, wc) = (memory::dense_in(x, cl)?, memory::dense_in(weight, cl)?);
    let b: Option<Vec<T>> = bias.map(|b| memory::gather::<T>(OP, b)).transpose()?;
    let values = forward::<T>(
        &xc.read_dense_slice::<T>()?,
        &wc.read_dense_slice::<T>()?,
        b.as_deref(),
        g,
    )?;
    Tensor::from_vec_in(values, &g.out_shape(), x.device(), cl)
}

/// The backward of conv2d on the channels-last path: the gradients `needs` asks for, each in
/// its input's memory format (the weight gradient of a row-major weight is row-major).
pub(crate) fn conv2d_backward<T: FloatElement>(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<[Option<Tensor>; 3]> {
    const BACKWARD: &str = "conv2d_backward";
    let cl = MemoryFormat::ChannelsLast;
    let gc = memory::dense_in(grad, cl)?;
    let dy = gc.read_dense_slice::<T>()?;
    let device = grad.device();
    let format_of = |t: &Tensor| t.dense_format().unwrap_or(MemoryFormat::Contiguous);
    let bias = if needs.bias {
        let k = g.out_channels;
        let mut sums = memory::zeroed::<T>(BACKWARD, k)?;
        for row in dy.chunks_exact(k.max(1)) {
            sums.iter_mut().zip(row).for_each(|(s, &v)| *s += v);
        }
        Some(Tensor::from_vec(sums, &[k], device)?)
    } else {
        None
    };
    let input = if needs.input {
        let wc = memory::dense_in(weight, cl)?;
        let dx = input_grad::<T>(&dy, &wc.read_dense_slice::<T>()?, g)?;
        let t = Tensor::from_vec_in(dx, x.dims(), device, cl)?;
        Some(in_format(t, format_of(x))?)
    } else {
        None
    };
    let weight_grad = if needs.weight {
        let xc = memory::dense_in(x, cl)?;
        let dw = weight_grad::<T>(&xc.read_dense_slice::<T>()?, &dy, g)?;
        let t = Tensor::from_vec_in(dw, weight.dims(), device, cl)?;
        Some(in_format(t, format_of(weight))?)
    } else {
        None
    };
    Ok([input, weight_grad, bias])
}
