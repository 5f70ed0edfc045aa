//! The shared-memory segment of one communicator: rendezvous and data.
//!
//! Every rank — a thread of this process or another process on this host — maps the same file
//! `/dev/shm/tandem-nccl-emu-<hex>`, named from the random part of the unique id. Its layout is
//! fixed by the number of ranks:
//!
//! - a [`Header`] (one page): the segment's magic, the layout version, the number of ranks, the
//!   chunk size, how many ranks joined;
//! - per rank a [`Slot`]: its claim (so a rank joins once), its pid, the round it last posted
//!   and last consumed, the descriptor of what it posted, and a staging area of [`CHUNK`]
//!   bytes; then a point-to-point mailbox ([`P2p`]) with a staging area of [`CHUNK`] bytes.
//!
//! The staging areas never grow: a collective larger than a chunk runs in rounds of one chunk.
//! The file is unlinked as soon as every rank has joined, so a crash leaves nothing behind.
//!
//! Everything another process can write is checked before use: the header's fields (a segment
//! made by something else, or for another number of ranks, is refused), each posted
//! descriptor's length against [`CHUNK`]; no length read from the segment sizes an allocation
//! or an index beyond the mapping.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of each rank's staging area (collectives and point-to-point each have one).
pub const CHUNK: usize = 512 << 10;
/// Most ranks of one communicator (the segment's size grows with it; only touched pages cost).
pub const MAX_RANKS: usize = 1024;
/// The segment's magic ("tndmNCCL").
const SEGMENT_MAGIC: u64 = 0x4c43_434e_6d64_6e74;
/// The layout's version: a segment of another build of the emulator is refused.
const LAYOUT_VERSION: u32 = 1;
/// Bytes of the header.
const HEADER_BYTES: usize = 4096;

/// The segment's header.
#[repr(C)]
pub struct Header {
    magic: AtomicU64,
    layout: AtomicU32,
    nranks: AtomicU32,
    chunk: AtomicU64,
    joined: AtomicU32,
}

/// What a rank posted for a round: the operation and where this round's data lies in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Desc {
    /// [`crate::Kind`] as a number.
    pub kind: u64,
    /// `ncclDataType_t`.
    pub dtype: u64,
    /// `ncclRedOp_t` for the reductions; 0 otherwise.
    pub op: u64,
    /// The root rank (broadcast and reduce; 0 for the others).
    pub root: u64,
    /// The operation's element count.
    pub count: u64,
    /// The collective's number on the communicator (1, 2, …).
    pub seq: u64,
    /// The round's index inside the collective.
    pub part: u64,
    /// Bytes of the staging area this round fills.
    pub len: u64,
}

/// One rank's collective slot header; its staging area follows 256 bytes after it.
#[repr(C)]
pub struct Slot {
    claimed: AtomicU32,
    pid: AtomicU32,
    /// The last round this rank posted (its chunk and descriptor are in place).
    pub posted: AtomicU64,
    /// The last round this rank finished reading (every rank's staging area may be reused).
    pub consumed: AtomicU64,
    desc: [AtomicU64; 8],
}

/// One rank's point-to-point mailbox; its staging area follows 256 bytes after it.
#[repr(C)]
pub struct P2p {
    /// Messages posted (a counter); the mailbox holds one when `posted > taken`.
    pub posted: AtomicU64,
    /// Messages taken by their receiver.
    pub taken: AtomicU64,
    /// The receiver of the message in the mailbox.
    pub dst: AtomicU64,
    /// The message's index among this sender's messages to that receiver (1, 2, …).
    pub index: AtomicU64,
    /// Bytes in the staging area.
    pub len: AtomicU64,
}

/// Bytes before a staging area.
const SLOT_HEADER: usize = 256;
/// Bytes of one rank's part: slot, staging, mailbox, staging.
const RANK_BYTES: usize = 2 * (SLOT_HEADER + CHUNK);

/// The segment's size for `nranks`.
pub fn size_for(nranks: usize) -> usize {
    HEADER_BYTES + nranks * RANK_BYTES
}

/// A mapped segment.
pub struct Segment {
    base: *mut u8,
    len: usize,
    nranks: usize,
    path: CString,
}

