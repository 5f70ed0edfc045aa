//! GPU conformance of the CUDA runtime: every runtime operation on a CUDA tensor against the
//! same operation on the CPU, host↔device round trips of every dtype, streams and events,
//! memory reuse across streams, and a cuBLAS product against the CPU.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).

use std::time::Duration;

use tandem_core::cuda;
use tandem_core::{DType, Device, Generator, Layout, Stream, Tensor};

const GPU: Device = Device::Cuda(0);

const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];

fn sample(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    let values = Tensor::randn(shape, 0.0, 30.0, DType::F64, Device::Cpu, &mut gen).unwrap();
    let values = if dtype == DType::U8 {
        let abs: Vec<f64> = values
            .to_vec_f64()
            .unwrap()
            .iter()
            .map(|v| v.abs())
            .collect();
        Tensor::from_vec(abs, shape, Device::Cpu).unwrap()
    } else {
        values
    };
    values.to_dtype(dtype).unwrap()
}

fn assert_same(what: &str, gpu: &Tensor, cpu: &Tensor, tol: f64) {
    assert_eq!(gpu.dims(), cpu.dims(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let (g, c) = (gpu.to_vec_f64().unwrap(), cpu.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what}: element {i}: cuda {a} vs cpu {b}");
    }
}

#[test]
fn every_dtype_round_trips_through_the_device_bit_for_bit() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        for shape in [&[][..], &[0][..], &[1][..], &[7, 13][..], &[3, 1000, 5][..]] {
            let host = sample(shape, dtype, 1);
            let dev = host.to_device(GPU).unwrap();
            assert_eq!(dev.device(), GPU);
            let back = dev.to_device(Device::Cpu).unwrap();
            assert_same(&format!("round trip {dtype} {shape:?}"), &back, &host, 0.0);
        }
    }
    // A transfer larger than one staging chunk.
    let big = sample(&[3 << 20], DType::F32, 2);
    let back = big.to_device(GPU).unwrap().to_device(Device::Cpu).unwrap();
    assert_same("24 MiB round trip", &back, &big, 0.0);
}

#[test]
fn runtime_ops_on_the_device_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        let a = sample(&[33, 65], dtype, 3);
        let b = sample(&[33, 65], dtype, 4);
        let (ga, gb) = (a.to_device(GPU).unwrap(), b.to_device(GPU).unwrap());
        // fill_ on a strided view (a column).
        let col = |t: &Tensor| {
            t.view_detached(t.layout().narrow("n", 1, 5, 3).unwrap())
                .unwrap()
        };
        col(&a).fill_(7.0).unwrap();
        col(&ga).fill_(7.0).unwrap();
        assert_same(&format!("fill_ {dtype}"), &ga, &a, 0.0);
        // copy_ from a transposed view, and contiguous().
        let t = |x: &Tensor| {
            x.view_detached(x.layout().transpose("t", 0, 1).unwrap())
                .unwrap()
        };
        let (ct, gt) = (
            t(&b).copy_detached().unwrap(),
            t(&gb).copy_detached().unwrap(),
        );
        assert!(gt.is_contiguous());
        assert_same(&format!("contiguous {dtype}"), &gt, &ct, 0.0);
        // casts to every dtype.
        for to in DTYPES {
            assert_same(
                &format!("cast {dtype} -> {to}"),
                &gb.to_dtype(to).unwrap(),
                &b.to_dtype(to).unwrap(),
                0.0,
            );
        }
        if matches!(dtype, DType::F32 | DType::F64) {
            a.scale_(0.5).unwrap();
            ga.scale_(0.5).unwrap();
            assert_same(&format!("scale_ {dtype}"), &ga, &a, 1e-7);
            a.add_scaled_(&b, -1.5).unwrap();
            ga.add_scaled_(&gb, -1.5).unwrap();
            assert_same(&format!("add_scaled_ {dtype}"), &ga, &a, 1e-6);
            // Accumulating a tensor into itself (aliasing).
            ga.add_(&ga.clone()).unwrap();
            a.add_(&a.clone()).unwrap();
            assert_same(&format!("self add {dtype}"), &ga, &a, 1e-6);
        }
    }
}

