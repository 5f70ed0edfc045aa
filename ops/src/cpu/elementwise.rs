//! Elementwise loops shared by the CPU kernels (unary and binary ops, losses, pooling, batch
//! norm): one function applied to every element of one or two slices, compiled for the widest
//! vector instructions the CPU has (chosen at run time) and forked onto rayon only when the work
//! is large and there is more than one thread.

use rayon::prelude::*;
use tandem_core::{Element, FloatElement, MemoryFormat, Result, Tensor};

use super::memory;
use super::parallel::parallel;
use super::simd::wide_simd_fn;

/// Elements per rayon task: large enough to amortise the fork, small enough to balance.
const CHUNK: usize = 1 << 13;

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

/// A new tensor with `f` applied to each element of `x` (any layout, dtype `T`): dense in
/// `x`'s format when `x` is dense row-major or channels-last (computed in storage order),
/// row-major otherwise; an allocation that cannot be made is an error naming `op`.
pub(crate) fn map<T: FloatElement>(
    op: &'static str,
    x: &Tensor,
    f: impl Fn(T) -> T + Sync,
) -> Result<Tensor> {
    if x.numel() == 0 {
        return empty_like::<T>(x);
    }
    if let Some(format) = x.dense_format() {
        let src = x.read_dense_slice::<T>()?;
        let mut out = memory::uninit::<T>(op, src.len())?;
        map_slice(&src, &mut out, f);
        drop(src);
        Tensor::from_vec_in(out, x.dims(), x.device(), format)
    } else {
        // Gathering the strided elements already yields a fresh buffer: map it in place.
        let mut out = memory::gather::<T>(op, x)?;
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

/// A new tensor with `f(a, b)` of the matching elements of two same-shaped tensors (any
/// layouts, dtype `T`), computed in storage order. The output is dense in the format of the
/// first operand that is dense in one (PyTorch's rule: the first operand decides), row-major
/// when neither is; the other operand is copied into that format when it differs. An
/// allocation that cannot be made is an error naming `op`.
pub(crate) fn zip_map<T: FloatElement>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(T, T) -> T + Sync,
) -> Result<Tensor> {
    if a.numel() == 0 {
        return empty_like::<T>(a);
    }
    let format = a
        .dense_format()
        .or(b.dense_format())
        .unwrap_or(MemoryFormat::Contiguous);
    let (ca, cb) = (memory::dense_in(a, format)?, memory::dense_in(b, format)?);
    let (x, y) = (ca.read_dense_slice::<T>()?, cb.read_dense_slice::<T>()?);
    let mut out = memory::uninit::<T>(op, x.len())?;
    zip_slices(&x, &y, &mut out, f);
    drop((x, y));
    Tensor::from_vec_in(out, a.dims(), a.device(), format)
}

/// A fresh tensor of `x`'s zero-element shape. Kernels return it early: a zero-size layout
/// may not count as contiguous (e.g. `[2, 0]`), so the slice path must not see one.
pub(crate) fn empty_like<T: FloatElement>(x: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(Vec::<T>::new(), x.dims(), x.device())
}
