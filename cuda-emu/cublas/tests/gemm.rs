//! The emulated cuBLAS through cudarc, on device memory of the emulated driver: every transpose,
//! padded leading dimensions, strided batches, alpha/beta, beta = 0 over NaN, half inputs, the
//! matrix-vector product, the arguments cuBLAS refuses, operands that run past their buffer,
//! and products running in stream order on the handle's stream.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::cublas::{result as cublas, sys};
use half::{bf16, f16};
use sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use tandem_core::cuda::{self, libs};
use tandem_core::{DType, Device, Element, Tensor};

const GPU: Device = Device::Cuda(0);

fn setup() -> std::sync::Arc<cuda::CudaDevice> {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    // The products below go through tandem's handle; make sure it exists (and the libraries
    // are the emulator's) before any test talks to cuBLAS directly.
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |_| Ok(())).unwrap();
    let cublas = libs::locate(libs::CudaLibrary::Cublas, GPU).unwrap();
    assert!(cublas.starts_with(common::use_emulator()), "{cublas:?}");
    dev
}

/// Values with few significant bits, so every product and sum below is exact in f32 and f64.
fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + seed * 5 + 3) % 11) as f64 * 0.25 - 1.25)
        .collect()
}

fn upload<T: Element + Copy>(v: &[f64], cast: impl Fn(f64) -> T) -> Tensor {
    let data: Vec<T> = v.iter().map(|&x| cast(x)).collect();
    Tensor::from_vec(data, &[v.len()], Device::Cpu)
        .unwrap()
        .to_device(GPU)
        .unwrap()
}

fn ptr(t: &Tensor) -> u64 {
    cuda::device_pointer("test", t).unwrap().1
}

fn download(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// The naive product in f64 over column-major storage: C = alpha·op(A)·op(B) + beta·C.
#[allow(clippy::too_many_arguments)]
fn naive(
    (m, n, k): (usize, usize, usize),
    (a, lda, ta): (&[f64], usize, bool),
    (b, ldb, tb): (&[f64], usize, bool),
    alpha: f64,
    beta: f64,
    c: &[f64],
    ldc: usize,
) -> Vec<f64> {
    let mut out = c.to_vec();
    for j in 0..n {
        for i in 0..m {
            let mut s = 0.0;
            for p in 0..k {
                let x = if ta { a[p + i * lda] } else { a[i + p * lda] };
                let y = if tb { b[j + p * ldb] } else { b[p + j * ldb] };
                s += x * y;
            }
            let old = if beta == 0.0 {
                0.0
            } else {
                beta * c[i + j * ldc]
            };
            out[i + j * ldc] = alpha * s + old;
        }
    }
    out
}

fn op(t: bool) -> sys::cublasOperation_t {
    if t {
        CUBLAS_OP_T
    } else {
        CUBLAS_OP_N
    }
}

#[test]
fn every_transpose_and_padded_leading_dimension_matches_the_naive_product() {
    let dev = setup();
    let (m, n, k) = (5usize, 4usize, 3usize);
    for dtype in [DType::F32, DType::F64] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (ar, ac) = if ta { (k, m) } else { (m, k) };
            let (br, bc) = if tb { (n, k) } else { (k, n) };
            let (lda, ldb, ldc) = (ar + 2, br + 1, m + 3);
            let (a, b, c) = (values(lda * ac, 1), values(ldb * bc, 2), values(ldc * n, 3));
            let (alpha, beta) = (0.75, -0.5);
            let want = naive(
                (m, n, k),
                (&a, lda, ta),
                (&b, ldb, tb),
                alpha,
                beta,
                &c,
                ldc,
            );
            let (ga, gb, gc) = match dtype {
                DType::F32 => (
                    upload(&a, |x| x as f32),
                    upload(&b, |x| x as f32),
                    upload(&c, |x| x as f32),
                ),
                _ => (upload(&a, |x| x), upload(&b, |x| x), upload(&c, |x| x)),
            };
            let (pa, pb, pc) = (ptr(&ga), ptr(&gb), ptr(&gc));
            let dims = (m as i32, n as i32, k as i32);
            let lds = (lda as i32, ldb as i32, ldc as i32);
            cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
                // SAFETY: the buffers hold the matrices their leading dimensions describe.
                match dtype {
                    DType::F32 => cublas::sgemm(
                        h,
                        op(ta),
                        op(tb),
                        dims.0,
                        dims.1,
                        dims.2,
                        &(alpha as f32),
                        pa as *const f32,
                        lds.0,
                        pb as *const f32,
                        lds.1,
                        &(beta as f32),
                        pc as *mut f32,
                        lds.2,
                    ),
                    _ => cublas::dgemm(
                        h,
                        op(ta),
                        op(tb),
                        dims.0,
                        dims.1,
                        dims.2,
                        &alpha,
                        pa as *const f64,
                        lds.0,
                        pb as *const f64,
                        lds.1,
                        &beta,
                        pc as *mut f64,
                        lds.2,
                    ),
                }
            })
            .unwrap();
            assert_eq!(download(&gc), want, "{dtype:?} transa {ta} transb {tb}");
        }
    }
}

