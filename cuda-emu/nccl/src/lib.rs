//! `tandem-cuda-emu-nccl`: an emulated NCCL (`libnccl.so.2`) for the emulated CUDA driver
//! (`tandem-cuda-emu`), tests only (issue 21, item 2). Like the other emulator libraries, a
//! program finds it only when `TANDEM_CUDA_LIBS` names a folder holding a copy of it under
//! NCCL's file name (`tandem-test-support` makes one); tandem's NCCL process group runs on it
//! unchanged, with its ranks as threads of one process or as processes on one host.
//!
//! # What is emulated
//!
//! With NCCL's signatures and `ncclResult_t` codes (it reports version 2.28.9):
//!
//! - **Unique ids** (`ncclGetUniqueId`): 128 bytes, a magic the emulator recognises and 16
//!   random bytes from `/dev/urandom`. An id the emulator did not make (one of the real NCCL,
//!   garbage) is refused with `ncclInvalidArgument` and a message.
//! - **Communicators**: `ncclCommInitRank`, `ncclCommInitRankConfig` (blocking, and
//!   non-blocking: it returns `ncclInProgress` and `ncclCommGetAsyncError` reports
//!   `ncclInProgress` until every rank has joined), `ncclCommCount`, `ncclCommUserRank`,
//!   `ncclCommCuDevice`, `ncclCommGetAsyncError`, `ncclCommFinalize` (non-blocking too: in
//!   progress until the operations issued before it are done; a blocking one waits),
//!   `ncclCommDestroy` (waits for the operations issued before it, as NCCL's implicit
//!   finalize), `ncclCommAbort`, `ncclGetErrorString`, `ncclGetLastError` (the last error of a
//!   call on this thread, or the communicator's asynchronous error), `ncclGetVersion`. A call
//!   on a destroyed or aborted communicator fails with `ncclInvalidUsage` (the handles are
//!   opaque numbers, never freed memory), and `ncclCommGetAsyncError` reports that error.
//! - **Operations**: `ncclAllReduce`, `ncclBroadcast`, `ncclBcast`, `ncclReduce`,
//!   `ncclAllGather`, `ncclReduceScatter`, `ncclSend`, `ncclRecv`, and `ncclGroupStart` /
//!   `ncclGroupEnd` (operations inside a group are issued at the outermost `ncclGroupEnd`; the
//!   sends and receives of a group progress together, so a ring of sends and receives does not
//!   deadlock). Every data type up to `ncclBfloat16` (not the FP8 types) and the operators
//!   `ncclSum`, `ncclProd`, `ncclMax`, `ncclMin`, `ncclAvg` ([`reduce`]: rank order, rounding
//!   each step to the type; the average as NCCL computes it).
//!
//! Every other entry point cudarc's NCCL bindings may load is a stub ([`stubs`]) that prints
//! `tandem-cuda-emu: <name> is not emulated` and returns `ncclInvalidUsage`.
//!
//! # How it runs
//!
//! **Rendezvous and data** go through a shared-memory segment keyed by the unique id
//! ([`segment`]): a file in `/dev/shm` named from the id's random bytes, with a fixed header and,
//! per rank, a fixed staging area of [`segment::CHUNK`] bytes. Threads of one process and
//! processes use the same mechanism. The file's memory is reserved when it is created (a full
//! `/dev/shm` is an init error, not a fault during a collective), and it is unlinked as soon as
//! every rank has joined (or when a rank that joined aborts before the others came), so a crash
//! leaves nothing behind. A rank joining with another `nranks` or a rank already taken gets
//! `ncclInvalidUsage` from the non-blocking init (its asynchronous error).
//!
//! **Operations run on the stream's worker**: a call checks its arguments — its device buffers
//! must each lie in one live allocation of the emulated driver
//! (`tandem_cuda_emu_check_device_range`), so a wrong data type that makes NCCL read or write
//! past a buffer fails with `ncclInvalidArgument` and a message naming the call, count and data
//! type — and enqueues the operation with `cuLaunchHostFunc`. The worker runs it when the stream
//! gets there and blocks until every rank has arrived, as NCCL's kernels do: a collective
//! issued before its inputs are ready, or read before it finished, is a real race on the
//! emulator. A collective moves in rounds of one chunk: each rank posts its chunk and the
//! round's descriptor (operation, count, data type, operator, root, collective number), waits
//! for every rank's post, reads what it needs, and marks the round consumed.
//!
//! **Mismatched collectives**: every rank compares every rank's descriptor with its own at each
//! round; a difference sets the communicator's asynchronous error (`ncclInvalidUsage`) with a
//! message naming both operations, and the communicator stops (its later operations do
//! nothing). Real NCCL would hang or combine the wrong buffers.
//!
//! **Waiting** spins briefly, then sleeps with a backoff from 50 µs to 1 ms, checking the
//! communicator's abort flag. There is no timeout: a rank that dies leaves the others'
//! operations pending until `ncclCommAbort`, which makes every blocked worker of that
//! communicator return at once (waiting up to 10 s for them) and fails every later call on
//! it; tandem's watchdog calls it. At process exit every communicator is aborted, so no worker
//! blocks the exit.
//!
//! # What only real NCCL checks
//!
//! NCCL's own algorithms and their rounding (rings and trees sum in another order; results here
//! are those of a rank-order reduction), speed, several GPUs and their topology, network
//! transports, `NCCL_*` settings, memory registration, and NCCL's own errors on a real GPU
//! ("Duplicate GPU detected", remote errors reported by the proxy when a peer dies: the
//! emulator leaves the peer pending instead). The segment's file is trusted not to be shrunk
//! by another process while mapped.
//!
//! # Tests
//!
//! `tests/collectives.rs` (every collective × data type × operator against a host reference on
//! 2, 4 and 8 thread ranks, chunked sizes, in place, groups, a ring of sends and receives),
//! `tests/processes.rs` (two processes; a killed rank left pending until the abort; a process
//! exiting with a collective pending), `tests/failures.rs` (non-blocking init, abort, mismatched
//! collectives, a wrong data type, forged ids and segments, another rank count, a duplicate
//! rank, an impossible posted length), `tests/symbols.rs`. tandem's own NCCL group tests
//! (`dist/tests/cuda_nccl.rs`) run on it in CI.

#![warn(missing_docs)]
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::too_many_arguments)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_cuda_emu_link::{self as link, Library};

pub mod reduce;
pub mod segment;
pub mod stubs;

use reduce::{DataType, RedOp};
use segment::{Desc, Segment, CHUNK};

/// `ncclResult_t`.
pub type Status = c_int;
/// `ncclSuccess`.
pub const SUCCESS: Status = 0;
/// `ncclSystemError`.
pub const SYSTEM_ERROR: Status = 2;
/// `ncclInternalError`.
pub const INTERNAL_ERROR: Status = 3;
/// `ncclInvalidArgument`.
pub const INVALID_ARGUMENT: Status = 4;
/// `ncclInvalidUsage`.
pub const INVALID_USAGE: Status = 5;
/// `ncclInProgress`.
pub const IN_PROGRESS: Status = 7;

