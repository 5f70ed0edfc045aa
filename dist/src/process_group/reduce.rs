//! Element-wise reduction kernels over raw buffers, shared by every CPU backend.
//!
//! Collectives move bytes; reductions need numbers. These kernels view aligned byte buffers as
//! f32, f64, f16 or bf16 elements and combine them. Half types are widened to f32 for each
//! combination and rounded back, so f16/bf16 reduce in f32 precision per element. The order in
//! which contributions are combined is fixed by the caller (rank order, or the ring order),
//! never by timing, so results are reproducible and identical on every rank.

use std::ops::{Add, Div};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use tandem_core::{DType, Tensor};

use super::ReduceOp;

/// A byte buffer aligned for any element type (8 bytes), reused between collectives so that
/// large transfers do not pay for page faults on fresh allocations.
#[derive(Default)]
pub(crate) struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    /// Makes the buffer `len` bytes long, growing its allocation only when needed. The
    /// contents are unspecified.
    pub(crate) fn resize(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }

    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutably.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

/// Whether collectives can reduce elements of `dtype`.
pub(crate) fn is_reducible(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// The number type reductions compute in.
trait Accumulator: Copy + PartialOrd + Add<Output = Self> + Div<Output = Self> {
    fn from_count(n: usize) -> Self;
    fn is_nan(self) -> bool;
}

impl Accumulator for f32 {
    fn from_count(n: usize) -> Self {
        n as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Accumulator for f64 {
    fn from_count(n: usize) -> Self {
        n as f64
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// How one dtype is stored (`Raw`, a plain-old-data type) and computed in (`Acc`).
trait Codec {
    type Raw: bytemuck::Pod;
    type Acc: Accumulator;
    fn widen(raw: Self::Raw) -> Self::Acc;
    fn narrow(acc: Self::Acc) -> Self::Raw;
}

struct F32Codec;
struct F64Codec;
struct F16Codec;
struct BF16Codec;

impl Codec for F32Codec {
    type Raw = f32;
    type Acc = f32;
    #[inline(always)]
    fn widen(raw: f32) -> f32 {
        raw
    }
    #[inline(always)]
    fn narrow(acc: f32) -> f32 {
        acc
    }
}

impl Codec for F64Codec {
    type Raw = f64;
    type Acc = f64;
    #[inline(always)]
    fn widen(raw: f64) -> f64 {
        raw
    }
    #[inline(always)]
    fn narrow(acc: f64) -> f64 {
        acc
    }
}

impl Codec for F16Codec {
    type Raw = u16;
    type Acc = f32;
    #[inline(always)]
    fn widen(raw: u16) -> f32 {
        f16::from_bits(raw).to_f32()
    }
    #[inline(always)]
    fn narrow(acc: f32) -> u16 {
        f16::from_f32(acc).to_bits()
    }
}

impl Codec for BF16Codec {
    type Raw = u16;
    type Acc = f32;
    #[inline(always)]
    fn widen(raw: u16) -> f32 {
        bf16::from_bits(raw).to_f32()
    }
    #[inline(always)]
    fn narrow(acc: f32) -> u16 {
        bf16::from_f32(acc).to_bits()
    }
}

#[inline(always)]
fn sum<A: Accumulator>(a: A, b: A) -> A {
    a + b
}

/// NaN-propagating maximum; on ties keeps the first operand (so -0/+0 follow the fixed order).
#[inline(always)]
fn max<A: Accumulator>(a: A, b: A) -> A {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if b > a {
        b
    } else {
        a
    }
}

/// NaN-propagating minimum; on ties keeps the first operand.
#[inline(always)]
fn min<A: Accumulator>(a: A, b: A) -> A {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if b < a {
        b
    } else {
        a
    }
}

fn typed<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T], String> {
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| format!("buffer is not a whole number of aligned elements: {e}"))
}

fn typed_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T], String> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| format!("buffer is not a whole number of aligned elements: {e}"))
}

