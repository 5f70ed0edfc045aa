//! CPU kernels of the elementwise binary ops. Same-shape contiguous operands (the residual
//! `add` of a ResNet block, for one) go through the vector-dispatched [`zip_slices`];
//! broadcasting walks the strided indices. `add_relu` (the join of a ResNet
//! block) adds and clamps in that same one pass.

use tandem_core::{with_float_type, Element, FloatElement, Result, Tensor};

use crate::cpu::elementwise::{map_slice, zip_slices};
use crate::cpu::memory::{self, host_slice};
use crate::cpu::strided::for_each_index2;

use super::shape::BinaryKind;

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
    // One loop per kind so the compiler vectorises each.
    match kind {
        BinaryKind::Add => zip_slices(a, b, out, |x: T, y: T| x + y),
        BinaryKind::Sub => zip_slices(a, b, out, |x: T, y: T| x - y),
        BinaryKind::Mul => zip_slices(a, b, out, |x: T, y: T| x * y),
        BinaryKind::Div => zip_slices(a, b, out, |x: T, y: T| x / y),
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
        let n = tandem_core::checked_numel(op, shape)?;
        // Both paths below write every element.
        let mut out = memory::uninit::<T>(op, n)?;
        if a.dims() == shape && b.dims() == shape && a.is_contiguous() && b.is_contiguous() {
            let (x, y) = (a.read_slice::<T>()?, b.read_slice::<T>()?);
            same_shape_kernel(kind, &x, &y, &mut out);
        } else {
            let la = a.layout().expand(op, shape)?;
            let lb = b.layout().expand(op, shape)?;
            let ga = a.storage().read_host(op)?;
            let gb = b.storage().read_host(op)?;
            let (x, y) = (host_slice::<T>(op, &ga)?, host_slice::<T>(op, &gb)?);
            for_each_index2(shape, (la.strides(), la.offset()), (lb.strides(), lb.offset()), |i, ia, ib| {
                out[i] = apply(kind, x[ia], y[ib]);
            });
        }
        Tensor::from_vec(out, shape, a.device())
    })
}

/// `max(0, a + b)` of two contiguous tensors of the same shape, in one pass (NaN stays NaN,
/// as in `relu`).
pub(crate) fn add_relu(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    with_float_type!(op, a.dtype(), T => {
        let (x, y) = (a.read_slice::<T>()?, b.read_slice::<T>()?);
        // Every element is written.
        let mut out = memory::uninit::<T>(op, x.len())?;
        zip_slices(&x, &y, &mut out, |x: T, y: T| {
            let s = x + y;
            if s < T::ZERO {
                T::ZERO
            } else {
                s
            }
        });
        drop((x, y));
        Tensor::from_vec(out, a.dims(), a.device())
    })
}

pub(crate) fn scalar(
    op: &'static str,
    a: &Tensor,
    f: impl Fn(f64) -> f64 + Sync,
) -> Result<Tensor> {
    with_float_type!(op, a.dtype(), T => {
        let c = memory::contiguous(op, a)?;
        let x = c.read_slice::<T>()?;
        let mut out = memory::uninit::<T>(op, x.len())?;
        map_slice(&x, &mut out, |v: T| T::from_f64(f(v.to_f64())));
        drop(x);
        Tensor::from_vec(out, a.dims(), a.device())
    })
}