#[test]
fn strided_batches_use_their_own_matrices_and_leave_the_gaps() {
    let dev = setup();
    let (m, n, k, batch) = (3usize, 2usize, 4usize, 3usize);
    for dtype in [DType::F32, DType::F64] {
        // A transposed (stored k × m), B not; strides leave gaps between entries.
        let (lda, ldb, ldc) = (k, k + 1, m + 1);
        let (sa, sb, sc) = (lda * m + 2, ldb * n + 1, ldc * n + 3);
        let (a, b, c) = (
            values(sa * batch, 4),
            values(sb * batch, 5),
            values(sc * batch, 6),
        );
        let (alpha, beta) = (2.0, 1.0);
        let mut want = c.clone();
        for e in 0..batch {
            let entry = naive(
                (m, n, k),
                (&a[e * sa..], lda, true),
                (&b[e * sb..], ldb, false),
                alpha,
                beta,
                &c[e * sc..(e + 1) * sc],
                ldc,
            );
            want[e * sc..(e + 1) * sc].copy_from_slice(&entry);
        }
        let (ga, gb, gc) = match dtype {
            DType::F32 => (
                upload(&a, |x| x as f32),
                upload(&b, |x| x as f32),
                upload(&c, |x| x as f32),
            ),
            _ => (upload(&a, |x| x), upload(&b, |x| x), upload(&c, |x| x)),
        };
        let (pa, pb, pc) = (ptr(&ga), ptr(&gb), ptr(&gc));
        cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
            // SAFETY: the buffers hold `batch` entries at these strides.
            match dtype {
                DType::F32 => cublas::sgemm_strided_batched(
                    h,
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    m as i32,
                    n as i32,
                    k as i32,
                    &(alpha as f32),
                    pa as *const f32,
                    lda as i32,
                    sa as i64,
                    pb as *const f32,
                    ldb as i32,
                    sb as i64,
                    &(beta as f32),
                    pc as *mut f32,
                    ldc as i32,
                    sc as i64,
                    batch as i32,
                ),
                _ => cublas::dgemm_strided_batched(
                    h,
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    m as i32,
                    n as i32,
                    k as i32,
                    &alpha,
                    pa as *const f64,
                    lda as i32,
                    sa as i64,
                    pb as *const f64,
                    ldb as i32,
                    sb as i64,
                    &beta,
                    pc as *mut f64,
                    ldc as i32,
                    sc as i64,
                    batch as i32,
                ),
            }
        })
        .unwrap();
        assert_eq!(download(&gc), want, "{dtype:?}");
    }
}

