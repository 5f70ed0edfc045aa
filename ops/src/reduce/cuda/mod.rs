//! The reductions on a CUDA device: the device side of `sum`, `mean`, `max` and their backward,
//! running the plans of [`launch`].
//!
//! The input is read as `rows` groups of `len` elements: the input viewed with the kept dims
//! first and the reduced dims last. That view is passed to the kernel as a [`StridedLayout`],
//! whose merging makes it dense (rank 1) whenever the reduced dims are trailing dims of a
//! contiguous input, so no copy is made for any layout. Two shapes get their own kernels: a
//! contiguous input reduced over a middle block of dims (`[outer, len, inner]`, `inner > 1`,
//! e.g. the batch dim of `[N, C]`) is summed column-wise with coalesced loads, and one long row
//! (a sum of everything) is split over many blocks and their partial sums added by a second
//! launch. Nothing here waits for the device.

pub mod launch;

use tandem_core::cuda::launch::StridedLayout;
use tandem_core::cuda::{device_pointer, device_view, launch_on_compute};
use tandem_core::{DType, Result, Tensor};

use crate::device_address::first_element_address;
use launch::{
    broadcast_scaled_launch, expanded_gradient, grouped_layout, max_rows_launch,
    max_scatter_launch, max_scatter_layouts, plan_sum, sum_launches, SumPlan,
};

/// `scale ·` the sum of `x` over `dims`, as a dense tensor of shape `kept`.
pub(crate) fn sum(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
    kept: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let out = Tensor::empty(kept, x.dtype(), x.device())?;
    let rows = out.numel();
    if rows == 0 {
        return Ok(out);
    }
    let plan = plan_sum(op, x.layout(), dims)?;
    let partials = match plan {
        SumPlan::Copy => return sum(op, &x.contiguous_detached()?, dims, kept, scale),
        SumPlan::Partial { blocks, .. } => Some(Tensor::empty(&[blocks], x.dtype(), x.device())?),
        _ => None,
    };
    let (dev, input) = device_view(op, x)?;
    let (_, out_ptr) = device_pointer(op, &out)?;
    let partials_ptr = match &partials {
        Some(p) => device_pointer(op, p)?.1,
        None => 0,
    };
    let launches = sum_launches(op, &plan, input, out_ptr, partials_ptr, scale)?;
    for launch in &launches {
        launch_on_compute(&dev, launch, rows)?;
    }
    Ok(out)
}

/// The gradient of `scale · sum(x, dims)` (input of `in_shape`) from the output gradient `g`
/// (of the kept shape, with or without the reduced dims): `g` broadcast back, times `scale`.
pub(crate) fn sum_backward(
    op: &'static str,
    g: &Tensor,
    in_shape: &[usize],
    dims: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let out = Tensor::empty(in_shape, g.dtype(), g.device())?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let g_layout = expanded_gradient(g.layout(), in_shape, dims);
    let (dev, g_ptr) = device_pointer(op, g)?;
    let (_, out_ptr) = device_pointer(op, &out)?;
    let launch = broadcast_scaled_launch(op, g.dtype(), out_ptr, g_ptr, &g_layout, scale)?;
    launch_on_compute(&dev, &launch, n)?;
    Ok(out)
}

/// The maximum of each group of `x` over `dims` and the position of its first maximum (tensors
/// of shape `kept`, of `x`'s dtype and i64). The caller has checked that no group is empty.
pub(crate) fn max(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
    kept: &[usize],
) -> Result<(Tensor, Tensor)> {
    let values = Tensor::empty(kept, x.dtype(), x.device())?;
    let positions = Tensor::empty(kept, DType::I64, x.device())?;
    let rows = values.numel();
    if rows == 0 {
        return Ok((values, positions));
    }
    let len: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let layout = grouped_layout(op, x.layout(), dims)?;
    if StridedLayout::new(op, &layout).is_err() {
        return max(op, &x.contiguous_detached()?, dims, kept);
    }
    let (dev, base) = device_pointer(op, x)?;
    let (_, values_ptr) = device_pointer(op, &values)?;
    let (_, positions_ptr) = device_pointer(op, &positions)?;
    let launch = max_rows_launch(
        op,
        x.dtype(),
        base,
        &layout,
        values_ptr,
        positions_ptr,
        rows,
        len,
    )?;
    launch_on_compute(&dev, &launch, rows)?;
    Ok((values, positions))
}

/// The backward of `max`: zeros of `in_shape` with each element of `g` at its group's first
/// maximum (`positions`, as [`max`] returns them: dense).
pub(crate) fn max_backward(
    op: &'static str,
    g: &Tensor,
    positions: &Tensor,
    in_shape: &[usize],
    dims: &[usize],
) -> Result<Tensor> {
    let grad = Tensor::zeros(in_shape, g.dtype(), g.device())?;
    let (g_kept, kept, reduced) = max_scatter_layouts(g.layout(), in_shape, dims);
    let rows = kept.numel();
    if rows == 0 || grad.numel() == 0 {
        return Ok(grad);
    }
    let (dev, grad_ptr) = device_pointer(op, &grad)?;
    let (_, g_ptr) = device_pointer(op, g)?;
    let p_ptr = first_element_address(op, positions)?;
    let launch = max_scatter_launch(
        op,
        g.dtype(),
        grad_ptr,
        g_ptr,
        &g_kept,
        p_ptr,
        &kept,
        &reduced,
    )?;
    launch_on_compute(&dev, &launch, rows)?;
    Ok(grad)
}
