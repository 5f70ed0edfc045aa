//! `tandem-cuda-emu-cudnn`: an emulated cuDNN (`libcudnn.so.9`) for the emulated driver
//! (`tandem-cuda-emu`), tests only (issue 21, item 1). Like the driver, a program finds it only
//! when `TANDEM_CUDA_LIBS` names a folder holding a copy of it under cuDNN's file name
//! (`tandem-test-support` makes one, with the driver, NVRTC, cuBLAS and cuBLASLt).
//!
//! # What is emulated
//!
//! The legacy convolution API tandem calls (through cudarc 0.19.10's `cudnn::result` and `sys`,
//! `cudnn-09010`), with the real signatures, handle types and cuDNN 9 status codes:
//!
//! - **Library**: `cudnnGetVersion` (9.1.0, the ABI cudarc binds), `cudnnGetCudartVersion`,
//!   `cudnnGetMaxDeviceVersion`, `cudnnGetProperty`, `cudnnGetErrorString` (the status's C
//!   name), `cudnnGetLastErrorString` (the emulator's last message), the sub-library version
//!   checks (`cudnn{Ops,Cnn,Adv}VersionCheck`).
//! - **Handles**: `cudnnCreate`, `cudnnDestroy`, `cudnnSetStream`, `cudnnGetStream`. A null,
//!   never created or destroyed handle gives `CUDNN_STATUS_BAD_PARAM` with a message.
//! - **Tensor descriptors**: create, destroy, `cudnnSetTensor4dDescriptor` (NCHW and NHWC),
//!   `cudnnSetTensor4dDescriptorEx` (explicit strides), `cudnnSetTensorNdDescriptor`, the
//!   matching getters and `cudnnGetTensorSizeInBytes`.
//! - **Filter descriptors**: create, destroy, `cudnnSetFilter4dDescriptor` and
//!   `cudnnSetFilterNdDescriptor` in the NCHW (`[K, C, R, S]`) and NHWC (`[K, R, S, C]`)
//!   layouts, `cudnnGetFilter4dDescriptor`, `cudnnGetFilterSizeInBytes`.
//! - **Convolution descriptors**: create, destroy, `cudnnSetConvolution2dDescriptor` and
//!   `…NdDescriptor` (padding, stride, dilation, convolution or cross-correlation, compute
//!   type), their getters, `cudnnSetConvolutionGroupCount` / `Get…`,
//!   `cudnnSetConvolutionMathType` / `Get…`, `cudnnGetConvolution2dForwardOutputDim` and
//!   `…NdForwardOutputDim`.
//! - **Algorithms**: for each pass (forward, backward-data, backward-filter)
//!   `cudnnGetConvolution…AlgorithmMaxCount`, the heuristics `cudnnGetConvolution…Algorithm_v7`,
//!   the measured search `cudnnFindConvolution…AlgorithmEx`, and
//!   `cudnnGetConvolution…WorkspaceSize`. Each pass offers several algorithms with different
//!   workspaces (see [`algorithms`]): one with none, some with a workspace that grows with the
//!   geometry, Winograd ones only for 3×3 (and 5×5) filters at stride 1, and some that, as on a
//!   GPU, need 16-byte-aligned buffers (cuDNN answers `CUDNN_STATUS_NOT_SUPPORTED` on other
//!   addresses, which tandem's plan cache handles). The heuristics rank by an estimate and
//!   never see addresses; the search runs the pass once (it is synchronous, as in cuDNN: it
//!   waits for the handle's stream) and ranks the algorithms that fit the buffers and the
//!   workspace by that time scaled per algorithm. The FFT algorithms and `…FWD_ALGO_DIRECT` are
//!   never supported (`CUDNN_STATUS_NOT_SUPPORTED`, listed last in every ranking).
//! - **Passes**: `cudnnConvolutionForward`, `cudnnConvolutionBackwardData`,
//!   `cudnnConvolutionBackwardFilter` with `alpha` and `beta` (host scalars: `double` for f64
//!   data, `float` otherwise; `beta == 0` does not read the output), f32, f64, f16 and bf16
//!   data (f32 compute for f16 and bf16, f16 compute accepted for f16 and run in f32).
//!
//! # How a pass runs
//!
//! In stream order on the handle's stream: the call checks its arguments, copies what it needs
//! from the descriptors (they may change after the call returns, as in cuDNN), reads the
//! scalars, and enqueues the pass on the stream's worker of the emulated driver with
//! `cuLaunchHostFunc`, so a pass reads its inputs when the stream gets there — a missing event
//! wait in tandem is a real race, as on a GPU. The pass is [`mod@reference`]: direct loops over
//! the descriptors' dims and strides, accumulating in the compute type. The worker also
//! overwrites the workspace the algorithm needs, so a workspace freed before the stream ran the
//! pass shows as a write after free in the driver's quarantine.
//!
//! # Checks, as cuDNN makes them
//!
//! Every call returns the status cuDNN documents and prints a message naming the function and
//! what is wrong on stderr (`tandem-cuda-emu: …`):
//!
//! - `CUDNN_STATUS_BAD_PARAM`: a null, unknown or destroyed handle; a descriptor never set or of
//!   the wrong kind; dims, strides, filter strides or dilations below 1, negative padding; a
//!   group count below 1; unknown enum values
//!   (data type, format, mode, math type, algorithm); descriptors that contradict each other
//!   (ranks, batch, input channels ≠ filter channels × groups, output channels ≠ filters,
//!   filters not a multiple of the groups, data types that differ, a filter larger than the
//!   padded input); a workspace smaller than the size reported for the algorithm, or null when
//!   one is needed; a requested algorithm count below 1; and, beyond cuDNN, a tensor or
//!   workspace that does not lie inside one live allocation of the emulated driver
//!   (`tandem_cuda_emu_check_device_range`) — on a GPU an illegal address.
//!   `CUDNN_STATUS_BAD_PARAM_NULL_POINTER` for a null data pointer, scalar or out-parameter.
//! - `CUDNN_STATUS_NOT_SUPPORTED`: an output whose spatial dims are not what the convolution
//!   gives (as cuDNN documents it), other than 4-d tensors (3-d convolutions are not
//!   emulated), a data/compute type combination cuDNN lacks, an algorithm the geometry or the
//!   buffers' alignment do not allow.
//!
//! Every convolution counts in the driver's counters (`convolutions`, through
//! `tandem_cuda_emu_count_dnn`).
//!
//! Every other entry point cudarc 0.19.10 may load is a stub ([`stubs`]) that prints
//! `tandem-cuda-emu: <name> is not emulated` and returns `CUDNN_STATUS_NOT_SUPPORTED`.
//!
//! # Not checked
//!
//! Speed (the passes are loops on the stream's worker thread), cuDNN's own rounding (summation
//! order, TF32 with `CUDNN_DEFAULT_MATH`/`CUDNN_TENSOR_OP_MATH`: the emulator computes in full
//! f32, so a test relying on TF32's rounding must not run here), which algorithms a real GPU
//! offers for a geometry and their workspace sizes (the emulator's are its own), what the
//! search writes in the output besides the result, which of cuDNN 9's finer status codes a real
//! cuDNN returns (the emulator answers the plain `BAD_PARAM` / `NOT_SUPPORTED` of the legacy
//! API's documentation, and `BAD_PARAM_NULL_POINTER` for null pointers; tandem tells only the
//! categories apart), the backend (graph) API, 3-d convolutions,
//! fused convolution-bias-activation, pooling, normalisation and the other non-convolution
//! calls (stubs).

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::too_many_arguments)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::cudnn::sys;
use parking_lot::Mutex;
use tandem_cuda_emu_link::{self as link, Library};

pub mod algorithms;
pub mod reference;
pub mod stubs;

use algorithms::{Algo, Spec};
use reference::{Call, Conv, Elem, Pass, Problem, Tensor4};

/// cuDNN's status type.
pub type Status = sys::cudnnStatus_t;
use sys::cudnnStatus_t as S;

/// The body of an entry point: `Err` holds the status to return.
type Res = link::Res<Cudnn>;

/// The last message, for `cudnnGetLastErrorString`.
static LAST: Mutex<String> = Mutex::new(String::new());

/// cuDNN for the shared code of the emulator's libraries.
pub enum Cudnn {}

impl Library for Cudnn {
    type Status = Status;
    const NAME: &'static str = "cuDNN";
    const WORK: &'static str = "convolution";
    const WORKER_PANIC: &'static str = "a cuDNN convolution panicked on its stream's worker";
    const SUCCESS: Status = S::CUDNN_STATUS_SUCCESS;
    const INTERNAL_ERROR: Status = S::CUDNN_STATUS_INTERNAL_ERROR;
    const NOT_EMULATED: Status = S::CUDNN_STATUS_NOT_SUPPORTED;
    const NO_DRIVER: Status = S::CUDNN_STATUS_NOT_INITIALIZED;
    const ENQUEUE_FAILED: Status = S::CUDNN_STATUS_EXECUTION_FAILED;

    /// Prints a message of the emulator on stderr, and keeps it for `cudnnGetLastErrorString`.
    fn say(message: &str) {
        link::say(message);
        *LAST.lock() = message.to_string();
    }