/// The version reported: 2.28.9, the NCCL of the GPU machine's PyTorch.
pub const VERSION_CODE: c_int = 22809;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;
/// The first bytes of every id the emulator makes.
pub const ID_MAGIC: &[u8; 16] = b"tandem-nccl-emu\0";

/// `ncclUniqueId`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    /// The bytes: [`ID_MAGIC`], 16 random bytes, zeros.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The body of an entry point: `Err` holds the status to return.
type Res = link::Res<Nccl>;

/// NCCL for the shared code of the emulator's libraries.
pub enum Nccl {}

impl Library for Nccl {
    type Status = Status;
    const NAME: &'static str = "NCCL";
    const WORK: &'static str = "operation";
    const WORKER_PANIC: &'static str = "an NCCL operation panicked on its stream's worker";
    const SUCCESS: Status = SUCCESS;
    const INTERNAL_ERROR: Status = INTERNAL_ERROR;
    const NOT_EMULATED: Status = INVALID_USAGE;
    const NO_DRIVER: Status = INTERNAL_ERROR;
    const ENQUEUE_FAILED: Status = INTERNAL_ERROR;

    /// A failure is also the thread's last error (`ncclGetLastError`).
    fn keep_error(message: &str) {
        set_last_error(message.to_string());
    }

    fn range_fault(what: String) -> Status {
        link::fail::<Nccl, ()>(
            INVALID_ARGUMENT,
            format!("{what}: not inside one live device allocation"),
        )
        .err()
        .unwrap_or(INVALID_ARGUMENT)
    }
}

use link::say;

/// The last error of a call on this thread (NCCL keeps one per thread as well); an
/// asynchronous error is kept by its communicator.
fn set_last_error(message: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// Fails with `status` after saying why (stderr and `ncclGetLastError`).
fn fail<T>(status: Status, message: String) -> Result<T, Status> {
    link::fail::<Nccl, T>(status, message)
}

/// Runs an entry point's body; a panic becomes `ncclInternalError` with a message (it must not
/// unwind into C).
fn entry(name: &str, body: impl FnOnce() -> Res) -> Status {
    link::entry::<Nccl>(name, body)
}

/// Writes through an out-pointer, or fails with `ncclInvalidArgument` when null.
unsafe fn put<T>(name: &str, out: *mut T, value: T) -> Res {
    if out.is_null() {
        return fail(INVALID_ARGUMENT, format!("{name}: a null out-pointer"));
    }
    // SAFETY: non-null; NCCL's contract for out-parameters.
    unsafe { out.write(value) };
    Ok(())
}

// ---- The emulated driver (tandem-cuda-emu-link) -----------------------------------------------

/// Checks that `len` bytes at `ptr` lie in one live device allocation; the driver reports the
/// fault (starting with `what`) on stderr.
fn check_range(ptr: u64, len: usize, what: impl FnOnce() -> String) -> Res {
    link::check_range::<Nccl>(ptr, len, what)
}

/// Work for a stream's worker.
type Job = link::Job;

/// Enqueues `job` on `stream` in stream order.
fn launch(name: &str, stream: usize, job: Job) -> Res {
    link::enqueue::<Nccl>(name, stream, job)
}

// ---- Unique ids -------------------------------------------------------------------------------

/// The segment name of an id the emulator made (hex of its random bytes).
fn id_name(id: &UniqueId) -> Result<String, String> {
    let bytes: Vec<u8> = id.internal.iter().map(|&b| b as u8).collect();
    if &bytes[..16] != ID_MAGIC {
        return Err(
            "the unique id was not made by the emulated NCCL's ncclGetUniqueId (an id of the \
             real NCCL, or garbage): every rank must use the id one rank got from this library"
                .into(),
        );
    }
    if bytes[32..].iter().any(|&b| b != 0) {
        return Err("the unique id's trailing bytes are not zero: it was altered".into());
    }
    Ok(bytes[16..32].iter().map(|b| format!("{b:02x}")).collect())
}

/// Emulates `ncclGetUniqueId`: [`ID_MAGIC`] and 16 random bytes from `/dev/urandom`, which name the
/// communicator's shared-memory segment.
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(out: *mut UniqueId) -> Status {
    entry("ncclGetUniqueId", || {
        let mut random = [0u8; 16];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut random))
            .or_else(|e| fail(SYSTEM_ERROR, format!("ncclGetUniqueId: /dev/urandom: {e}")))?;
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (dst, &src) in id.internal.iter_mut().zip(ID_MAGIC.iter().chain(&random)) {
            *dst = src as c_char;
        }
        // SAFETY: the caller's out-parameter.
        unsafe { put("ncclGetUniqueId", out, id) }
    })
}

/// Emulates `ncclGetVersion`: [`VERSION_CODE`] (2.28.9).
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> Status {
    // SAFETY: the caller's out-parameter.
    entry("ncclGetVersion", || unsafe {
        put("ncclGetVersion", version, VERSION_CODE)
    })
}

// ---- Communicators ----------------------------------------------------------------------------

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `ncclAllReduce`.
    AllReduce = 1,
    /// `ncclBroadcast` (and `ncclBcast`).
    Broadcast = 2,
    /// `ncclReduce`.
    Reduce = 3,
    /// `ncclAllGather`.
    AllGather = 4,
    /// `ncclReduceScatter`.
    ReduceScatter = 5,
    /// `ncclSend`.
    Send = 6,
    /// `ncclRecv`.
    Recv = 7,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "ncclAllReduce",
            Kind::Broadcast => "ncclBroadcast",
            Kind::Reduce => "ncclReduce",
            Kind::AllGather => "ncclAllGather",
            Kind::ReduceScatter => "ncclReduceScatter",
            Kind::Send => "ncclSend",
            Kind::Recv => "ncclRecv",
        }
    }

    fn from_raw(raw: u64) -> Option<Kind> {
        Some(match raw {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::Reduce,
            4 => Kind::AllGather,
            5 => Kind::ReduceScatter,
            6 => Kind::Send,
            7 => Kind::Recv,
            _ => return None,
        })
    }
}

/// One operation, checked at its call.
#[derive(Clone, Copy, Debug)]
struct Op {
    kind: Kind,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    op: RedOp,
    /// The root (broadcast, reduce) or the peer (send, receive).
    root: usize,
    /// The collective's number on the communicator (0 for send and receive).
    seq: u64,
}

/// Describes a posted descriptor in words (its fields may come from another process: only
/// formatted, never used).
fn describe(d: &Desc) -> String {
    let kind = Kind::from_raw(d.kind);
    let name = kind.map_or_else(|| format!("operation {}", d.kind), |k| k.name().to_string());
    let dtype = DataType::from_raw(d.dtype as i32).map_or_else(
        || format!("data type {}", d.dtype),
        |t| t.name().to_string(),
    );
    let op = RedOp::from_raw(d.op as i32)
        .map_or_else(|| format!("operator {}", d.op), |o| o.name().to_string());
    let body = match kind {
        Some(Kind::AllReduce | Kind::ReduceScatter) => format!("count {}, {dtype}, {op}", d.count),
        Some(Kind::Reduce) => format!("count {}, {dtype}, {op}, root {}", d.count, d.root),
        Some(Kind::Broadcast) => format!("count {}, {dtype}, root {}", d.count, d.root),
        _ => format!("count {}, {dtype}", d.count),
    };
    format!("{name}({body}) as collective #{}", d.seq)
}

