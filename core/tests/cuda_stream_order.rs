//! GPU checks of two stream-ordering fixes of issue 19 (each runs on the GPU, or on the CUDA
//! emulator without one):
//!
//! - defect 5: a batch copied on a copy stream and dropped after use on the compute stream is
//!   freed without making the compute stream wait for later copies on the copy stream (a gate
//!   holds the copy stream closed while the first batch is used and dropped);
//! - defect 8: recording events reuses the CUDA event objects of dropped events.
//!
//! One test per binary would keep the process-wide count of created events undisturbed; here
//! the event test only counts events it records itself on a quiet device, and the copy test
//! records none of its own between its two counts.

use std::time::Duration;

use cudarc::driver::{result, sys};
use tandem_core::cuda;
use tandem_core::stream::events_created;
use tandem_core::{DType, Device, Stream, Tensor};

const GPU: Device = Device::Cuda(0);

/// Holds a CUDA stream: work issued on it after [`Gate::close`] waits until [`Gate::open`]
/// (the stream waits for a word of mapped host memory to become 1). Dropping the gate opens it
/// and waits for the stream, so a failing test never leaves the device blocked.
struct Gate {
    host: *mut u32,
    stream: Stream,
}

impl Gate {
    /// `None` when the device cannot wait on memory values.
    fn close(stream: &Stream) -> Option<Gate> {
        let dev = cuda::device(0).unwrap();
        dev.bind("gate").unwrap();
        // SAFETY: a 4-byte mapped, page-locked allocation, written before any stream sees it.
        let host = unsafe {
            let p = result::malloc_host(
                4,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
            .ok()?
            .cast::<u32>();
            std::ptr::write_volatile(p, 0);
            p
        };
        let mut device_address: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; the wait reads 4 bytes of it,
        // which stay allocated until the drop has waited for the stream.
        let closed = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device_address, host.cast(), 0)
                .result()
                .and_then(|()| {
                    sys::cuStreamWaitValue32_v2(
                        stream.cuda_stream().unwrap().cu_stream(),
                        device_address,
                        1,
                        sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                    .result()
                })
        };
        if closed.is_err() {
            // SAFETY: allocated above, never waited on.
            let _ = unsafe { result::free_host(host.cast()) };
            return None;
        }
        Some(Gate {
            host,
            stream: stream.clone(),
        })
    }

    fn open(&self) {
        // SAFETY: the word stays allocated for the gate's life.
        unsafe { std::ptr::write_volatile(self.host, 1) };
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
        let _ = self.stream.synchronize();
        // SAFETY: the stream has passed its wait; nothing reads the word any more.
        let _ = unsafe { result::free_host(self.host.cast()) };
    }
}

fn batch(seed: u64) -> Tensor {
    let values: Vec<f32> = (0..64 * 1024)
        .map(|i| (i as u64 * 7 + seed) as f32)
        .collect();
    Tensor::from_vec(values, &[64, 1024], Device::Cpu).unwrap()
}

#[test]
fn dropping_a_loaded_batch_does_not_wait_for_later_copies() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let copy = Stream::new_on(GPU, "copy").unwrap();
    let compute = Stream::compute(GPU).unwrap();
    // The first batch, copied and made visible to the compute stream as the loader does.
    let first_host = batch(1);
    let (first, ready) = first_host.to_device_on(GPU, &copy).unwrap();
    compute.wait_event(&ready).unwrap();
    // A later batch is prefetched behind a closed gate: its copy cannot finish yet.
    let Some(gate) = Gate::close(&copy) else {
        println!("skipped: the device cannot wait on memory values");
        return;
    };
    let second_host = batch(2);
    let (second, second_ready) = second_host.to_device_on(GPU, &copy).unwrap();
    // Use the first batch on the compute stream, then drop it (the step is over).
    let doubled = first.copy_detached().unwrap();
    doubled.scale_(2.0).unwrap();
    drop(first);
    drop(ready);
    let after = compute.record_event().unwrap();
    let done = after.wait_timeout(Duration::from_secs(20)).unwrap();
    let second_pending = !second_ready.is_complete();
    drop(gate);
    assert!(second_pending, "the gate did not hold the copy stream");
    assert!(
        done,
        "the compute stream waited for a later batch's copy when the first batch was freed"
    );
    let want: Vec<f32> = first_host
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v * 2.0)
        .collect();
    assert_eq!(doubled.to_vec::<f32>().unwrap(), want);
    compute.wait_event(&second_ready).unwrap();
    assert_eq!(
        second.to_vec::<f32>().unwrap(),
        second_host.to_vec::<f32>().unwrap()
    );
}

#[test]
fn recorded_cuda_events_reuse_the_objects_of_dropped_ones() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let compute = Stream::compute(GPU).unwrap();
    let t = Tensor::zeros(&[1 << 20], DType::F32, GPU).unwrap();
    // Warm the pool with the events one step needs, then check that steps reuse them.
    let step = || {
        let start = compute.record_event().unwrap();
        t.add_scaled_(&t.clone(), 1.0).unwrap();
        let end = compute.record_event().unwrap();
        end.synchronize().unwrap();
        start.elapsed_until(&end).unwrap()
    };
    step();
    let before = events_created();
    for _ in 0..20 {
        assert!(step() < Duration::from_secs(10));
    }
    // Other tests in this binary may create a few events meanwhile; 20 steps without reuse
    // would create 40.
    assert!(
        events_created() - before < 20,
        "{} events created for 20 steps",
        events_created() - before
    );
}