    fn range_fault(_what: String) -> Status {
        S::CUDNN_STATUS_BAD_PARAM
    }
}

/// Prints a message of the emulator on stderr (and keeps it as the last one).
fn say(message: &str) {
    Cudnn::say(message)
}

/// Fails with `status` after saying why.
fn fail<T>(status: Status, message: String) -> Result<T, Status> {
    link::fail::<Cudnn, T>(status, message)
}

/// Runs an entry point's body; a panic becomes `CUDNN_STATUS_INTERNAL_ERROR` with a message (it
/// must not unwind into C).
fn entry(name: &str, body: impl FnOnce() -> Res) -> Status {
    link::entry::<Cudnn>(name, body)
}

/// Writes through an out-pointer, or fails with `BAD_PARAM_NULL_POINTER` when null.
unsafe fn put<T>(name: &str, what: &str, out: *mut T, value: T) -> Res {
    if out.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: {what} is null"),
        );
    }
    // SAFETY: non-null; cuDNN's contract for out-parameters.
    unsafe { out.write(value) };
    Ok(())
}

// ---- The emulated driver (tandem-cuda-emu-link) -----------------------------------------------

fn driver() -> Result<&'static link::Driver, Status> {
    link::driver::<Cudnn>()
}

/// Checks that `len` bytes at `ptr` lie in one live device allocation; the driver reports the
/// fault (starting with `what`) on stderr.
fn check_range(ptr: u64, len: usize, what: impl FnOnce() -> String) -> Res {
    link::check_range::<Cudnn>(ptr, len, what)
}

/// Work for a stream's worker.
type Job = link::Job;

/// Enqueues `job` on `stream` (the handle's) in stream order.
fn enqueue(name: &str, stream: usize, job: Job) -> Res {
    link::enqueue::<Cudnn>(name, stream, job)
}

// ---- Handles and descriptors ------------------------------------------------------------------

/// A tensor descriptor once set: data type, dims and element strides.
#[derive(Clone, Debug)]
struct TensorDesc {
    dtype: u32,
    dims: Vec<usize>,
    strides: Vec<usize>,
}

/// A filter descriptor once set: data type, layout (0 NCHW: `[K, C, R, S]` in memory, 1 NHWC:
/// `[K, R, S, C]`) and dims, always given as `[K, C, spatial…]`.
#[derive(Clone, Debug)]
struct FilterDesc {
    dtype: u32,
    format: u32,
    dims: Vec<usize>,
}

/// The geometry of a convolution descriptor once set.
#[derive(Clone, Debug)]
struct ConvGeometry {
    pad: Vec<usize>,
    stride: Vec<usize>,
    dilation: Vec<usize>,
    mode: u32,
    compute: u32,
}

/// A convolution descriptor: the geometry once set, and the settings it starts with.
#[derive(Clone, Debug)]
struct ConvDesc {
    geometry: Option<ConvGeometry>,
    math: u32,
    groups: usize,
}

#[derive(Clone, Debug)]
enum Desc {
    Tensor(Option<TensorDesc>),
    Filter(Option<FilterDesc>),
    Conv(ConvDesc),
}

#[derive(Default)]
struct Registry {
    /// Live handles and their streams.
    handles: HashMap<usize, usize>,
    /// Live descriptors.
    descriptors: HashMap<usize, Desc>,
}

/// Everything live, by the opaque address handed out (a counter, never dereferenced).
fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry::default()))
}

/// A fresh opaque address.
fn next_id() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    0x7d11_0000_0000 + NEXT.fetch_add(1, Ordering::Relaxed) * 64
}

/// The stream of handle `h`.
fn stream_of(name: &str, h: *mut c_void) -> Result<usize, Status> {
    if h.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the handle is null"),
        );
    }
    match registry().lock().handles.get(&(h as usize)) {
        Some(&s) => Ok(s),
        None => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: {h:p} is not a live cuDNN handle (never created, or destroyed)"),
        ),
    }
}

/// A copy of descriptor `d`, named `what` in messages.
fn descriptor(name: &str, what: &str, d: *mut c_void) -> Result<Desc, Status> {
    if d.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the descriptor {what} is null"),
        );
    }
    match registry().lock().descriptors.get(&(d as usize)) {
        Some(desc) => Ok(desc.clone()),
        None => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: {what} ({d:p}) is not a live cuDNN descriptor (never created, or destroyed)"),
        ),
    }
}

fn tensor(name: &str, what: &str, d: *mut c_void) -> Result<TensorDesc, Status> {
    match descriptor(name, what, d)? {
        Desc::Tensor(Some(t)) => Ok(t),
        Desc::Tensor(None) => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the tensor descriptor {what} was never set"),
        ),
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {what} is not a tensor descriptor ({})",
                kind(&other)
            ),
        ),
    }
}

fn filter(name: &str, what: &str, d: *mut c_void) -> Result<FilterDesc, Status> {
    match descriptor(name, what, d)? {
        Desc::Filter(Some(f)) => Ok(f),
        Desc::Filter(None) => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the filter descriptor {what} was never set"),
        ),
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {what} is not a filter descriptor ({})",
                kind(&other)
            ),
        ),
    }
}

fn conv(name: &str, d: *mut c_void) -> Result<ConvDesc, Status> {
    match descriptor(name, "convDesc", d)? {
        Desc::Conv(c) => Ok(c),
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: convDesc is not a convolution descriptor ({})",
                kind(&other)
            ),
        ),
    }
}

fn kind(d: &Desc) -> &'static str {
    match d {
        Desc::Tensor(_) => "a tensor descriptor",
        Desc::Filter(_) => "a filter descriptor",
        Desc::Conv(_) => "a convolution descriptor",
    }
}

/// Replaces descriptor `d` (which must be live and of the kind `update` accepts).
fn update(name: &str, d: *mut c_void, update: impl FnOnce(&mut Desc) -> Res) -> Res {
    if d.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the descriptor is null"),
        );
    }
    let mut r = registry().lock();
    match r.descriptors.get_mut(&(d as usize)) {
        Some(desc) => update(desc),
        None => {
            drop(r);
            fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!(
                    "{name}: {d:p} is not a live cuDNN descriptor (never created, or destroyed)"
                ),
            )
        }
    }
}

fn create(name: &str, out: *mut *mut c_void, desc: Desc) -> Res {
    let id = next_id();
    // SAFETY: out-parameter.
    unsafe { put(name, "the descriptor's out-pointer", out, id as *mut c_void) }?;
    registry().lock().descriptors.insert(id, desc);
    Ok(())
}

fn destroy(name: &str, d: *mut c_void, which: fn(&Desc) -> bool) -> Res {
    if d.is_null() {
        // cuDNN accepts destroying a null descriptor.
        return Ok(());
    }
    let mut r = registry().lock();
    match r.descriptors.get(&(d as usize)) {
        Some(desc) if which(desc) => {
            r.descriptors.remove(&(d as usize));
            Ok(())
        }
        Some(desc) => {
            let k = kind(desc);
            drop(r);
            fail(S::CUDNN_STATUS_BAD_PARAM, format!("{name}: {d:p} is {k}"))
        }
        None => {
            drop(r);
            fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: {d:p} is not a live cuDNN descriptor (destroyed twice?)"),
            )
        }
    }
}

// ---- Library ----------------------------------------------------------------------------------

/// cuDNN 9.1.0 (`CUDNN_VERSION` = major·10000 + minor·100 + patch), the ABI cudarc's
/// `cudnn-09010` bindings describe.
pub const VERSION: usize = 90100;

/// Emulates `cudnnGetVersion`: [`VERSION`] (9.1.0).
#[no_mangle]
pub extern "C" fn cudnnGetVersion() -> usize {
    VERSION
}

/// Emulates `cudnnGetCudartVersion`: 13000 (CUDA 13.0).
#[no_mangle]
pub extern "C" fn cudnnGetCudartVersion() -> usize {
    13000
}

/// Emulates `cudnnGetMaxDeviceVersion`: 900 (the emulated device is `sm_90`).
#[no_mangle]
pub extern "C" fn cudnnGetMaxDeviceVersion() -> usize {
    // The emulated device is sm_90.
    900
}

/// Emulates `cudnnGetProperty`: the major, minor and patch level of [`VERSION`].
#[no_mangle]
pub unsafe extern "C" fn cudnnGetProperty(kind: u32, value: *mut c_int) -> Status {
    let name = "cudnnGetProperty";
    entry(name, || {
        let v = match kind {
            0 => VERSION / 10000,
            1 => VERSION / 100 % 100,
            2 => VERSION % 100,
            _ => {
                return fail(
                    S::CUDNN_STATUS_BAD_PARAM,
                    format!("{name}: {kind} is not a libraryPropertyType"),
                )
            }
        };
        // SAFETY: out-parameter.
        unsafe { put(name, "value", value, v as c_int) }
    })
}

/// Emulates `cudnnOpsVersionCheck`: always success (there are no separate sub-libraries to
/// mismatch).
#[no_mangle]
pub extern "C" fn cudnnOpsVersionCheck() -> Status {
    S::CUDNN_STATUS_SUCCESS
}

