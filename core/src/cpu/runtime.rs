//! The runtime's own kernels on host memory: reading elements out, fill, copy, scale,
//! accumulate and cast. [`Tensor`]'s device-neutral methods (`core/src/access.rs`) call these
//! for CPU tensors; any layout (views, broadcasts, offsets) is handled here.

use crate::{
    with_element_type, with_half_type, DType, Element, FloatElement, HalfElement, Layout, Result,
    Tensor,
};

/// The elements of a CPU tensor in row-major order (any layout).
pub(crate) fn to_vec<T: Element>(t: &Tensor) -> Result<Vec<T>> {
    let guard = t.storage().read_host("to_vec")?;
    let data = T::slice(&guard).expect("dtype checked by the caller");
    if t.is_contiguous() {
        let off = t.layout().offset();
        let mut out = crate::alloc::try_uninit::<T>("to_vec", t.numel())?;
        out.copy_from_slice(&data[off..off + t.numel()]);
        return Ok(out);
    }
    let mut out = crate::alloc::try_uninit::<T>("to_vec", t.numel())?;
    let row_len = t.dims().last().copied().unwrap_or(1);
    let mut rows = out.chunks_mut(row_len.max(1));
    t.layout().for_each_row(|start, stride| {
        let row = rows.next().expect("one output row per layout row");
        if stride == 1 {
            row.copy_from_slice(&data[start..start + row.len()]);
        } else {
            for (j, v) in row.iter_mut().enumerate() {
                *v = data[start + j * stride];
            }
        }
    });
    Ok(out)
}

/// Applies `f` to every element of `t` in place.
pub(crate) fn map_in_place<T: Element>(
    op: &'static str,
    t: &Tensor,
    mut f: impl FnMut(&mut T),
) -> Result<()> {
    let layout = t.layout().clone();
    let mut guard = t.storage().write_host(op)?;
    let data = T::slice_mut(&mut guard).expect("dtype checked by the caller");
    // A dense tensor (row-major or channels-last) covers one run of its storage: `f` applies
    // to each element alone, so the run is walked in storage order.
    if layout.is_contiguous() || layout.is_contiguous_in(crate::MemoryFormat::ChannelsLast) {
        let off = layout.offset();
        data[off..off + layout.numel()].iter_mut().for_each(f);
    } else {
        layout.for_each_index(|i| f(&mut data[i]));
    }
    Ok(())
}

/// The common case of [`zip_in_place`] (gradient accumulation, optimizer updates): two dense
/// buffers whose storage orders agree (both row-major, or both channels-last), in different
/// storages, handed to `f` as the two runs of storage they cover. `false` (nothing done) for
/// any other pair.
fn zip_runs<T: Element>(
    op: &'static str,
    dst: &Tensor,
    src: &Tensor,
    f: impl FnOnce(&mut [T], &[T]),
) -> Result<bool> {
    let same_order = (dst.is_contiguous() && src.is_contiguous())
        || (dst.layout().is_channels_last()
            && src.layout().is_channels_last()
            && dst.layout().strides() == src.layout().strides());
    if !same_order || dst.storage().same_buffer(src.storage()) {
        return Ok(false);
    }
    let source = src.storage().read_host(op)?;
    let (at, n) = (src.layout().offset(), src.numel());
    let source = &T::slice(&source).expect("dtype checked")[at..at + n];
    let mut dest = dst.storage().write_host(op)?;
    let off = dst.layout().offset();
    let dest = &mut T::slice_mut(&mut dest).expect("dtype checked")[off..off + dst.numel()];
    f(dest, source);
    Ok(true)
}

/// Applies `f(dst, src)` elementwise in place (same shape and dtype, checked by the caller).
/// Reading from the same storage as the destination is handled by copying the source first.
pub(crate) fn zip_in_place<T: Element>(
    op: &'static str,
    dst: &Tensor,
    src: &Tensor,
    mut f: impl FnMut(&mut T, T),
) -> Result<()> {
    if zip_runs::<T>(op, dst, src, |d, s| {
        d.iter_mut().zip(s).for_each(|(d, &s)| f(d, s))
    })? {
        return Ok(());
    }
    let src_values: Vec<T> = to_vec::<T>(src)?;
    let layout: Layout = dst.layout().clone();
    {
        let mut guard = dst.storage().write_host(op)?;
        let data = T::slice_mut(&mut guard).expect("dtype checked");
        let mut k = 0;
        layout.for_each_index(|i| {
            f(&mut data[i], src_values[k]);
            k += 1;
        });
    }
    // The gathered copy came from the caching allocator: hand it back, or the next request of
    // its size misses the cache (and pays for fresh pages).
    crate::alloc::recycle(src_values);
    Ok(())
}

/// Sets every element to `value`.
pub(crate) fn fill(t: &Tensor, value: f64) -> Result<()> {
    with_element_type!(t.dtype(), T => {
        let v = T::from_f64(value);
        map_in_place::<T>("fill_", t, |x| *x = v)
    })
}

/// `dst = src`, elementwise.
pub(crate) fn copy(dst: &Tensor, src: &Tensor) -> Result<()> {
    with_element_type!(dst.dtype(), T => zip_in_place::<T>("copy_", dst, src, |d, s| *d = s))
}