#[test]
fn beta_zero_does_not_read_c() {
    let dev = setup();
    let (m, n, k, ldc) = (2usize, 3usize, 2usize, 4usize);
    let (a, b) = (values(m * k, 7), values(k * n, 8));
    let (ga, gb) = (upload(&a, |x| x as f32), upload(&b, |x| x as f32));
    let gc = upload(&vec![f64::NAN; ldc * n], |x| x as f32);
    let (pa, pb, pc) = (ptr(&ga), ptr(&gb), ptr(&gc));
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
        // SAFETY: the buffers hold the matrices.
        cublas::sgemm(
            h,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            &1.0,
            pa as *const f32,
            m as i32,
            pb as *const f32,
            k as i32,
            &0.0,
            pc as *mut f32,
            ldc as i32,
        )
    })
    .unwrap();
    let want = naive(
        (m, n, k),
        (&a, m, false),
        (&b, k, false),
        1.0,
        0.0,
        &vec![f64::NAN; ldc * n],
        ldc,
    );
    let got = download(&gc);
    for j in 0..n {
        for i in 0..ldc {
            let (g, w) = (got[i + j * ldc], want[i + j * ldc]);
            if i < m {
                assert_eq!(g, w, "C({i}, {j})");
            } else {
                assert!(
                    g.is_nan(),
                    "the padding row {i} of column {j} was written: {g}"
                );
            }
        }
    }
}

#[test]
fn half_inputs_with_f32_compute_through_gemm_ex() {
    let dev = setup();
    let (m, n, k) = (3usize, 2usize, 5usize);
    let (a, b) = (values(m * k, 9), values(k * n, 10));
    let want = naive(
        (m, n, k),
        (&a, m, false),
        (&b, k, false),
        1.0,
        0.0,
        &vec![0.0; m * n],
        m,
    );
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_16F, CUBLAS_COMPUTE_32F};
    use sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    // f16 in, f32 out.
    let (ga, gb) = (upload(&a, f16::from_f64), upload(&b, f16::from_f64));
    let gc = upload(&vec![f64::NAN; m * n], |x| x as f32);
    // bf16 in, bf16 out.
    let (ha, hb) = (upload(&a, bf16::from_f64), upload(&b, bf16::from_f64));
    let hc = upload(&vec![f64::NAN; m * n], bf16::from_f64);
    let (one, zero) = (1.0f32, 0.0f32);
    let status = |h, (pa, pb, pc), (ta, tc), compute| unsafe {
        // SAFETY: the buffers hold the matrices in the types named.
        sys::cublasGemmEx(
            h,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            (&one as *const f32).cast(),
            pa as *const c_void,
            ta,
            m as i32,
            pb as *const c_void,
            ta,
            k as i32,
            (&zero as *const f32).cast(),
            pc as *mut c_void,
            tc,
            m as i32,
            compute,
            CUBLAS_GEMM_DFALT,
        )
    };
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| {
        let ptrs = (ptr(&ga), ptr(&gb), ptr(&gc));
        status(h, ptrs, (CUDA_R_16F, CUDA_R_32F), CUBLAS_COMPUTE_32F).result()?;
        let ptrs = (ptr(&ha), ptr(&hb), ptr(&hc));
        status(h, ptrs, (CUDA_R_16BF, CUDA_R_16BF), CUBLAS_COMPUTE_32F).result()?;
        // An f16 accumulator is not emulated: refused, not computed wrongly.
        let refused = status(h, ptrs, (CUDA_R_16F, CUDA_R_16F), CUBLAS_COMPUTE_16F);
        assert_eq!(refused, sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED);
        Ok(())
    })
    .unwrap();
    assert_eq!(download(&gc), want, "f16 → f32");
    let rounded: Vec<f64> = want.iter().map(|&x| bf16::from_f64(x).to_f64()).collect();
    assert_eq!(download(&hc), rounded, "bf16 → bf16");
}

