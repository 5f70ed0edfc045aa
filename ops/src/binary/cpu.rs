//! CPU kernels of the elementwise binary ops. Same-shape contiguous operands (the residual
//! `add` of a ResNet block, for one) go through the vector-dispatched [`zip_slices`];
//! broadcasting walks the strided indices. `add_relu` (the join of a ResNet
//! block) adds and clamps in that same one pass.

use tandem_core::{with_float_type, Element, FloatElement, MemoryFormat, Result, Tensor};

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

/// The memory format of a binary op's output (PyTorch's rule, simplified): that of the first
/// operand that has the output's full shape and is not expanded (a broadcast operand, or one
/// with a stride of 0, has no say), row-major when neither has or the output is not 4-D.
pub(crate) fn output_format(a: &Tensor, b: &Tensor, shape: &[usize]) -> MemoryFormat {
    let has_say = |t: &Tensor| {
        t.dims() == shape
            && t.dims()
                .iter()
                .zip(t.layout().strides())
                .all(|(&n, &s)| n == 1 || s != 0)
    };
    if shape.len() != 4 {
        MemoryFormat::Contiguous
    } else if has_say(a) {
        a.memory_format()
    } else if has_say(b) {
        b.memory_format()
    } else {
        MemoryFormat::Contiguous
    }
}

/// The output dims in the order of `format`'s storage (NHWC for channels-last): walking them
/// row-major walks the output's storage in order.
const CHANNELS_LAST_ORDER: [usize; 4] = [0, 2, 3, 1];

pub(crate) fn binary(
    op: &'static str,
    kind: BinaryKind,
    a: &Tensor,
    b: &Tensor,
    shape: &[usize],
) -> Result<Tensor> {
    let format = output_format(a, b, shape);
    with_float_type!(op, a.dtype(), T => {
        let n = tandem_core::checked_numel(op, shape)?;
        // Both paths below write every element.
        let mut out = memory::uninit::<T>(op, n)?;
        let same = a.dims() == shape && b.dims() == shape;
        if same && a.is_contiguous_in(format) && b.is_contiguous_in(format) {
            // Same-format operands: one pass in storage order.
            let (x, y) = (a.read_dense_slice::<T>()?, b.read_dense_slice::<T>()?);
            same_shape_kernel(kind, &x, &y, &mut out);
        } else {
            let (mut la, mut lb) = (a.layout().expand(op, shape)?, b.layout().expand(op, shape)?);
            let mut walk = shape.to_vec();
            if format == MemoryFormat::ChannelsLast {
                // Walk in NHWC order so the output is written in its storage order.
                la = la.permute(op, &CHANNELS_LAST_ORDER)?;
                lb = lb.permute(op, &CHANNELS_LAST_ORDER)?;
                walk = CHANNELS_LAST_ORDER.iter().map(|&d| shape[d]).collect();
            }
            let ga = a.storage().read_host(op)?;
            let gb = b.storage().read_host(op)?;
            let (x, y) = (host_slice::<T>(op, &ga)?, host_slice::<T>(op, &gb)?);
            for_each_index2(&walk, (la.strides(), la.offset()), (lb.strides(), lb.offset()), |i, ia, ib| {
                out[i] = apply(kind, x[ia], y[ib]);
            });
        }
        Tensor::from_vec_in(out, shape, a.device(), format)
    })
}

/// `max(0, a + b)` of two tensors of the same shape dense in the same format (row-major or
/// channels-last), in one pass in storage order (NaN stays NaN, as in `relu`); the output has
/// `a`'s format.
pub(crate) fn add_relu(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let format = a.dense_format().unwrap_or(MemoryFormat::Contiguous);
    with_float_type!(op, a.dtype(), T => {
        let (x, y) = (a.read_dense_slice::<T>()?, b.read_dense_slice::<T>()?);
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
        Tensor::from_vec_in(out, a.dims(), a.device(), format)
    })
}

/// `f(a)` elementwise for the scalar ops, in storage order; the output keeps `a`'s format when
/// `a` is dense in one (row-major otherwise).
pub(crate) fn scalar(
    op: &'static str,
    a: &Tensor,
    f: impl Fn(f64) -> f64 + Sync,
) -> Result<Tensor> {
    let format = a.dense_format().unwrap_or(MemoryFormat::Contiguous);
    with_float_type!(op, a.dtype(), T => {
        let c = memory::dense_in(a, format)?;
        let x = c.read_dense_slice::<T>()?;
        let mut out = memory::uninit::<T>(op, x.len())?;
        map_slice(&x, &mut out, |v: T| T::from_f64(f(v.to_f64())));
        drop(x);
        Tensor::from_vec_in(out, a.dims(), a.device(), format)
    })
}
