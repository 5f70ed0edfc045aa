//! `tandem-cuda-harness`: keeps tandem's GPU code honest on machines without a GPU.
//!
//! Two checks run in every CI run:
//!
//! - **Host execution.** The build script compiles every `.cu` file of the workspace with the
//!   host C++ compiler against `include/tandem_host.h`, an emulation of the CUDA execution model
//!   (blocks of OS threads meeting at barriers, shared memory, atomics, warp shuffles and
//!   votes), into one shared library per file. [`run`] executes a [`Launch`] — the same plan
//!   the CUDA runtime executes on a device — with host pointers, after checking the plan's
//!   arguments against the kernel's parameters ([`check_declarations`]: every `KernelArg::In`
//!   a `const T*`, every `KernelArg::Out` a `T*`, values of the right size), so each test also
//!   checks what the plans it runs declare to the stream sanitizer. Tests run every kernel against
//!   tandem's CPU ops (`tests/runtime_kernels.rs`) and check the emulation itself
//!   (`tests/emulator.rs`).
//! - **NVRTC.** `tests/nvrtc.rs` compiles every `.cu` with tandem's own NVRTC path for sm_80 and
//!   sm_90, prints each kernel's registers and spills, and fails on an error or an unexplained
//!   spill. Without NVRTC it prints `skipped: NVRTC not found (…)`; with
//!   `TANDEM_REQUIRE_NVRTC=1` (set by `.ci/run`) that skip is a failure instead.
//!
//! The harness is a development tool: it is not published and nothing in tandem depends on it.

#![warn(missing_docs)]

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tandem_core::cuda::launch::{KernelArg, KernelHeader, KernelSource, Launch};
use tandem_core::{Error, Result};

mod discover;
pub use discover::{kernel_files, KernelFile, KERNEL_FOLDERS, SHARED_HEADER_FOLDER};

/// A kernel file and the host library built from it.
#[derive(Debug)]
pub struct KernelLibrary {
    /// The file's stem, which is the `name` of its `KernelSource`.
    pub name: &'static str,
    /// The `.cu` file.
    pub source: &'static str,
    /// The shared library compiled from it.
    pub library: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/kernel_libraries.rs"));

/// The environment variable that turns the NVRTC test's skip into a failure (`.ci/run` sets it
/// to `1`).
pub const TANDEM_REQUIRE_NVRTC: &str = "TANDEM_REQUIRE_NVRTC";

/// How long threads may wait at a barrier before the launch is declared stuck.
pub const DEFAULT_BARRIER_TIMEOUT: Duration = Duration::from_secs(20);

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// `tandem_host_launch_config` in tandem_host.h.
#[repr(C)]
struct HostLaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    barrier_timeout_ms: u32,
}

type HostEntry =
    unsafe extern "C" fn(*const HostLaunchConfig, *mut *mut c_void, *mut c_char, usize) -> i32;

/// `tandem_param_kinds_<kernel>` (TANDEM_HOST_EXPORT_PARAM_KINDS in tandem_host.h): writes each
/// parameter's kind and size, returns the parameter count.
type ParamKinds = unsafe extern "C" fn(*mut c_char, *mut u64, i32) -> i32;

/// The most parameters a kernel's table is read for; no tandem kernel comes close.
const MAX_PARAMS: usize = 64;

/// What a kernel parameter is, as the kernel's C++ signature says (`param_kind` in
/// tandem_host.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// `const T*`: the kernel only reads through it; the plan declares [`KernelArg::In`].
    PointerToConst,
    /// `T*`: the kernel may write through it; the plan declares [`KernelArg::Out`].
    PointerToMut,
    /// Anything else, passed by value: the plan passes a value of the same size.
    Value,
}

impl ParamKind {
    fn describe(self) -> &'static str {
        match self {
            ParamKind::PointerToConst => "a pointer to const (`const T*`)",
            ParamKind::PointerToMut => "a pointer to non-const (`T*`)",
            ParamKind::Value => "a value",
        }
    }
}

