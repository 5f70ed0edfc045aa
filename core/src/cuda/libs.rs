//! Finding the CUDA libraries at run time, so that a missing one is an error and never a panic.
//!
//! tandem is built against cudarc with `dynamic-loading`: nothing CUDA is linked, and each
//! library is opened at first use. cudarc panics when a library or one of its symbols is
//! missing, so tandem looks for the library itself first, through [`ensure`], and turns absence
//! into [`Error::DeviceUnavailable`] naming the library and every place searched.
//!
//! # Search order
//!
//! For each library, the first of these that holds a loadable copy wins:
//!
//! 1. the folders in `TANDEM_CUDA_LIBS`, a `:`-separated list (for example the `nvidia/cu13/lib`,
//!    `nvidia/cudnn/lib` and `nvidia/nccl/lib` folders of a Python environment with NVIDIA's pip
//!    packages);
//! 2. the dynamic loader's own search (`LD_LIBRARY_PATH`, the `ld.so` cache, `/lib`, `/usr/lib`),
//!    by the same file names cudarc asks for;
//! 3. `$CUDA_HOME`, then `$CUDA_PATH`: their `lib64`, `lib` and `targets/x86_64-linux/lib`;
//! 4. the usual install folders: `/usr/local/cuda/lib64`, `/usr/local/cuda/targets/x86_64-linux/lib`,
//!    `/usr/local/nvidia/lib64`, `/usr/local/nvidia/lib`, `/usr/lib/x86_64-linux-gnu`, `/usr/lib64`,
//!    `/usr/lib/wsl/lib` and `/opt/cuda/lib64`.
//!
//! In a folder, the file names tried are cudarc's (`libcublas.so`, …, `libcublas.so.13`,
//! `libcublas.so.12`, …), plus `libnccl.so.2` for NCCL. A library found in a folder is opened by
//! its absolute path; glibc then answers cudarc's later open-by-name with that same library,
//! because it matches the name against the SONAME of every library already loaded. [`ensure`]
//! checks that this holds (that cudarc's own search lands on the library tandem found) and fails
//! with an explanation when it does not. NCCL is the exception: cudarc asks for `libnccl.so`, which
//! NVIDIA's packages do not ship, so tandem exposes the opened `libnccl.so.2` through [`library`]
//! for its own bindings. For NVRTC, the builtins library it opens by name at compile time
//! (`libnvrtc-builtins.so.<major>.<minor>`) is opened as well, from NVRTC's own folder.
//!
//! The search runs once per library and process; its result, found or not, is kept.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::{Device, Error, Result};

/// The environment variable holding extra folders to search first (`:`-separated).
pub const TANDEM_CUDA_LIBS: &str = "TANDEM_CUDA_LIBS";

/// A CUDA library tandem opens at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The driver API, `libcuda.so.1` (installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler, `libnvrtc.so.13`, with its builtins library.
    Nvrtc,
    /// cuBLAS, `libcublas.so.13`.
    Cublas,
    /// cuBLASLt, `libcublasLt.so.13`.
    CublasLt,
    /// cuDNN, `libcudnn.so.9`.
    Cudnn,
    /// NCCL, `libnccl.so.2`.
    Nccl,
}

impl CudaLibrary {
    /// Every library, in a fixed order.
    pub const ALL: [CudaLibrary; 6] = [
        CudaLibrary::Driver,
        CudaLibrary::Nvrtc,
        CudaLibrary::Cublas,
        CudaLibrary::CublasLt,
        CudaLibrary::Cudnn,
        CudaLibrary::Nccl,
    ];

