//! Suites written once and run on several process groups and devices: `suites_cpu.rs` runs
//! them on the CPU in every test run (which checks the suites themselves, the threads backend
//! and the device-threads group's host path); `cuda_ddp.rs` and `cuda_device_group.rs` run them
//! on a [`DeviceThreadGroup`] on `cuda:0` (skipped without a GPU).
//!
//! - [`ddp`]: DistributedDataParallel on a [`Backend`] against one process training on the full
//!   batch on the same device — gradients after one step, parameters after k steps, for 1, 2, 4
//!   and 8 ranks — and SyncBatchNorm, no_sync, unused parameters, bucket rebuild, compression
//!   hooks, gradients as bucket views, telemetry; [`ddp_unused`]: a parameter no rank uses.
//! - [`collectives`]: every collective, reduce op and dtype of a device group against the
//!   threads backend (the CPU reference) on the same inputs, bit for bit, plus ordering,
//!   mismatches and placement.
//! - [`gate`]: holding a CUDA stream, to show that the host does not wait for the device.
//! - [`host_syncs`]: DDP's backward never makes the host wait for the device, counted by the
//!   CUDA emulator (`cuda_ddp_syncs.rs`).
//!
//! Failures name the backend and device, the world size, the rank, the model or collective, and
//! the parameter or element, so that a run on a lent GPU can be debugged from its output alone.

#![allow(dead_code)]

pub mod collectives;
pub mod ddp;
pub mod ddp_unused;
pub mod gate;
pub mod host_syncs;

use std::fmt;
use std::sync::Arc;

use tandem_core::Device;
use tandem_dist::{DeviceThreadGroup, ProcessGroup, ThreadProcessGroup};

/// The world sizes of the equivalence runs.
pub const WORLDS: [usize; 4] = [1, 2, 4, 8];

/// The process group a suite runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Backend {
    /// [`ThreadProcessGroup`]: ranks are threads, tensors are on the CPU.
    Threads,
    /// [`DeviceThreadGroup`]: ranks are threads sharing one device (the CPU too).
    DeviceThreads(Device),
}

impl Backend {
    /// Where the models, batches and gradients live.
    pub fn device(self) -> Device {
        match self {
            Backend::Threads => Device::Cpu,
            Backend::DeviceThreads(device) => device,
        }
    }

    /// A whole group of `world` ranks; element `k` is rank `k`.
    pub fn groups(self, world: usize) -> Vec<Arc<dyn ProcessGroup>> {
        let made = match self {
            Backend::Threads => ThreadProcessGroup::new_group(world)
                .map(|gs| gs.into_iter().map(|g| Arc::new(g) as _).collect()),
            Backend::DeviceThreads(device) => DeviceThreadGroup::new_group(device, world)
                .map(|gs| gs.into_iter().map(|g| Arc::new(g) as _).collect()),
        };
        made.unwrap_or_else(|e| panic!("{self}: a group of {world} ranks: {e}"))
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Threads => write!(f, "threads backend (cpu)"),
            Backend::DeviceThreads(device) => write!(f, "device-threads group on {device}"),
        }
    }
}

/// Runs `f(rank, group)` on `world` ranks of `backend`, one thread each (a device group's
/// ranks must issue from their own threads), and returns the results in rank order.
pub fn on_ranks<T: Send>(
    backend: Backend,
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    let groups = backend.groups(world);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                std::thread::Builder::new()
                    .name(format!("rank {rank} of {world}"))
                    .spawn_scoped(s, move || f(rank, g))
                    .expect("a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    panic!("{backend}: rank {rank} of {world} panicked (its message is above)")
                })
            })
            .collect()
    })
}

/// [`on_ranks`] on a device-threads group on `device`.
pub fn on_device_ranks<T: Send>(
    device: Device,
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    on_ranks(Backend::DeviceThreads(device), world, f)
}