/// One parameter of a kernel: its kind and its size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelParam {
    /// Pointer to const, pointer to non-const, or value.
    pub kind: ParamKind,
    /// `sizeof` the parameter.
    pub size: usize,
}

/// Checks a launch plan's arguments against its kernel's parameters: as many arguments as
/// parameters; [`KernelArg::In`] for each pointer to const, [`KernelArg::Out`] for each pointer
/// to non-const, and a value of the parameter's size for every other parameter. The stream
/// sanitizer trusts the `In`/`Out` declarations, so a wrong one would hide a race (an `In` the
/// kernel writes) or report a false one; the harness checks every launch it runs with this.
///
/// Errors name the kernel, the argument's index and the mismatch.
pub fn check_declarations(
    kernel: &str,
    args: &[KernelArg],
    params: &[KernelParam],
) -> std::result::Result<(), String> {
    if args.len() != params.len() {
        return Err(format!(
            "kernel {kernel} takes {} parameters; the launch plan passes {} arguments",
            params.len(),
            args.len()
        ));
    }
    for (index, (arg, param)) in args.iter().zip(params).enumerate() {
        let mismatch = |fix: &str| {
            Err(format!(
                "argument {index} of kernel {kernel} is declared {} but parameter {index} is {} \
                 ({fix})",
                declared(arg),
                param.kind.describe()
            ))
        };
        match (arg, param.kind) {
            (KernelArg::In(_), ParamKind::PointerToConst)
            | (KernelArg::Out(_), ParamKind::PointerToMut) => {}
            (KernelArg::In(_), ParamKind::PointerToMut) => {
                return mismatch(
                    "the kernel may write through it: declare Out, or make the parameter \
                     `const T*` if the kernel only reads it",
                )
            }
            (KernelArg::Out(_), ParamKind::PointerToConst) => {
                return mismatch("the kernel only reads through it: declare In")
            }
            (KernelArg::In(_) | KernelArg::Out(_), ParamKind::Value) => {
                return mismatch("pass the value itself, not a device pointer")
            }
            (_, ParamKind::PointerToConst | ParamKind::PointerToMut) => {
                return mismatch("declare the device pointer as In or Out")
            }
            (_, ParamKind::Value) if arg.size_in_bytes() != param.size => {
                return Err(format!(
                    "argument {index} of kernel {kernel} is {} of {} bytes but parameter \
                     {index} has {} bytes",
                    declared(arg),
                    arg.size_in_bytes(),
                    param.size
                ))
            }
            (_, ParamKind::Value) => {}
        }
    }
    Ok(())
}

/// An argument's declaration, for messages: `In`, `Out`, `U64`, ...
fn declared(arg: &KernelArg) -> &'static str {
    match arg {
        KernelArg::In(_) => "In",
        KernelArg::Out(_) => "Out",
        KernelArg::I32(_) => "an I32",
        KernelArg::U32(_) => "a U32",
        KernelArg::I64(_) => "an I64",
        KernelArg::U64(_) => "a U64",
        KernelArg::F32(_) => "an F32",
        KernelArg::F64(_) => "an F64",
        KernelArg::U16(_) => "a U16",
        KernelArg::U8(_) => "a U8",
        KernelArg::Pod(_) => "a struct",
    }
}