#[test]
fn gemv_sums_rows_as_tandem_asks() {
    let dev = setup();
    let (m, n) = (4usize, 3usize);
    let a = values(m * n, 11);
    let x = values(n, 12);
    let y0 = values(m, 13);
    let (ga, gx, gy) = (upload(&a, |v| v), upload(&x, |v| v), upload(&y0, |v| v));
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
        // SAFETY: A is m × n dense, x has n elements, y has m.
        cublas::dgemv(
            h,
            CUBLAS_OP_N,
            m as i32,
            n as i32,
            &2.0,
            ptr(&ga) as *const f64,
            m as i32,
            ptr(&gx) as *const f64,
            1,
            &1.0,
            ptr(&gy) as *mut f64,
            1,
        )
    })
    .unwrap();
    let want: Vec<f64> = (0..m)
        .map(|i| 2.0 * (0..n).map(|j| a[i + j * m] * x[j]).sum::<f64>() + y0[i])
        .collect();
    assert_eq!(download(&gy), want);
}

/// `cublasSgemm_v2` with raw integers for the enums, to pass values cudarc's enum cannot hold.
type RawSgemm = unsafe extern "C" fn(
    sys::cublasHandle_t,
    i32,
    i32,
    i32,
    i32,
    i32,
    *const f32,
    *const f32,
    i32,
    *const f32,
    i32,
    *const f32,
    *mut f32,
    i32,
) -> u32;

fn raw_sgemm() -> libloading::Symbol<'static, RawSgemm> {
    let lib = libs::library(libs::CudaLibrary::Cublas, GPU).unwrap();
    // SAFETY: the emulated cuBLAS exports it with this ABI (enums are C ints).
    unsafe { lib.get::<RawSgemm>(b"cublasSgemm_v2") }.unwrap()
}

#[test]
fn arguments_cublas_refuses_give_invalid_value() {
    let dev = setup();
    let f = raw_sgemm();
    let buf = upload(&vec![0.0; 64], |x| x as f32);
    let p = ptr(&buf) as *mut f32;
    let one = 1.0f32;
    // (transa, transb, m, n, k, lda, ldb, ldc) and the status cuBLAS gives.
    type Args = (i32, i32, i32, i32, i32, i32, i32, i32);
    let cases: [(Args, u32, &str); 9] = [
        ((0, 0, 2, 2, 2, 2, 2, 2), 0, "valid"),
        ((7, 0, 2, 2, 2, 2, 2, 2), 7, "transa not an operation"),
        ((0, -1, 2, 2, 2, 2, 2, 2), 7, "transb not an operation"),
        ((0, 0, -1, 2, 2, 2, 2, 2), 7, "negative m"),
        ((0, 0, 2, 2, -3, 2, 2, 2), 7, "negative k"),
        ((0, 0, 3, 2, 2, 2, 2, 3), 7, "lda < m for op N"),
        ((1, 0, 2, 2, 3, 2, 3, 2), 7, "lda < k for op T"),
        ((0, 1, 2, 3, 2, 2, 2, 2), 7, "ldb < n for op T"),
        ((0, 0, 0, 2, 2, 0, 2, 1), 7, "lda = 0 < max(1, 0)"),
    ];
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| {
        for ((ta, tb, m, n, k, lda, ldb, ldc), want, what) in cases {
            // SAFETY: the buffer holds 64 elements, more than any valid case touches.
            let got = unsafe { f(h, ta, tb, m, n, k, &one, p, lda, p, ldb, &one, p, ldc) };
            assert_eq!(got, want, "{what}");
        }
        // ldc < max(1, m), and a null alpha.
        // SAFETY: as above.
        let got = unsafe { f(h, 0, 0, 2, 2, 2, &one, p, 2, p, 2, &one, p, 1) };
        assert_eq!(got, 7, "ldc < m");
        // SAFETY: as above; a null scalar is refused before anything is read.
        let got = unsafe { f(h, 0, 0, 2, 2, 2, std::ptr::null(), p, 2, p, 2, &one, p, 2) };
        assert_eq!(got, 7, "null alpha");
        // Empty products succeed without touching anything (m = 0 with a null C).
        // SAFETY: nothing is touched.
        let got = unsafe {
            f(
                h,
                0,
                0,
                0,
                2,
                2,
                &one,
                p,
                1,
                p,
                2,
                &one,
                std::ptr::null_mut(),
                1,
            )
        };
        assert_eq!(got, 0, "m = 0");
        Ok(())
    })
    .unwrap();
    // A handle that is not one.
    // SAFETY: a bogus handle is refused before anything is read.
    let got = unsafe {
        f(
            0x1234 as sys::cublasHandle_t,
            0,
            0,
            2,
            2,
            2,
            &one,
            p,
            2,
            p,
            2,
            &one,
            p,
            2,
        )
    };
    assert_eq!(got, 1, "CUBLAS_STATUS_NOT_INITIALIZED");
    // A destroyed one.
    let h = cublas::create_handle().unwrap();
    // SAFETY: a live handle, destroyed once.
    unsafe { cublas::destroy_handle(h) }.unwrap();
    // SAFETY: as above.
    let got = unsafe { f(h, 0, 0, 2, 2, 2, &one, p, 2, p, 2, &one, p, 2) };
    assert_eq!(got, 1, "a destroyed handle");
}

