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