/// Why an operation stopped.
enum Stop {
    /// `ncclCommAbort` was called.
    Aborted,
    /// An error to set as the communicator's asynchronous error.
    Error(Status, String),
}

/// A communicator of this process.
pub struct Comm {
    rank: usize,
    nranks: usize,
    path: String,
    segment: OnceLock<Segment>,
    /// `ncclInProgress` until the rendezvous completes, then `ncclSuccess` or its error.
    init: AtomicI32,
    /// The asynchronous error (`ncclSuccess` while healthy) and its message.
    error: AtomicI32,
    message: Mutex<String>,
    aborted: AtomicBool,
    /// Tickets order the communicator's operations as they were issued, whatever stream
    /// each runs on. Taken under `issue`.
    next_ticket: AtomicU64,
    serving: AtomicU64,
    issue: Mutex<()>,
    /// The next collective's number.
    next_seq: AtomicU64,
    /// Rounds done on the segment (only the operation being served touches it).
    round: AtomicU64,
    /// Messages sent to / received from each peer (only the operation being served touches
    /// them).
    sent: Mutex<Vec<u64>>,
    received: Mutex<Vec<u64>>,
    /// Workers and rendezvous threads inside this communicator.
    running: AtomicUsize,
    finalizing: AtomicBool,
    /// Whether this rank joined the segment.
    joined: AtomicBool,
    /// Whether calls block (`config.blocking`); non-blocking ones answer `ncclInProgress`.
    blocking: bool,
}

impl Comm {
    fn failed(&self) -> bool {
        self.error.load(Ordering::Acquire) != SUCCESS || self.aborted.load(Ordering::Acquire)
    }

    /// Sets the asynchronous error (the first wins) and reports it. The message is in place
    /// before the error shows.
    fn set_error(&self, status: Status, message: String) {
        let mut kept = self.message.lock();
        if self.error.load(Ordering::Acquire) != SUCCESS {
            return;
        }
        let message = format!("rank {} of {}: {message}", self.rank, self.nranks);
        say(&message);
        set_last_error(message.clone());
        *kept = message;
        self.error.store(status, Ordering::Release);
    }

    /// Waits until `ready` (spinning briefly, then sleeping 50 µs to 1 ms), or the
    /// communicator is aborted.
    fn wait(&self, mut ready: impl FnMut() -> Result<bool, Stop>) -> Result<(), Stop> {
        let started = Instant::now();
        let mut nap = Duration::from_micros(50);
        loop {
            if ready()? {
                return Ok(());
            }
            if self.aborted.load(Ordering::Acquire) {
                return Err(Stop::Aborted);
            }
            let waited = started.elapsed();
            if waited < Duration::from_micros(20) {
                std::hint::spin_loop();
            } else if waited < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }
}

/// Live communicators by handle (an opaque number, never dereferenced), and the handles of
/// destroyed or aborted ones, so that a later call on them fails instead of touching freed
/// memory.
struct Registry {
    live: HashMap<usize, Arc<Comm>>,
    gone: HashMap<usize, &'static str>,
    next: usize,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        // SAFETY: registering a plain function; it runs at exit.
        unsafe { libc::atexit(abort_everything) };
        Mutex::new(Registry {
            live: HashMap::new(),
            gone: HashMap::new(),
            next: 0x7e00_0000,
        })
    })
}

/// At exit: abort every communicator, so that no worker blocked in an operation holds the exit.
extern "C" fn abort_everything() {
    if let Some(r) = registry().try_lock() {
        for comm in r.live.values() {
            comm.aborted.store(true, Ordering::Release);
        }
    }
}

fn lookup(name: &str, handle: *mut c_void) -> Result<Arc<Comm>, Status> {
    let r = registry().lock();
    if let Some(c) = r.live.get(&(handle as usize)) {
        return Ok(c.clone());
    }
    match r.gone.get(&(handle as usize)) {
        Some(how) => fail(
            INVALID_USAGE,
            format!("{name}: communicator {handle:p} was {how}"),
        ),
        None => fail(
            INVALID_ARGUMENT,
            format!("{name}: {handle:p} is not a communicator of the emulated NCCL"),
        ),
    }
}

/// Joins the segment: open, claim the rank, wait for every rank.
fn rendezvous(comm: &Comm) -> Result<(), Stop> {
    let segment = Segment::open(&comm.path, comm.nranks).map_err(|e| {
        let status = if e.contains("every rank must pass") || e.contains("not a segment") {
            INVALID_USAGE
        } else {
            SYSTEM_ERROR
        };
        Stop::Error(status, format!("ncclCommInitRank: {e}"))
    })?;
    segment
        .join(comm.rank)
        .map_err(|e| Stop::Error(INVALID_USAGE, format!("ncclCommInitRank: {e}")))?;
    let segment = comm.segment.get_or_init(|| segment);
    comm.joined.store(true, Ordering::Release);
    if comm.aborted.load(Ordering::Acquire) {
        segment.unlink();
        return Err(Stop::Aborted);
    }
    comm.wait(|| {
        segment
            .all_joined()
            .map_err(|e| Stop::Error(INVALID_USAGE, format!("ncclCommInitRank: {e}")))
    })
}

/// Runs the rendezvous and records its outcome.
fn finish_init(comm: &Comm) {
    let status = match rendezvous(comm) {
        Ok(()) => SUCCESS,
        Err(Stop::Aborted) => INVALID_USAGE,
        Err(Stop::Error(status, message)) => {
            comm.set_error(status, message);
            status
        }
    };
    comm.init.store(status, Ordering::Release);
    comm.running.fetch_sub(1, Ordering::AcqRel);
}

thread_local! {
    /// `ncclGroupStart` depth and the operations and blocking inits held until the outermost
    /// `ncclGroupEnd`.
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
    /// The last error of a call on this thread.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// `ncclGetLastError`'s string (valid until this thread's next call).
    static LAST_TEXT: RefCell<CString> = RefCell::new(CString::default());
}

#[derive(Default)]
struct Group {
    depth: usize,
    ops: Vec<(Arc<Comm>, usize, Op)>,
    inits: Vec<Arc<Comm>>,
}

fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// `ncclConfig_t`'s first fields (NCCL 2.14's layout).
#[repr(C)]
pub struct Config {
    /// `sizeof(ncclConfig_t)` (not checked).
    pub size: usize,
    /// `NCCL_CONFIG_INITIALIZER`'s magic, checked.
    pub magic: u32,
    /// The NCCL version the config was made for (not checked).
    pub version: u32,
    /// 0: non-blocking init and finalize; any other value blocking.
    pub blocking: c_int,
}

