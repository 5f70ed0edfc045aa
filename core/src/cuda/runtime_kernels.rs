//! Launch plans for the runtime's own kernels (`kernels/runtime.cu`): fill, copy, cast, scale,
//! add_scaled and the two passes of a p-norm.
//!
//! Each builder is a pure function from device addresses, dtypes, layouts and scalars to a
//! [`Launch`]; the CUDA runtime executes it on a device and the host harness on the CPU. The
//! builders check everything the kernel relies on: shapes and dtypes, the dtypes a kernel
//! exists for, that no two elements of a destination share memory (each element is written by
//! one thread), that a source does not overlap its destination (unless it is the very same
//! view, which elementwise kernels handle), and that byte addresses do not overflow. Scalars are
//! converted to the tensor's dtype here, exactly as the CPU op converts them.

use half::{bf16, f16};

use super::launch::{index_u32, KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use crate::{DType, Error, Layout, Result};

/// `runtime.cu`, embedded.
pub static RUNTIME: KernelSource = KernelSource {
    name: "runtime",
    source: include_str!("kernels/runtime.cu"),
    headers: &[],
};

/// Threads per block of the runtime's elementwise kernels.
pub const THREADS_PER_BLOCK: u32 = 256;

/// A tensor in device memory: its storage's base address, dtype and layout (offset and strides
/// in elements from that base).
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a> {
    /// Address of the storage's first element.
    pub ptr: u64,
    /// Element type.
    pub dtype: DType,
    /// Shape, strides and offset.
    pub layout: &'a Layout,
}

impl DeviceView<'_> {
    /// The device address of the view's first element (`ptr + offset·size`); errors when the
    /// address would overflow. The one place the offset-to-bytes arithmetic is written.
    pub fn first_element(&self, op: &'static str) -> Result<u64> {
        (self.layout.offset() as u64)
            .checked_mul(self.dtype.size_in_bytes() as u64)
            .and_then(|bytes| self.ptr.checked_add(bytes))
            .ok_or_else(|| {
                Error::invalid(
                    op,
                    format!(
                        "layout {:?} at address {:#x} overflows a 64-bit address",
                        self.layout, self.ptr
                    ),
                )
            })
    }

    /// The byte range `[start, end)` the view touches (empty for no elements); errors when an
    /// address would overflow or the base is null.
    fn byte_range(&self, op: &'static str) -> Result<(u64, u64)> {
        if self.layout.numel() == 0 {
            return Ok((self.ptr, self.ptr));
        }
        let size = self.dtype.size_in_bytes() as u64;
        let at = |elements: usize| {
            (elements as u64)
                .checked_mul(size)
                .and_then(|bytes| self.ptr.checked_add(bytes))
        };
        match (
            self.ptr,
            at(self.layout.offset()),
            at(self.layout.storage_extent()),
        ) {
            (0, _, _) => Err(Error::invalid(
                op,
                "null device pointer for a non-empty tensor",
            )),
            (_, Some(start), Some(end)) => Ok((start, end)),
            _ => Err(Error::invalid(
                op,
                format!(
                    "layout {:?} at address {:#x} reaches beyond the 64-bit address space",
                    self.layout, self.ptr
                ),
            )),
        }
    }
}

/// Which reduction `norm_partial` computes, for a p-norm of order `p`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// Σ x² (p = 2).
    SumSquares,
    /// Σ |x| (p = 1).
    SumAbs,
    /// max |x|, a NaN winning (p = ∞).
    MaxAbs,
    /// Σ |x|^p (any other finite p > 0).
    SumPow(f64),
}

impl NormKind {
    /// The reduction for a norm of order `p` (`f64::INFINITY` for the maximum norm).
    pub fn for_order(p: f64) -> Self {
        if p == 2.0 {
            NormKind::SumSquares
        } else if p == 1.0 {
            NormKind::SumAbs
        } else if p == f64::INFINITY {
            NormKind::MaxAbs
        } else {
            NormKind::SumPow(p)
        }
    }

    /// The norm from the reduced value, as the CPU computes it (`reduced.powf(1 / p)`).
    pub fn finish(self, reduced: f64) -> f64 {
        match self {
            NormKind::MaxAbs => reduced,
            NormKind::SumSquares => reduced.powf(0.5),
            NormKind::SumAbs => reduced,
            NormKind::SumPow(p) => reduced.powf(1.0 / p),
        }
    }

