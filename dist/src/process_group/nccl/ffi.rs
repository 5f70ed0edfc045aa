//! Bindings to the NCCL functions tandem calls, resolved at run time.
//!
//! NCCL is opened like every other CUDA library: `tandem_core`'s library search finds
//! `libnccl.so.2` (NVIDIA's packages ship no `libnccl.so`, the name cudarc asks for), and the
//! symbols below are looked up in it once per process. A missing library, a missing symbol or
//! a version older than 2.14 (the first with non-blocking communicators, which a safe abort
//! needs) is an error naming it, never a panic.
//!
//! The signatures, enum values and the `ncclConfig_t` prefix were checked against `nccl.h` of
//! NCCL 2.28.9 (the pip package `nvidia-nccl-cu13==2.28.9`) and 2.30.7; `ncclResult_t`,
//! `ncclDataType_t` and `ncclRedOp_t` are C enums, passed as `int`; `ncclUniqueId` is a
//! 128-byte struct passed by value; `ncclComm_t` and `cudaStream_t` are opaque pointers.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use tandem_core::cuda::libs::{self, CudaLibrary};
use tandem_core::Device;

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `cudaStream_t` (the same handle as the driver's `CUstream`).
pub(crate) type RawStream = *mut c_void;
/// `ncclResult_t`.
pub(crate) type NcclStatus = c_int;

/// `ncclSuccess`.
pub(crate) const SUCCESS: NcclStatus = 0;
/// `ncclInProgress`: a non-blocking call is still being carried out in the background.
pub(crate) const IN_PROGRESS: NcclStatus = 7;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawUniqueId {
    pub(crate) internal: [c_char; UNIQUE_ID_BYTES],
}

/// The first fields of `ncclConfig_t`, as NCCL 2.14 introduced it (plus `trafficClass`, so the
/// struct has no padding NCCL could read). NCCL copies `min(size, its own size)` bytes and
/// resets every field newer than `version` to its default, so this prefix is understood by
/// every release from 2.14 on.
#[repr(C)]
pub(crate) struct RawConfig {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` of version 2.14 with `blocking` set.
    pub(crate) fn new(blocking: bool) -> Self {
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: 0xcafe_beef,
            version: 21400,
            blocking: c_int::from(blocking),
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
        }
    }
}

/// `ncclDataType_t` values.
pub(crate) mod data_type {
    use std::ffi::c_int;
    pub(crate) const UINT8: c_int = 1;
    pub(crate) const INT64: c_int = 4;
    pub(crate) const FLOAT16: c_int = 6;
    pub(crate) const FLOAT32: c_int = 7;
    pub(crate) const FLOAT64: c_int = 8;
    pub(crate) const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t` values.
pub(crate) mod red_op {
    use std::ffi::c_int;
    pub(crate) const SUM: c_int = 0;
    pub(crate) const MAX: c_int = 2;
    pub(crate) const MIN: c_int = 3;
    pub(crate) const AVG: c_int = 4;
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclStatus;
type GetUniqueIdFn = unsafe extern "C" fn(*mut RawUniqueId) -> NcclStatus;
type CommInitRankConfigFn =
    unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclStatus;
type CommFn = unsafe extern "C" fn(RawComm) -> NcclStatus;
type CommGetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut NcclStatus) -> NcclStatus;
type CommQueryFn = unsafe extern "C" fn(RawComm, *mut c_int) -> NcclStatus;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclStatus;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclStatus;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    RawComm,
    RawStream,
) -> NcclStatus;
type ReduceScatterFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> NcclStatus;
type GetErrorStringFn = unsafe extern "C" fn(NcclStatus) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;

/// NCCL's version, decoded from `ncclGetVersion`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// `NCCL_MAJOR`.
    pub major: u32,
    /// `NCCL_MINOR`.
    pub minor: u32,
    /// `NCCL_PATCH`.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `NCCL_VERSION_CODE`: `X*1000 + Y*100 + Z` up to 2.8, `X*10000 + Y*100 + Z`
    /// from 2.9 on.
    pub fn from_code(code: u32) -> Self {
        if code >= 10_000 {
            NcclVersion {
                major: code / 10_000,
                minor: code / 100 % 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 1_000,
                minor: code / 100 % 10,
                patch: code % 100,
            }
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The oldest NCCL tandem accepts: 2.14 brought non-blocking communicators, `ncclCommFinalize`
/// and the `blocking` config field.
pub const MIN_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 14,
    patch: 0,
};

/// The NCCL functions tandem calls, resolved from the loaded library.
pub(crate) struct Api {
    pub(crate) version: NcclVersion,
    pub(crate) path: String,
    pub(crate) get_unique_id: GetUniqueIdFn,
    pub(crate) comm_init_rank_config: CommInitRankConfigFn,
    pub(crate) comm_finalize: CommFn,
    pub(crate) comm_destroy: CommFn,
    pub(crate) comm_abort: CommFn,
    pub(crate) comm_get_async_error: CommGetAsyncErrorFn,
    pub(crate) comm_count: CommQueryFn,
    pub(crate) comm_user_rank: CommQueryFn,
    pub(crate) all_reduce: AllReduceFn,
    pub(crate) broadcast: BroadcastFn,
    pub(crate) all_gather: AllGatherFn,
    pub(crate) reduce_scatter: ReduceScatterFn,
    get_error_string: GetErrorStringFn,
    get_last_error: GetLastErrorFn,
}

/// NCCL's functions, loading the library on first use. The error names what is missing and
/// where the library was searched for.
pub(crate) fn api() -> std::result::Result<&'static Api, String> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> std::result::Result<Api, String> {
    // The device only labels the error message: finding the library needs no device.
    let library = libs::library(CudaLibrary::Nccl, Device::Cuda(0)).map_err(|e| match e {
        tandem_core::Error::DeviceUnavailable { reason, .. } => reason,
        other => other.to_string(),
    })?;
    let path = libs::locate(CudaLibrary::Nccl, Device::Cuda(0))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "libnccl.so.2".into());
    macro_rules! bind {
        ($name:literal, $ty:ty) => {{
            // SAFETY: the symbol is NCCL's exported function of this name, whose C signature
            // `$ty` reproduces (checked against nccl.h, see the module docs).
            let symbol = unsafe { library.get::<$ty>(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("NCCL at {path} does not export {}: {e}", $name))?;
            *symbol
        }};
    }
    let get_version: GetVersionFn = bind!("ncclGetVersion", GetVersionFn);
    let mut code: c_int = 0;
    // SAFETY: `code` is valid for one write of an int.
    let status = unsafe { get_version(&mut code) };
    if status != SUCCESS || code <= 0 {
        return Err(format!(
            "ncclGetVersion of NCCL at {path} failed with status {status}"
        ));
    }
    let version = NcclVersion::from_code(code as u32);
    if version < MIN_VERSION {
        return Err(format!(
            "NCCL {version} at {path} is too old: tandem needs NCCL {MIN_VERSION} or newer \
             (non-blocking communicators, which a safe abort needs)"
        ));
    }
    Ok(Api {
        version,
        get_unique_id: bind!("ncclGetUniqueId", GetUniqueIdFn),
        comm_init_rank_config: bind!("ncclCommInitRankConfig", CommInitRankConfigFn),
        comm_finalize: bind!("ncclCommFinalize", CommFn),
        comm_destroy: bind!("ncclCommDestroy", CommFn),
        comm_abort: bind!("ncclCommAbort", CommFn),
        comm_get_async_error: bind!("ncclCommGetAsyncError", CommGetAsyncErrorFn),
        comm_count: bind!("ncclCommCount", CommQueryFn),
        comm_user_rank: bind!("ncclCommUserRank", CommQueryFn),
        all_reduce: bind!("ncclAllReduce", AllReduceFn),
        broadcast: bind!("ncclBroadcast", BroadcastFn),
        all_gather: bind!("ncclAllGather", AllGatherFn),
        reduce_scatter: bind!("ncclReduceScatter", ReduceScatterFn),
        get_error_string: bind!("ncclGetErrorString", GetErrorStringFn),
        get_last_error: bind!("ncclGetLastError", GetLastErrorFn),
        path,
    })
}

/// The name of an `ncclResult_t`.
pub(crate) fn status_name(status: NcclStatus) -> &'static str {
    match status {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an unknown NCCL status",
    }
}

