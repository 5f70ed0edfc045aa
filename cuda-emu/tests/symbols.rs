//! The emulated libraries export every symbol cudarc 0.19.10 may load (its lazy loader panics
//! on a missing one), implemented or as a stub that fails with a message.

mod common;

fn check(library: &str, list: &str) {
    let path = common::use_emulator().join(library);
    // SAFETY: the emulator's libraries have no initialisers with preconditions.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    let missing: Vec<&str> = list
        .lines()
        .filter(|name| !name.is_empty())
        // SAFETY: only the address is read.
        .filter(|name| unsafe { lib.get::<*mut std::ffi::c_void>(name.as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "{library} lacks {missing:?}");
}

#[test]
fn every_driver_symbol_cudarc_loads_is_exported() {
    check("libcuda.so", include_str!("data/cudarc_driver_symbols.txt"));
}

#[test]
fn every_nvrtc_symbol_cudarc_loads_is_exported() {
    check("libnvrtc.so", include_str!("data/cudarc_nvrtc_symbols.txt"));
}

#[test]
fn a_stub_fails_with_not_supported() {
    let path = common::use_emulator().join("libcuda.so");
    // SAFETY: as above.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    // SAFETY: the stubs take no arguments they read and return a CUresult.
    let status = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> u32>(b"cuGraphCreate")
            .unwrap();
        f()
    };
    assert_eq!(status, 801, "CUDA_ERROR_NOT_SUPPORTED");
}