/// Empty tensors (zero-byte allocations at address 0, and zero-length views into a real
/// allocation) go through every runtime operation as on the CPU: nothing is launched, copied or
/// refused as overlapping.
#[test]
fn runtime_ops_on_empty_tensors_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        for shape in [&[0][..], &[3, 0], &[0, 5], &[2, 0, 4]] {
            let what = format!("{dtype} {shape:?}");
            let host = sample(shape, dtype, 7);
            let dev = host.to_device(GPU).unwrap();
            assert_eq!(dev.dims(), shape, "{what}: upload");
            assert_same(
                &format!("{what}: round trip"),
                &dev.to_device(Device::Cpu).unwrap(),
                &host,
                0.0,
            );
            for t in [&dev, &host] {
                t.fill_(3.0).unwrap();
                t.copy_(&t.clone()).unwrap();
                let other = Tensor::zeros(shape, dtype, t.device()).unwrap();
                t.copy_(&other).unwrap();
            }
            assert_same(&format!("{what}: fill_ and copy_"), &dev, &host, 0.0);
            for to in DTYPES {
                assert_same(
                    &format!("{what}: cast to {to}"),
                    &dev.to_dtype(to).unwrap(),
                    &host.to_dtype(to).unwrap(),
                    0.0,
                );
            }
            if matches!(dtype, DType::F32 | DType::F64) {
                dev.scale_(0.5).unwrap();
                dev.add_scaled_(&dev.clone(), 2.0).unwrap();
                dev.add_(&Tensor::ones(shape, dtype, GPU).unwrap()).unwrap();
                assert_eq!(dev.to_vec_f64().unwrap(), Vec::<f64>::new(), "{what}");
            }
        }
        // A zero-length window of a real allocation (its address is not 0), transposed.
        let host = sample(&[4, 6], dtype, 8);
        let dev = host.to_device(GPU).unwrap();
        let window = |t: &Tensor| {
            let n = t
                .view_detached(t.layout().narrow("n", 1, 3, 0).unwrap())
                .unwrap();
            n.view_detached(n.layout().transpose("t", 0, 1).unwrap())
                .unwrap()
        };
        let (hw, dw) = (window(&host), window(&dev));
        assert_eq!(dw.dims(), [0, 4]);
        dw.fill_(1.0).unwrap();
        dw.copy_(&Tensor::zeros(&[0, 4], dtype, GPU).unwrap())
            .unwrap();
        assert_same(
            &format!("{dtype}: window"),
            &dw.copy_detached().unwrap(),
            &hw.copy_detached().unwrap(),
            0.0,
        );
        assert_same(&format!("{dtype}: around the window"), &dev, &host, 0.0);
    }
}

#[test]
fn creation_and_broadcast_views_on_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let z = Tensor::zeros(&[4, 5], DType::F32, GPU).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 20]);
    let f = Tensor::full(&[3], 2.5, DType::F64, GPU).unwrap();
    assert_eq!(f.to_vec::<f64>().unwrap(), vec![2.5; 3]);
    let row = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[1, 3], GPU).unwrap();
    let expanded = row
        .view_detached(row.layout().expand("e", &[4, 3]).unwrap())
        .unwrap();
    assert_eq!(
        expanded.copy_detached().unwrap().to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0].repeat(4)
    );
    // Reading a single element through a one-element view (what gradcheck does).
    let e = row
        .view_detached(Layout::from_parts(
            Default::default(),
            Default::default(),
            2,
        ))
        .unwrap();
    assert_eq!(e.item().unwrap(), 3.0);
}

#[test]
fn events_order_streams_and_measure_time() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let compute = Stream::compute(GPU).unwrap();
    let comm = Stream::new_on(GPU, "comm").unwrap();
    // GPU-sized only so that the GPU's kernels take measurable time; the emulator's take long
    // enough at any size.
    let elements = if tandem_test_support::on_emulator() {
        1 << 14
    } else {
        1 << 22
    };
    let t = Tensor::zeros(&[elements], DType::F32, GPU).unwrap();
    let start = compute.record_event().unwrap();
    for _ in 0..20 {
        t.add_scaled_(&t.clone(), 1.0).unwrap();
    }
    t.fill_(1.0).unwrap();
    let end = compute.record_event().unwrap();
    comm.wait_event(&end).unwrap();
    let on_comm = comm.record_event().unwrap();
    assert!(on_comm.wait_timeout(Duration::from_secs(30)).unwrap());
    assert!(
        end.is_complete(),
        "the comm stream's event came after compute's"
    );
    let took = start.elapsed_until(&end).unwrap();
    // A real GPU's bound: on the emulator (host threads on a shared machine) only the order.
    let bound = if tandem_test_support::on_emulator() {
        Duration::MAX
    } else {
        Duration::from_secs(10)
    };
    assert!(took > Duration::ZERO && took < bound, "{took:?}");
    assert_eq!(t.to_vec::<f32>().unwrap()[..4], [1.0; 4]);
    // Host events and device events are of different devices.
    assert!(start
        .elapsed_until(&tandem_core::Event::completed())
        .is_err());
}

