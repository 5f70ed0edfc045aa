//! `tandem-cuda-emu-nvrtc`: an emulated NVRTC (`libnvrtc.so`) for tandem's emulated CUDA driver
//! (`tandem-cuda-emu`, in the folder above). Tests only: a program finds it only when
//! `TANDEM_CUDA_LIBS` names a folder holding a copy of it under NVRTC's file name.
//!
//! # What it does
//!
//! `nvrtcCompileProgram` compiles the program's CUDA C with the host C++ compiler (`$CXX`, else
//! `c++`) against the host harness's execution model (`cuda-harness/include/tandem_host.h`, which
//! runs a block's threads as OS threads meeting at barriers) plus `include/tandem_emu.h` (which
//! makes every kernel export its parameter sizes), into a shared library. The "CUBIN" it returns
//! is that library, wrapped in a small header ([`MODULE_MAGIC`], the architecture, the length):
//! the emulated `cuModuleLoadData` loads it and `cuLaunchKernel` calls the kernel's host entry.
//! Compiler errors come back through the program log, with `NVRTC_ERROR_COMPILATION`, as from
//! the real NVRTC.
//!
//! Compiled libraries are cached by a SHA-256 of the sources, headers, options, compiler and the
//! two emulation headers, in `$TANDEM_CUDA_EMU_CACHE`, else `$XDG_CACHE_HOME/tandem/cuda-emu`,
//! else `$HOME/.cache/tandem/cuda-emu`, else the temporary folder, so a test suite compiles each
//! kernel file once.
//!
//! Its version is 13.99: no real NVRTC has it, so tandem's own kernel cache, whose key holds the
//! NVRTC version, never hands an emulator module to a real driver or a real CUBIN to the emulator.
//!
//! # What it does not do
//!
//! PTX, LTO-IR and OptiX-IR output, name expressions and lowered names, bundled-header queries:
//! those entry points print `tandem-cuda-emu: <name> is not emulated` and fail. Options it does
//! not know fail with `NVRTC_ERROR_INVALID_OPTION`. `--ptxas-options=-v` adds no resource report to
//! the log. `--use_fast_math` is accepted and ignored (the host build never fuses or approximates).

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]

use std::collections::HashSet;
use std::ffi::{c_char, c_int, CStr};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// The first bytes of a module image made by this NVRTC. The emulated driver checks them.
pub const MODULE_MAGIC: &[u8; 24] = b"TANDEM-CUDA-EMU-MODULE\0\0";

/// NVRTC's version as this emulation reports it (see the crate docs).
pub const VERSION: (c_int, c_int) = (13, 99);

/// The architectures it accepts, as `major * 10 + minor` (those of NVRTC 13.0).
pub const ARCHS: &[c_int] = &[75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];

/// The host harness's execution model, embedded so nothing is read from the source tree at run
/// time (the library may run on a machine that has only the built test binaries).
pub const TANDEM_HOST_H: &str = include_str!("../../../cuda-harness/include/tandem_host.h");
/// What the emulation adds to it (parameter sizes for launches).
pub const TANDEM_EMU_H: &str = include_str!("../include/tandem_emu.h");

/// Flags of the host compile: the harness's own (cuda-harness/build.rs), so kernels behave as
/// in the harness tests.
const CXX_FLAGS: &[&str] = &[
    "-std=c++17",
    "-O1",
    "-g0",
    "-fPIC",
    "-shared",
    "-pthread",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unknown-pragmas",
];

// nvrtcResult values.
const NVRTC_SUCCESS: c_int = 0;
const NVRTC_ERROR_INVALID_INPUT: c_int = 3;
const NVRTC_ERROR_INVALID_PROGRAM: c_int = 4;
const NVRTC_ERROR_INVALID_OPTION: c_int = 5;
const NVRTC_ERROR_COMPILATION: c_int = 6;
const NVRTC_ERROR_INTERNAL_ERROR: c_int = 11;

/// One program (`nvrtcProgram` points to one): its sources, and after compiling, the log and
/// the module image.
pub struct Program {
    source: String,
    name: String,
    headers: Vec<(String, String)>,
    log: String,
    image: Option<Vec<u8>>,
}

