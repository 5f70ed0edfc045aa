//! The SGD step on a CUDA device: one fused `sgd_step` launch over every parameter of a dtype
//! (and, in the step that creates momentum buffers for some parameters but not others, one
//! more for those), through a table cached in the optimizer.

use tandem_core::{DType, Tensor};

use super::{SgdConfig, SgdUpdate, NAME};
use crate::multi_tensor::{
    element_address, run_on_table, sgd_launch, Roles, TableCache, TableEntry, TensorTable,
    CHUNK_ELEMENTS,
};
use crate::optimizer::check_disjoint;
use crate::Result;

/// Updates every parameter of `updates` (all on `cuda:ordinal`); `params` is the optimizer's
/// list, for messages.
pub(super) fn update(
    ordinal: usize,
    params: &[Tensor],
    updates: &[&SgdUpdate],
    cfg: &SgdConfig,
    tables: &mut TableCache,
) -> Result<()> {
    // One launch per (dtype, first): the kernel takes both as uniform arguments.
    let mut groups: Vec<((DType, bool), Vec<&SgdUpdate>)> = Vec::new();
    for &u in updates {
        let key = (u.target.dtype(), u.first);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(u),
            None => groups.push((key, vec![u])),
        }
    }
    for ((dtype, first), group) in groups {
        let mut entries = Vec::with_capacity(group.len());
        let mut device = None;
        for u in &group {
            let (dev, param) = element_address(NAME, &u.target)?;
            let (_, grad) = element_address(NAME, &u.grad)?;
            let buffer = match &u.buffer {
                Some(b) => element_address(NAME, b)?.1,
                None => 0,
            };
            entries.push(TableEntry {
                param,
                grad,
                state: [buffer, 0, 0],
                numel: u.target.numel() as u64,
            });
            device = Some(dev);
        }
        let table = TensorTable::new(NAME, dtype, &entries, CHUNK_ELEMENTS)?;
        let Some(dev) = device.filter(|_| !table.is_empty()) else {
            continue;
        };
        let lease = tables.lease(ordinal, &table, |t| {
            check_disjoint(NAME, t, |position| {
                let index = group[position].index;
                (index, &params[index])
            })
        })?;
        run_on_table(
            &dev,
            &sgd_launch(&table, lease.address(), cfg, first)?,
            &table,
            Roles::UPDATE,
        )?;
        // The launch is queued: the table may go now (its free is ordered after the launch).
        drop(lease);
    }
    Ok(())
}
