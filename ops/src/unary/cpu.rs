//! CPU kernels of the elementwise unary ops and of their backward.
//!
//! Every op gets its own monomorphised loop (the `match` on the kind sits outside the loop), so
//! the cheap ones (neg, relu, sqrt, their backward) compile to vector code and the
//! transcendental ones call the float type's own `exp`/`ln`/`tanh` without going through f64.
//! The loops are compiled for the widest vector instructions the CPU has (chosen at run time),
//! write into recycled buffers, and fork onto rayon only when there is more than one thread.
//! [`map`] and [`zip_map`] are shared with the other kernels of this crate that apply a
//! function elementwise.

use rayon::prelude::*;
use tandem_core::{alloc, with_float_type, Element, FloatElement, Result, Tensor};

use crate::simd::wide_simd_fn;
use crate::util::parallel;

/// Elements per rayon task: large enough to amortise the fork, small enough to balance.
const CHUNK: usize = 1 << 13;

/// A float type together with the exponential the kernels use.
///
/// f64 uses the standard library's `exp`. f32 uses [`exp_f32`], written so that the compiler
/// turns a loop of it into vector code (the C library's `expf` is a scalar call per element);
/// softmax, cross entropy, sigmoid and exp all go through it.
pub(crate) trait ExpFloat: FloatElement {
    /// `e^self`.
    fn exp_fast(self) -> Self;
}

impl ExpFloat for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
}

impl ExpFloat for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
}

/// `e^x` in f32 within 2 ulp over the whole range (denormal results included; `exp(±∞)` is
/// `∞`/`0`, NaN stays NaN), branch-free so that loops over it vectorise.
///
/// `x = n·ln2 + r` with `n` an integer and `|r| ≤ ln2/2`; `e^r` is its Taylor series to `r⁷`
/// (truncation below 6e-9 relative) and `2ⁿ` is built from exponent bits in two halves, so
/// that neither half leaves the normal range even when the product is denormal or infinite.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    // 1.5·2²³: adding it rounds to an integer that lands in the low mantissa bits
    const SHIFTER: f32 = 12_582_912.0;
    // ln 2 split in a 9-bit head (products with n ≤ 150 stay exact) and a tail
    const LN2_HI: f32 = 0.693_359_4; // 355/512
    const LN2_LO: f32 = -2.121_944_4e-4;
    // beyond these e^x is ∞ / 0 in f32; clamping keeps n small (and lets NaN through)
    let x = x.clamp(-104.0, 88.8);
    let shifted = x * std::f32::consts::LOG2_E + SHIFTER;
    let n_float = shifted - SHIFTER;
    let n = (shifted.to_bits() as i32).wrapping_sub(SHIFTER.to_bits() as i32);
    let r = (x - n_float * LN2_HI) - n_float * LN2_LO;
    // Estrin's scheme: pairs of terms in parallel, so the dependency chain is short
    let r2 = r * r;
    let r4 = r2 * r2;
    let low = (1.0 + r) + r2 * (0.5 + r * (1.0 / 6.0));
    let high = (1.0 / 24.0 + r * (1.0 / 120.0)) + r2 * (1.0 / 720.0 + r * (1.0 / 5040.0));
    let p = low + r4 * high;
    let half = n >> 1;
    let rest = n.wrapping_sub(half);
    let two_to = |k: i32| f32::from_bits((k.wrapping_add(127) as u32) << 23);
    p * two_to(half) * two_to(rest)
}

/// Which unary operation a kernel applies.
#[derive(Clone, Copy, Debug)]
pub(crate) enum UnaryKind {
    Neg,
    Exp,
    Log,
    Sqrt,
    Pow(f64),
    Relu,
    Sigmoid,
    Tanh,
}

impl UnaryKind {
    /// The op name used in errors and in the graph.
    pub(crate) fn name(self) -> &'static str {
        match self {
            UnaryKind::Neg => "neg",
            UnaryKind::Exp => "exp",
            UnaryKind::Log => "log",
            UnaryKind::Sqrt => "sqrt",
            UnaryKind::Pow(_) => "pow_scalar",
            UnaryKind::Relu => "relu",
            UnaryKind::Sigmoid => "sigmoid",
            UnaryKind::Tanh => "tanh",
        }
    }

    /// Whether the backward is cheaper from the output than from the input (then the output
    /// is what the op saves, and the input can be freed).
    pub(crate) fn saves_output(self) -> bool {
        matches!(
            self,
            UnaryKind::Exp
                | UnaryKind::Sqrt
                | UnaryKind::Relu
                | UnaryKind::Sigmoid
                | UnaryKind::Tanh
        )
    }
}