/// Live program handles, so a stale or foreign handle is an error, not a crash.
static PROGRAMS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

fn programs() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    PROGRAMS.lock().unwrap_or_else(|p| p.into_inner())
}

fn not_emulated(name: &str) -> c_int {
    eprintln!("tandem-cuda-emu: {name} is not emulated");
    NVRTC_ERROR_INTERNAL_ERROR
}

/// Runs `f` on the program behind `prog`, or fails with `NVRTC_ERROR_INVALID_PROGRAM`.
unsafe fn with_program(prog: *mut Program, f: impl FnOnce(&mut Program) -> c_int) -> c_int {
    if prog.is_null()
        || !programs()
            .as_ref()
            .is_some_and(|s| s.contains(&(prog as usize)))
    {
        return NVRTC_ERROR_INVALID_PROGRAM;
    }
    // SAFETY: the handle is live (in the registry); NVRTC programs are not used from two
    // threads at once (NVRTC's own rule), so the exclusive borrow is sound.
    let program = unsafe { &mut *prog };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(program))) {
        Ok(status) => status,
        Err(_) => NVRTC_ERROR_INTERNAL_ERROR,
    }
}

unsafe fn string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string (NVRTC's contract).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Emulates `nvrtcVersion`: 13.99, a version no real NVRTC has (see the crate docs).
#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int {
    if major.is_null() || minor.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: both checked non-null; the caller passes writable ints.
    unsafe {
        *major = VERSION.0;
        *minor = VERSION.1;
    }
    NVRTC_SUCCESS
}

/// Emulates `nvrtcGetNumSupportedArchs`: the length of [`ARCHS`].
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(count: *mut c_int) -> c_int {
    if count.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: checked non-null.
    unsafe { *count = ARCHS.len() as c_int };
    NVRTC_SUCCESS
}

/// Emulates `nvrtcGetSupportedArchs`: copies [`ARCHS`].
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(archs: *mut c_int) -> c_int {
    if archs.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller sized the array with nvrtcGetNumSupportedArchs.
    unsafe { std::ptr::copy_nonoverlapping(ARCHS.as_ptr(), archs, ARCHS.len()) };
    NVRTC_SUCCESS
}

/// Emulates `nvrtcGetErrorString`: the enum name of a code (not NVRTC's sentence); unknown codes
/// give `NVRTC_ERROR unknown`.
#[no_mangle]
pub extern "C" fn nvrtcGetErrorString(result: c_int) -> *const c_char {
    let text: &'static [u8] = match result {
        0 => b"NVRTC_SUCCESS\0",
        1 => b"NVRTC_ERROR_OUT_OF_MEMORY\0",
        2 => b"NVRTC_ERROR_PROGRAM_CREATION_FAILURE\0",
        3 => b"NVRTC_ERROR_INVALID_INPUT\0",
        4 => b"NVRTC_ERROR_INVALID_PROGRAM\0",
        5 => b"NVRTC_ERROR_INVALID_OPTION\0",
        6 => b"NVRTC_ERROR_COMPILATION\0",
        7 => b"NVRTC_ERROR_BUILTIN_OPERATION_FAILURE\0",
        11 => b"NVRTC_ERROR_INTERNAL_ERROR\0",
        _ => b"NVRTC_ERROR unknown\0",
    };
    text.as_ptr().cast()
}