#[test]
fn an_operand_running_past_its_buffer_is_refused_naming_it() {
    let dev = setup();
    let f = raw_sgemm();
    // A 4 × 3 A in a 12-element buffer, described with lda 5: its last column runs 2 elements
    // past the end (a leading dimension cuBLAS accepts, 5 ≥ 4, but the buffer does not hold).
    let a = upload(&values(12, 1), |x| x as f32);
    let b = upload(&values(6, 2), |x| x as f32);
    let c = upload(&[7.0; 8], |x| x as f32);
    let (pa, pb, pc) = (ptr(&a), ptr(&b), ptr(&c));
    let one = 1.0f32;
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| {
        // SAFETY: the emulator checks the ranges before touching anything.
        let got = unsafe {
            f(
                h, 0, 0, 4, 2, 3, &one, pa as _, 5, pb as _, 3, &one, pc as _, 4,
            )
        };
        assert_eq!(got, 7);
        let fault = common::last_fault();
        assert!(
            fault.contains("cublasSgemm_v2: matrix A (4×3 as stored")
                && fault.contains("leading dimension 5")
                && fault.contains("run past the end"),
            "{fault}"
        );
        // The same for C with ldc past its buffer, and for a batch entry past the end.
        // SAFETY: as above.
        let got = unsafe {
            f(
                h, 0, 0, 4, 2, 3, &one, pa as _, 4, pb as _, 3, &one, pc as _, 5,
            )
        };
        assert_eq!(got, 7);
        assert!(
            common::last_fault().contains("matrix C"),
            "{}",
            common::last_fault()
        );
        // SAFETY: as above.
        let got = unsafe {
            cublas::sgemm_strided_batched(
                h,
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                2,
                2,
                3,
                &one,
                pa as _,
                2,
                0,
                pb as _,
                3,
                0,
                &0.0,
                pc as _,
                2,
                4,
                3,
            )
        };
        assert!(got.is_err());
        let fault = common::last_fault();
        assert!(
            fault.contains("matrix C") && fault.contains("batch entry 2 of 3"),
            "{fault}"
        );
        Ok(())
    })
    .unwrap();
    // Nothing was written.
    assert_eq!(download(&c), vec![7.0; 8]);
}

