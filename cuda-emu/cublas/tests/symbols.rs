//! The emulated cuBLAS and cuBLASLt export every symbol cudarc 0.19.10 may load (its lazy loader
//! panics on a missing one), implemented or as a stub that fails with a message.

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
fn every_cublas_symbol_cudarc_loads_is_exported() {
    check(
        "libcublas.so",
        include_str!("data/cudarc_cublas_symbols.txt"),
    );
}

#[test]
fn every_cublaslt_symbol_cudarc_loads_is_exported() {
    check(
        "libcublasLt.so",
        include_str!("data/cudarc_cublaslt_symbols.txt"),
    );
}

#[test]
fn a_stub_fails_with_not_supported() {
    for (library, symbol) in [
        ("libcublas.so", &b"cublasSsyrk_v2"[..]),
        ("libcublasLt.so", &b"cublasLtMatmul"[..]),
    ] {
        let path = common::use_emulator().join(library);
        // SAFETY: as above.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        // SAFETY: the stubs take no arguments they read and return a cublasStatus_t.
        let status = unsafe {
            let f = lib.get::<unsafe extern "C" fn() -> u32>(symbol).unwrap();
            f()
        };
        assert_eq!(status, 15, "CUBLAS_STATUS_NOT_SUPPORTED");
    }
}
