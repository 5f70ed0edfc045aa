//! The device (one, `sm_90`, with an H100's limits) and its primary context.

use std::cell::Cell;
use std::ffi::c_char;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use cudarc::driver::sys;
use sys::cudaError_enum as E;
use sys::CUdevice_attribute as A;

use crate::{entry, initialised, put, CUresult, Res};

/// The device's name, as `cuDeviceGetName` reports it.
pub const DEVICE_NAME: &str = "tandem-cuda-emu (emulated NVIDIA H100 80GB HBM3)";
/// Device memory the emulated device reports (80 GiB, an H100's).
pub const TOTAL_MEMORY: usize = 80 << 30;
/// Dynamic shared memory a block may use without opting in.
pub const DEFAULT_SHARED_PER_BLOCK: i32 = 48 << 10;
/// Shared memory a block may use after opting in (`cuFuncSetAttribute`).
pub const MAX_SHARED_PER_BLOCK_OPTIN: i32 = 227 << 10;

/// The attributes the emulated device reports: an H100 SXM's.
const ATTRIBUTES: &[(A, i32)] = &[
    (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, i32::MAX),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535),
    (A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
        DEFAULT_SHARED_PER_BLOCK,
    ),
    (A::CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY, 65536),
    (A::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32),
    (A::CU_DEVICE_ATTRIBUTE_MAX_PITCH, i32::MAX),
    (A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, 65536),
    (A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 1_980_000),
    (A::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT, 512),
    (A::CU_DEVICE_ATTRIBUTE_GPU_OVERLAP, 1),
    (A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 132),
    (A::CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT, 0),
    (A::CU_DEVICE_ATTRIBUTE_INTEGRATED, 0),
    (A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, 0),
    (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS, 1),
    (A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED, 1),
    (A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 0),
    (A::CU_DEVICE_ATTRIBUTE_TCC_DRIVER, 0),
    (A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, 2_619_000),
    (A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, 5120),
    (A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, 50 << 20),
    (A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 2048),
    (A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 3),
    (A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
    (A::CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        228 << 10,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
        65536,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1),
    (A::CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO,
        2,
    ),
    (A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS, 0),
    (A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, 1),
    (A::CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
        1,
    ),
    (A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        MAX_SHARED_PER_BLOCK_OPTIN,
    ),
    (A::CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, 0),
    (A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES,
        0,
    ),
    (
        A::CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST,
        0,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, 0),
    (A::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE, 0),
    (
        A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
        1024,
    ),
    (A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, 32),
    (A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, 1),
    (A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, 0),
    (A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, 1),
    (
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        0,
    ),
];

/// The value of attribute `attrib` (its number), if the emulator reports it.
pub fn attribute(attrib: u32) -> Option<i32> {
    ATTRIBUTES
        .iter()
        .find(|(a, _)| *a as u32 == attrib)
        .map(|&(_, v)| v)
}

fn device(ordinal: i32) -> Res {
    initialised()?;
    if ordinal == 0 {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_INVALID_DEVICE)
    }
}

/// Emulates `cuDeviceGetCount`: always one device.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut i32) -> CUresult {
    entry("cuDeviceGetCount", || {
        initialised()?;
        // SAFETY: out-parameter.
        unsafe { put(count, 1) }
    })
}

/// Emulates `cuDeviceGet`: ordinal 0 is the one device; any other is `CUDA_ERROR_INVALID_DEVICE`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(out: *mut i32, ordinal: i32) -> CUresult {
    entry("cuDeviceGet", || {
        device(ordinal)?;
        // SAFETY: out-parameter.
        unsafe { put(out, ordinal) }
    })
}

