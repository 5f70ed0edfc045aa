//! Dropout on a CUDA device (`dropout.cu`): one launch draws the keep-mask from the
//! counter-based generator and writes the output, one launch applies the mask in backward. The
//! mask equals the CPU's for the same seed (both devices use the same generator).
//!
//! A dense channels-last input keeps its format: the forward runs in storage order (each
//! element drawing with its logical index, so the mask is the row-major one laid out
//! channels-last, as on the CPU), and the backward follows the mask's format.
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::cuda::{device_pointer, device_view, launch_on_compute};
use tandem_core::{DType, Layout, MemoryFormat, Result, Tensor};

use launch::{
    dropout_backward_launch, dropout_forward_channels_last_launch, dropout_forward_launch,
};

/// The view of a CUDA tensor.
fn view<'a>(op: &'static str, t: &'a Tensor) -> Result<DeviceView<'a>> {
    device_view(op, t).map(|(_, v)| v)
}

/// The view of a CUDA tensor through `layout` (one of its own, permuted).
fn view_through<'a>(op: &'static str, t: &Tensor, layout: &'a Layout) -> Result<DeviceView<'a>> {
    let (_, ptr) = device_pointer(op, t)?;
    Ok(DeviceView {
        ptr,
        dtype: t.dtype(),
        layout,
    })
}

/// Inverted dropout of `x` with the mask of `seed`: the output and the u8 keep-mask.
pub(crate) fn forward(
    x: &Tensor,
    seed: u64,
    threshold: u32,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "dropout";
    let format = x.dense_format().unwrap_or(MemoryFormat::Contiguous);
    let out = Tensor::empty_in(x.dims(), x.dtype(), x.device(), format)?;
    let mask = Tensor::empty_in(x.dims(), DType::U8, x.device(), format)?;
    if x.numel() == 0 {
        // Nothing to draw or write; the builder below accepts empty views too.
        return Ok((out, mask));
    }
    let (dev, _) = device_pointer(OP, &out)?;
    let build = match format {
        MemoryFormat::Contiguous => dropout_forward_launch,
        MemoryFormat::ChannelsLast => dropout_forward_channels_last_launch,
    };
    let launch = build(
        view(OP, &out)?,
        view(OP, &mask)?,
        view(OP, x)?,
        seed,
        threshold,
        scale,
    )?;
    launch_on_compute(&dev, &launch, x.numel())?;
    Ok((out, mask))
}

/// `g · scale` where `mask` keeps an element, 0 elsewhere, in the mask's format (the
/// forward input's): computed in its storage order, with every view permuted to NHWC order
/// for channels-last (the kernel then writes a row-major output and reads a row-major mask).
pub(crate) fn apply_mask(g: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "dropout backward";
    g.device().same_as(mask.device(), OP)?;
    let format = mask.dense_format().unwrap_or(MemoryFormat::Contiguous);
    let out = Tensor::empty_in(g.dims(), g.dtype(), g.device(), format)?;
    if g.numel() == 0 {
        return Ok(out);
    }
    let (dev, _) = device_pointer(OP, &out)?;
    let order = |t: &Tensor| -> Result<Layout> {
        match format {
            MemoryFormat::Contiguous => Ok(t.layout().clone()),
            MemoryFormat::ChannelsLast => t.layout().permute(OP, &[0, 2, 3, 1]),
        }
    };
    let (out_layout, g_layout, mask_layout) = (order(&out)?, order(g)?, order(mask)?);
    let launch = dropout_backward_launch(
        view_through(OP, &out, &out_layout)?,
        view_through(OP, g, &g_layout)?,
        view_through(OP, mask, &mask_layout)?,
        scale,
    )?;
    launch_on_compute(&dev, &launch, g.numel())?;
    Ok(out)
}
