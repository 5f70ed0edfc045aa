//! Where tandem's GPU tests run: on the real GPU when this machine has one, otherwise on the
//! CUDA emulator (`cuda-emu/`: an emulated driver, NVRTC, cuBLAS, cuBLASLt, cuDNN and NCCL that
//! run tandem's unchanged CUDA code on the host), so that `cargo test --workspace` runs every GPU
//! test on every machine.
//!
//! Every GPU test calls [`select_cuda`] before its first CUDA call. Only tests call it: a user's
//! program never picks the emulator by itself (its libraries are built as
//! `libtandem_cuda_emu*.so`, and only a folder holding copies under CUDA's names, put in
//! `TANDEM_CUDA_LIBS`, selects them — which is what [`select_cuda`] does).
//!
//! The choice, made once per process:
//! - `TANDEM_TEST_CUDA=gpu`: the real GPU, and a test panics when there is none (the GPU bundle
//!   sets it, so a broken driver on a GPU machine fails instead of quietly emulating);
//! - `TANDEM_TEST_CUDA=emulator`: the emulator, even on a machine with a GPU;
//! - `TANDEM_TEST_CUDA=skip`: no CUDA; each GPU test prints a skip line and passes;
//! - unset: the GPU if the real driver loads (through tandem's own library search) and reports
//!   a device, else the emulator.
//!
//! On the emulator the stream sanitizer is switched on (`TANDEM_CUDA_SANITIZER=1`) unless the
//! variable is already set, so every GPU test also checks stream ordering.
//!
//! The emulator's libraries are found beside the test binary: this crate depends on the
//! emulator's crates, so cargo builds their shared libraries into `target/<profile>/deps` before
//! any test that uses it.
//!
//! The emulated NCCL is copied as `libnccl.so.2`, the name tandem's search opens, into the
//! folder that comes first in `TANDEM_CUDA_LIBS`, so a GPU test on the emulator finds it before
//! a real NCCL later in that list (CI installs one for `dist/tests/nccl_id.rs`, which does not
//! select the emulator). Rank processes a test starts inherit the variables [`select_cuda`]
//! set (`TANDEM_CUDA_LIBS`, `TANDEM_CUDA_SANITIZER`, `TANDEM_KERNEL_CACHE`), so they run on
//! the same emulator; a test that starts a program without having selected the emulator puts
//! [`emulator_folder`] in that child's `TANDEM_CUDA_LIBS` itself.

#![warn(missing_docs)]

pub mod emulator_counters;

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tandem_core::cuda::libs::{self, CudaLibrary, SearchPaths};

/// The variable that overrides the choice: `gpu`, `emulator` or `skip`.
pub const TANDEM_TEST_CUDA: &str = "TANDEM_TEST_CUDA";

/// The variable that switches tandem's stream sanitizer on.
const TANDEM_CUDA_SANITIZER: &str = "TANDEM_CUDA_SANITIZER";

/// Where this process's GPU tests run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaTarget {
    /// A real CUDA device, through the real driver.
    Gpu,
    /// The CUDA emulator (`cuda-emu/`), on the host.
    Emulator,
}

/// The file names cargo gives the emulator's libraries, and the names tandem's search looks
/// for.
const EMULATOR_LIBRARIES: [(&str, &str); 6] = [
    ("libtandem_cuda_emu.so", "libcuda.so"),
    ("libtandem_cuda_emu_nvrtc.so", "libnvrtc.so"),
    ("libtandem_cuda_emu_cublas.so", "libcublas.so"),
    ("libtandem_cuda_emu_cublaslt.so", "libcublasLt.so"),
    // The file name cuDNN's packages ship; its SONAME is `libcudnn.so` (cuda-emu/cudnn/build.rs).
    ("libtandem_cuda_emu_cudnn.so", "libcudnn.so.9"),
    ("libtandem_cuda_emu_nccl.so", "libnccl.so.2"),
];

