//! Every other entry point of NCCL that cudarc 0.19.10 may load (its `nccl-02028` bindings), as a
//! stub that prints `tandem-cuda-emu: <name> is not emulated` on stderr and returns
//! `ncclInvalidUsage`, so that a call the emulator lacks fails with a message naming the
//! function instead of a missing symbol. The arguments are ignored (the C calling convention
//! lets a callee ignore them).
//!
//! The list is cudarc's names minus the ones `lib.rs` implements:
//!
//! ```sh
//! grep -oE 'load::<_F>\("[A-Za-z0-9_]+"\)' $CUDARC/src/nccl/sys/mod.rs \
//!     | sed -E 's/.*\("(.*)"\)/\1/' | sort -u > all.txt
//! grep -ohE 'extern "C" fn nccl[A-Za-z0-9_]+' cuda-emu/nccl/src/lib.rs | sed 's/.* fn //' \
//!     | sort -u > done.txt
//! comm -23 all.txt done.txt
//! ```
//!
//! `tests/symbols.rs` checks that the library exports every name cudarc may load.

use crate::{Nccl, Status};

tandem_cuda_emu_link::stubs!(
    Status = tandem_cuda_emu_link::not_emulated::<Nccl>;
    ncclAlltoAll,
    ncclCommDeregister,
    ncclCommGetUniqueId,
    ncclCommGrow,
    ncclCommInitAll,
    ncclCommInitRankScalable,
    ncclCommMemStats,
    ncclCommRegister,
    ncclCommResume,
    ncclCommRevoke,
    ncclCommShrink,
    ncclCommSplit,
    ncclCommSuspend,
    ncclCommWindowDeregister,
    ncclCommWindowRegister,
    ncclGather,
    ncclGroupSimulateEnd,
    ncclMemAlloc,
    ncclMemFree,
    ncclParamBind,
    ncclParamDumpAll,
    ncclParamGet,
    ncclParamGetAllParameterKeys,
    ncclParamGetI16,
    ncclParamGetI32,
    ncclParamGetI64,
    ncclParamGetI8,
    ncclParamGetParameter,
    ncclParamGetStr,
    ncclParamGetU16,
    ncclParamGetU32,
    ncclParamGetU64,
    ncclParamGetU8,
    ncclPutSignal,
    ncclRedOpCreatePreMulSum,
    ncclRedOpDestroy,
    ncclResetDebugInit,
    ncclScatter,
    ncclSignal,
    ncclWaitSignal,
    ncclWinGetUserPtr,
);