/// Emulates `cuDeviceGetAttribute` with an H100 SXM's values; an attribute outside the emulator's
/// table is `CUDA_ERROR_NOT_SUPPORTED` (with a message).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(out: *mut i32, attrib: u32, dev: i32) -> CUresult {
    entry("cuDeviceGetAttribute", || {
        device(dev)?;
        match attribute(attrib) {
            // SAFETY: out-parameter.
            Some(v) => unsafe { put(out, v) },
            None => {
                crate::say(&format!(
                    "cuDeviceGetAttribute: attribute {attrib} is not emulated"
                ));
                Err(E::CUDA_ERROR_NOT_SUPPORTED)
            }
        }
    })
}

/// Emulates `cuDeviceGetName`: [`DEVICE_NAME`], truncated to the buffer.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: i32) -> CUresult {
    entry("cuDeviceGetName", || {
        device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let n = DEVICE_NAME.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(DEVICE_NAME.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

/// Emulates `cuDeviceTotalMem_v2`: [`TOTAL_MEMORY`] (80 GiB), whatever the host has.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> CUresult {
    entry("cuDeviceTotalMem_v2", || {
        device(dev)?;
        // SAFETY: out-parameter.
        unsafe { put(bytes, TOTAL_MEMORY) }
    })
}

/// The emulated device's UUID: fixed, and spelling "tandem-cuda-emu!".
const UUID: [u8; 16] = *b"tandem-cuda-emu!";

/// Emulates `cuDeviceGetUuid`: a fixed UUID, the bytes of "tandem-cuda-emu!".
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut sys::CUuuid, dev: i32) -> CUresult {
    entry("cuDeviceGetUuid", || {
        device(dev)?;
        // SAFETY: out-parameter; CUuuid is 16 bytes.
        unsafe { put(uuid.cast::<[u8; 16]>(), UUID) }
    })
}

/// Emulates `cuDeviceGetUuid_v2`: as [`cuDeviceGetUuid`].
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut sys::CUuuid, dev: i32) -> CUresult {
    // SAFETY: forwarded.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// Emulates `cuDeviceGetPCIBusId`: always `0000:00:00.0`; a buffer shorter than that is
/// `CUDA_ERROR_INVALID_VALUE` (no truncation).
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: i32, dev: i32) -> CUresult {
    entry("cuDeviceGetPCIBusId", || {
        device(dev)?;
        let id = b"0000:00:00.0\0";
        if bus.is_null() || (len as usize) < id.len() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds `len` bytes, at least the id's.
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), bus.cast::<u8>(), id.len()) };
        Ok(())
    })
}

/// The primary context of the one device. Its address is the `CUcontext` handle.
pub struct Context {
    retained: AtomicI64,
    flags: AtomicU32,
}

/// The one primary context; its address is the handle [`primary`] returns.
pub static PRIMARY: Context = Context {
    retained: AtomicI64::new(0),
    flags: AtomicU32::new(0),
};

/// The primary context's handle.
pub fn primary() -> sys::CUcontext {
    &PRIMARY as *const Context as sys::CUcontext
}

thread_local! {
    /// The context current on this thread (null: none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// Fails with `CUDA_ERROR_INVALID_CONTEXT` unless a context is current on this thread, as the
/// driver does for every call that works in a context.
pub fn current() -> Res {
    initialised()?;
    if CURRENT.with(Cell::get) == primary() as usize {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_INVALID_CONTEXT)
    }
}

/// Emulates `cuDevicePrimaryCtxRetain`: counts a retain of the one primary context and returns its
/// handle.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut sys::CUcontext, dev: i32) -> CUresult {
    entry("cuDevicePrimaryCtxRetain", || {
        device(dev)?;
        PRIMARY.retained.fetch_add(1, Ordering::AcqRel);
        // SAFETY: out-parameter.
        unsafe { put(ctx, primary()) }
    })
}

fn release(dev: i32) -> Res {
    device(dev)?;
    let before = PRIMARY.retained.fetch_sub(1, Ordering::AcqRel);
    if before <= 0 {
        PRIMARY.retained.fetch_add(1, Ordering::AcqRel);
        crate::say("cuDevicePrimaryCtxRelease: the primary context was not retained");
        return Err(E::CUDA_ERROR_INVALID_CONTEXT);
    }
    Ok(())
}

