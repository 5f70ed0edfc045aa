//! The batch-norm phases for f16 and bf16 inputs, in one pass over the halves: statistics and
//! every accumulation in f32/f64, f32 normalization constants, the outputs rounded once.
//!
//! The input splits into units — whole samples of a row-major `[N, C, L]` input, whole rows
//! (pixels) of a channels-last one — of about [`UNIT_ELEMENTS`] elements. Each unit is widened
//! into an f32 scratch buffer that stays in the core's cache (the vector conversions of
//! `tandem_core::cpu::convert`), the f32 passes of `passes.rs`/`nhwc.rs` run on it as on a
//! small tensor of their own, and an output unit is rounded straight into the half result.
//! So no full-size f32 copy of the input, the output or the gradient is ever made, and the
//! arithmetic is exactly the f32 op's on the widened values: the half op equals the f32 op on
//! the same (rounded) inputs up to the order of the per-channel f64 sums. Units run in
//! parallel (one scratch per worker) when the input is large; their per-channel sums are
//! added, and their moments merged (Chan's parallel-variance formula, in f64), in unit order.

use rayon::prelude::*;
use tandem_core::cpu::convert::Path;
use tandem_core::{HalfElement, Result};

use super::half_nhwc::{self, Constants, HalfMap};
use super::{nhwc, passes};
use crate::batch_norm::shape::Dims;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// f32 elements a unit widens (at least one sample or row, so sometimes more): 32 KiB per
/// widened operand, so that a backward unit's three operands stay in L2.
const UNIT_ELEMENTS: usize = 8192;

/// How the input's storage splits into units that the f32 passes handle on their own.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Units {
    /// Row-major `[N, C, L]`: units of whole samples.
    Samples(Dims),
    /// Channels-last `[rows, C]`: units of whole rows.
    Rows {
        /// Channels.
        c: usize,
    },
}

impl Units {
    /// Elements of one sample (row-major) or one row (channels-last).
    fn group(self) -> usize {
        match self {
            Units::Samples(d) => d.c * d.l,
            Units::Rows { c } => c,
        }
    }

    /// Elements of one unit, about [`UNIT_ELEMENTS`]: whole samples, or whole tasks of the
    /// channels-last passes (so that their blocked sums are the f32 op's own).
    fn len(self) -> usize {
        let g = match self {
            Units::Samples(_) => self.group(),
            Units::Rows { c } => c * nhwc::ROWS_PER_TASK,
        };
        g * (UNIT_ELEMENTS / g.max(1)).max(1)
    }

    /// Channels.
    fn channels(self) -> usize {
        match self {
            Units::Samples(d) => d.c,
            Units::Rows { c } => c,
        }
    }

    /// The `[n, c, l]` dims of a row-major unit of `len` elements.
    fn dims(self, len: usize) -> Dims {
        match self {
            Units::Samples(d) => Dims {
                n: len / (d.c * d.l).max(1),
                ..d
            },
            Units::Rows { c } => Dims {
                n: len / c.max(1),
                c,
                l: 1,
            },
        }
    }
}

/// The conversions' path: the widest vector one, or in this crate's tests the plain one while
/// a test forces it (every path rounds alike, so a forced run must match bit for bit).
fn path() -> Path {
    #[cfg(test)]
    if tests::PLAIN.load(std::sync::atomic::Ordering::Relaxed) {
        return Path::Plain;
    }
    Path::Vector
}

/// The channel count when the AVX-512 channels-last passes (`half_nhwc`) take the input: a
/// channels-last one whose channels are a multiple of 16, on a CPU with AVX-512 (and not
/// while a test forces the plain conversions or the general passes).
fn direct(units: Units) -> Option<usize> {
    #[cfg(test)]
    if tests::GENERAL.load(std::sync::atomic::Ordering::Relaxed) || path() == Path::Plain {
        return None;
    }
    match units {
        Units::Rows { c } if half_nhwc::applies(c) => Some(c),
        _ => None,
    }
}

/// A mask's per-channel `(scale, shift)` as two lists.
fn unzip_mask(mask: &[(f32, f32)]) -> (Vec<f32>, Vec<f32>) {
    mask.iter().copied().unzip()
}

/// `src` rounded into `dst`.
fn narrow<H: HalfElement>(src: &[f32], dst: &mut [H]) {
    H::narrow_on(path(), src, dst)
}

/// Per-worker f32 buffers that the units' operands are widened into.
#[derive(Default)]
struct Scratch {
    first: Vec<f32>,
    second: Vec<f32>,
    third: Vec<f32>,
}

