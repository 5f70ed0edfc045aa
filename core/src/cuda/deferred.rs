//! Deferred errors: what a kernel finds wrong on the device, reported when the host next looks.
//!
//! Some inputs can only be checked by reading them, and on a GPU reading them on the host inside
//! the op would stall the stream at every call: a class label out of range is the example
//! (`cross_entropy`, `nll_loss`). Such a kernel checks on the device instead. It skips the bad
//! element (no out-of-bounds access; its result is NaN) and records the first finding in a small
//! record. The next time the host looks at the device — [`Tensor::to_vec`] (and so `item`) or
//! [`CudaDevice::synchronize`] — [`check`] turns the record into an [`Error::InvalidArgument`]
//! naming the op and what was found, exactly as the CPU op would have failed, and clears it. A
//! training loop that reads its loss after the step (`loss.item()?`) gets the error there.
//!
//! [`Tensor::to_vec`]: crate::Tensor::to_vec
//!
//! # Whose error it is
//! Every op on a device runs on its one compute stream, whichever host thread issues it, so a
//! stream cannot tell one caller's work from another's. The host thread can: each thread that
//! launches a checking kernel on a device leases its own record there, its kernels record into
//! it, and its reads check it. A read synchronises the compute stream, so by then every kernel
//! the thread issued before it has run and the thread's record is complete; what another thread's
//! kernels found stays in that thread's record until that thread reads. Threads sharing a GPU —
//! the ranks of a `DeviceThreadGroup`, tests run in parallel — each get their own errors and
//! never another's. (A PyTorch device-side assertion is a sticky error of the whole context, seen
//! by whichever thread makes the next CUDA call; with `TORCH_USE_CUDA_DSA` a per-device buffer and
//! a registry of launches let the message name the launch that asserted, but the error still
//! goes to every thread. tandem's findings are input errors that leave the device usable, so
//! each goes to the one thread that can act on it.)
//!
//! Work handed between threads is attributed to the thread that launched it: a tensor a thread
//! computed with a bad label reports at that thread's next read, not at a reader elsewhere.
//!
//! Findings are never lost. When a thread ends, its record is retired: an event is recorded on the
//! compute stream after the thread's last work. Once the event has completed, a clean record is
//! reused by the next thread; one holding a finding the thread never read is reported at the next
//! read on the device by any thread, naming the thread that ended, then reused. A device has
//! [`RECORDS_PER_DEVICE`] records; record 0 is shared by threads that arrive while every other one
//! is leased, and read by every thread without a record of its own (among them, the first to
//! read reports a finding, whoever's it was).
//!
//! Cost: the first checking launch of a thread on a device leases a record (a lock, once); later
//! launches find it in a thread-local list. A read that finds nothing costs one load from host
//! memory, and one more (a counter) to see whether ended threads left records to look at. No
//! host synchronisation is added anywhere, and nothing is allocated per launch.
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
//! The host reads the record straight from host memory after a synchronisation, without a copy.
//! Reporting clears the record and, in stream order on the compute stream, the claim. With
//! several findings of one thread in flight the first to claim its record is reported (not
//! necessarily the lowest position); the others are dropped.

use std::cell::RefCell;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaEvent};
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

/// What a kernel needs to record a finding: the calling thread's record on one device (see the
/// module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeferredSlot {
    /// Device address of the claim word (`tandem_u32`).
    pub claim: u64,
    /// Device address of the four-word record (`tandem_i64[4]`).
    pub record: u64,
    /// The check's code.
    pub code: u32,
}

/// How many records a device has; record `SHARED` is for threads that find the others leased.
/// Enough that only a program with a thousand threads issuing checked ops on one device at once
/// shares one: 32 KiB of page-locked host memory and 4 KiB of device memory per device.
pub const RECORDS_PER_DEVICE: usize = 1024;

/// The record shared by threads that arrive while every other record is leased.
const SHARED: usize = 0;

/// Words per record: the code, the position, the value, the bound.
const WORDS: usize = 4;

