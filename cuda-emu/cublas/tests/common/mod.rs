//! Points tandem's library search at the emulated driver, NVRTC, cuBLAS and cuBLASLt, as the
//! driver's tests do (`cuda-emu/tests/common/mod.rs`, which explains the layout): cargo builds
//! the four shared libraries before these tests (this package's library and its
//! dev-dependencies) beside the test binary; [`use_emulator`] copies them, once per process,
//! into a fresh folder under the names tandem's search looks for and puts that folder first in
//! `TANDEM_CUDA_LIBS`, before any CUDA call.
//!
//! By hand (for another crate's GPU tests): after `cargo build -p tandem-cuda-emu -p
//! tandem-cuda-emu-nvrtc -p tandem-cuda-emu-cublas -p tandem-cuda-emu-cublaslt`, copy
//! `target/debug/libtandem_cuda_emu.so` to `<dir>/libcuda.so`, `…_nvrtc.so` to
//! `<dir>/libnvrtc.so` (and link `<dir>/libnvrtc-builtins.so.13.99` to it), `…_cublas.so` to
//! `<dir>/libcublas.so`, `…_cublaslt.so` to `<dir>/libcublasLt.so`, and export
//! `TANDEM_CUDA_LIBS=<dir>`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tandem_core::cuda::libs::{self, CudaLibrary};
use tandem_core::Device;

/// The file names cargo gives the libraries, and the names tandem's search looks for.
const LIBRARIES: [(&str, &str); 4] = [
    ("libtandem_cuda_emu.so", "libcuda.so"),
    ("libtandem_cuda_emu_nvrtc.so", "libnvrtc.so"),
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

/// The folder holding the emulator under CUDA's names, set up and put first in
/// `TANDEM_CUDA_LIBS` on the first call.
pub fn use_emulator() -> &'static Path {
    static FOLDER: OnceLock<PathBuf> = OnceLock::new();
    FOLDER.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("tandem-cuda-emu-cublas-libs")
            .tempdir()
            .expect("a temporary folder")
            .keep();
        for (built_name, cuda_name) in LIBRARIES {
            std::fs::copy(built(built_name), dir.join(cuda_name))
                .unwrap_or_else(|e| panic!("copy {built_name}: {e}"));
        }
        std::os::unix::fs::symlink("libnvrtc.so", dir.join("libnvrtc-builtins.so.13.99"))
            .expect("link NVRTC's builtins");
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

/// The emulated driver's last reported fault (`tandem_cuda_emu_last_fault`).
pub fn last_fault() -> String {
    let library = libs::library(CudaLibrary::Driver, Device::Cuda(0)).expect("the driver");
    type LastFault = unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> usize;
    // SAFETY: the emulator exports this function with this signature.
    let f = unsafe { library.get::<LastFault>(b"tandem_cuda_emu_last_fault") }
        .expect("the emulator's fault query");
    let mut buf = vec![0u8; 4096];
    // SAFETY: the buffer holds 4096 bytes.
    let n = unsafe { f(buf.as_mut_ptr().cast(), buf.len()) }.min(buf.len() - 1);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}
