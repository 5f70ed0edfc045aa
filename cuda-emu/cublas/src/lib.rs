//! `tandem-cuda-emu-cublas`: an emulated cuBLAS (`libcublas.so`) for the emulated driver
//! (`tandem-cuda-emu`), tests only (issue 20, part 1, item 3). Like the driver, a program finds
//! it only when `TANDEM_CUDA_LIBS` names a folder holding a copy of it under cuBLAS's file name
//! (`tests/common/mod.rs` makes one, with the driver, NVRTC and the emulated cuBLASLt).
//!
//! # What is emulated
//!
//! The calls tandem makes (through cudarc's `cublas::result`), with the real signatures,
//! handle types and `cublasStatus_t` codes:
//!
//! - **Handles**: `cublasCreate_v2`, `cublasDestroy_v2`, `cublasSetStream_v2` /
//!   `cublasGetStream_v2`, `cublasSetMathMode` / `cublasGetMathMode`,
//!   `cublasSetPointerMode_v2` / `cublasGetPointerMode_v2` (host and device scalars),
//!   `cublasSetWorkspace_v2` (accepted, unused), `cublasGetVersion_v2`, `cublasGetProperty`,
//!   `cublasGetCudartVersion`, `cublasGetStatusName`, `cublasGetStatusString`. A handle that
//!   was never created or is destroyed gives `CUBLAS_STATUS_NOT_INITIALIZED`.
//! - **Products**: `cublasSgemm_v2`, `cublasDgemm_v2`, `cublasSgemmStridedBatched`,
//!   `cublasDgemmStridedBatched`, `cublasSgemv_v2`, `cublasDgemv_v2` (tandem's matmul, linear,
//!   the im2col convolution and row sums), and `cublasGemmEx` / `cublasGemmStridedBatchedEx`
//!   with f16 or bf16 inputs and f32 compute (output f16/bf16 or f32), f32 with the
//!   `CUBLAS_COMPUTE_32F*` types, and f64 with `CUBLAS_COMPUTE_64F*`; other type combinations
//!   give `CUBLAS_STATUS_NOT_SUPPORTED` with a message.
//!
//! Arguments are checked as cuBLAS checks them (`CUBLAS_STATUS_INVALID_VALUE` for a transpose
//! that is not `N`, `T` or `C`, negative sizes or batch counts, `lda < max(1, rows of A as
//! stored)`, likewise `ldb` and `ldc < max(1, m)`, a zero vector increment, a null scalar), and
//! then, beyond cuBLAS, every matrix and vector the call touches is checked to lie inside one
//! live allocation of the emulated driver (`tandem_cuda_emu_check_device_range`, the check its
//! copies use): an operand that runs past its buffer (a wrong leading dimension or stride) fails
//! the call with `CUBLAS_STATUS_INVALID_VALUE` and a message on stderr naming the function, the
//! operand, its shape and leading dimension, instead of a silent read of a neighbour's memory.
//!
//! # How a product runs
//!
//! In stream order on the handle's stream: the call checks its arguments, reads host scalars,
//! and enqueues the product on the stream's worker of the emulated driver with
//! `cuLaunchHostFunc` (resolved at run time from the already-loaded driver), so a product reads
//! its inputs when the stream gets there — a missing event wait in tandem is a real race, as on
//! a GPU. With `CUBLAS_POINTER_MODE_DEVICE` the scalars are read there too.
//!
//! The product itself is [`mod@reference`]: plain loops in cuBLAS's column-major semantics, not
//! tandem's CPU matmul, accumulating in the compute type (f32 for `S` and the f32 compute
//! types, f64 for `D`); `beta == 0` does not read `C`. The TF32 math mode
//! (`CUBLAS_TF32_TENSOR_OP_MATH`, `CUBLAS_COMPUTE_32F_FAST_TF32`) is accepted and computed in
//! full f32: results are at least as accurate as a GPU's, so a test that relies on TF32's
//! rounding must not run on the emulator.
//!
//! Every other entry point cudarc 0.19.10 may load is a stub ([`stubs`]) that prints
//! `tandem-cuda-emu: <name> is not emulated` and returns `CUBLAS_STATUS_NOT_SUPPORTED`.
//!
//! # Not checked
//!
//! Speed (a product is a triple loop on one thread), cuBLAS's own rounding (summation order,
//! TF32, fused multiply-adds), complex types, and the 64-bit (`_64`) API.

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::too_many_arguments)]