const CONFIG_MAGIC: u32 = 0xcafe_beef;

fn init_comm(
    name: &str,
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    blocking: bool,
) -> Res {
    if out.is_null() {
        return fail(INVALID_ARGUMENT, format!("{name}: a null comm pointer"));
    }
    if nranks < 1 || nranks as usize > segment::MAX_RANKS {
        return fail(
            INVALID_ARGUMENT,
            format!(
                "{name}: nranks {nranks} (the emulated NCCL supports 1 to {})",
                segment::MAX_RANKS
            ),
        );
    }
    if rank < 0 || rank >= nranks {
        return fail(
            INVALID_ARGUMENT,
            format!("{name}: rank {rank} is not in 0..{nranks}"),
        );
    }
    let id_name = id_name(&id).or_else(|e| fail(INVALID_ARGUMENT, format!("{name}: {e}")))?;
    let comm = Arc::new(Comm {
        rank: rank as usize,
        nranks: nranks as usize,
        path: Segment::path_for(&id_name),
        segment: OnceLock::new(),
        init: AtomicI32::new(IN_PROGRESS),
        error: AtomicI32::new(SUCCESS),
        message: Mutex::new(String::new()),
        aborted: AtomicBool::new(false),
        next_ticket: AtomicU64::new(0),
        serving: AtomicU64::new(0),
        issue: Mutex::new(()),
        next_seq: AtomicU64::new(1),
        round: AtomicU64::new(0),
        sent: Mutex::new(vec![0; nranks as usize]),
        received: Mutex::new(vec![0; nranks as usize]),
        running: AtomicUsize::new(1),
        finalizing: AtomicBool::new(false),
        joined: AtomicBool::new(false),
        blocking,
    });
    let handle = {
        let mut r = registry().lock();
        r.next += 0x100;
        let handle = r.next;
        r.live.insert(handle, comm.clone());
        handle
    };
    let worker = comm.clone();
    std::thread::Builder::new()
        .name(format!("tandem-nccl-emu-init-{rank}"))
        .spawn(move || finish_init(&worker))
        .or_else(|e| {
            comm.running.fetch_sub(1, Ordering::AcqRel);
            comm.init.store(SYSTEM_ERROR, Ordering::Release);
            fail(
                SYSTEM_ERROR,
                format!("{name}: starting the rendezvous: {e}"),
            )
        })?;
    // SAFETY: checked non-null; the caller's out-parameter.
    unsafe { out.write(handle as *mut c_void) };
    if !blocking {
        return Err(IN_PROGRESS);
    }
    if in_group() {
        GROUP.with(|g| g.borrow_mut().inits.push(comm));
        return Ok(());
    }
    wait_init(&comm)
}

/// Waits for a blocking init's rendezvous.
fn wait_init(comm: &Comm) -> Res {
    let _ = comm.wait(|| Ok(comm.init.load(Ordering::Acquire) != IN_PROGRESS));
    match comm.init.load(Ordering::Acquire) {
        SUCCESS => Ok(()),
        IN_PROGRESS => Err(INVALID_USAGE),
        status => Err(status),
    }
}

/// Emulates `ncclCommInitRankConfig`: as [`ncclCommInitRank`], non-blocking when the config says so
/// (`ncclInProgress` until every rank has joined); a config without NCCL's magic is
/// `ncclInvalidArgument`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut Config,
) -> Status {
    entry("ncclCommInitRankConfig", || {
        let blocking = if config.is_null() {
            true
        } else {
            // SAFETY: the caller passes an ncclConfig_t, whose first fields are `Config`.
            let c = unsafe { &*config };
            if c.magic != CONFIG_MAGIC {
                return fail(
                    INVALID_ARGUMENT,
                    format!(
                        "ncclCommInitRankConfig: the config's magic is {:#x}, not {CONFIG_MAGIC:#x} \
                         (initialise it with NCCL_CONFIG_INITIALIZER)",
                        c.magic
                    ),
                );
            }
            // NCCL_CONFIG_UNDEF_INT means the default, blocking.
            c.blocking != 0
        };
        init_comm("ncclCommInitRankConfig", out, nranks, id, rank, blocking)
    })
}

/// Emulates `ncclCommInitRank`: joins the shared-memory segment named by the id and waits for every
/// rank (at the outermost `ncclGroupEnd` inside a group); an id the emulator did not make is
/// `ncclInvalidArgument`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> Status {
    entry("ncclCommInitRank", || {
        init_comm("ncclCommInitRank", out, nranks, id, rank, true)
    })
}

/// Emulates `ncclCommCount`: the communicator's number of ranks.
#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, count: *mut c_int) -> Status {
    entry("ncclCommCount", || {
        let c = lookup("ncclCommCount", comm)?;
        // SAFETY: the caller's out-parameter.
        unsafe { put("ncclCommCount", count, c.nranks as c_int) }
    })
}

/// Emulates `ncclCommUserRank`: this rank.
#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, rank: *mut c_int) -> Status {
    entry("ncclCommUserRank", || {
        let c = lookup("ncclCommUserRank", comm)?;
        // SAFETY: the caller's out-parameter.
        unsafe { put("ncclCommUserRank", rank, c.rank as c_int) }
    })
}

/// Emulates `ncclCommCuDevice`: always device 0 (the emulated driver has one).
#[no_mangle]
pub unsafe extern "C" fn ncclCommCuDevice(comm: *mut c_void, device: *mut c_int) -> Status {
    entry("ncclCommCuDevice", || {
        lookup("ncclCommCuDevice", comm)?;
        // SAFETY: the caller's out-parameter. The emulated driver has one device.
        unsafe { put("ncclCommCuDevice", device, 0) }
    })
}

/// Emulates `ncclCommGetAsyncError`: the communicator's asynchronous error (a mismatched collective
/// among them), `ncclInProgress` during a non-blocking init or finalize, and `ncclInvalidUsage`
/// once it is destroyed or aborted.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(comm: *mut c_void, state: *mut Status) -> Status {
    entry("ncclCommGetAsyncError", || {
        let value = {
            let r = registry().lock();
            match (r.live.get(&(comm as usize)), r.gone.get(&(comm as usize))) {
                (Some(c), _) => Some(c.clone()),
                (None, Some(_)) => None,
                (None, None) => {
                    drop(r);
                    return fail(
                        INVALID_ARGUMENT,
                        format!(
                            "ncclCommGetAsyncError: {comm:p} is not a communicator of the \
                             emulated NCCL"
                        ),
                    );
                }
            }
        };
        let status = match value {
            // Destroyed or aborted: an error from now on.
            None => INVALID_USAGE,
            Some(c) => {
                let error = c.error.load(Ordering::Acquire);
                let init = c.init.load(Ordering::Acquire);
                if error != SUCCESS {
                    error
                } else if init != SUCCESS {
                    init
                } else if c.finalizing.load(Ordering::Acquire)
                    && c.serving.load(Ordering::Acquire) < c.next_ticket.load(Ordering::Acquire)
                {
                    IN_PROGRESS
                } else {
                    SUCCESS
                }
            }
        };
        // SAFETY: the caller's out-parameter.
        unsafe { put("ncclCommGetAsyncError", state, status) }
    })
}

