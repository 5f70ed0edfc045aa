//! conv2d on bf16 values (NCHW): forward, input gradient and weight gradient as im2col column
//! products by the bf16 GEMM (`cpu::gemm_bf16`), which accumulates in f32.
//!
//! Per sample, the columns `[C·kh·kw, OH·OW]` of the input are built in bf16 (a copy, no
//! rounding), then:
//! - forward: `out = W · cols (+ b)` in f32, rounded once to bf16;
//! - weight gradient: `gWᵀ += cols · gyᵀ` in f32 (the columns are the left operand, whose
//!   pairs of consecutive pixels the packing reads as one 32-bit word); returned in f32;
//! - input gradient: `gcols = Wᵀ · gy` in f32, added back onto the input pixels (col2im) in
//!   f32, rounded once to bf16.
//!
//! The batch is split into one chunk per rayon thread as in the f32 kernels; each chunk owns
//! its scratch and its partial weight and bias gradients, summed in chunk order at the end.

use rayon::prelude::*;
use tandem_core::half::bf16;
use tandem_core::{DType, Result, Tensor};

use super::OP;
use crate::conv2d::shape::{Geometry, Needs};
use crate::cpu::gemm_bf16::{gemm_bf16, Bf16Mat, Path};
use crate::cpu::memory::{self, Scratch};

/// Gradients of a bf16 convolution: the input gradient in bf16, the weight (`[O, C, kh, kw]`)
/// and bias gradients in f32 (the caller rounds them, or keeps f32 for f32 master weights).
pub(crate) struct Bf16Grads {
    pub input: Option<Vec<bf16>>,
    pub weight: Option<Vec<f32>>,
    pub bias: Option<Vec<f32>>,
}

/// The input range `[lo, hi)` of output positions `0..out_len` whose tap `tap` (at
/// `tap·dilation − pad + o·stride`) falls inside `0..len`, as output positions.
fn valid(tap: usize, pad: usize, stride: usize, len: usize, out_len: usize) -> (usize, usize) {
    // Position of output o: o·stride + tap − pad; inside when tap + o·stride ≥ pad and
    // o·stride + tap < len + pad.
    let lo = pad.saturating_sub(tap).div_ceil(stride).min(out_len);
    let hi = if len + pad > tap {
        (len + pad - tap).div_ceil(stride).min(out_len)
    } else {
        0
    };
    (lo, hi.max(lo))
}

/// Builds the columns `[C·kh·kw, OH·OW]` of one sample `x` (`[C, H, W]`) into `cols`.
fn im2col(g: &Geometry, x: &[bf16], cols: &mut [bf16]) {
    let (kh, kw) = g.kernel;
    let (sh, sw) = g.stride;
    let (ph, pw) = g.padding;
    let (dh, dw) = g.dilation;
    let (ow_n, pixels) = (g.out_w, g.out_pixels());
    let mut rows = cols.chunks_mut(pixels);
    for plane in x.chunks(g.in_h * g.in_w).take(g.in_channels) {
        for a in 0..kh {
            let (oh0, oh1) = valid(a * dh, ph, sh, g.in_h, g.out_h);
            for b in 0..kw {
                let (ow0, ow1) = valid(b * dw, pw, sw, g.in_w, ow_n);
                let row = rows.next().expect("im2col: columns hold C·kh·kw rows");
                row[..oh0 * ow_n].fill(bf16::ZERO);
                row[oh1 * ow_n..].fill(bf16::ZERO);
                for oh in oh0..oh1 {
                    let dst = &mut row[oh * ow_n..(oh + 1) * ow_n];
                    dst[..ow0].fill(bf16::ZERO);
                    dst[ow1..].fill(bf16::ZERO);
                    let ih = oh * sh + a * dh - ph;
                    let src = &plane[ih * g.in_w..(ih + 1) * g.in_w];
                    if sw == 1 {
                        let iw0 = ow0 + b * dw - pw;
                        dst[ow0..ow1].copy_from_slice(&src[iw0..iw0 + ow1 - ow0]);
                    } else {
                        for (ow, d) in dst.iter_mut().enumerate().take(ow1).skip(ow0) {
                            *d = src[ow * sw + b * dw - pw];
                        }
                    }
                }
            }
        }
    }
}