mod status_name;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_longlong, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::cublas::sys;
use parking_lot::Mutex;
use tandem_cuda_emu_link::{self as link, Library};

pub mod reference;
pub mod stubs;

use reference::{Compute, Elem, Gemm, Gemv, Operand, Vector};

/// cuBLAS's status type.
pub type Status = sys::cublasStatus_t;
use sys::cublasStatus_t as S;

/// The body of an entry point: `Err` holds the status to return.
type Res = link::Res<Cublas>;

/// cuBLAS for the shared code of the emulator's libraries.
pub enum Cublas {}

impl Library for Cublas {
    type Status = Status;
    const NAME: &'static str = "cuBLAS";
    const WORK: &'static str = "product";
    const WORKER_PANIC: &'static str = "a cuBLAS product panicked on its stream's worker";
    const SUCCESS: Status = S::CUBLAS_STATUS_SUCCESS;
    const INTERNAL_ERROR: Status = S::CUBLAS_STATUS_INTERNAL_ERROR;
    const NOT_EMULATED: Status = S::CUBLAS_STATUS_NOT_SUPPORTED;
    const NO_DRIVER: Status = S::CUBLAS_STATUS_NOT_INITIALIZED;
    const ENQUEUE_FAILED: Status = S::CUBLAS_STATUS_EXECUTION_FAILED;

    fn range_fault(_what: String) -> Status {
        S::CUBLAS_STATUS_INVALID_VALUE
    }
}

use link::say;

/// Fails with `status` after saying why.
fn fail<T>(status: Status, message: String) -> Result<T, Status> {
    link::fail::<Cublas, T>(status, message)
}

/// Runs an entry point's body; a panic becomes `CUBLAS_STATUS_INTERNAL_ERROR` with a message
/// (it must not unwind into C).
fn entry(name: &str, body: impl FnOnce() -> Res) -> Status {
    link::entry::<Cublas>(name, body)
}

/// Writes through an out-pointer, or fails with `CUBLAS_STATUS_INVALID_VALUE` when null.
unsafe fn put<T>(out: *mut T, value: T) -> Res {
    // SAFETY: forwarded (cuBLAS's contract for out-parameters).
    unsafe { link::put(out, value, || S::CUBLAS_STATUS_INVALID_VALUE) }
}

// ---- The emulated driver (tandem-cuda-emu-link) -----------------------------------------------

fn driver() -> Result<&'static link::Driver, Status> {
    link::driver::<Cublas>()
}

/// Checks that `len` bytes at `ptr` lie in one live device allocation; the driver reports the
/// fault (starting with `what`) on stderr.
fn check_range(ptr: u64, len: usize, what: impl FnOnce() -> String) -> Res {
    link::check_range::<Cublas>(ptr, len, what)
}

/// Counts a product in the driver's counters (`kind` 0: a GEMM, 1: a GEMV).
fn count_product(kind: u32) -> Res {
    driver()?.count_blas(kind);
    Ok(())
}

/// Work for a stream's worker.
type Job = link::Job;

/// Enqueues `job` on `stream` (the handle's) in stream order.
fn enqueue(name: &str, stream: usize, job: Job) -> Res {
    link::enqueue::<Cublas>(name, stream, job)
}

// ---- Handles ----------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct State {
    stream: usize,
    math: u32,
    device_scalars: bool,
}

/// Live handles, by the opaque address handed out (a counter, never dereferenced).
fn handles() -> &'static Mutex<HashMap<usize, State>> {
    static H: OnceLock<Mutex<HashMap<usize, State>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(HashMap::new()))
}

fn state(name: &str, h: sys::cublasHandle_t) -> Result<State, Status> {
    match handles().lock().get(&(h as usize)) {
        Some(s) => Ok(*s),
        None => fail(
            S::CUBLAS_STATUS_NOT_INITIALIZED,
            format!("{name}: {h:p} is not a live cuBLAS handle"),
        ),
    }
}

fn update(name: &str, h: sys::cublasHandle_t, f: impl FnOnce(&mut State)) -> Res {
    match handles().lock().get_mut(&(h as usize)) {
        Some(s) => {
            f(s);
            Ok(())
        }
        None => fail(
            S::CUBLAS_STATUS_NOT_INITIALIZED,
            format!("{name}: {h:p} is not a live cuBLAS handle"),
        ),
    }
}