fn combine_into<C: Codec>(op: ReduceOp, acc: &mut [u8], src: &[u8]) -> Result<(), String> {
    let acc = typed_mut::<C::Raw>(acc)?;
    let src = typed::<C::Raw>(src)?;
    if acc.len() != src.len() {
        return Err(format!(
            "reducing {} elements with {}",
            acc.len(),
            src.len()
        ));
    }
    fn apply<C: Codec>(acc: &mut [C::Raw], src: &[C::Raw], f: impl Fn(C::Acc, C::Acc) -> C::Acc) {
        for (a, &s) in acc.iter_mut().zip(src) {
            *a = C::narrow(f(C::widen(*a), C::widen(s)));
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => apply::<C>(acc, src, sum),
        ReduceOp::Max => apply::<C>(acc, src, max),
        ReduceOp::Min => apply::<C>(acc, src, min),
    }
    Ok(())
}

fn divide_in_place<C: Codec>(buf: &mut [u8], divisor: usize) -> Result<(), String> {
    let d = C::Acc::from_count(divisor);
    for x in typed_mut::<C::Raw>(buf)? {
        *x = C::narrow(C::widen(*x) / d);
    }
    Ok(())
}

fn reduce_all_typed<C: Codec>(
    op: ReduceOp,
    sources: &[Option<&[u8]>],
    out: &mut [u8],
) -> Result<(), String> {
    const BLOCK: usize = 256;
    let out = typed_mut::<C::Raw>(out)?;
    let sources: Vec<Option<&[C::Raw]>> = sources
        .iter()
        .map(|s| s.map(typed::<C::Raw>).transpose())
        .collect::<Result<_, _>>()?;
    if let Some(bad) = sources.iter().flatten().find(|s| s.len() != out.len()) {
        return Err(format!(
            "reducing {} elements with {}",
            out.len(),
            bad.len()
        ));
    }
    if sources.is_empty() {
        return Err("no contributions to reduce".into());
    }
    let count = C::Acc::from_count(sources.len());
    let zero = C::widen(bytemuck::Zeroable::zeroed());
    let mut acc = [zero; BLOCK];
    // The current contents of `out`, for the source that is `out` itself.
    let mut own = [<C::Raw as bytemuck::Zeroable>::zeroed(); BLOCK];
    for start in (0..out.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(out.len());
        let (acc, own) = (&mut acc[..end - start], &mut own[..end - start]);
        own.copy_from_slice(&out[start..end]);
        let source = |k: usize| match sources[k] {
            Some(s) => &s[start..end],
            None => &own[..],
        };
        for (a, &x) in acc.iter_mut().zip(source(0)) {
            *a = C::widen(x);
        }
        for k in 1..sources.len() {
            let src = source(k);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => acc
                    .iter_mut()
                    .zip(src)
                    .for_each(|(a, &x)| *a = sum(*a, C::widen(x))),
                ReduceOp::Max => acc
                    .iter_mut()
                    .zip(src)
                    .for_each(|(a, &x)| *a = max(*a, C::widen(x))),
                ReduceOp::Min => acc
                    .iter_mut()
                    .zip(src)
                    .for_each(|(a, &x)| *a = min(*a, C::widen(x))),
            }
        }
        let average = op == ReduceOp::Avg;
        for (o, &a) in out[start..end].iter_mut().zip(acc.iter()) {
            *o = C::narrow(if average { a / count } else { a });
        }
    }
    Ok(())
}

macro_rules! by_codec {
    ($dtype:expr, $C:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $C = F32Codec;
                $body
            }
            DType::F64 => {
                type $C = F64Codec;
                $body
            }
            DType::F16 => {
                type $C = F16Codec;
                $body
            }
            DType::BF16 => {
                type $C = BF16Codec;
                $body
            }
            other => Err(format!(
                "cannot reduce {other} elements (supported: f32, f64, f16, bf16)"
            )),
        }
    };
}

/// `acc = acc ⊕ src` element-wise (for `Avg`, a sum; see [`divide`]).
pub(crate) fn combine(
    dtype: DType,
    op: ReduceOp,
    acc: &mut [u8],
    src: &[u8],
) -> Result<(), String> {
    by_codec!(dtype, C => combine_into::<C>(op, acc, src))
}

/// Divides every element by `divisor` (the last step of an average).
pub(crate) fn divide(dtype: DType, buf: &mut [u8], divisor: usize) -> Result<(), String> {
    by_codec!(dtype, C => divide_in_place::<C>(buf, divisor))
}

/// `out = sources[0] ⊕ sources[1] ⊕ …` in exactly that order, accumulating half types in f32
/// and rounding once; `Avg` divides the sum by the number of sources.
pub(crate) fn reduce_all(
    dtype: DType,
    op: ReduceOp,
    sources: &[&[u8]],
    out: &mut [u8],
) -> Result<(), String> {
    let sources: Vec<Option<&[u8]>> = sources.iter().map(|s| Some(*s)).collect();
    reduce_in_place(dtype, op, &sources, out)
}

/// Like [`reduce_all`], where a `None` source stands for the current contents of `out` (which
/// is then overwritten with the result).
pub(crate) fn reduce_in_place(
    dtype: DType,
    op: ReduceOp,
    sources: &[Option<&[u8]>],
    out: &mut [u8],
) -> Result<(), String> {
    by_codec!(dtype, C => reduce_all_typed::<C>(op, sources, out))
}

/// Runs `f` over the bytes of a contiguous CPU tensor (read lock held meanwhile).
pub(crate) fn with_tensor_bytes<R>(
    t: &Tensor,
    f: impl FnOnce(&[u8]) -> R,
) -> tandem_core::Result<R> {
    Ok(match t.dtype() {
        DType::F32 => f(bytemuck::cast_slice(&t.read_slice::<f32>()?)),
        DType::F64 => f(bytemuck::cast_slice(&t.read_slice::<f64>()?)),
        DType::F16 => f(bytemuck::cast_slice(
            t.read_slice::<f16>()?.reinterpret_cast(),
        )),
        DType::BF16 => f(bytemuck::cast_slice(
            t.read_slice::<bf16>()?.reinterpret_cast(),
        )),
        DType::I64 => f(bytemuck::cast_slice(&t.read_slice::<i64>()?)),
        DType::U8 => f(&t.read_slice::<u8>()?),
    })
}

