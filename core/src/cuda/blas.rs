//! cuBLAS for matrix products: one handle per device (created on first use, behind a lock,
//! bound to the stream of each call), and the TF32 setting.
//!
//! TF32 (the tensor cores' 10-bit-mantissa mode for f32 products) is off by default for matrix
//! products, as in PyTorch (`torch.backends.cuda.matmul.allow_tf32 = False`): results then match
//! the CPU to f32 rounding. [`set_allow_tf32_matmul`] turns it on for speed. Convolutions have
//! their own setting, on by default as in PyTorch ([`set_allow_tf32_conv`]).
//!
//! f16/bf16 products (`cublasGemmEx` with `CUBLAS_COMPUTE_32F`) run under [`LOW_PRECISION_MATH`]:
//! tensor cores as cuBLAS chooses, but every reduction in f32, split-K partial sums included
//! (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`), so that the only rounding to the low
//! dtype is the final one, as on the CPU.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cudarc::cublas::{result as cublas, sys};
use cudarc::driver::CudaStream;
use parking_lot::Mutex;

use super::device::{CudaDevice, Handle, MAX_DEVICES};
use super::libs::{self, CudaLibrary};
use crate::{Error, Result};

static ALLOW_TF32_MATMUL: AtomicBool = AtomicBool::new(false);
static ALLOW_TF32_CONV: AtomicBool = AtomicBool::new(true);

/// Allows (or forbids) TF32 tensor-core math in f32 matrix products (default: forbidden).
pub fn set_allow_tf32_matmul(allow: bool) {
    ALLOW_TF32_MATMUL.store(allow, Ordering::Relaxed);
}

/// Whether f32 matrix products may use TF32.
pub fn allow_tf32_matmul() -> bool {
    ALLOW_TF32_MATMUL.load(Ordering::Relaxed)
}

/// Allows (or forbids) TF32 in f32 convolutions (default: allowed, as in PyTorch).
pub fn set_allow_tf32_conv(allow: bool) {
    ALLOW_TF32_CONV.store(allow, Ordering::Relaxed);
}

/// Whether f32 convolutions may use TF32.
pub fn allow_tf32_conv() -> bool {
    ALLOW_TF32_CONV.load(Ordering::Relaxed)
}

/// The math mode of f16/bf16 products: the default math (tensor cores allowed) with reduced
/// precision reductions forbidden, so split-K sums stay in f32 (`CUBLAS_DEFAULT_MATH | 16`).
pub const LOW_PRECISION_MATH: sys::cublasMath_t =
    sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;

struct BlasHandle {
    handle: Handle<sys::cublasHandle_t>,
    math: sys::cublasMath_t,
}

static HANDLES: [OnceLock<Mutex<BlasHandle>>; MAX_DEVICES] =
    [const { OnceLock::new() }; MAX_DEVICES];
static CREATING: Mutex<()> = Mutex::new(());

fn blas_err(op: &'static str, dev: &CudaDevice) -> impl Fn(cublas::CublasError) -> Error {
    let device = dev.device();
    move |e| Error::Cuda {
        op,
        device,
        detail: format!("cuBLAS: {:?}", e.0),
    }
}

fn handle_of(op: &'static str, dev: &CudaDevice) -> Result<&'static Mutex<BlasHandle>> {
    let slot = &HANDLES[dev.ordinal()];
    if let Some(h) = slot.get() {
        return Ok(h);
    }
    let _creating = CREATING.lock();
    if let Some(h) = slot.get() {
        return Ok(h);
    }
    libs::ensure(CudaLibrary::CublasLt, dev.device())?;
    libs::ensure(CudaLibrary::Cublas, dev.device())?;
    dev.bind(op)?;
    let handle = cublas::create_handle().map_err(blas_err(op, dev))?;
    let _ = slot.set(Mutex::new(BlasHandle {
        handle: Handle(handle),
        math: sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
    }));
    Ok(slot.get().expect("just set"))
}

/// Runs `f` with the device's cuBLAS handle bound to `stream` and the math mode set from the
/// TF32 setting (`tf32` says whether this call is one that may use it).
pub fn with_blas<R>(
    op: &'static str,
    dev: &CudaDevice,
    stream: &CudaStream,
    tf32: bool,
    f: impl FnOnce(sys::cublasHandle_t) -> std::result::Result<R, cublas::CublasError>,
) -> Result<R> {
    let math = if tf32 {
        sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
    } else {
        sys::cublasMath_t::CUBLAS_DEFAULT_MATH
    };
    with_blas_math(op, dev, stream, math, f)
}

/// Runs `f` with the device's cuBLAS handle bound to `stream` and the math mode `math` (set only
/// when the handle's current mode differs): [`LOW_PRECISION_MATH`] for f16/bf16 products.
pub fn with_blas_math<R>(
    op: &'static str,
    dev: &CudaDevice,
    stream: &CudaStream,
    math: sys::cublasMath_t,
    f: impl FnOnce(sys::cublasHandle_t) -> std::result::Result<R, cublas::CublasError>,
) -> Result<R> {
    let mut guard = handle_of(op, dev)?.lock();
    dev.bind(op)?;
    let handle = guard.handle.0;
    // SAFETY: the handle belongs to this device's context (current); the stream is one of its
    // streams (cuBLAS's stream type is the runtime alias of the driver's).
    unsafe { cublas::set_stream(handle, stream.cu_stream().cast()) }.map_err(blas_err(op, dev))?;
    if guard.math != math {
        // SAFETY: a valid handle and mode.
        unsafe { sys::cublasSetMathMode(handle, math) }
            .result()
            .map_err(blas_err(op, dev))?;
        guard.math = math;
    }
    f(handle).map_err(blas_err(op, dev))
}
