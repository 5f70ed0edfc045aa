//! Deferred errors: what a kernel finds wrong on the device, reported when the host next looks.
//!
//! Some inputs can only be checked by reading them, and on a GPU reading them on the host inside
//! the op would stall the stream at every call: a class label out of range is the example
//! (`cross_entropy`, `nll_loss`). Such a kernel checks on the device instead. It skips the bad
//! element (no out-of-bounds access; its result is NaN) and records the first finding in a small
//! per-device record. The next time the host looks at the device — [`Tensor::to_vec`] (and so
//! `item`) or [`CudaDevice::synchronize`] — [`check`] turns the record into an
//! [`Error::InvalidArgument`] naming the op and what was found, exactly as the CPU op would have
//! failed, and clears it. A training loop that reads its loss after the step (`loss.item()?`)
//! gets the error there.
//!
//! # The record, as kernels see it
//! An op asks for a [`DeferredSlot`] with [`slot`] and passes its three fields to the kernel:
//!
//! - `claim` (`tandem_u32*`, device memory, 0 while nothing is recorded): a kernel that finds
//!   something wrong claims the record with `atomicCAS(claim, 0, 1) == 0`; only the one thread
//!   that wins writes it, later findings are dropped until the host has reported the first.
//! - `record` (`tandem_i64*`, four words of page-locked host memory mapped into the device's
//!   address space): the winner writes `record[1] = position`, `record[2] = value`,
//!   `record[3] = bound`, then `__threadfence_system()`, then `record[0] = code`.
//! - `code` (`tandem_u32`): which [`DeferredCheck`] the finding belongs to (never 0).
//!
//! The host reads the record straight from host memory after a synchronisation, without a copy:
//! when nothing went wrong, a check costs one load. Reporting clears the record and, in stream
//! order on the compute stream, the claim. With several findings in flight the first to claim
//! the record is reported (not necessarily the lowest position); the others are dropped.
//!
//! The record is per device, not per thread or stream: an error found by one thread's op may be
//! reported by another thread's read of the same device.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use super::device::{driver_err, CudaDevice, Handle, MAX_DEVICES};
use super::memory::DeviceBuffer;
use crate::{Error, Result};

/// What a kernel recorded: an index (a class label, say) at `position` whose value lies outside
/// `0..bound`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finding {
    /// Where the bad value was (a row, a flat element index: the op's kernel says).
    pub position: u64,
    /// The bad value.
    pub value: i64,
    /// The exclusive upper bound the value had to respect (the class count, say).
    pub bound: u64,
}

/// A kind of finding: the op whose kernels record it and how to describe it, in the words the
/// CPU op uses for the same mistake. Declare one `static` per op.
pub struct DeferredCheck {
    op: &'static str,
    describe: fn(&Finding) -> String,
    code: OnceLock<u32>,
}

impl DeferredCheck {
    /// A check for `op`; `describe` words a finding (the error message after `op: `).
    pub const fn new(op: &'static str, describe: fn(&Finding) -> String) -> Self {
        DeferredCheck {
            op,
            describe,
            code: OnceLock::new(),
        }
    }

    /// The op the check belongs to.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The error the CPU op would have returned for `finding`.
    pub fn error(&self, finding: &Finding) -> Error {
        Error::invalid(self.op, (self.describe)(finding))
    }

    /// The check's code in device records (1, 2, …), registered on first use.
    fn code(&'static self) -> u32 {
        *self.code.get_or_init(|| {
            let mut checks = CHECKS.lock();
            checks.push(self);
            checks.len() as u32
        })
    }
}

impl std::fmt::Debug for DeferredCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeferredCheck({})", self.op)
    }
}

/// Every check used so far; a record's code is its index plus one.
static CHECKS: Mutex<Vec<&'static DeferredCheck>> = Mutex::new(Vec::new());

/// What a kernel needs to record a finding on one device (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeferredSlot {
    /// Device address of the claim word (`tandem_u32`).
    pub claim: u64,
    /// Device address of the four-word record (`tandem_i64[4]`).
    pub record: u64,
    /// The check's code.
    pub code: u32,
}

/// The record of one device: the claim word in device memory and the record in mapped host
/// memory. Created on first use, kept for the life of the process (like the device).
struct DeviceRecord {
    claim: DeviceBuffer,
    host: Handle<*mut i64>,
    device_address: u64,
}

