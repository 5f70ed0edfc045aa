//! Counters of what the host asks of the device: kernel launches, copies and their bytes per
//! direction, memsets, host synchronisations, allocations the stream-ordered pool did not serve,
//! and the products of the emulated cuBLAS and the convolutions of the emulated cuDNN. A test reads them around a training step to see
//! the host's side of the step — the launch overhead a GPU will pay (a few µs per launch) and
//! every point where the host waits for the device.
//!
//! Each entry point counts itself with one call ([`count`], [`count_bytes`], [`host_sync`]) on
//! the calling (host) thread, when the call is accepted. The counters are process-wide atomics;
//! `tandem_cuda_emu_counters` copies them into a [`Counters`] and
//! `tandem_cuda_emu_reset_counters` sets them to zero. With `tandem_cuda_emu_trace_host_syncs(1)`
//! every host synchronisation also prints its call stack on stderr, to find who waited.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The layout version of [`Counters`]; fields are only ever appended, and a new field bumps it.
pub const COUNTERS_VERSION: u64 = 2;

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $field:ident,)*) => {
        /// A snapshot of the emulator's counters (`tandem_cuda_emu_counters`), all `u64`.
        ///
        /// `version` is [`COUNTERS_VERSION`] and `size` the size of the emulator's struct in
        /// bytes; a reader built against an older layout gets the fields it knows.
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            /// [`COUNTERS_VERSION`] of the emulator that wrote the snapshot.
            pub version: u64,
            /// `size_of::<Counters>()` of the emulator that wrote the snapshot.
            pub size: u64,
            $($(#[doc = $doc])* pub $field: u64,)*
        }

        /// One counter (an index into the counters' table).
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[doc = $doc])* $field,)*
        }

        const FIELDS: usize = [$(stringify!($field)),*].len();

        impl Counters {
            /// The counters' names and values, in the struct's order (header excluded).
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field)),*]
            }

            /// What happened between `earlier` and `self` (field by field, saturating).
            pub fn since(&self, earlier: &Counters) -> Counters {
                Counters {
                    version: self.version,
                    size: self.size,
                    $($field: self.$field.saturating_sub(earlier.$field),)*
                }
            }
        }

        fn snapshot() -> Counters {
            Counters {
                version: COUNTERS_VERSION,
                size: std::mem::size_of::<Counters>() as u64,
                $($field: VALUES[Counter::$field as usize].load(Ordering::Relaxed),)*
            }
        }
    };
}

counters! {
    /// Kernel launches (`cuLaunchKernel`).
    launches,
    /// Host functions enqueued (`cuLaunchHostFunc`; the emulated cuBLAS runs each product as one).
    host_functions,
    /// Host-to-device copies (sync and async).
    copies_htod,
    /// Bytes copied host to device.
    bytes_htod,
    /// Device-to-host copies (sync and async).
    copies_dtoh,
    /// Bytes copied device to host.
    bytes_dtoh,
    /// Device-to-device copies (sync and async).
    copies_dtod,
    /// Bytes copied device to device.
    bytes_dtod,
    /// Memsets (`cuMemsetD8/D16/D32`, sync and async).
    memsets,
    /// Bytes set by memsets.
    bytes_memset,
    /// Every call that blocks the host until device work is done: the sum of the five below.
    host_syncs,
    /// `cuStreamSynchronize`.
    stream_syncs,
    /// `cuEventSynchronize`.
    event_syncs,
    /// `cuCtxSynchronize`.
    context_syncs,
    /// Copies and memsets that return only when done: `cuMemcpyHtoD/DtoH/DtoD_v2`,
    /// `cuMemsetD*_v2`, and `cuMemcpyDtoHAsync` into pageable host memory.
    blocking_copies,
    /// Frees that wait for the whole device: `cuMemFree_v2`, `cuMemFreeHost`.
    blocking_frees,
    /// `cuStreamQuery` and `cuEventQuery` (they do not block, but a loop of them does).
    queries,
    /// Stream-ordered allocations (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`).
    pool_allocations,
    /// Stream-ordered allocations the pool's cached memory did not cover, so it reserved more
    /// from the device (on a GPU: a slow driver allocation inside the step).
    pool_misses,
    /// Allocations outside the pool (`cuMemAlloc_v2`).
    driver_allocations,
    /// Pinned host allocations (`cuMemHostAlloc`, `cuMemAllocHost_v2`).
    pinned_allocations,
    /// Stream-ordered frees (`cuMemFreeAsync`).
    pool_frees,
    /// Event records (`cuEventRecord`, `cuEventRecordWithFlags`).
    event_records,
    /// Cross-stream waits (`cuStreamWaitEvent`).
    stream_waits,
    /// Events created (`cuEventCreate`).
    events_created,
    /// Matrix products of the emulated cuBLAS (`cublas*gemm*`, batched or not, one per call).
    gemms,
    /// Matrix-vector products of the emulated cuBLAS (`cublas*gemv*`).
    gemvs,
    /// Convolution passes of the emulated cuDNN (`cudnnConvolution{Forward,BackwardData,
    /// BackwardFilter}`, and each `cudnnFindConvolution*AlgorithmEx`, which runs the pass).
    convolutions,
}

