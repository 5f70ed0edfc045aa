//! Compiling kernels: CUDA C embedded in the binary, compiled by NVRTC at first use to a CUBIN
//! for the device's exact architecture, cached in memory and on disk.
//!
//! A CUBIN, not PTX: a newer NVRTC emits PTX of an ISA version an older driver refuses (NVRTC
//! 13.5 writes PTX ISA 9.5, which a CUDA 13.0 driver rejects), while a CUBIN for `sm_XY` runs
//! on any driver that supports `sm_XY`. Compiling for a real architecture also runs the
//! assembler, so resource errors (too much shared memory, …) surface here and
//! `--ptxas-options=-v` reports each kernel's registers and spills ([`KernelResources`]).
//!
//! NVRTC is called through the library [`libs`] located and opened, never through
//! cudarc's by-name loading, so a missing library or symbol is an error and the library used is
//! the one that was checked.
//!
//! Results are cached in memory and on disk by [`kernel_cache`](super::kernel_cache).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use super::kernel_cache::{DiskCache, KernelCache};
use super::launch::{KernelSource, TANDEM_CUH};
use super::libs::{self, CudaLibrary};
use crate::{Device, Error, Result};

/// A GPU architecture, `sm_<major><minor>` (compute capability `major.minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    /// Compute capability major version (8 for an A100, 9 for an H100).
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
}

impl Arch {
    /// `sm_<major><minor>`.
    pub const fn new(major: u32, minor: u32) -> Self {
        Arch { major, minor }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// How to compile.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// The device the kernels are for; named in errors.
    pub device: Device,
    /// Run the assembler verbosely (`--ptxas-options=-v`) so the result lists each kernel's
    /// registers, shared memory, stack frame and spills. Off by default.
    pub verbose: bool,
    /// Allow NVRTC's fast-math (`--use_fast_math`: approximate division, square root and
    /// transcendentals, denormals flushed to zero). Off by default: kernels match the CPU.
    pub fast_math: bool,
}

impl CompileOptions {
    /// The NVRTC command line for `arch`.
    pub(super) fn nvrtc_options(&self, arch: Arch) -> Vec<String> {
        let mut options = vec![
            "-std=c++17".to_string(),
            format!("--gpu-architecture={arch}"),
        ];
        if self.fast_math {
            options.push("--use_fast_math".to_string());
        }
        if self.verbose {
            options.push("--ptxas-options=-v".to_string());
        }
        options
    }
}

/// What the assembler reported for one kernel (with [`CompileOptions::verbose`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block, in bytes.
    pub shared_bytes: u64,
    /// Stack frame per thread, in bytes.
    pub stack_frame_bytes: u64,
    /// Bytes stored to local memory because registers ran out.
    pub spill_store_bytes: u64,
    /// Bytes loaded back from those spills.
    pub spill_load_bytes: u64,
}

/// A compiled module: the CUBIN and what NVRTC said while making it.
#[derive(Clone, Debug)]
pub struct Cubin {
    /// The source file's name.
    pub source: &'static str,
    /// The architecture it runs on.
    pub arch: Arch,
    /// NVRTC's version (major, minor).
    pub nvrtc_version: (i32, i32),
    /// The CUBIN image, for `cuModuleLoadData`.
    pub image: Vec<u8>,
    /// NVRTC's log (warnings, and the assembler's report when verbose).
    pub log: String,
    /// Per-kernel resources parsed from the log (empty unless verbose).
    pub resources: Vec<KernelResources>,
}

/// A kernel that did not compile, with NVRTC's log. Its `Debug` is its message.
pub struct CompileError {
    /// The source file's name.
    pub source: &'static str,
    /// The architecture it was compiled for.
    pub arch: Arch,
    /// NVRTC's log.
    pub log: String,
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.cu did not compile for {}:\n{}",
            self.source, self.arch, self.log
        )
    }
}

impl std::error::Error for CompileError {}

crate::debug_as_display!(CompileError);

/// Compiles `source` for `arch`, or returns the result cached in this process or on disk (in
/// the folder named by the environment). Errors: NVRTC missing, or an architecture it does not
/// know ([`Error::DeviceUnavailable`]); the source not compiling ([`Error::External`] wrapping a
/// [`CompileError`] with NVRTC's log).
pub fn compile(
    source: &'static KernelSource,
    arch: Arch,
    options: &CompileOptions,
) -> Result<Arc<Cubin>> {
    static GLOBAL: OnceLock<KernelCache> = OnceLock::new();
    GLOBAL
        .get_or_init(|| KernelCache::new(DiskCache::Default))
        .compile(source, arch, options)
}