/// `src` widened into `buf` (resized to fit); the widened values.
fn widened<'b, H: HalfElement>(buf: &'b mut Vec<f32>, src: &[H]) -> &'b [f32] {
    buf.resize(src.len(), 0.0);
    H::widen_on(path(), src, buf);
    buf
}

/// `f(scratch, start, len)` for every unit of a `len`-element input (units in order, in
/// parallel when large).
fn reduce_units<R: Send>(
    len: usize,
    units: Units,
    f: impl Fn(&mut Scratch, usize, usize) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let step = units.len();
    if len == 0 || step == 0 {
        return Ok(Vec::new());
    }
    let starts: Vec<usize> = (0..len).step_by(step).collect();
    let run = |s: &mut Scratch, &start: &usize| f(s, start, step.min(len - start));
    if parallel(len) && starts.len() > 1 {
        starts.par_iter().map_init(Scratch::default, run).collect()
    } else {
        let mut s = Scratch::default();
        starts.iter().map(|start| run(&mut s, start)).collect()
    }
}

/// A `len`-element half output written unit by unit: `f(scratch, start, out_unit)` fills
/// the unit at `start` and returns its partial result (units in order, in parallel when
/// large).
fn write_units<H: HalfElement, R: Send>(
    op: &'static str,
    len: usize,
    units: Units,
    f: impl Fn(&mut Scratch, usize, &mut [H]) -> Result<R> + Sync,
) -> Result<(Vec<H>, Vec<R>)> {
    // Every element is written.
    let mut out = memory::uninit::<H>(op, len)?;
    let step = units.len();
    if len == 0 || step == 0 {
        return Ok((out, Vec::new()));
    }
    let run = |s: &mut Scratch, (i, o): (usize, &mut [H])| f(s, i * step, o);
    let partial = if parallel(len) && len > step {
        out.par_chunks_mut(step)
            .enumerate()
            .map_init(Scratch::default, run)
            .collect::<Result<Vec<R>>>()?
    } else {
        let mut s = Scratch::default();
        out.chunks_mut(step)
            .enumerate()
            .map(|p| run(&mut s, p))
            .collect::<Result<Vec<R>>>()?
    };
    Ok((out, partial))
}

/// Per-channel mean and biased variance of `x`, each unit's moments from the f32 passes,
/// merged in f64.
pub(crate) fn moments<H: HalfElement>(x: &[H], units: Units) -> Result<(Vec<f64>, Vec<f64>)> {
    if let Some(c) = direct(units) {
        return Ok(half_nhwc::moments(x, c));
    }
    let c = units.channels();
    let parts = reduce_units(x.len(), units, |s, start, len| {
        let xs = widened(&mut s.first, &x[start..start + len]);
        let (mean, var) = match units {
            Units::Samples(_) => passes::moments::<f32>(xs, units.dims(len)),
            Units::Rows { c } => nhwc::moments::<f32>(xs, c),
        };
        Ok(((len / c.max(1)) as f64, mean, var))
    })?;
    let total: f64 = parts.iter().map(|p| p.0).sum();
    if total == 0.0 {
        return Ok((vec![0.0; c], vec![0.0; c]));
    }
    let mut mean = vec![0.0; c];
    for (n, m, _) in &parts {
        mean.iter_mut()
            .zip(m)
            .for_each(|(t, m)| *t += n * m / total);
    }
    // Σ(x − mean)² = Σ over units of (their own squared deviations + n·(unit mean − mean)²)
    let mut var = vec![0.0; c];
    for (n, m, v) in &parts {
        for ch in 0..c {
            let off = m[ch] - mean[ch];
            var[ch] += n * (v[ch] + off * off) / total;
        }
    }
    Ok((mean, var))
}