/// `dst[i] = f(src[i])` over two equally long runs, one thread.
#[inline(always)]
fn map_run<T: Copy, F: Fn(T) -> T>(src: &[T], dst: &mut [T], f: &F) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f(s));
}

wide_simd_fn!(
    /// [`map_run`] in the widest vector instructions the CPU has.
    fn map_run_wide[T: Copy, F: Fn(T) -> T](src: &[T], dst: &mut [T], f: &F) = map_run
);

/// `data[i] = f(data[i])`, one thread.
#[inline(always)]
fn map_run_in_place<T: Copy, F: Fn(T) -> T>(data: &mut [T], f: &F) {
    data.iter_mut().for_each(|v| *v = f(*v));
}

wide_simd_fn!(
    /// [`map_run_in_place`] in the widest vector instructions the CPU has.
    fn map_run_in_place_wide[T: Copy, F: Fn(T) -> T](data: &mut [T], f: &F) = map_run_in_place
);

/// `dst[i] = f(a[i], b[i])` over three equally long runs, one thread.
#[inline(always)]
fn zip_run<T: Copy, F: Fn(T, T) -> T>(a: &[T], b: &[T], dst: &mut [T], f: &F) {
    dst.iter_mut()
        .zip(a)
        .zip(b)
        .for_each(|((o, &x), &y)| *o = f(x, y));
}

wide_simd_fn!(
    /// [`zip_run`] in the widest vector instructions the CPU has.
    fn zip_run_wide[T: Copy, F: Fn(T, T) -> T](a: &[T], b: &[T], dst: &mut [T], f: &F) = zip_run
);

/// Applies `f` to every element of `src` into `dst` (same length), in parallel when large.
pub(crate) fn map_slice<T: Element>(src: &[T], dst: &mut [T], f: impl Fn(T) -> T + Sync) {
    if parallel(dst.len()) {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| map_run_wide(s, d, &f));
    } else {
        map_run_wide(src, dst, &f);
    }
}

/// Applies `f` to every element of `data` in place, in parallel when large.
fn map_in_place<T: Element>(data: &mut [T], f: impl Fn(T) -> T + Sync) {
    if parallel(data.len()) {
        data.par_chunks_mut(CHUNK)
            .for_each(|d| map_run_in_place_wide(d, &f));
    } else {
        map_run_in_place_wide(data, &f);
    }
}

/// A new contiguous tensor with `f` applied to each element of `x` (any layout, dtype `T`).
pub(crate) fn map<T: FloatElement>(x: &Tensor, f: impl Fn(T) -> T + Sync) -> Result<Tensor> {
    if x.numel() == 0 {
        return empty_like::<T>(x);
    }
    if x.is_contiguous() {
        let src = x.read_slice::<T>()?;
        let mut out = alloc::uninit::<T>(src.len());
        map_slice(&src, &mut out, f);
        drop(src);
        Tensor::from_vec(out, x.dims(), x.device())
    } else {
        // Gathering the strided elements already yields a fresh buffer: map it in place.
        let mut out = x.to_vec::<T>()?;
        map_in_place(&mut out, f);
        Tensor::from_vec(out, x.dims(), x.device())
    }
}

/// Writes `f(a, b)` of the matching elements of `a` and `b` into `dst` (all the same length),
/// in parallel when large.
pub(crate) fn zip_slices<T: Element>(
    a: &[T],
    b: &[T],
    dst: &mut [T],
    f: impl Fn(T, T) -> T + Sync,
) {
    if parallel(dst.len()) {
        dst.par_chunks_mut(CHUNK)
            .zip(a.par_chunks(CHUNK))
            .zip(b.par_chunks(CHUNK))
            .for_each(|((o, a), b)| zip_run_wide(a, b, o, &f));
    } else {
        zip_run_wide(a, b, dst, &f);
    }
}

/// A new contiguous tensor with `f(a, b)` of the matching elements of two same-shaped tensors
/// (any layouts, dtype `T`).
pub(crate) fn zip_map<T: FloatElement>(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(T, T) -> T + Sync,
) -> Result<Tensor> {
    if a.numel() == 0 {
        return empty_like::<T>(a);
    }
    let (ca, cb) = (a.contiguous_detached()?, b.contiguous_detached()?);
    let (x, y) = (ca.read_slice::<T>()?, cb.read_slice::<T>()?);
    let mut out = alloc::uninit::<T>(x.len());
    zip_slices(&x, &y, &mut out, f);
    drop((x, y));
    Tensor::from_vec(out, a.dims(), a.device())
}