/// Emulates `cudnnCnnVersionCheck`: always success (there are no separate sub-libraries to
/// mismatch).
#[no_mangle]
pub extern "C" fn cudnnCnnVersionCheck() -> Status {
    S::CUDNN_STATUS_SUCCESS
}

/// Emulates `cudnnAdvVersionCheck`: always success (there are no separate sub-libraries to
/// mismatch).
#[no_mangle]
pub extern "C" fn cudnnAdvVersionCheck() -> Status {
    S::CUDNN_STATUS_SUCCESS
}

/// The C name of a status (what cuDNN's `cudnnGetErrorString` returns).
pub fn status_name(status: u32) -> &'static CStr {
    match status {
        0 => c"CUDNN_STATUS_SUCCESS",
        1001 => c"CUDNN_STATUS_NOT_INITIALIZED",
        1002 => c"CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
        1003 => c"CUDNN_STATUS_SERIALIZATION_VERSION_MISMATCH",
        1004 => c"CUDNN_STATUS_DEPRECATED",
        1005 => c"CUDNN_STATUS_LICENSE_ERROR",
        1006 => c"CUDNN_STATUS_RUNTIME_IN_PROGRESS",
        1007 => c"CUDNN_STATUS_RUNTIME_FP_OVERFLOW",
        1008 => c"CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
        2000 => c"CUDNN_STATUS_BAD_PARAM",
        2001 => c"CUDNN_STATUS_INVALID_VALUE",
        2002 => c"CUDNN_STATUS_BAD_PARAM_NULL_POINTER",
        2003 => c"CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
        2004 => c"CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
        2005 => c"CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND",
        2006 => c"CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT",
        2007 => c"CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH",
        2008 => c"CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH",
        2009 => c"CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES",
        2010 => c"CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE",
        2011 => c"CUDNN_STATUS_BAD_PARAM_CUDA_GRAPH_MISMATCH",
        2012 => c"CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE",
        3000 => c"CUDNN_STATUS_NOT_SUPPORTED",
        3001 => c"CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN",
        3002 => c"CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
        3003 => c"CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE",
        3004 => c"CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
        3005 => c"CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER",
        3006 => c"CUDNN_STATUS_NOT_SUPPORTED_INCOMPATIBLE_CUDART",
        3007 => c"CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
        3008 => c"CUDNN_STATUS_NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING",
        3009 => c"CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE",
        3010 => c"CUDNN_STATUS_NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT",
        3011 => c"CUDNN_STATUS_NOT_SUPPORTED_PADDING",
        3012 => c"CUDNN_STATUS_NOT_SUPPORTED_BAD_LAUNCH_PARAM",
        3013 => c"CUDNN_STATUS_NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API",
        4000 => c"CUDNN_STATUS_INTERNAL_ERROR",
        4001 => c"CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
        4002 => c"CUDNN_STATUS_INTERNAL_ERROR_UNEXPECTED_VALUE",
        4003 => c"CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
        4004 => c"CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
        4005 => c"CUDNN_STATUS_INTERNAL_ERROR_BAD_LAUNCH_PARAM",
        4006 => c"CUDNN_STATUS_INTERNAL_ERROR_TEXTURE_CREATION_FAILED",
        5000 => c"CUDNN_STATUS_EXECUTION_FAILED",
        5001 => c"CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER",
        5002 => c"CUDNN_STATUS_EXECUTION_FAILED_CUBLAS",
        5003 => c"CUDNN_STATUS_EXECUTION_FAILED_CUDART",
        5004 => c"CUDNN_STATUS_EXECUTION_FAILED_CURAND",
        _ => c"CUDNN_UNKNOWN_STATUS",
    }
}

/// Emulates `cudnnGetErrorString`: the status's C name ([`status_name`]).
#[no_mangle]
pub extern "C" fn cudnnGetErrorString(status: u32) -> *const c_char {
    status_name(status).as_ptr()
}

/// Emulates `cudnnGetLastErrorString`: the emulator's last message (of any thread), truncated to
/// the buffer.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetLastErrorString(message: *mut c_char, max_size: usize) {
    if message.is_null() || max_size == 0 {
        return;
    }
    let last = LAST.lock().clone();
    let n = last.len().min(max_size - 1);
    // SAFETY: the caller passes a buffer of `max_size` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(last.as_ptr(), message.cast::<u8>(), n);
        *message.add(n) = 0;
    }
}

// ---- Handles ----------------------------------------------------------------------------------

/// Emulates `cudnnCreate`: a handle on the legacy default stream; fails when the emulated driver is
/// not loaded.
#[no_mangle]
pub unsafe extern "C" fn cudnnCreate(out: *mut *mut c_void) -> Status {
    let name = "cudnnCreate";
    entry(name, || {
        driver()?;
        let id = next_id();
        // SAFETY: out-parameter.
        unsafe { put(name, "handle", out, id as *mut c_void) }?;
        registry().lock().handles.insert(id, 0);
        Ok(())
    })
}

/// Emulates `cudnnDestroy`: forgets the handle (work already enqueued still runs).
#[no_mangle]
pub extern "C" fn cudnnDestroy(h: *mut c_void) -> Status {
    let name = "cudnnDestroy";
    entry(name, || {
        stream_of(name, h)?;
        registry().lock().handles.remove(&(h as usize));
        Ok(())
    })
}

/// Emulates `cudnnSetStream`: later passes run on `stream` (not checked until a pass is enqueued).
#[no_mangle]
pub extern "C" fn cudnnSetStream(h: *mut c_void, stream: *mut c_void) -> Status {
    let name = "cudnnSetStream";
    entry(name, || {
        stream_of(name, h)?;
        registry()
            .lock()
            .handles
            .insert(h as usize, stream as usize);
        Ok(())
    })
}

/// Emulates `cudnnGetStream`: the handle's stream.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetStream(h: *mut c_void, stream: *mut *mut c_void) -> Status {
    let name = "cudnnGetStream";
    entry(name, || {
        let s = stream_of(name, h)?;
        // SAFETY: out-parameter.
        unsafe { put(name, "streamId", stream, s as *mut c_void) }
    })
}

// ---- Tensor descriptors -----------------------------------------------------------------------

/// Checks a data type value: one of cudnnDataType_t's (BAD_PARAM otherwise).
fn data_type(name: &str, dtype: u32) -> Res {
    if dtype <= 15 {
        Ok(())
    } else {
        fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: {dtype} is not a cudnnDataType_t"),
        )
    }
}

/// Sizes (dims, strides, …) as `usize`, each at least `min` (BAD_PARAM otherwise).
fn sizes(name: &str, what: &str, values: &[c_int], min: c_int) -> Result<Vec<usize>, Status> {
    if let Some(v) = values.iter().find(|&&v| v < min) {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: {what} {values:?} has {v}, below {min}"),
        );
    }
    Ok(values.iter().map(|&v| v as usize).collect())
}

/// A C array of `n` ints (BAD_PARAM_NULL_POINTER for a null one).
unsafe fn array(name: &str, what: &str, p: *const c_int, n: usize) -> Result<Vec<c_int>, Status> {
    if p.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: {what} is null"),
        );
    }
    // SAFETY: the caller passes `n` ints (cuDNN's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

fn set_tensor(name: &str, d: *mut c_void, dtype: u32, dims: &[c_int], strides: &[c_int]) -> Res {
    data_type(name, dtype)?;
    let dims = sizes(name, "dims", dims, 1)?;
    let strides = sizes(name, "strides", strides, 1)?;
    update(name, d, |desc| match desc {
        Desc::Tensor(t) => {
            *t = Some(TensorDesc {
                dtype,
                dims,
                strides,
            });
            Ok(())
        }
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the descriptor is {}", kind(other)),
        ),
    })
}

/// Emulates `cudnnCreateTensorDescriptor`: an unset tensor descriptor.
#[no_mangle]
pub unsafe extern "C" fn cudnnCreateTensorDescriptor(out: *mut *mut c_void) -> Status {
    let name = "cudnnCreateTensorDescriptor";
    entry(name, || create(name, out, Desc::Tensor(None)))
}

/// Emulates `cudnnDestroyTensorDescriptor`; a handle of another kind or destroyed twice is
/// `CUDNN_STATUS_BAD_PARAM`.
#[no_mangle]
pub extern "C" fn cudnnDestroyTensorDescriptor(d: *mut c_void) -> Status {
    let name = "cudnnDestroyTensorDescriptor";
    entry(name, || destroy(name, d, |k| matches!(k, Desc::Tensor(_))))
}