/// Runs `f` over the bytes of a contiguous CPU tensor, mutably (write lock held meanwhile).
pub(crate) fn with_tensor_bytes_mut<R>(
    t: &Tensor,
    f: impl FnOnce(&mut [u8]) -> R,
) -> tandem_core::Result<R> {
    Ok(match t.dtype() {
        DType::F32 => f(bytemuck::cast_slice_mut(&mut t.write_slice::<f32>()?)),
        DType::F64 => f(bytemuck::cast_slice_mut(&mut t.write_slice::<f64>()?)),
        DType::F16 => f(bytemuck::cast_slice_mut(
            t.write_slice::<f16>()?.reinterpret_cast_mut(),
        )),
        DType::BF16 => f(bytemuck::cast_slice_mut(
            t.write_slice::<bf16>()?.reinterpret_cast_mut(),
        )),
        DType::I64 => f(bytemuck::cast_slice_mut(&mut t.write_slice::<i64>()?)),
        DType::U8 => f(&mut t.write_slice::<u8>()?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of(v: &[f32]) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.resize(v.len() * 4);
        b.bytes_mut().copy_from_slice(bytemuck::cast_slice(v));
        b
    }

    fn floats(b: &AlignedBuf) -> Vec<f32> {
        bytemuck::cast_slice::<u8, f32>(b.bytes()).to_vec()
    }

    #[test]
    fn reduce_all_folds_sources_in_the_given_order() {
        let a = bytes_of(&[1.0, 5.0, -1.0]);
        let b = bytes_of(&[2.0, 4.0, f32::NAN]);
        let c = bytes_of(&[3.0, 3.0, 0.0]);
        let mut out = bytes_of(&[0.0; 3]);
        let srcs = [a.bytes(), b.bytes(), c.bytes()];
        reduce_all(DType::F32, ReduceOp::Sum, &srcs, out.bytes_mut()).unwrap();
        let v = floats(&out);
        assert_eq!(&v[..2], &[6.0, 12.0]);
        assert!(v[2].is_nan());
        reduce_all(DType::F32, ReduceOp::Max, &srcs, out.bytes_mut()).unwrap();
        assert_eq!(&floats(&out)[..2], &[3.0, 5.0]);
        assert!(floats(&out)[2].is_nan(), "max propagates NaN");
        reduce_all(DType::F32, ReduceOp::Min, &srcs, out.bytes_mut()).unwrap();
        assert_eq!(&floats(&out)[..2], &[1.0, 3.0]);
        reduce_all(DType::F32, ReduceOp::Avg, &srcs, out.bytes_mut()).unwrap();
        assert_eq!(&floats(&out)[..2], &[2.0, 4.0]);
    }

    #[test]
    fn half_types_accumulate_in_f32_and_round_once() {
        // 2048 + 1 + 1 is not representable step by step in f16 (2049 rounds to 2048), but the
        // f32 accumulator carries the exact 2050.
        let to_bytes = |v: &[f32]| {
            let h: Vec<u16> = v.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
            let mut b = AlignedBuf::default();
            b.resize(h.len() * 2);
            b.bytes_mut().copy_from_slice(bytemuck::cast_slice(&h));
            b
        };
        let (a, b, c) = (to_bytes(&[2048.0]), to_bytes(&[1.0]), to_bytes(&[1.0]));
        let mut out = to_bytes(&[0.0]);
        reduce_all(
            DType::F16,
            ReduceOp::Sum,
            &[a.bytes(), b.bytes(), c.bytes()],
            out.bytes_mut(),
        )
        .unwrap();
        let got = f16::from_bits(bytemuck::cast_slice::<u8, u16>(out.bytes())[0]).to_f32();
        assert_eq!(got, 2050.0);
    }

    #[test]
    fn combine_and_divide_make_an_average() {
        let mut acc = bytes_of(&[1.0, 2.0]);
        let src = bytes_of(&[3.0, 6.0]);
        combine(DType::F32, ReduceOp::Avg, acc.bytes_mut(), src.bytes()).unwrap();
        divide(DType::F32, acc.bytes_mut(), 2).unwrap();
        assert_eq!(floats(&acc), vec![2.0, 4.0]);
    }

    #[test]
    fn integers_are_refused_with_the_supported_list() {
        let mut acc = AlignedBuf::default();
        acc.resize(8);
        let src = [0u8; 8];
        let err = combine(DType::I64, ReduceOp::Sum, acc.bytes_mut(), &src).unwrap_err();
        assert!(
            err.contains("i64") && err.contains("f32, f64, f16, bf16"),
            "{err}"
        );
    }

    #[test]
    fn mismatched_lengths_are_an_error_not_a_panic() {
        let mut acc = bytes_of(&[1.0, 2.0]);
        let src = bytes_of(&[1.0]);
        assert!(combine(DType::F32, ReduceOp::Sum, acc.bytes_mut(), src.bytes()).is_err());
        assert!(combine(DType::F32, ReduceOp::Sum, acc.bytes_mut(), &[0u8; 3]).is_err());
    }
}