    /// `kind` and `p` as the kernels take them (`TANDEM_NORM_*` in runtime.cu).
    fn kernel_args(self) -> (i32, f64) {
        match self {
            NormKind::SumSquares => (0, 2.0),
            NormKind::SumAbs => (1, 1.0),
            NormKind::MaxAbs => (2, f64::INFINITY),
            NormKind::SumPow(p) => (3, p),
        }
    }
}

const FLOAT_DTYPES: &str = "f32, f64, f16, bf16";

fn check_float(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            op,
            dtype,
            supported: FLOAT_DTYPES,
        })
    }
}

/// Whether two elements of `layout` may share a storage index. A sufficient test: sorted by
/// stride, each dimension (of size > 1) must step over everything the smaller ones span. Every
/// layout tandem's views make passes unless it is expanded (stride 0).
fn elements_overlap(layout: &Layout) -> bool {
    let mut dims: Vec<(usize, usize)> = layout
        .shape()
        .iter()
        .zip(layout.strides())
        .filter(|(&size, _)| size > 1)
        .map(|(&size, &stride)| (stride, size))
        .collect();
    dims.sort_unstable();
    let mut span = 0usize;
    for (stride, size) in dims {
        if stride <= span {
            return true;
        }
        span = span.saturating_add(stride.saturating_mul(size - 1));
    }
    false
}

fn check_destination(op: &'static str, dst: &DeviceView) -> Result<(u64, u64)> {
    if elements_overlap(dst.layout) {
        return Err(Error::invalid(
            op,
            format!(
                "destination elements overlap in memory (shape {:?}, strides {:?}, e.g. an \
                 expanded view); write to a contiguous tensor instead",
                dst.layout.shape().as_slice(),
                dst.layout.strides().as_slice()
            ),
        ));
    }
    dst.byte_range(op)
}

/// Whether `src` overlaps `dst` in memory other than as the very same view, which kernels that
/// read and write element `i` in the same thread handle. Callers copy the source first when
/// this is true; the builders refuse such pairs.
pub fn overlaps_other_than_same_view(dst: &DeviceView, src: &DeviceView) -> Result<bool> {
    let same_view = dst.ptr == src.ptr && dst.dtype == src.dtype && dst.layout == src.layout;
    Ok(views_share_memory(dst, src)? && !same_view)
}

/// Whether `a` and `b` touch a common byte, the very same view included (for kernels that must
/// not read what they write at all). Views of no elements share nothing, wherever they point:
/// every zero-byte allocation sits at address 0, so two empty tensors have the same pointer
/// and, for one shape, the same layout.
pub fn views_share_memory(a: &DeviceView, b: &DeviceView) -> Result<bool> {
    Ok(byte_ranges_overlap(
        a.byte_range("overlap check")?,
        b.byte_range("overlap check")?,
    ))
}

/// Whether the byte ranges `[a0, a1)` and `[b0, b1)` share a byte. An empty range shares none,
/// even one that starts inside the other.
pub fn byte_ranges_overlap((a0, a1): (u64, u64), (b0, b1): (u64, u64)) -> bool {
    a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
}

fn check_pair(op: &'static str, dst: &DeviceView, src: &DeviceView) -> Result<()> {
    if dst.layout.shape() != src.layout.shape() {
        return Err(Error::shape(
            op,
            format!(
                "destination {:?} vs source {:?}",
                dst.layout.shape().as_slice(),
                src.layout.shape().as_slice()
            ),
        ));
    }
    check_destination(op, dst)?;
    if overlaps_other_than_same_view(dst, src)? {
        return Err(Error::invalid(
            op,
            format!(
                "source ({} at {:#x}, {:?}) overlaps destination ({} at {:#x}, {:?}); copy the \
                 source first",
                src.dtype, src.ptr, src.layout, dst.dtype, dst.ptr, dst.layout
            ),
        ));
    }
    Ok(())
}

fn elementwise(op: &'static str, kernel: String, n: usize, args: Vec<KernelArg>) -> Result<Launch> {
    Ok(Launch {
        source: &RUNTIME,
        kernel,
        config: LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        args,
    })
}

fn layout_arg(op: &'static str, layout: &Layout) -> Result<KernelArg> {
    Ok(KernelArg::pod(&StridedLayout::new(op, layout)?))
}

