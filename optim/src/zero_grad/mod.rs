//! `zero_grad`: every existing gradient set to zero in place, dispatched once per device. On
//! the CPU each gradient is filled by the host runtime; on a CUDA device the dense gradients of
//! each dtype are zeroed by one multi-tensor launch (`cuda.rs`).

mod cuda;

use tandem_core::{Device, Tensor};

use crate::grouping::by_device;
use crate::Result;

/// Zeroes the gradients of `params` in place (the gradient tensors are kept).
pub(crate) fn zero_grads(params: &[Tensor]) -> Result<()> {
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    for (device, group) in by_device(&grads, Tensor::device) {
        match device {
            Device::Cpu => {
                for g in group {
                    g.zero_()?;
                }
            }
            Device::Cuda(ordinal) => cuda::zero(ordinal, &group)?,
        }
    }
    Ok(())
}