/// `y = x·scale[c] + shift[c]` and the epilogue (its residual laid out like `x`), rounded.
pub(crate) fn normalize<H: HalfElement>(
    op: &'static str,
    x: &[H],
    units: Units,
    scale: &[f64],
    shift: &[f64],
    epilogue: passes::Epilogue<'_, H>,
) -> Result<Vec<H>> {
    if let Some(c) = direct(units) {
        let coefs = passes::affine_coefs::<f32>(scale, shift);
        let (a, b) = unzip_mask(&coefs);
        let map = match epilogue {
            passes::Epilogue::Plain => HalfMap::Affine { relu: false },
            passes::Epilogue::Relu => HalfMap::Affine { relu: true },
            passes::Epilogue::AddRelu(r) => HalfMap::AffineAddRelu(r),
        };
        let k = Constants {
            a: &a,
            b: &b,
            ..Constants::default()
        };
        return half_nhwc::map(op, x, c, map, k);
    }
    let (y, _) = write_units(op, x.len(), units, |s, start, out: &mut [H]| {
        let range = start..start + out.len();
        let xs = widened(&mut s.first, &x[range.clone()]);
        let e = match epilogue {
            passes::Epilogue::Plain => passes::Epilogue::Plain,
            passes::Epilogue::Relu => passes::Epilogue::Relu,
            passes::Epilogue::AddRelu(r) => {
                passes::Epilogue::AddRelu(widened(&mut s.second, &r[range]))
            }
        };
        let y = match units {
            Units::Samples(_) => {
                passes::normalize::<f32>(op, xs, units.dims(out.len()), scale, shift, e)?
            }
            Units::Rows { c } => nhwc::normalize::<f32>(op, xs, c, scale, shift, e)?,
        };
        narrow(&y, out);
        // The f32 pass's output came from the cache: hand it back.
        tandem_core::alloc::recycle(y);
        Ok(())
    })?;
    Ok(y)
}

/// Adds per-unit `(Σg, Σg·(x − mean))` pairs per channel.
fn add_sums(c: usize, parts: Vec<(Vec<f64>, Vec<f64>)>) -> (Vec<f64>, Vec<f64>) {
    let (mut sum_g, mut sum_gc) = (vec![0.0; c], vec![0.0; c]);
    for (g, gc) in parts {
        sum_g.iter_mut().zip(&g).for_each(|(t, v)| *t += v);
        sum_gc.iter_mut().zip(&gc).for_each(|(t, v)| *t += v);
    }
    (sum_g, sum_gc)
}

/// Per-channel `Σ g` and `Σ g·(x − mean)`; with `mask` (f32 `(scale, shift)`) `g` counts only
/// where the forward's normalised value was positive.
pub(crate) fn grad_sums<H: HalfElement>(
    g: &[H],
    x: &[H],
    units: Units,
    mean: &[f64],
    mask: Option<&[(f32, f32)]>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    if let Some(c) = direct(units) {
        let mask = mask.map(unzip_mask);
        let mask = mask.as_ref().map(|(s, t)| (&s[..], &t[..]));
        return Ok(half_nhwc::grad_sums(g, x, c, mean, mask));
    }
    let parts = reduce_units(g.len(), units, |s, start, len| {
        let range = start..start + len;
        let gs = widened(&mut s.first, &g[range.clone()]);
        let xs = widened(&mut s.second, &x[range]);
        Ok(match units {
            Units::Samples(_) => passes::grad_sums::<f32>(gs, xs, units.dims(len), mean, mask),
            Units::Rows { c } => nhwc::grad_sums::<f32>(gs, xs, c, mean, mask),
        })
    })?;
    Ok(add_sums(units.channels(), parts))
}

/// The output gradient masked where the saved output `y` is positive (exact in the half
/// type: each value is `g` or 0), with the per-channel `Σ g'` and `Σ g'·(x − mean)`.
pub(crate) fn masked_grad_sums<H: HalfElement>(
    op: &'static str,
    g: &[H],
    y: &[H],
    x: &[H],
    units: Units,
    mean: &[f64],
) -> Result<(Vec<H>, Vec<f64>, Vec<f64>)> {
    if let Some(c) = direct(units) {
        let masked = half_nhwc::map(op, g, c, HalfMap::KeepPositive(y), Constants::default())?;
        let (sum_g, sum_gc) = half_nhwc::grad_sums(&masked, x, c, mean, None);
        return Ok((masked, sum_g, sum_gc));
    }
    let (masked, parts) = write_units(op, g.len(), units, |s, start, out: &mut [H]| {
        let range = start..start + out.len();
        let gs = widened(&mut s.first, &g[range.clone()]);
        let ys = widened(&mut s.second, &y[range.clone()]);
        let xs = widened(&mut s.third, &x[range]);
        let (m, sum_g, sum_gc) = match units {
            Units::Samples(_) => {
                passes::masked_grad_sums::<f32>(op, gs, ys, xs, units.dims(out.len()), mean)?
            }
            Units::Rows { c } => nhwc::masked_grad_sums::<f32>(op, gs, ys, xs, c, mean)?,
        };
        narrow(&m, out);
        tandem_core::alloc::recycle(m);
        Ok((sum_g, sum_gc))
    })?;
    let (sum_g, sum_gc) = add_sums(units.channels(), parts);
    Ok((masked, sum_g, sum_gc))
}