/// NVRTC's version, if it can be loaded (for messages and tests).
pub fn nvrtc_version(device: Device) -> Result<(i32, i32)> {
    Nvrtc::get(device).map(|n| n.version)
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The map stays consistent even if a holder panicked: entries are inserted whole.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Per-kernel resources from the assembler's verbose report. Only entry functions (kernels)
/// are listed; device functions the assembler reports separately are skipped.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let quoted = |line: &str| line.split('\'').nth(1).map(str::to_string);
    let number_before = |line: &str, unit: &str| -> Option<u64> {
        let end = line.find(unit)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    let mut current: Option<usize> = None;
    for line in log.lines() {
        if line.contains("Compiling entry function") {
            current = quoted(line).map(|kernel| {
                out.push(KernelResources {
                    kernel,
                    ..Default::default()
                });
                out.len() - 1
            });
        } else if line.contains("Function properties for") {
            let name = line.rsplit("Function properties for").next().map(str::trim);
            current = out.iter().position(|k| Some(k.kernel.as_str()) == name);
        } else if let Some(k) = current.map(|i| &mut out[i]) {
            if line.contains("bytes stack frame") {
                k.stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0) as u32;
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// NVRTC's functions, bound from the library `libs` opened.
pub(super) struct Nvrtc {
    /// NVRTC's version (major, minor).
    pub(super) version: (i32, i32),
    /// Architectures NVRTC can compile for, as `major * 10 + minor`.
    pub(super) archs: Vec<i32>,
    create: unsafe extern "C" fn(
        *mut *mut c_void,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int,
    log: unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut *mut c_void) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    /// NVRTC compiles one program at a time here: it is documented thread-safe, but compiles are
    /// rare and the serialisation keeps memory use of parallel first uses bounded.
    serial: Mutex<()>,
}

impl Nvrtc {
    /// NVRTC, bound on first use; `device` is named in the error when it is missing.
    pub(super) fn get(device: Device) -> Result<&'static Nvrtc> {
        static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
        let library = libs::library(CudaLibrary::Nvrtc, device)?;
        NVRTC
            .get_or_init(|| Nvrtc::bind(library))
            .as_ref()
            .map_err(|reason| Error::DeviceUnavailable {
                device,
                reason: reason.clone(),
            })
    }

    fn bind(library: &'static libloading::Library) -> std::result::Result<Nvrtc, String> {
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: the types of the fields below are NVRTC's documented signatures.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("NVRTC does not export {}: {e}", $name))?
            };
        }
        let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            symbol!("nvrtcVersion");
        let num_archs: unsafe extern "C" fn(*mut c_int) -> c_int =
            symbol!("nvrtcGetNumSupportedArchs");
        let get_archs: unsafe extern "C" fn(*mut c_int) -> c_int =
            symbol!("nvrtcGetSupportedArchs");
        let (mut major, mut minor, mut count) = (0, 0, 0);
        // SAFETY: the pointers are valid for writes of one c_int each.
        let status = unsafe { version_fn(&mut major, &mut minor) | num_archs(&mut count) };
        if status != 0 || !(0..=1024).contains(&count) {
            return Err(format!(
                "NVRTC did not report its version or architectures (status {status})"
            ));
        }
        let mut archs = vec![0; count as usize];
        // SAFETY: `archs` has room for the `count` entries NVRTC said it would write.
        if unsafe { get_archs(archs.as_mut_ptr()) } != 0 {
            return Err("nvrtcGetSupportedArchs failed".to_string());
        }
        Ok(Nvrtc {
            version: (major, minor),
            archs,
            create: symbol!("nvrtcCreateProgram"),
            compile: symbol!("nvrtcCompileProgram"),
            log_size: symbol!("nvrtcGetProgramLogSize"),
            log: symbol!("nvrtcGetProgramLog"),
            cubin_size: symbol!("nvrtcGetCUBINSize"),
            cubin: symbol!("nvrtcGetCUBIN"),
            destroy: symbol!("nvrtcDestroyProgram"),
            error_string: symbol!("nvrtcGetErrorString"),
            serial: Mutex::new(()),
        })
    }

    /// Whether NVRTC can compile for `arch`.
    pub(super) fn supports(&self, arch: Arch) -> bool {
        self.archs
            .contains(&((arch.major * 10 + arch.minor) as i32))
    }

    fn describe(&self, status: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any status.
        let text = unsafe { (self.error_string)(status) };
        if text.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated and static.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Compiles to a CUBIN; returns it with the log.
    pub(super) fn compile(
        &self,
        source: &'static KernelSource,
        arch: Arch,
        options: &[String],
    ) -> Result<(Vec<u8>, String)> {
        let internal = |what: &str, status: c_int| {
            Error::external(
                format!("compiling {}.cu for {arch} with NVRTC", source.name),
                format!("{what}: {}", self.describe(status)),
            )
        };
        let c = |s: &str| CString::new(s).map_err(|_| internal("a string holds a NUL byte", 3));
        let text = c(source.source)?;
        let name = c(&format!("{}.cu", source.name))?;
        let headers: Vec<(CString, CString)> = std::iter::once(&TANDEM_CUH)
            .chain(source.headers)
            .map(|h| Ok((c(h.source)?, c(h.name)?)))
            .collect::<Result<_>>()?;
        let header_texts: Vec<*const c_char> = headers.iter().map(|h| h.0.as_ptr()).collect();
        let header_names: Vec<*const c_char> = headers.iter().map(|h| h.1.as_ptr()).collect();
        let options: Vec<CString> = options.iter().map(|o| c(o)).collect::<Result<_>>()?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();

        let _serial = lock(&self.serial);
        let mut program: *mut c_void = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string; the arrays have the lengths
        // passed; `program` receives the handle.
        let status = unsafe {
            (self.create)(
                &mut program,
                text.as_ptr(),
                name.as_ptr(),
                headers.len() as c_int,
                header_texts.as_ptr(),
                header_names.as_ptr(),
            )
        };
        if status != 0 {
            return Err(internal("nvrtcCreateProgram", status));
        }
        let program = Program {
            nvrtc: self,
            handle: program,
        };
        // SAFETY: a valid program; the options array has the length passed.
        let compiled = unsafe {
            (self.compile)(
                program.handle,
                option_ptrs.len() as c_int,
                option_ptrs.as_ptr(),
            )
        };
        let log = program
            .read(self.log_size, self.log)
            .map_err(|s| internal("reading the log", s))?;
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string();
        if compiled != 0 {
            return Err(Error::external(
                format!(
                    "compiling {}.cu for {arch} with NVRTC {}.{}",
                    source.name, self.version.0, self.version.1
                ),
                CompileError {
                    source: source.name,
                    arch,
                    log,
                },
            ));
        }
        let image = program
            .read(self.cubin_size, self.cubin)
            .map_err(|s| internal("reading the CUBIN", s))?;
        Ok((image, log))
    }
}

/// An NVRTC program, destroyed on drop.
struct Program<'a> {
    nvrtc: &'a Nvrtc,
    handle: *mut c_void,
}

impl Program<'_> {
    /// Reads a buffer NVRTC sizes first (the log, the CUBIN).
    fn read(
        &self,
        size: unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int,
        read: unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int,
    ) -> std::result::Result<Vec<u8>, c_int> {
        let mut len = 0usize;
        // SAFETY: a valid program; `len` receives the size.
        let status = unsafe { size(self.handle, &mut len) };
        if status != 0 {
            return Err(status);
        }
        let mut buffer = vec![0u8; len];
        // SAFETY: `buffer` holds the `len` bytes NVRTC said it would write.
        let status = unsafe { read(self.handle, buffer.as_mut_ptr().cast()) };
        if status != 0 {
            return Err(status);
        }
        Ok(buffer)
    }
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        unsafe { (self.nvrtc.destroy)(&mut self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_are_parsed_from_the_assembler_report() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'norm_finish' for 'sm_80'
ptxas info    : Function properties for norm_finish
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 38 registers, used 1 barriers, 256 bytes smem, 536 bytes cmem[0]
ptxas info    : Compile time = 3.1 ms
ptxas info    : Function properties for __internal_accurate_pow
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'fill_f32' for 'sm_80'
ptxas info    : Function properties for fill_f32
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers, 516 bytes cmem[0]
";
        let r = parse_resources(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                kernel: "norm_finish".into(),
                registers: 38,
                shared_bytes: 256,
                stack_frame_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 12,
            }
        );
        assert_eq!(
            (r[1].kernel.as_str(), r[1].registers, r[1].shared_bytes),
            ("fill_f32", 22, 0)
        );
    }

    #[test]
    fn options_default_to_exact_arch_cubin_without_fast_math() {
        let o = CompileOptions::default().nvrtc_options(Arch::new(9, 0));
        assert_eq!(o, ["-std=c++17", "--gpu-architecture=sm_90"]);
        let verbose = CompileOptions {
            verbose: true,
            ..Default::default()
        };
        assert!(verbose
            .nvrtc_options(Arch::new(8, 0))
            .contains(&"--ptxas-options=-v".to_string()));
    }
}
