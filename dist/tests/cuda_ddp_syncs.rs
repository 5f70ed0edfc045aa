//! DDP on the (emulated) GPU performs no host synchronisation inside backward (issue 21, item
//! 4), on a [`tandem_dist::DeviceThreadGroup`]: the suite is `device_suite/host_syncs.rs`. The
//! emulator's counters are per process, so this file holds that one measurement and nothing
//! else runs beside it. On a real GPU there are no counters: the test says so and passes.

mod ddp_common;
mod device_suite;

use ddp_common::Model;
use device_suite::host_syncs::{
    assert_no_host_sync_in_backward, config, count_backward, Meeting, RankBarrier, STEPS,
};
use device_suite::{on_ranks, Backend};
use tandem_core::Device;

const BACKEND: Backend = Backend::DeviceThreads(Device::Cuda(0));

fn check(model: Model, world: usize) {
    let barrier = RankBarrier::new(world);
    let meeting = Meeting::Threads(&barrier);
    let counted = on_ranks(BACKEND, world, |rank, group| {
        count_backward(model, rank, group, config(), STEPS, &meeting)
    });
    let what = format!("DDP {model:?} on the {BACKEND}, {world} ranks");
    match counted.into_iter().flatten().next() {
        Some(steps) => assert_no_host_sync_in_backward(&what, &steps),
        None => println!("skipped: {what}: the host synchronisations are counted by the emulator"),
    }
}

#[test]
fn ddp_backward_on_the_device_group_never_makes_the_host_wait_for_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // One test in this binary: the counters see every thread of the process.
    for world in [2, 4] {
        check(Model::Mlp, world);
    }
    check(Model::Cnn, 2);
}
