//! Elementwise loops over the 16-bit floats (f16, bf16) for the hot memory-bound ops of a
//! mixed-precision ResNet step (relu, add, add_relu and relu's backward): each element is
//! loaded as a half, computed in f32 and stored as a half in one pass, with no widened copy of
//! the tensor. The loops are compiled for the widest vector instructions the CPU has (chosen at
//! run time, as [`super::simd`]) and fork onto rayon only when the work is large.
//!
//! bf16 loads and stores are bit operations without branches (so they vectorise): a load
//! shifts the 16 bits into the top of an f32; a store rounds to nearest, ties to even, and
//! keeps NaN a quiet NaN. f16 goes through the `half` crate's conversions.

use rayon::prelude::*;
use tandem_core::half::{bf16, f16};
use tandem_core::{with_half_type, Element, Result, Tensor};

use super::memory;
use super::parallel::parallel;
use super::simd::wide_simd_fn;

/// Elements per rayon task.
const CHUNK: usize = 1 << 13;

/// A 16-bit float loaded to and stored from f32 inside the loops.
pub(crate) trait HalfLanes: Element {
    /// Widens to f32 (exact).
    fn load(self) -> f32;
    /// Rounds an f32 to this type (nearest, ties to even).
    fn store(v: f32) -> Self;
}

impl HalfLanes for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        let x = v.to_bits();
        // Adding 0x7fff plus the kept lowest bit rounds to nearest with ties to even; a carry
        // into the exponent is the correct rounding up (to the next binade, or to infinity).
        let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
        // A NaN's payload could carry into infinity: keep it a quiet NaN instead.
        let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
        let quiet = ((x >> 16) as u16) | 0x0040;
        bf16::from_bits(if nan { quiet } else { rounded })
    }
}

impl HalfLanes for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `dst[i] = f(src[i])` in f32, one thread.
#[inline(always)]
fn map_run<H: HalfLanes, F: Fn(f32) -> f32>(src: &[H], dst: &mut [H], f: &F) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &s)| *d = H::store(f(s.load())));
}

wide_simd_fn!(
    /// [`map_run`] in the widest vector instructions the CPU has.
    fn map_run_wide[H: HalfLanes, F: Fn(f32) -> f32](src: &[H], dst: &mut [H], f: &F) = map_run
);

/// `dst[i] = f(a[i], b[i])` in f32, one thread.
#[inline(always)]
fn zip_run<H: HalfLanes, F: Fn(f32, f32) -> f32>(a: &[H], b: &[H], dst: &mut [H], f: &F) {
    dst.iter_mut()
        .zip(a)
        .zip(b)
        .for_each(|((o, &x), &y)| *o = H::store(f(x.load(), y.load())));
}

wide_simd_fn!(
    /// [`zip_run`] in the widest vector instructions the CPU has.
    fn zip_run_wide[H: HalfLanes, F: Fn(f32, f32) -> f32](a: &[H], b: &[H], dst: &mut [H], f: &F)
        = zip_run
);

/// A new contiguous tensor of `f` applied to each element of `x` (any layout) in f32.
fn map<H: HalfLanes>(
    op: &'static str,
    x: &Tensor,
    f: impl Fn(f32) -> f32 + Sync,
) -> Result<Tensor> {
    if x.numel() == 0 {
        return Tensor::from_vec(Vec::<H>::new(), x.dims(), x.device());
    }
    let c = memory::contiguous(op, x)?;
    let src = c.read_slice::<H>()?;
    let mut out = memory::uninit::<H>(op, src.len())?;
    if parallel(out.len()) {
        out.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| map_run_wide(s, d, &f));
    } else {
        map_run_wide(&src, &mut out, &f);
    }
    drop(src);
    Tensor::from_vec(out, x.dims(), x.device())
}

/// A new contiguous tensor of `f(a, b)` of the matching elements of two same-shaped tensors
/// (any layouts) in f32.
fn zip<H: HalfLanes>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<Tensor> {
    if a.numel() == 0 {
        return Tensor::from_vec(Vec::<H>::new(), a.dims(), a.device());
    }
    let (ca, cb) = (memory::contiguous(op, a)?, memory::contiguous(op, b)?);
    let (x, y) = (ca.read_slice::<H>()?, cb.read_slice::<H>()?);
    let mut out = memory::uninit::<H>(op, x.len())?;
    if parallel(out.len()) {
        out.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .zip(y.par_chunks(CHUNK))
            .for_each(|((o, a), b)| zip_run_wide(a, b, o, &f));
    } else {
        zip_run_wide(&x, &y, &mut out, &f);
    }
    drop((x, y));
    Tensor::from_vec(out, a.dims(), a.device())
}