/// Adds the columns `cols` (`[C·kh·kw, OH·OW]`, f32) back onto the pixels they were read from
/// (`gx`, `[C, H, W]`): the adjoint of [`im2col`].
fn col2im(g: &Geometry, cols: &[f32], gx: &mut [f32]) {
    let (kh, kw) = g.kernel;
    let (sh, sw) = g.stride;
    let (ph, pw) = g.padding;
    let (dh, dw) = g.dilation;
    let (ow_n, pixels) = (g.out_w, g.out_pixels());
    let mut rows = cols.chunks(pixels);
    for plane in gx.chunks_mut(g.in_h * g.in_w).take(g.in_channels) {
        for a in 0..kh {
            let (oh0, oh1) = valid(a * dh, ph, sh, g.in_h, g.out_h);
            for b in 0..kw {
                let (ow0, ow1) = valid(b * dw, pw, sw, g.in_w, ow_n);
                let row = rows.next().expect("col2im: columns hold C·kh·kw rows");
                for oh in oh0..oh1 {
                    let ih = oh * sh + a * dh - ph;
                    let dst = &mut plane[ih * g.in_w..(ih + 1) * g.in_w];
                    let src = &row[oh * ow_n..(oh + 1) * ow_n];
                    for ow in ow0..ow1 {
                        dst[ow * sw + b * dw - pw] += src[ow];
                    }
                }
            }
        }
    }
}

/// Runs `f(first_sample, count, chunk_of_out)` over chunks of the batch (`per` output elements
/// a sample), one per rayon thread when there is more than one, and collects the results in
/// chunk order.
fn chunks<T: Send, R: Send>(
    batch: usize,
    out: &mut [T],
    per: usize,
    f: impl Fn(usize, usize, &mut [T]) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let threads = rayon::current_num_threads().max(1);
    let chunk = batch.div_ceil(threads).max(1);
    let run = |ci: usize, c: &mut [T]| f(ci * chunk, chunk.min(batch - ci * chunk), c);
    if threads > 1 && batch > 1 {
        let parts: Vec<&mut [T]> = match per {
            0 => (0..batch.div_ceil(chunk)).map(|_| &mut [][..]).collect(),
            _ => out.chunks_mut(chunk * per).collect(),
        };
        parts
            .into_par_iter()
            .enumerate()
            .map(|(ci, c)| run(ci, c))
            .collect()
    } else {
        Ok(vec![run(0, out)?])
    }
}

