//! The Adam(W) step on a CUDA device: one fused `adam_step` launch per dtype and step count
//! (every parameter shares one count in training, so one launch), through a table cached in
//! the optimizer. The bias corrections of each count are launch arguments, computed on the host
//! exactly as the CPU computes them.

use tandem_core::{DType, Tensor};

use super::{AdamConfig, AdamUpdate};
use crate::multi_tensor::{
    adam_launch, element_address, run_on_table, Roles, TableCache, TableEntry, TensorTable,
    CHUNK_ELEMENTS,
};
use crate::optimizer::check_disjoint;
use crate::Result;

/// Updates every parameter of `updates` (all on `cuda:ordinal`); `name` and `params` are the
/// optimizer's, for messages.
pub(super) fn update(
    ordinal: usize,
    name: &'static str,
    params: &[Tensor],
    updates: &[&AdamUpdate],
    cfg: &AdamConfig,
    decoupled: bool,
    tables: &mut TableCache,
) -> Result<()> {
    let mut groups: Vec<((DType, u64), Vec<&AdamUpdate>)> = Vec::new();
    for &u in updates {
        let key = (u.target.dtype(), u.step);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(u),
            None => groups.push((key, vec![u])),
        }
    }
    for ((dtype, step), group) in groups {
        let mut entries = Vec::with_capacity(group.len());
        let mut device = None;
        for u in &group {
            let (dev, param) = element_address(name, &u.target)?;
            let address = |t: &Tensor| element_address(name, t).map(|(_, a)| a);
            let max_exp_avg_sq = match &u.max_exp_avg_sq {
                Some(t) => address(t)?,
                None => 0,
            };
            entries.push(TableEntry {
                param,
                grad: address(&u.grad)?,
                state: [
                    address(&u.exp_avg)?,
                    address(&u.exp_avg_sq)?,
                    max_exp_avg_sq,
                ],
                numel: u.target.numel() as u64,
            });
            device = Some(dev);
        }
        let table = TensorTable::new(name, dtype, &entries, CHUNK_ELEMENTS)?;
        let Some(dev) = device.filter(|_| !table.is_empty()) else {
            continue;
        };
        let lease = tables.lease(ordinal, &table, |t| {
            check_disjoint(name, t, |position| {
                let index = group[position].index;
                (index, &params[index])
            })
        })?;
        run_on_table(
            &dev,
            &adam_launch(&table, lease.address(), cfg, decoupled, step)?,
            &table,
            Roles::UPDATE,
        )?;
        // The launch is queued: the table may go now (its free is ordered after the launch).
        drop(lease);
    }
    Ok(())
}
