//! The emulated NCCL exports every symbol cudarc's NCCL bindings may load (its lazy loader
//! panics on a missing one) and every one tandem's `dist` binds, implemented or as a stub that
//! fails with a message.

mod common;

fn library() -> libloading::Library {
    let path = tandem_test_support::use_emulator().join("libnccl.so.2");
    // SAFETY: the emulator's libraries have no initialisers with preconditions.
    unsafe { libloading::Library::new(&path) }.unwrap()
}

fn missing(list: &str) -> Vec<String> {
    let lib = library();
    list.lines()
        .filter(|name| !name.is_empty())
        // SAFETY: only the address is read.
        .filter(|name| unsafe { lib.get::<*mut std::ffi::c_void>(name.as_bytes()) }.is_err())
        .map(str::to_string)
        .collect()
}

#[test]
fn every_nccl_symbol_cudarc_loads_is_exported() {
    let missing = missing(include_str!("data/cudarc_nccl_symbols.txt"));
    assert!(missing.is_empty(), "libnccl.so.2 lacks {missing:?}");
}

#[test]
fn every_nccl_symbol_tandem_binds_is_exported_and_the_version_is_2_28_9() {
    let missing = missing(
        "ncclGetVersion\nncclGetUniqueId\nncclCommInitRankConfig\nncclCommFinalize\n\
         ncclCommDestroy\nncclCommAbort\nncclCommGetAsyncError\nncclCommCount\n\
         ncclCommUserRank\nncclAllReduce\nncclBroadcast\nncclAllGather\nncclReduceScatter\n\
         ncclGetErrorString\nncclGetLastError\n",
    );
    assert!(missing.is_empty(), "libnccl.so.2 lacks {missing:?}");
    let mut version = 0;
    // SAFETY: an out-parameter.
    assert_eq!(unsafe { (common::nccl().get_version)(&mut version) }, 0);
    assert_eq!(version, 22809);
}

#[test]
fn a_stub_fails_with_invalid_usage() {
    let lib = library();
    // SAFETY: the stubs take no arguments they read and return an ncclResult_t.
    let status = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> std::ffi::c_int>(b"ncclCommSplit")
            .unwrap();
        f()
    };
    assert_eq!(status, common::INVALID_USAGE);
}