/// Forward of a bf16 convolution: `x` `[N, C, H, W]`, `w` `[O, C·kh·kw]`, `bias` `[O]` (f32:
/// added before the one rounding), result `[N, O, OH, OW]` in bf16, accumulated in f32.
pub(crate) fn forward_bf16(
    path: Path,
    x: &[bf16],
    w: &[bf16],
    bias: Option<&[f32]>,
    g: &Geometry,
) -> Result<Vec<bf16>> {
    let (o_n, patch, pixels) = (g.out_channels, g.patch(), g.out_pixels());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let mut out = memory::uninit::<bf16>(OP, g.batch * out_per)?;
    let one_thread = rayon::current_num_threads() <= 1 || g.batch <= 1;
    chunks(g.batch, &mut out, out_per, |n0, count, chunk| {
        let mut cols = Scratch::<bf16>::new(OP, patch * pixels)?;
        let mut acc = Scratch::<f32>::new(OP, out_per)?;
        for (s, dst) in chunk.chunks_mut(out_per.max(1)).take(count).enumerate() {
            im2col(g, &x[(n0 + s) * in_per..][..in_per], &mut cols.buf);
            let (a, b) = (
                Bf16Mat::row_major(w, patch),
                Bf16Mat::row_major(&cols.buf, pixels),
            );
            let acc = &mut acc.buf;
            gemm_bf16(
                path,
                (o_n, pixels, patch),
                a,
                b,
                acc,
                pixels,
                false,
                one_thread,
            );
            for (o, (d, v)) in dst.chunks_mut(pixels).zip(acc.chunks(pixels)).enumerate() {
                let shift = bias.map_or(0.0, |b| b[o]);
                d.iter_mut()
                    .zip(v)
                    .for_each(|(d, &v)| *d = bf16::from_f32(v + shift));
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Backward of [`forward_bf16`] for the output gradient `gy` (`[N, O, OH, OW]`, bf16): the
/// gradients `needs` asks for, each accumulated in f32.
pub(crate) fn backward_bf16(
    path: Path,
    x: &[bf16],
    w: &[bf16],
    gy: &[bf16],
    g: &Geometry,
    needs: Needs,
) -> Result<Bf16Grads> {
    let (o_n, patch, pixels) = (g.out_channels, g.patch(), g.out_pixels());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let mut gx = match needs.input {
        true => memory::uninit::<bf16>(OP, g.batch * in_per)?,
        false => Vec::new(),
    };
    let per = if needs.input { in_per } else { 0 };
    let one_thread = rayon::current_num_threads() <= 1 || g.batch <= 1;
    let partials = chunks(g.batch, &mut gx, per, |n0, count, gx_chunk| {
        let mut gwt = memory::zeroed::<f32>(OP, if needs.weight { patch * o_n } else { 0 })?;
        let mut gb = memory::zeroed::<f32>(OP, if needs.bias { o_n } else { 0 })?;
        let mut cols = Scratch::<bf16>::new(OP, if needs.weight { patch * pixels } else { 0 })?;
        let mut gcols = Scratch::<f32>::new(OP, if needs.input { patch * pixels } else { 0 })?;
        let mut gx32 = Scratch::<f32>::new(OP, per)?;
        for s in 0..count {
            let gn = &gy[(n0 + s) * out_per..][..out_per];
            if needs.bias {
                for (acc, plane) in gb.iter_mut().zip(gn.chunks(pixels.max(1))) {
                    *acc += plane.iter().map(|v| v.to_f32()).sum::<f32>();
                }
            }
            let gm = Bf16Mat::row_major(gn, pixels);
            if needs.weight {
                im2col(g, &x[(n0 + s) * in_per..][..in_per], &mut cols.buf);
                let a = Bf16Mat::row_major(&cols.buf, pixels);
                gemm_bf16(
                    path,
                    (patch, o_n, pixels),
                    a,
                    gm.t(),
                    &mut gwt,
                    o_n,
                    true,
                    one_thread,
                );
            }
            if needs.input {
                let wt = Bf16Mat::row_major(w, patch).t();
                let gc = &mut gcols.buf;
                gemm_bf16(
                    path,
                    (patch, pixels, o_n),
                    wt,
                    gm,
                    gc,
                    pixels,
                    false,
                    one_thread,
                );
                gx32.buf.fill(0.0);
                col2im(g, gc, &mut gx32.buf);
                let dst = &mut gx_chunk[s * in_per..][..in_per];
                dst.iter_mut()
                    .zip(&gx32.buf)
                    .for_each(|(d, &v)| *d = bf16::from_f32(v));
            }
        }
        Ok((gwt, gb))
    })?;
    let weight = needs.weight.then(|| {
        let mut gw = vec![0f32; o_n * patch];
        for (gwt, _) in &partials {
            // From [C·kh·kw, O] to [O, C·kh·kw].
            for (r, row) in gwt.chunks(o_n.max(1)).enumerate() {
                row.iter()
                    .enumerate()
                    .for_each(|(o, &v)| gw[o * patch + r] += v);
            }
        }
        gw
    });
    let bias = needs.bias.then(|| {
        let mut gb = vec![0f32; o_n];
        for (_, part) in &partials {
            gb.iter_mut().zip(part).for_each(|(t, &v)| *t += v);
        }
        gb
    });
    Ok(Bf16Grads {
        input: needs.input.then_some(gx),
        weight,
        bias,
    })
}

/// Whether every tensor given is BF16 (the operands the bf16 kernels take).
fn all_bf16<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> bool {
    tensors.into_iter().all(|t| t.dtype() == DType::BF16)
}

/// The forward of conv2d on BF16 CPU tensors by the bf16 kernels (any layout: read through a
/// contiguous copy), `[N, O, OH, OW]` in BF16; `None` when an operand is not BF16 (the caller
/// then takes the path through f32).
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Option<Tensor>> {
    if !all_bf16([x, weight].into_iter().chain(bias)) {
        return Ok(None);
    }
    let (xc, wc) = (memory::contiguous(OP, x)?, memory::contiguous(OP, weight)?);
    let b: Option<Vec<f32>> = bias
        .map(|b| memory::gather::<bf16>(OP, b).map(|v| v.iter().map(|v| v.to_f32()).collect()))
        .transpose()?;
    let (xs, ws) = (xc.read_slice::<bf16>()?, wc.read_slice::<bf16>()?);
    let out = forward_bf16(Path::detect(), &xs, &ws, b.as_deref(), g)?;
    Tensor::from_vec(out, &g.out_shape(), x.device()).map(Some)
}

/// The backward of conv2d on BF16 CPU tensors by the bf16 kernels: the gradients `needs` asks
/// for, in BF16 (each accumulated in f32 and rounded once); `None` when `x`, `weight` or `grad`
/// is not BF16.
pub(crate) fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<Option<[Option<Tensor>; 3]>> {
    if !all_bf16([x, weight, grad]) {
        return Ok(None);
    }
    let (xc, wc, gc) = (
        memory::contiguous(OP, x)?,
        memory::contiguous(OP, weight)?,
        memory::contiguous(OP, grad)?,
    );
    let (xs, ws, gs) = (
        xc.read_slice::<bf16>()?,
        wc.read_slice::<bf16>()?,
        gc.read_slice::<bf16>()?,
    );
    let grads = backward_bf16(Path::detect(), &xs, &ws, &gs, g, needs)?;
    let device = grad.device();
    let rounded = |v: Option<Vec<f32>>, shape: &[usize]| {
        v.map(|v| Tensor::from_vec(v.into_iter().map(bf16::from_f32).collect(), shape, device))
            .transpose()
    };
    Ok(Some([
        grads
            .input
            .map(|v| Tensor::from_vec(v, x.dims(), device))
            .transpose()?,
        rounded(grads.weight, weight.dims())?,
        rounded(grads.bias, &[g.out_channels])?,
    ]))
}

#[cfg(test)]
mod tests {
    use super::super::{backward, forward};
    use super::*;
    use crate::conv2d::shape::Conv2dParams;
    use crate::cpu::gemm::{gemm_into, MatRef};

    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    }

    fn widen(v: &[bf16]) -> Vec<f32> {
        v.iter().map(|v| v.to_f32()).collect()
    }

    /// `got` is within bf16 rounding (when `rounded`) plus f32 accumulation error of `want`.
    fn close(what: &str, got: &[f32], want: &[f32], scale: f32, rounded: bool) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
            let tol = if rounded { b.abs() / 256.0 } else { 0.0 } + 1e-5 * scale;
            assert!((a - b).abs() <= tol, "{what}[{i}]: {a} vs {b} (tol {tol})");
        }
    }

    /// Forward and all three gradients of `g` on `path` against the f32 kernels on the same
    /// (bf16-representable) values.
    fn check(path: Path, x: [usize; 4], w: [usize; 4], p: Conv2dParams) {
        let g = Geometry::new("test", &x, &w, &p).unwrap();
        let (xb, wb) = (values(x.iter().product(), 3), values(w.iter().product(), 5));
        let bias: Vec<f32> = widen(&values(w[0], 9));
        let gyb = values(g.batch * g.out_per_sample(), 11);
        let (xf, wf, gyf) = (widen(&xb), widen(&wb), widen(&gyb));
        // Sums of |terms| bound f32 accumulation error: values are in [-1, 1].
        let (kh, kw) = g.kernel;
        let depth_x = (g.out_channels * kh * kw) as f32;
        let depth_w = (g.batch * g.out_pixels()) as f32;
        let scale = g.patch() as f32;
        let want = forward::<f32>(&xf, &wf, Some(&bias), &g).unwrap();
        let got = forward_bf16(path, &xb, &wb, Some(&bias), &g).unwrap();
        close(
            &format!("{path:?} {g:?} forward"),
            &widen(&got),
            &want,
            scale,
            true,
        );
        let needs = Needs {
            input: true,
            weight: true,
            bias: true,
        };
        let want = backward::<f32>(&xf, &wf, &gyf, &g, needs).unwrap();
        let got = backward_bf16(path, &xb, &wb, &gyb, &g, needs).unwrap();
        let what = format!("{path:?} {g:?}");
        let gx = widen(&got.input.unwrap());
        close(
            &format!("{what} grad x"),
            &gx,
            &want.input.unwrap(),
            depth_x,
            true,
        );
        let gw = got.weight.unwrap();
        close(
            &format!("{what} grad w"),
            &gw,
            &want.weight.unwrap(),
            depth_w,
            false,
        );
        let gb = got.bias.unwrap();
        close(
            &format!("{what} grad b"),
            &gb,
            &want.bias.unwrap(),
            depth_w,
            false,
        );
        let only_w = Needs {
            input: false,
            weight: true,
            bias: false,
        };
        let got = backward_bf16(path, &xb, &wb, &gyb, &g, only_w).unwrap();
        assert!(got.input.is_none() && got.bias.is_none() && got.weight.is_some());
    }

    fn params(stride: usize, padding: usize, dilation: usize) -> Conv2dParams {
        Conv2dParams {
            stride: (stride, stride),
            padding: (padding, padding),
            dilation: (dilation, dilation),
        }
    }

    fn cases() -> Vec<([usize; 4], [usize; 4], Conv2dParams)> {
        vec![
            ([2, 16, 8, 8], [16, 16, 3, 3], params(1, 1, 1)),
            ([2, 3, 9, 7], [5, 3, 3, 3], params(2, 1, 1)),
            ([1, 4, 7, 6], [3, 4, 2, 3], params(1, 2, 2)),
            ([3, 16, 8, 8], [32, 16, 1, 1], params(2, 0, 1)),
            ([2, 1, 12, 12], [6, 1, 5, 5], params(1, 0, 1)),
            ([1, 5, 4, 4], [7, 5, 3, 3], params(3, 1, 1)),
        ]
    }

    #[test]
    fn plain_path_matches_f32_conv() {
        for (x, w, p) in cases() {
            check(Path::Plain, x, w, p);
        }
    }

    #[test]
    fn dpbf16_path_matches_f32_conv() {
        let path = Path::detect();
        if matches!(path, Path::Plain) {
            eprintln!("no AVX512-BF16 on this CPU: only the plain path checked");
        }
        for (x, w, p) in cases() {
            check(path, x, w, p);
        }
    }

    #[test]
    fn batch_split_over_threads_matches() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(|| {
            check(
                Path::detect(),
                [5, 16, 8, 8],
                [16, 16, 3, 3],
                params(1, 1, 1),
            );
            check(Path::detect(), [0, 3, 4, 4], [2, 3, 3, 3], params(1, 1, 1));
        });
    }

    #[test]
    fn tensor_entry_points_round_once_and_decline_other_dtypes() {
        use tandem_core::Device;
        let p = params(1, 1, 1);
        let g = Geometry::new("test", &[2, 3, 5, 5], &[4, 3, 3, 3], &p).unwrap();
        let t = |v: Vec<bf16>, shape: &[usize]| Tensor::from_vec(v, shape, Device::Cpu).unwrap();
        let (xb, wb, bb) = (values(150, 1), values(108, 2), values(4, 3));
        let gyb = values(g.batch * g.out_per_sample(), 4);
        let (x, w, b) = (
            t(xb.clone(), &[2, 3, 5, 5]),
            t(wb.clone(), &[4, 3, 3, 3]),
            t(bb.clone(), &[4]),
        );
        let gy = t(gyb.clone(), &g.out_shape());
        let out = conv2d(&x, &w, Some(&b), &g).unwrap().unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let want = forward_bf16(Path::detect(), &xb, &wb, Some(&widen(&bb)), &g).unwrap();
        assert_eq!(
            out.to_vec_f64().unwrap(),
            want.iter().map(|v| v.to_f64()).collect::<Vec<_>>()
        );
        let needs = Needs {
            input: true,
            weight: true,
            bias: true,
        };
        let [gx, gw, gb] = conv2d_backward(&x, &w, &gy, &g, needs).unwrap().unwrap();
        let want = backward_bf16(Path::detect(), &xb, &wb, &gyb, &g, needs).unwrap();
        let rounded = |v: Vec<f32>| {
            v.iter()
                .map(|&v| f64::from(bf16::from_f32(v)))
                .collect::<Vec<_>>()
        };
        let (gw, gb) = (gw.unwrap(), gb.unwrap());
        assert_eq!(
            (gw.dtype(), gw.dims()),
            (DType::BF16, &[4usize, 3, 3, 3][..])
        );
        assert_eq!(gw.to_vec_f64().unwrap(), rounded(want.weight.unwrap()));
        assert_eq!(gb.to_vec_f64().unwrap(), rounded(want.bias.unwrap()));
        assert_eq!(gx.unwrap().dims(), x.dims());
        let x32 = x.to_dtype(DType::F32).unwrap();
        assert!(conv2d(&x32, &w, None, &g).unwrap().is_none());
        assert!(
            conv2d_backward(&x, &w, &gy.to_dtype(DType::F32).unwrap(), &g, needs)
                .unwrap()
                .is_none()
        );
    }

    /// Median and fastest seconds of `runs` calls of `f` (the fastest is the steadier figure on
    /// a shared machine).
    fn median(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
        f();
        let mut t: Vec<f64> = (0..runs)
            .map(|_| {
                let start = std::time::Instant::now();
                f();
                start.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        (t[runs / 2], t[0])
    }

    /// A measurement, not a test: the f32 kernels against the bf16 ones (the detected path
    /// and the plain one) on ResNet-20's convolutions at batch 32, one thread, medians in ms.
    /// `cargo test -p tandem-ops --lib measure_bf16_conv -- --ignored --nocapture`
    /// (with `CARGO_PROFILE_DEV_OPT_LEVEL=3` for numbers worth comparing).
    #[test]
    #[ignore = "a measurement, run by hand"]
    fn measure_bf16_conv_on_resnet20_shapes() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let shapes = [
            ([32, 3, 32, 32], [16, 3, 3, 3], params(1, 1, 1)),
            ([32, 16, 32, 32], [16, 16, 3, 3], params(1, 1, 1)),
            ([32, 16, 32, 32], [32, 16, 3, 3], params(2, 1, 1)),
            ([32, 16, 32, 32], [32, 16, 1, 1], params(2, 0, 1)),
            ([32, 32, 16, 16], [32, 32, 3, 3], params(1, 1, 1)),
            ([32, 32, 16, 16], [64, 32, 3, 3], params(2, 1, 1)),
            ([32, 64, 8, 8], [64, 64, 3, 3], params(1, 1, 1)),
        ];
        let all = Needs {
            input: true,
            weight: true,
            bias: false,
        };
        pool.install(|| {
            println!("GEMM m×n×k | f32 gemm | bf16 dpbf16 | bf16 plain (ms, median/fastest)");
            for (m, n, k) in [
                (16, 1024, 144),
                (32, 256, 288),
                (64, 64, 576),
                (256, 256, 256),
            ] {
                let (a, b) = (values(m * k, 1), values(k * n, 2));
                let (a32, b32) = (widen(&a), widen(&b));
                let mut dst = vec![0f32; m * n];
                let ms = |f: &mut dyn FnMut()| {
                    let (med, min) = median(9, f);
                    format!("{:.3}/{:.3}", med * 1e3, min * 1e3)
                };
                let f32_ms = ms(&mut || {
                    let (l, r) = (MatRef::row_major(0, k), MatRef::row_major(0, n));
                    let d = MatRef::row_major(0, n);
                    gemm_into((m, n, k), &mut dst, d, &a32, l, &b32, r, false, false)
                });
                let mut bf = |path| {
                    let (l, r) = (Bf16Mat::row_major(&a, k), Bf16Mat::row_major(&b, n));
                    gemm_bf16(path, (m, n, k), l, r, &mut dst, n, false, false)
                };
                let dp_ms = ms(&mut || bf(Path::detect()));
                let plain_ms = ms(&mut || bf(Path::Plain));
                println!("{m}×{n}×{k} | {f32_ms} | {dp_ms} | {plain_ms}");
            }
        });
        println!("shape | f32 fwd | bf16 fwd | plain fwd | f32 bwd | bf16 bwd | plain bwd");
        println!("(ms, median/fastest of 9; backward = input and weight gradients)");
        pool.install(|| {
            for (x, w, p) in shapes {
                let g = Geometry::new("bench", &x, &w, &p).unwrap();
                let (xb, wb) = (values(x.iter().product(), 3), values(w.iter().product(), 5));
                let gyb = values(g.batch * g.out_per_sample(), 11);
                let (xf, wf, gyf) = (widen(&xb), widen(&wb), widen(&gyb));
                let ms = |f: &mut dyn FnMut()| {
                    let (med, min) = median(9, f);
                    format!("{:.2}/{:.2}", med * 1e3, min * 1e3)
                };
                let f32_fwd = ms(&mut || drop(forward::<f32>(&xf, &wf, None, &g).unwrap()));
                let (xr, wr, gr, gm) = (&xb[..], &wb[..], &gyb[..], &g);
                let fwd = |path| move || drop(forward_bf16(path, xr, wr, None, gm).unwrap());
                let bf_fwd = ms(&mut fwd(Path::detect()));
                let plain_fwd = ms(&mut fwd(Path::Plain));
                let f32_bwd = ms(&mut || drop(backward::<f32>(&xf, &wf, &gyf, &g, all).unwrap()));
                let bwd = |path| move || drop(backward_bf16(path, xr, wr, gr, gm, all).unwrap());
                let bf_bwd = ms(&mut bwd(Path::detect()));
                let plain_bwd = ms(&mut bwd(Path::Plain));
                println!(
                    "{x:?}x{w:?} s{} | {f32_fwd} | {bf_fwd} | {plain_fwd} | {f32_bwd} | {bf_bwd} | \
                     {plain_bwd}",
                    p.stride.0
                );
            }
        });
    }
}