/// Emulates `nvrtcCreateProgram`: keeps the source, its name (`default_program` when null) and the
/// named headers.
#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut *mut Program,
    src: *const c_char,
    name: *const c_char,
    num_headers: c_int,
    headers: *const *const c_char,
    include_names: *const *const c_char,
) -> c_int {
    if prog.is_null() || num_headers < 0 {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: NUL-terminated strings per NVRTC's contract.
    let Some(source) = (unsafe { string(src) }) else {
        return NVRTC_ERROR_INVALID_INPUT;
    };
    // SAFETY: as above; a null name means "default_program".
    let name = unsafe { string(name) }.unwrap_or_else(|| "default_program".to_string());
    let mut list = Vec::new();
    for i in 0..num_headers as usize {
        if headers.is_null() || include_names.is_null() {
            return NVRTC_ERROR_INVALID_INPUT;
        }
        // SAFETY: both arrays have `num_headers` entries (NVRTC's contract).
        let (text, include) = unsafe { (string(*headers.add(i)), string(*include_names.add(i))) };
        match (text, include) {
            (Some(text), Some(include)) => list.push((include, text)),
            _ => return NVRTC_ERROR_INVALID_INPUT,
        }
    }
    let program = Box::into_raw(Box::new(Program {
        source,
        name,
        headers: list,
        log: String::new(),
        image: None,
    }));
    programs()
        .get_or_insert_with(HashSet::new)
        .insert(program as usize);
    // SAFETY: checked non-null.
    unsafe { *prog = program };
    NVRTC_SUCCESS
}

/// Emulates `nvrtcDestroyProgram`: frees the program and nulls the handle; an unknown handle is
/// `NVRTC_ERROR_INVALID_PROGRAM`.
#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut *mut Program) -> c_int {
    if prog.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: checked non-null.
    let handle = unsafe { *prog };
    let removed = programs()
        .as_mut()
        .is_some_and(|s| s.remove(&(handle as usize)));
    if !removed {
        return NVRTC_ERROR_INVALID_PROGRAM;
    }
    // SAFETY: the handle came from Box::into_raw in nvrtcCreateProgram and was live.
    drop(unsafe { Box::from_raw(handle) });
    // SAFETY: checked non-null.
    unsafe { *prog = std::ptr::null_mut() };
    NVRTC_SUCCESS
}

/// Emulates `nvrtcCompileProgram` by compiling with the host C++ compiler into a module image for
/// the emulated driver, cached (see the crate docs); compiler errors go to the log with
/// `NVRTC_ERROR_COMPILATION`.
#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(
    prog: *mut Program,
    num_options: c_int,
    options: *const *const c_char,
) -> c_int {
    let mut list = Vec::new();
    for i in 0..num_options.max(0) as usize {
        if options.is_null() {
            return NVRTC_ERROR_INVALID_INPUT;
        }
        // SAFETY: `options` has `num_options` NUL-terminated entries.
        match unsafe { string(*options.add(i)) } {
            Some(o) => list.push(o),
            None => return NVRTC_ERROR_INVALID_INPUT,
        }
    }
    // SAFETY: validated by with_program.
    unsafe {
        with_program(prog, |program| {
            program.image = None;
            match compile(program, &list) {
                Ok((image, log)) => {
                    program.image = Some(image);
                    program.log = log;
                    NVRTC_SUCCESS
                }
                Err((status, log)) => {
                    program.log = log;
                    status
                }
            }
        })
    }
}

/// Reads a sized buffer of the program: its size, or its bytes.
unsafe fn size_of_output(
    prog: *mut Program,
    size: *mut usize,
    pick: fn(&Program) -> Option<&[u8]>,
) -> c_int {
    if size.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: validated by with_program; `size` checked non-null.
    unsafe {
        with_program(prog, |p| match pick(p) {
            Some(bytes) => {
                *size = bytes.len();
                NVRTC_SUCCESS
            }
            None => NVRTC_ERROR_INVALID_PROGRAM,
        })
    }
}

unsafe fn copy_output(
    prog: *mut Program,
    out: *mut c_char,
    pick: fn(&Program) -> Option<&[u8]>,
) -> c_int {
    if out.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: validated by with_program; the caller sized `out` with the size call.
    unsafe {
        with_program(prog, |p| match pick(p) {
            Some(bytes) => {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len());
                NVRTC_SUCCESS
            }
            None => NVRTC_ERROR_INVALID_PROGRAM,
        })
    }
}

/// The log with its terminating NUL, as NVRTC hands it out.
fn log_bytes(p: &Program) -> Option<&[u8]> {
    Some(p.log.as_bytes())
}

fn image_bytes(p: &Program) -> Option<&[u8]> {
    p.image.as_deref()
}

/// Emulates `nvrtcGetProgramLogSize`: the log's length plus its NUL.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(prog: *mut Program, size: *mut usize) -> c_int {
    // SAFETY: forwarded; the size includes the NUL written by nvrtcGetProgramLog.
    let status = unsafe { size_of_output(prog, size, log_bytes) };
    if status == NVRTC_SUCCESS {
        // SAFETY: size_of_output checked `size` and wrote it.
        unsafe { *size += 1 };
    }
    status
}

