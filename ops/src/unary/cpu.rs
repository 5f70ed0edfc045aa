//! CPU kernels of the elementwise unary ops and of their backward.
//!
//! Every op gets its own monomorphised loop (the `match` on the kind sits outside the loop), so
//! the cheap ones (neg, relu, sqrt, their backward) compile to vector code and the
//! transcendental ones call the float type's own `exp`/`ln`/`tanh` without going through f64.
//! The loops are compiled for the widest vector instructions the CPU has (chosen at run time),
//! write into recycled buffers, and fork onto rayon only when there is more than one thread.
//! [`map`] and [`zip_map`] are shared with the other kernels of this crate that apply a
//! function elementwise.

use tandem_core::{with_float_type, FloatElement, Result, Tensor};

use crate::cpu::elementwise::{map, zip_map};
use crate::cpu::exp::ExpFloat;

use super::shape::{integer_exponent, UnaryKind};

/// The forward of `kind` on `x`.
pub(crate) fn forward(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    with_float_type!(kind.name(), x.dtype(), T => forward_typed::<T>(kind, x))
}

fn forward_typed<T: ExpFloat>(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    let op = kind.name();
    let one = T::one();
    match kind {
        UnaryKind::Neg => map::<T>(op, x, |v| -v),
        UnaryKind::Exp => map::<T>(op, x, |v| v.exp_fast()),
        UnaryKind::Log => map::<T>(op, x, |v| v.ln()),
        UnaryKind::Sqrt => map::<T>(op, x, |v| v.sqrt()),
        // `v < 0 ? 0 : v` rather than `max`: NaN propagates, as in PyTorch.
        UnaryKind::Relu => map::<T>(op, x, |v| if v < T::ZERO { T::ZERO } else { v }),
        UnaryKind::Sigmoid => map::<T>(op, x, |v| one / (one + (-v).exp_fast())),
        UnaryKind::Tanh => map::<T>(op, x, |v| v.tanh()),
        UnaryKind::Pow(p) => pow::<T>(op, x, p),
    }
}

fn pow<T: FloatElement>(op: &'static str, x: &Tensor, p: f64) -> Result<Tensor> {
    let pt = T::from_f64(p);
    if p == 2.0 {
        map::<T>(op, x, |v| v * v)
    } else if p == 0.5 {
        map::<T>(op, x, |v| v.sqrt())
    } else if let Some(k) = integer_exponent(p) {
        map::<T>(op, x, |v| v.powi(k))
    } else {
        map::<T>(op, x, |v| v.powf(pt))
    }
}

/// The gradient of `kind`'s input from the output gradient `g` and the saved tensor (the
/// output when [`UnaryKind::saves_output`], the input otherwise).
pub(crate) fn backward(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    with_float_type!(kind.name(), g.dtype(), T => backward_typed::<T>(kind, g, saved))
}

fn backward_typed<T: FloatElement>(kind: UnaryKind, g: &Tensor, saved: &Tensor) -> Result<Tensor> {
    let op = kind.name();
    let one = T::one();
    match kind {
        UnaryKind::Neg => map::<T>(op, g, |g| -g),
        UnaryKind::Exp => zip_map::<T>(op, g, saved, |g, y| g * y),
        UnaryKind::Log => zip_map::<T>(op, g, saved, |g, x| g / x),
        UnaryKind::Sqrt => {
            let half = T::from_f32(0.5);
            zip_map::<T>(op, g, saved, |g, y| half * g / y)
        }
        UnaryKind::Relu => zip_map::<T>(op, g, saved, |g, y| if y > T::ZERO { g } else { T::ZERO }),
        UnaryKind::Sigmoid => zip_map::<T>(op, g, saved, |g, y| g * y * (one - y)),
        UnaryKind::Tanh => zip_map::<T>(op, g, saved, |g, y| g * (one - y * y)),
        UnaryKind::Pow(p) => pow_backward::<T>(op, g, saved, p),
    }
}

/// `g · p · x^(p−1)`.
fn pow_backward<T: FloatElement>(
    op: &'static str,
    g: &Tensor,
    x: &Tensor,
    p: f64,
) -> Result<Tensor> {
    let pt = T::from_f64(p);
    let q = p - 1.0;
    let qt = T::from_f64(q);
    if p == 0.0 {
        map::<T>(op, g, |_| T::ZERO)
    } else if p == 1.0 {
        map::<T>(op, g, |g| g)
    } else if p == 2.0 {
        zip_map::<T>(op, g, x, |g, x| (g + g) * x)
    } else if let Some(k) = integer_exponent(q) {
        zip_map::<T>(op, g, x, |g, x| g * pt * x.powi(k))
    } else {
        zip_map::<T>(op, g, x, |g, x| g * pt * x.powf(qt))
    }
}