static VALUES: [AtomicU64; FIELDS] = [const { AtomicU64::new(0) }; FIELDS];
static TRACE_SYNCS: AtomicBool = AtomicBool::new(false);

/// Counts one event of `counter`.
pub fn count(counter: Counter) {
    VALUES[counter as usize].fetch_add(1, Ordering::Relaxed);
}

/// Counts one event of `counter` that moved `bytes` bytes (counted in `bytes_counter`).
pub fn count_bytes(counter: Counter, bytes_counter: Counter, bytes: usize) {
    count(counter);
    VALUES[bytes_counter as usize].fetch_add(bytes as u64, Ordering::Relaxed);
}

/// Counts a host synchronisation of kind `kind` (also in `host_syncs`), named `what` in the
/// trace.
pub fn host_sync(kind: Counter, what: &str) {
    count(kind);
    count(Counter::host_syncs);
    if TRACE_SYNCS.load(Ordering::Relaxed) {
        crate::say(&format!(
            "host synchronisation: {what}, from\n{}",
            std::backtrace::Backtrace::force_capture()
        ));
    }
}

/// Copies the counters into `out`: at most `capacity` bytes of a [`Counters`] (a reader built
/// against an older, shorter layout passes its own size and gets the fields it knows). Returns
/// `CUDA_ERROR_INVALID_VALUE` for a null `out` or a capacity smaller than the header.
#[no_mangle]
pub unsafe extern "C" fn tandem_cuda_emu_counters(
    out: *mut Counters,
    capacity: usize,
) -> crate::CUresult {
    crate::entry("tandem_cuda_emu_counters", || {
        if out.is_null() || capacity < 16 {
            return Err(cudarc::driver::sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE);
        }
        let now = snapshot();
        let n = capacity.min(std::mem::size_of::<Counters>());
        // SAFETY: `out` holds `capacity` writable bytes (the caller's contract); `now` is a
        // plain struct of u64s, so any prefix of its bytes is meaningful.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&now as *const Counters).cast::<u8>(),
                out.cast::<u8>(),
                n,
            )
        };
        Ok(())
    })
}

/// Sets every counter to zero.
#[no_mangle]
pub extern "C" fn tandem_cuda_emu_reset_counters() {
    for v in &VALUES {
        v.store(0, Ordering::Relaxed);
    }
}

/// Counts a product of the emulated cuBLAS: `kind` 0 for a GEMM, 1 for a GEMV.
#[no_mangle]
pub extern "C" fn tandem_cuda_emu_count_blas(kind: u32) {
    count(if kind == 1 {
        Counter::gemvs
    } else {
        Counter::gemms
    });
}

/// Counts a convolution pass of the emulated cuDNN (`kind`: 0 forward, 1 backward-data, 2
/// backward-filter; all count in `convolutions`).
#[no_mangle]
pub extern "C" fn tandem_cuda_emu_count_dnn(_kind: u32) {
    count(Counter::convolutions);
}

/// With `on` non-zero, every host synchronisation prints its call stack on stderr.
#[no_mangle]
pub extern "C" fn tandem_cuda_emu_trace_host_syncs(on: u32) {
    TRACE_SYNCS.store(on != 0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_struct_is_a_header_and_one_u64_per_counter() {
        assert_eq!(std::mem::size_of::<Counters>(), 8 * (2 + FIELDS));
        assert_eq!(Counters::default().fields().len(), FIELDS);
    }

    #[test]
    fn since_subtracts_field_by_field() {
        let a = Counters {
            launches: 3,
            bytes_htod: 10,
            ..Default::default()
        };
        let b = Counters {
            launches: 5,
            bytes_htod: 30,
            ..Default::default()
        };
        let d = b.since(&a);
        assert_eq!((d.launches, d.bytes_htod, d.gemms), (2, 20, 0));
    }
}