/// Emulates `nvrtcGetProgramLog`: copies the log and its NUL.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: *mut Program, log: *mut c_char) -> c_int {
    // SAFETY: forwarded.
    let status = unsafe { copy_output(prog, log, log_bytes) };
    if status == NVRTC_SUCCESS {
        // SAFETY: the caller's buffer has the size nvrtcGetProgramLogSize reported (log + NUL).
        unsafe {
            with_program(prog, |p| {
                *log.add(p.log.len()) = 0;
                NVRTC_SUCCESS
            })
        }
    } else {
        status
    }
}

/// Emulates `nvrtcGetCUBINSize`: the size of the module image (a wrapped host library, not a
/// CUBIN); before a successful compile it is `NVRTC_ERROR_INVALID_PROGRAM`.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(prog: *mut Program, size: *mut usize) -> c_int {
    // SAFETY: forwarded.
    unsafe { size_of_output(prog, size, image_bytes) }
}

/// Emulates `nvrtcGetCUBIN`: copies the module image (see [`nvrtcGetCUBINSize`]).
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: *mut Program, cubin: *mut c_char) -> c_int {
    // SAFETY: forwarded.
    unsafe { copy_output(prog, cubin, image_bytes) }
}

macro_rules! not_emulated {
    ($($name:ident),* $(,)?) => {
        $(
            #[doc = concat!("`", stringify!($name), "`: not emulated; prints `tandem-cuda-emu: ",
                stringify!($name), " is not emulated` and returns `NVRTC_ERROR_INTERNAL_ERROR` \
                (the arguments are ignored).")]
            #[no_mangle]
            pub extern "C" fn $name() -> c_int {
                not_emulated(stringify!($name))
            }
        )*
    };
}

// Every other entry point cudarc 0.19.10's NVRTC bindings may load.
not_emulated!(
    nvrtcAddNameExpression,
    nvrtcGetBundledHeadersInfo,
    nvrtcGetLTOIR,
    nvrtcGetLTOIRSize,
    nvrtcGetLoweredName,
    nvrtcGetOptiXIR,
    nvrtcGetOptiXIRSize,
    nvrtcGetPTX,
    nvrtcGetPTXSize,
    nvrtcGetTileIR,
    nvrtcGetTileIRSize,
    nvrtcInstallBundledHeaders,
    nvrtcRemoveBundledHeaders,
);

/// What a compile needs from the options.
#[derive(Debug, Default)]
struct Parsed {
    arch: u32,
    defines: Vec<String>,
    includes: Vec<String>,
}

fn parse_options(options: &[String]) -> Result<Parsed, String> {
    let mut parsed = Parsed {
        arch: 52,
        ..Default::default()
    };
    let arch_of = |value: &str| -> Result<u32, String> {
        let digits = value
            .strip_prefix("sm_")
            .or_else(|| value.strip_prefix("compute_"))
            .ok_or_else(|| format!("unknown architecture {value:?}"))?;
        let arch: u32 = digits
            .trim_end_matches(['a', 'f'])
            .parse()
            .map_err(|_| format!("unknown architecture {value:?}"))?;
        if !ARCHS.contains(&(arch as c_int)) {
            return Err(format!("unsupported architecture {value:?}"));
        }
        Ok(arch)
    };
    let mut iter = options.iter();
    while let Some(option) = iter.next() {
        let o = option.as_str();
        if let Some(v) = o
            .strip_prefix("--gpu-architecture=")
            .or_else(|| o.strip_prefix("-arch="))
        {
            parsed.arch = arch_of(v)?;
        } else if o == "-arch" || o == "--gpu-architecture" {
            let v = iter.next().ok_or("-arch needs a value")?;
            parsed.arch = arch_of(v)?;
        } else if let Some(v) = o
            .strip_prefix("--define-macro=")
            .or_else(|| o.strip_prefix("-D"))
        {
            parsed.defines.push(v.to_string());
        } else if let Some(v) = o
            .strip_prefix("--include-path=")
            .or_else(|| o.strip_prefix("-I"))
        {
            parsed.includes.push(v.to_string());
        } else if o.starts_with("-std=")
            || o.starts_with("--std=")
            || o.starts_with("--ptxas-options=")
            || o.starts_with("-Xptxas")
            || o.starts_with("--fmad=")
            || o.starts_with("-fmad=")
            || o.starts_with("-dopt=")
            || matches!(
                o,
                "--use_fast_math"
                    | "-use_fast_math"
                    | "-lineinfo"
                    | "--generate-line-info"
                    | "-default-device"
                    | "--device-as-default-execution-space"
                    | "--extra-device-vectorization"
                    | "-dw"
                    | "-w"
            )
        {
            // Accepted; nothing changes in the host build.
        } else {
            return Err(format!(
                "nvrtc: error: unrecognized option {o:?} (tandem-cuda-emu's NVRTC)"
            ));
        }
    }
    Ok(parsed)
}

