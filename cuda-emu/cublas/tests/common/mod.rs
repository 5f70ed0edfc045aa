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

use std::path::Path;

// The driver's test helper, shared: it copies the driver and NVRTC, and the libraries named
// here beside them.
#[path = "../../../tests/common/mod.rs"]
mod emulator;

#[allow(unused_imports)] // each test binary uses its own part of the helper
pub use emulator::last_fault;

/// The folder holding the emulated driver, NVRTC, cuBLAS and cuBLASLt under CUDA's names, set
/// up and put first in `TANDEM_CUDA_LIBS` on the first call.
pub fn use_emulator() -> &'static Path {
    emulator::use_emulator_with(&emulator::CUBLAS)
}
