//! Modules from the emulated NVRTC, and kernel launches on the streams' workers.
//!
//! Launches of different streams run at the same time, as on a GPU: each runs on its stream's
//! worker, with its own state and its own crew of threads in the execution model
//! (cuda-harness/include/tandem_host.h). Launches of one stream stay in order (one worker).
//! Two launches of the same kernel (by name) never overlap: its `__shared__` variables are
//! `static` in the host build, one copy per kernel, so a launch of kernel K waits for the
//! running launch of K on another stream (`Function::running`). A kernel that spins until
//! another stream's kernel or the host writes a flag therefore finishes instead of deadlocking.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;
use sys::cudaError_enum as E;

use crate::context::{current, DEFAULT_SHARED_PER_BLOCK, MAX_SHARED_PER_BLOCK_OPTIN};
use crate::stream::lookup;
use crate::{entry, fault, put, say, sticky, CUresult};

/// The first bytes of a module image from the emulated NVRTC (`tandem-cuda-emu-nvrtc`'s
/// `MODULE_MAGIC`; kept in step by the tests, which compile through it).
const MODULE_MAGIC: &[u8; 24] = b"TANDEM-CUDA-EMU-MODULE\0\0";
/// The emulated device's architecture, `major * 10 + minor`.
const DEVICE_ARCH: u32 = 90;
/// How long a block's threads may wait at a barrier before the launch is declared stuck.
const BARRIER_TIMEOUT_MS: u32 = 20_000;
/// The most parameters a kernel may have here.
const MAX_PARAMS: usize = 256;

/// `tandem_host_launch_config` in cuda-harness/include/tandem_host.h.
#[repr(C)]
pub(crate) struct HostLaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    barrier_timeout_ms: u32,
}

type HostEntry =
    unsafe extern "C" fn(*const HostLaunchConfig, *mut *mut c_void, *mut c_char, usize) -> c_int;
type ParamSizes = unsafe extern "C" fn(*mut u64, c_int) -> c_int;
/// `tandem_emu_set_worker_hook` (tandem_emu.h): sets the execution model's worker hook.
type SetWorkerHook = unsafe extern "C" fn(Option<unsafe extern "C" fn(*const HostLaunchConfig)>);

/// What a fault report says about a running launch: the config handed to the kernel's host entry
/// is the first field, so the execution model's worker hook, which receives the config, finds
/// the rest.
#[repr(C)]
pub(crate) struct RunningLaunch {
    config: HostLaunchConfig,
    kernel: String,
    stream: u64,
}

impl RunningLaunch {
    /// "kernel k (grid [..], block [..]) on stream 3".
    pub(crate) fn describe(&self) -> String {
        format!(
            "kernel {} (grid {:?}, block {:?}) on stream {}",
            self.kernel, self.config.grid, self.config.block, self.stream
        )
    }
}

thread_local! {
    /// The launch the calling thread (a worker of the execution model) runs, or null.
    static RUNNING: std::cell::Cell<*const RunningLaunch> =
        const { std::cell::Cell::new(std::ptr::null()) };
}

/// The execution model's worker hook: every worker of a launch calls it with the launch's
/// config when it starts its share, and with null when done.
unsafe extern "C" fn worker_hook(config: *const HostLaunchConfig) {
    // The config is the first field of a RunningLaunch (see cuLaunchKernel), which outlives
    // every worker of the launch.
    RUNNING.with(|r| r.set(config.cast()));
}

/// The launch the calling thread runs, if it is a worker of one (for the SIGSEGV report; the
/// thread-local was set before the kernel ran, so reading it in a signal handler allocates
/// nothing).
pub(crate) fn running_on_this_thread() -> Option<&'static RunningLaunch> {
    let p = RUNNING.with(|r| r.get());
    // SAFETY: set by worker_hook to a RunningLaunch that lives until every worker of its launch
    // called the hook with null; this thread has not yet (it is the one asking).
    unsafe { p.as_ref() }
}

/// A loaded module: the host library of the kernels.
pub struct Module {
    library: &'static libloading::Library,
}

/// A kernel of a module.
pub struct Function {
    name: String,
    entry: HostEntry,
    params: Vec<usize>,
    max_dynamic_shared: AtomicI32,
    /// Held while a launch of this kernel runs: shared by every function of the same name (its
    /// `__shared__` variables are one static copy, see the module docs).
    running: Arc<Mutex<()>>,
}