/// Emulates `cudnnSetTensor4dDescriptor` for NCHW and NHWC (packed strides);
/// `CUDNN_TENSOR_NCHW_VECT_C` is `CUDNN_STATUS_NOT_SUPPORTED`.
#[no_mangle]
pub extern "C" fn cudnnSetTensor4dDescriptor(
    d: *mut c_void,
    format: u32,
    dtype: u32,
    n: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> Status {
    let name = "cudnnSetTensor4dDescriptor";
    entry(name, || {
        let strides = match format {
            0 => [c * h * w, h * w, w, 1],
            1 => [h * w * c, 1, w * c, c],
            2 => {
                return fail(
                    S::CUDNN_STATUS_NOT_SUPPORTED,
                    format!("{name}: CUDNN_TENSOR_NCHW_VECT_C is not emulated"),
                )
            }
            _ => {
                return fail(
                    S::CUDNN_STATUS_BAD_PARAM,
                    format!("{name}: {format} is not a cudnnTensorFormat_t"),
                )
            }
        };
        set_tensor(name, d, dtype, &[n, c, h, w], &strides)
    })
}

/// Emulates `cudnnSetTensor4dDescriptorEx`: dims and explicit strides, each at least 1.
#[no_mangle]
pub extern "C" fn cudnnSetTensor4dDescriptorEx(
    d: *mut c_void,
    dtype: u32,
    n: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
    ns: c_int,
    cs: c_int,
    hs: c_int,
    ws: c_int,
) -> Status {
    let name = "cudnnSetTensor4dDescriptorEx";
    entry(name, || {
        set_tensor(name, d, dtype, &[n, c, h, w], &[ns, cs, hs, ws])
    })
}

/// Emulates `cudnnSetTensorNdDescriptor` for 1 to 8 dims (only 4-d tensors can be convolved).
#[no_mangle]
pub unsafe extern "C" fn cudnnSetTensorNdDescriptor(
    d: *mut c_void,
    dtype: u32,
    nb_dims: c_int,
    dims: *const c_int,
    strides: *const c_int,
) -> Status {
    let name = "cudnnSetTensorNdDescriptor";
    entry(name, || {
        if !(1..=8).contains(&nb_dims) {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: nbDims = {nb_dims} is not in 1..=8"),
            );
        }
        // SAFETY: arrays of nbDims ints.
        let (dims, strides) = unsafe {
            (
                array(name, "dimA", dims, nb_dims as usize)?,
                array(name, "strideA", strides, nb_dims as usize)?,
            )
        };
        set_tensor(name, d, dtype, &dims, &strides)
    })
}

/// Emulates `cudnnGetTensor4dDescriptor`: the data type, dims and strides of a 4-d descriptor.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetTensor4dDescriptor(
    d: *mut c_void,
    dtype: *mut u32,
    n: *mut c_int,
    c: *mut c_int,
    h: *mut c_int,
    w: *mut c_int,
    ns: *mut c_int,
    cs: *mut c_int,
    hs: *mut c_int,
    ws: *mut c_int,
) -> Status {
    let name = "cudnnGetTensor4dDescriptor";
    entry(name, || {
        let t = tensor(name, "tensorDesc", d)?;
        if t.dims.len() != 4 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: the descriptor has {} dims, not 4", t.dims.len()),
            );
        }
        // SAFETY: out-parameters.
        unsafe {
            put(name, "dataType", dtype, t.dtype)?;
            for (i, out) in [n, c, h, w].into_iter().enumerate() {
                put(name, "a dim", out, t.dims[i] as c_int)?;
            }
            for (i, out) in [ns, cs, hs, ws].into_iter().enumerate() {
                put(name, "a stride", out, t.strides[i] as c_int)?;
            }
        }
        Ok(())
    })
}

/// Emulates `cudnnGetTensorNdDescriptor`: the data type, rank, and up to `requested` dims and
/// strides.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetTensorNdDescriptor(
    d: *mut c_void,
    requested: c_int,
    dtype: *mut u32,
    nb_dims: *mut c_int,
    dims: *mut c_int,
    strides: *mut c_int,
) -> Status {
    let name = "cudnnGetTensorNdDescriptor";
    entry(name, || {
        let t = tensor(name, "tensorDesc", d)?;
        // SAFETY: out-parameters; the arrays hold `requested` ints.
        unsafe {
            put(name, "dataType", dtype, t.dtype)?;
            put(name, "nbDims", nb_dims, t.dims.len() as c_int)?;
            for i in 0..(requested.max(0) as usize).min(t.dims.len()) {
                put(name, "dimA", dims.add(i), t.dims[i] as c_int)?;
                put(name, "strideA", strides.add(i), t.strides[i] as c_int)?;
            }
        }
        Ok(())
    })
}

/// Emulates `cudnnGetTensorSizeInBytes`: the bytes the strides span, from the first to the last
/// element.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetTensorSizeInBytes(d: *mut c_void, size: *mut usize) -> Status {
    let name = "cudnnGetTensorSizeInBytes";
    entry(name, || {
        let t = tensor(name, "tensorDesc", d)?;
        let span = 1 + t
            .dims
            .iter()
            .zip(&t.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>();
        let bytes = span * elem_size(t.dtype);
        // SAFETY: out-parameter.
        unsafe { put(name, "size", size, bytes) }
    })
}

/// Bytes per element of a data type (the emulated convolution's four, and the others' sizes).
fn elem_size(dtype: u32) -> usize {
    match dtype {
        1 | 10 => 8,
        0 | 4 | 5 | 7 => 4,
        2 | 9 => 2,
        8 => 32,
        _ => 1,
    }
}

// ---- Filter descriptors -----------------------------------------------------------------------

fn set_filter(name: &str, d: *mut c_void, dtype: u32, format: u32, dims: &[c_int]) -> Res {
    data_type(name, dtype)?;
    match format {
        0 | 1 => {}
        2 => {
            return fail(
                S::CUDNN_STATUS_NOT_SUPPORTED,
                format!("{name}: CUDNN_TENSOR_NCHW_VECT_C is not emulated"),
            )
        }
        _ => {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: {format} is not a cudnnTensorFormat_t"),
            )
        }
    }
    let dims = sizes(name, "filter dims", dims, 1)?;
    update(name, d, |desc| match desc {
        Desc::Filter(f) => {
            *f = Some(FilterDesc {
                dtype,
                format,
                dims,
            });
            Ok(())
        }
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the descriptor is {}", kind(other)),
        ),
    })
}

/// Emulates `cudnnCreateFilterDescriptor`: an unset filter descriptor.
#[no_mangle]
pub unsafe extern "C" fn cudnnCreateFilterDescriptor(out: *mut *mut c_void) -> Status {
    let name = "cudnnCreateFilterDescriptor";
    entry(name, || create(name, out, Desc::Filter(None)))
}

/// Emulates `cudnnDestroyFilterDescriptor`; a handle of another kind or destroyed twice is
/// `CUDNN_STATUS_BAD_PARAM`.
#[no_mangle]
pub extern "C" fn cudnnDestroyFilterDescriptor(d: *mut c_void) -> Status {
    let name = "cudnnDestroyFilterDescriptor";
    entry(name, || destroy(name, d, |k| matches!(k, Desc::Filter(_))))
}

/// Emulates `cudnnSetFilter4dDescriptor`: `[K, C, R, S]` in the NCHW or NHWC layout;
/// `CUDNN_TENSOR_NCHW_VECT_C` is `CUDNN_STATUS_NOT_SUPPORTED`.
#[no_mangle]
pub extern "C" fn cudnnSetFilter4dDescriptor(
    d: *mut c_void,
    dtype: u32,
    format: u32,
    k: c_int,
    c: c_int,
    h: c_int,
    w: c_int,
) -> Status {
    let name = "cudnnSetFilter4dDescriptor";
    entry(name, || set_filter(name, d, dtype, format, &[k, c, h, w]))
}

/// Emulates `cudnnSetFilterNdDescriptor` for 3 to 8 dims, in the layouts of
/// [`cudnnSetFilter4dDescriptor`].
#[no_mangle]
pub unsafe extern "C" fn cudnnSetFilterNdDescriptor(
    d: *mut c_void,
    dtype: u32,
    format: u32,
    nb_dims: c_int,
    dims: *const c_int,
) -> Status {
    let name = "cudnnSetFilterNdDescriptor";
    entry(name, || {
        if !(3..=8).contains(&nb_dims) {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: nbDims = {nb_dims} is not in 3..=8"),
            );
        }
        // SAFETY: an array of nbDims ints.
        let dims = unsafe { array(name, "filterDimA", dims, nb_dims as usize) }?;
        set_filter(name, d, dtype, format, &dims)
    })
}

/// Emulates `cudnnGetFilter4dDescriptor`: the data type, format and dims of a 4-d filter.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetFilter4dDescriptor(
    d: *mut c_void,
    dtype: *mut u32,
    format: *mut u32,
    k: *mut c_int,
    c: *mut c_int,
    h: *mut c_int,
    w: *mut c_int,
) -> Status {
    let name = "cudnnGetFilter4dDescriptor";
    entry(name, || {
        let f = filter(name, "filterDesc", d)?;
        if f.dims.len() != 4 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: the descriptor has {} dims, not 4", f.dims.len()),
            );
        }
        // SAFETY: out-parameters.
        unsafe {
            put(name, "dataType", dtype, f.dtype)?;
            put(name, "format", format, f.format)?;
            for (i, out) in [k, c, h, w].into_iter().enumerate() {
                put(name, "a dim", out, f.dims[i] as c_int)?;
            }
        }
        Ok(())
    })
}

/// Emulates `cudnnGetFilterSizeInBytes`: the packed size of the filter.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetFilterSizeInBytes(d: *mut c_void, size: *mut usize) -> Status {
    let name = "cudnnGetFilterSizeInBytes";
    entry(name, || {
        let f = filter(name, "filterDesc", d)?;
        let bytes = f.dims.iter().product::<usize>() * elem_size(f.dtype);
        // SAFETY: out-parameter.
        unsafe { put(name, "size", size, bytes) }
    })
}