    /// The library's name in messages, with the file a CUDA 13 installation has.
    pub fn describe(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "the CUDA driver (libcuda.so.1)",
            CudaLibrary::Nvrtc => "NVRTC (libnvrtc.so.13)",
            CudaLibrary::Cublas => "cuBLAS (libcublas.so.13)",
            CudaLibrary::CublasLt => "cuBLASLt (libcublasLt.so.13)",
            CudaLibrary::Cudnn => "cuDNN (libcudnn.so.9)",
            CudaLibrary::Nccl => "NCCL (libnccl.so.2)",
        }
    }

    /// What to do when the library is missing: how it is installed, and the folder of NVIDIA's
    /// pip packages that holds it (for [`TANDEM_CUDA_LIBS`]).
    fn remedy(self) -> (&'static str, Option<&'static str>) {
        match self {
            CudaLibrary::Driver => ("the NVIDIA driver", None),
            CudaLibrary::Nvrtc | CudaLibrary::Cublas | CudaLibrary::CublasLt => (
                "the CUDA 13 toolkit",
                Some("<site-packages>/nvidia/cu13/lib"),
            ),
            CudaLibrary::Cudnn => ("cuDNN 9", Some("<site-packages>/nvidia/cudnn/lib")),
            CudaLibrary::Nccl => ("NCCL 2", Some("<site-packages>/nvidia/nccl/lib")),
        }
    }

    /// The stem cudarc builds its file names from.
    fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::Cublas => "cublas",
            CudaLibrary::CublasLt => "cublasLt",
            CudaLibrary::Cudnn => "cudnn",
            CudaLibrary::Nccl => "nccl",
        }
    }

    /// A symbol every version of the library exports; finding it tells that the file is the
    /// library and not something else with its name.
    fn probe_symbol(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuInit",
            CudaLibrary::Nvrtc => "nvrtcVersion",
            CudaLibrary::Cublas => "cublasCreate_v2",
            CudaLibrary::CublasLt => "cublasLtCreate",
            CudaLibrary::Cudnn => "cudnnGetVersion",
            CudaLibrary::Nccl => "ncclGetVersion",
        }
    }

    /// The file names tried, in order: cudarc's own list, plus `libnccl.so.2` for NCCL.
    pub fn file_names(self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for name in cudarc::get_lib_name_candidates(self.stem()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        if self == CudaLibrary::Nccl {
            names.push("libnccl.so.2".to_string());
        }
        names
    }

    /// Whether cudarc opens this library itself (by name), so its search must agree with ours.
    fn opened_by_cudarc(self) -> bool {
        self != CudaLibrary::Nccl
    }
}

/// Where to look, in order. [`SearchPaths::from_env`] is what tandem uses; tests build their own.
#[derive(Clone, Debug, Default)]
pub struct SearchPaths {
    /// The folders of `TANDEM_CUDA_LIBS`, searched first.
    pub tandem_cuda_libs: Vec<PathBuf>,
    /// Whether to ask the dynamic loader (plain `dlopen` by name).
    pub loader: bool,
    /// `$CUDA_HOME`, if set.
    pub cuda_home: Option<PathBuf>,
    /// `$CUDA_PATH`, if set.
    pub cuda_path: Option<PathBuf>,
    /// The usual install folders, searched last.
    pub usual: Vec<PathBuf>,
}

