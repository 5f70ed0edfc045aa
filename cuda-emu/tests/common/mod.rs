//! Points tandem's library search at the emulated driver and NVRTC.
//!
//! cargo builds the two shared libraries before these tests (the driver is this package's
//! library; the NVRTC is a dev-dependency) into the folder of the test binary
//! (`target/<profile>/deps`) and its parent. [`use_emulator`] copies them, once per process,
//! into a fresh folder under the names tandem's search looks for (`libcuda.so`, `libnvrtc.so`
//! and NVRTC's builtins companion `libnvrtc-builtins.so.13.99`), and puts that folder first in
//! `TANDEM_CUDA_LIBS`, before any CUDA call. Everything is found at run time, relative to the
//! test binary, so a copied test bundle works on another machine too.
//!
//! CI can do the same by hand: `cargo build -p tandem-cuda-emu -p tandem-cuda-emu-nvrtc`, copy
//! `target/debug/libtandem_cuda_emu.so` to `<dir>/libcuda.so` and
//! `target/debug/libtandem_cuda_emu_nvrtc.so` to `<dir>/libnvrtc.so`, link
//! `<dir>/libnvrtc-builtins.so.13.99` to the latter, and export `TANDEM_CUDA_LIBS=<dir>:…`.
//! (Take them right after that `cargo build`: a `cargo test` refreshes only the copies in
//! `target/debug/deps`, which is why [`use_emulator`] looks there first.)

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The file names cargo gives the driver and NVRTC, and the names tandem's search looks for.
const DRIVER_AND_NVRTC: [(&str, &str); 2] = [
    ("libtandem_cuda_emu.so", "libcuda.so"),
    ("libtandem_cuda_emu_nvrtc.so", "libnvrtc.so"),
];

/// The same for cuBLAS and cuBLASLt, for the tests of the emulated cuBLAS (which has them as
/// its package and a dev-dependency, so cargo builds them beside its test binaries).
pub const CUBLAS: [(&str, &str); 2] = [
    ("libtandem_cuda_emu_cublas.so", "libcublas.so"),
    ("libtandem_cuda_emu_cublaslt.so", "libcublasLt.so"),
];

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
                 {candidates:?}); run the tests through cargo"
            )
        })
}

/// The folder holding the emulated driver and NVRTC under CUDA's names, set up and put first in
/// `TANDEM_CUDA_LIBS` on the first call.
pub fn use_emulator() -> &'static Path {
    use_emulator_with(&[])
}

/// [`use_emulator`] with `extra` libraries (pairs of cargo's file name and CUDA's name, such as
/// [`CUBLAS`]) copied beside them. The first call in a process sets the folder up.
pub fn use_emulator_with(extra: &[(&str, &str)]) -> &'static Path {
    static FOLDER: OnceLock<PathBuf> = OnceLock::new();
    FOLDER.get_or_init(|| {
        let dir = emulator_folder(extra);
        let mut folders = vec![dir.clone()];
        if let Some(old) = std::env::var_os("TANDEM_CUDA_LIBS") {
            folders.extend(std::env::split_paths(&old));
        }
        std::env::set_var(
            "TANDEM_CUDA_LIBS",
            std::env::join_paths(folders).expect("paths without ':'"),
        );
        dir
    })
}

/// A fresh folder holding the emulated driver and NVRTC (and `extra`) under CUDA's names,
/// without touching this process's environment: for a test that runs a program on the emulator
/// by putting the folder in that child's `TANDEM_CUDA_LIBS` only.
pub fn emulator_folder(extra: &[(&str, &str)]) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("tandem-cuda-emu-libs")
        .tempdir()
        .expect("a temporary folder")
        .keep();
    // Copies, not links: tandem resolves the library it loaded to its real path and looks
    // for NVRTC's builtins beside it.
    for (built_name, cuda_name) in DRIVER_AND_NVRTC.iter().chain(extra) {
        std::fs::copy(built(built_name), dir.join(cuda_name))
            .unwrap_or_else(|e| panic!("copy {built_name}: {e}"));
    }
    std::os::unix::fs::symlink("libnvrtc.so", dir.join("libnvrtc-builtins.so.13.99"))
        .expect("link NVRTC's builtins");
    dir
}

