//! The emulated cuDNN exports every symbol cudarc 0.19.10 may load (its lazy loader panics on a
//! missing one), implemented or as a stub that fails with a message.

mod common;

fn open() -> libloading::Library {
    let path = common::use_emulator().join("libcudnn.so.9");
    // SAFETY: the emulator's libraries have no initialisers with preconditions.
    unsafe { libloading::Library::new(&path) }.unwrap()
}

#[test]
fn every_cudnn_symbol_cudarc_loads_is_exported() {
    let lib = open();
    let missing: Vec<&str> = include_str!("data/cudarc_cudnn_symbols.txt")
        .lines()
        .filter(|name| !name.is_empty())
        // SAFETY: only the address is read.
        .filter(|name| unsafe { lib.get::<*mut std::ffi::c_void>(name.as_bytes()) }.is_err())
        .collect();
    assert!(missing.is_empty(), "libcudnn.so.9 lacks {missing:?}");
}

#[test]
fn a_stub_fails_with_not_supported() {
    let lib = open();
    // SAFETY: the stubs take no arguments they read and return a cudnnStatus_t.
    let status = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> u32>(b"cudnnPoolingForward")
            .unwrap();
        f()
    };
    assert_eq!(status, 3000, "CUDNN_STATUS_NOT_SUPPORTED");
}

#[test]
fn the_version_is_cudnn_9_and_statuses_have_their_names() {
    let lib = open();
    // SAFETY: these have these C signatures.
    unsafe {
        let version = lib
            .get::<unsafe extern "C" fn() -> usize>(b"cudnnGetVersion")
            .unwrap();
        assert!((90000..100000).contains(&version()), "{}", version());
        let name = lib
            .get::<unsafe extern "C" fn(u32) -> *const std::ffi::c_char>(b"cudnnGetErrorString")
            .unwrap();
        for (status, want) in [
            (0, "CUDNN_STATUS_SUCCESS"),
            (2000, "CUDNN_STATUS_BAD_PARAM"),
            (3000, "CUDNN_STATUS_NOT_SUPPORTED"),
        ] {
            let got = std::ffi::CStr::from_ptr(name(status)).to_str().unwrap();
            assert_eq!(got, want);
        }
    }
}
