//! The scaler's unscale and check on a CUDA device, with no host round trip: a one-element I64
//! flag zeroed on the compute stream, then one `grad_unscale` launch per dtype over every
//! gradient (a multi-tensor table), each raising the flag on a non-finite element. The flag
//! stays on the device; `GradScaler::step` reads it once.
//!
//! Dense f32 and f64 gradients are unscaled where they are; a strided gradient is unscaled as
//! a dense copy, which is then copied back into it.

use tandem_core::cuda::sanitizer::Use;
use tandem_core::{DType, Device, Tensor};

use super::{copy_back, dense_gradients};
use crate::multi_tensor::{
    element_address, grad_unscale_launch, run_on_table, shared_cache, Roles, TableEntry,
    TensorTable, CHUNK_ELEMENTS,
};
use crate::{Error, Result};

const OP: &str = "GradScaler.unscale";

/// Unscales `grads` (f32 or f64, all on `cuda:ordinal`) by `inv_scale` and returns the found-inf
/// flag, a one-element I64 tensor on the device that the queued kernels set to 1 on an infinite
/// or NaN element.
pub(super) fn unscale(ordinal: usize, grads: &[Tensor], inv_scale: f64) -> Result<Tensor> {
    let flag = Tensor::zeros(&[1], DType::I64, Device::Cuda(ordinal))?;
    let (_, flag_address) = element_address(OP, &flag)?;
    let dense = dense_gradients(grads)?;
    for dtype in [DType::F32, DType::F64] {
        let mut entries = Vec::new();
        let mut members = Vec::new();
        let mut device = None;
        for (index, g) in dense.iter().enumerate().filter(|(_, g)| g.dtype() == dtype) {
            let (dev, grad) = element_address(OP, g)?;
            device = Some(dev);
            entries.push(TableEntry {
                grad,
                numel: g.numel() as u64,
                ..Default::default()
            });
            members.push(index);
        }
        let table = TensorTable::new(OP, dtype, &entries, CHUNK_ELEMENTS)?;
        let Some(dev) = device.filter(|_| !table.is_empty()) else {
            continue;
        };
        // The lease keeps the uploaded table alive until the launch reading it is queued.
        let lease =
            shared_cache().lease(ordinal, &table, |table| disjoint(table, &dense, &members))?;
        run_on_table(
            &dev,
            &grad_unscale_launch(&table, lease.address(), inv_scale, flag_address)?,
            &table,
            Roles {
                param: None,
                grad: Some(Use::Write),
                state: None,
            },
        )?;
        drop(lease);
    }
    copy_back(grads, &dense)?;
    Ok(flag)
}

/// Errors when two gradients share memory: they are unscaled at once, so an overlap would be
/// divided twice (and race).
fn disjoint(table: &TensorTable, grads: &[Tensor], members: &[usize]) -> Result<()> {
    let Some((a, b)) = table.first_overlap() else {
        return Ok(());
    };
    let describe = |position: usize| {
        let g = &grads[members[position]];
        format!("{:?} {}", g.dims(), g.dtype())
    };
    Err(Error::Scaler {
        msg: format!(
            "two gradients share memory ({} and {}); on a CUDA device all gradients are \
             unscaled at once, so they must not overlap",
            describe(a),
            describe(b)
        ),
    })
}
