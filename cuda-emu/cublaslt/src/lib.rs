//! `tandem-cuda-emu-cublaslt`: an emulated cuBLASLt (`libcublasLt.so`), tests only (issue 20,
//! part 1, item 3). tandem itself calls no cuBLASLt function: it makes sure the library is
//! present before cuBLAS (the real cuBLAS needs it), so the emulator provides one that loads,
//! with handles (`cublasLtCreate`, `cublasLtDestroy`), versions (`cublasLtGetVersion`,
//! `cublasLtGetCudartVersion`, `cublasLtGetProperty`) and status names. Every other entry point
//! cudarc 0.19.10 may load is a stub that prints `tandem-cuda-emu: <name> is not emulated` and
//! returns `CUBLAS_STATUS_NOT_SUPPORTED` (cudarc panics on a missing symbol). Matrix
//! multiplications through cuBLASLt (`cublasLtMatmul`) are not emulated: tandem does not use them.

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

#[path = "../../cublas/src/status_name.rs"]
mod status_name;

use std::collections::HashSet;
use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cublaslt::sys;
use std::sync::Mutex;

/// cuBLASLt's status type (cuBLAS's).
pub type Status = sys::cublasStatus_t;
use sys::cublasStatus_t as S;

/// Live handles (opaque addresses from a counter, never dereferenced).
static HANDLES: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn with_handles<R>(f: impl FnOnce(&mut HashSet<usize>) -> R) -> R {
    let mut guard = HANDLES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    f(guard.get_or_insert_with(HashSet::new))
}

/// Emulates `cublasLtCreate`: an opaque handle, only remembered (there is no state behind it).
#[no_mangle]
pub unsafe extern "C" fn cublasLtCreate(out: *mut sys::cublasLtHandle_t) -> Status {
    if out.is_null() {
        return S::CUBLAS_STATUS_INVALID_VALUE;
    }
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let id = 0x7ab2_0000_0000 + NEXT.fetch_add(1, Ordering::Relaxed) * 64;
    with_handles(|h| h.insert(id));
    // SAFETY: non-null out-parameter.
    unsafe { out.write(id as sys::cublasLtHandle_t) };
    S::CUBLAS_STATUS_SUCCESS
}

/// Emulates `cublasLtDestroy`: forgets the handle; an unknown one is
/// `CUBLAS_STATUS_NOT_INITIALIZED`.
#[no_mangle]
pub extern "C" fn cublasLtDestroy(handle: sys::cublasLtHandle_t) -> Status {
    if with_handles(|h| h.remove(&(handle as usize))) {
        S::CUBLAS_STATUS_SUCCESS
    } else {
        S::CUBLAS_STATUS_NOT_INITIALIZED
    }
}

/// cuBLASLt 13.0.0.
const VERSION: usize = 130000;

/// Emulates `cublasLtGetVersion`: 130000 (cuBLASLt 13.0.0).
#[no_mangle]
pub extern "C" fn cublasLtGetVersion() -> usize {
    VERSION
}

/// Emulates `cublasLtGetCudartVersion`: 13000 (CUDA 13.0).
#[no_mangle]
pub extern "C" fn cublasLtGetCudartVersion() -> usize {
    13000
}

/// Emulates `cublasLtGetProperty`: the major, minor and patch level of 13.0.0.
#[no_mangle]
pub unsafe extern "C" fn cublasLtGetProperty(kind: u32, value: *mut c_int) -> Status {
    let v = match kind {
        0 => VERSION / 10000,
        1 => VERSION / 100 % 100,
        2 => VERSION % 100,
        _ => return S::CUBLAS_STATUS_INVALID_VALUE,
    };
    if value.is_null() {
        return S::CUBLAS_STATUS_INVALID_VALUE;
    }
    // SAFETY: non-null out-parameter.
    unsafe { value.write(v as c_int) };
    S::CUBLAS_STATUS_SUCCESS
}

/// Emulates `cublasLtGetStatusName`: the name of a cuBLAS status code.
#[no_mangle]
pub extern "C" fn cublasLtGetStatusName(status: u32) -> *const c_char {
    status_name::status_name(status).as_ptr()
}

/// Says that `name` is not emulated (the stubs below).
fn not_emulated(name: &str) -> Status {
    tandem_cuda_emu_link::say(&format!("{name} is not emulated"));
    S::CUBLAS_STATUS_NOT_SUPPORTED
}

/// Emulates `cublasLtGetStatusString`: the status's name, as [`cublasLtGetStatusName`] (not
/// cuBLASLt's sentence).
#[no_mangle]
pub extern "C" fn cublasLtGetStatusString(status: u32) -> *const c_char {
    cublasLtGetStatusName(status)
}

// Generated as cuBLAS's stubs (`cuda-emu/cublas/src/stubs.rs`): the names cudarc loads from
// `cublaslt/sys/mod.rs` minus the ones above. `cuda-emu/cublas/tests/symbols.rs` checks that
// every name is exported.
tandem_cuda_emu_link::stubs!(
    Status = not_emulated;
    cublasLtEmulationDescCreate,
    cublasLtEmulationDescDestroy,
    cublasLtEmulationDescGetAttribute,
    cublasLtEmulationDescInit_internal,
    cublasLtEmulationDescSetAttribute,
    cublasLtGroupedMatrixLayoutCreate,
    cublasLtGroupedMatrixLayoutInit_internal,
    cublasLtHeuristicsCacheGetCapacity,
    cublasLtHeuristicsCacheSetCapacity,
    cublasLtLoggerForceDisable,
    cublasLtLoggerOpenFile,
    cublasLtLoggerSetCallback,
    cublasLtLoggerSetFile,
    cublasLtLoggerSetLevel,
    cublasLtLoggerSetMask,
    cublasLtMatmul,
    cublasLtMatmulAlgoCapGetAttribute,
    cublasLtMatmulAlgoCheck,
    cublasLtMatmulAlgoCheckForStream,
    cublasLtMatmulAlgoConfigGetAttribute,
    cublasLtMatmulAlgoConfigSetAttribute,
    cublasLtMatmulAlgoGetHeuristic,
    cublasLtMatmulAlgoGetHeuristicForStream,
    cublasLtMatmulAlgoGetIds,
    cublasLtMatmulAlgoInit,
    cublasLtMatmulDescCreate,
    cublasLtMatmulDescDestroy,
    cublasLtMatmulDescGetAttribute,
    cublasLtMatmulDescInit_internal,
    cublasLtMatmulDescSetAttribute,
    cublasLtMatmulPreferenceCreate,
    cublasLtMatmulPreferenceDestroy,
    cublasLtMatmulPreferenceGetAttribute,
    cublasLtMatmulPreferenceInit_internal,
    cublasLtMatmulPreferenceSetAttribute,
    cublasLtMatrixLayoutCreate,
    cublasLtMatrixLayoutDestroy,
    cublasLtMatrixLayoutGetAttribute,
    cublasLtMatrixLayoutInit_internal,
    cublasLtMatrixLayoutSetAttribute,
    cublasLtMatrixTransform,
    cublasLtMatrixTransformDescCreate,
    cublasLtMatrixTransformDescDestroy,
    cublasLtMatrixTransformDescGetAttribute,
    cublasLtMatrixTransformDescInit_internal,
    cublasLtMatrixTransformDescSetAttribute,
);