/// The records of one device: the claim words in device memory and the records in mapped host
/// memory, with who holds which. Created on first use, kept for the life of the process (like
/// the device).
struct DeviceRecords {
    /// `RECORDS_PER_DEVICE` claim words (`u32`).
    claims: DeviceBuffer,
    /// `RECORDS_PER_DEVICE` records of `WORDS` words each.
    host: Handle<*mut i64>,
    /// The device's address of `host`.
    device_address: u64,
    leases: Mutex<Leases>,
    /// How many records of ended threads wait in `leases.retired`: reads look there only when
    /// this is not 0.
    retired: AtomicUsize,
}

/// Which records are free, and which ended threads left behind.
struct Leases {
    free: Vec<usize>,
    retired: Vec<Retired>,
}

/// The record of a thread that ended; reusable once `done` has completed.
struct Retired {
    record: usize,
    thread: String,
    /// Recorded on the compute stream after the thread's last work; `None` when recording it
    /// failed (the device is broken then, and the record is treated as done).
    done: Option<CudaEvent>,
}

impl Retired {
    fn is_done(&self) -> bool {
        // An error of the query is the device's sticky error, reported by every later call:
        // nothing more will run, so the record is as done as it gets.
        self.done
            .as_ref()
            .is_none_or(|e| e.try_is_complete().unwrap_or(true))
    }
}

impl DeviceRecords {
    fn open(dev: &Arc<CudaDevice>) -> Result<Self> {
        const OP: &str = "deferred errors";
        let err = driver_err(OP, dev.device());
        let stream = dev.compute_stream();
        let claim_bytes = RECORDS_PER_DEVICE * std::mem::size_of::<u32>();
        let claims = DeviceBuffer::alloc(OP, dev, claim_bytes, stream)?;
        dev.bind(OP)?;
        super::sanitizer::access(
            dev.device(),
            stream,
            "memset (deferred-error claims)",
            &[(claims.ptr(), super::sanitizer::Use::Write)],
        )?;
        // SAFETY: `claims` holds `claim_bytes` bytes on this device, allocated on `stream`.
        unsafe { result::memset_d8_async(claims.ptr(), 0, claim_bytes, stream.cu_stream()) }
            .map_err(&err)?;
        let words = RECORDS_PER_DEVICE * WORDS;
        // SAFETY: a plain allocation; DEVICEMAP maps it into the device's address space,
        // PORTABLE into every context's.
        let host = unsafe {
            result::malloc_host(
                words * std::mem::size_of::<i64>(),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(&err)?
        .cast::<i64>();
        // SAFETY: `host` points at `words` writable, 8-aligned i64 (page-locked allocations are
        // page aligned) that no kernel knows of yet.
        unsafe { std::ptr::write_bytes(host, 0, words) };
        let mut device_address: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; flags must be 0.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_address, host.cast(), 0) }
            .result()
            .map_err(&err)?;
        Ok(DeviceRecords {
            claims,
            host: Handle(host),
            device_address,
            // Popped from the end: record 1 first.
            leases: Mutex::new(Leases {
                free: (1..RECORDS_PER_DEVICE).rev().collect(),
                retired: Vec::new(),
            }),
            retired: AtomicUsize::new(0),
        })
    }

    /// Word `i` of record `r`, shared with the device.
    fn word(&self, r: usize, i: usize) -> &AtomicI64 {
        debug_assert!(r < RECORDS_PER_DEVICE && i < WORDS);
        // SAFETY: the records are `RECORDS_PER_DEVICE * WORDS` 8-aligned i64 that live as long
        // as the process; the device writes them only while a kernel runs, and AtomicI64 has
        // i64's layout.
        unsafe { AtomicI64::from_ptr(self.host.0.add(r * WORDS + i)) }
    }

    /// What kernels need to write record `r`.
    fn slot(&self, r: usize, code: u32) -> DeferredSlot {
        DeferredSlot {
            claim: self.claims.ptr() + (r * std::mem::size_of::<u32>()) as u64,
            record: self.device_address + (r * WORDS * std::mem::size_of::<i64>()) as u64,
            code,
        }
    }

