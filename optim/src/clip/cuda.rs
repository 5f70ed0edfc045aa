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

use std::sync::Arc;

use tandem_core::cuda::device::CudaDevice;
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
    let dense = dense_gradients(grads)?;
    let Some(plan) = plan_tables(&dense)? else {
        // Every gradient is empty: the norm of nothing is 0, and nothing needs scaling.
        return Ok(0.0);
    };
    let total_chunks = plan.total_chunks;

    // partials[0..total_chunks), then the reduced value, then the finished norm.
    let slots = usize::try_from(total_chunks + 2)
        .map_err(|_| TensorError::invalid(OP, "too many chunks for one norm"))?;
    let partials = Tensor::empty(&[slots], DType::F64, tandem_core::Device::Cuda(ordinal))?;
    let (_, base) = element_address(OP, &partials)?;
    let slots_at = NormSlots {
        base,
        reduced: base + 8 * total_chunks,
        norm: base + 8 * (total_chunks + 1),
    };

    // Leases on the tables, held until the last launch reading them (the scaling) is queued:
    // another thread may evict from the shared cache as soon as the lock goes.
    let mut leases = Vec::with_capacity(plan.tables.len());
    {
        let mut cache = shared_cache();
        for t in &plan.tables {
            leases.push(cache.lease(ordinal, &t.table, |table| {
                disjoint(table, grads, &t.members)
            })?);
        }
    }
    let table_addresses: Vec<u64> = leases.iter().map(|lease| lease.address()).collect();
    measure(&plan, &table_addresses, kind, &slots_at)?;
    scale(&plan, &table_addresses, kind, max_norm, &slots_at)?;
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

/// The gradients of one dtype, as one table.
struct DtypeTable {
    table: TensorTable,
    /// Maps table positions to indices into the gradients.
    members: Vec<usize>,
    /// Where this table's chunks' partials start in the shared array.
    first_partial: u64,
}

/// The tables of one clip; their chunks share one array of partials.
struct ClipPlan {
    dev: Arc<CudaDevice>,
    tables: Vec<DtypeTable>,
    total_chunks: u64,
}

/// Device addresses in the f64 array of partials.
struct NormSlots {
    /// The first partial.
    base: u64,
    /// The partials reduced to one value (before the norm's final root).
    reduced: u64,
    /// The finished norm, which block 0 of the first scaling stores.
    norm: u64,
}

/// Dense copies of strided gradients (the gradients themselves when dense), all f32 or f64.
fn dense_gradients(grads: &[Tensor]) -> Result<Vec<Tensor>> {
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
    Ok(dense)
}

/// One table per dtype present, with the gradients' indices; `None` when there is no element
/// to measure.
fn plan_tables(dense: &[Tensor]) -> Result<Option<ClipPlan>> {
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
            tables.push(DtypeTable {
                table,
                members,
                first_partial,
            });
        }
    }
    Ok(device.filter(|_| total_chunks > 0).map(|dev| ClipPlan {
        dev,
        tables,
        total_chunks,
    }))
}

/// Queues the partial norms of every chunk and their reduction to one value at
/// `slots.reduced`; `table_addresses` are the leased tables' device copies.
fn measure(
    plan: &ClipPlan,
    table_addresses: &[u64],
    kind: NormKind,
    slots: &NormSlots,
) -> Result<()> {
    for (t, &address) in plan.tables.iter().zip(table_addresses) {
        let first = slots.base + 8 * t.first_partial;
        run_on_table(
            &plan.dev,
            &grad_norm_partial_launch(&t.table, address, kind, first)?,
            &t.table,
            Roles {
                param: None,
                grad: Some(Use::Read),
                state: None,
            },
        )?;
    }
    let count = usize::try_from(plan.total_chunks)
        .map_err(|_| TensorError::invalid(OP, "too many chunks for one norm"))?;
    run(
        &plan.dev,
        &norm_finish_launch(slots.base, count, kind, slots.reduced)?,
    )
}

/// Queues the scaling of every gradient by the reduced norm; the first table's launch also
/// stores the finished norm.
fn scale(
    plan: &ClipPlan,
    table_addresses: &[u64],
    kind: NormKind,
    max_norm: f64,
    slots: &NormSlots,
) -> Result<()> {
    for (i, (t, &address)) in plan.tables.iter().zip(table_addresses).enumerate() {
        let norm_out = if i == 0 { slots.norm } else { 0 };
        run_on_table(
            &plan.dev,
            &grad_clip_scale_launch(&t.table, address, slots.reduced, kind, max_norm, norm_out)?,
            &t.table,
            Roles {
                param: None,
                grad: Some(Use::Write),
                state: None,
            },
        )?;
    }
    Ok(())
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