/// The parameters of `kernel` in `library`, from its `tandem_param_kinds_<kernel>` table.
fn kernel_params(
    library: &libloading::Library,
    kernel: &str,
) -> std::result::Result<Vec<KernelParam>, String> {
    let symbol = format!("tandem_param_kinds_{kernel}");
    // SAFETY: every `tandem_param_kinds_*` symbol is defined by TANDEM_HOST_EXPORT_PARAM_KINDS
    // with this type.
    let table: ParamKinds =
        *unsafe { library.get::<ParamKinds>(symbol.as_bytes()) }.map_err(|e| {
            format!(
                "no parameter table {symbol} ({e}); is the kernel followed by TANDEM_HOST_EXPORT?"
            )
        })?;
    let mut kinds: Vec<c_char> = vec![0; MAX_PARAMS];
    let mut sizes = vec![0u64; MAX_PARAMS];
    // SAFETY: the table writes at most MAX_PARAMS entries into each buffer.
    let count = unsafe { table(kinds.as_mut_ptr(), sizes.as_mut_ptr(), MAX_PARAMS as i32) };
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    if count > MAX_PARAMS {
        return Err(format!(
            "kernel {kernel} has {count} parameters; the harness reads at most {MAX_PARAMS}"
        ));
    }
    kinds
        .iter()
        .zip(&sizes)
        .take(count)
        .map(|(&kind, &size)| {
            let kind = match kind as u8 {
                b'i' => ParamKind::PointerToConst,
                b'o' => ParamKind::PointerToMut,
                b'v' => ParamKind::Value,
                other => return Err(format!("{symbol}: unknown parameter kind {other}")),
            };
            Ok(KernelParam {
                kind,
                size: size as usize,
            })
        })
        .collect()
}

/// Runs `launch` on the CPU: its kernel, from the host library of its source file, over its
/// grid, with its arguments. Launches of different kernels from different threads run at the
/// same time (each has its own state and threads in the emulation); two launches of the same
/// kernel do not (its `__shared__` variables are one static copy): the second waits.
///
/// Before running, checks the plan's arguments against the kernel's parameters
/// ([`check_declarations`]: count, `In`/`Out` against `const`, value sizes).
///
/// Errors when the kernel's file or its host entry point is missing, an argument does not match
/// its parameter, or the emulation detected a fault (a barrier not reached by every thread, a partial-warp intrinsic, threads stuck).
///
/// # Safety
/// Every pointer argument of the launch must point to host memory valid for everything the
/// kernel reads and writes, as a device pointer would on a GPU.
pub unsafe fn run(launch: &Launch) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { run_with_timeout(launch, DEFAULT_BARRIER_TIMEOUT) }
}