/// `t *= factor` (f32, f64).
pub(crate) fn scale<T: FloatElement>(t: &Tensor, factor: f64) -> Result<()> {
    let f = T::from_f64(factor);
    map_in_place::<T>("scale_", t, |x| *x *= f)
}

/// `dst += alpha * src` (f32, f64).
pub(crate) fn add_scaled<T: FloatElement>(dst: &Tensor, src: &Tensor, alpha: f64) -> Result<()> {
    let a = T::from_f64(alpha);
    zip_in_place::<T>("add_scaled_", dst, src, |d, s| *d += a * s)
}

/// `t`'s elements mapped by `f` into a fresh tensor: in storage order, keeping the layout, when
/// `t` is channels-last; else in row-major order, contiguous.
fn convert<S: Element, T: Element>(t: &Tensor, f: impl Fn(S) -> T) -> Result<Tensor> {
    if t.layout().is_channels_last() {
        let values: Vec<T> = t.read_dense_slice::<S>()?.iter().map(|&x| f(x)).collect();
        return Tensor::from_vec_in(
            values,
            t.dims(),
            t.device(),
            crate::MemoryFormat::ChannelsLast,
        );
    }
    let values: Vec<T> = to_vec::<S>(t)?.into_iter().map(f).collect();
    Tensor::from_vec(values, t.dims(), t.device())
}

/// `t *= factor` for a 16-bit float `t`, computed in f32 and rounded once.
pub(crate) fn scale_half<T: HalfElement>(t: &Tensor, factor: f64) -> Result<()> {
    let f = factor as f32;
    map_in_place::<T>("scale_", t, |x| *x = T::from_f32(x.to_f32() * f))
}

/// `dst += alpha * src` for 16-bit floats, computed in f32 and rounded once.
pub(crate) fn add_scaled_half<T: HalfElement>(
    dst: &Tensor,
    src: &Tensor,
    alpha: f64,
) -> Result<()> {
    let a = alpha as f32;
    // Dense pairs in chunks through the vector conversions (the same values: each element is
    // widened exactly, added in f32 and rounded to nearest even).
    const CHUNK: usize = 512;
    let done = zip_runs::<T>("add_scaled_", dst, src, |dest, source| {
        let (mut d32, mut s32) = ([0f32; CHUNK], [0f32; CHUNK]);
        for (d, s) in dest.chunks_mut(CHUNK).zip(source.chunks(CHUNK)) {
            let (dw, sw) = (&mut d32[..d.len()], &mut s32[..d.len()]);
            crate::cpu::convert::widen(d, dw);
            crate::cpu::convert::widen(s, sw);
            dw.iter_mut().zip(sw.iter()).for_each(|(d, s)| *d += a * s);
            crate::cpu::convert::narrow(dw, d);
        }
    })?;
    if done {
        return Ok(());
    }
    zip_in_place::<T>("add_scaled_", dst, src, |d, s| {
        *d = T::from_f32(d.to_f32() + a * s.to_f32())
    })
}

/// `t`'s elements converted to `dtype`, as a fresh CPU tensor (rounds to nearest for floats,
/// truncates toward zero and saturates for integers). A channels-last tensor stays
/// channels-last (PyTorch's `preserve_format`: the conversion runs in storage order); any other
/// layout gives a contiguous result.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    // Mixed precision widens and rounds between f32 and the 16-bit floats on every op: a dense
    // tensor (row-major or channels-last) converts in storage order with the vector
    // conversions of `convert.rs`, keeping its memory format; a strided view is gathered first.
    if t.dtype() == DType::F32 && dtype.is_half() {
        return with_half_type!("cast", dtype, T => convert_dense::<f32, T>(t, crate::cpu::convert::narrow));
    }
    if t.dtype().is_half() && dtype == DType::F32 {
        return with_half_type!("cast", t.dtype(), S => convert_dense::<S, f32>(t, crate::cpu::convert::widen));
    }
    let wide = with_element_type!(t.dtype(), S => convert::<S, f64>(t, |x| x.to_f64()))?;
    with_element_type!(dtype, T => convert::<f64, T>(&wide, T::from_f64))
}

/// Elements converted per rayon task by [`convert_dense`].
const CONVERT_CHUNK: usize = 1 << 15;

/// `t` (of dtype `S`) converted to `D` by the slice conversion `f`: in storage order into a
/// tensor of the same memory format when `t` is dense in one, else gathered row-major first.
/// Large tensors convert in parallel chunks.
fn convert_dense<S: Element, D: Element>(
    t: &Tensor,
    f: impl Fn(&[S], &mut [D]) + Sync,
) -> Result<Tensor> {
    let run = |src: &[S], format: crate::MemoryFormat| -> Result<Tensor> {
        let mut out = crate::alloc::try_uninit::<D>("cast", src.len())?;
        if src.len() >= 2 * CONVERT_CHUNK && rayon::current_num_threads() > 1 {
            use rayon::prelude::*;
            out.par_chunks_mut(CONVERT_CHUNK)
                .zip(src.par_chunks(CONVERT_CHUNK))
                .for_each(|(d, s)| f(s, d));
        } else {
            f(src, &mut out);
        }
        Tensor::from_vec_in(out, t.dims(), t.device(), format)
    };
    match t.dense_format() {
        Some(format) => run(&t.read_dense_slice::<S>()?, format),
        None => run(&to_vec::<S>(t)?, crate::MemoryFormat::Contiguous),
    }
}