/// A host function that blocks its stream until the `AtomicBool` it is given is set (at most
/// 20 s, so a failing test cannot hang).
unsafe extern "C" fn hold(flag: *mut c_void) {
    // SAFETY: the tests pass a pointer to a static AtomicBool.
    let flag = unsafe { &*(flag as *const AtomicBool) };
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Blocks `stream` until `flag` is set.
fn hold_stream(stream: cudarc::driver::sys::CUstream, flag: &'static AtomicBool) {
    // SAFETY: a live stream of the current context; the flag outlives the host function.
    unsafe {
        cudarc::driver::sys::cuLaunchHostFunc(stream, Some(hold), flag as *const _ as *mut c_void)
    }
    .result()
    .unwrap();
}

#[test]
fn products_run_in_stream_order_on_the_handles_stream() {
    let dev = setup();
    let (m, n, k) = (2usize, 2usize, 2usize);
    let (a, b) = (values(4, 1), values(4, 2));
    let (ga, gb) = (upload(&a, |x| x as f32), upload(&b, |x| x as f32));
    let gc = upload(&[9.0; 4], |x| x as f32);
    let (pa, pb, pc) = (ptr(&ga), ptr(&gb), ptr(&gc));
    // Finish the uploads, then hold the compute stream.
    dev.compute_stream().synchronize().unwrap();
    dev.bind("test").unwrap();
    static RELEASE: AtomicBool = AtomicBool::new(false);
    hold_stream(dev.compute_stream().cu_stream(), &RELEASE);
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
        // SAFETY: 2 × 2 matrices in 4-element buffers.
        cublas::sgemm(
            h,
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            &1.0,
            pa as *const f32,
            2,
            pb as *const f32,
            2,
            &0.0,
            pc as *mut f32,
            2,
        )
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // The emulator's device memory is host memory: C is still untouched while the stream is held.
    // SAFETY: the buffer holds 4 f32 and is alive; the worker does not write it yet.
    let before = unsafe { std::slice::from_raw_parts(pc as *const f32, 4) }.to_vec();
    assert_eq!(
        before,
        vec![9.0; 4],
        "the product ran before its stream got there"
    );
    RELEASE.store(true, Ordering::Release);
    dev.compute_stream().synchronize().unwrap();
    let want = naive(
        (m, n, k),
        (&a, 2, false),
        (&b, 2, false),
        1.0,
        0.0,
        &[0.0; 4],
        2,
    );
    assert_eq!(download(&gc), want);
}

/// Sets `n` f32 at `dst` from `values` in stream order on `stream` (pageable source: staged at
/// the call, written when the stream gets there).
fn upload_on(stream: cudarc::driver::sys::CUstream, dst: u64, values: &[f32]) {
    // SAFETY: `dst` holds `values.len()` f32 (checked by the emulator too).
    unsafe {
        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
            dst,
            values.as_ptr().cast(),
            std::mem::size_of_val(values),
            stream,
        )
    }
    .result()
    .unwrap();
}