/// Emulates `cuDevicePrimaryCtxRelease_v2`: counts a release; releasing more often than retaining
/// is `CUDA_ERROR_INVALID_CONTEXT`. Nothing is freed when the count reaches 0.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: i32) -> CUresult {
    entry("cuDevicePrimaryCtxRelease_v2", || release(dev))
}

/// Emulates `cuDevicePrimaryCtxRelease`: as [`cuDevicePrimaryCtxRelease_v2`].
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: i32) -> CUresult {
    entry("cuDevicePrimaryCtxRelease", || release(dev))
}

/// Emulates `cuDevicePrimaryCtxGetState`: the stored flags, and active while the context is
/// retained.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: i32,
    flags: *mut u32,
    active: *mut i32,
) -> CUresult {
    entry("cuDevicePrimaryCtxGetState", || {
        device(dev)?;
        // SAFETY: out-parameters.
        unsafe {
            put(flags, PRIMARY.flags.load(Ordering::Acquire))?;
            put(
                active,
                (PRIMARY.retained.load(Ordering::Acquire) > 0) as i32,
            )
        }
    })
}

/// Emulates `cuDevicePrimaryCtxSetFlags_v2`: stores the flags (any value; they change nothing).
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: i32, flags: u32) -> CUresult {
    entry("cuDevicePrimaryCtxSetFlags_v2", || {
        device(dev)?;
        PRIMARY.flags.store(flags, Ordering::Release);
        Ok(())
    })
}

/// Emulates `cuCtxSetCurrent` for this thread: the primary context or null; any other handle is
/// `CUDA_ERROR_INVALID_CONTEXT`.
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: sys::CUcontext) -> CUresult {
    entry("cuCtxSetCurrent", || {
        initialised()?;
        if !ctx.is_null() && ctx != primary() {
            return Err(E::CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(ctx as usize));
        Ok(())
    })
}

/// Emulates `cuCtxGetCurrent`: this thread's current context (null when none).
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut sys::CUcontext) -> CUresult {
    entry("cuCtxGetCurrent", || {
        initialised()?;
        // SAFETY: out-parameter.
        unsafe { put(ctx, CURRENT.with(Cell::get) as sys::CUcontext) }
    })
}

/// Emulates `cuCtxGetDevice`: device 0, once a context is current.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut i32) -> CUresult {
    entry("cuCtxGetDevice", || {
        current()?;
        // SAFETY: out-parameter.
        unsafe { put(dev, 0) }
    })
}

/// Emulates `cuCtxGetFlags`: the primary context's stored flags.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut u32) -> CUresult {
    entry("cuCtxGetFlags", || {
        current()?;
        // SAFETY: out-parameter.
        unsafe { put(flags, PRIMARY.flags.load(Ordering::Acquire)) }
    })
}

/// Emulates `cuCtxSetFlags`: stores the flags (any value; they change nothing).
#[no_mangle]
pub extern "C" fn cuCtxSetFlags(flags: u32) -> CUresult {
    entry("cuCtxSetFlags", || {
        current()?;
        PRIMARY.flags.store(flags, Ordering::Release);
        Ok(())
    })
}

/// Emulates `cuCtxGetStreamPriorityRange`: least 0, greatest -5; either pointer
/// may be null.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut i32,
    greatest: *mut i32,
) -> CUresult {
    entry("cuCtxGetStreamPriorityRange", || {
        current()?;
        // SAFETY: out-parameters (either may be null, per the driver's documentation).
        unsafe {
            if !least.is_null() {
                *least = 0;
            }
            if !greatest.is_null() {
                *greatest = -5;
            }
        }
        Ok(())
    })
}

/// Emulates `cuCtxSynchronize`: waits for every stream's work, counted as a host synchronisation in
/// the counters.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    entry("cuCtxSynchronize", || {
        current()?;
        crate::counters::host_sync(crate::counters::Counter::context_syncs, "cuCtxSynchronize");
        crate::stream::synchronize_all()
    })
}