/// One lock per kernel name (see [`Function::running`]).
fn kernel_lock(name: &str) -> Arc<Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<String, Arc<Mutex<()>>>>> = OnceLock::new();
    LOCKS
        .get_or_init(Default::default)
        .lock()
        .entry(name.to_string())
        .or_default()
        .clone()
}

fn modules() -> &'static Mutex<HashMap<usize, Arc<Module>>> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<Module>>>> = OnceLock::new();
    MODULES.get_or_init(Default::default)
}

fn functions() -> &'static Mutex<HashMap<usize, Arc<Function>>> {
    static FUNCTIONS: OnceLock<Mutex<HashMap<usize, Arc<Function>>>> = OnceLock::new();
    FUNCTIONS.get_or_init(Default::default)
}

/// Reads a module image: the architecture and the host library's bytes.
///
/// # Safety
/// `image` points to a module image (or anything starting with at least 40 readable bytes when
/// it carries the magic, and 4 otherwise).
unsafe fn parse_image<'a>(image: *const u8) -> Result<(u32, &'a [u8]), CUresult> {
    // SAFETY: every image, real or emulated, has at least 4 bytes.
    let head = unsafe { std::slice::from_raw_parts(image, 4) };
    if head == b"\x7fELF" {
        say(
            "cuModuleLoadData: this is a real CUBIN (from NVIDIA's NVRTC); the emulated driver \
             runs only modules from tandem-cuda-emu's NVRTC. Put the emulated libnvrtc in \
             TANDEM_CUDA_LIBS before the real one",
        );
        return Err(E::CUDA_ERROR_INVALID_IMAGE);
    }
    // SAFETY: an image without the ELF magic is either ours (40-byte header) or text PTX
    // (NUL-terminated, so the first 24 bytes are readable unless it is shorter; PTX is longer).
    let magic = unsafe { std::slice::from_raw_parts(image, MODULE_MAGIC.len()) };
    if magic != MODULE_MAGIC {
        say(
            "cuModuleLoadData: the image is not a module of tandem-cuda-emu's NVRTC (PTX and \
             fatbins are not emulated)",
        );
        return Err(E::CUDA_ERROR_INVALID_IMAGE);
    }
    // SAFETY: our header is 40 bytes: magic, arch (u32), reserved (u32), length (u64).
    let header = unsafe { std::slice::from_raw_parts(image, 40) };
    let arch = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(header[32..40].try_into().expect("8 bytes")) as usize;
    // SAFETY: the library's bytes follow the header, `len` of them.
    let library = unsafe { std::slice::from_raw_parts(image.add(40), len) };
    Ok((arch, library))
}

/// Loads a host library from memory (through a memfd; nothing is written to disk).
fn load_library(bytes: &[u8]) -> Result<libloading::Library, String> {
    // SAFETY: memfd_create with a static name.
    let fd = unsafe { libc::memfd_create(c"tandem-cuda-emu-module".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    let mut written = 0;
    while written < bytes.len() {
        // SAFETY: writes from a live slice to our fd.
        let n = unsafe { libc::write(fd, bytes[written..].as_ptr().cast(), bytes.len() - written) };
        if n <= 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: our fd.
            unsafe { libc::close(fd) };
            return Err(format!("writing the module: {e}"));
        }
        written += n as usize;
    }
    // The fd stays open for the life of the process: the loader knows a library by the path
    // it was opened by, so a closed fd's number, reused for the next module, would make
    // `dlopen` hand back the earlier module instead of loading the new one.
    let path = format!("/proc/self/fd/{fd}");
    // SAFETY: the library was compiled by the emulated NVRTC from tandem's kernels; its
    // initialisers only set up the execution model's statics.
    unsafe { libloading::Library::new(&path) }.map_err(|e| {
        // SAFETY: our fd, unused on failure.
        unsafe { libc::close(fd) };
        format!("{e}")
    })
}

/// Emulates `cuModuleLoadData` for images from the emulated NVRTC only (a host shared library
/// behind a tandem header, not a CUBIN or PTX): loads the library; an image for another
/// architecture than `sm_90`'s family is `CUDA_ERROR_NO_BINARY_FOR_GPU`.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(
    out: *mut sys::CUmodule,
    image: *const c_void,
) -> CUresult {
    entry("cuModuleLoadData", || {
        current()?;
        if image.is_null() || out.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a module image.
        let (arch, bytes) = unsafe { parse_image(image.cast()) }?;
        // A CUBIN runs on its own major version, on minors at least its own.
        if arch / 10 != DEVICE_ARCH / 10 || arch > DEVICE_ARCH {
            say(&format!(
                "cuModuleLoadData: the module was compiled for sm_{arch}; the emulated device is \
                 sm_{DEVICE_ARCH}"
            ));
            return Err(E::CUDA_ERROR_NO_BINARY_FOR_GPU);
        }
        let library = load_library(bytes).map_err(|e| {
            say(&format!(
                "cuModuleLoadData: loading the module's host library failed: {e}"
            ));
            E::CUDA_ERROR_INVALID_IMAGE
        })?;
        // SAFETY: tandem_emu.h defines the symbol with this type; the hook is a plain function.
        match unsafe { library.get::<SetWorkerHook>(b"tandem_emu_set_worker_hook") } {
            // SAFETY: as above.
            Ok(set) => unsafe { set(Some(worker_hook)) },
            Err(_) => {
                say(
                    "cuModuleLoadData: the module was compiled against an older tandem_host.h \
                     (it has no tandem_emu_set_worker_hook), most likely a stale entry of \
                     tandem's kernel cache: point TANDEM_KERNEL_CACHE at an empty folder (the \
                     cache's key does not cover the emulation's headers)",
                );
                return Err(E::CUDA_ERROR_INVALID_IMAGE);
            }
        }
        // Kept for the life of the process: launches in flight use its code.
        let module = Arc::new(Module {
            library: Box::leak(Box::new(library)),
        });
        let handle = Arc::as_ptr(&module) as usize;
        modules().lock().insert(handle, module);
        // SAFETY: out-parameter.
        unsafe { put(out, handle as sys::CUmodule) }
    })
}

