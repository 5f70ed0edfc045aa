//! CPU kernels of the elementwise binary ops.

use rayon::prelude::*;
use tandem_core::{with_float_type, Element, FloatElement, Result, Tensor};

use crate::util::{for_each_index2, PARALLEL_THRESHOLD};

/// Which binary operation a kernel applies.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
}

#[inline(always)]
fn apply<T: FloatElement>(kind: BinaryKind, x: T, y: T) -> T {
    match kind {
        BinaryKind::Add => x + y,
        BinaryKind::Sub => x - y,
        BinaryKind::Mul => x * y,
        BinaryKind::Div => x / y,
    }
}

fn same_shape_kernel<T: FloatElement>(kind: BinaryKind, a: &[T], b: &[T], out: &mut [T]) {
    macro_rules! run {
        ($f:expr) => {
            if out.len() >= PARALLEL_THRESHOLD {
                out.par_chunks_mut(8192)
                    .zip(a.par_chunks(8192))
                    .zip(b.par_chunks(8192))
                    .for_each(|((o, x), y)| {
                        o.iter_mut()
                            .zip(x)
                            .zip(y)
                            .for_each(|((o, &x), &y)| *o = $f(x, y))
                    });
            } else {
                out.iter_mut()
                    .zip(a)
                    .zip(b)
                    .for_each(|((o, &x), &y)| *o = $f(x, y));
            }
        };
    }
    // One loop per kind so the compiler vectorises each.
    match kind {
        BinaryKind::Add => run!(|x: T, y: T| x + y),
        BinaryKind::Sub => run!(|x: T, y: T| x - y),
        BinaryKind::Mul => run!(|x: T, y: T| x * y),
        BinaryKind::Div => run!(|x: T, y: T| x / y),
    }
}

pub(crate) fn binary(
    op: &'static str,
    kind: BinaryKind,
    a: &Tensor,
    b: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
    with_float_type!(op, a.dtype(), T => {
        let n: usize = shape.iter().product();
        let mut out = vec![T::ZERO; n];
        if a.dims() == shape && b.dims() == shape && a.is_contiguous() && b.is_contiguous() {
            let (x, y) = (a.read_slice::<T>()?, b.read_slice::<T>()?);
            same_shape_kernel(kind, &x, &y, &mut out);
        } else {
            let la = a.layout().expand(op, shape)?;
            let lb = b.layout().expand(op, shape)?;
            let ga = a.storage().read();
            let gb = b.storage().read();
            let (x, y) = (T::slice(&ga).expect("dtype checked"), T::slice(&gb).expect("dtype checked"));
            for_each_index2(shape, (la.strides(), la.offset()), (lb.strides(), lb.offset()), |i, ia, ib| {
                out[i] = apply(kind, x[ia], y[ib]);
            });
        }
        Tensor::from_vec(out, shape, a.device())
    })
}

pub(crate) fn scalar(
    op: &'static str,
    a: &Tensor,
    f: impl Fn(f64) -> f64 + Sync,
) -> Result<Tensor> {
    with_float_type!(op, a.dtype(), T => {
        let c = a.contiguous_detached()?;
        let x = c.read_slice::<T>()?;
        let out: Vec<T> = if x.len() >= PARALLEL_THRESHOLD {
            x.par_iter().map(|&v| T::from_f64(f(v.to_f64()))).collect()
        } else {
            x.iter().map(|&v| T::from_f64(f(v.to_f64()))).collect()
        };
        Tensor::from_vec(out, a.dims(), a.device())
    })
}
