//! Kernels of different streams run at the same time, as on a GPU: two kernels on two streams
//! that each wait for a flag the other raises both see it. (They used to share a process-wide
//! launch lock: whichever ran first spun until it gave up, so one of the two always failed.)

mod common;
#[path = "common/kernels.rs"]
mod kernels;

use tandem_core::cuda;
use tandem_core::{DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);

/// About 5 s of the emulated 2 GHz clock: far longer than the other kernel needs, short enough
/// that a regression fails instead of hanging.
const LIMIT_CYCLES: i64 = 10_000_000_000;

#[test]
fn kernels_of_two_streams_waiting_for_each_other_both_finish() {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    // Flags and results as one-element f32 tensors: 0.0 is the bit pattern 0 (a flag down);
    // the kernels write u32 bits.
    let zeros = || Tensor::zeros(&[1], DType::F32, GPU).unwrap();
    let (started, flag, seen_flag, seen_started) = (zeros(), zeros(), zeros(), zeros());
    let ptr = |t: &Tensor| cuda::device_pointer("test", t).unwrap().1;
    dev.synchronize().unwrap();
    let first = dev.new_stream().unwrap();
    let second = dev.new_stream().unwrap();
    // The first stream raises `started`, then waits for `flag`; the second waits for `started`,
    // then raises `flag`. Whichever starts first, it can finish only if the other runs beside it.
    dev.launch(
        &kernels::signal_then_wait(ptr(&started), ptr(&flag), LIMIT_CYCLES, ptr(&seen_flag)),
        &first,
    )
    .unwrap();
    dev.launch(
        &kernels::wait_for_flag(ptr(&started), LIMIT_CYCLES, ptr(&seen_started)),
        &second,
    )
    .unwrap();
    dev.launch(&kernels::set_flag(ptr(&flag), 1), &second)
        .unwrap();
    first.synchronize().unwrap();
    second.synchronize().unwrap();
    let bits = |t: &Tensor| t.to_vec::<f32>().unwrap()[0].to_bits();
    assert_eq!(
        (bits(&seen_started), bits(&seen_flag)),
        (1, 1),
        "a kernel gave up waiting for the other stream's kernel (0 = gave up): kernels of \
         different streams did not run at the same time"
    );
}