/// Emulates `cublasCreate_v2`: a handle on the legacy default stream, default math and host pointer
/// mode; fails when the emulated driver is not loaded.
#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(out: *mut sys::cublasHandle_t) -> Status {
    entry("cublasCreate_v2", || {
        driver()?;
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let id = 0x7ab1_0000_0000 + NEXT.fetch_add(1, Ordering::Relaxed) * 64;
        // SAFETY: out-parameter.
        unsafe { put(out, id as sys::cublasHandle_t) }?;
        handles().lock().insert(
            id,
            State {
                stream: 0,
                math: 0,
                device_scalars: false,
            },
        );
        Ok(())
    })
}

/// Emulates `cublasDestroy_v2`: forgets the handle (work already enqueued still runs); an unknown
/// handle is `CUBLAS_STATUS_NOT_INITIALIZED`.
#[no_mangle]
pub extern "C" fn cublasDestroy_v2(h: sys::cublasHandle_t) -> Status {
    entry("cublasDestroy_v2", || {
        match handles().lock().remove(&(h as usize)) {
            Some(_) => Ok(()),
            None => Err(S::CUBLAS_STATUS_NOT_INITIALIZED),
        }
    })
}

/// Emulates `cublasSetStream_v2`: later products run on `stream` (not checked until a product is
/// enqueued).
#[no_mangle]
pub extern "C" fn cublasSetStream_v2(h: sys::cublasHandle_t, stream: sys::cudaStream_t) -> Status {
    entry("cublasSetStream_v2", || {
        update("cublasSetStream_v2", h, |s| s.stream = stream as usize)
    })
}

/// Emulates `cublasGetStream_v2`: the handle's stream.
#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(
    h: sys::cublasHandle_t,
    stream: *mut sys::cudaStream_t,
) -> Status {
    entry("cublasGetStream_v2", || {
        let s = state("cublasGetStream_v2", h)?;
        // SAFETY: out-parameter.
        unsafe { put(stream, s.stream as sys::cudaStream_t) }
    })
}

/// Emulates `cublasSetMathMode`: checks and stores the mode; every mode computes in full precision
/// (TF32 included).
#[no_mangle]
pub extern "C" fn cublasSetMathMode(h: sys::cublasHandle_t, mode: u32) -> Status {
    entry("cublasSetMathMode", || {
        // The modes of CUDA 13 (default, tensor op, pedantic, TF32, BF16x9, FP64 fixed point),
        // optionally with CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (16).
        if !matches!(mode & !16, 0..=4 | 8) {
            return fail(
                S::CUBLAS_STATUS_INVALID_VALUE,
                format!("cublasSetMathMode: {mode} is not a cublasMath_t"),
            );
        }
        update("cublasSetMathMode", h, |s| s.math = mode)
    })
}

/// Emulates `cublasGetMathMode`: the stored mode.
#[no_mangle]
pub unsafe extern "C" fn cublasGetMathMode(h: sys::cublasHandle_t, mode: *mut u32) -> Status {
    entry("cublasGetMathMode", || {
        let s = state("cublasGetMathMode", h)?;
        // SAFETY: out-parameter.
        unsafe { put(mode, s.math) }
    })
}

/// Emulates `cublasSetPointerMode_v2`: host (0) or device (1) scalars.
#[no_mangle]
pub extern "C" fn cublasSetPointerMode_v2(h: sys::cublasHandle_t, mode: u32) -> Status {
    entry("cublasSetPointerMode_v2", || {
        if mode > 1 {
            return Err(S::CUBLAS_STATUS_INVALID_VALUE);
        }
        update("cublasSetPointerMode_v2", h, |s| {
            s.device_scalars = mode == 1
        })
    })
}

/// Emulates `cublasGetPointerMode_v2`: the stored pointer mode.
#[no_mangle]
pub unsafe extern "C" fn cublasGetPointerMode_v2(h: sys::cublasHandle_t, mode: *mut u32) -> Status {
    entry("cublasGetPointerMode_v2", || {
        let s = state("cublasGetPointerMode_v2", h)?;
        // SAFETY: out-parameter.
        unsafe { put(mode, s.device_scalars as u32) }
    })
}