// ---- Convolution descriptors ------------------------------------------------------------------

/// Emulates `cudnnCreateConvolutionDescriptor`: unset geometry, default math, one group.
#[no_mangle]
pub unsafe extern "C" fn cudnnCreateConvolutionDescriptor(out: *mut *mut c_void) -> Status {
    let name = "cudnnCreateConvolutionDescriptor";
    entry(name, || {
        create(
            name,
            out,
            Desc::Conv(ConvDesc {
                geometry: None,
                math: 0,
                groups: 1,
            }),
        )
    })
}

/// Emulates `cudnnDestroyConvolutionDescriptor`; a handle of another kind or destroyed twice is
/// `CUDNN_STATUS_BAD_PARAM`.
#[no_mangle]
pub extern "C" fn cudnnDestroyConvolutionDescriptor(d: *mut c_void) -> Status {
    let name = "cudnnDestroyConvolutionDescriptor";
    entry(name, || destroy(name, d, |k| matches!(k, Desc::Conv(_))))
}

fn update_conv(name: &str, d: *mut c_void, f: impl FnOnce(&mut ConvDesc)) -> Res {
    update(name, d, |desc| match desc {
        Desc::Conv(c) => {
            f(c);
            Ok(())
        }
        other => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the descriptor is {}", kind(other)),
        ),
    })
}

fn set_conv(
    name: &str,
    d: *mut c_void,
    (pad, stride, dilation): (&[c_int], &[c_int], &[c_int]),
    mode: u32,
    compute: u32,
) -> Res {
    let pad = sizes(name, "padding", pad, 0)?;
    let stride = sizes(name, "stride", stride, 1)?;
    let dilation = sizes(name, "dilation", dilation, 1)?;
    if mode > 1 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: mode {mode} is not a cudnnConvolutionMode_t"),
        );
    }
    data_type(name, compute)?;
    update_conv(name, d, |c| {
        c.geometry = Some(ConvGeometry {
            pad,
            stride,
            dilation,
            mode,
            compute,
        })
    })
}

/// Emulates `cudnnSetConvolution2dDescriptor`: padding (at least 0), stride and dilation (at least
/// 1), convolution or cross-correlation, compute type.
#[no_mangle]
pub extern "C" fn cudnnSetConvolution2dDescriptor(
    d: *mut c_void,
    pad_h: c_int,
    pad_w: c_int,
    u: c_int,
    v: c_int,
    dilation_h: c_int,
    dilation_w: c_int,
    mode: u32,
    compute: u32,
) -> Status {
    let name = "cudnnSetConvolution2dDescriptor";
    entry(name, || {
        set_conv(
            name,
            d,
            (&[pad_h, pad_w], &[u, v], &[dilation_h, dilation_w]),
            mode,
            compute,
        )
    })
}

/// Emulates `cudnnSetConvolutionNdDescriptor` for 1 to 6 spatial dims (only 2-d convolutions run),
/// checked as [`cudnnSetConvolution2dDescriptor`].
#[no_mangle]
pub unsafe extern "C" fn cudnnSetConvolutionNdDescriptor(
    d: *mut c_void,
    length: c_int,
    pad: *const c_int,
    stride: *const c_int,
    dilation: *const c_int,
    mode: u32,
    compute: u32,
) -> Status {
    let name = "cudnnSetConvolutionNdDescriptor";
    entry(name, || {
        if !(1..=6).contains(&length) {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: arrayLength = {length} is not in 1..=6"),
            );
        }
        let n = length as usize;
        // SAFETY: arrays of arrayLength ints.
        let (pad, stride, dilation) = unsafe {
            (
                array(name, "padA", pad, n)?,
                array(name, "filterStrideA", stride, n)?,
                array(name, "dilationA", dilation, n)?,
            )
        };
        set_conv(name, d, (&pad, &stride, &dilation), mode, compute)
    })
}

fn geometry(name: &str, d: *mut c_void) -> Result<(ConvDesc, ConvGeometry), Status> {
    let c = conv(name, d)?;
    match c.geometry.clone() {
        Some(g) => Ok((c, g)),
        None => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: the convolution descriptor was never set"),
        ),
    }
}

/// Emulates `cudnnGetConvolution2dDescriptor`: the geometry, mode and compute type of a 2-d
/// descriptor.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolution2dDescriptor(
    d: *mut c_void,
    pad_h: *mut c_int,
    pad_w: *mut c_int,
    u: *mut c_int,
    v: *mut c_int,
    dilation_h: *mut c_int,
    dilation_w: *mut c_int,
    mode: *mut u32,
    compute: *mut u32,
) -> Status {
    let name = "cudnnGetConvolution2dDescriptor";
    entry(name, || {
        let (_, g) = geometry(name, d)?;
        if g.pad.len() != 2 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!(
                    "{name}: the descriptor has {} spatial dims, not 2",
                    g.pad.len()
                ),
            );
        }
        // SAFETY: out-parameters.
        unsafe {
            put(name, "pad_h", pad_h, g.pad[0] as c_int)?;
            put(name, "pad_w", pad_w, g.pad[1] as c_int)?;
            put(name, "u", u, g.stride[0] as c_int)?;
            put(name, "v", v, g.stride[1] as c_int)?;
            put(name, "dilation_h", dilation_h, g.dilation[0] as c_int)?;
            put(name, "dilation_w", dilation_w, g.dilation[1] as c_int)?;
            put(name, "mode", mode, g.mode)?;
            put(name, "computeType", compute, g.compute)
        }
    })
}

/// Emulates `cudnnGetConvolutionNdDescriptor`: the spatial rank, up to `requested` paddings,
/// strides and dilations, the mode and compute type.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionNdDescriptor(
    d: *mut c_void,
    requested: c_int,
    length: *mut c_int,
    pad: *mut c_int,
    stride: *mut c_int,
    dilation: *mut c_int,
    mode: *mut u32,
    compute: *mut u32,
) -> Status {
    let name = "cudnnGetConvolutionNdDescriptor";
    entry(name, || {
        let (_, g) = geometry(name, d)?;
        // SAFETY: out-parameters; the arrays hold `requested` ints.
        unsafe {
            put(name, "arrayLength", length, g.pad.len() as c_int)?;
            for i in 0..(requested.max(0) as usize).min(g.pad.len()) {
                put(name, "padA", pad.add(i), g.pad[i] as c_int)?;
                put(name, "strideA", stride.add(i), g.stride[i] as c_int)?;
                put(name, "dilationA", dilation.add(i), g.dilation[i] as c_int)?;
            }
            put(name, "mode", mode, g.mode)?;
            put(name, "computeType", compute, g.compute)
        }
    })
}

/// Emulates `cudnnSetConvolutionGroupCount` (at least 1).
#[no_mangle]
pub extern "C" fn cudnnSetConvolutionGroupCount(d: *mut c_void, groups: c_int) -> Status {
    let name = "cudnnSetConvolutionGroupCount";
    entry(name, || {
        if groups < 1 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: groupCount = {groups} is below 1"),
            );
        }
        update_conv(name, d, |c| c.groups = groups as usize)
    })
}

/// Emulates `cudnnGetConvolutionGroupCount`.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionGroupCount(
    d: *mut c_void,
    groups: *mut c_int,
) -> Status {
    let name = "cudnnGetConvolutionGroupCount";
    entry(name, || {
        let c = conv(name, d)?;
        // SAFETY: out-parameter.
        unsafe { put(name, "groupCount", groups, c.groups as c_int) }
    })
}

/// Emulates `cudnnSetConvolutionMathType`: stored; every math type computes in full precision (TF32
/// included).
#[no_mangle]
pub extern "C" fn cudnnSetConvolutionMathType(d: *mut c_void, math: u32) -> Status {
    let name = "cudnnSetConvolutionMathType";
    entry(name, || {
        if math > 3 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: {math} is not a cudnnMathType_t"),
            );
        }
        update_conv(name, d, |c| c.math = math)
    })
}

/// Emulates `cudnnGetConvolutionMathType`: the stored math type.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionMathType(d: *mut c_void, math: *mut u32) -> Status {
    let name = "cudnnGetConvolutionMathType";
    entry(name, || {
        let c = conv(name, d)?;
        // SAFETY: out-parameter.
        unsafe { put(name, "mathType", math, c.math) }
    })
}

/// The output dims `[N, K, spatial…]` of a convolution of `x` by `w`.
fn output_dims(
    name: &str,
    x: &TensorDesc,
    w: &FilterDesc,
    c: &ConvDesc,
) -> Result<Vec<usize>, Status> {
    let g = c.geometry.as_ref().ok_or_else(|| {
        say(&format!("{name}: the convolution descriptor was never set"));
        S::CUDNN_STATUS_BAD_PARAM
    })?;
    let spatial = g.pad.len();
    if x.dims.len() != spatial + 2 || w.dims.len() != spatial + 2 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: the input has {} dims and the filter {}, but the convolution has {spatial} \
                 spatial dims",
                x.dims.len(),
                w.dims.len()
            ),
        );
    }
    let (k, fc) = (w.dims[0], w.dims[1]);
    let fs = filter_spatial(w);
    if x.dims[1] != fc * c.groups {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: the input has {} channels, the filter {fc} per group × {} groups",
                x.dims[1], c.groups
            ),
        );
    }
    let mut out = vec![x.dims[0], k];
    for (d, &f) in fs.iter().enumerate() {
        let span = g.dilation[d] * (f - 1) + 1;
        let padded = x.dims[2 + d] + 2 * g.pad[d];
        if span > padded {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!(
                    "{name}: spatial dim {d}: the filter spans {span} (size {}, dilation {}), more \
                     than the padded input's {padded} (size {}, padding {})",
                    f, g.dilation[d], x.dims[2 + d], g.pad[d]
                ),
            );
        }
        out.push((padded - span) / g.stride[d] + 1);
    }
    Ok(out)
}