/// Emulates `ncclCommFinalize`: waits for the operations issued before it (a non-blocking
/// communicator returns `ncclInProgress` instead).
#[no_mangle]
pub extern "C" fn ncclCommFinalize(comm: *mut c_void) -> Status {
    entry("ncclCommFinalize", || {
        let c = lookup("ncclCommFinalize", comm)?;
        c.finalizing.store(true, Ordering::Release);
        let error = c.error.load(Ordering::Acquire);
        if error != SUCCESS {
            return Err(error);
        }
        if c.serving.load(Ordering::Acquire) >= c.next_ticket.load(Ordering::Acquire) {
            return Ok(());
        }
        if !c.blocking {
            return Err(IN_PROGRESS);
        }
        let _ = c.wait(|| {
            Ok(c.failed()
                || c.serving.load(Ordering::Acquire) >= c.next_ticket.load(Ordering::Acquire))
        });
        match c.error.load(Ordering::Acquire) {
            SUCCESS if !c.aborted.load(Ordering::Acquire) => Ok(()),
            SUCCESS => Err(INVALID_USAGE),
            error => Err(error),
        }
    })
}

/// Removes a communicator: later calls with its handle fail.
fn retire(handle: *mut c_void, how: &'static str) -> Result<Arc<Comm>, Status> {
    let mut r = registry().lock();
    match r.live.remove(&(handle as usize)) {
        Some(c) => {
            r.gone.insert(handle as usize, how);
            Ok(c)
        }
        None => {
            let known = r.gone.get(&(handle as usize)).copied();
            drop(r);
            match known {
                Some(how) => fail(
                    INVALID_USAGE,
                    format!("communicator {handle:p} was {how} already"),
                ),
                None => fail(
                    INVALID_ARGUMENT,
                    format!("{handle:p} is not a communicator of the emulated NCCL"),
                ),
            }
        }
    }
}

/// Stops every worker of `c` and waits (up to 10 s) until none is inside it.
fn stop(c: &Comm) {
    c.aborted.store(true, Ordering::Release);
    if c.init.load(Ordering::Acquire) != SUCCESS && c.joined.load(Ordering::Acquire) {
        // This rank joined and the rendezvous may not have completed: it never will now, and
        // nobody else may unlink the file. (A rank refused before joining leaves the file to
        // the ranks that did.)
        // SAFETY: a NUL-terminated path; a missing file is fine.
        if let Ok(path) = CString::new(c.path.clone()) {
            unsafe { libc::unlink(path.as_ptr()) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.running.load(Ordering::Acquire) > 0 {
        if Instant::now() > deadline {
            say(&format!(
                "rank {}: ncclCommAbort: {} workers still inside the communicator after 10 s",
                c.rank,
                c.running.load(Ordering::Acquire)
            ));
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Emulates `ncclCommAbort`: retires the handle and makes every worker blocked in the communicator
/// return (waiting up to 10 s for them); later calls on it fail.
#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: *mut c_void) -> Status {
    entry("ncclCommAbort", || {
        let c = retire(comm, "aborted")?;
        stop(&c);
        Ok(())
    })
}

/// Emulates `ncclCommDestroy`: waits for the operations issued before it (unless the communicator
/// failed), then stops it as [`ncclCommAbort`] does.
#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: *mut c_void) -> Status {
    entry("ncclCommDestroy", || {
        let c = retire(comm, "destroyed")?;
        // As NCCL's implicit finalize: the operations issued before finish first (with every
        // rank), unless the communicator failed.
        let _ = c.wait(|| {
            Ok(c.failed()
                || c.serving.load(Ordering::Acquire) >= c.next_ticket.load(Ordering::Acquire))
        });
        stop(&c);
        Ok(())
    })
}

/// Emulates `ncclGetErrorString`: NCCL's text for each `ncclResult_t`.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(status: Status) -> *const c_char {
    let text: &CStr = match status {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        8 => c"NCCL operation timed out",
        _ => c"unknown result code",
    };
    text.as_ptr()
}

/// Emulates `ncclGetLastError`: the communicator's asynchronous error message if it has one, else
/// the last error of a call on this thread. The text stays valid until this thread calls it again.
#[no_mangle]
pub extern "C" fn ncclGetLastError(comm: *mut c_void) -> *const c_char {
    let mut text = LAST_ERROR.with(|e| e.borrow().clone());
    if let Some(c) = registry().lock().live.get(&(comm as usize)) {
        let message = c.message.lock();
        if !message.is_empty() {
            text = message.clone();
        }
    }
    let text = CString::new(text.replace('\0', " ")).unwrap_or_default();
    LAST_TEXT.with(|t| {
        *t.borrow_mut() = text;
        t.borrow().as_ptr()
    })
}

// ---- Operations -------------------------------------------------------------------------------

/// Checks an operation's arguments and issues it (or holds it until `ncclGroupEnd`).
fn submit(
    comm: *mut c_void,
    stream: *mut c_void,
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
) -> Res {
    let name = kind.name();
    let c = lookup(name, comm)?;
    check_usable(name, &c)?;
    let Some(dtype) = DataType::from_raw(dtype) else {
        return fail(
            INVALID_ARGUMENT,
            format!("{name}: data type {dtype} is not one the emulated NCCL knows"),
        );
    };
    let op = reduction(name, kind, op)?;
    let root = root_rank(name, kind, root, c.nranks)?;
    check_buffers(&c, kind, root, send, recv, count, dtype)?;
    let op = Op {
        kind,
        send: send as u64,
        recv: recv as u64,
        count,
        dtype,
        op,
        root,
        seq: 0,
    };
    let grouped = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.ops.push((c.clone(), stream as usize, op));
            true
        } else {
            false
        }
    });
    if grouped {
        return Ok(());
    }
    issue(&c, stream as usize, vec![op])
}

/// Errors when `c` cannot take operations: its initialisation is unfinished or failed, or an
/// earlier operation failed (NCCL's errors are sticky on the communicator).
fn check_usable(name: &str, c: &Comm) -> Res {
    match c.init.load(Ordering::Acquire) {
        SUCCESS => {}
        IN_PROGRESS => {
            return fail(
                INVALID_USAGE,
                format!("{name}: the communicator's initialisation is still in progress"),
            )
        }
        status => return Err(status),
    }
    let error = c.error.load(Ordering::Acquire);
    if error != SUCCESS {
        return fail(
            error,
            format!(
                "{name}: the communicator failed before: {}",
                c.message.lock()
            ),
        );
    }
    Ok(())
}

