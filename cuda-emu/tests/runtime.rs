//! tandem's own CUDA runtime (tandem-core, through cudarc) against the emulated driver and
//! NVRTC: the device comes up, tensors round-trip, the runtime's kernels run, streams really run
//! concurrently (a missing wait is a race) and events order them.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use tandem_core::cuda::{self, libs, nvrtc::Arch};
use tandem_core::{DType, Device, Stream, Tensor};

const GPU: Device = Device::Cuda(0);

fn setup() {
    common::use_emulator();
}

#[test]
fn the_emulated_device_comes_up_through_tandems_library_search() {
    setup();
    let folder = common::use_emulator();
    let driver = libs::locate(libs::CudaLibrary::Driver, GPU).unwrap();
    assert!(
        driver.starts_with(folder),
        "{driver:?} is not the emulator in {folder:?}"
    );
    let nvrtc = libs::locate(libs::CudaLibrary::Nvrtc, GPU).unwrap();
    assert!(nvrtc.starts_with(folder), "{nvrtc:?}");
    assert_eq!(cuda::device_count(), 1);
    let dev = cuda::device(0).unwrap();
    assert_eq!(dev.arch(), Arch::new(9, 0));
    assert!(dev.name().contains("tandem-cuda-emu"), "{}", dev.name());
    assert_eq!(dev.total_memory(), 80 << 30);
    assert_eq!(cuda::nvrtc::nvrtc_version(GPU).unwrap(), (13, 99));
    // A second ordinal does not exist.
    let err = cuda::device(1).unwrap_err().to_string();
    assert!(err.contains("1 CUDA device"), "{err}");
}

#[test]
fn tensors_round_trip_host_device_host() {
    setup();
    for n in [1usize, 7, 1000, 3 << 20] {
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
        let host = Tensor::from_vec(values.clone(), &[n], Device::Cpu).unwrap();
        let dev = host.to_device(GPU).unwrap();
        assert_eq!(dev.device(), GPU);
        assert_eq!(dev.to_vec::<f32>().unwrap(), values, "{n} f32");
    }
    let ints: Vec<i64> = (0..513).map(|i| i * 1_000_000_007 - 5).collect();
    let dev = Tensor::from_vec(ints.clone(), &[513], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    assert_eq!(dev.to_vec::<i64>().unwrap(), ints);
}

#[test]
fn fresh_device_memory_is_poisoned() {
    setup();
    // Memory nobody wrote reads as NaN (all bits set), so a kernel reading it shows.
    let t = Tensor::empty(&[64], DType::F32, GPU).unwrap();
    let v = t.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|x| x.to_bits() == u32::MAX), "{v:?}");
}

#[test]
fn runtime_kernels_fill_copy_and_cast_run_on_the_emulated_device() {
    setup();
    let t = Tensor::zeros(&[33, 65], DType::F32, GPU).unwrap();
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0));
    t.fill_(2.5).unwrap();
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == 2.5));

    // A strided copy: the transpose of a matrix, made contiguous on the device.
    let values: Vec<f64> = (0..6 * 5).map(|i| i as f64).collect();
    let m = Tensor::from_vec(values.clone(), &[6, 5], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap();
    let mt = m
        .view_detached(m.layout().transpose("t", 0, 1).unwrap())
        .unwrap()
        .copy_detached()
        .unwrap();
    assert!(mt.is_contiguous());
    let got = mt.to_vec::<f64>().unwrap();
    for r in 0..5 {
        for c in 0..6 {
            assert_eq!(got[r * 6 + c], values[c * 5 + r], "transpose ({r}, {c})");
        }
    }

    // Casts to and from half precision.
    let h = m
        .to_dtype(DType::F16)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    assert_eq!(h.to_vec::<f64>().unwrap(), values);
    let b = m
        .to_dtype(DType::BF16)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let expected: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    assert_eq!(b.to_vec::<f32>().unwrap(), expected);

    // scale_ and add_scaled_ as well.
    let a = Tensor::full(&[100], 3.0, DType::F32, GPU).unwrap();
    a.scale_(2.0).unwrap();
    a.add_scaled_(&Tensor::full(&[100], 1.0, DType::F32, GPU).unwrap(), -0.5)
        .unwrap();
    assert!(a.to_vec::<f32>().unwrap().iter().all(|&x| x == 5.5));
}

/// A gate a stream's worker can be held at: a host function enqueued on the stream blocks until
/// the test opens the gate (at most 30 s, so a broken test ends by itself).
static GATE_OPEN: AtomicBool = AtomicBool::new(true);

unsafe extern "C" fn wait_at_gate(_: *mut c_void) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !GATE_OPEN.load(Ordering::Acquire) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn hold(stream: &Stream) {
    GATE_OPEN.store(false, Ordering::Release);
    let dev = cuda::device(0).unwrap();
    dev.bind("test").unwrap();
    let s = stream.cuda_stream().unwrap().cu_stream();
    // SAFETY: a host function with no data, on a live stream of the current context.
    let status = unsafe { sys::cuLaunchHostFunc(s, Some(wait_at_gate), std::ptr::null_mut()) };
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS);
}