/// A filter's spatial sizes: cuDNN takes a filter's dims as `[K, C, spatial…]` in either
/// layout (the format says only how they lie in memory).
fn filter_spatial(w: &FilterDesc) -> Vec<usize> {
    w.dims[2..].to_vec()
}

/// Emulates `cudnnGetConvolution2dForwardOutputDim`: `[N, K, H', W']`, after checking that the
/// tensor, filter and convolution agree.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolution2dForwardOutputDim(
    d: *mut c_void,
    x: *mut c_void,
    w: *mut c_void,
    n: *mut c_int,
    c: *mut c_int,
    h: *mut c_int,
    ww: *mut c_int,
) -> Status {
    let name = "cudnnGetConvolution2dForwardOutputDim";
    entry(name, || {
        let cd = conv(name, d)?;
        let xd = tensor(name, "inputTensorDesc", x)?;
        let wd = filter(name, "filterDesc", w)?;
        let out = output_dims(name, &xd, &wd, &cd)?;
        if out.len() != 4 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: a {}-d convolution", out.len() - 2),
            );
        }
        // SAFETY: out-parameters.
        unsafe {
            for (i, p) in [n, c, h, ww].into_iter().enumerate() {
                put(name, "an output dim", p, out[i] as c_int)?;
            }
        }
        Ok(())
    })
}

/// Emulates `cudnnGetConvolutionNdForwardOutputDim`: as the 2-d one, for `nbDims` equal to the
/// output's rank.
#[no_mangle]
pub unsafe extern "C" fn cudnnGetConvolutionNdForwardOutputDim(
    d: *mut c_void,
    x: *mut c_void,
    w: *mut c_void,
    nb_dims: c_int,
    out: *mut c_int,
) -> Status {
    let name = "cudnnGetConvolutionNdForwardOutputDim";
    entry(name, || {
        let cd = conv(name, d)?;
        let xd = tensor(name, "inputTensorDesc", x)?;
        let wd = filter(name, "filterDesc", w)?;
        let dims = output_dims(name, &xd, &wd, &cd)?;
        if nb_dims as usize != dims.len() {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM,
                format!("{name}: nbDims = {nb_dims}, the output has {}", dims.len()),
            );
        }
        for (i, &v) in dims.iter().enumerate() {
            // SAFETY: an array of nbDims ints.
            unsafe { put(name, "tensorOuputDimA", out.add(i), v as c_int) }?;
        }
        Ok(())
    })
}

// ---- Convolutions: checks ---------------------------------------------------------------------

/// The three descriptors of a pass, by role: input `x`, filter `w`, output `y` (in the backward
/// passes, `y` is the output gradient and `x` or `w` the gradient written).
struct Descs {
    x: *mut c_void,
    w: *mut c_void,
    conv: *mut c_void,
    y: *mut c_void,
}

/// A checked convolution: the problem the reference runs, and the descriptor's math type.
#[derive(Clone, Copy, Debug)]
struct Checked {
    problem: Problem,
    math: u32,
    /// The compute type is f64 (the scalars are doubles).
    double: bool,
}

/// The argument name of each role in `pass`'s call, for messages.
fn role_names(pass: Pass) -> (&'static str, &'static str, &'static str) {
    match pass {
        Pass::Forward => ("xDesc", "wDesc", "yDesc"),
        Pass::BackwardData => ("dxDesc", "wDesc", "dyDesc"),
        Pass::BackwardFilter => ("xDesc", "dwDesc", "dyDesc"),
    }
}

/// Checks the descriptors of one pass against each other, as cuDNN does (see the crate doc).
fn check(name: &str, pass: Pass, d: &Descs) -> Result<Checked, Status> {
    let roles = role_names(pass);
    let (xn, wn, yn) = roles;
    let x = tensor(name, xn, d.x)?;
    let w = filter(name, wn, d.w)?;
    let y = tensor(name, yn, d.y)?;
    let (c, g) = geometry(name, d.conv)?;
    check_ranks_and_types(name, roles, &x, &w, &y, &g)?;
    check_output(name, roles, &x, &w, &y, &c, &g)?;
    let elem = element_type(name, x.dtype, g.compute)?;
    let t4 = |t: &TensorDesc| Tensor4 {
        dims: [t.dims[0], t.dims[1], t.dims[2], t.dims[3]],
        strides: [t.strides[0], t.strides[1], t.strides[2], t.strides[3]],
    };
    let [fk, fc, fr, fs] = [w.dims[0], w.dims[1], w.dims[2], w.dims[3]];
    let filter = if w.format == 1 {
        Tensor4::nhwc([fk, fc, fr, fs])
    } else {
        Tensor4::nchw([fk, fc, fr, fs])
    };
    Ok(Checked {
        problem: Problem {
            x: t4(&x),
            w: filter,
            y: t4(&y),
            conv: Conv {
                pad: [g.pad[0], g.pad[1]],
                stride: [g.stride[0], g.stride[1]],
                dilation: [g.dilation[0], g.dilation[1]],
                groups: c.groups,
                flip: g.mode == 0,
            },
            elem,
        },
        math: c.math,
        double: elem == Elem::F64,
    })
}

/// Checks that the three tensors and the convolution agree on the rank and the tensors on the
/// data type; `roles` names the arguments in messages.
fn check_ranks_and_types(
    name: &str,
    (xn, wn, yn): (&str, &str, &str),
    x: &TensorDesc,
    w: &FilterDesc,
    y: &TensorDesc,
    g: &ConvGeometry,
) -> Result<(), Status> {
    if x.dims.len() != y.dims.len() || x.dims.len() != w.dims.len() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {xn} has {} dims, {wn} {} and {yn} {}",
                x.dims.len(),
                w.dims.len(),
                y.dims.len()
            ),
        );
    }
    if x.dims.len() < 3 || x.dims.len() != g.pad.len() + 2 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {xn} has {} dims, the convolution {} spatial dims",
                x.dims.len(),
                g.pad.len()
            ),
        );
    }
    if x.dtype != w.dtype || x.dtype != y.dtype {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: the data types differ: {xn} {}, {wn} {}, {yn} {}",
                dtype_name(x.dtype),
                dtype_name(w.dtype),
                dtype_name(y.dtype)
            ),
        );
    }
    Ok(())
}

/// Checks the filter count against the groups and `y`'s shape against the convolution of `x`
/// by `w`, and that the convolution is one the emulator runs (2-d).
fn check_output(
    name: &str,
    (xn, wn, yn): (&str, &str, &str),
    x: &TensorDesc,
    w: &FilterDesc,
    y: &TensorDesc,
    c: &ConvDesc,
    g: &ConvGeometry,
) -> Result<(), Status> {
    let k = w.dims[0];
    if !k.is_multiple_of(c.groups) {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {wn} has {k} filters, not a multiple of the {} groups",
                c.groups
            ),
        );
    }
    let expected = output_dims(name, x, w, c)?;
    if y.dims[0] != x.dims[0] || y.dims[1] != k {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {yn} is {:?}, but {xn} {:?} and {wn} {:?} give [{}, {k}, …]",
                y.dims, x.dims, w.dims, x.dims[0]
            ),
        );
    }
    if y.dims[2..] != expected[2..] {
        return fail(
            S::CUDNN_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: {yn} is {:?}, but the convolution (padding {:?}, stride {:?}, dilation \
                 {:?}) of {xn} {:?} by {wn} {:?} gives {expected:?}",
                y.dims, g.pad, g.stride, g.dilation, x.dims, w.dims
            ),
        );
    }
    if x.dims.len() != 4 {
        return fail(
            S::CUDNN_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: {}-d convolutions are not emulated",
                x.dims.len() - 2
            ),
        );
    }
    Ok(())
}

/// The element type of a convolution with `data` tensors and `compute` arithmetic, for the
/// combinations cuDNN supports.
fn element_type(name: &str, data: u32, compute: u32) -> Result<Elem, Status> {
    match (data, compute) {
        (0, 0) => Ok(Elem::F32),
        (1, 1) => Ok(Elem::F64),
        (2, 0 | 2) => Ok(Elem::F16),
        (9, 0) => Ok(Elem::BF16),
        _ => fail(
            S::CUDNN_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: {} data with {} compute is not supported (f32/f32, f64/f64, \
                 f16/f16 or f32, bf16/f32 are)",
                dtype_name(data),
                dtype_name(compute)
            ),
        ),
    }
}