impl SearchPaths {
    /// The search order documented at the top of this module, read from the environment.
    pub fn from_env() -> Self {
        let non_empty = |v: Option<OsString>| v.filter(|s| !s.is_empty()).map(PathBuf::from);
        SearchPaths {
            tandem_cuda_libs: std::env::var_os(TANDEM_CUDA_LIBS)
                .map(|v| {
                    std::env::split_paths(&v)
                        .filter(|p| !p.as_os_str().is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            loader: true,
            cuda_home: non_empty(std::env::var_os("CUDA_HOME")),
            cuda_path: non_empty(std::env::var_os("CUDA_PATH")),
            usual: [
                "/usr/local/cuda/lib64",
                "/usr/local/cuda/targets/x86_64-linux/lib",
                "/usr/local/nvidia/lib64",
                "/usr/local/nvidia/lib",
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib64",
                "/usr/lib/wsl/lib",
                "/opt/cuda/lib64",
            ]
            .iter()
            .map(PathBuf::from)
            .collect(),
        }
    }

    /// The folders under a CUDA installation root that may hold its libraries.
    fn root_folders(root: &Path) -> [PathBuf; 3] {
        [
            root.join("lib64"),
            root.join("lib"),
            root.join("targets/x86_64-linux/lib"),
        ]
    }
}

/// A library tandem has opened and keeps open for the life of the process.
#[derive(Debug)]
pub struct LoadedLibrary {
    path: PathBuf,
    library: libloading::Library,
    /// Libraries opened alongside (NVRTC's builtins), kept open so that later lookups by name
    /// find them.
    _companions: Vec<libloading::Library>,
}

impl LoadedLibrary {
    /// The file the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open library, for binding symbols.
    pub fn library(&self) -> &libloading::Library {
        &self.library
    }
}

/// Checks that `lib` can be used, searching for it on the first call; afterwards this only
/// reads the kept result. Call it before any cudarc call into that library.
///
/// Errors with [`Error::DeviceUnavailable`] for `device`, naming the library and every place
/// searched, when it is missing or cannot be loaded.
pub fn ensure(lib: CudaLibrary, device: Device) -> Result<()> {
    loaded(lib, device).map(|_| ())
}

/// The file `lib` is loaded from (searching for it on first use).
pub fn locate(lib: CudaLibrary, device: Device) -> Result<PathBuf> {
    loaded(lib, device).map(|l| l.path.clone())
}

/// The open library, for tandem's own bindings (NCCL, NVRTC).
pub fn library(lib: CudaLibrary, device: Device) -> Result<&'static libloading::Library> {
    loaded(lib, device).map(|l| &l.library)
}

fn loaded(lib: CudaLibrary, device: Device) -> Result<&'static LoadedLibrary> {
    static SLOTS: [OnceLock<std::result::Result<LoadedLibrary, String>>; 6] =
        [const { OnceLock::new() }; 6];
    let index = CudaLibrary::ALL
        .iter()
        .position(|&l| l == lib)
        .expect("ALL lists every library");
    SLOTS[index]
        .get_or_init(|| {
            let found = search(lib, &SearchPaths::from_env())?;
            if lib.opened_by_cudarc() {
                check_cudarc_agrees(lib, &found)?;
            }
            Ok(found)
        })
        .as_ref()
        .map_err(|reason| Error::DeviceUnavailable {
            device,
            reason: reason.clone(),
        })
}

/// Searches `paths` for `lib` and opens it. The error text names the library, every place
/// searched and what was found there.
pub fn search(lib: CudaLibrary, paths: &SearchPaths) -> std::result::Result<LoadedLibrary, String> {
    let names = lib.file_names();
    let mut searched: Vec<String> = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut try_folders = |label: &str, folders: &[PathBuf], searched: &mut Vec<String>| {
        let mut notes = Vec::new();
        for folder in folders {
            if seen.contains(folder) {
                continue;
            }
            seen.push(folder.clone());
            let mut note = format!("{}: no such library", folder.display());
            for name in &names {
                let candidate = folder.join(name);
                if !candidate.exists() {
                    continue;
                }
                match open(lib, &candidate) {
                    Ok(found) => return Some(found),
                    Err(e) => note = format!("{}: could not be loaded ({e})", candidate.display()),
                }
            }
            notes.push(note);
        }
        searched.push(format!("{label}: {}", notes.join("; ")));
        None
    };

    // 1. TANDEM_CUDA_LIBS.
    if paths.tandem_cuda_libs.is_empty() {
        searched.push(format!("{TANDEM_CUDA_LIBS}: not set"));
    } else if let Some(found) =
        try_folders(TANDEM_CUDA_LIBS, &paths.tandem_cuda_libs, &mut searched)
    {
        return with_companions(lib, found);
    }

    // 2. The dynamic loader, by cudarc's names.
    if paths.loader {
        let mut failures = Vec::new();
        for name in &names {
            match open(lib, Path::new(name)) {
                Ok(found) => return with_companions(lib, found),
                Err(e) if !e.contains("No such file") => failures.push(format!("{name}: {e}")),
                Err(_) => {}
            }
        }
        let ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let mut note = format!(
            "the dynamic loader (LD_LIBRARY_PATH={ld_path:?}, the ld.so cache, /lib, /usr/lib) by \
             the names {}: not found",
            names.join(", ")
        );
        if !failures.is_empty() {
            note.push_str(&format!(" ({})", failures.join("; ")));
        }
        searched.push(note);
    }

    // 3. CUDA_HOME and CUDA_PATH.
    for (var, root) in [
        ("CUDA_HOME", &paths.cuda_home),
        ("CUDA_PATH", &paths.cuda_path),
    ] {
        match root {
            None => searched.push(format!("{var}: not set")),
            Some(root) => {
                let folders = SearchPaths::root_folders(root);
                if let Some(found) = try_folders(var, &folders, &mut searched) {
                    return with_companions(lib, found);
                }
            }
        }
    }

    // 4. The usual install folders.
    if !paths.usual.is_empty() {
        if let Some(found) = try_folders("usual install folders", &paths.usual, &mut searched) {
            return with_companions(lib, found);
        }
    }

    Err(not_found(lib, &searched))
}

/// The message for a library that was searched for everywhere and not found: one short line
/// that says what to do, then every place searched, one a line.
fn not_found(lib: CudaLibrary, searched: &[String]) -> String {
    let (install, pip_folder) = lib.remedy();
    let pip = pip_folder
        .map(|folder| format!(" (for NVIDIA's pip packages: {folder})"))
        .unwrap_or_default();
    let mut text = format!(
        "{} was not found: install {install}, or set {TANDEM_CUDA_LIBS} to the folder holding \
         it{pip}\nSearched, in order:",
        lib.describe(),
    );
    for (i, place) in searched.iter().enumerate() {
        text.push_str(&format!("\n  ({}) {place}", i + 1));
    }
    text
}

/// Opens one file (a path with a `/`) or name (through the loader's search) and checks that it
/// exports the library's probe symbol.
fn open(lib: CudaLibrary, file: &Path) -> std::result::Result<LoadedLibrary, String> {
    // SAFETY: loading a CUDA library runs its initialisers; NVIDIA's libraries have no
    // initialisers with preconditions on the caller.
    let library =
        unsafe { libloading::Library::new(file.as_os_str()) }.map_err(|e| describe(&e))?;
    let probe = lib.probe_symbol();
    // SAFETY: the symbol is only read as an address, never called.
    let address = unsafe { library.get::<*mut std::ffi::c_void>(probe.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("it does not export {probe}: {}", describe(&e)))?;
    let path = loaded_path(address).unwrap_or_else(|| file.to_path_buf());
    Ok(LoadedLibrary {
        path,
        library,
        _companions: Vec::new(),
    })
}

/// A libloading error with its cause (its own message is only "dlopen failed").
fn describe(error: &libloading::Error) -> String {
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

/// The file a loaded symbol lives in, as the loader resolved it.
#[cfg(unix)]
fn loaded_path(address: *mut std::ffi::c_void) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let ok = unsafe { libc::dladdr(address, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, alive while the library
    // stays loaded (we hold it).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes()));
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

#[cfg(not(unix))]
fn loaded_path(_address: *mut std::ffi::c_void) -> Option<PathBuf> {
    None
}

/// Opens what a library needs beside itself: NVRTC's builtins library, which NVRTC opens by
/// name (`libnvrtc-builtins.so.<major>.<minor>`) when it compiles.
fn with_companions(
    lib: CudaLibrary,
    mut found: LoadedLibrary,
) -> std::result::Result<LoadedLibrary, String> {
    if lib != CudaLibrary::Nvrtc {
        return Ok(found);
    }
    let (major, minor) = nvrtc_version(&found.library)?;
    let name = format!("libnvrtc-builtins.so.{major}.{minor}");
    let beside = found.path.parent().map(|folder| folder.join(&name));
    let mut tried = Vec::new();
    for candidate in beside
        .iter()
        .map(PathBuf::as_path)
        .chain([Path::new(&name)])
    {
        // SAFETY: as in `open`.
        match unsafe { libloading::Library::new(candidate.as_os_str()) } {
            Ok(builtins) => {
                found._companions.push(builtins);
                return Ok(found);
            }
            Err(e) => tried.push(format!("{}: {}", candidate.display(), describe(&e))),
        }
    }
    Err(format!(
        "NVRTC {major}.{minor} was found at {}, but its builtins library {name} was not \
         ({}); install it beside NVRTC (the pip package nvidia-cuda-nvrtc ships both)",
        found.path.display(),
        tried.join("; ")
    ))
}

/// NVRTC's version, through the library just opened.
fn nvrtc_version(library: &libloading::Library) -> std::result::Result<(i32, i32), String> {
    type NvrtcVersion = unsafe extern "C" fn(*mut i32, *mut i32) -> i32;
    // SAFETY: nvrtcVersion has this signature in every NVRTC release.
    let version = unsafe { library.get::<NvrtcVersion>(b"nvrtcVersion") }
        .map_err(|e| format!("NVRTC does not export nvrtcVersion: {e}"))?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for a write of an i32.
    let status = unsafe { version(&mut major, &mut minor) };
    if status != 0 {
        return Err(format!("nvrtcVersion failed with status {status}"));
    }
    Ok((major, minor))
}

/// Checks that cudarc's own open-by-name lands on the library tandem found. cudarc tries its
/// names in order and takes the first that opens; that one must be ours, or cudarc would call
/// into a library tandem never checked.
fn check_cudarc_agrees(lib: CudaLibrary, ours: &LoadedLibrary) -> std::result::Result<(), String> {
    let mut names = lib.file_names();
    names.retain(|n| n != "libnccl.so.2");
    for name in &names {
        // cudarc takes the first name that opens, whatever it is.
        // SAFETY: as in `open`.
        if unsafe { libloading::Library::new(name) }.is_err() {
            continue;
        }
        let theirs = open(lib, Path::new(name)).map_err(|e| {
            format!(
                "{} was found at {}, but cudarc, which opens it by the name {name}, would get a \
                 library that {e}",
                lib.describe(),
                ours.path.display()
            )
        })?;
        let same = |a: &Path, b: &Path| {
            std::fs::canonicalize(a)
                .ok()
                .zip(std::fs::canonicalize(b).ok())
                .is_some_and(|(a, b)| a == b)
        };
        if same(&theirs.path, &ours.path) {
            return Ok(());
        }
        return Err(format!(
            "{} was found at {}, but cudarc, which opens it by the name {name}, would get {} \
             (first on the dynamic loader's path); point {TANDEM_CUDA_LIBS} at the folder of the \
             library the loader finds, or remove that one from the loader's path",
            lib.describe(),
            ours.path.display(),
            theirs.path.display()
        ));
    }
    Err(format!(
        "{} was found at {}, but cudarc cannot open it by any of its names ({}): the file's SONAME \
         matches none of them",
        lib.describe(),
        ours.path.display(),
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_dir() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary folder")
    }

    #[test]
    fn missing_library_names_the_library_and_every_place_searched() {
        let dir = empty_dir();
        let paths = SearchPaths {
            tandem_cuda_libs: vec![dir.path().to_path_buf()],
            loader: false,
            cuda_home: Some(dir.path().join("cuda-home")),
            cuda_path: None,
            usual: vec![dir.path().join("usual")],
        };
        let err = search(CudaLibrary::Driver, &paths).unwrap_err();
        assert!(err.contains("the CUDA driver (libcuda.so.1)"), "{err}");
        assert!(err.contains("\n  (1) TANDEM_CUDA_LIBS: "), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(err.contains("TANDEM_CUDA_LIBS"), "{err}");
        assert!(err.contains("cuda-home/lib64"), "{err}");
        assert!(err.contains("cuda-home/targets/x86_64-linux/lib"), "{err}");
        assert!(err.contains("CUDA_PATH: not set"), "{err}");
        assert!(err.contains("usual"), "{err}");
    }

    #[test]
    fn a_missing_library_leads_with_one_short_line_saying_what_to_do() {
        let dir = empty_dir();
        let paths = SearchPaths {
            tandem_cuda_libs: vec![dir.path().join("a"), dir.path().join("b")],
            loader: false,
            cuda_home: Some(dir.path().join("cuda-home")),
            cuda_path: Some(dir.path().join("cuda-path")),
            usual: SearchPaths::from_env().usual,
        };
        for lib in [CudaLibrary::Driver, CudaLibrary::Cudnn, CudaLibrary::Nccl] {
            let Err(reason) = search(lib, &paths) else {
                continue; // installed in a usual folder on this machine
            };
            // As the user sees it: wrapped into the device error.
            let err = Error::DeviceUnavailable {
                device: Device::Cuda(0),
                reason,
            }
            .to_string();
            let first = err.lines().next().unwrap_or_default();
            assert!(first.len() <= 200, "{} characters: {first}", first.len());
            assert!(
                first.contains(lib.describe())
                    && first.contains("install ")
                    && first.contains("set TANDEM_CUDA_LIBS to the folder holding it"),
                "{first}"
            );
            // The details follow, one place a line.
            let rest: Vec<&str> = err.lines().skip(1).collect();
            assert_eq!(rest[0], "Searched, in order:", "{err}");
            assert!(rest[1].starts_with("  (1) TANDEM_CUDA_LIBS: "), "{err}");
            assert!(rest.iter().any(|l| l.contains("cuda-path/lib64")), "{err}");
        }
    }

    #[test]
    fn a_file_that_is_not_a_library_is_reported_not_loaded() {
        let dir = empty_dir();
        std::fs::write(dir.path().join("libnvrtc.so.13"), b"not an ELF file").unwrap();
        let paths = SearchPaths {
            tandem_cuda_libs: vec![dir.path().to_path_buf()],
            ..SearchPaths::default()
        };
        let err = search(CudaLibrary::Nvrtc, &paths).unwrap_err();
        assert!(err.contains("libnvrtc.so.13: could not be loaded"), "{err}");
    }

    #[test]
    fn nccl_is_searched_under_the_name_its_packages_ship() {
        assert!(CudaLibrary::Nccl
            .file_names()
            .contains(&"libnccl.so.2".to_string()));
        // cudarc's own list, with CUDA 13 names, for the others.
        assert!(CudaLibrary::Cublas
            .file_names()
            .contains(&"libcublas.so.13".to_string()));
        assert!(CudaLibrary::Driver
            .file_names()
            .contains(&"libcuda.so.1".to_string()));
    }

    #[test]
    fn the_driver_on_a_machine_without_one_is_an_error_not_a_panic() {
        // On machines with a driver this checks nothing but that the call returns.
        match ensure(CudaLibrary::Driver, Device::Cuda(0)) {
            Ok(()) => eprintln!(
                "this machine has a CUDA driver; the missing-driver case is untested here"
            ),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("cuda:0") && msg.contains("libcuda.so.1"),
                    "{msg}"
                );
                assert!(msg.contains("dynamic loader"), "{msg}");
            }
        }
    }
}