/// The per-channel constants of the input gradient `g·a[c] + x·b[c] + k[c]`.
pub(crate) struct GradCoefs<'a> {
    /// The gradient's factor (`w/σ`).
    pub a: &'a [f64],
    /// The input's factor.
    pub b: &'a [f64],
    /// The constant.
    pub k: &'a [f64],
}

/// `grad_x = g·a[c] + x·b[c] + k[c]` rounded to the half type; with `mask` (f32
/// `(scale, shift)`) `g` is zeroed where the forward's normalised value was not positive.
pub(crate) fn grad_input<H: HalfElement>(
    op: &'static str,
    g: &[H],
    x: &[H],
    units: Units,
    coefs: &GradCoefs<'_>,
    mask: Option<&[(f32, f32)]>,
) -> Result<Vec<H>> {
    let GradCoefs { a, b, k } = *coefs;
    if let Some(c) = direct(units) {
        let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
        let (a, b, k) = (f32s(a), f32s(b), f32s(k));
        let (s, t) = mask.map(unzip_mask).unwrap_or_default();
        let map = HalfMap::Gradient {
            x,
            masked: mask.is_some(),
        };
        let constants = Constants {
            a: &a,
            b: &b,
            k: &k,
            s: &s,
            t: &t,
        };
        return half_nhwc::map(op, g, c, map, constants);
    }
    let (gx, _) = write_units(op, g.len(), units, |s, start, out: &mut [H]| {
        let range = start..start + out.len();
        let gs = widened(&mut s.first, &g[range.clone()]);
        let xs = widened(&mut s.second, &x[range]);
        let gx = match units {
            Units::Samples(_) => {
                passes::grad_input::<f32>(op, gs, xs, units.dims(out.len()), a, b, k, mask)?
            }
            Units::Rows { c } => nhwc::grad_input::<f32>(op, gs, xs, c, a, b, k, mask)?,
        };
        narrow(&gx, out);
        tandem_core::alloc::recycle(gx);
        Ok(())
    })?;
    Ok(gx)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tandem_autograd::{backward, BackwardOptions};
    use tandem_core::{DType, Device, Generator, MemoryFormat, Tensor};

    /// Forces the plain conversions while set (only [`plain_conversions_match_the_vector_ones`]
    /// sets it; other tests running meanwhile get the same bits either way).
    pub(super) static PLAIN: AtomicBool = AtomicBool::new(false);
    /// Forces the general half passes instead of the AVX-512 channels-last ones while set.
    pub(super) static GENERAL: AtomicBool = AtomicBool::new(false);

    /// The bits of batch_norm_add_relu's output and of the gradients of x, the residual and
    /// the weight, for a half input in `format`.
    fn run(dtype: DType, format: MemoryFormat) -> Vec<Vec<f64>> {
        run_shape(dtype, format, [3, 5, 9, 7])
    }

    /// [`run`] for an input of `shape`.
    fn run_shape(dtype: DType, format: MemoryFormat, shape: [usize; 4]) -> Vec<Vec<f64>> {
        let mut g = Generator::new(7);
        let mut randn =
            |s: &[usize]| Tensor::randn(s, 0.0, 1.5, DType::F32, Device::Cpu, &mut g).unwrap();
        let x = randn(&shape)
            .to_dtype(dtype)
            .unwrap()
            .contiguous_in(format)
            .unwrap();
        let r = randn(&shape)
            .to_dtype(dtype)
            .unwrap()
            .contiguous_in(format)
            .unwrap();
        let w = randn(&shape[1..2]).with_requires_grad().unwrap();
        let (x, r) = (
            x.with_requires_grad().unwrap(),
            r.with_requires_grad().unwrap(),
        );
        let y = crate::batch_norm_add_relu(&x, &r, None, None, Some(&w), None, true, 0.1, 1e-5)
            .unwrap();
        let dy = randn(&shape).to_dtype(dtype).unwrap();
        backward(&y, Some(&dy), &BackwardOptions::default()).unwrap();
        [y, x.grad().unwrap(), r.grad().unwrap(), w.grad().unwrap()]
            .iter()
            .map(|t| t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap())
            .collect()
    }

    /// A quick harness, not a timed test: medians of forward + backward of the batch-norm
    /// family on a ResNet-20-sized bf16 activation, native half passes against the f32 detour
    /// (cast → f32 op → cast) they replace, one thread.
    /// `cargo test -p tandem-ops --lib half_batch_norm_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn half_batch_norm_timing() {
        use crate::batch_norm::{batch_norm_fused, fused_via_f32, BatchNormArgs, Epilogue};
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let median = |f: &dyn Fn()| {
            let mut t: Vec<f64> = (0..9)
                .map(|_| {
                    let s = std::time::Instant::now();
                    f();
                    s.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let mut g = Generator::new(3);
        let shape = [32, 16, 32, 32];
        let mut randn =
            |s: &[usize]| Tensor::randn(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let (w, b) = (
            randn(&[16]).with_requires_grad().unwrap(),
            randn(&[16]).with_requires_grad().unwrap(),
        );
        for format in [MemoryFormat::ChannelsLast, MemoryFormat::Contiguous] {
            let x = randn(&shape)
                .to_dtype(DType::BF16)
                .unwrap()
                .contiguous_in(format)
                .unwrap();
            let r = randn(&shape)
                .to_dtype(DType::BF16)
                .unwrap()
                .contiguous_in(format)
                .unwrap();
            let dy = randn(&shape)
                .to_dtype(DType::BF16)
                .unwrap()
                .contiguous_in(format)
                .unwrap();
            let (x, r) = (
                x.with_requires_grad().unwrap(),
                r.with_requires_grad().unwrap(),
            );
            let args = BatchNormArgs {
                running_mean: None,
                running_var: None,
                weight: Some(&w),
                bias: Some(&b),
                training: true,
                momentum: 0.1,
                eps: 1e-5,
            };
            for (name, e) in [
                ("batch_norm", Epilogue::Plain),
                ("batch_norm_relu", Epilogue::Relu),
                ("batch_norm_add_relu", Epilogue::AddRelu(&r)),
            ] {
                let step = |native: bool| {
                    let y = if native {
                        batch_norm_fused(&x, e, &args)
                    } else {
                        fused_via_f32(&x, e, &args)
                    }
                    .unwrap();
                    // Fresh gradients each step: accumulating into the leaves is not timed.
                    for t in [&x, &r, &w, &b] {
                        t.set_grad(None).unwrap();
                    }
                    backward(&y, Some(&dy), &BackwardOptions::default()).unwrap();
                };
                let (tn, tv) = pool.install(|| (median(&|| step(true)), median(&|| step(false))));
                println!("{name} bf16 {shape:?} {format:?} fwd+bwd: native {tn:.3} ms, through f32 {tv:.3} ms");
            }
        }
    }

    /// The AVX-512 channels-last passes (channels a multiple of 16) against the general half
    /// passes: the same f32 arithmetic but for the order of the f32 additions inside the
    /// per-channel block sums, so the outputs and gradients agree to a unit or two in the
    /// half type's last place, and the f32 weight gradients closely.
    #[test]
    fn direct_channels_last_passes_agree_with_the_general_ones() {
        if !super::half_nhwc::applies(16) {
            println!("skipped: this CPU lacks AVX-512F or AVX512-BF16");
            return;
        }
        for dtype in [DType::BF16, DType::F16] {
            for c in [16, 48] {
                let shape = [5, c, 9, 7];
                let direct = run_shape(dtype, MemoryFormat::ChannelsLast, shape);
                GENERAL.store(true, Ordering::Relaxed);
                let general = run_shape(dtype, MemoryFormat::ChannelsLast, shape);
                GENERAL.store(false, Ordering::Relaxed);
                let ulp = if dtype == DType::BF16 {
                    2f64.powi(-7)
                } else {
                    2f64.powi(-10)
                };
                for (i, (d, g)) in direct.iter().zip(&general).enumerate() {
                    let top = g.iter().fold(0f64, |m, v| m.max(v.abs()));
                    // Halves (y, x and residual gradients): 2 units of the last place, plus
                    // an absolute term for values near zero after cancellation; the f32
                    // weight gradient: 1e-4 of its largest entry.
                    let tol = |v: f64| {
                        if i < 3 {
                            2.0 * ulp * v.abs() + 1e-3 * top
                        } else {
                            1e-4 * top
                        }
                    };
                    for (j, (a, b)) in d.iter().zip(g).enumerate() {
                        assert!(
                            (a - b).abs() <= tol(*b),
                            "{dtype} c={c} output {i} element {j}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// The plain (scalar) conversions give the vector ones' results bit for bit, through a
    /// whole forward and backward, in both layouts and both half dtypes.
    #[test]
    fn plain_conversions_match_the_vector_ones() {
        for dtype in [DType::BF16, DType::F16] {
            for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
                let vector = run(dtype, format);
                PLAIN.store(true, Ordering::Relaxed);
                let plain = run(dtype, format);
                PLAIN.store(false, Ordering::Relaxed);
                assert_eq!(vector, plain, "{dtype} {format:?}");
            }
        }
    }
}