    /// A record for a thread arriving on the device: a free one, else one an ended thread left
    /// clean, else the shared one.
    fn lease(&self) -> usize {
        let mut leases = self.leases.lock();
        if let Some(r) = leases.free.pop() {
            return r;
        }
        // A record holding a finding stays retired until a read reports it.
        let reusable = leases
            .retired
            .iter()
            .position(|t| t.is_done() && self.word(t.record, 0).load(Ordering::Acquire) == 0);
        match reusable {
            Some(i) => {
                self.retired.fetch_sub(1, Ordering::Release);
                leases.retired.swap_remove(i).record
            }
            None => SHARED,
        }
    }

    /// Takes what record `r` holds, clearing it: the record now, the claim in stream order on
    /// the compute stream (kernels issued after this see both free). `None` when it is clean.
    fn take(
        &self,
        dev: &CudaDevice,
        r: usize,
        read_point: &'static str,
    ) -> Result<Option<(i64, Finding)>> {
        let code = self.word(r, 0).load(Ordering::Acquire);
        if code == 0 {
            return Ok(None);
        }
        let finding = Finding {
            position: self.word(r, 1).load(Ordering::Relaxed) as u64,
            value: self.word(r, 2).load(Ordering::Relaxed),
            bound: self.word(r, 3).load(Ordering::Relaxed) as u64,
        };
        for i in 0..WORDS {
            self.word(r, i).store(0, Ordering::Relaxed);
        }
        dev.bind(read_point)?;
        let claim = self.slot(r, 0).claim;
        super::sanitizer::access(
            dev.device(),
            dev.compute_stream(),
            "memset (deferred-error claim)",
            &[(claim, super::sanitizer::Use::Write)],
        )?;
        // SAFETY: the claim word is 4 bytes of this device's memory, inside `claims`, which was
        // allocated on this stream.
        unsafe { result::memset_d8_async(claim, 0, 4, dev.compute_stream().cu_stream()) }
            .map_err(driver_err(read_point, dev.device()))?;
        Ok(Some((code, finding)))
    }

    /// Looks at the records of ended threads whose work has run: a clean one is freed, one
    /// holding a finding is reported (the first such), cleared and freed.
    fn sweep(&self, dev: &CudaDevice, read_point: &'static str) -> Result<()> {
        let mut leases = self.leases.lock();
        let mut i = 0;
        while i < leases.retired.len() {
            if !leases.retired[i].is_done() {
                i += 1;
                continue;
            }
            let ended = leases.retired.swap_remove(i);
            self.retired.fetch_sub(1, Ordering::Release);
            // On an error (a broken device) the record is not freed: its claim may still be set.
            let found = self.take(dev, ended.record, read_point)?;
            leases.free.push(ended.record);
            if let Some((code, finding)) = found {
                let by = format!(
                    "issued by thread {}, which ended before reading it",
                    ended.thread
                );
                return Err(report(dev, read_point, code, &finding, Some(&by)));
            }
        }
        Ok(())
    }
}

static RECORDS: [OnceLock<DeviceRecords>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
static OPENING: Mutex<()> = Mutex::new(());

/// The records this thread leased, by device ordinal, with the thread's name (for a report
/// after it ended). Handed back, as retired, when the thread ends.
struct ThreadLeases {
    held: Vec<(usize, usize)>,
    thread: Option<String>,
}

impl Drop for ThreadLeases {
    fn drop(&mut self) {
        let thread = self.thread.take().unwrap_or_default();
        for &(ordinal, r) in &self.held {
            if r != SHARED {
                // Never unwind out of a thread-local destructor (that aborts the process).
                let _ = std::panic::catch_unwind(|| retire(ordinal, r, thread.clone()));
            }
        }
    }
}

thread_local! {
    static LEASED: RefCell<ThreadLeases> = const {
        RefCell::new(ThreadLeases { held: Vec::new(), thread: None })
    };
}

/// Hands record `r` of `cuda:ordinal` back when its thread ends: it is reused once the work the
/// thread issued has run, and what it holds then is reported by the next read on the device.
fn retire(ordinal: usize, r: usize, thread: String) {
    let Some(records) = RECORDS[ordinal].get() else {
        return;
    };
    let done = super::device::device(ordinal).ok().and_then(|dev| {
        dev.bind("deferred errors").ok()?;
        dev.compute_stream().record_event(None).ok()
    });
    records.leases.lock().retired.push(Retired {
        record: r,
        thread,
        done,
    });
    records.retired.fetch_add(1, Ordering::Release);
}

/// The calling thread's record on `cuda:ordinal`, if it has leased one.
fn leased(ordinal: usize) -> Option<usize> {
    LEASED
        .try_with(|l| {
            l.borrow()
                .held
                .iter()
                .find(|&&(o, _)| o == ordinal)
                .map(|&(_, r)| r)
        })
        .ok()
        .flatten()
}

/// The device's records, created on first use.
fn records(dev: &Arc<CudaDevice>) -> Result<&'static DeviceRecords> {
    let cell = &RECORDS[dev.ordinal()];
    if let Some(r) = cell.get() {
        return Ok(r);
    }
    let _opening = OPENING.lock();
    if cell.get().is_none() {
        let _ = cell.set(DeviceRecords::open(dev)?);
    }
    cell.get()
        .ok_or_else(|| Error::invalid("deferred errors", "the device's records were not created"))
}