/// Emulates `cuModuleUnload`: forgets the handle; the host library stays loaded for the life of the
/// process (launches in flight may run its code).
#[no_mangle]
pub extern "C" fn cuModuleUnload(module: sys::CUmodule) -> CUresult {
    entry("cuModuleUnload", || {
        current()?;
        // The library itself stays loaded (kernels in flight may run its code).
        modules()
            .lock()
            .remove(&(module as usize))
            .map(|_| ())
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    })
}

/// Emulates `cuModuleGetFunction`: finds the kernel's host entry point (exported by
/// `TANDEM_HOST_EXPORT`) and its parameter sizes; a kernel without them is `CUDA_ERROR_NOT_FOUND`
/// with a message.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    out: *mut sys::CUfunction,
    module: sys::CUmodule,
    name: *const c_char,
) -> CUresult {
    entry("cuModuleGetFunction", || {
        current()?;
        let module = modules()
            .lock()
            .get(&(module as usize))
            .cloned()
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        if name.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: NUL-terminated per the driver's contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let symbol = |prefix: &str| format!("{prefix}{name}");
        // SAFETY: the symbols are defined by tandem_emu.h's TANDEM_HOST_EXPORT with these types.
        let (entry_fn, sizes_fn) = unsafe {
            let e = module
                .library
                .get::<HostEntry>(symbol("tandem_host_").as_bytes())
                .map(|s| *s);
            let p = module
                .library
                .get::<ParamSizes>(symbol("tandem_emu_params_").as_bytes())
                .map(|s| *s);
            (e, p)
        };
        let (Ok(entry_fn), Ok(sizes_fn)) = (entry_fn, sizes_fn) else {
            say(&format!(
                "cuModuleGetFunction: the module has no kernel {name:?} (is it followed by \
                 TANDEM_HOST_EXPORT({name})?)"
            ));
            return Err(E::CUDA_ERROR_NOT_FOUND);
        };
        let mut sizes = vec![0u64; MAX_PARAMS];
        // SAFETY: writes at most MAX_PARAMS sizes.
        let count = unsafe { sizes_fn(sizes.as_mut_ptr(), MAX_PARAMS as c_int) };
        if count < 0 || count as usize > MAX_PARAMS {
            say(&format!(
                "cuModuleGetFunction: kernel {name} has {count} parameters"
            ));
            return Err(E::CUDA_ERROR_INVALID_IMAGE);
        }
        sizes.truncate(count as usize);
        let function = Arc::new(Function {
            running: kernel_lock(&name),
            name,
            entry: entry_fn,
            params: sizes.into_iter().map(|s| s as usize).collect(),
            max_dynamic_shared: AtomicI32::new(DEFAULT_SHARED_PER_BLOCK),
        });
        let handle = Arc::as_ptr(&function) as usize;
        functions().lock().insert(handle, function);
        // SAFETY: out-parameter.
        unsafe { put(out, handle as sys::CUfunction) }
    })
}

