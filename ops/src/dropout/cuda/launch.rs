//! Launch plans of dropout (`dropout.cu`): pure functions from device views to a [`Launch`],
//! public so that the host harness (`tandem-cuda-harness`) runs the very plans the op runs on a
//! GPU.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use tandem_core::cuda::runtime_kernels::{views_share_memory, DeviceView};
use tandem_core::{DType, Error, MemoryFormat, Result};

use crate::elementwise_plan::THREADS_PER_BLOCK;

/// `dropout.cu`, embedded.
pub static DROPOUT_KERNELS: KernelSource = KernelSource {
    name: "dropout",
    source: include_str!("../dropout.cu"),
    headers: &[],
};

/// `value` in the kernel's dtype, converted as the CPU kernel converts it (`T::from_f64`).
fn value_arg(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F64 => KernelArg::F64(value),
        _ => KernelArg::F32(value as f32),
    }
}

/// Checks a dense destination of `like`'s shape and dtype `dtype`.
fn check_dense(
    op: &'static str,
    what: &str,
    v: &DeviceView,
    like: &DeviceView,
    dtype: DType,
) -> Result<()> {
    if v.dtype != dtype {
        return Err(Error::invalid(
            op,
            format!("the {what} must be {dtype}, got {}", v.dtype),
        ));
    }
    if v.layout.shape() != like.layout.shape() {
        return Err(Error::shape(
            op,
            format!(
                "the {what} has shape {:?}, the input {:?}",
                v.layout.shape().as_slice(),
                like.layout.shape().as_slice()
            ),
        ));
    }
    if !StridedLayout::new(op, v.layout)?.is_contiguous() {
        return Err(Error::invalid(
            op,
            format!(
                "the {what} must be dense; got strides {:?}",
                v.layout.strides().as_slice()
            ),
        ));
    }
    Ok(())
}

/// Errors when `a` and `b` share any memory (empty views share none: see
/// [`views_share_memory`]).
fn check_disjoint(op: &'static str, a: (&str, &DeviceView), b: (&str, &DeviceView)) -> Result<()> {
    if views_share_memory(a.1, b.1)? {
        return Err(Error::invalid(
            op,
            format!("the {} overlaps the {}", a.0, b.0),
        ));
    }
    Ok(())
}

fn float(op: &'static str, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::F64) {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            op,
            dtype,
            supported: "f32, f64",
        })
    }
}

/// Dropout forward: `out` (dense, `x`'s shape and dtype) gets `x · scale` where the mask keeps
/// an element and 0 elsewhere; `mask` (dense u8 of `x`'s shape) gets 1 = keep. Element `i` is
/// kept when its 32-bit draw from `seed` is at least `threshold`. `x` may have any layout; no
/// two of the three may share memory.
pub fn dropout_forward_launch(
    out: DeviceView,
    mask: DeviceView,
    x: DeviceView,
    seed: u64,
    threshold: u32,
    scale: f64,
) -> Result<Launch> {
    const OP: &str = "dropout";
    float(OP, x.dtype)?;
    check_dense(OP, "output", &out, &x, x.dtype)?;
    check_dense(OP, "mask", &mask, &x, DType::U8)?;
    check_disjoint(OP, ("output", &out), ("input", &x))?;
    check_disjoint(OP, ("mask", &mask), ("input", &x))?;
    check_disjoint(OP, ("mask", &mask), ("output", &out))?;
    let n = x.layout.numel();
    let x_layout = StridedLayout::new(OP, x.layout)?;
    Ok(Launch {
        source: &DROPOUT_KERNELS,
        kernel: format!("dropout_forward_{}", x.dtype),
        config: LaunchConfig::for_elements(OP, n.div_ceil(2), THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out.first_element(OP)?),
            KernelArg::Out(mask.first_element(OP)?),
            KernelArg::In(x.ptr),
            KernelArg::pod(&x_layout),
            KernelArg::U64(n as u64),
            KernelArg::U64(seed),
            KernelArg::U32(threshold),
            value_arg(x.dtype, scale),
        ],
    })
}

/// Checks a view dense channels-last of `like`'s 4-D shape with dtype `dtype`.
fn check_channels_last(
    op: &'static str,
    what: &str,
    v: &DeviceView,
    like: &[usize],
    dtype: DType,
) -> Result<()> {
    if v.dtype != dtype {
        return Err(Error::invalid(
            op,
            format!("the {what} must be {dtype}, got {}", v.dtype),
        ));
    }
    if v.layout.shape().as_slice() != like || !v.layout.is_contiguous_in(MemoryFormat::ChannelsLast)
    {
        return Err(Error::invalid(
            op,
            format!(
                "the {what} must be dense channels-last of shape {like:?}; got shape {:?} with \
                 strides {:?}",
                v.layout.shape().as_slice(),
                v.layout.strides().as_slice()
            ),
        ));
    }
    Ok(())
}