/// Where `check`'s kernels, launched by the calling thread on `dev`, record a finding. The
/// first call of a thread on a device leases the thread's record there (and the first on a
/// device creates the device's records: small allocations, zeroed in stream order, no
/// synchronisation); later calls look it up.
pub fn slot(dev: &Arc<CudaDevice>, check: &'static DeferredCheck) -> Result<DeferredSlot> {
    let records = records(dev)?;
    let code = check.code();
    if let Some(r) = leased(dev.ordinal()) {
        return Ok(records.slot(r, code));
    }
    let r = records.lease();
    let kept = LEASED.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.thread.is_none() {
            let current = std::thread::current();
            l.thread = Some(match current.name() {
                Some(name) => format!("'{name}'"),
                None => format!("{:?}", current.id()),
            });
        }
        l.held.push((dev.ordinal(), r));
    });
    if kept.is_err() {
        // The thread is ending (a launch from a thread-local destructor): nothing would hand a
        // record back, so hand it back now, unused, and take the shared one.
        if r != SHARED {
            records.leases.lock().free.push(r);
        }
        return Ok(records.slot(SHARED, code));
    }
    Ok(records.slot(r, code))
}

/// Reports and clears what the calling thread's kernels on `dev` recorded (what the shared
/// record holds, for a thread without a record of its own), or else what a thread that ended
/// left unread. Call it where the host has just waited for the device's
/// compute stream; `read_point` names that place (`"to_vec"`) in the message. Costs two loads
/// from host memory when nothing was recorded.
pub fn check(dev: &CudaDevice, read_point: &'static str) -> Result<()> {
    // Frees the stream sanitizer found unordered, made by this thread (one load when none).
    super::sanitizer::take_reported(dev.device())?;
    let Some(records) = RECORDS[dev.ordinal()].get() else {
        return Ok(());
    };
    // A thread without a record of its own launched its checks (if any) into the shared one.
    let own = leased(dev.ordinal()).unwrap_or(SHARED);
    if let Some((code, finding)) = records.take(dev, own, read_point)? {
        return Err(report(dev, read_point, code, &finding, None));
    }
    if records.retired.load(Ordering::Acquire) > 0 {
        records.sweep(dev, read_point)?;
    }
    Ok(())
}

/// The error for a finding with `code`; `by` says whose work it was when not the caller's.
fn report(
    dev: &CudaDevice,
    read_point: &'static str,
    code: i64,
    finding: &Finding,
    by: Option<&str>,
) -> Error {
    let check = usize::try_from(code - 1)
        .ok()
        .and_then(|i| CHECKS.lock().get(i).copied());
    let Some(check) = check else {
        return Error::Cuda {
            op: read_point,
            device: dev.device(),
            detail: format!("a kernel recorded an error with unknown code {code}"),
        };
    };
    let by = by.map(|b| format!(" {b}")).unwrap_or_default();
    Error::invalid(
        check.op,
        format!(
            "{} (found on {} by a kernel of {}{by}; reported at the next host read, {read_point})",
            (check.describe)(finding),
            dev.device(),
            check.op
        ),
    )
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
