//! A count of the host's reads of device memory (device-to-host copies), per thread.
//!
//! Each such read waits for the device, so a training step should have none where it means
//! to keep the host ahead of the GPU (a SyncBatchNorm forward, say). Tests read the count
//! before and after the code they check; it costs one thread-local increment per copy.

use std::cell::Cell;

thread_local! {
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// How many device-to-host copies this thread has issued (`to_vec`, `to_device(Cpu)`, …).
pub fn device_to_host_copies() -> u64 {
    READS.with(Cell::get)
}

/// Counts one device-to-host copy issued by this thread.
pub(crate) fn note_copy() {
    READS.with(|r| r.set(r.get() + 1));
}