/// The reduction operator of a `kind` operation; operations that do not reduce ignore it, as
/// NCCL does, so any value passes for them.
fn reduction(name: &str, kind: Kind, op: c_int) -> Result<RedOp, Status> {
    let reduces = matches!(kind, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter);
    match RedOp::from_raw(op) {
        Some(op) => Ok(op),
        None if reduces => fail(
            INVALID_ARGUMENT,
            format!("{name}: reduction operator {op} is not one the emulated NCCL knows"),
        ),
        None => Ok(RedOp::Sum),
    }
}

/// The root (or, for a send or receive, the peer) of a `kind` operation, checked to be a rank
/// of a communicator of `nranks`; 0 for operations without one.
fn root_rank(name: &str, kind: Kind, root: c_int, nranks: usize) -> Result<usize, Status> {
    let has_root = matches!(
        kind,
        Kind::Broadcast | Kind::Reduce | Kind::Send | Kind::Recv
    );
    if has_root && (root < 0 || root as usize >= nranks) {
        let what = if matches!(kind, Kind::Send | Kind::Recv) {
            "peer"
        } else {
            "root"
        };
        return fail(
            INVALID_ARGUMENT,
            format!("{name}: {what} {root} is not a rank of this communicator of {nranks}"),
        );
    }
    Ok(if has_root { root as usize } else { 0 })
}

/// Checks that the send and receive buffers a `kind` operation on this rank touches lie in
/// live allocations: the worker copies through them later, when the caller's check can no
/// longer fail the call.
fn check_buffers(
    c: &Comm,
    kind: Kind,
    root: usize,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: DataType,
) -> Res {
    let name = kind.name();
    let call = |what: &str| format!("{name}(count {count}, {}) {what}", dtype.name());
    let bytes = |elements: Option<usize>| -> Result<usize, Status> {
        elements
            .and_then(|e| e.checked_mul(dtype.size()))
            .map_or_else(|| fail(INVALID_ARGUMENT, call("overflows")), Ok)
    };
    let one = bytes(Some(count))?;
    let all = bytes(count.checked_mul(c.nranks))?;
    let (send_bytes, recv_bytes) = match kind {
        Kind::AllReduce => (one, one),
        Kind::Broadcast => (if c.rank == root { one } else { 0 }, one),
        Kind::Reduce => (one, if c.rank == root { one } else { 0 }),
        Kind::AllGather => (one, all),
        Kind::ReduceScatter => (all, one),
        Kind::Send => (one, 0),
        Kind::Recv => (0, one),
    };
    if send_bytes > 0 {
        check_range(send as u64, send_bytes, || {
            call(&format!("sendbuff {send:p} ({send_bytes} bytes)"))
        })?;
    }
    if recv_bytes > 0 {
        check_range(recv as u64, recv_bytes, || {
            call(&format!("recvbuff {recv:p} ({recv_bytes} bytes)"))
        })?;
    }
    Ok(())
}

/// Takes a ticket and enqueues `ops` (one collective, or the sends and receives of a group) on
/// `stream`.
fn issue(c: &Arc<Comm>, stream: usize, mut ops: Vec<Op>) -> Res {
    let _order = c.issue.lock();
    for op in &mut ops {
        if !matches!(op.kind, Kind::Send | Kind::Recv) {
            op.seq = c.next_seq.fetch_add(1, Ordering::AcqRel);
        }
    }
    let ticket = c.next_ticket.load(Ordering::Acquire);
    let comm = c.clone();
    let name = ops[0].kind.name();
    launch(name, stream, Box::new(move || execute(&comm, ticket, &ops)))?;
    c.next_ticket.store(ticket + 1, Ordering::Release);
    Ok(())
}

/// On the stream's worker: waits for the ticket's turn, runs the operations, records an error.
fn execute(c: &Comm, ticket: u64, ops: &[Op]) {
    c.running.fetch_add(1, Ordering::AcqRel);
    let turn = c.wait(|| Ok(c.failed() || c.serving.load(Ordering::Acquire) >= ticket));
    if turn.is_ok() && !c.failed() {
        if let Some(segment) = c.segment.get() {
            let result = if ops
                .iter()
                .all(|o| matches!(o.kind, Kind::Send | Kind::Recv))
            {
                point_to_point(c, segment, ops)
            } else {
                ops.iter().try_for_each(|op| collective(c, segment, op))
            };
            if let Err(Stop::Error(status, message)) = result {
                c.set_error(status, message);
            }
        }
    }
    c.serving.fetch_max(ticket + 1, Ordering::AcqRel);
    c.running.fetch_sub(1, Ordering::AcqRel);
}

/// One round: waits until every rank consumed the previous one, lets `fill` write this rank's
/// staging area, posts `desc`, waits for every rank's post and checks their descriptors
/// against it. The caller reads the staging areas, then calls [`consumed`].
fn round(c: &Comm, s: &Segment, desc: &Desc, fill: impl FnOnce(*mut u8)) -> Result<u64, Stop> {
    let r = c.round.load(Ordering::Acquire) + 1;
    let n = c.nranks;
    c.wait(|| Ok((0..n).all(|q| s.slot(q).consumed.load(Ordering::Acquire) >= r - 1)))?;
    fill(s.staging(c.rank));
    let mine = s.slot(c.rank);
    mine.set_desc(desc);
    mine.posted.store(r, Ordering::Release);
    c.wait(|| Ok((0..n).all(|q| s.slot(q).posted.load(Ordering::Acquire) >= r)))?;
    for q in 0..n {
        let slot = s.slot(q);
        let posted = slot.posted.load(Ordering::Acquire);
        let theirs = slot.desc();
        if posted != r || theirs.len > CHUNK as u64 {
            return Err(Stop::Error(
                INTERNAL_ERROR,
                format!(
                    "rank {q} posted round {posted} of {} bytes while this rank is at round {r} \
                     (the shared segment was written by something else)",
                    theirs.len
                ),
            ));
        }
        if theirs != *desc {
            return Err(Stop::Error(
                INVALID_USAGE,
                format!(
                    "mismatched collectives: rank {} issued {} but rank {q} issued {} (round \
                     {} of the collective)",
                    c.rank,
                    describe(desc),
                    describe(&theirs),
                    desc.part
                ),
            ));
        }
    }
    c.round.store(r, Ordering::Release);
    Ok(r)
}

/// Marks round `r` consumed by this rank.
fn consumed(c: &Comm, s: &Segment, r: u64) {
    s.slot(c.rank).consumed.store(r, Ordering::Release);
}

