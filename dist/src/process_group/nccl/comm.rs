//! One NCCL communicator, created non-blocking so that it can be aborted at any time.
//!
//! NCCL's rules for a communicator that may have to be aborted (its user guide, "Fault
//! Tolerance"): create it with `blocking = 0`; then every call returns at once, possibly with
//! `ncclInProgress`, and the caller polls `ncclCommGetAsyncError` until the state is
//! `ncclSuccess` before the next call (or before touching the streams the call used); and no
//! other thread may be inside an NCCL call on that communicator while `ncclCommAbort` runs.
//!
//! [`Comm`] keeps those rules: every NCCL call on the communicator — the polls included — is
//! made under one lock, held only for the call itself, so the watchdog can take the lock and
//! abort between two polls of a collective that is still being enqueued (an enqueue that needs
//! an unresponsive peer waits for it). Polls check the caller's interrupt between rounds, so a
//! poll never outlives the group's failure. After an abort or a destroy the handle is gone, and
//! every later call fails with an error that says so instead of touching freed memory.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_core::cuda::CudaDevice;

use super::ffi::{self, Api, NcclStatus, RawComm, RawConfig, RawUniqueId, IN_PROGRESS, SUCCESS};
use super::UniqueId;

/// Why an NCCL call did not succeed.
#[derive(Clone, Debug)]
pub(crate) enum CommFailure {
    /// NCCL reported an error (described in words).
    Nccl(String),
    /// The caller's interrupt fired (the group failed, or the deadline passed).
    Interrupted(crate::DistError),
    /// The communicator was aborted or destroyed already.
    Gone,
}

/// The communicator handle, usable from any thread under [`Comm`]'s lock.
struct Handle(RawComm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `Comm` makes every call under one mutex.
unsafe impl Send for Handle {}

/// A non-blocking NCCL communicator on one device. See the module docs.
pub(crate) struct Comm {
    api: &'static Api,
    device: Arc<CudaDevice>,
    handle: Mutex<Option<Handle>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Comm(NCCL {} on {})",
            self.api.version,
            self.device.device()
        )
    }
}

/// How long a poll spins (yielding) before it starts to nap: in non-blocking mode NCCL
/// launches every collective from a thread of its own and answers `ncclInProgress` meanwhile,
/// which takes tens of microseconds.
const POLL_SPIN: Duration = Duration::from_micros(500);
/// The longest nap between two polls after that.
const POLL_MAX_NAP: Duration = Duration::from_millis(1);

impl Comm {
    /// Creates the communicator of `rank` in a group of `world` meeting under `id`, on
    /// `device`. Polls until every rank has joined; `interrupt` is asked between polls and
    /// ends the wait with its error (a peer that died, the deadline). On any failure the
    /// half-made communicator is aborted.
    pub(crate) fn init(
        api: &'static Api,
        device: Arc<CudaDevice>,
        world: usize,
        rank: usize,
        id: &UniqueId,
        interrupt: &dyn Fn() -> Option<crate::DistError>,
    ) -> Result<Comm, CommFailure> {
        device
            .bind("NCCL init")
            .map_err(|e| CommFailure::Nccl(e.to_string()))?;
        let mut raw_id = RawUniqueId {
            internal: [0; ffi::UNIQUE_ID_BYTES],
        };
        for (dst, &src) in raw_id.internal.iter_mut().zip(id.as_bytes()) {
            *dst = src as std::ffi::c_char;
        }
        let mut config = RawConfig::new(false);
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call; the world size and rank were
        // checked by the caller (rank < world ≤ MAX_WORLD_SIZE, which fits an int); the
        // device's context is current on this thread, so NCCL binds the communicator to it.
        let status = unsafe {
            (api.comm_init_rank_config)(
                &mut raw,
                world as c_int,
                raw_id,
                rank as c_int,
                &mut config,
            )
        };
        if raw.is_null() {
            // SAFETY: no communicator to describe.
            let text = unsafe { api.describe(status, std::ptr::null_mut()) };
            return Err(CommFailure::Nccl(format!(
                "ncclCommInitRankConfig returned no communicator: {text}"
            )));
        }
        let comm = Comm {
            api,
            device,
            handle: Mutex::new(Some(Handle(raw))),
        };
        let ready = if status == SUCCESS || status == IN_PROGRESS {
            comm.poll_ready("ncclCommInitRankConfig", interrupt)
        } else {
            Err(comm.failure("ncclCommInitRankConfig", status))
        };
        match ready {
            Ok(()) => Ok(comm),
            Err(e) => {
                comm.abort();
                Err(e)
            }
        }
    }

    /// NCCL's version.
    pub(crate) fn version(&self) -> ffi::NcclVersion {
        self.api.version
    }

    /// `(ncclCommCount, ncclCommUserRank)`: what NCCL believes the world size and this rank
    /// are.
    pub(crate) fn count_and_rank(&self) -> Result<(usize, usize), CommFailure> {
        let guard = self.handle.lock();
        let Some(handle) = guard.as_ref() else {
            return Err(CommFailure::Gone);
        };
        let (mut count, mut rank): (c_int, c_int) = (0, 0);
        // SAFETY: the communicator is live (we hold the lock and the handle); both pointers
        // are valid for one write.
        let status = unsafe { (self.api.comm_count)(handle.0, &mut count) };
        if status != SUCCESS {
            return Err(self.failure_locked("ncclCommCount", status, handle.0));
        }
        // SAFETY: as above.
        let status = unsafe { (self.api.comm_user_rank)(handle.0, &mut rank) };
        if status != SUCCESS {
            return Err(self.failure_locked("ncclCommUserRank", status, handle.0));
        }
        Ok((count.max(0) as usize, rank.max(0) as usize))
    }