/// Emulates `cublasSetWorkspace_v2`: accepted and unused (the reference products need no
/// workspace).
#[no_mangle]
pub extern "C" fn cublasSetWorkspace_v2(
    h: sys::cublasHandle_t,
    workspace: *mut c_void,
    size: usize,
) -> Status {
    entry("cublasSetWorkspace_v2", || {
        state("cublasSetWorkspace_v2", h)?;
        if size > 0 && workspace.is_null() {
            return Err(S::CUBLAS_STATUS_INVALID_VALUE);
        }
        // The reference products need no workspace.
        Ok(())
    })
}

/// cuBLAS 13.0.0 (`CUBLAS_VERSION` = major·10000 + minor·100 + patch).
const VERSION: c_int = 130000;

/// Emulates `cublasGetVersion_v2`: 130000 (cuBLAS 13.0.0).
#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(
    h: sys::cublasHandle_t,
    version: *mut c_int,
) -> Status {
    entry("cublasGetVersion_v2", || {
        state("cublasGetVersion_v2", h)?;
        // SAFETY: out-parameter.
        unsafe { put(version, VERSION) }
    })
}

/// Emulates `cublasGetProperty`: the major, minor and patch level of 13.0.0.
#[no_mangle]
pub unsafe extern "C" fn cublasGetProperty(kind: u32, value: *mut c_int) -> Status {
    entry("cublasGetProperty", || {
        let v = match kind {
            0 => VERSION / 10000,
            1 => VERSION / 100 % 100,
            2 => VERSION % 100,
            _ => return Err(S::CUBLAS_STATUS_INVALID_VALUE),
        };
        // SAFETY: out-parameter.
        unsafe { put(value, v) }
    })
}

/// Emulates `cublasGetCudartVersion`: 13000 (CUDA 13.0).
#[no_mangle]
pub extern "C" fn cublasGetCudartVersion() -> usize {
    13000
}

/// Emulates `cublasGetStatusName`: the status's enum name.
#[no_mangle]
pub extern "C" fn cublasGetStatusName(status: u32) -> *const c_char {
    status_name::status_name(status).as_ptr()
}

/// Emulates `cublasGetStatusString`: a sentence for each cuBLAS status ("unknown error" for other
/// codes).
#[no_mangle]
pub extern "C" fn cublasGetStatusString(status: u32) -> *const c_char {
    let text: &'static CStr = match status {
        0 => c"the operation completed successfully",
        1 => c"the library was not initialized",
        3 => c"the resource allocation failed",
        7 => c"an invalid numeric value was used as an argument",
        8 => c"an absent device architectural feature is required",
        11 => c"an access to GPU memory space failed",
        13 => c"the GPU program failed to execute",
        14 => c"an internal operation failed",
        15 => c"the functionality requested is not supported",
        16 => c"an error was detected when checking the current licensing",
        _ => c"unknown error",
    };
    text.as_ptr()
}

/// Emulates `cublasXerbla`: prints the reference BLAS's illegal-parameter message on stderr (with
/// the emulator's prefix).
#[no_mangle]
pub unsafe extern "C" fn cublasXerbla(name: *const c_char, info: c_int) {
    let name = if name.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated string per the contract.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    say(&format!(
        "** On entry to {name} parameter number {info} had an illegal value"
    ));
}

// ---- Products ---------------------------------------------------------------------------------

/// A transpose argument: `N` → false, `T` and `C` (the same for real types) → true.
fn transpose(name: &str, which: &str, op: c_int) -> Result<bool, Status> {
    match op {
        0 => Ok(false),
        1 | 2 => Ok(true),
        _ => fail(
            S::CUBLAS_STATUS_INVALID_VALUE,
            format!("{name}: {which} = {op} is not CUBLAS_OP_N, CUBLAS_OP_T or CUBLAS_OP_C"),
        ),
    }
}

fn size(name: &str, what: &str, v: i64) -> Result<usize, Status> {
    usize::try_from(v).or_else(|_| {
        fail(
            S::CUBLAS_STATUS_INVALID_VALUE,
            format!("{name}: {what} = {v} is negative"),
        )
    })
}

fn leading(name: &str, what: &str, ld: c_int, rows: usize) -> Result<usize, Status> {
    if (ld as i64) < rows.max(1) as i64 {
        return fail(
            S::CUBLAS_STATUS_INVALID_VALUE,
            format!("{name}: {what} = {ld} is less than max(1, {rows}), the rows of the matrix as stored"),
        );
    }
    Ok(ld as usize)
}