fn function(f: sys::CUfunction) -> Result<Arc<Function>, CUresult> {
    functions()
        .lock()
        .get(&(f as usize))
        .cloned()
        .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

use sys::CUfunction_attribute as FA;

/// Emulates `cuFuncGetAttribute` for a few attributes, with fixed values (1024 threads, 32
/// registers, no static shared/constant/local memory, version 90) and the dynamic shared memory
/// limit as set; others are `CUDA_ERROR_NOT_SUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    out: *mut i32,
    attrib: u32,
    f: sys::CUfunction,
) -> CUresult {
    entry("cuFuncGetAttribute", || {
        current()?;
        let f = function(f)?;
        let value = match attrib {
            a if a == FA::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK as u32 => 1024,
            a if a == FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES as u32 => 0,
            a if a == FA::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES as u32 => 0,
            a if a == FA::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES as u32 => 0,
            a if a == FA::CU_FUNC_ATTRIBUTE_NUM_REGS as u32 => 32,
            a if a == FA::CU_FUNC_ATTRIBUTE_PTX_VERSION as u32 => 90,
            a if a == FA::CU_FUNC_ATTRIBUTE_BINARY_VERSION as u32 => 90,
            a if a == FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as u32 => {
                f.max_dynamic_shared.load(Ordering::Acquire)
            }
            _ => {
                say(&format!(
                    "cuFuncGetAttribute: attribute {attrib} is not emulated"
                ));
                return Err(E::CUDA_ERROR_NOT_SUPPORTED);
            }
        };
        // SAFETY: out-parameter.
        unsafe { put(out, value) }
    })
}

/// Emulates `cuFuncSetAttribute`: the maximum dynamic shared memory (up to an H100's opt-in limit)
/// and the shared memory carveout (accepted and ignored); others are `CUDA_ERROR_NOT_SUPPORTED`.
#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: sys::CUfunction, attrib: u32, value: i32) -> CUresult {
    entry("cuFuncSetAttribute", || {
        current()?;
        let f = function(f)?;
        if attrib == FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as u32 {
            if !(0..=MAX_SHARED_PER_BLOCK_OPTIN).contains(&value) {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            f.max_dynamic_shared.store(value, Ordering::Release);
            return Ok(());
        }
        if attrib == FA::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT as u32 {
            return Ok(());
        }
        say(&format!(
            "cuFuncSetAttribute: attribute {attrib} is not emulated"
        ));
        Err(E::CUDA_ERROR_NOT_SUPPORTED)
    })
}

/// Arguments copied at the launch, 16-byte aligned each.
struct Arguments {
    storage: Vec<u128>,
    offsets: Vec<usize>,
}

// SAFETY: plain bytes.
unsafe impl Send for Arguments {}

/// Emulates `cuLaunchKernel`: checks the grid, block and shared memory against an H100's limits,
/// copies the arguments, and runs the kernel's host build on the stream's worker (never beside
/// another launch of the same kernel); arguments through `extra` are `CUDA_ERROR_NOT_SUPPORTED`,
/// and a failing kernel is a sticky `CUDA_ERROR_LAUNCH_FAILED`.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: sys::CUfunction,
    grid_x: u32,
    grid_y: u32,
    grid_z: u32,
    block_x: u32,
    block_y: u32,
    block_z: u32,
    shared_bytes: u32,
    stream: sys::CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry("cuLaunchKernel", || {
        current()?;
        let f = function(f)?;
        let stream = lookup(stream)?;
        sticky()?;
        let grid = [grid_x, grid_y, grid_z];
        let block = [block_x, block_y, block_z];
        let invalid = |why: String| {
            say(&format!(
                "cuLaunchKernel: {} with grid {grid:?}, block {block:?}, {shared_bytes} bytes of \
                 shared memory: {why}",
                f.name
            ));
            E::CUDA_ERROR_INVALID_VALUE
        };
        check_launch_shape(&f, grid, block, shared_bytes).map_err(invalid)?;
        if !extra.is_null() {
            say("cuLaunchKernel: arguments through `extra` are not emulated");
            return Err(E::CUDA_ERROR_NOT_SUPPORTED);
        }
        if params.is_null() && !f.params.is_empty() {
            return Err(invalid(format!(
                "no arguments for {} parameters",
                f.params.len()
            )));
        }
        // Copy the arguments now: the caller may reuse its storage once the call returns.
        // SAFETY: `params` is not null when `f` has parameters (checked above), and then has one
        // pointer per parameter, each to a value of the parameter's size (the driver's contract).
        let args = unsafe { copy_arguments(&f, params) }.map_err(invalid)?;
        let running = RunningLaunch {
            config: HostLaunchConfig {
                grid,
                block,
                shared_mem_bytes: shared_bytes,
                barrier_timeout_ms: BARRIER_TIMEOUT_MS,
            },
            kernel: f.name.clone(),
            stream: stream.id,
        };
        crate::counters::count(crate::counters::Counter::launches);
        stream.enqueue(Box::new(move || run_launch(&f, running, args)));
        Ok(())
    })
}