fn dtype_name(dtype: u32) -> String {
    match dtype {
        0 => "CUDNN_DATA_FLOAT".into(),
        1 => "CUDNN_DATA_DOUBLE".into(),
        2 => "CUDNN_DATA_HALF".into(),
        9 => "CUDNN_DATA_BFLOAT16".into(),
        other => format!("cudnnDataType_t {other}"),
    }
}

/// The algorithm numbered `algo` for `pass`, or BAD_PARAM for a value that is none.
fn algo_of(name: &str, pass: Pass, algo: u32) -> Result<Algo, Status> {
    match Algo::new(pass, algo) {
        Some(a) => Ok(a),
        None => fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: {algo} is not a {}", algorithms::enum_name(pass)),
        ),
    }
}

/// The spec of `algo` for the checked problem, or NOT_SUPPORTED with cuDNN's reason.
fn spec_of(name: &str, algo: Algo, c: &Checked) -> Result<Spec, Status> {
    match algo.spec(&c.problem) {
        Ok(s) => Ok(s),
        Err(why) => fail(
            S::CUDNN_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: {} does not support this convolution: {why}",
                algo.name()
            ),
        ),
    }
}

/// The bytes each role's tensor spans.
fn spans(p: &Problem) -> [usize; 3] {
    let b = p.elem.size();
    [p.x.span() * b, p.w.span() * b, p.y.span() * b]
}

/// Checks the three data pointers: non-null, and inside one live allocation each.
fn check_buffers(name: &str, pass: Pass, p: &Problem, ptrs: [u64; 3]) -> Res {
    let (xn, wn, yn) = role_names(pass);
    let names = [xn, wn, yn].map(|n| n.trim_end_matches("Desc"));
    let dims = [p.x.dims, p.w.dims, p.y.dims];
    let strides = [p.x.strides, p.w.strides, p.y.strides];
    for (i, bytes) in spans(p).into_iter().enumerate() {
        if ptrs[i] == 0 {
            return fail(
                S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
                format!("{name}: the data pointer {} is null", names[i]),
            );
        }
        check_range(ptrs[i], bytes, || {
            format!(
                "{name}: tensor {} (dims {:?}, strides {:?}, {bytes} bytes)",
                names[i], dims[i], strides[i]
            )
        })?;
    }
    Ok(())
}

/// Reads a host scalar of the compute type.
unsafe fn scalar(name: &str, what: &str, p: *const c_void, double: bool) -> Result<f64, Status> {
    if p.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: {what} is null"),
        );
    }
    // SAFETY: a host scalar of the compute type (cuDNN's contract).
    Ok(unsafe {
        if double {
            p.cast::<f64>().read_unaligned()
        } else {
            p.cast::<f32>().read_unaligned() as f64
        }
    })
}

/// Counts a convolution in the driver's counters.
fn count(pass: Pass) -> Res {
    driver()?.count_dnn(pass as u32);
    Ok(())
}

/// Fills `bytes` at `ptr` on the worker, as an algorithm's workspace use would.
///
/// # Safety
/// The range lies in a device allocation (checked at the call).
unsafe fn touch_workspace(ptr: u64, bytes: usize) {
    if bytes > 0 {
        // SAFETY: the caller's range.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0x5a, bytes) };
    }
}

// ---- Convolutions: running --------------------------------------------------------------------

/// The arguments of a pass call, by role (see [`Descs`]).
struct Run {
    handle: *mut c_void,
    descs: Descs,
    ptrs: [u64; 3],
    algo: u32,
    workspace: u64,
    workspace_bytes: usize,
    alpha: *const c_void,
    beta: *const c_void,
}

fn run(name: &str, pass: Pass, r: Run) -> Res {
    let stream = stream_of(name, r.handle)?;
    let c = check(name, pass, &r.descs)?;
    let algo = algo_of(name, pass, r.algo)?;
    let spec = spec_of(name, algo, &c)?;
    if let Some(why) = algorithms::misaligned(&spec, r.ptrs) {
        return fail(
            S::CUDNN_STATUS_NOT_SUPPORTED,
            format!(
                "{name}: {} does not support these buffers: {why}",
                algo.name()
            ),
        );
    }
    if r.workspace_bytes < spec.workspace {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {} needs {} bytes of workspace, {} given",
                algo.name(),
                spec.workspace,
                r.workspace_bytes
            ),
        );
    }
    if spec.workspace > 0 && r.workspace == 0 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!(
                "{name}: {} needs {} bytes of workspace, and the workspace is null",
                algo.name(),
                spec.workspace
            ),
        );
    }
    check_buffers(name, pass, &c.problem, r.ptrs)?;
    if r.workspace != 0 {
        check_range(r.workspace, r.workspace_bytes, || {
            format!("{name}: the workspace ({} bytes)", r.workspace_bytes)
        })?;
    }
    // SAFETY: the caller's scalars.
    let alpha = unsafe { scalar(name, "alpha", r.alpha, c.double) }?;
    // SAFETY: as above.
    let beta = unsafe { scalar(name, "beta", r.beta, c.double) }?;
    count(pass)?;
    let call = Call {
        pass,
        problem: c.problem,
        x: r.ptrs[0],
        w: r.ptrs[1],
        y: r.ptrs[2],
        alpha,
        beta,
    };
    let (workspace, needed) = (r.workspace, spec.workspace);
    enqueue(
        name,
        stream,
        Box::new(move || {
            // SAFETY: every tensor and the workspace were checked to lie in live allocations at
            // the call; a buffer freed since then stays mapped (in the driver's quarantine), as
            // on a GPU, where such a race reads or writes freed memory.
            unsafe {
                touch_workspace(workspace, needed);
                reference::run(&call)
            }
        }),
    )
}

/// One entry of a ranking, laid out as `cudnnConvolution*AlgoPerf_t`, with its enums as plain
/// integers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Perf {
    /// The algorithm (the pass's `cudnnConvolution…Algo_t`).
    pub algo: u32,
    /// `CUDNN_STATUS_SUCCESS`, or `CUDNN_STATUS_NOT_SUPPORTED` for this problem.
    pub status: u32,
    /// Milliseconds: estimated (heuristics) or measured and scaled (search); -1 when not
    /// supported.
    pub time: f32,
    /// Workspace bytes it needs.
    pub memory: usize,
    /// `cudnnDeterminism_t`.
    pub determinism: u32,
    /// `cudnnMathType_t` (the descriptor's).
    pub math_type: u32,
    /// Zero.
    pub reserved: [c_int; 3],
}

const _: () = {
    assert!(
        std::mem::size_of::<Perf>() == std::mem::size_of::<sys::cudnnConvolutionFwdAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<Perf>()
            == std::mem::size_of::<sys::cudnnConvolutionBwdDataAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<Perf>()
            == std::mem::size_of::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>()
    );
};

/// Writes `ranked` (best first) into the caller's results.
unsafe fn write_ranking(
    name: &str,
    ranked: &[Perf],
    requested: c_int,
    returned: *mut c_int,
    results: *mut Perf,
) -> Res {
    let n = (requested.max(0) as usize).min(ranked.len());
    if results.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: perfResults is null"),
        );
    }
    // SAFETY: out-parameters; `results` holds `requested` entries.
    unsafe {
        put(name, "returnedAlgoCount", returned, n as c_int)?;
        for (i, p) in ranked[..n].iter().enumerate() {
            results.add(i).write(*p);
        }
    }
    Ok(())
}

fn check_requested(name: &str, requested: c_int, returned: *mut c_int) -> Res {
    if requested < 1 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: requestedAlgoCount = {requested} is below 1"),
        );
    }
    if returned.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: returnedAlgoCount is null"),
        );
    }
    Ok(())
}

unsafe fn heuristic(
    name: &str,
    pass: Pass,
    handle: *mut c_void,
    descs: Descs,
    requested: c_int,
    returned: *mut c_int,
    results: *mut Perf,
) -> Res {
    stream_of(name, handle)?;
    check_requested(name, requested, returned)?;
    let c = check(name, pass, &descs)?;
    let ranked = algorithms::rank(pass, &c.problem, c.math, None);
    // SAFETY: forwarded.
    unsafe { write_ranking(name, &ranked, requested, returned, results) }
}