impl DeviceRecord {
    fn open(dev: &Arc<CudaDevice>) -> Result<Self> {
        const OP: &str = "deferred errors";
        let err = driver_err(OP, dev.device());
        let stream = dev.compute_stream();
        let claim = DeviceBuffer::alloc(OP, dev, 4, stream)?;
        dev.bind(OP)?;
        // SAFETY: `claim` holds 4 bytes on this device, allocated on `stream`.
        unsafe { result::memset_d8_async(claim.ptr(), 0, 4, stream.cu_stream()) }.map_err(&err)?;
        // SAFETY: a plain allocation of 32 bytes; DEVICEMAP maps it into the device's address
        // space, PORTABLE into every context's.
        let host = unsafe {
            result::malloc_host(
                4 * std::mem::size_of::<i64>(),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(&err)?
        .cast::<i64>();
        // SAFETY: `host` points at 32 writable, 8-aligned bytes (page-locked allocations are
        // page aligned) that no kernel knows of yet.
        unsafe { std::ptr::write_bytes(host, 0, 4) };
        let mut device_address: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_address, host.cast(), 0) }
            .result()
            .map_err(&err)?;
        Ok(DeviceRecord {
            claim,
            host: Handle(host),
            device_address,
        })
    }

    /// Word `i` of the record, shared with the device.
    fn word(&self, i: usize) -> &AtomicI64 {
        debug_assert!(i < 4);
        // SAFETY: the record is four 8-aligned i64 that live as long as the process; the
        // device writes them only while a kernel runs, and AtomicI64 has i64's layout.
        unsafe { AtomicI64::from_ptr(self.host.0.add(i)) }
    }
}

static RECORDS: [OnceLock<DeviceRecord>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
static OPENING: Mutex<()> = Mutex::new(());

/// Where `check`'s kernels on `dev` record a finding. Creates the device's record on first use
/// (a small allocation, zeroed in stream order: no synchronisation).
pub fn slot(dev: &Arc<CudaDevice>, check: &'static DeferredCheck) -> Result<DeferredSlot> {
    let cell = &RECORDS[dev.ordinal()];
    let record = match cell.get() {
        Some(r) => r,
        None => {
            let _opening = OPENING.lock();
            if cell.get().is_none() {
                let _ = cell.set(DeviceRecord::open(dev)?);
            }
            cell.get().ok_or_else(|| {
                Error::invalid("deferred errors", "the device record was not created")
            })?
        }
    };
    Ok(DeferredSlot {
        claim: record.claim.ptr(),
        record: record.device_address,
        code: check.code(),
    })
}

/// Reports and clears what kernels on `dev` recorded. Call it where the host has just waited for
/// the device's compute stream; `read_point` names that place (`"to_vec"`) in the message.
/// Costs one load from host memory when nothing was recorded.
pub fn check(dev: &CudaDevice, read_point: &'static str) -> Result<()> {
    let Some(record) = RECORDS[dev.ordinal()].get() else {
        return Ok(());
    };
    let code = record.word(0).load(Ordering::Acquire);
    if code == 0 {
        return Ok(());
    }
    let finding = Finding {
        position: record.word(1).load(Ordering::Relaxed) as u64,
        value: record.word(2).load(Ordering::Relaxed),
        bound: record.word(3).load(Ordering::Relaxed) as u64,
    };
    // Clear the record, then the claim in stream order: kernels issued after this see both free.
    for i in 0..4 {
        record.word(i).store(0, Ordering::Relaxed);
    }
    dev.bind(read_point)?;
    let stream = dev.compute_stream();
    // SAFETY: the claim word is 4 bytes of this device's memory, allocated on this stream.
    unsafe { result::memset_d8_async(record.claim.ptr(), 0, 4, stream.cu_stream()) }
        .map_err(driver_err(read_point, dev.device()))?;
    let check = usize::try_from(code - 1)
        .ok()
        .and_then(|i| CHECKS.lock().get(i).copied());
    let Some(check) = check else {
        return Err(Error::Cuda {
            op: read_point,
            device: dev.device(),
            detail: format!("a kernel recorded an error with unknown code {code}"),
        });
    };
    Err(Error::invalid(
        check.op,
        format!(
            "{} (found on {} by a kernel of {}; reported at the next host read, {read_point})",
            (check.describe)(&finding),
            dev.device(),
            check.op
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn describe(f: &Finding) -> String {
        format!(
            "label {} at {} is not below {}",
            f.value, f.position, f.bound
        )
    }

    static FIRST: DeferredCheck = DeferredCheck::new("first_op", describe);
    static SECOND: DeferredCheck = DeferredCheck::new("second_op", describe);

    #[test]
    fn checks_get_distinct_nonzero_codes_once() {
        let (a, b) = (FIRST.code(), SECOND.code());
        assert!(a != 0 && b != 0 && a != b);
        assert_eq!(FIRST.code(), a, "the code is stable");
        assert_eq!(CHECKS.lock()[a as usize - 1].op(), "first_op");
    }

    #[test]
    fn a_finding_reads_as_the_cpu_error() {
        let e = FIRST.error(&Finding {
            position: 3,
            value: -2,
            bound: 5,
        });
        assert_eq!(e.to_string(), "first_op: label -2 at 3 is not below 5");
    }
}
