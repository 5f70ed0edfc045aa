//! The emulator's own tests: its libraries are set up by `tandem-test-support`'s
//! [`use_emulator`] (the one copy of that logic, which every GPU test uses through
//! `select_cuda`), plus the emulator's queries (last fault, quarantine check).

#![allow(dead_code)]

pub use tandem_test_support::use_emulator;

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
