//! The device address of a CUDA tensor's first element, for the launch code of every op: the
//! storage's base plus the layout's offset in bytes, computed by
//! [`DeviceView::first_element`](tandem_core::cuda::runtime_kernels::DeviceView::first_element).

use std::sync::Arc;

use tandem_core::cuda::{device_view, CudaDevice};
use tandem_core::{Result, Tensor};

/// The open device of a CUDA tensor and the address of its first element.
pub(crate) fn first_element(op: &'static str, t: &Tensor) -> Result<(Arc<CudaDevice>, u64)> {
    let (dev, view) = device_view(op, t)?;
    Ok((dev, view.first_element(op)?))
}

/// The address of a CUDA tensor's first element.
pub(crate) fn first_element_address(op: &'static str, t: &Tensor) -> Result<u64> {
    Ok(first_element(op, t)?.1)
}