#[test]
fn a_product_missing_its_event_wait_reads_the_old_operand() {
    use cudarc::driver::sys as drv;
    let dev = setup();
    dev.bind("test").unwrap();
    let compute = dev.compute_stream().cu_stream();
    let mut side: drv::CUstream = std::ptr::null_mut();
    // SAFETY: an out-parameter; the context is current.
    unsafe { drv::cuStreamCreate(&mut side, 1) }
        .result()
        .unwrap();
    let a = upload(&[1.0, 2.0, 3.0, 4.0], |x| x as f32);
    let (pa, b_values) = (ptr(&a), [5.0f32, 6.0, 7.0, 8.0]);
    let right = naive(
        (2, 2, 2),
        (&[1.0, 2.0, 3.0, 4.0], 2, false),
        (&[5.0, 6.0, 7.0, 8.0], 2, false),
        1.0,
        0.0,
        &[0.0; 4],
        2,
    );
    static RELEASE_RACE: AtomicBool = AtomicBool::new(false);
    static RELEASE_WAIT: AtomicBool = AtomicBool::new(false);
    for (waits, release) in [(false, &RELEASE_RACE), (true, &RELEASE_WAIT)] {
        // B starts as zeros; the side stream writes its values once released.
        let b = upload(&[0.0; 4], |x| x as f32);
        let c = upload(&[0.0; 4], |x| x as f32);
        let (pb, pc) = (ptr(&b), ptr(&c));
        dev.compute_stream().synchronize().unwrap();
        hold_stream(side, release);
        upload_on(side, pb, &b_values);
        if waits {
            let mut written: drv::CUevent = std::ptr::null_mut();
            // SAFETY: out-parameter; live streams of the current context.
            unsafe {
                drv::cuEventCreate(&mut written, 0).result().unwrap();
                drv::cuEventRecord(written, side).result().unwrap();
                drv::cuStreamWaitEvent(compute, written, 0)
                    .result()
                    .unwrap();
            }
        }
        cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
            // SAFETY: 2 × 2 matrices in 4-element buffers.
            cublas::sgemm(
                h,
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                2,
                2,
                2,
                &1.0,
                pa as *const f32,
                2,
                pb as *const f32,
                2,
                &0.0,
                pc as *mut f32,
                2,
            )
        })
        .unwrap();
        if !waits {
            // Without the wait the product runs now, on the zeros, while the side stream is
            // still held: the race a GPU would have, made certain.
            dev.compute_stream().synchronize().unwrap();
        }
        release.store(true, Ordering::Release);
        // SAFETY: a live stream.
        unsafe { drv::cuStreamSynchronize(side) }.result().unwrap();
        dev.compute_stream().synchronize().unwrap();
        let got = download(&c);
        if waits {
            assert_eq!(got, right, "with the event wait");
        } else {
            assert_eq!(
                got,
                vec![0.0; 4],
                "without the wait the product saw the old B"
            );
        }
    }
    dev.bind("test").unwrap();
    // SAFETY: the stream is idle and no longer used.
    unsafe { drv::cuStreamDestroy_v2(side) }.result().unwrap();
}

#[test]
fn device_pointer_mode_reads_the_scalars_in_stream_order() {
    use sys::cublasPointerMode_t::{CUBLAS_POINTER_MODE_DEVICE, CUBLAS_POINTER_MODE_HOST};
    let dev = setup();
    let (a, b, c) = (values(4, 1), values(4, 2), values(4, 3));
    let (ga, gb, gc) = (upload(&a, |x| x), upload(&b, |x| x), upload(&c, |x| x));
    let scalars = upload(&[0.0, 0.0], |x| x);
    let ps = ptr(&scalars);
    // Hold the stream so that the scalars are still zeros when the product is called: read at
    // the call, the product would be 0·AᵀB + 0·C.
    dev.compute_stream().synchronize().unwrap();
    dev.bind("test").unwrap();
    static RELEASE: AtomicBool = AtomicBool::new(false);
    hold_stream(dev.compute_stream().cu_stream(), &RELEASE);
    // SAFETY: 2 f64 at `ps`, written in stream order (pageable source staged at the call).
    unsafe {
        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
            ps,
            [3.0f64, -2.0].as_ptr().cast(),
            16,
            dev.compute_stream().cu_stream(),
        )
    }
    .result()
    .unwrap();
    cuda::blas::with_blas("test", &dev, dev.compute_stream(), false, |h| unsafe {
        // SAFETY: the handle is locked by with_blas; the mode is restored before it returns.
        sys::cublasSetPointerMode_v2(h, CUBLAS_POINTER_MODE_DEVICE).result()?;
        // SAFETY: 2 × 2 matrices; alpha and beta are device f64.
        let status = cublas::dgemm(
            h,
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            2,
            2,
            2,
            ps as *const f64,
            ptr(&ga) as *const f64,
            2,
            ptr(&gb) as *const f64,
            2,
            (ps + 8) as *const f64,
            ptr(&gc) as *mut f64,
            2,
        );
        sys::cublasSetPointerMode_v2(h, CUBLAS_POINTER_MODE_HOST).result()?;
        status
    })
    .unwrap();
    RELEASE.store(true, Ordering::Release);
    let want = naive((2, 2, 2), (&a, 2, true), (&b, 2, false), 3.0, -2.0, &c, 2);
    assert_eq!(download(&gc), want);
}