/// Reads a NUL-terminated string NCCL owns.
///
/// # Safety
/// `text` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn owned_text(text: *const c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .trim()
        .to_string()
}

impl Api {
    /// `status` in words: its name, NCCL's explanation and, when `comm` is given, NCCL's
    /// last error message (which may concern an earlier call).
    ///
    /// # Safety
    /// `comm` is null or a communicator that has not been destroyed or aborted, and no other
    /// thread calls NCCL on it meanwhile.
    pub(crate) unsafe fn describe(&self, status: NcclStatus, comm: RawComm) -> String {
        // SAFETY: ncclGetErrorString accepts any value and returns a static string.
        let explanation = unsafe { owned_text((self.get_error_string)(status)) };
        let last = if comm.is_null() {
            String::new()
        } else {
            // SAFETY: `comm` is live (this function's contract); NCCL returns a string it owns.
            unsafe { owned_text((self.get_last_error)(comm)) }
        };
        let mut text = format!("{} ({status})", status_name(status));
        if !explanation.is_empty() {
            text.push_str(&format!(": {explanation}"));
        }
        if !last.is_empty() {
            text.push_str(&format!("; NCCL's last error: {last}"));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_in_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(22809).to_string(),
            "2.28.9",
            "2.9 and later"
        );
        assert_eq!(NcclVersion::from_code(23007).to_string(), "2.30.7");
        assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
        assert!(NcclVersion::from_code(21306) < MIN_VERSION);
        assert!(NcclVersion::from_code(21400) >= MIN_VERSION);
    }

    #[test]
    fn the_config_prefix_has_the_layout_of_nccl_h() {
        // size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs,
        // maxCTAs; const char* netName; int splitShare, trafficClass.
        assert_eq!(std::mem::size_of::<RawConfig>(), 48);
        assert_eq!(std::mem::offset_of!(RawConfig, blocking), 16);
        assert_eq!(std::mem::offset_of!(RawConfig, net_name), 32);
        assert_eq!(std::mem::offset_of!(RawConfig, traffic_class), 44);
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
    }

    #[test]
    fn statuses_have_names() {
        assert_eq!(status_name(6), "ncclRemoteError");
        assert_eq!(status_name(IN_PROGRESS), "ncclInProgress");
        assert_eq!(status_name(99), "an unknown NCCL status");
    }
}