#[test]
fn memory_used_on_a_second_stream_is_not_reused_before_that_stream_is_done() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let dev = cuda::device(0).unwrap();
    let comm = Stream::new_on(GPU, "comm").unwrap();
    // GPU-sized so that the comm stream is still busy on a GPU when the host allocates again;
    // the emulator's stream workers are slow enough with far less (and 16M elements × 600
    // launches takes it over 15 minutes).
    let (n, launches) = if tandem_test_support::on_emulator() {
        (1 << 16, 20)
    } else {
        (1 << 24, 200)
    };
    for _ in 0..3 {
        {
            let t = Tensor::full(&[n], 3.0, DType::F32, GPU).unwrap();
            let ready = Stream::compute(GPU).unwrap().record_event().unwrap();
            comm.wait_event(&ready).unwrap();
            // Keep the comm stream writing `t` for a while after the host drops it.
            let (_, ptr) = cuda::device_pointer("test", &t).unwrap();
            let view = cuda::runtime_kernels::DeviceView {
                ptr,
                dtype: DType::F32,
                layout: t.layout(),
            };
            let launch = cuda::runtime_kernels::scale_launch(view, 2.0).unwrap();
            for _ in 0..launches {
                dev.launch(&launch, comm.cuda_stream().unwrap()).unwrap();
            }
            t.record_stream(&comm).unwrap();
        }
        // A new allocation of the same size on the compute stream, written at once: had it
        // been given the dropped memory before the comm stream finished, the comm stream's
        // later launches would double its values.
        let fresh = Tensor::full(&[n], 5.0, DType::F32, GPU).unwrap();
        comm.synchronize().unwrap();
        let values = fresh.to_vec::<f32>().unwrap();
        assert!(values.iter().all(|&v| v == 5.0), "memory reused too early");
    }
    let stats = cuda::memory_stats(0).unwrap();
    assert!(stats.peak_allocated >= n * 4, "{stats:?}");
    assert!(stats.reserved >= stats.allocated, "{stats:?}");
}

#[test]
fn asking_for_a_device_that_does_not_exist_names_the_count() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let n = cuda::device_count();
    let err = Tensor::zeros(&[1], DType::F32, Device::Cuda(n))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("cuda:{n}")) && err.contains("CUDA device"),
        "{err}"
    );
}

#[test]
fn cublas_product_matches_the_cpu_with_and_without_tf32() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    use cudarc::cublas::{result as cublas, sys::cublasOperation_t::CUBLAS_OP_N};
    let (m, k, n) = (67usize, 45usize, 33usize);
    let a = sample(&[m, k], DType::F32, 5);
    let b = sample(&[k, n], DType::F32, 6);
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let mut expected = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            expected[i * n + j] = (0..k)
                .map(|p| av[i * k + p] as f64 * bv[p * n + j] as f64)
                .sum();
        }
    }
    for tf32 in [false, true] {
        let (ga, gb) = (a.to_device(GPU).unwrap(), b.to_device(GPU).unwrap());
        let c = Tensor::empty(&[m, n], DType::F32, GPU).unwrap();
        let dev = cuda::device(0).unwrap();
        let ptr = |t: &Tensor| cuda::device_pointer("test", t).unwrap().1;
        let (pa, pb, pc) = (ptr(&ga), ptr(&gb), ptr(&c));
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ.
        cuda::blas::with_blas("test", &dev, dev.compute_stream(), tf32, |h| unsafe {
            cublas::sgemm(
                h,
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &1.0,
                pb as *const f32,
                n as i32,
                pa as *const f32,
                k as i32,
                &0.0,
                pc as *mut f32,
                n as i32,
            )
        })
        .unwrap();
        let got = c.to_vec::<f32>().unwrap();
        let scale = expected.iter().map(|v| v.abs()).fold(0.0, f64::max);
        let worst = got
            .iter()
            .zip(&expected)
            .map(|(g, e)| (*g as f64 - e).abs())
            .fold(0.0, f64::max);
        let tol = if tf32 { 5e-3 } else { 1e-5 };
        assert!(
            worst <= tol * scale,
            "tf32 {tf32}: worst error {worst} (scale {scale})"
        );
    }
}

