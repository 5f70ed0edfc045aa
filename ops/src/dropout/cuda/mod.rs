//! Dropout on a CUDA device (`dropout.cu`): one launch draws the keep-mask from the
//! counter-based generator and writes the output, one launch applies the mask in backward. The
//! mask equals the CPU's for the same seed (both devices use the same generator).
//!
//! The plans are in [`launch`].

pub mod launch;

use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::cuda::{device_pointer, device_view, launch_on_compute};
use tandem_core::{DType, Result, Tensor};

use launch::{dropout_backward_launch, dropout_forward_launch};

/// The view of a CUDA tensor.
fn view<'a>(op: &'static str, t: &'a Tensor) -> Result<DeviceView<'a>> {
    device_view(op, t).map(|(_, v)| v)
}

/// Inverted dropout of `x` with the mask of `seed`: the output and the u8 keep-mask.
pub(crate) fn forward(
    x: &Tensor,
    seed: u64,
    threshold: u32,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "dropout";
    let out = Tensor::empty(x.dims(), x.dtype(), x.device())?;
    let mask = Tensor::empty(x.dims(), DType::U8, x.device())?;
    if x.numel() == 0 {
        // Nothing to draw or write; the builder below accepts empty views too.
        return Ok((out, mask));
    }
    let (dev, _) = device_pointer(OP, &out)?;
    let launch = dropout_forward_launch(
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

/// `g · scale` where `mask` keeps an element, 0 elsewhere.
pub(crate) fn apply_mask(g: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "dropout backward";
    g.device().same_as(mask.device(), OP)?;
    let out = Tensor::empty(g.dims(), g.dtype(), g.device())?;
    if g.numel() == 0 {
        return Ok(out);
    }
    let (dev, _) = device_pointer(OP, &out)?;
    let launch = dropout_backward_launch(view(OP, &out)?, view(OP, g)?, view(OP, mask)?, scale)?;
    launch_on_compute(&dev, &launch, g.numel())?;
    Ok(out)
}