/// Checks that every batch entry of a stored `rows × cols` matrix lies in one allocation.
fn check_matrix(
    name: &str,
    which: &str,
    o: &Operand,
    rows: usize,
    cols: usize,
    batch: usize,
) -> Res {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let elem = o.elem.size();
    let len = ((cols - 1) * o.ld + rows) * elem;
    let entries = if o.stride == 0 { batch.min(1) } else { batch };
    for b in 0..entries {
        let start = (o.ptr as i64).wrapping_add((b as i64).wrapping_mul(o.stride) * elem as i64);
        check_range(start as u64, len, || {
            let entry = if batch > 1 {
                format!(", batch entry {b} of {batch} at stride {}", o.stride)
            } else {
                String::new()
            };
            format!(
                "{name}: matrix {which} ({rows}×{cols} as stored, {} elements, leading dimension \
                 {}{entry})",
                match o.elem {
                    Elem::F16 => "f16",
                    Elem::BF16 => "bf16",
                    Elem::F32 => "f32",
                    Elem::F64 => "f64",
                },
                o.ld
            )
        })?;
    }
    Ok(())
}

/// Reads a scalar: from the host now, or (device pointer mode) on the worker.
#[derive(Clone, Copy)]
enum Scalar {
    Now(f64),
    Device(u64, Elem),
}

impl Scalar {
    unsafe fn new(
        name: &str,
        what: &str,
        p: *const c_void,
        elem: Elem,
        device: bool,
    ) -> Result<Self, Status> {
        if p.is_null() {
            return fail(
                S::CUBLAS_STATUS_INVALID_VALUE,
                format!("{name}: {what} is null"),
            );
        }
        if device {
            check_range(p as u64, elem.size(), || {
                format!("{name}: the device scalar {what}")
            })?;
            return Ok(Scalar::Device(p as u64, elem));
        }
        // SAFETY: a host scalar of the compute type (cuBLAS's contract in host pointer mode).
        Ok(Scalar::Now(unsafe {
            match elem {
                Elem::F64 => (p as *const f64).read_unaligned(),
                _ => (p as *const f32).read_unaligned() as f64,
            }
        }))
    }

    fn get(self) -> f64 {
        match self {
            Scalar::Now(v) => v,
            // SAFETY: checked to lie in a live allocation at the call; read in stream order.
            Scalar::Device(p, Elem::F64) => unsafe { (p as *const f64).read_unaligned() },
            Scalar::Device(p, _) => unsafe { (p as *const f32).read_unaligned() as f64 },
        }
    }
}

/// Everything a GEMM call passes, with its element and compute types decided.
struct GemmArgs {
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_elem: Elem,
    lda: c_int,
    stride_a: i64,
    b: *const c_void,
    b_elem: Elem,
    ldb: c_int,
    stride_b: i64,
    beta: *const c_void,
    c: *mut c_void,
    c_elem: Elem,
    ldc: c_int,
    stride_c: i64,
    batch: c_int,
    compute: Compute,
}