/// [`run`] with a barrier timeout (tests of the stuck-barrier detection use a short one).
///
/// # Safety
/// As for [`run`].
pub unsafe fn run_with_timeout(launch: &Launch, barrier_timeout: Duration) -> Result<()> {
    let context = || {
        format!(
            "host harness: {}.cu kernel {}",
            launch.source.name, launch.kernel
        )
    };
    let library = host_library(launch.source.name).map_err(|e| Error::external(context(), e))?;
    let symbol = format!("tandem_host_{}", launch.kernel);
    // SAFETY: every `tandem_host_*` symbol is defined by TANDEM_HOST_EXPORT with this type.
    let entry: HostEntry =
        *unsafe { library.get::<HostEntry>(symbol.as_bytes()) }.map_err(|e| {
            Error::external(
                context(),
                format!(
                    "no host entry {symbol} ({e}); is the kernel followed by TANDEM_HOST_EXPORT?"
                ),
            )
        })?;
    let params =
        kernel_params(library, &launch.kernel).map_err(|e| Error::external(context(), e))?;
    check_declarations(&launch.kernel, &launch.args, &params)
        .map_err(|e| Error::external(context(), e))?;
    let config = HostLaunchConfig {
        grid: launch.config.grid,
        block: launch.config.block,
        shared_mem_bytes: launch.config.shared_mem_bytes,
        barrier_timeout_ms: barrier_timeout.as_millis().min(u32::MAX as u128) as u32,
    };
    let mut params = launch.params();
    let mut message = vec![0u8; 1024];
    let running = kernel_lock(launch.source.name, &launch.kernel);
    let _kernel_alone = running.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the entry reads the config, one value per parameter through `params` (which
    // borrow `launch`), and writes at most `message.len()` bytes; the kernel's own accesses are
    // the caller's promise.
    let status = unsafe {
        entry(
            &config,
            params.as_mut_ptr(),
            message.as_mut_ptr().cast(),
            message.len(),
        )
    };
    if status != 0 {
        let end = message
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(message.len());
        return Err(Error::external(
            context(),
            String::from_utf8_lossy(&message[..end]).into_owned(),
        ));
    }
    Ok(())
}

/// The host library built from the kernel file named `name`, opened once.
/// The lock held while a kernel (of a source file, by name) runs: its `__shared__` variables are
/// static in the host build, one copy per kernel, so two launches of it must not overlap.
fn kernel_lock(source: &'static str, kernel: &str) -> std::sync::Arc<Mutex<()>> {
    type Locks = Mutex<HashMap<(&'static str, String), std::sync::Arc<Mutex<()>>>>;
    static LOCKS: OnceLock<Locks> = OnceLock::new();
    LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((source, kernel.to_string()))
        .or_default()
        .clone()
}

fn host_library(name: &str) -> std::result::Result<&'static libloading::Library, String> {
    static OPEN: OnceLock<Mutex<HashMap<&'static str, &'static libloading::Library>>> =
        OnceLock::new();
    let entry = KERNEL_LIBRARIES
        .iter()
        .find(|l| l.name == name)
        .ok_or_else(|| {
            format!(
                "no kernel file {name}.cu under {}",
                KERNEL_FOLDERS.join(", ")
            )
        })?;
    let mut open = OPEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(library) = open.get(entry.name) {
        return Ok(library);
    }
    // SAFETY: the library was built by this crate's build script from tandem's kernels; its
    // initialisers only set up the emulation's statics.
    let library = unsafe { libloading::Library::new(entry.library) }
        .map_err(|e| format!("opening {}: {e}", entry.library))?;
    // Kept for the life of the process: entry points are used through `&'static` references.
    let library: &'static libloading::Library = Box::leak(Box::new(library));
    open.insert(entry.name, library);
    Ok(library)
}

/// Every kernel file as a `KernelSource` for NVRTC, with the headers beside it, read from the
/// working tree (for the NVRTC test; tandem itself embeds its sources).
pub fn kernel_sources() -> std::result::Result<Vec<&'static KernelSource>, String> {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let read =
        |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()));
    kernel_files(&workspace_root())?
        .into_iter()
        .map(|file| {
            let headers: Vec<KernelHeader> = file
                .headers
                .iter()
                .map(|h| {
                    Ok(KernelHeader {
                        name: leak(
                            h.file_name()
                                .map(|n| n.to_string_lossy().into_owned())
                                .unwrap_or_default(),
                        ),
                        source: leak(read(h)?),
                    })
                })
                .collect::<std::result::Result<_, String>>()?;
            let source: &'static KernelSource = Box::leak(Box::new(KernelSource {
                name: leak(file.name),
                source: leak(read(&file.path)?),
                headers: Box::leak(headers.into_boxed_slice()),
            }));
            Ok(source)
        })
        .collect()
}

/// Whether NVRTC can be used. Without it, prints `skipped: NVRTC not found (…)` for `test` and
/// returns `false`, or panics when `TANDEM_REQUIRE_NVRTC=1`.
pub fn nvrtc_available(test: &str) -> bool {
    match tandem_core::cuda::nvrtc::nvrtc_version(tandem_core::Device::Cuda(0)) {
        Ok(_) => true,
        Err(e) => {
            let message = format!("{test}: skipped: NVRTC not found ({e})");
            if std::env::var(TANDEM_REQUIRE_NVRTC).is_ok_and(|v| v == "1") {
                panic!("{message}; {TANDEM_REQUIRE_NVRTC}=1 makes this a failure");
            }
            println!("{message}");
            false
        }
    }
}