/// Runs one collective in rounds of one chunk.
fn collective(c: &Comm, s: &Segment, op: &Op) -> Result<(), Stop> {
    let n = c.nranks;
    let es = op.dtype.size();
    if op.count == 0 {
        return Ok(());
    }
    // Elements per rank and round: reduce-scatter packs every destination's part in a chunk.
    let per = match op.kind {
        Kind::ReduceScatter => (CHUNK / n / es).max(1),
        _ => CHUNK / es,
    };
    let parts = op.count.div_ceil(per);
    for part in 0..parts {
        let off = part * per;
        let len = per.min(op.count - off);
        let chunk = Chunk {
            part,
            per,
            off,
            len,
            bytes: len * es,
        };
        let desc = chunk_desc(op, n, &chunk);
        // SAFETY (the staging and the combining): the device ranges were checked at the call
        // to lie in live allocations of count (or nranks × count) elements, and the caller
        // keeps them alive until the stream passes this operation; staging areas hold CHUNK
        // bytes and every length here is at most that (per ≤ CHUNK / es, and
        // nranks × per × es ≤ CHUNK for reduce-scatter).
        let r = round(c, s, &desc, |staging| unsafe {
            stage_chunk(op, c.rank, n, &chunk, staging)
        })?;
        // SAFETY: as above.
        unsafe { combine_chunk(op, s, c.rank, n, &chunk) };
        consumed(c, s, r);
    }
    Ok(())
}

/// One round's share of a collective, in elements of each rank's buffer.
#[derive(Clone, Copy)]
struct Chunk {
    /// The round's number within the operation.
    part: usize,
    /// Elements per rank and round.
    per: usize,
    /// The first element of this round.
    off: usize,
    /// Elements in this round.
    len: usize,
    /// `len` in bytes.
    bytes: usize,
}

/// The description of one round of `op`, which every rank posts and checks against the others'
/// (a mismatch means the ranks called different collectives).
fn chunk_desc(op: &Op, n: usize, chunk: &Chunk) -> Desc {
    Desc {
        kind: op.kind as u64,
        dtype: op.dtype.raw() as u64,
        op: if matches!(
            op.kind,
            Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter
        ) {
            op.op.raw() as u64
        } else {
            0
        },
        root: op.root as u64,
        count: op.count as u64,
        seq: op.seq,
        part: chunk.part as u64,
        len: if op.kind == Kind::ReduceScatter {
            (chunk.bytes * n) as u64
        } else {
            chunk.bytes as u64
        },
    }
}

/// Copies what rank `me` contributes to one round of `op` into its staging area.
///
/// # Safety
/// `op`'s send buffer holds `count` (for reduce-scatter `n × count`) elements and `staging`
/// holds CHUNK bytes, which the round's data fits.
unsafe fn stage_chunk(op: &Op, me: usize, n: usize, chunk: &Chunk, staging: *mut u8) {
    let es = op.dtype.size();
    let send = op.send as *mut u8;
    let Chunk {
        per, off, bytes, ..
    } = *chunk;
    // SAFETY: the ranges lie in the buffers the caller vouches for (see the function's doc).
    unsafe {
        match op.kind {
            Kind::AllReduce | Kind::Reduce | Kind::AllGather => {
                std::ptr::copy(send.add(off * es), staging, bytes)
            }
            Kind::Broadcast if me == op.root => std::ptr::copy(send.add(off * es), staging, bytes),
            Kind::ReduceScatter => {
                for q in 0..n {
                    std::ptr::copy(
                        send.add((q * op.count + off) * es),
                        staging.add(q * per * es),
                        bytes,
                    )
                }
            }
            _ => {}
        }
    }
}

/// Combines every rank's staged data of one round of `op` into rank `me`'s receive buffer.
///
/// # Safety
/// `op`'s receive buffer holds `count` (for all-gather `n × count`) elements, and every rank
/// has staged this round in `s`.
unsafe fn combine_chunk(op: &Op, s: &Segment, me: usize, n: usize, chunk: &Chunk) {
    let es = op.dtype.size();
    let recv = op.recv as *mut u8;
    let Chunk {
        per,
        off,
        len,
        bytes,
        ..
    } = *chunk;
    // SAFETY: the ranges lie in the buffers the caller vouches for (see the function's doc);
    // staging areas hold CHUNK bytes.
    unsafe {
        match op.kind {
            Kind::AllReduce | Kind::Reduce => {
                if op.kind == Kind::AllReduce || me == op.root {
                    for q in 0..n {
                        reduce::combine(
                            op.dtype,
                            op.op,
                            recv.add(off * es),
                            s.staging(q),
                            len,
                            q == 0,
                            q + 1 == n,
                            n,
                        );
                    }
                }
            }
            Kind::Broadcast => {
                std::ptr::copy(s.staging(op.root), recv.add(off * es), bytes);
            }
            Kind::AllGather => {
                for q in 0..n {
                    std::ptr::copy(s.staging(q), recv.add((q * op.count + off) * es), bytes);
                }
            }
            Kind::ReduceScatter => {
                for q in 0..n {
                    reduce::combine(
                        op.dtype,
                        op.op,
                        recv.add(off * es),
                        s.staging(q).add(me * per * es),
                        len,
                        q == 0,
                        q + 1 == n,
                        n,
                    );
                }
            }
            Kind::Send | Kind::Recv => {}
        }
    }
}

/// A send or receive in progress.
struct Transfer {
    op: Op,
    /// Bytes moved so far.
    done: usize,
}

/// Runs a group's sends and receives together: each round of the loop moves whatever can move
/// (this rank's mailbox holds one message at a time; a receive takes the message addressed to
/// it from its peer's mailbox), so sends and receives in any order complete.
fn point_to_point(c: &Comm, s: &Segment, ops: &[Op]) -> Result<(), Stop> {
    let mut sends: Vec<Transfer> = Vec::new();
    let mut recvs: Vec<Transfer> = Vec::new();
    for op in ops {
        let t = Transfer { op: *op, done: 0 };
        if op.kind == Kind::Send {
            sends.push(t);
        } else {
            recvs.push(t);
        }
    }
    let mut sent = c.sent.lock();
    let mut received = c.received.lock();
    let mailbox = s.mailbox(c.rank);
    // Messages this rank posted and whether the last was taken.
    let mut next_send = 0;
    c.wait(|| {
        post_sends(c, s, &mut sends, &mut next_send, &mut sent);
        take_receives(c, s, &mut recvs, &mut received)?;
        let sends_done = next_send >= sends.len();
        let recvs_done = recvs.iter().all(|t| t.done >= t.total());
        // The last message must be taken before the mailbox may be reused by a later group.
        let taken = mailbox.taken.load(Ordering::Acquire) >= mailbox.posted.load(Ordering::Acquire);
        Ok(sends_done && recvs_done && taken)
    })
}

impl Transfer {
    /// The bytes the whole transfer moves.
    fn total(&self) -> usize {
        self.op.count * self.op.dtype.size()
    }
}