/// Checks a launch's grid, block and dynamic shared memory against an H100's limits and `f`'s
/// shared memory allowance; the error says which limit, for `cuLaunchKernel`'s message.
fn check_launch_shape(
    f: &Function,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
) -> Result<(), String> {
    let [grid_x, grid_y, grid_z] = grid;
    let [block_x, block_y, block_z] = block;
    if grid.contains(&0) || block.contains(&0) {
        return Err("a dimension is 0".into());
    }
    let threads = block.iter().map(|&b| b as u64).product::<u64>();
    if threads > 1024 || block_x > 1024 || block_y > 1024 || block_z > 64 {
        return Err("at most 1024 threads per block, (1024, 1024, 64) per dimension".into());
    }
    if grid_x > i32::MAX as u32 || grid_y > 65535 || grid_z > 65535 {
        return Err("the grid is larger than (2^31 - 1, 65535, 65535)".into());
    }
    let allowed = f.max_dynamic_shared.load(Ordering::Acquire);
    if shared_bytes as i64 > allowed as i64 {
        return Err(format!(
            "more dynamic shared memory than the {allowed} bytes allowed (opt in with \
             cuFuncSetAttribute)"
        ));
    }
    Ok(())
}

/// Copies one argument per parameter of `f` into 16-byte aligned storage of its own; the error
/// names a null argument pointer.
///
/// # Safety
/// When `f` has parameters, `params` holds one pointer per parameter, each null or pointing to
/// a value of the parameter's size.
unsafe fn copy_arguments(f: &Function, params: *mut *mut c_void) -> Result<Arguments, String> {
    let mut offsets = Vec::with_capacity(f.params.len());
    let mut total = 0;
    for &size in &f.params {
        offsets.push(total);
        total += size.div_ceil(16) * 16;
    }
    let mut args = Arguments {
        storage: vec![0u128; total / 16 + 1],
        offsets,
    };
    let base = args.storage.as_mut_ptr().cast::<u8>();
    for (i, &size) in f.params.iter().enumerate() {
        // SAFETY: `params` has one pointer per parameter, each to a value of the
        // parameter's size (the caller's contract); the destination has room (sized above).
        unsafe {
            let src = *params.add(i);
            if src.is_null() {
                return Err(format!("argument {i} is a null pointer"));
            }
            std::ptr::copy_nonoverlapping(src.cast::<u8>(), base.add(args.offsets[i]), size);
        }
    }
    Ok(args)
}

/// Runs one launch of `f` on the stream's worker: never beside another launch of the same
/// kernel; a failing kernel becomes a sticky `CUDA_ERROR_LAUNCH_FAILED`.
fn run_launch(f: &Function, running: RunningLaunch, mut args: Arguments) {
    let config = &running.config;
    let base = args.storage.as_mut_ptr().cast::<u8>();
    let mut pointers: Vec<*mut c_void> = args
        .offsets
        .iter()
        // SAFETY: each offset lies inside `storage`.
        .map(|&o| unsafe { base.add(o) }.cast())
        .collect();
    let mut message = vec![0u8; 1024];
    // Other kernels run beside this one; another launch of this kernel does not.
    let _kernel_alone = f.running.lock();
    // SAFETY: the entry reads the config and one value per parameter; the kernel's
    // memory accesses are to device memory the caller passed (host memory here). The
    // config is the first field of `running` (the worker hook relies on it).
    let status = unsafe {
        (f.entry)(
            config,
            pointers.as_mut_ptr(),
            message.as_mut_ptr().cast(),
            message.len(),
        )
    };
    if status != 0 {
        let end = message
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(message.len());
        fault(
            E::CUDA_ERROR_LAUNCH_FAILED,
            format!(
                "kernel {} (grid {:?}, block {:?}) on stream {} failed: {}",
                f.name,
                config.grid,
                config.block,
                running.stream,
                String::from_utf8_lossy(&message[..end])
            ),
            true,
        );
    }
}