/// Checks a GEMM's arguments as cuBLAS does, checks its operands' ranges, and enqueues it.
fn gemm_call(name: &str, h: sys::cublasHandle_t, g: GemmArgs) -> Res {
    let st = state(name, h)?;
    let ta = transpose(name, "transa", g.transa)?;
    let tb = transpose(name, "transb", g.transb)?;
    let m = size(name, "m", g.m as i64)?;
    let n = size(name, "n", g.n as i64)?;
    let k = size(name, "k", g.k as i64)?;
    let (ar, ac) = if ta { (k, m) } else { (m, k) };
    let (br, bc) = if tb { (n, k) } else { (k, n) };
    let lda = leading(name, "lda", g.lda, ar)?;
    let ldb = leading(name, "ldb", g.ldb, br)?;
    let ldc = leading(name, "ldc", g.ldc, m)?;
    let batch = size(name, "batchCount", g.batch as i64)?;
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let scalar = match g.compute {
        Compute::F64 => Elem::F64,
        Compute::F32 => Elem::F32,
    };
    // SAFETY: the caller's scalars (cuBLAS's contract).
    let alpha = unsafe { Scalar::new(name, "alpha", g.alpha, scalar, st.device_scalars) }?;
    let beta = unsafe { Scalar::new(name, "beta", g.beta, scalar, st.device_scalars) }?;
    let operand = |ptr: *const c_void, elem, ld, trans, stride| Operand {
        ptr: ptr as u64,
        elem,
        ld,
        trans,
        stride,
    };
    let a = operand(g.a, g.a_elem, lda, ta, g.stride_a);
    let b = operand(g.b, g.b_elem, ldb, tb, g.stride_b);
    let c = operand(g.c, g.c_elem, ldc, false, g.stride_c);
    if k > 0 {
        check_matrix(name, "A", &a, ar, ac, batch)?;
        check_matrix(name, "B", &b, br, bc, batch)?;
    }
    check_matrix(name, "C", &c, m, n, batch)?;
    let compute = g.compute;
    count_product(0)?;
    enqueue(
        name,
        st.stream,
        Box::new(move || {
            let product = Gemm {
                m,
                n,
                k,
                batch,
                alpha: alpha.get(),
                beta: beta.get(),
                a,
                b,
                c,
                compute,
            };
            // SAFETY: every matrix was checked to lie in a live allocation at the call; a
            // buffer freed since then stays mapped (in the driver's quarantine), as on a GPU,
            // where such a race reads or writes freed memory.
            unsafe { reference::gemm(&product) }
        }),
    )
}

/// Emulates `cublasSgemm_v2` (f32, f32 compute; see the crate docs). Arguments checked as cuBLAS
/// does, every operand's range checked against the live allocations, the product run by
/// [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasSgemm_v2(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> Status {
    let name = "cublasSgemm_v2";
    entry(name, || {
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha: alpha.cast(),
                a: a.cast(),
                a_elem: Elem::F32,
                lda,
                stride_a: 0,
                b: b.cast(),
                b_elem: Elem::F32,
                ldb,
                stride_b: 0,
                beta: beta.cast(),
                c: c.cast(),
                c_elem: Elem::F32,
                ldc,
                stride_c: 0,
                batch: 1,
                compute: Compute::F32,
            },
        )
    })
}

/// Emulates `cublasDgemm_v2` (f64, f64 compute; see the crate docs). Arguments checked as cuBLAS
/// does, every operand's range checked against the live allocations, the product run by
/// [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasDgemm_v2(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    b: *const f64,
    ldb: c_int,
    beta: *const f64,
    c: *mut f64,
    ldc: c_int,
) -> Status {
    let name = "cublasDgemm_v2";
    entry(name, || {
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha: alpha.cast(),
                a: a.cast(),
                a_elem: Elem::F64,
                lda,
                stride_a: 0,
                b: b.cast(),
                b_elem: Elem::F64,
                ldb,
                stride_b: 0,
                beta: beta.cast(),
                c: c.cast(),
                c_elem: Elem::F64,
                ldc,
                stride_c: 0,
                batch: 1,
                compute: Compute::F64,
            },
        )
    })
}

/// Emulates `cublasSgemmStridedBatched` (f32, f32 compute; see the crate docs). Arguments checked
/// as cuBLAS does, every operand's range checked against the live allocations, the product run by
/// [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasSgemmStridedBatched(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    stride_a: c_longlong,
    b: *const f32,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    stride_c: c_longlong,
    batch: c_int,
) -> Status {
    let name = "cublasSgemmStridedBatched";
    entry(name, || {
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha: alpha.cast(),
                a: a.cast(),
                a_elem: Elem::F32,
                lda,
                stride_a,
                b: b.cast(),
                b_elem: Elem::F32,
                ldb,
                stride_b,
                beta: beta.cast(),
                c: c.cast(),
                c_elem: Elem::F32,
                ldc,
                stride_c,
                batch,
                compute: Compute::F32,
            },
        )
    })
}

/// Emulates `cublasDgemmStridedBatched` (f64, f64 compute; see the crate docs). Arguments checked
/// as cuBLAS does, every operand's range checked against the live allocations, the product run by
/// [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasDgemmStridedBatched(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    stride_a: c_longlong,
    b: *const f64,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const f64,
    c: *mut f64,
    ldc: c_int,
    stride_c: c_longlong,
    batch: c_int,
) -> Status {
    let name = "cublasDgemmStridedBatched";
    entry(name, || {
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha: alpha.cast(),
                a: a.cast(),
                a_elem: Elem::F64,
                lda,
                stride_a,
                b: b.cast(),
                b_elem: Elem::F64,
                ldb,
                stride_b,
                beta: beta.cast(),
                c: c.cast(),
                c_elem: Elem::F64,
                ldc,
                stride_c,
                batch,
                compute: Compute::F64,
            },
        )
    })
}

