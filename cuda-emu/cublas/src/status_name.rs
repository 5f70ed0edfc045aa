//! The names of cuBLAS's status codes, shared by the emulated cuBLAS and cuBLASLt (which
//! includes this file by path: the two libraries are separate shared objects).

use std::ffi::CStr;

/// The C name of cuBLAS status `status` (`CUBLAS_STATUS_UNKNOWN` for a code cuBLAS does not
/// define).
pub(crate) fn status_name(status: u32) -> &'static CStr {
    match status {
        0 => c"CUBLAS_STATUS_SUCCESS",
        1 => c"CUBLAS_STATUS_NOT_INITIALIZED",
        3 => c"CUBLAS_STATUS_ALLOC_FAILED",
        7 => c"CUBLAS_STATUS_INVALID_VALUE",
        8 => c"CUBLAS_STATUS_ARCH_MISMATCH",
        11 => c"CUBLAS_STATUS_MAPPING_ERROR",
        13 => c"CUBLAS_STATUS_EXECUTION_FAILED",
        14 => c"CUBLAS_STATUS_INTERNAL_ERROR",
        15 => c"CUBLAS_STATUS_NOT_SUPPORTED",
        16 => c"CUBLAS_STATUS_LICENSE_ERROR",
        _ => c"CUBLAS_STATUS_UNKNOWN",
    }
}