/// The folder compiled libraries are cached in (see the crate docs).
fn cache_dir() -> PathBuf {
    let non_empty = |v: Option<std::ffi::OsString>| v.filter(|s| !s.is_empty()).map(PathBuf::from);
    if let Some(dir) = non_empty(std::env::var_os("TANDEM_CUDA_EMU_CACHE")) {
        return dir;
    }
    if let Some(dir) = non_empty(std::env::var_os("XDG_CACHE_HOME")) {
        return dir.join("tandem/cuda-emu");
    }
    if let Some(home) = non_empty(std::env::var_os("HOME")) {
        return home.join(".cache/tandem/cuda-emu");
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("tandem-cuda-emu-{uid}"))
}

fn compiler() -> String {
    std::env::var("TANDEM_CUDA_EMU_CXX")
        .ok()
        .or_else(|| std::env::var("CXX").ok())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "c++".to_string())
}

/// A header's include name, if it is a plain relative path (no `..`, not absolute).
fn safe_relative(name: &str) -> Option<&Path> {
    let path = Path::new(name);
    let plain = path
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    (plain && !name.is_empty()).then_some(path)
}

/// Compiles `program` with `options`: the module image and the log, or a status and the log.
fn compile(program: &Program, options: &[String]) -> Result<(Vec<u8>, String), (c_int, String)> {
    let parsed = parse_options(options).map_err(|log| (NVRTC_ERROR_INVALID_OPTION, log))?;
    let cxx = compiler();
    let program_file = safe_relative(&program.name)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("program.cu"));

    let mut hasher = Sha256::new();
    for part in [
        TANDEM_HOST_H,
        TANDEM_EMU_H,
        &cxx,
        &program.name,
        &program.source,
        &CXX_FLAGS.join(" "),
        &parsed.defines.join("\u{1}"),
        &parsed.includes.join("\u{1}"),
    ] {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    for (name, text) in &program.headers {
        hasher.update((name.len() as u64).to_le_bytes());
        hasher.update(name.as_bytes());
        hasher.update((text.len() as u64).to_le_bytes());
        hasher.update(text.as_bytes());
    }
    let key: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();

    let cache = cache_dir();
    let internal = |what: String| {
        (
            NVRTC_ERROR_INTERNAL_ERROR,
            format!("tandem-cuda-emu: {what}"),
        )
    };
    std::fs::create_dir_all(&cache).map_err(|e| {
        internal(format!(
            "creating the cache folder {}: {e}",
            cache.display()
        ))
    })?;
    let library = cache.join(format!("{key}.so"));
    let log_file = cache.join(format!("{key}.log"));
    let (bytes, log) = match std::fs::read(&library) {
        Ok(bytes) => (
            bytes,
            std::fs::read_to_string(&log_file).unwrap_or_default(),
        ),
        Err(_) => build(
            program,
            &program_file,
            &parsed,
            &cxx,
            &cache,
            &key,
            &library,
            &log_file,
        )?,
    };

    let mut image = Vec::with_capacity(bytes.len() + 40);
    image.extend_from_slice(MODULE_MAGIC);
    image.extend_from_slice(&parsed.arch.to_le_bytes());
    image.extend_from_slice(&0u32.to_le_bytes());
    image.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    image.extend_from_slice(&bytes);
    Ok((image, log))
}