/// `value` converted to `dtype` as the CPU converts it (`Element::from_f64`), as a kernel
/// argument of that dtype.
fn value_arg(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F32 => KernelArg::F32(value as f32),
        DType::F64 => KernelArg::F64(value),
        DType::F16 => KernelArg::U16(f16::from_f64(value).to_bits()),
        DType::BF16 => KernelArg::U16(bf16::from_f64(value).to_bits()),
        DType::I64 => KernelArg::I64(value as i64),
        DType::U8 => KernelArg::U8(value as u8),
    }
}

/// A scalar in the dtype's compute type (float for f16 and bf16).
fn compute_arg(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F64 => KernelArg::F64(value),
        _ => KernelArg::F32(value as f32),
    }
}

/// `fill_` : every element of `dst` set to `value` (converted to its dtype). An expanded
/// destination is allowed: every copy of an element gets the same value.
pub fn fill_launch(dst: DeviceView, value: f64) -> Result<Launch> {
    let op = "fill_";
    dst.byte_range(op)?;
    let n = dst.layout.numel();
    elementwise(
        op,
        format!("fill_{}", dst.dtype),
        n,
        vec![
            KernelArg::Out(dst.ptr),
            layout_arg(op, dst.layout)?,
            KernelArg::U64(n as u64),
            value_arg(dst.dtype, value),
        ],
    )
}

/// `copy_`: `src`'s elements into `dst` (same shape and dtype; any layouts).
pub fn copy_launch(dst: DeviceView, src: DeviceView) -> Result<Launch> {
    let op = "copy_";
    if dst.dtype != src.dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype,
            rhs: src.dtype,
        });
    }
    check_pair(op, &dst, &src)?;
    let n = dst.layout.numel();
    elementwise(
        op,
        format!("copy_{}", dst.dtype),
        n,
        vec![
            KernelArg::Out(dst.ptr),
            layout_arg(op, dst.layout)?,
            KernelArg::In(src.ptr),
            layout_arg(op, src.layout)?,
            KernelArg::U64(n as u64),
        ],
    )
}

/// `to_dtype`: `src`'s elements converted into `dst` (same shape, any dtypes and layouts), with
/// the CPU's semantics: through f64, floats rounded to nearest even, floats to integers
/// truncated toward zero and saturated, NaN to 0. The same dtype is a copy.
pub fn cast_launch(dst: DeviceView, src: DeviceView) -> Result<Launch> {
    if dst.dtype == src.dtype {
        return copy_launch(dst, src);
    }
    let op = "to_dtype";
    check_pair(op, &dst, &src)?;
    let n = dst.layout.numel();
    elementwise(
        op,
        format!("cast_{}_{}", src.dtype, dst.dtype),
        n,
        vec![
            KernelArg::Out(dst.ptr),
            layout_arg(op, dst.layout)?,
            KernelArg::In(src.ptr),
            layout_arg(op, src.layout)?,
            KernelArg::U64(n as u64),
        ],
    )
}

/// `scale_`: `x *= factor` for every element (float dtypes; f16 and bf16 computed in f32).
pub fn scale_launch(dst: DeviceView, factor: f64) -> Result<Launch> {
    let op = "scale_";
    check_float(op, dst.dtype)?;
    check_destination(op, &dst)?;
    let n = dst.layout.numel();
    elementwise(
        op,
        format!("scale_{}", dst.dtype),
        n,
        vec![
            KernelArg::Out(dst.ptr),
            layout_arg(op, dst.layout)?,
            KernelArg::U64(n as u64),
            compute_arg(dst.dtype, factor),
        ],
    )
}

/// `add_scaled_`: `dst += alpha * src` (same shape and float dtype; f16 and bf16 computed in
/// f32). The product is rounded before the sum, as on the CPU.
pub fn add_scaled_launch(dst: DeviceView, src: DeviceView, alpha: f64) -> Result<Launch> {
    let op = "add_scaled_";
    check_float(op, dst.dtype)?;
    if dst.dtype != src.dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype,
            rhs: src.dtype,
        });
    }
    check_pair(op, &dst, &src)?;
    let n = dst.layout.numel();
    elementwise(
        op,
        format!("add_scaled_{}", dst.dtype),
        n,
        vec![
            KernelArg::Out(dst.ptr),
            layout_arg(op, dst.layout)?,
            KernelArg::In(src.ptr),
            layout_arg(op, src.layout)?,
            KernelArg::U64(n as u64),
            compute_arg(dst.dtype, alpha),
        ],
    )
}

