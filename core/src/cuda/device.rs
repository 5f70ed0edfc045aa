//! One CUDA device as tandem uses it: its context, its compute stream, the kernel modules
//! loaded on it, and the settings its memory pool needs.
//!
//! A device is opened on first use ([`device`]) and stays open for the life of the process.
//! Opening checks, before any cudarc call, that the driver library can be loaded (cudarc
//! panics otherwise), that the ordinal exists, and then retains the device's primary context.
//! Every later driver call on any thread binds that context first ([`CudaDevice::bind`]).
//!
//! Kernels are compiled by NVRTC for the device's exact architecture the first time one of a
//! source file's kernels is launched, loaded as a module, and their function handles cached, so
//! a launch after the first costs one map lookup and `cuLaunchKernel`.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use parking_lot::Mutex;

use super::launch::{KernelSource, Launch};
use super::libs::{self, CudaLibrary};
use super::nvrtc::{self, Arch, CompileOptions};
use crate::{Device, Error, Result};

/// The most CUDA devices one process can use.
pub const MAX_DEVICES: usize = 64;

/// A raw driver handle that the driver allows to be used from any thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Handle<T>(pub(crate) T);
// SAFETY: module, function and memory-pool handles are process-wide driver objects; the CUDA
// driver API is thread-safe for them once the owning context is current (see `bind`).
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above; the handles are only passed by value to the driver.
unsafe impl<T> Sync for Handle<T> {}

/// An open CUDA device.
pub struct CudaDevice {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    arch: Arch,
    name: String,
    total_memory: usize,
    pool: Handle<sys::CUmemoryPool>,
    modules: Mutex<HashMap<&'static str, Handle<sys::CUmodule>>>,
    /// Function handles by source file, then kernel name (looked up without allocating).
    functions: Mutex<HashMap<&'static str, HashMap<String, Handle<sys::CUfunction>>>>,
    pub(crate) memory: super::memory::Counters,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice(cuda:{} {} {})",
            self.ordinal, self.name, self.arch
        )
    }
}

/// Turns a driver error into tandem's error for `op` on `device`.
pub(crate) fn driver_err(op: &'static str, device: Device) -> impl Fn(DriverError) -> Error {
    move |e: DriverError| {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Error::Cuda {
            op,
            device,
            detail: format!("{name}: {text}"),
        }
    }
}

static DEVICES: [OnceLock<Arc<CudaDevice>>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
static OPENING: Mutex<()> = Mutex::new(());

/// The CUDA device `ordinal`, opened on first use. Errors name what is missing: the driver
/// library (and where it was searched for), a device, or the ordinal.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    let dev = Device::Cuda(ordinal);
    let slot = DEVICES
        .get(ordinal)
        .ok_or_else(|| Error::DeviceUnavailable {
            device: dev,
            reason: format!("tandem supports CUDA ordinals below {MAX_DEVICES}"),
        })?;
    if let Some(d) = slot.get() {
        return Ok(d.clone());
    }
    let _opening = OPENING.lock();
    if let Some(d) = slot.get() {
        return Ok(d.clone());
    }
    let opened = Arc::new(CudaDevice::open(ordinal)?);
    let _ = slot.set(opened.clone());
    Ok(opened)
}

/// How many CUDA devices this machine has (0 when the driver is missing).
pub fn device_count() -> usize {
    if libs::ensure(CudaLibrary::Driver, Device::Cuda(0)).is_err() {
        return 0;
    }
    let count = result::init().and_then(|()| result::device::get_count());
    count.map(|n| n.max(0) as usize).unwrap_or(0)
}

/// Whether `cuda:0` can be used (the driver loads and there is a device).
pub fn is_available() -> bool {
    device_count() > 0
}

impl CudaDevice {
    fn open(ordinal: usize) -> Result<Self> {
        let dev = Device::Cuda(ordinal);
        libs::ensure(CudaLibrary::Driver, dev)?;
        let err = driver_err("open device", dev);
        result::init().map_err(|e| Error::DeviceUnavailable {
            device: dev,
            reason: format!("the CUDA driver did not initialise: {}", err(e)),
        })?;
        let count = result::device::get_count().map_err(&err)?.max(0) as usize;
        if ordinal >= count {
            return Err(Error::DeviceUnavailable {
                device: dev,
                reason: format!(
                    "this machine has {count} CUDA device{}",
                    if count == 1 { "" } else { "s" }
                ),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(&err)?;
        // tandem tracks stream use of its buffers itself; cudarc's per-slice events are unused.
        // SAFETY: no cudarc `CudaSlice` is ever created on this context.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(&err)?;
        let name = ctx.name().map_err(&err)?;
        let total_memory = ctx.total_mem().map_err(&err)?;
        let compute = ctx.new_stream().map_err(&err)?;
        super::sanitizer::stream_created(&compute, &format!("compute ({dev})"));
        // SAFETY: the context is current (CudaContext::new binds it); the pool handle is the
        // device's default pool, owned by the driver.
        let pool =
            unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }.map_err(&err)?;
        // Keep freed memory cached, and never let the pool tie one stream to another's frees
        // (see `POOL_SETTINGS` for each attribute and why).
        super::memory::configure_pool(pool).map_err(&err)?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            compute,
            arch: Arch::new(major as u32, minor as u32),
            name,
            total_memory,
            pool: Handle(pool),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            memory: Default::default(),
        })
    }

