//! softmax and log_softmax on a CUDA device: the device side of the ops, running the plans of
//! [`launch`].
//!
//! Inputs are made dense first (`contiguous_detached`, a copy only for a strided input), then
//! read as `[outer, len, inner]` around the softmax dim: rows (`inner == 1`) get one warp or
//! one block each, columns (`inner > 1`) one thread each. Nothing here waits for the device.

pub mod launch;

use tandem_core::cuda::{device_pointer, launch_on_compute};

use tandem_core::{Result, Tensor};

use super::shape::Split;
use crate::device_address::first_element_address as element_address;
use launch::softmax_launch;

/// softmax (log_softmax when `log`) of `x` along the middle dim of `split`.
pub(crate) fn forward(op: &'static str, x: &Tensor, split: Split, log: bool) -> Result<Tensor> {
    let y = Tensor::empty(x.dims(), x.dtype(), x.device())?;
    if x.numel() == 0 {
        return Ok(y);
    }
    let x = x.contiguous_detached()?;
    let (dev, _) = device_pointer(op, &x)?;
    let launch = softmax_launch(
        op,
        x.dtype(),
        &[element_address(op, &x)?],
        element_address(op, &y)?,
        (split.outer, split.n, split.inner),
        log,
        false,
    )?;
    launch_on_compute(&dev, &launch, x.numel())?;
    Ok(y)
}

/// The input gradient from the output gradient `g` and the saved output `y`.
pub(crate) fn backward(
    op: &'static str,
    g: &Tensor,
    y: &Tensor,
    split: Split,
    log: bool,
) -> Result<Tensor> {
    let dx = Tensor::empty(g.dims(), g.dtype(), g.device())?;
    if g.numel() == 0 {
        return Ok(dx);
    }
    let (g, y) = (g.contiguous_detached()?, y.contiguous_detached()?);
    let (dev, _) = device_pointer(op, &g)?;
    let launch = softmax_launch(
        op,
        g.dtype(),
        &[element_address(op, &g)?, element_address(op, &y)?],
        element_address(op, &dx)?,
        (split.outer, split.n, split.inner),
        log,
        true,
    )?;
    launch_on_compute(&dev, &launch, g.numel())?;
    Ok(dx)
}