/// The element types and compute type of a `GemmEx` call, or `NOT_SUPPORTED` with a message.
fn ex_types(
    name: &str,
    at: c_int,
    bt: c_int,
    ct: c_int,
    compute: c_int,
) -> Result<(Elem, Elem, Elem, Compute), Status> {
    const R_32F: c_int = 0;
    const R_64F: c_int = 1;
    const R_16F: c_int = 2;
    const R_16BF: c_int = 14;
    let elem = |t| match t {
        R_32F => Some(Elem::F32),
        R_64F => Some(Elem::F64),
        R_16F => Some(Elem::F16),
        R_16BF => Some(Elem::BF16),
        _ => None,
    };
    let supported = match compute {
        // CUBLAS_COMPUTE_32F and _PEDANTIC: half inputs into half or f32 outputs, or f32.
        68 | 69 => matches!(
            (at, bt, ct),
            (R_16F, R_16F, R_16F | R_32F)
                | (R_16BF, R_16BF, R_16BF | R_32F)
                | (R_32F, R_32F, R_32F)
        ),
        // CUBLAS_COMPUTE_32F_FAST_16F / _16BF / _TF32: f32 matrices (computed in full f32).
        74 | 75 | 77 => (at, bt, ct) == (R_32F, R_32F, R_32F),
        // CUBLAS_COMPUTE_64F and _PEDANTIC.
        70 | 71 => (at, bt, ct) == (R_64F, R_64F, R_64F),
        _ => false,
    };
    match (supported, elem(at), elem(bt), elem(ct)) {
        (true, Some(a), Some(b), Some(c)) => {
            let compute = if matches!(compute, 70 | 71) {
                Compute::F64
            } else {
                Compute::F32
            };
            Ok((a, b, c, compute))
        }
        _ => fail(
            S::CUBLAS_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: Atype {at}, Btype {bt}, Ctype {ct} with computeType {compute} is not \
                 emulated (f16/bf16 with CUBLAS_COMPUTE_32F, f32 with CUBLAS_COMPUTE_32F*, f64 \
                 with CUBLAS_COMPUTE_64F are)"
            ),
        ),
    }
}

/// Emulates `cublasGemmEx` for f16/bf16 inputs with f32 compute, f32 and f64 (other type
/// combinations are `CUBLAS_STATUS_NOT_SUPPORTED`; the algorithm is ignored; see the crate docs).
/// Arguments checked as cuBLAS does, every operand's range checked against the live allocations,
/// the product run by [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasGemmEx(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    compute_type: c_int,
    _algo: c_int,
) -> Status {
    let name = "cublasGemmEx";
    entry(name, || {
        state(name, h)?;
        let (a_elem, b_elem, c_elem, compute) =
            ex_types(name, a_type, b_type, c_type, compute_type)?;
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                a_elem,
                lda,
                stride_a: 0,
                b,
                b_elem,
                ldb,
                stride_b: 0,
                beta,
                c,
                c_elem,
                ldc,
                stride_c: 0,
                batch: 1,
                compute,
            },
        )
    })
}

/// Emulates `cublasGemmStridedBatchedEx` with the types of [`cublasGemmEx`] (the algorithm is
/// ignored; see the crate docs). Arguments checked as cuBLAS does, every operand's range checked
/// against the live allocations, the product run by [`mod@reference`] on the handle's stream's
/// worker.
#[no_mangle]
pub extern "C" fn cublasGemmStridedBatchedEx(
    h: sys::cublasHandle_t,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    stride_a: c_longlong,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    stride_c: c_longlong,
    batch: c_int,
    compute_type: c_int,
    _algo: c_int,
) -> Status {
    let name = "cublasGemmStridedBatchedEx";
    entry(name, || {
        state(name, h)?;
        let (a_elem, b_elem, c_elem, compute) =
            ex_types(name, a_type, b_type, c_type, compute_type)?;
        gemm_call(
            name,
            h,
            GemmArgs {
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                a,
                a_elem,
                lda,
                stride_a,
                b,
                b_elem,
                ldb,
                stride_b,
                beta,
                c,
                c_elem,
                ldc,
                stride_c,
                batch,
                compute,
            },
        )
    })
}

