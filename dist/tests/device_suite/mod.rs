//! The suites of the device-threads process group, written once for any device:
//! `device_group_cpu.rs` runs them on the CPU in every test run (which checks the suites
//! themselves and the group's host path), `cuda_ddp.rs` and `cuda_device_group.rs` on `cuda:0`
//! (skipped without a GPU).
//!
//! - [`ddp`]: DistributedDataParallel on a `DeviceThreadGroup` against one process training on
//!   the full batch on the same device — gradients after one step, parameters after k steps —
//!   and no_sync, unused parameters, bucket rebuild, compression hooks, gradients as bucket views.
//! - [`collectives`]: every collective, reduce op and dtype against the threads backend (the
//!   CPU reference) on the same inputs, bit for bit, plus ordering, mismatches and placement.
//!
//! Failures name the device, the world size, the rank, the model or collective, and the
//! parameter or element, so that a run on a lent GPU can be debugged from its output alone.

#![allow(dead_code)]

pub mod collectives;
pub mod ddp;
pub mod gate;

use std::sync::Arc;

use tandem_core::Device;
use tandem_dist::{DeviceThreadGroup, ProcessGroup};

/// Runs `f(rank, group)` on `world` ranks of a device group on `device`, one thread each (a
/// device group's ranks must issue from their own threads), and returns the results in rank
/// order.
pub fn on_device_ranks<T: Send>(
    device: Device,
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    let groups = DeviceThreadGroup::new_group(device, world)
        .unwrap_or_else(|e| panic!("a device group of {world} ranks on {device}: {e}"));
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                std::thread::Builder::new()
                    .name(format!("{device} rank {rank}"))
                    .spawn_scoped(s, move || f(rank, Arc::new(g) as Arc<dyn ProcessGroup>))
                    .expect("a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| panic!("{device}: rank {rank} of {world} panicked (above)"))
            })
            .collect()
    })
}