/// Where this process's GPU tests run, chosen on the first call (see the module's doc); `None`,
/// after printing a `skipped: …` line, when they do not run at all (`TANDEM_TEST_CUDA=skip`).
///
/// Call it before the test's first CUDA call: tandem keeps the libraries it found for the life
/// of the process, so the emulator must be in `TANDEM_CUDA_LIBS` before then.
///
/// Panics when the choice cannot be honoured: `TANDEM_TEST_CUDA=gpu` without a device, an
/// unknown value, or an emulator that does not load.
pub fn select_cuda() -> Option<CudaTarget> {
    static TARGET: OnceLock<Result<Option<CudaTarget>, String>> = OnceLock::new();
    let target = TARGET
        .get_or_init(choose)
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}"));
    if target.is_none() {
        println!("skipped: {TANDEM_TEST_CUDA}=skip");
    }
    *target
}

/// Whether this process's GPU tests run on the emulator (selecting where they run on the first
/// call, as [`select_cuda`] does).
pub fn on_emulator() -> bool {
    select_cuda() == Some(CudaTarget::Emulator)
}

/// For a test that needs what the emulator does not have yet (an emulated NCCL, …):
/// `true`, after printing `skipped on the CUDA emulator: needs <needs>`, when this process runs
/// on the emulator; the test then returns.
pub fn skip_on_emulator(needs: &str) -> bool {
    let skip = on_emulator();
    if skip {
        println!("skipped on the CUDA emulator: needs {needs}");
    }
    skip
}

fn choose() -> Result<Option<CudaTarget>, String> {
    let wanted = std::env::var(TANDEM_TEST_CUDA).unwrap_or_default();
    let target = match wanted.as_str() {
        "skip" => return Ok(None),
        "emulator" => CudaTarget::Emulator,
        "gpu" => match probe_driver() {
            Probe::Gpu => CudaTarget::Gpu,
            Probe::Emulator => {
                return Err(format!(
                    "{TANDEM_TEST_CUDA}=gpu, but the CUDA driver tandem finds is the emulator \
                     (TANDEM_CUDA_LIBS={:?})",
                    std::env::var_os(libs::TANDEM_CUDA_LIBS).unwrap_or_default()
                ))
            }
            Probe::None(reason) => {
                return Err(format!(
                    "{TANDEM_TEST_CUDA}=gpu, but there is no GPU: {reason}"
                ))
            }
        },
        "" => match probe_driver() {
            Probe::Gpu => CudaTarget::Gpu,
            Probe::Emulator | Probe::None(_) => CudaTarget::Emulator,
        },
        other => {
            return Err(format!(
                "{TANDEM_TEST_CUDA}={other:?}: expected gpu, emulator or skip"
            ))
        }
    };
    if target == CudaTarget::Emulator {
        use_emulator();
        // Every GPU test on the emulator also checks stream ordering. Set before any CUDA call
        // (the `OnceLock` in `select_cuda`), as `use_emulator` sets the library folder.
        if std::env::var_os(TANDEM_CUDA_SANITIZER).is_none() {
            std::env::set_var(TANDEM_CUDA_SANITIZER, "1");
        }
    }
    if !tandem_core::cuda::is_available() {
        return Err(format!(
            "the GPU tests chose {target:?}, but tandem finds no CUDA device: {}",
            tandem_core::cuda::device(0)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        ));
    }
    Ok(Some(target))
}

/// What the real driver, found by tandem's own search, says.
enum Probe {
    /// It loads and reports at least one device.
    Gpu,
    /// The driver found is the emulator (someone put it in `TANDEM_CUDA_LIBS` by hand).
    Emulator,
    /// No usable device, and why.
    None(String),
}

fn probe_driver() -> Probe {
    let found = match libs::search(CudaLibrary::Driver, &SearchPaths::from_env()) {
        Ok(found) => found,
        Err(reason) => return Probe::None(reason),
    };
    let library = found.library();
    // SAFETY: only the symbol's presence is read.
    if unsafe { library.get::<*mut std::ffi::c_void>(b"tandem_cuda_emu_last_fault") }.is_ok() {
        return Probe::Emulator;
    }
    type CuInit = unsafe extern "C" fn(u32) -> c_int;
    type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: both are the driver API's entry points with these C signatures.
    let (init, get_count) = match unsafe {
        (
            library.get::<CuInit>(b"cuInit"),
            library.get::<CuDeviceGetCount>(b"cuDeviceGetCount"),
        )
    } {
        (Ok(init), Ok(get_count)) => (init, get_count),
        _ => return Probe::None(format!("{} lacks cuInit", found.path().display())),
    };
    // SAFETY: cuInit takes flags (0) and may be called more than once.
    let status = unsafe { init(0) };
    if status != 0 {
        // Close it: the emulated driver must be the only libcuda in the process, since cudarc
        // opens the driver by name and would otherwise get this one.
        drop(found);
        return Probe::None(format!("cuInit failed with CUDA error {status}"));
    }
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid place for the result.
    let status = unsafe { get_count(&mut count) };
    if status != 0 || count < 1 {
        drop(found);
        return Probe::None(format!(
            "the driver reports {count} devices (status {status})"
        ));
    }
    // Keep the real driver loaded: tandem opens the same file next, and unloading a driver
    // that has been initialised is not safe.
    std::mem::forget(found);
    Probe::Gpu
}