unsafe fn find(
    name: &str,
    pass: Pass,
    handle: *mut c_void,
    descs: Descs,
    ptrs: [u64; 3],
    requested: c_int,
    returned: *mut c_int,
    results: *mut Perf,
    workspace: u64,
    workspace_bytes: usize,
) -> Res {
    let stream = stream_of(name, handle)?;
    check_requested(name, requested, returned)?;
    if results.is_null() {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
            format!("{name}: perfResults is null"),
        );
    }
    let c = check(name, pass, &descs)?;
    if workspace == 0 && workspace_bytes > 0 {
        return fail(
            S::CUDNN_STATUS_BAD_PARAM,
            format!("{name}: workSpaceSizeInBytes = {workspace_bytes}, and the workspace is null"),
        );
    }
    check_buffers(name, pass, &c.problem, ptrs)?;
    if workspace != 0 {
        check_range(workspace, workspace_bytes, || {
            format!("{name}: the workspace ({workspace_bytes} bytes)")
        })?;
    }
    count(pass)?;
    // cuDNN runs every algorithm; the emulator runs the pass once (they all compute the same)
    // and scales its time per algorithm.
    let call = Call {
        pass,
        problem: c.problem,
        x: ptrs[0],
        w: ptrs[1],
        y: ptrs[2],
        alpha: 1.0,
        beta: 0.0,
    };
    let elapsed = Arc::new(Mutex::new(None::<f64>));
    let done = Arc::clone(&elapsed);
    enqueue(
        name,
        stream,
        Box::new(move || {
            let start = std::time::Instant::now();
            // SAFETY: as for a pass: the ranges were checked at the call, and the search is
            // synchronous (the caller's buffers outlive it).
            unsafe {
                touch_workspace(workspace, workspace_bytes);
                reference::run(&call)
            };
            *done.lock() = Some(start.elapsed().as_secs_f64() * 1e3);
        }),
    )?;
    let code = driver()?.synchronize(stream);
    if code != 0 {
        return fail(
            S::CUDNN_STATUS_EXECUTION_FAILED,
            format!("{name}: synchronising the handle's stream failed (CUresult {code})"),
        );
    }
    let ms = elapsed.lock().unwrap_or(0.0).max(1e-3);
    let ranked = algorithms::rank(pass, &c.problem, c.math, Some((ms, ptrs, workspace_bytes)));
    // SAFETY: forwarded.
    unsafe { write_ranking(name, &ranked, requested, returned, results) }
}

unsafe fn workspace_size(
    name: &str,
    pass: Pass,
    handle: *mut c_void,
    descs: Descs,
    algo: u32,
    size: *mut usize,
) -> Res {
    stream_of(name, handle)?;
    let c = check(name, pass, &descs)?;
    let algo = algo_of(name, pass, algo)?;
    // Asking for the workspace of every algorithm, to learn which apply, is how a search
    // starts (tandem's does): a refusal here is kept for `cudnnGetLastErrorString` only, not
    // printed.
    let spec = match algo.spec(&c.problem) {
        Ok(s) => s,
        Err(why) => {
            *LAST.lock() = format!(
                "{name}: {} does not support this convolution: {why}",
                algo.name()
            );
            return Err(S::CUDNN_STATUS_NOT_SUPPORTED);
        }
    };
    // SAFETY: out-parameter.
    unsafe { put(name, "sizeInBytes", size, spec.workspace) }
}

fn max_count(name: &str, handle: *mut c_void, count: *mut c_int, pass: Pass) -> Res {
    stream_of(name, handle)?;
    // SAFETY: out-parameter.
    unsafe { put(name, "count", count, algorithms::count(pass) as c_int) }
}

// ---- Convolutions: entry points ---------------------------------------------------------------

/// `[x, w, y]` from a pass's two inputs and its output, in the order its entry points take them:
/// forward `x, w -> y`, backward data `w, dy -> dx`, backward filter `x, dy -> dw`.
fn arrange<T>(pass: Pass, [a, b]: [T; 2], output: T) -> [T; 3] {
    match pass {
        Pass::Forward => [a, b, output],
        Pass::BackwardData => [output, a, b],
        Pass::BackwardFilter => [a, output, b],
    }
}

impl Descs {
    /// A pass's descriptors as its entry points take them (see [`arrange`]).
    fn of(pass: Pass, inputs: [*mut c_void; 2], conv: *mut c_void, output: *mut c_void) -> Self {
        let [x, w, y] = arrange(pass, inputs, output);
        Descs { x, w, conv, y }
    }
}

/// The five entry points of each pass, whose C signatures differ between passes only in which
/// tensors are the inputs and which the output ([`arrange`]): the algorithms' count,
/// `Get…Algorithm_v7` (the heuristic), `Find…AlgorithmEx` (timed), the workspace size, and the
/// convolution itself.
macro_rules! pass_entry_points {
    ($($pass:expr => $max_count:ident, $v7:ident, $find:ident, $workspace_size:ident, $run:ident;)*) => {$(
        #[doc = concat!("Emulates `", stringify!($max_count), "`: the number of algorithms the \
            emulator offers for the pass (see [`algorithms`]).")]
        #[no_mangle]
        pub unsafe extern "C" fn $max_count(h: *mut c_void, count: *mut c_int) -> Status {
            let name = stringify!($max_count);
            entry(name, || max_count(name, h, count, $pass))
        }

        #[doc = concat!("Emulates `", stringify!($v7), "`: the emulator's algorithms ranked \
            by an estimate from the multiply-adds (addresses are not seen; see [`algorithms`]).")]
        #[no_mangle]
        pub unsafe extern "C" fn $v7(
            h: *mut c_void,
            a: *mut c_void,
            b: *mut c_void,
            c: *mut c_void,
            output: *mut c_void,
            requested: c_int,
            returned: *mut c_int,
            results: *mut Perf,
        ) -> Status {
            let name = stringify!($v7);
            let descs = Descs::of($pass, [a, b], c, output);
            // SAFETY: the caller's arguments (cuDNN's contract).
            entry(name, || unsafe {
                heuristic(name, $pass, h, descs, requested, returned, results)
            })
        }

        #[doc = concat!("Emulates `", stringify!($find), "`: runs the pass once, synchronously \
            (writing the output), and ranks the algorithms that fit the buffers and the \
            workspace by that time scaled per algorithm (cuDNN runs each one).")]
        #[no_mangle]
        pub unsafe extern "C" fn $find(
            h: *mut c_void,
            a_desc: *mut c_void,
            a: *const c_void,
            b_desc: *mut c_void,
            b: *const c_void,
            c: *mut c_void,
            output_desc: *mut c_void,
            output: *mut c_void,
            requested: c_int,
            returned: *mut c_int,
            results: *mut Perf,
            workspace: *mut c_void,
            workspace_bytes: usize,
        ) -> Status {
            let name = stringify!($find);
            let descs = Descs::of($pass, [a_desc, b_desc], c, output_desc);
            let ptrs = arrange($pass, [a as u64, b as u64], output as u64);
            // SAFETY: the caller's arguments (cuDNN's contract).
            entry(name, || unsafe {
                find(
                    name,
                    $pass,
                    h,
                    descs,
                    ptrs,
                    requested,
                    returned,
                    results,
                    workspace as u64,
                    workspace_bytes,
                )
            })
        }

        #[doc = concat!("Emulates `", stringify!($workspace_size), "`: the emulator's own \
            workspace size for the algorithm (not a GPU's); an algorithm that does not apply is \
            `CUDNN_STATUS_NOT_SUPPORTED`, kept for `cudnnGetLastErrorString` but not printed.")]
        #[no_mangle]
        pub unsafe extern "C" fn $workspace_size(
            h: *mut c_void,
            a: *mut c_void,
            b: *mut c_void,
            c: *mut c_void,
            output: *mut c_void,
            algo: u32,
            size: *mut usize,
        ) -> Status {
            let name = stringify!($workspace_size);
            let descs = Descs::of($pass, [a, b], c, output);
            // SAFETY: the caller's arguments (cuDNN's contract).
            entry(name, || unsafe {
                workspace_size(name, $pass, h, descs, algo, size)
            })
        }

        #[doc = concat!("Emulates `", stringify!($run), "`: checks the descriptors, buffers, \
            algorithm and workspace (see the crate docs) and runs [`mod@reference`] on the \
            handle's stream's worker, which also overwrites the workspace the algorithm needs.")]
        #[no_mangle]
        pub extern "C" fn $run(
            h: *mut c_void,
            alpha: *const c_void,
            a_desc: *mut c_void,
            a: *const c_void,
            b_desc: *mut c_void,
            b: *const c_void,
            c: *mut c_void,
            algo: u32,
            workspace: *mut c_void,
            workspace_bytes: usize,
            beta: *const c_void,
            output_desc: *mut c_void,
            output: *mut c_void,
        ) -> Status {
            let name = stringify!($run);
            let r = Run {
                handle: h,
                descs: Descs::of($pass, [a_desc, b_desc], c, output_desc),
                ptrs: arrange($pass, [a as u64, b as u64], output as u64),
                algo,
                workspace: workspace as u64,
                workspace_bytes,
                alpha,
                beta,
            };
            entry(name, || run(name, $pass, r))
        }
    )*};
}

pass_entry_points! {
    Pass::Forward => cudnnGetConvolutionForwardAlgorithmMaxCount,
        cudnnGetConvolutionForwardAlgorithm_v7, cudnnFindConvolutionForwardAlgorithmEx,
        cudnnGetConvolutionForwardWorkspaceSize, cudnnConvolutionForward;
    Pass::BackwardData => cudnnGetConvolutionBackwardDataAlgorithmMaxCount,
        cudnnGetConvolutionBackwardDataAlgorithm_v7, cudnnFindConvolutionBackwardDataAlgorithmEx,
        cudnnGetConvolutionBackwardDataWorkspaceSize, cudnnConvolutionBackwardData;
    Pass::BackwardFilter => cudnnGetConvolutionBackwardFilterAlgorithmMaxCount,
        cudnnGetConvolutionBackwardFilterAlgorithm_v7,
        cudnnFindConvolutionBackwardFilterAlgorithmEx,
        cudnnGetConvolutionBackwardFilterWorkspaceSize, cudnnConvolutionBackwardFilter;
}
