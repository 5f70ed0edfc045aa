//! Clipping on a CUDA device, with no host round trip per parameter:
//!
//! 1. `grad_norm_partial` per dtype: one f64 partial per chunk of every gradient, all into one
//!    device array;
//! 2. the runtime's `norm_finish`: the partials reduced, in a fixed order, to one value in
//!    device memory;
//! 3. `grad_clip_scale` per dtype: reads that value, finishes the norm, and scales every
//!    gradient by `max_norm / (norm + 1e-6)` when that is below 1 (a non-finite norm scales
//!    nothing); block 0 also stores the finished norm;
//! 4. one read of the norm to the host, which the function returns (and reports as an error
//!    when it is not finite).
//!
//! Dense f32 and f64 gradients are measured and scaled where they are; a strided gradient is
//! measured and scaled as a dense copy, which is then copied back into it.

use tandem_core::cuda::runtime_kernels::{norm_finish_launch, NormKind};
use tandem_core::cuda::sanitizer::Use;
use tandem_core::{DType, Error as TensorError, Tensor};

use super::non_finite;
use crate::multi_tensor::{
    count_host_read, element_address, grad_clip_scale_launch, grad_norm_partial_launch, run,
    run_on_table, shared_cache, Roles, TableEntry, TensorTable, CHUNK_ELEMENTS,
};
use crate::{Error, Result};

const OP: &str = "clip_grad_norm";

/// Measures and, when needed, scales `grads` (all on `cuda:ordinal`, at least one).
pub(super) fn clip(ordinal: usize, grads: &[Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    let kind = NormKind::for_order(norm_type);
    // Dense stand-ins for strided gradients, copied back at the end.
    let dense: Vec<Tensor> = grads
        .iter()
        .map(|g| g.contiguous_detached())
        .collect::<std::result::Result<_, _>>()?;

    if let Some(g) = dense
        .iter()
        .find(|g| !matches!(g.dtype(), DType::F32 | DType::F64))
    {
        return Err(TensorError::UnsupportedDType {
            op: OP,
            dtype: g.dtype(),
            supported: "f32, f64",
        }
        .into());
    }

    // One table per dtype, with the gradients' indices; their chunks share one array of
    // partials, each table's from `first_partial` on.
    let mut tables = Vec::new();
    let mut device = None;
    let mut total_chunks: u64 = 0;
    for dtype in [DType::F32, DType::F64] {
        let mut entries = Vec::new();
        let mut members = Vec::new();
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
        if !table.is_empty() {
            let first_partial = total_chunks;
            total_chunks += table.chunks();
            tables.push((table, members, first_partial));
        }
    }
    let Some(dev) = device.filter(|_| total_chunks > 0) else {
        // Every gradient is empty: the norm of nothing is 0, and nothing needs scaling.
        return Ok(0.0);
    };

    // partials[0..total_chunks), then the reduced value, then the finished norm.
    let slots = usize::try_from(total_chunks + 2)
        .map_err(|_| TensorError::invalid(OP, "too many chunks for one norm"))?;
    let partials = Tensor::empty(&[slots], DType::F64, tandem_core::Device::Cuda(ordinal))?;
    let (_, base) = element_address(OP, &partials)?;
    let slot = |i: u64| base + 8 * i;
    let (reduced, norm) = (slot(total_chunks), slot(total_chunks + 1));

    // Leases on the tables, held until the last launch reading them (the scaling) is queued:
    // another thread may evict from the shared cache as soon as the lock goes.
    let mut leases = Vec::with_capacity(tables.len());
    {
        let mut cache = shared_cache();
        for (table, members, _) in &tables {
            leases.push(cache.lease(ordinal, table, |t| disjoint(t, grads, members))?);
        }
    }
    for ((table, _, first_partial), lease) in tables.iter().zip(&leases) {
        run_on_table(
            &dev,
            &grad_norm_partial_launch(table, lease.address(), kind, slot(*first_partial))?,
            table,
            Roles {
                param: None,
                grad: Some(Use::Read),
                state: None,
            },
        )?;
    }
    let count = usize::try_from(total_chunks)
        .map_err(|_| TensorError::invalid(OP, "too many chunks for one norm"))?;
    run(&dev, &norm_finish_launch(base, count, kind, reduced)?)?;
    for (i, ((table, _, _), lease)) in tables.iter().zip(&leases).enumerate() {
        let norm_out = if i == 0 { norm } else { 0 };
        run_on_table(
            &dev,
            &grad_clip_scale_launch(table, lease.address(), reduced, kind, max_norm, norm_out)?,
            table,
            Roles {
                param: None,
                grad: Some(Use::Write),
                state: None,
            },
        )?;
    }
    drop(leases);
    for (g, d) in grads.iter().zip(&dense) {
        if !d.same_tensor(g) && !d.storage().same_buffer(g.storage()) {
            g.copy_(d)?;
        }
    }

    // The one host read: the contract returns the norm. It waits for the kernels above.
    let last = partials.layout().narrow(OP, 0, slots - 1, 1)?;
    let total = partials.view_detached(last)?.item()?;
    count_host_read();
    if !total.is_finite() {
        return Err(non_finite(total, norm_type, grads.len()));
    }
    Ok(total)
}

/// Errors when two gradients share memory: they are scaled at once, not one after the other.
/// `members` maps table positions to indices into `grads`.
fn disjoint(table: &TensorTable, grads: &[Tensor], members: &[usize]) -> Result<()> {
    let Some((a, b)) = table.first_overlap() else {
        return Ok(());
    };
    let describe = |position: usize| {
        let g = &grads[members[position]];
        format!("{:?} {}", g.dims(), g.dtype())
    };
    Err(Error::Clip {
        msg: format!(
            "two gradients share memory ({} and {}); on a CUDA device all gradients are scaled \
             at once, so they must not overlap",
            describe(a),
            describe(b)
        ),
    })
}