/// Runs the host compiler in a scratch folder and moves the library into the cache.
#[allow(clippy::too_many_arguments)]
fn build(
    program: &Program,
    program_file: &Path,
    parsed: &Parsed,
    cxx: &str,
    cache: &Path,
    key: &str,
    library: &Path,
    log_file: &Path,
) -> Result<(Vec<u8>, String), (c_int, String)> {
    let internal = |what: String| {
        (
            NVRTC_ERROR_INTERNAL_ERROR,
            format!("tandem-cuda-emu: {what}"),
        )
    };
    static SCRATCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let scratch = cache.join(format!(
        "build-{key}-{}-{}",
        std::process::id(),
        SCRATCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let write = |path: &Path, text: &str| -> Result<(), (c_int, String)> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| internal(format!("creating {}: {e}", parent.display())))?;
        }
        std::fs::write(path, text).map_err(|e| internal(format!("writing {}: {e}", path.display())))
    };
    let result = (|| {
        write(&scratch.join("tandem_host.h"), TANDEM_HOST_H)?;
        write(&scratch.join("tandem_emu.h"), TANDEM_EMU_H)?;
        write(&scratch.join(program_file), &program.source)?;
        for (name, text) in &program.headers {
            let relative = safe_relative(name).ok_or_else(|| {
                (
                    NVRTC_ERROR_INVALID_INPUT,
                    format!("tandem-cuda-emu: header include name {name:?} is not a plain relative path"),
                )
            })?;
            write(&scratch.join("include").join(relative), text)?;
        }
        let wrapper = scratch.join("wrapper.cpp");
        write(
            &wrapper,
            &format!(
                "// Generated by tandem-cuda-emu's NVRTC.\n#include \"tandem_host.h\"\n#include \"tandem_emu.h\"\n#include \"{}\"\n",
                program_file.display()
            ),
        )?;
        let output_tmp = scratch.join("module.so");
        let mut command = Command::new(cxx);
        command
            .current_dir(&scratch)
            .args(CXX_FLAGS)
            .arg(format!("-I{}", scratch.join("include").display()))
            .arg(format!("-I{}", scratch.display()));
        for include in &parsed.includes {
            command.arg(format!("-I{include}"));
        }
        for define in &parsed.defines {
            command.arg(format!("-D{define}"));
        }
        command.arg("-o").arg(&output_tmp).arg(&wrapper);
        let output = command.output().map_err(|e| {
            internal(format!(
                "running the host C++ compiler {cxx:?} (set CXX or TANDEM_CUDA_EMU_CXX): {e}"
            ))
        })?;
        let log = String::from_utf8_lossy(&output.stderr).into_owned();
        if !output.status.success() {
            return Err((NVRTC_ERROR_COMPILATION, log));
        }
        let bytes = std::fs::read(&output_tmp)
            .map_err(|e| internal(format!("reading {}: {e}", output_tmp.display())))?;
        // Into the cache by rename, so concurrent compiles never see a partial file.
        let log_tmp = scratch.join("log");
        let mut f = std::fs::File::create(&log_tmp)
            .map_err(|e| internal(format!("writing {}: {e}", log_tmp.display())))?;
        let _ = f.write_all(log.as_bytes());
        let _ = std::fs::rename(&log_tmp, log_file);
        let _ = std::fs::rename(&output_tmp, library);
        Ok((bytes, log))
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_tandem_passes_are_accepted_and_the_architecture_is_read() {
        let o: Vec<String> = [
            "-std=c++17",
            "--gpu-architecture=sm_90",
            "--ptxas-options=-v",
            "--use_fast_math",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(parse_options(&o).unwrap().arch, 90);
        let bad = vec!["--frobnicate".to_string()];
        assert!(parse_options(&bad).unwrap_err().contains("--frobnicate"));
        let arch = vec!["--gpu-architecture=sm_31".to_string()];
        assert!(parse_options(&arch).unwrap_err().contains("sm_31"));
    }

    #[test]
    fn header_names_must_stay_inside_the_build_folder() {
        assert!(safe_relative("tandem.cuh").is_some());
        assert!(safe_relative("sub/x.cuh").is_some());
        assert!(safe_relative("../x.cuh").is_none());
        assert!(safe_relative("/etc/passwd").is_none());
    }
}
