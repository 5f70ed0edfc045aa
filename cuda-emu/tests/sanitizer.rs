//! The stream sanitizer (`TANDEM_CUDA_SANITIZER=1`, core/src/cuda/sanitizer) on the emulated
//! driver: a kernel writing memory on the compute stream and a kernel reading it on another
//! stream without a wait is an error at the read, naming both kernels and both streams; with the
//! wait it runs; a free racing another stream's use is reported at the next synchronisation.
//!
//! The sanitizer has one host clock for the process, so a synchronisation by a test running in
//! parallel could order the racing read after the write (it would really have run after it) and
//! hide the race: the tests take turns.

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};
use tandem_core::cuda::{self, CudaDevice, DeviceBuffer};
use tandem_core::{Device, Error, Stream};

static SANITIZED: KernelSource = KernelSource {
    name: "cuda_emu_sanitizer",
    source: r#"
#include "tandem.cuh"

// p[i] = value for i < n (one block).
extern "C" __global__ void sanitizer_write(float* p, int n, float value) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        p[i] = value;
    }
}
TANDEM_HOST_EXPORT(sanitizer_write)

// out[i] = 2 * p[i] for i < n (one block).
extern "C" __global__ void sanitizer_read(const float* p, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[i] = 2.0f * p[i];
    }
}
TANDEM_HOST_EXPORT(sanitizer_read)
"#,
    headers: &[],
};

const N: usize = 256;

fn config() -> LaunchConfig {
    LaunchConfig::new("test", [1, 1, 1], [64, 1, 1], 0).unwrap()
}

fn write(p: &DeviceBuffer, value: f32) -> Launch {
    Launch {
        source: &SANITIZED,
        kernel: "sanitizer_write".into(),
        config: config(),
        args: vec![
            KernelArg::Out(p.ptr()),
            KernelArg::I32(N as i32),
            KernelArg::F32(value),
        ],
    }
}

fn read(p: &DeviceBuffer, out: &DeviceBuffer) -> Launch {
    Launch {
        source: &SANITIZED,
        kernel: "sanitizer_read".into(),
        config: config(),
        args: vec![
            KernelArg::In(p.ptr()),
            KernelArg::Out(out.ptr()),
            KernelArg::I32(N as i32),
        ],
    }
}

/// The sanitizer on, the emulator found, the device open; the guard keeps other tests of this
/// file from synchronising meanwhile.
fn setup() -> (MutexGuard<'static, ()>, Arc<CudaDevice>, Stream) {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    // Before the first CUDA call of the process: the sanitizer reads the variable once.
    std::env::set_var("TANDEM_CUDA_SANITIZER", "1");
    common::use_emulator();
    assert!(cuda::sanitizer::enabled());
    let dev = cuda::device(0).unwrap();
    let side = Stream::new_on(Device::Cuda(0), "side").unwrap();
    (turn, dev, side)
}

fn race_text(e: Error) -> String {
    match e {
        Error::StreamRace { .. } => e.to_string(),
        other => panic!("expected a stream race, got {other}"),
    }
}

#[test]
fn a_read_on_another_stream_without_a_wait_for_the_write_is_an_error_naming_both() {
    let (_turn, dev, side) = setup();
    let compute = dev.compute_stream();
    let side_cuda = side.cuda_stream().unwrap();
    let x = DeviceBuffer::alloc("x for the test", &dev, N * 4, compute).unwrap();
    let out = DeviceBuffer::alloc("out for the test", &dev, N * 4, side_cuda).unwrap();
    dev.launch(&write(&x, 1.5), compute).unwrap();
    // The side stream reads x without waiting for the compute stream's write.
    let e = dev.launch(&read(&x, &out), side_cuda).unwrap_err();
    let text = race_text(e);
    for part in [
        "`sanitizer_read` (read on stream 'side (cuda:0)')",
        "`sanitizer_write` (write on stream 'compute (cuda:0)')",
        &format!("{} bytes at {:#x}", N * 4, x.ptr()),
        "allocated by `x for the test` on stream 'compute (cuda:0)'",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    // The racing launch was not issued; ordering it makes it run.
    side.wait_event(
        &Stream::compute(Device::Cuda(0))
            .unwrap()
            .record_event()
            .unwrap(),
    )
    .unwrap();
    dev.launch(&read(&x, &out), side_cuda).unwrap();
    side.synchronize().unwrap();
    dev.synchronize().unwrap();
}

#[test]
fn a_read_after_a_wait_for_an_event_recorded_after_the_write_is_fine() {
    let (_turn, dev, side) = setup();
    let compute = Stream::compute(Device::Cuda(0)).unwrap();
    let side_cuda = side.cuda_stream().unwrap();
    let x = DeviceBuffer::alloc("x", &dev, N * 4, dev.compute_stream()).unwrap();
    let out = DeviceBuffer::alloc("out", &dev, N * 4, side_cuda).unwrap();
    // An event recorded before the write does not order it.
    let early = compute.record_event().unwrap();
    dev.launch(&write(&x, 2.0), dev.compute_stream()).unwrap();
    side.wait_event(&early).unwrap();
    let e = dev.launch(&read(&x, &out), side_cuda).unwrap_err();
    assert!(race_text(e).contains("`sanitizer_write`"));
    let written = compute.record_event().unwrap();
    side.wait_event(&written).unwrap();
    dev.launch(&read(&x, &out), side_cuda).unwrap();
    // The compute stream overwrites x only after the side stream's read.
    let e = dev
        .launch(&write(&x, 3.0), dev.compute_stream())
        .unwrap_err();
    assert!(
        race_text(e).contains("`sanitizer_read` (read on stream 'side (cuda:0)')"),
        "write after read"
    );
    compute.wait_event(&side.record_event().unwrap()).unwrap();
    dev.launch(&write(&x, 3.0), dev.compute_stream()).unwrap();
    // x is freed on compute, out on the side stream: each is ordered after its users.
    drop(x);
    drop(out);
    dev.synchronize().unwrap();
}

#[test]
fn a_free_racing_another_streams_use_is_reported_at_the_next_synchronisation() {
    let (_turn, dev, side) = setup();
    let compute = Stream::compute(Device::Cuda(0)).unwrap();
    let side_cuda = side.cuda_stream().unwrap();
    let x = DeviceBuffer::alloc("x freed early", &dev, N * 4, dev.compute_stream()).unwrap();
    let out = DeviceBuffer::alloc("out", &dev, N * 4, side_cuda).unwrap();
    dev.launch(&write(&x, 1.0), dev.compute_stream()).unwrap();
    side.wait_event(&compute.record_event().unwrap()).unwrap();
    dev.launch(&read(&x, &out), side_cuda).unwrap();
    // Not marked as used on the side stream (record_stream): the free on compute does not
    // wait for the read.
    drop(x);
    let text = race_text(dev.synchronize().unwrap_err());
    for part in [
        "memory freed on stream 'compute (cuda:0)'",
        "`sanitizer_read` (read on stream 'side (cuda:0)')",
        "allocated by `x freed early`",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    dev.synchronize().expect("reported once");
    // Marked as used there, the same free waits for the read: nothing to report.
    let y = DeviceBuffer::alloc("y", &dev, N * 4, dev.compute_stream()).unwrap();
    dev.launch(&write(&y, 1.0), dev.compute_stream()).unwrap();
    side.wait_event(&compute.record_event().unwrap()).unwrap();
    dev.launch(&read(&y, &out), side_cuda).unwrap();
    y.record_stream(side_cuda);
    drop(y);
    dev.synchronize().unwrap();
    side.synchronize().unwrap();
}