/// Checks a GEMV's arguments as cuBLAS does, checks its operands' ranges, and enqueues it.
fn gemv_call(
    name: &str,
    h: sys::cublasHandle_t,
    trans: c_int,
    (m, n): (c_int, c_int),
    (alpha, beta): (*const c_void, *const c_void),
    (a, lda): (*const c_void, c_int),
    (x, incx): (*const c_void, c_int),
    (y, incy): (*mut c_void, c_int),
    elem: Elem,
) -> Res {
    let st = state(name, h)?;
    let trans = transpose(name, "trans", trans)?;
    let m = size(name, "m", m as i64)?;
    let n = size(name, "n", n as i64)?;
    let lda = leading(name, "lda", lda, m)?;
    if incx == 0 || incy == 0 {
        return fail(
            S::CUBLAS_STATUS_INVALID_VALUE,
            format!("{name}: incx = {incx}, incy = {incy}: an increment is zero"),
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // SAFETY: the caller's scalars.
    let alpha = unsafe { Scalar::new(name, "alpha", alpha, elem, st.device_scalars) }?;
    let beta = unsafe { Scalar::new(name, "beta", beta, elem, st.device_scalars) }?;
    let a = Operand {
        ptr: a as u64,
        elem,
        ld: lda,
        trans,
        stride: 0,
    };
    let (xl, yl) = if trans { (m, n) } else { (n, m) };
    let x = Vector {
        ptr: x as u64,
        len: xl,
        inc: incx as i64,
    };
    let y = Vector {
        ptr: y as u64,
        len: yl,
        inc: incy as i64,
    };
    check_matrix(name, "A", &a, m, n, 1)?;
    for (which, v) in [("x", &x), ("y", &y)] {
        let span = ((v.len - 1) * v.inc.unsigned_abs() as usize + 1) * elem.size();
        check_range(v.ptr, span, || {
            format!(
                "{name}: vector {which} ({} elements, increment {})",
                v.len, v.inc
            )
        })?;
    }
    let compute = if elem == Elem::F64 {
        Compute::F64
    } else {
        Compute::F32
    };
    count_product(1)?;
    enqueue(
        name,
        st.stream,
        Box::new(move || {
            let product = Gemv {
                m,
                n,
                alpha: alpha.get(),
                beta: beta.get(),
                a,
                x,
                y,
                compute,
            };
            // SAFETY: as for the GEMM: every range was checked at the call.
            unsafe { reference::gemv(&product) }
        }),
    )
}

/// Emulates `cublasSgemv_v2` (f32, f32 compute): arguments checked as cuBLAS does (a zero increment
/// is `CUBLAS_STATUS_INVALID_VALUE`), the ranges of `A`, `x` and `y` checked, the product run by
/// [`mod@reference`] on the handle's stream's worker.
#[no_mangle]
pub extern "C" fn cublasSgemv_v2(
    h: sys::cublasHandle_t,
    trans: c_int,
    m: c_int,
    n: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    x: *const f32,
    incx: c_int,
    beta: *const f32,
    y: *mut f32,
    incy: c_int,
) -> Status {
    let name = "cublasSgemv_v2";
    entry(name, || {
        gemv_call(
            name,
            h,
            trans,
            (m, n),
            (alpha.cast(), beta.cast()),
            (a.cast(), lda),
            (x.cast(), incx),
            (y.cast(), incy),
            Elem::F32,
        )
    })
}

/// Emulates `cublasDgemv_v2` (f64, f64 compute), as [`cublasSgemv_v2`].
#[no_mangle]
pub extern "C" fn cublasDgemv_v2(
    h: sys::cublasHandle_t,
    trans: c_int,
    m: c_int,
    n: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    x: *const f64,
    incx: c_int,
    beta: *const f64,
    y: *mut f64,
    incy: c_int,
) -> Status {
    let name = "cublasDgemv_v2";
    entry(name, || {
        gemv_call(
            name,
            h,
            trans,
            (m, n),
            (alpha.cast(), beta.cast()),
            (a.cast(), lda),
            (x.cast(), incx),
            (y.cast(), incy),
            Elem::F64,
        )
    })
}