// SAFETY: the mapping is shared memory accessed through atomics and raw copies guarded by the
// round protocol; the pointer stays valid until drop.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: base/len are the mapping made in `open`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Segment {
    /// The file of the segment named `name` (hex of the id's random bytes).
    pub fn path_for(name: &str) -> String {
        format!("/dev/shm/tandem-nccl-emu-{name}")
    }

    /// Opens (creating if needed) and maps the segment at `path` for `nranks`, checking the
    /// header another rank may have written. Does not join.
    pub fn open(path: &str, nranks: usize) -> Result<Segment, String> {
        if nranks == 0 || nranks > MAX_RANKS {
            return Err(format!(
                "{nranks} ranks: the emulated NCCL supports 1 to {MAX_RANKS}"
            ));
        }
        let cpath = CString::new(path).map_err(|_| format!("{path:?} holds a NUL"))?;
        let want = size_for(nranks);
        // SAFETY: a NUL-terminated path; the descriptor is closed below.
        let fd = unsafe {
            libc::open(
                cpath.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(os_error(&format!("opening {path}")));
        }
        let mapped = (|| {
            // Under an exclusive lock, grow the file to this rank's size but never shrink it
            // (a rank with fewer ranks must not cut a mapping another rank uses).
            // SAFETY: a valid descriptor.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                return Err(os_error(&format!("locking {path}")));
            }
            // SAFETY: `st` is a valid out-parameter.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: a valid descriptor and out-parameter.
            let grown = if unsafe { libc::fstat(fd, &mut st) } != 0 {
                Err(os_error(&format!("stat {path}")))
            } else if (st.st_size as u64) < want as u64 {
                // Reserve the memory now (tmpfs): a full /dev/shm is then an error here, not a
                // SIGBUS at the first touch of a page during a collective.
                // SAFETY: a valid descriptor.
                match unsafe { libc::posix_fallocate(fd, 0, want as libc::off_t) } {
                    0 => Ok(()),
                    // SAFETY: a valid descriptor.
                    libc::EOPNOTSUPP | libc::EINVAL
                        if unsafe { libc::ftruncate(fd, want as libc::off_t) } == 0 =>
                    {
                        Ok(())
                    }
                    code => Err(format!(
                        "reserving {want} bytes for {path}: {} (is /dev/shm full?)",
                        std::io::Error::from_raw_os_error(code)
                    )),
                }
            } else {
                Ok(())
            };
            // SAFETY: a valid descriptor.
            unsafe { libc::flock(fd, libc::LOCK_UN) };
            grown?;
            // SAFETY: a fresh shared mapping of `want` bytes of a file at least that long.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    want,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(os_error(&format!("mapping {path}")));
            }
            Ok(base.cast::<u8>())
        })();
        // SAFETY: the descriptor is ours; the mapping survives its closing.
        unsafe { libc::close(fd) };
        let base = mapped?;
        let segment = Segment {
            base,
            len: want,
            nranks,
            path: cpath,
        };
        segment.check_header()?;
        Ok(segment)
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header (zeroed or written by a rank); its fields are
        // atomics, valid for any bit pattern.
        unsafe { &*self.base.cast::<Header>() }
    }

    /// Claims the header for this layout or checks another rank's claim.
    fn check_header(&self) -> Result<(), String> {
        let h = self.header();
        let path = self.path.to_string_lossy();
        match h
            .magic
            .compare_exchange(0, SEGMENT_MAGIC, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                h.layout.store(LAYOUT_VERSION, Ordering::Release);
                h.chunk.store(CHUNK as u64, Ordering::Release);
            }
            Err(SEGMENT_MAGIC) => {}
            Err(other) => {
                return Err(format!(
                    "{path} is not a segment of the emulated NCCL (magic {other:#x})"
                ))
            }
        }
        // The claimer writes layout and chunk right after the magic: wait for them briefly.
        for _ in 0..1000 {
            if h.layout.load(Ordering::Acquire) != 0 && h.chunk.load(Ordering::Acquire) != 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let layout = h.layout.load(Ordering::Acquire);
        let chunk = h.chunk.load(Ordering::Acquire);
        if layout != LAYOUT_VERSION || chunk != CHUNK as u64 {
            return Err(format!(
                "{path} has layout {layout} and chunks of {chunk} bytes; this emulated NCCL \
                 uses layout {LAYOUT_VERSION} and {CHUNK} (another build of the emulator?)"
            ));
        }
        let n = self.nranks as u32;
        match h
            .nranks
            .compare_exchange(0, n, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(theirs) if theirs == n => Ok(()),
            Err(theirs) => Err(format!(
                "this rank joins a communicator of {n} ranks, but the ranks already there \
                 joined one of {theirs} (every rank must pass the same nranks)"
            )),
        }
    }

    /// Claims `rank`'s slot and counts it as joined; unlinks the file when it is the last.
    pub fn join(&self, rank: usize) -> Result<(), String> {
        let slot = self.slot(rank);
        if slot
            .claimed
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(format!(
                "rank {rank} joined this communicator twice (another rank passed the same rank)"
            ));
        }
        slot.pid.store(std::process::id(), Ordering::Release);
        let joined = self.header().joined.fetch_add(1, Ordering::AcqRel) + 1;
        if joined as usize >= self.nranks {
            self.unlink();
        }
        Ok(())
    }

    /// Whether every rank has joined; an error when the count is impossible (a forged header).
    pub fn all_joined(&self) -> Result<bool, String> {
        let joined = self.header().joined.load(Ordering::Acquire) as usize;
        if joined > self.nranks {
            return Err(format!(
                "{joined} ranks joined a communicator of {} (the segment was written by \
                 something else)",
                self.nranks
            ));
        }
        Ok(joined == self.nranks)
    }

    /// How many ranks have joined (as the header says).
    pub fn joined(&self) -> u32 {
        self.header().joined.load(Ordering::Acquire)
    }

    /// Removes the file (every rank has it mapped, or the rendezvous was given up).
    pub fn unlink(&self) {
        // SAFETY: a NUL-terminated path; a missing file is fine.
        unsafe { libc::unlink(self.path.as_ptr()) };
    }

    /// Rank `rank`'s slot (`rank < nranks`, checked by the caller).
    pub fn slot(&self, rank: usize) -> &Slot {
        assert!(rank < self.nranks);
        // SAFETY: inside the mapping (size_for), suitably aligned (page + multiples of 256);
        // atomics are valid for any bits.
        unsafe {
            &*self
                .base
                .add(HEADER_BYTES + rank * RANK_BYTES)
                .cast::<Slot>()
        }
    }

    /// Rank `rank`'s collective staging area.
    pub fn staging(&self, rank: usize) -> *mut u8 {
        assert!(rank < self.nranks);
        // SAFETY: inside the mapping; CHUNK bytes follow.
        unsafe {
            self.base
                .add(HEADER_BYTES + rank * RANK_BYTES + SLOT_HEADER)
        }
    }

    /// Rank `rank`'s mailbox.
    pub fn mailbox(&self, rank: usize) -> &P2p {
        assert!(rank < self.nranks);
        // SAFETY: inside the mapping, aligned; atomics are valid for any bits.
        unsafe {
            &*self
                .base
                .add(HEADER_BYTES + rank * RANK_BYTES + SLOT_HEADER + CHUNK)
                .cast::<P2p>()
        }
    }

    /// Rank `rank`'s mailbox staging area.
    pub fn mailbox_staging(&self, rank: usize) -> *mut u8 {
        assert!(rank < self.nranks);
        // SAFETY: inside the mapping; CHUNK bytes follow.
        unsafe {
            self.base
                .add(HEADER_BYTES + rank * RANK_BYTES + 2 * SLOT_HEADER + CHUNK)
        }
    }
}

impl Slot {
    /// Writes the descriptor (before `posted` is released).
    pub fn set_desc(&self, d: &Desc) {
        let v = [d.kind, d.dtype, d.op, d.root, d.count, d.seq, d.part, d.len];
        for (a, x) in self.desc.iter().zip(v) {
            a.store(x, Ordering::Relaxed);
        }
    }

    /// Reads the descriptor (after `posted` was acquired).
    pub fn desc(&self) -> Desc {
        let v: Vec<u64> = self
            .desc
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        Desc {
            kind: v[0],
            dtype: v[1],
            op: v[2],
            root: v[3],
            count: v[4],
            seq: v[5],
            part: v[6],
            len: v[7],
        }
    }
}