#[test]
fn copies_on_a_second_stream_are_ordered_by_their_event() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let copy = Stream::new_on(GPU, "copy").unwrap();
    let compute = Stream::compute(GPU).unwrap();
    for round in 0..20 {
        let host = sample(&[257, 129], DType::F32, 100 + round);
        let (dev, ready) = host.to_device_on(GPU, &copy).unwrap();
        compute.wait_event(&ready).unwrap();
        // A kernel on the compute stream reads the copy right after the wait.
        let doubled = dev.copy_detached().unwrap();
        doubled.scale_(2.0).unwrap();
        let want: Vec<f32> = host
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v * 2.0)
            .collect();
        assert_eq!(doubled.to_vec::<f32>().unwrap(), want, "round {round}");
    }
}

/// A kernel that holds its stream: one thread spins until the flag (host memory mapped into the
/// device) turns non-zero, or until `limit` clock cycles have passed, so that a test failing
/// before it releases the gate cannot leave the device spinning.
static GATE: tandem_core::cuda::launch::KernelSource = tandem_core::cuda::launch::KernelSource {
    name: "cuda_runtime_test_gate",
    source: r#"
#include "tandem.cuh"

extern "C" __global__ void gate(const volatile unsigned int* flag, long long limit) {
    long long start = clock64();
    while (*flag == 0u && clock64() - start < limit) {
    }
}
TANDEM_HOST_EXPORT(gate)
"#,
    headers: &[],
};

/// About 30 s of spinning at 2 GHz: far longer than the test waits, far shorter than forever.
const GATE_LIMIT_CYCLES: i64 = 60_000_000_000;