    /// The device as tandem names it (`cuda:N`).
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The product name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture kernels are compiled for (`sm_90` on an H100).
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.total_memory
    }

    /// The stream ops run on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// A new stream on this device (a communication stream, say).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(driver_err("new stream", self.device()))?;
        super::sanitizer::stream_created(&stream, &format!("stream on {}", self.device()));
        Ok(stream)
    }

    /// The retained primary context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn pool(&self) -> sys::CUmemoryPool {
        self.pool.0
    }

    /// Makes this device's context current on the calling thread (cheap when it already is).
    pub fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_err(op, self.device()))
    }

    /// Blocks until everything issued on the compute stream has run; reports an error a
    /// kernel raised asynchronously, or one it recorded ([`deferred`](super::deferred)).
    pub fn synchronize(&self) -> Result<()> {
        self.bind("synchronize")?;
        super::sanitizer::synchronized(&self.compute, || self.compute.synchronize())
            .map_err(driver_err("synchronize", self.device()))?;
        super::deferred::check(self, "synchronize")
    }

    /// The handle of `kernel` in `source`, compiling and loading the module on first use.
    fn function(&self, source: &'static KernelSource, kernel: &str) -> Result<sys::CUfunction> {
        if let Some(f) = self
            .functions
            .lock()
            .get(source.name)
            .and_then(|kernels| kernels.get(kernel))
        {
            return Ok(f.0);
        }
        let dev = self.device();
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(source.name) {
                Some(m) => m.0,
                None => {
                    let cubin = nvrtc::compile(
                        source,
                        self.arch,
                        &CompileOptions {
                            device: dev,
                            ..Default::default()
                        },
                    )?;
                    self.bind("load kernels")?;
                    // SAFETY: `image` is a complete CUBIN for this device's architecture;
                    // the driver copies what it needs before returning.
                    let module = unsafe { result::module::load_data(cubin.image.as_ptr().cast()) }
                        .map_err(driver_err("load kernels", dev))?;
                    modules.insert(source.name, Handle(module));
                    module
                }
            }
        };
        let name =
            CString::new(kernel).map_err(|_| Error::invalid("launch", "kernel name with NUL"))?;
        // SAFETY: `module` is loaded and never unloaded; `name` is NUL-terminated.
        let function =
            unsafe { result::module::get_function(module, name) }.map_err(|e| Error::Cuda {
                op: "launch",
                device: dev,
                detail: format!(
                    "kernel `{kernel}` is not in {}.cu: {}",
                    source.name,
                    driver_err("launch", dev)(e)
                ),
            })?;
        self.functions
            .lock()
            .entry(source.name)
            .or_default()
            .insert(kernel.to_string(), Handle(function));
        Ok(function)
    }

    /// Runs `launch` on `stream` (of this device). Asynchronous: errors a kernel raises while
    /// running surface at the next synchronisation.
    pub fn launch(&self, launch: &Launch, stream: &CudaStream) -> Result<()> {
        let function = self.function(launch.source, &launch.kernel)?;
        // Before the launch: a launch racing with another stream's work is not issued.
        super::sanitizer::launch(self.device(), stream, launch)?;
        self.bind("launch")?;
        let c = launch.config;
        let mut params = launch.params();
        // SAFETY: `params` holds one pointer per argument, to a value of the kernel's parameter
        // type (the launch plan is built for this kernel's signature, and the same plan is
        // exercised against the kernel in the host harness); device pointers in it are live
        // allocations of this device, kept alive by the tensors the caller holds until the
        // stream has run the kernel (stream-ordered frees).
        unsafe {
            result::launch_kernel(
                function,
                (c.grid[0], c.grid[1], c.grid[2]),
                (c.block[0], c.block[1], c.block[2]),
                c.shared_mem_bytes,
                stream.cu_stream(),
                params.as_mut_slice(),
            )
        }
        .map_err(|e| Error::Cuda {
            op: "launch",
            device: self.device(),
            detail: format!(
                "{}: {}",
                launch.kernel,
                driver_err("launch", self.device())(e)
            ),
        })
    }
}
