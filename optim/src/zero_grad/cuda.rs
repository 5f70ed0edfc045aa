//! `zero_grad` on a CUDA device: one `grad_zero` launch per dtype over every dense f32/f64
//! gradient; any other gradient (strided, or another dtype) is filled by the runtime.

use tandem_core::cuda::sanitizer::Use;
use tandem_core::{DType, Tensor};

use crate::multi_tensor::{
    element_address, grad_zero_launch, run_on_table, shared_cache, Roles, TableEntry, TensorTable,
    CHUNK_ELEMENTS,
};
use crate::Result;

const OP: &str = "zero_grad";

/// Zeroes `grads`, all on `cuda:ordinal`.
pub(super) fn zero(ordinal: usize, grads: &[&Tensor]) -> Result<()> {
    for dtype in [DType::F32, DType::F64] {
        let mut entries = Vec::new();
        let mut device = None;
        for g in grads
            .iter()
            .filter(|g| g.dtype() == dtype && g.is_contiguous())
        {
            let (dev, grad) = element_address(OP, g)?;
            device = Some(dev);
            entries.push(TableEntry {
                grad,
                numel: g.numel() as u64,
                ..Default::default()
            });
        }
        let table = TensorTable::new(OP, dtype, &entries, CHUNK_ELEMENTS)?;
        let Some(dev) = device.filter(|_| !table.is_empty()) else {
            continue;
        };
        // Overlapping gradients are harmless here (every write is a zero): no check.
        // The lease (not the lock, released at the end of this statement) keeps the table from
        // being evicted and freed by another thread before the launch that reads it is queued.
        let lease = shared_cache().lease(ordinal, &table, |_| Ok(()))?;
        run_on_table(
            &dev,
            &grad_zero_launch(&table, lease.address())?,
            &table,
            Roles {
                param: None,
                grad: Some(Use::Write),
                state: None,
            },
        )?;
        drop(lease);
    }
    for g in grads {
        if !(g.is_contiguous() && matches!(g.dtype(), DType::F32 | DType::F64)) {
            g.zero_()?;
        }
    }
    Ok(())
}