/// Copies the emulator's libraries, once per process, into a fresh folder under the names
/// tandem's library search looks for (`libcuda.so`, `libnvrtc.so`, `libcublas.so`,
/// `libcublasLt.so`, `libcudnn.so.9`, `libnccl.so.2`, and NVRTC's builtins companion
/// `libnvrtc-builtins.so.13.99`) and puts that folder first in `TANDEM_CUDA_LIBS`. Returns the
/// folder.
///
/// [`select_cuda`] calls it when the tests run on the emulator (and also switches the stream
/// sanitizer on); the emulator's own tests call it directly, without the sanitizer, since some
/// of them misuse memory on purpose. Call it before any CUDA call.
pub fn use_emulator() -> &'static Path {
    static FOLDER: OnceLock<PathBuf> = OnceLock::new();
    FOLDER.get_or_init(|| {
        let dir = emulator_folder();
        let mut folders = vec![dir.clone()];
        if let Some(old) = std::env::var_os(libs::TANDEM_CUDA_LIBS) {
            folders.extend(std::env::split_paths(&old));
        }
        // tandem's kernel cache is keyed by the NVRTC version, not by the emulation's headers,
        // so an image compiled against an older `tandem_host.h` would be loaded again (the
        // emulated driver refuses it): a fresh cache per process. The emulated NVRTC's own
        // cache, keyed by the headers too, keeps the compiles cheap.
        let kernels = dir.join("kernel-cache");
        std::fs::create_dir_all(&kernels).expect("the kernel cache folder");
        // Test threads may run already; they only read these variables through tandem's CUDA
        // code, which no test reaches before this call returns (the `OnceLock`).
        std::env::set_var("TANDEM_KERNEL_CACHE", &kernels);
        std::env::set_var(
            libs::TANDEM_CUDA_LIBS,
            std::env::join_paths(folders).expect("paths without ':'"),
        );
        dir
    })
}

/// A fresh folder holding the emulator's libraries under CUDA's names (as
/// [`use_emulator`] sets up), without touching this process's environment: for a test that runs
/// a program on the emulator by putting the folder in that child's `TANDEM_CUDA_LIBS` only. The
/// caller removes it.
pub fn emulator_folder() -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("tandem-cuda-emu-libs")
        .tempdir()
        .expect("a temporary folder")
        .keep();
    // Hard links (copies where the folders are on different file systems), not symbolic
    // links: tandem resolves the library it loaded to its real path and looks for NVRTC's
    // builtins beside it. Each test process keeps its folder, so copies would leave ~32 MB
    // behind per process; hard links leave only the names.
    for (built_name, cuda_name) in EMULATOR_LIBRARIES {
        let (from, to) = (built(built_name), dir.join(cuda_name));
        std::fs::hard_link(&from, &to)
            .or_else(|_| std::fs::copy(&from, &to).map(drop))
            .unwrap_or_else(|e| panic!("copy {built_name}: {e}"));
    }
    std::os::unix::fs::symlink("libnvrtc.so", dir.join("libnvrtc-builtins.so.13.99"))
        .expect("link NVRTC's builtins");
    dir
}

/// An emulator library as cargo built it: in the test binary's folder (`target/<profile>/deps`,
/// refreshed by every `cargo test`) or its parent (refreshed by `cargo build`).
fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    let candidates = [deps.join(name), deps.parent().unwrap_or(deps).join(name)];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "the emulator library {name} was not built beside the test binary (looked at \
                 {candidates:?}); run the tests through cargo, or set {TANDEM_TEST_CUDA}=gpu \
                 (or skip) where the tests were copied without it"
            )
        })
}