/// A fresh tensor of `x`'s zero-element shape. Kernels return it early: a zero-size layout
/// may not count as contiguous (e.g. `[2, 0]`), so the slice path must not see one.
pub(crate) fn empty_like<T: FloatElement>(x: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(Vec::<T>::new(), x.dims(), x.device())
}

/// `p` as a small integer exponent when it is one (then `powi` is exact and faster).
fn integer_exponent(p: f64) -> Option<i32> {
    (p.fract() == 0.0 && p.abs() <= 64.0).then_some(p as i32)
}

/// The forward of `kind` on `x`.
pub(crate) fn forward(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    with_float_type!(kind.name(), x.dtype(), T => forward_typed::<T>(kind, x))
}

fn forward_typed<T: ExpFloat>(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    let one = T::one();
    match kind {
        UnaryKind::Neg => map::<T>(x, |v| -v),
        UnaryKind::Exp => map::<T>(x, |v| v.exp_fast()),
        UnaryKind::Log => map::<T>(x, |v| v.ln()),
        UnaryKind::Sqrt => map::<T>(x, |v| v.sqrt()),
        // `v < 0 ? 0 : v` rather than `max`: NaN propagates, as in PyTorch.
        UnaryKind::Relu => map::<T>(x, |v| if v < T::ZERO { T::ZERO } else { v }),
        UnaryKind::Sigmoid => map::<T>(x, |v| one / (one + (-v).exp_fast())),
        UnaryKind::Tanh => map::<T>(x, |v| v.tanh()),
        UnaryKind::Pow(p) => pow::<T>(x, p),
    }
}

fn pow<T: FloatElement>(x: &Tensor, p: f64) -> Result<Tensor> {
    let pt = T::from_f64(p);
    if p == 2.0 {
        map::<T>(x, |v| v * v)
    } else if p == 0.5 {
        map::<T>(x, |v| v.sqrt())
    } else if let Some(k) = integer_exponent(p) {
        map::<T>(x, |v| v.powi(k))
    } else {
        map::<T>(x, |v| v.powf(pt))
    }
}

/// The gradient of `kind`'s input from the output gradient `g` and the saved tensor (the
/// output when [`UnaryKind::saves_output`], the input otherwise).
pub(crate) fn backward(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    with_float_type!(kind.name(), g.dtype(), T => backward_typed::<T>(kind, g, saved))
}

fn backward_typed<T: FloatElement>(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    let one = T::one();
    match kind {
        UnaryKind::Neg => map::<T>(g, |g| -g),
        UnaryKind::Exp => zip_map::<T>(g, saved, |g, y| g * y),
        UnaryKind::Log => zip_map::<T>(g, saved, |g, x| g / x),
        UnaryKind::Sqrt => {
            let half = T::from_f32(0.5);
            zip_map::<T>(g, saved, |g, y| half * g / y)
        }
        UnaryKind::Relu => zip_map::<T>(g, saved, |g, y| if y > T::ZERO { g } else { T::ZERO }),
        UnaryKind::Sigmoid => zip_map::<T>(g, saved, |g, y| g * y * (one - y)),
        UnaryKind::Tanh => zip_map::<T>(g, saved, |g, y| g * (one - y * y)),
        UnaryKind::Pow(p) => pow_backward::<T>(g, saved, p),
    }
}

/// `g · p · x^(p−1)`.
fn pow_backward<T: FloatElement>(g: &Tensor, x: &Tensor, p: f64) -> Result<Tensor> {
    let pt = T::from_f64(p);
    let q = p - 1.0;
    let qt = T::from_f64(q);
    if p == 0.0 {
        map::<T>(g, |_| T::ZERO)
    } else if p == 1.0 {
        map::<T>(g, |g| g)
    } else if p == 2.0 {
        zip_map::<T>(g, x, |g, x| (g + g) * x)
    } else if let Some(k) = integer_exponent(q) {
        zip_map::<T>(g, x, |g, x| g * pt * x.powi(k))
    } else {
        zip_map::<T>(g, x, |g, x| g * pt * x.powf(qt))
    }
}