fn release() {
    GATE_OPEN.store(true, Ordering::Release);
}

/// Copies `src` into `dst` on `stream`, device to device (a read of `src` on that stream).
fn copy_on(stream: &Stream, dst: &Tensor, src: &Tensor) {
    let (dev, d) = cuda::device_pointer("test", dst).unwrap();
    let (_, s) = cuda::device_pointer("test", src).unwrap();
    dev.bind("test").unwrap();
    let bytes = src.numel() * src.dtype().size_in_bytes();
    let cu = stream.cuda_stream().unwrap().cu_stream();
    // SAFETY: both are live allocations of `bytes` bytes on the current context's device.
    let status = unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, bytes, cu) };
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS);
}

#[test]
fn a_missing_wait_between_streams_is_a_real_race_and_an_event_orders_them() {
    setup();
    let _one_gate = GATE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let compute = Stream::compute(GPU).unwrap();
    let side = Stream::new_on(GPU, "side").unwrap();
    let t = Tensor::zeros(&[1024], DType::F32, GPU).unwrap();
    let seen = Tensor::zeros(&[1024], DType::F32, GPU).unwrap();
    compute.synchronize().unwrap();

    // Without a wait: the compute stream is held before its fill; the side stream reads `t` at
    // once and sees the old values. On a GPU this is the same race, only less reproducible.
    hold(&compute);
    t.fill_(1.0).unwrap();
    copy_on(&side, &seen, &t);
    side.synchronize().unwrap();
    release();
    compute.synchronize().unwrap();
    assert!(
        seen.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0),
        "the side stream read `t` before the compute stream wrote it"
    );
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&x| x == 1.0));

    // With the wait: the side stream's copy cannot run before the fill, however long the
    // compute stream is held.
    hold(&compute);
    t.fill_(2.0).unwrap();
    let written = compute.record_event().unwrap();
    side.wait_event(&written).unwrap();
    copy_on(&side, &seen, &t);
    let copied = side.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !copied.is_complete(),
        "the side stream ran past its wait while the compute stream was held"
    );
    release();
    side.synchronize().unwrap();
    assert!(copied.is_complete());
    assert!(seen.to_vec::<f32>().unwrap().iter().all(|&x| x == 2.0));
}

/// The gate is process-wide: tests that use it run one at a time.
static GATE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn timing_events_measure_the_work_between_them() {
    setup();
    let _one_gate = GATE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let compute = Stream::compute(GPU).unwrap();
    let start = compute.record_event().unwrap();
    hold(&compute);
    let end = compute.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!end.is_complete());
    release();
    end.synchronize().unwrap();
    let took = start.elapsed_until(&end).unwrap();
    assert!(took >= Duration::from_millis(20), "{took:?}");
}

#[test]
fn the_default_pool_reports_its_memory() {
    setup();
    let before = cuda::memory_stats(0).unwrap();
    let t = Tensor::zeros(&[1 << 16], DType::F32, GPU).unwrap();
    let during = cuda::memory_stats(0).unwrap();
    assert!(during.reserved >= during.allocated, "{during:?}");
    assert!(during.peak_reserved >= 1 << 18, "{before:?} {during:?}");
    drop(t);
    cuda::empty_cache(0).unwrap();
}

#[test]
fn compiler_errors_come_back_through_the_nvrtc_log() {
    setup();
    static BROKEN: cuda::launch::KernelSource = cuda::launch::KernelSource {
        name: "cuda_emu_broken",
        source: "#include \"tandem.cuh\"\n\
                 extern \"C\" __global__ void broken(float* p) { p[0] = no_such_name; }\n\
                 TANDEM_HOST_EXPORT(broken)\n",
        headers: &[],
    };
    let options = cuda::nvrtc::CompileOptions {
        device: GPU,
        ..Default::default()
    };
    let err = cuda::nvrtc::compile(&BROKEN, Arch::new(9, 0), &options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no_such_name"), "{err}");
    assert!(err.contains("cuda_emu_broken"), "{err}");
}

#[test]
fn a_copy_past_the_end_of_an_allocation_is_refused_naming_it() {
    setup();
    let small = Tensor::zeros(&[8], DType::F32, GPU).unwrap();
    let large = Tensor::zeros(&[16], DType::F32, GPU).unwrap();
    let (dev, d) = cuda::device_pointer("test", &small).unwrap();
    let (_, s) = cuda::device_pointer("test", &large).unwrap();
    dev.bind("test").unwrap();
    let cu = dev.compute_stream().cu_stream();
    // SAFETY: the emulator checks the ranges before touching memory.
    let status = unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, 64, cu) };
    assert_eq!(status, sys::CUresult::CUDA_ERROR_INVALID_VALUE);
    let fault = common::last_fault();
    assert!(fault.contains("run past the end of allocation"), "{fault}");
    assert!(
        fault.contains("of 32 bytes") && fault.contains("by 32 bytes"),
        "{fault}"
    );
    // Not sticky: the device goes on.
    dev.synchronize().unwrap();
}