/// Sends, in order: posts the next chunk in this rank's mailbox whenever it is free, and moves
/// `next_send` past finished sends. `sent` counts the messages posted to each peer.
fn post_sends(
    c: &Comm,
    s: &Segment,
    sends: &mut [Transfer],
    next_send: &mut usize,
    sent: &mut [u64],
) {
    let me = c.rank;
    let mailbox = s.mailbox(me);
    while *next_send < sends.len() {
        let t = &mut sends[*next_send];
        if t.done >= t.total() && t.done > 0 || t.total() == 0 {
            *next_send += 1;
            continue;
        }
        if mailbox.taken.load(Ordering::Acquire) < mailbox.posted.load(Ordering::Acquire) {
            break;
        }
        let len = (t.total() - t.done).min(CHUNK);
        let peer = t.op.root;
        sent[peer] += 1;
        // SAFETY: the send buffer was checked at the call; the staging area holds CHUNK.
        unsafe {
            std::ptr::copy(
                (t.op.send as *const u8).add(t.done),
                s.mailbox_staging(me),
                len,
            )
        };
        mailbox.dst.store(peer as u64, Ordering::Relaxed);
        mailbox.index.store(sent[peer], Ordering::Relaxed);
        mailbox.len.store(len as u64, Ordering::Relaxed);
        mailbox.posted.fetch_add(1, Ordering::Release);
        t.done += len;
        if t.done < t.total() {
            break;
        }
    }
}

/// Receives: takes every message addressed to this rank that is next from its sender.
/// `received` counts the messages taken from each peer.
fn take_receives(
    c: &Comm,
    s: &Segment,
    recvs: &mut [Transfer],
    received: &mut [u64],
) -> Result<(), Stop> {
    let me = c.rank;
    let mut waiting = vec![false; c.nranks];
    for t in recvs.iter_mut() {
        let peer = t.op.root;
        // Messages from one peer arrive in order: only its first unfinished receive takes.
        if waiting[peer] {
            continue;
        }
        while t.done < t.total() {
            let theirs = s.mailbox(peer);
            let posted = theirs.posted.load(Ordering::Acquire);
            if theirs.taken.load(Ordering::Acquire) >= posted
                || theirs.dst.load(Ordering::Relaxed) != me as u64
                || theirs.index.load(Ordering::Relaxed) != received[peer] + 1
            {
                break;
            }
            let len = theirs.len.load(Ordering::Relaxed) as usize;
            let room = t.total() - t.done;
            if len > CHUNK || len > room || len == 0 {
                return Err(Stop::Error(
                    INVALID_USAGE,
                    format!(
                        "ncclRecv(count {}, {}) from rank {peer}: rank {peer} sent {len} bytes \
                         where {room} remain (mismatched send and receive, or a segment \
                         written by something else)",
                        t.op.count,
                        t.op.dtype.name()
                    ),
                ));
            }
            // SAFETY: the receive buffer was checked at the call and `len` fits what remains
            // of it; the mailbox's staging area holds CHUNK ≥ len bytes.
            unsafe {
                std::ptr::copy(
                    s.mailbox_staging(peer),
                    (t.op.recv as *mut u8).add(t.done),
                    len,
                )
            };
            t.done += len;
            received[peer] += 1;
            theirs.taken.store(posted, Ordering::Release);
        }
        waiting[peer] = t.done < t.total();
    }
    Ok(())
}

macro_rules! collective_entry {
    ($name:ident, ($($arg:ident: $ty:ty),*), $call:expr) => {
        #[doc = concat!("Emulates `", stringify!($name), "`: checks the arguments and that the \
            buffers lie in live allocations, then runs it on the stream's worker through the \
            shared-memory segment, blocking there until every rank arrives (inside a group, at \
            the outermost `ncclGroupEnd`); see the crate docs.")]
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> Status {
            entry(stringify!($name), || $call)
        }
    };
}

collective_entry!(ncclAllReduce,
    (send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int,
     comm: *mut c_void, stream: *mut c_void),
    submit(comm, stream, Kind::AllReduce, send, recv, count, dtype, op, 0));

collective_entry!(ncclBroadcast,
    (send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, root: c_int,
     comm: *mut c_void, stream: *mut c_void),
    submit(comm, stream, Kind::Broadcast, send, recv, count, dtype, -1, root));

collective_entry!(ncclBcast,
    (buff: *mut c_void, count: usize, dtype: c_int, root: c_int, comm: *mut c_void,
     stream: *mut c_void),
    submit(comm, stream, Kind::Broadcast, buff, buff, count, dtype, -1, root));

collective_entry!(ncclReduce,
    (send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int,
     root: c_int, comm: *mut c_void, stream: *mut c_void),
    submit(comm, stream, Kind::Reduce, send, recv, count, dtype, op, root));

collective_entry!(ncclAllGather,
    (send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, comm: *mut c_void,
     stream: *mut c_void),
    submit(comm, stream, Kind::AllGather, send, recv, count, dtype, -1, 0));

collective_entry!(ncclReduceScatter,
    (send: *const c_void, recv: *mut c_void, count: usize, dtype: c_int, op: c_int,
     comm: *mut c_void, stream: *mut c_void),
    submit(comm, stream, Kind::ReduceScatter, send, recv, count, dtype, op, 0));

collective_entry!(ncclSend,
    (send: *const c_void, count: usize, dtype: c_int, peer: c_int, comm: *mut c_void,
     stream: *mut c_void),
    submit(comm, stream, Kind::Send, send, std::ptr::null_mut(), count, dtype, -1, peer));

collective_entry!(ncclRecv,
    (recv: *mut c_void, count: usize, dtype: c_int, peer: c_int, comm: *mut c_void,
     stream: *mut c_void),
    submit(comm, stream, Kind::Recv, std::ptr::null(), recv, count, dtype, -1, peer));

/// Emulates `ncclGroupStart`: operations and blocking inits until the matching `ncclGroupEnd` are
/// held (groups nest).
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> Status {
    entry("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// Emulates `ncclGroupEnd`: at the outermost end, waits for the held inits and issues the held
/// operations, each communicator's and stream's sends and receives as one operation that progresses
/// together.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> Status {
    entry("ncclGroupEnd", || {
        let held = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(());
            }
            g.depth -= 1;
            if g.depth > 0 {
                return Ok(None);
            }
            Ok(Some((
                std::mem::take(&mut g.ops),
                std::mem::take(&mut g.inits),
            )))
        });
        let (ops, inits) = match held {
            Err(()) => {
                return fail(
                    INVALID_USAGE,
                    "ncclGroupEnd without ncclGroupStart".to_string(),
                )
            }
            Ok(None) => return Ok(()),
            Ok(Some(held)) => held,
        };
        for comm in &inits {
            wait_init(comm)?;
        }
        // Collectives in order; the sends and receives of each communicator and stream as one
        // operation, at the place of the first.
        let mut batches: Vec<(Arc<Comm>, usize, Vec<Op>)> = Vec::new();
        for (comm, stream, op) in ops {
            let p2p = matches!(op.kind, Kind::Send | Kind::Recv);
            let joined = p2p
                && batches.iter_mut().any(|(c, s, batch)| {
                    let same = Arc::ptr_eq(c, &comm)
                        && *s == stream
                        && matches!(batch[0].kind, Kind::Send | Kind::Recv);
                    if same {
                        batch.push(op);
                    }
                    same
                });
            if !joined {
                batches.push((comm, stream, vec![op]));
            }
        }
        let mut result = Ok(());
        for (comm, stream, batch) in batches {
            if let Err(status) = issue(&comm, stream, batch) {
                result = Err(status);
            }
        }
        result
    })
}