/// Dropout forward of a dense channels-last `x` (4-D) in storage order: `out` (dense
/// channels-last, `x`'s shape and dtype) and `mask` (dense channels-last u8) get the values and
/// the mask of [`dropout_forward_launch`] on the same logical elements — element `(n, c, h, w)`
/// draws with its row-major index — laid out channels-last. No two of the three may share
/// memory.
pub fn dropout_forward_channels_last_launch(
    out: DeviceView,
    mask: DeviceView,
    x: DeviceView,
    seed: u64,
    threshold: u32,
    scale: f64,
) -> Result<Launch> {
    const OP: &str = "dropout";
    float(OP, x.dtype)?;
    let shape = x.layout.shape().as_slice();
    if shape.len() != 4 {
        return Err(Error::shape(
            OP,
            format!("a channels-last input must be 4-D, got shape {shape:?}"),
        ));
    }
    check_channels_last(OP, "input", &x, shape, x.dtype)?;
    check_channels_last(OP, "output", &out, shape, x.dtype)?;
    check_channels_last(OP, "mask", &mask, shape, DType::U8)?;
    check_disjoint(OP, ("output", &out), ("input", &x))?;
    check_disjoint(OP, ("mask", &mask), ("input", &x))?;
    check_disjoint(OP, ("mask", &mask), ("output", &out))?;
    let n = x.layout.numel();
    Ok(Launch {
        source: &DROPOUT_KERNELS,
        kernel: format!("dropout_forward_channels_last_{}", x.dtype),
        config: LaunchConfig::for_elements(OP, n, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out.first_element(OP)?),
            KernelArg::Out(mask.first_element(OP)?),
            KernelArg::In(x.first_element(OP)?),
            KernelArg::U64(n as u64),
            KernelArg::U64(shape[1].max(1) as u64),
            KernelArg::U64(shape[2].max(1) as u64),
            KernelArg::U64(shape[3].max(1) as u64),
            KernelArg::U64(seed),
            KernelArg::U32(threshold),
            value_arg(x.dtype, scale),
        ],
    })
}

/// Dropout backward: `out` (dense, `g`'s shape and dtype) gets `g · scale` where `mask` (dense
/// u8 of `g`'s shape, 1 = keep) keeps an element and 0 elsewhere. `g` may have any layout and
/// may not share memory with `out`.
pub fn dropout_backward_launch(
    out: DeviceView,
    g: DeviceView,
    mask: DeviceView,
    scale: f64,
) -> Result<Launch> {
    const OP: &str = "dropout backward";
    float(OP, g.dtype)?;
    check_dense(OP, "output", &out, &g, g.dtype)?;
    check_dense(OP, "mask", &mask, &g, DType::U8)?;
    check_disjoint(OP, ("output", &out), ("gradient", &g))?;
    check_disjoint(OP, ("output", &out), ("mask", &mask))?;
    let n = g.layout.numel();
    let g_layout = StridedLayout::new(OP, g.layout)?;
    Ok(Launch {
        source: &DROPOUT_KERNELS,
        kernel: format!("dropout_backward_{}", g.dtype),
        config: LaunchConfig::for_elements(OP, n, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out.first_element(OP)?),
            KernelArg::In(g.ptr),
            KernelArg::pod(&g_layout),
            KernelArg::In(mask.first_element(OP)?),
            KernelArg::U64(n as u64),
            value_arg(g.dtype, scale),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Layout;

    fn view(ptr: u64, dtype: DType, layout: &Layout) -> DeviceView<'_> {
        DeviceView { ptr, dtype, layout }
    }

    /// Zero-byte allocations all sit at address 0: three empty views with equal pointers and
    /// layouts overlap nothing.
    #[test]
    fn empty_views_at_address_zero_do_not_overlap() {
        let empty = Layout::contiguous(&[0, 3]);
        let launch = dropout_forward_launch(
            view(0, DType::F32, &empty),
            view(0, DType::U8, &empty),
            view(0, DType::F32, &empty),
            7,
            1 << 31,
            2.0,
        )
        .unwrap();
        assert_eq!(launch.kernel, "dropout_forward_f32");
        let launch = dropout_backward_launch(
            view(0, DType::F64, &empty),
            view(0, DType::F64, &empty),
            view(0, DType::U8, &empty),
            2.0,
        )
        .unwrap();
        assert_eq!(launch.kernel, "dropout_backward_f64");
    }

    #[test]
    fn an_output_sharing_memory_with_the_input_is_refused_even_as_the_same_view() {
        let l = Layout::contiguous(&[4, 3]);
        let mask = view(0x9000, DType::U8, &l);
        let err = dropout_forward_launch(
            view(0x1000, DType::F32, &l),
            mask,
            view(0x1000, DType::F32, &l),
            7,
            1 << 31,
            2.0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("output overlaps the input"), "{err}");
        let err = dropout_forward_launch(
            view(0x1000, DType::F32, &l),
            view(0x1020, DType::U8, &l),
            view(0x5000, DType::F32, &l),
            7,
            1 << 31,
            2.0,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("mask overlaps the output"), "{err}");
    }
}