    /// Enqueues one collective: `call` receives the communicator and must make exactly one
    /// NCCL call on it. Waits (polling, interruptibly) until NCCL has enqueued it on its
    /// stream. Call with the device's context current.
    pub(crate) fn enqueue(
        &self,
        what: &str,
        interrupt: &dyn Fn() -> Option<crate::DistError>,
        call: impl FnOnce(&'static Api, RawComm) -> NcclStatus,
    ) -> Result<(), CommFailure> {
        let status = {
            let guard = self.handle.lock();
            let Some(handle) = guard.as_ref() else {
                return Err(CommFailure::Gone);
            };
            let status = call(self.api, handle.0);
            if status != SUCCESS && status != IN_PROGRESS {
                return Err(self.failure_locked(what, status, handle.0));
            }
            status
        };
        if status == IN_PROGRESS {
            self.poll_ready(what, interrupt)?;
        }
        Ok(())
    }

    /// `ncclCommGetAsyncError`: `Ok(true)` if the communicator is healthy and idle,
    /// `Ok(false)` if a non-blocking call is still in progress, the error otherwise.
    pub(crate) fn check(&self) -> Result<bool, CommFailure> {
        let guard = self.handle.lock();
        let Some(handle) = guard.as_ref() else {
            return Err(CommFailure::Gone);
        };
        let mut state: NcclStatus = SUCCESS;
        // SAFETY: the communicator is live and no other thread is in NCCL on it (the lock).
        let status = unsafe { (self.api.comm_get_async_error)(handle.0, &mut state) };
        if status != SUCCESS {
            return Err(self.failure_locked("ncclCommGetAsyncError", status, handle.0));
        }
        match state {
            SUCCESS => Ok(true),
            IN_PROGRESS => Ok(false),
            error => Err(self.failure_locked("an asynchronous NCCL operation", error, handle.0)),
        }
    }

    /// Polls until the communicator's state is `ncclSuccess`, an error, or `interrupt` fires.
    fn poll_ready(
        &self,
        what: &str,
        interrupt: &dyn Fn() -> Option<crate::DistError>,
    ) -> Result<(), CommFailure> {
        let started = Instant::now();
        let mut nap = Duration::from_micros(50);
        loop {
            match self.check() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(CommFailure::Nccl(text)) => {
                    return Err(CommFailure::Nccl(format!("{what}: {text}")))
                }
                Err(other) => return Err(other),
            }
            if let Some(e) = interrupt() {
                return Err(CommFailure::Interrupted(e));
            }
            if started.elapsed() < POLL_SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(POLL_MAX_NAP);
            }
        }
    }

    /// Aborts the communicator: asks NCCL to stop its kernels and proxy threads and frees it.
    /// Safe at any time and from any thread; later calls fail with [`CommFailure::Gone`].
    pub(crate) fn abort(&self) {
        let mut guard = self.handle.lock();
        if let Some(handle) = guard.take() {
            // Best effort: the communicator is gone either way.
            let _ = self.device.bind("ncclCommAbort");
            // SAFETY: the communicator is live, and no other thread is in NCCL on it (we hold
            // the lock); afterwards the handle is dropped and never used again.
            unsafe {
                (self.api.comm_abort)(handle.0);
            }
        }
    }

    /// Finalizes the communicator (flushing what was issued, in step with the other ranks)
    /// and destroys it. Polls until the finalize completes; when it fails or `interrupt`
    /// fires, the communicator is aborted instead and the reason returned.
    pub(crate) fn finalize_and_destroy(
        &self,
        interrupt: &dyn Fn() -> Option<crate::DistError>,
    ) -> Result<(), CommFailure> {
        let _ = self.device.bind("ncclCommFinalize");
        let status = {
            let guard = self.handle.lock();
            let Some(handle) = guard.as_ref() else {
                return Err(CommFailure::Gone);
            };
            // SAFETY: the communicator is live and no other thread is in NCCL on it.
            let status = unsafe { (self.api.comm_finalize)(handle.0) };
            if status != SUCCESS && status != IN_PROGRESS {
                Err(self.failure_locked("ncclCommFinalize", status, handle.0))
            } else {
                Ok(status)
            }
        };
        let finalized = status.and_then(|status| {
            if status == IN_PROGRESS {
                self.poll_ready("ncclCommFinalize", interrupt)
            } else {
                Ok(())
            }
        });
        if let Err(e) = finalized {
            self.abort();
            return Err(e);
        }
        let mut guard = self.handle.lock();
        if let Some(handle) = guard.take() {
            // SAFETY: the communicator is finalized and live; the handle is dropped after.
            let status = unsafe { (self.api.comm_destroy)(handle.0) };
            if status != SUCCESS {
                // SAFETY: no communicator to describe any more.
                let text = unsafe { self.api.describe(status, std::ptr::null_mut()) };
                return Err(CommFailure::Nccl(format!("ncclCommDestroy: {text}")));
            }
        }
        Ok(())
    }

    fn failure(&self, what: &str, status: NcclStatus) -> CommFailure {
        let guard = self.handle.lock();
        let raw = guard.as_ref().map_or(std::ptr::null_mut(), |h| h.0);
        self.failure_locked(what, status, raw)
    }

    /// Describes a failed call; the caller holds the lock and `raw` is live (or null).
    fn failure_locked(&self, what: &str, status: NcclStatus, raw: RawComm) -> CommFailure {
        // SAFETY: `raw` is live or null, and the caller holds the lock.
        let text = unsafe { self.api.describe(status, raw) };
        CommFailure::Nccl(format!("{what}: {text}"))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // A communicator that was neither destroyed nor aborted (a failed set-up): abort it,
        // which never waits for the other ranks.
        self.abort();
    }
}