/// The emulator's last reported fault (`tandem_cuda_emu_last_fault`).
pub fn last_fault() -> String {
    let library = tandem_core::cuda::libs::library(
        tandem_core::cuda::libs::CudaLibrary::Driver,
        tandem_core::Device::Cuda(0),
    )
    .expect("the emulated driver is loaded");
    type LastFault = unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> usize;
    // SAFETY: the emulator exports this function with this signature.
    let f = unsafe { library.get::<LastFault>(b"tandem_cuda_emu_last_fault") }
        .expect("the emulator's fault query");
    let mut buf = vec![0u8; 4096];
    // SAFETY: the buffer holds 4096 bytes.
    let n = unsafe { f(buf.as_mut_ptr().cast(), buf.len()) }.min(buf.len() - 1);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Runs the emulator's check of quarantined (freed) memory now (`tandem_cuda_emu_check_quarantine`):
/// the code a later synchronisation returns.
pub fn check_quarantine() -> u32 {
    let library = tandem_core::cuda::libs::library(
        tandem_core::cuda::libs::CudaLibrary::Driver,
        tandem_core::Device::Cuda(0),
    )
    .expect("the emulated driver is loaded");
    type Check = unsafe extern "C" fn() -> u32;
    // SAFETY: the emulator exports this function with this signature.
    let f = unsafe { library.get::<Check>(b"tandem_cuda_emu_check_quarantine") }
        .expect("the emulator's quarantine check");
    // SAFETY: no arguments.
    unsafe { f() }
}

/// The emulated driver, already loaded by tandem (by its path, from the folder
/// [`use_emulator_with`] made): its symbols are the emulator's own, so its counters are the ones
/// tandem's calls move.
fn loaded_driver() -> &'static libloading::Library {
    tandem_core::cuda::libs::library(
        tandem_core::cuda::libs::CudaLibrary::Driver,
        tandem_core::Device::Cuda(0),
    )
    .expect("the emulated driver is loaded (open cuda:0 first)")
}

/// The emulator's counters now (`tandem_cuda_emu_counters`): launches, copies and bytes,
/// host synchronisations, pool misses, cuBLAS products. Take one before and one after the code
/// to measure, and subtract with [`Counters::since`].
pub fn counters() -> tandem_cuda_emu::counters::Counters {
    use tandem_cuda_emu::counters::{Counters, COUNTERS_VERSION};
    type Read = unsafe extern "C" fn(*mut Counters, usize) -> u32;
    // SAFETY: the emulator exports this function with this signature.
    let read = unsafe { loaded_driver().get::<Read>(b"tandem_cuda_emu_counters") }
        .expect("the emulator's counters");
    let mut out = Counters::default();
    // SAFETY: `out` is a Counters of the size passed.
    let code = unsafe { read(&mut out, std::mem::size_of::<Counters>()) };
    assert_eq!(code, 0, "tandem_cuda_emu_counters failed");
    assert_eq!(
        out.version, COUNTERS_VERSION,
        "the loaded emulator's counters have another layout (a stale copy of the library?)"
    );
    out
}

/// Sets the emulator's counters to zero (`tandem_cuda_emu_reset_counters`).
pub fn reset_counters() {
    type Reset = unsafe extern "C" fn();
    // SAFETY: the emulator exports this function with this signature.
    let reset = unsafe { loaded_driver().get::<Reset>(b"tandem_cuda_emu_reset_counters") }
        .expect("the emulator's counter reset");
    // SAFETY: no arguments.
    unsafe { reset() }
}

/// Makes every host synchronisation print its call stack on stderr (or stop doing so), to
/// find the code that waited (`tandem_cuda_emu_trace_host_syncs`).
pub fn trace_host_syncs(on: bool) {
    type Trace = unsafe extern "C" fn(u32);
    // SAFETY: the emulator exports this function with this signature.
    let trace = unsafe { loaded_driver().get::<Trace>(b"tandem_cuda_emu_trace_host_syncs") }
        .expect("the emulator's sync trace");
    // SAFETY: a flag.
    unsafe { trace(on.into()) }
}
