//! CPU kernels of softmax and log_softmax and their backward.
//!
//! The input is read as `[outer, n, inner]`, `n` being the softmax dim. When `inner == 1`
//! (softmax over the last dim, the usual case) each row is contiguous and is processed with
//! lane-wise max/sum loops; otherwise a `[n, inner]` block is processed a row at a time with
//! per-column running max/sum vectors, so the loops stay contiguous and vectorise either way.
//! Stability comes from subtracting each group's maximum before exponentiating.

use rayon::prelude::*;
use tandem_core::{Element, Result, Tensor};

use crate::cpu::elementwise::empty_like;
use crate::cpu::exp::ExpFloat;
use crate::cpu::lanes::{lanes_max, lanes_sum, lanes_sum_exp};
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

use super::shape::Split;

/// Runs `f` on each `[n, inner]` block of the input and output (and of a third operand for
/// backward), in parallel when the tensor is large.
fn for_each_block<T: Element>(
    split: Split,
    out: &mut [T],
    a: &[T],
    b: Option<&[T]>,
    f: impl Fn(&mut [T], &[T], &[T]) + Sync,
) {
    let block = split.n * split.inner;
    if block == 0 {
        return;
    }
    let b = b.unwrap_or(a);
    if parallel(out.len()) && split.outer > 1 {
        out.par_chunks_mut(block)
            .zip(a.par_chunks(block))
            .zip(b.par_chunks(block))
            .for_each(|((o, a), b)| f(o, a, b));
    } else {
        out.chunks_mut(block)
            .zip(a.chunks(block))
            .zip(b.chunks(block))
            .for_each(|((o, a), b)| f(o, a, b));
    }
}

/// softmax (or log_softmax when `log`) of `x` along the middle dim of `split`.
pub(crate) fn forward<T: ExpFloat>(x: &Tensor, split: Split, log: bool) -> Result<Tensor> {
    if x.numel() == 0 {
        return empty_like::<T>(x);
    }
    let op = if log { "log_softmax" } else { "softmax" };
    let c = memory::contiguous(op, x)?;
    let data = c.read_slice::<T>()?;
    let mut out = memory::uninit::<T>(op, data.len())?;
    for_each_block(split, &mut out, &data, None, |y, x, _| {
        if split.inner == 1 {
            row_forward(x, y, log)
        } else {
            block_forward(x, y, split, log)
        }
    });
    drop(data);
    Tensor::from_vec(out, x.dims(), x.device())
}

fn row_forward<T: ExpFloat>(x: &[T], y: &mut [T], log: bool) {
    let m = lanes_max(x);
    if log {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = x - m;
        }
        let s = lanes_sum_exp(y, T::ZERO);
        let ls = s.ln();
        y.iter_mut().for_each(|y| *y -= ls);
    } else {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = (x - m).exp_fast();
        }
        let inv = T::one() / lanes_sum(y);
        y.iter_mut().for_each(|y| *y *= inv);
    }
}

fn block_forward<T: ExpFloat>(x: &[T], y: &mut [T], split: Split, log: bool) {
    let inner = split.inner;
    let mut m = vec![T::neg_infinity(); inner];
    for row in x.chunks_exact(inner) {
        for (m, &v) in m.iter_mut().zip(row) {
            if v > *m {
                *m = v;
            }
        }
    }
    let mut s = vec![T::ZERO; inner];
    for (yr, xr) in y.chunks_exact_mut(inner).zip(x.chunks_exact(inner)) {
        for (((y, &x), &m), s) in yr.iter_mut().zip(xr).zip(&m).zip(s.iter_mut()) {
            let shifted = x - m;
            let e = shifted.exp_fast();
            *s += e;
            *y = if log { shifted } else { e };
        }
    }
    if log {
        s.iter_mut().for_each(|s| *s = s.ln());
        for yr in y.chunks_exact_mut(inner) {
            yr.iter_mut().zip(&s).for_each(|(y, &ls)| *y -= ls);
        }
    } else {
        s.iter_mut().for_each(|s| *s = T::one() / *s);
        for yr in y.chunks_exact_mut(inner) {
            yr.iter_mut().zip(&s).for_each(|(y, &inv)| *y *= inv);
        }
    }
}

/// The input gradient from the output gradient `g` and the saved output `y`:
/// softmax: `y ⊙ (g − Σ g⊙y)`; log_softmax: `g − exp(y) ⊙ Σ g`.
pub(crate) fn backward<T: ExpFloat>(
    g: &Tensor,
    y: &Tensor,
    split: Split,
    log: bool,
) -> Result<Tensor> {
    if g.numel() == 0 {
        return empty_like::<T>(g);
    }
    let op = if log { "log_softmax" } else { "softmax" };
    let (gc, yc) = (memory::contiguous(op, g)?, memory::contiguous(op, y)?);
    let (gs, ys) = (gc.read_slice::<T>()?, yc.read_slice::<T>()?);
    let mut out = memory::uninit::<T>(op, gs.len())?;
    for_each_block(split, &mut out, &gs, Some(&ys), |dx, g, y| {
        if split.inner == 1 {
            row_backward(g, y, dx, log)
        } else {
            block_backward(g, y, dx, split.inner, log)
        }
    });
    drop((gs, ys));
    Tensor::from_vec(out, g.dims(), g.device())
}

fn row_backward<T: ExpFloat>(g: &[T], y: &[T], dx: &mut [T], log: bool) {
    if log {
        let total = lanes_sum(g);
        for ((dx, &g), &y) in dx.iter_mut().zip(g).zip(y) {
            *dx = g - y.exp_fast() * total;
        }
    } else {
        for ((dx, &g), &y) in dx.iter_mut().zip(g).zip(y) {
            *dx = g * y;
        }
        let dot = lanes_sum(dx);
        for (dx, &y) in dx.iter_mut().zip(y) {
            *dx -= y * dot;
        }
    }
}

fn block_backward<T: ExpFloat>(g: &[T], y: &[T], dx: &mut [T], inner: usize, log: bool) {
    let mut acc = vec![T::ZERO; inner];
    for (gr, yr) in g.chunks_exact(inner).zip(y.chunks_exact(inner)) {
        for ((a, &g), &y) in acc.iter_mut().zip(gr).zip(yr) {
            *a += if log { g } else { g * y };
        }
    }
    for ((dr, gr), yr) in dx
        .chunks_exact_mut(inner)
        .zip(g.chunks_exact(inner))
        .zip(y.chunks_exact(inner))
    {
        for (((dx, &g), &y), &a) in dr.iter_mut().zip(gr).zip(yr).zip(&acc) {
            *dx = if log {
                g - y.exp_fast() * a
            } else {
                y * (g - a)
            };
        }
    }
}