/// `max(x, 0)` of a half tensor (NaN stays NaN, as the f32 relu).
pub(crate) fn relu(op: &'static str, x: &Tensor) -> Result<Tensor> {
    with_half_type!(op, x.dtype(), H => map::<H>(op, x, |v| if v < 0.0 { 0.0 } else { v }))
}

/// relu's input gradient: `g` where the output `y > 0`, else 0 (both halves, same shape).
pub(crate) fn relu_backward(op: &'static str, g: &Tensor, y: &Tensor) -> Result<Tensor> {
    with_half_type!(op, g.dtype(), H => zip::<H>(op, g, y, |g, y| if y > 0.0 { g } else { 0.0 }))
}

/// `a + b` of two same-shaped half tensors, rounded once.
pub(crate) fn add(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    with_half_type!(op, a.dtype(), H => zip::<H>(op, a, b, |x, y| x + y))
}

/// `max(0, a + b)` of two same-shaped half tensors, rounded once.
pub(crate) fn add_relu(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    with_half_type!(op, a.dtype(), H => zip::<H>(op, a, b, |x, y| {
        let s = x + y;
        if s < 0.0 {
            0.0
        } else {
            s
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::HalfLanes;
    use tandem_core::half::bf16;

    /// The branch-free bf16 store rounds as the `half` crate does (nearest, ties to even),
    /// for every bf16 neighbourhood, the halfway points, infinities and NaN.
    #[test]
    fn bf16_store_matches_the_half_crate_rounding() {
        let mut checked = 0;
        for hi in 0..=u16::MAX {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let v = f32::from_bits(((hi as u32) << 16) | lo);
                let (got, want) = (bf16::store(v), bf16::from_f32(v));
                if v.is_nan() {
                    assert!(got.is_nan(), "{v:e} ({:#x})", v.to_bits());
                } else {
                    assert_eq!(got.to_bits(), want.to_bits(), "{v:e} ({:#x})", v.to_bits());
                    assert_eq!(got.load(), want.to_f32());
                }
                checked += 1;
            }
        }
        assert_eq!(checked, 6 << 16);
    }

    /// A quick harness, not a timed test: medians of the native half loops against the general
    /// path (widen to f32, the f32 kernel, round) and against f32, on a ResNet-sized activation.
    /// `cargo test -p tandem-ops --lib half_loops_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn half_loops_timing() {
        use crate::low_precision::via_f32;
        use std::time::Instant;
        use tandem_core::{DType, Device, Generator, Result, Tensor};
        type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
        fn median(mut f: impl FnMut()) -> f64 {
            let mut t: Vec<f64> = (0..15)
                .map(|_| {
                    let s = Instant::now();
                    f();
                    s.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        }
        let shape = [32, 64, 16, 16];
        let mut g = Generator::new(1);
        let a = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let b = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let relu2: Op = |x, _| crate::unary::relu(x);
        let native: [(&str, Op); 3] = [
            ("relu", |x, _| super::relu("relu", x)),
            ("add", |x, y| super::add("add", x, y)),
            ("add_relu", |x, y| super::add_relu("add_relu", x, y)),
        ];
        let f32_ops: [Op; 3] = [relu2, crate::binary::add, crate::binary::add_relu];
        for dtype in [DType::BF16, DType::F16] {
            let (al, bl) = (a.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            for ((name, nat), f) in native.iter().zip(f32_ops) {
                let t_native = median(|| drop(nat(&al, &bl).unwrap()));
                let t_general =
                    median(|| drop(via_f32(dtype, &[&al, &bl], |w| f(&w[0], &w[1])).unwrap()));
                let t_f32 = median(|| drop(f(&a, &b).unwrap()));
                println!(
                    "{name} {dtype} {shape:?}: native {t_native:.3} ms, through f32 \
                     {t_general:.3} ms, f32 op {t_f32:.3} ms"
                );
            }
        }
    }
}