/// A gate kernel running on a stream, released by writing its flag from the host (through
/// pinned memory mapped into the device, so no stream has to run for the release). Dropping it
/// releases the gate and waits for the stream, so a failing assertion cannot leave it closed.
struct Gate {
    host: *mut u32,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl Gate {
    fn close(dev: &cuda::CudaDevice, stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Gate {
        use cudarc::driver::{result, sys};
        use tandem_core::cuda::launch::{KernelArg, Launch, LaunchConfig};
        dev.bind("test").unwrap();
        // SAFETY: a plain 4-byte allocation of pinned, device-mapped host memory.
        let host = unsafe {
            result::malloc_host(
                4,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .unwrap()
        .cast::<u32>();
        // SAFETY: `host` points at 4 writable bytes no kernel uses yet.
        unsafe { host.write_volatile(0) };
        let mut device_ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP; the out-pointer is valid.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host.cast(), 0) }
            .result()
            .unwrap();
        let launch = Launch {
            source: &GATE,
            kernel: "gate".into(),
            config: LaunchConfig::new("gate", [1, 1, 1], [1, 1, 1], 0).unwrap(),
            args: vec![KernelArg::In(device_ptr), KernelArg::I64(GATE_LIMIT_CYCLES)],
        };
        let gate = Gate {
            host,
            stream: stream.clone(),
        };
        dev.launch(&launch, stream).unwrap();
        gate
    }

    fn open(&self) {
        // SAFETY: the flag lives until drop; the kernel only reads it.
        unsafe { self.host.write_volatile(1) };
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
        let _ = self.stream.synchronize();
        // SAFETY: the kernel reading the flag has finished (the stream is synchronised).
        let _ = unsafe { cudarc::driver::result::free_host(self.host.cast()) };
    }
}

#[test]
fn gate_kernel_compiles_with_nvrtc() {
    // Runs wherever NVRTC is found (CI installs it), so the GPU test below cannot fail on its
    // kernel's source.
    use tandem_core::cuda::nvrtc::{compile, nvrtc_version, Arch, CompileOptions};
    // First, as every GPU test: the NVRTC this process loads must match its driver.
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    if nvrtc_version(Device::Cuda(0)).is_err() {
        println!("skipped: NVRTC not found");
        return;
    }
    let cubin = compile(&GATE, Arch::new(9, 0), &CompileOptions::default()).unwrap();
    assert!(!cubin.image.is_empty());
}

#[test]
fn a_compute_allocation_after_a_comm_stream_free_does_not_wait_for_the_comm_stream() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    use tandem_core::cuda::runtime_kernels::{fill_launch, DeviceView};
    let dev = cuda::device(0).unwrap();
    let compute = dev.compute_stream().clone();
    let comm = dev.new_stream().unwrap();
    // Start from an empty pool: the block freed on the comm stream below is then the only
    // cached memory that fits, the one a pool with internal dependencies would hand over.
    cuda::empty_cache(0).unwrap();
    // 64 MiB on a GPU; 1 MiB on the emulator, whose fill must finish inside the bounded host
    // wait below while the gate holds (it fills at host speed, block by block).
    let bytes: usize = if tandem_test_support::on_emulator() {
        1 << 20
    } else {
        64 << 20
    };
    let gate = Gate::close(&dev, &comm);
    let gate_passed = comm.record_event(Some(CU_EVENT_DISABLE_TIMING)).unwrap();
    // Comm-stream memory (an NCCL temporary, say), freed behind the still-running gate.
    drop(cuda::DeviceBuffer::alloc("test", &dev, bytes, &comm).unwrap());
    // The compute stream allocates the same size and runs a kernel on it.
    let fresh = cuda::DeviceBuffer::alloc("test", &dev, bytes, &compute).unwrap();
    let layout = Layout::contiguous(&[bytes / 4]);
    let view = DeviceView {
        ptr: fresh.ptr(),
        dtype: DType::F32,
        layout: &layout,
    };
    dev.launch(&fill_launch(view, 1.0).unwrap(), &compute)
        .unwrap();
    let done = compute.record_event(Some(CU_EVENT_DISABLE_TIMING)).unwrap();
    // A bounded host wait: the compute work needs microseconds, the gate holds for ~30 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut finished = false;
    while std::time::Instant::now() < deadline {
        if done.try_is_complete().unwrap() {
            finished = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let gate_held = !gate_passed.try_is_complete().unwrap();
    drop(gate);
    compute.synchronize().unwrap();
    assert!(
        gate_held,
        "the gate kernel stopped holding the comm stream early; the test proves nothing"
    );
    assert!(
        finished,
        "a compute-stream allocation after a comm-stream free waited for the comm stream"
    );
    drop(fresh);
}

#[test]
fn concurrent_transfers_beyond_the_pinned_cache_cap_arrive_whole() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // Four threads each moving 40 MiB (five 8 MiB chunks) both ways, three times: far more
    // staging than the pinned cache's 64 MiB cap, so copies wait for busy buffers or go through
    // pageable memory. Every byte must still arrive.
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                for round in 0..3 {
                    let host = sample(&[10 << 20], DType::F32, 1000 + 10 * t + round);
                    let back = host.to_device(GPU).unwrap().to_device(Device::Cpu).unwrap();
                    assert_same(&format!("thread {t} round {round}"), &back, &host, 0.0);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // The trim point frees what is idle; transfers keep working after it.
    cuda::empty_cache(0).unwrap();
    let host = sample(&[1000], DType::F64, 7);
    let back = host.to_device(GPU).unwrap().to_device(Device::Cpu).unwrap();
    assert_same("after the trim", &back, &host, 0.0);
}

#[test]
fn casts_keep_a_channels_last_tensor_channels_last_on_the_device_as_on_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    use tandem_core::MemoryFormat;
    let cl = MemoryFormat::ChannelsLast;
    let host = sample(&[2, 3, 4, 5], DType::F32, 11)
        .contiguous_in(cl)
        .unwrap();
    let dev = host.to_device(GPU).unwrap().contiguous_in(cl).unwrap();
    for to in [DType::BF16, DType::F16, DType::F64] {
        let (d, h) = (dev.to_dtype(to).unwrap(), host.to_dtype(to).unwrap());
        assert_eq!(d.memory_format(), cl, "cuda cast to {to:?}");
        assert_eq!(h.memory_format(), cl, "cpu cast to {to:?}");
        assert_same(&format!("cast to {to:?}"), &d, &h, 0.0);
    }
}

#[test]
fn a_device_tensor_is_re_laid_out_in_place() {
    use tandem_core::MemoryFormat;
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let host = sample(&[2, 3, 4, 5], DType::F32, 9);
    let w = host.to_device(Device::Cuda(0)).unwrap();
    w.set_requires_grad(true).unwrap();
    w.set_grad(Some(host.to_device(Device::Cuda(0)).unwrap()))
        .unwrap();
    let (id, handle) = (w.id(), w.clone());
    w.to_memory_format_(MemoryFormat::ChannelsLast).unwrap();
    assert_eq!(handle.id(), id);
    assert!(handle.layout().is_channels_last());
    assert_eq!(handle.device(), Device::Cuda(0));
    assert_same("re-laid out", &handle, &host, 0.0);
    assert!(w.grad().unwrap().layout().is_channels_last());
    assert_same("its gradient", &w.grad().unwrap(), &host, 0.0);
    // Back to the host, in place: the strides and values come along.
    w.move_to_device(Device::Cpu).unwrap();
    assert!(w.layout().is_channels_last());
    assert_eq!(w.to_vec::<f32>().unwrap(), host.to_vec::<f32>().unwrap());
}