/// The first pass of a norm: one partial result (f64) per block, written to
/// `partials[0..blocks)` where `blocks` is `launch.config.grid[0]`. Several tensors' partials may
/// go to one array at different offsets and be finished together by [`norm_finish_launch`].
pub fn norm_partial_launch(src: DeviceView, kind: NormKind, partials: u64) -> Result<Launch> {
    let op = "norm";
    check_float(op, src.dtype)?;
    src.byte_range(op)?;
    if let NormKind::SumPow(p) = kind {
        if !(p.is_finite() && p > 0.0) {
            return Err(Error::invalid(
                op,
                format!("norm order p must be finite and > 0, got {p}"),
            ));
        }
    }
    if partials == 0 {
        return Err(Error::invalid(
            op,
            "null device pointer for the partial results",
        ));
    }
    let n = src.layout.numel();
    let (kind, p) = kind.kernel_args();
    elementwise(
        op,
        format!("norm_partial_{}", src.dtype),
        n,
        vec![
            KernelArg::In(src.ptr),
            layout_arg(op, src.layout)?,
            KernelArg::U64(n as u64),
            KernelArg::I32(kind),
            KernelArg::F64(p),
            KernelArg::Out(partials),
        ],
    )
}

/// The second pass: `out[0]` = the sum (or maximum) of `partials[0..count)`, in a fixed order,
/// by one block. Apply [`NormKind::finish`] to the value on the host.
pub fn norm_finish_launch(partials: u64, count: usize, kind: NormKind, out: u64) -> Result<Launch> {
    let op = "norm";
    let count = index_u32(op, "the number of partial results", count)?;
    if out == 0 || (partials == 0 && count > 0) {
        return Err(Error::invalid(
            op,
            "null device pointer for the norm's partials or result",
        ));
    }
    Ok(Launch {
        source: &RUNTIME,
        kernel: "norm_finish".to_string(),
        config: LaunchConfig::for_rows(op, 1, THREADS_PER_BLOCK, 0)?,
        args: vec![
            KernelArg::In(partials),
            KernelArg::U32(count),
            KernelArg::I32(kind.kernel_args().0),
            KernelArg::Out(out),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    fn view(ptr: u64, dtype: DType, layout: &Layout) -> DeviceView<'_> {
        DeviceView { ptr, dtype, layout }
    }

    #[test]
    fn first_element_adds_the_offset_in_bytes_and_refuses_overflow() {
        let l = Layout::contiguous(&[3, 4]).narrow("t", 0, 1, 2).unwrap();
        assert_eq!(
            view(0x1000, DType::F64, &l).first_element("t").unwrap(),
            0x1000 + 4 * 8
        );
        assert_eq!(
            view(0x1000, DType::F16, &l).first_element("t").unwrap(),
            0x1000 + 4 * 2
        );
        let err = view(u64::MAX - 8, DType::F32, &l)
            .first_element("t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("overflows"), "{err}");
    }

    #[test]
    fn kernel_names_follow_op_and_dtype() {
        let l = Layout::contiguous(&[5]);
        let f = fill_launch(view(0x1000, DType::BF16, &l), 1.0).unwrap();
        assert_eq!(f.kernel, "fill_bf16");
        assert_eq!(f.args[3], KernelArg::U16(bf16::ONE.to_bits()));
        let c = cast_launch(view(0x1000, DType::F16, &l), view(0x2000, DType::I64, &l)).unwrap();
        assert_eq!(c.kernel, "cast_i64_f16");
        let same = cast_launch(view(0x1000, DType::U8, &l), view(0x2000, DType::U8, &l)).unwrap();
        assert_eq!(same.kernel, "copy_u8");
    }

    #[test]
    fn unsupported_dtypes_and_mismatches_are_named() {
        let l = Layout::contiguous(&[5]);
        let err = scale_launch(view(0x1000, DType::I64, &l), 2.0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("scale_") && err.contains("i64"), "{err}");
        let other = Layout::contiguous(&[6]);
        let err = copy_launch(
            view(0x1000, DType::F32, &l),
            view(0x2000, DType::F32, &other),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("copy_") && err.contains("[5]") && err.contains("[6]"),
            "{err}"
        );
    }

    #[test]
    fn expanded_destinations_are_refused_except_for_fill() {
        let expanded = Layout::contiguous(&[1, 4]).expand("t", &[3, 4]).unwrap();
        let src = Layout::contiguous(&[3, 4]);
        assert!(fill_launch(view(0x1000, DType::F32, &expanded), 0.0).is_ok());
        let err = copy_launch(
            view(0x1000, DType::F32, &expanded),
            view(0x9000, DType::F32, &src),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("overlap"), "{err}");
        assert!(scale_launch(view(0x1000, DType::F32, &expanded), 2.0).is_err());
        // A transposed or narrowed view does not overlap itself.
        let t = src.transpose("t", 0, 1).unwrap();
        assert!(!elements_overlap(&t));
        assert!(!elements_overlap(&src.narrow("t", 1, 1, 2).unwrap()));
    }

    #[test]
    fn overlapping_source_and_destination_are_refused_unless_the_same_view() {
        let l = Layout::contiguous(&[4, 4]);
        let t = l.transpose("t", 0, 1).unwrap();
        assert!(add_scaled_launch(
            view(0x1000, DType::F32, &l),
            view(0x1000, DType::F32, &l),
            0.5
        )
        .is_ok());
        let err = add_scaled_launch(
            view(0x1000, DType::F32, &l),
            view(0x1000, DType::F32, &t),
            0.5,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("overlaps"), "{err}");
        // Adjacent, not overlapping: 16 f32 end at 0x1040.
        assert!(copy_launch(view(0x1000, DType::F32, &l), view(0x1040, DType::F32, &l)).is_ok());
        assert!(copy_launch(view(0x1000, DType::F32, &l), view(0x103c, DType::F32, &l)).is_err());
    }

    #[test]
    fn empty_views_share_no_memory_even_at_the_same_address() {
        assert!(!byte_ranges_overlap((0, 0), (0, 0)));
        assert!(!byte_ranges_overlap((0x1000, 0x1000), (0x0f00, 0x1100)));
        assert!(byte_ranges_overlap((0x1000, 0x1001), (0x0f00, 0x1100)));
        assert!(!byte_ranges_overlap((0x1000, 0x1040), (0x1040, 0x1080)));
        let empty = Layout::contiguous(&[2, 0, 3]);
        let a = view(0, DType::F32, &empty);
        assert!(!views_share_memory(&a, &a).unwrap());
        assert!(!overlaps_other_than_same_view(&a, &a).unwrap());
        let full = Layout::contiguous(&[4]);
        let b = view(0x1000, DType::F32, &full);
        assert!(views_share_memory(&b, &b).unwrap());
        assert!(!overlaps_other_than_same_view(&b, &b).unwrap());
        assert!(!views_share_memory(&b, &view(0x1000, DType::F32, &empty)).unwrap());
    }

    #[test]
    fn address_overflow_and_null_pointers_are_errors() {
        let l = Layout::from_parts(
            Shape::from_slice(&[2]),
            Shape::from_slice(&[usize::MAX / 4]),
            0,
        );
        assert!(fill_launch(view(0x1000, DType::F64, &l), 0.0).is_err());
        let l = Layout::contiguous(&[3]);
        assert!(fill_launch(view(0, DType::F32, &l), 0.0).is_err());
        let empty = Layout::contiguous(&[0]);
        assert!(fill_launch(view(0, DType::F32, &empty), 0.0).is_ok());
    }

    #[test]
    fn norm_kinds_match_the_cpu_norm_orders() {
        assert_eq!(NormKind::for_order(2.0), NormKind::SumSquares);
        assert_eq!(NormKind::for_order(1.0), NormKind::SumAbs);
        assert_eq!(NormKind::for_order(f64::INFINITY), NormKind::MaxAbs);
        assert_eq!(NormKind::for_order(3.0), NormKind::SumPow(3.0));
        assert_eq!(NormKind::SumSquares.finish(16.0), 4.0);
        let l = Layout::contiguous(&[3]);
        assert!(
            norm_partial_launch(view(0x1000, DType::F32, &l), NormKind::SumPow(-1.0), 0x2000)
                .is_err()
        );
        assert!(norm_finish_launch(0x2000, 1 << 31, NormKind::SumAbs, 0x3000).is_err());
    }
}
