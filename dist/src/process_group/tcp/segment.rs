//! Shared-memory segments for the same-host path: how a rank creates one (an anonymous memory
//! file sealed against shrinking, growing and any new way of writing to it), hands it to a peer
//! (the file itself, over a Unix-domain socket with `SCM_RIGHTS`), and how the peer checks and
//! maps it read-only.
//!
//! Layout: a header page of progress counters ([`Counter`]), each 64 bytes apart and written by
//! the owner only, then the data area.
//!
//! **Only the owner can write.** The owner maps its file read-write first and then adds
//! `F_SEAL_FUTURE_WRITE` (Linux 5.1 or later): the kernel keeps that one mapping writable but
//! refuses every later way to write through the file, to anyone holding it — a writable shared
//! mapping (`EPERM`), `mprotect` of a read-only one to writable (`EACCES`), `write(2)`, punching
//! holes — and reopening it through `/proc/<pid>/fd` does not help, since seals belong to the
//! file, not to a descriptor. So a peer cannot change a rank's published data while a third rank
//! copies it. (A read-only reopen of the descriptor would add nothing: a peer could reopen it
//! read-write through `/proc`.)
//!
//! **The receiving side trusts nothing it is sent**: the file must carry the shrink seal (so no
//! page it maps can vanish and fault) and a write seal (so no rank but its owner can change it),
//! must be at least the size both sides agreed on, must be neither this rank's own segment nor
//! one another peer already sent, and is mapped read-only at that size; descriptors that arrive
//! unasked are closed. No address or length a peer sends is ever used to reach memory.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use super::link::poll;

/// Bytes of the header page of a segment, which holds the owner's progress counters.
pub(super) const HEADER: usize = 4096;

/// The progress counters in a segment's header, each written by the segment's owner only.
/// A counter holds [`mark`]`(collective, step)`, so values only grow across collectives.
#[derive(Clone, Copy)]
pub(super) enum Counter {
    /// The owner has staged its data for this many steps.
    Staged = 0,
    /// The owner has published its reduced share for this many steps.
    Reduced = 1,
    /// The owner has finished reading the peers' slots for this many steps.
    Consumed = 2,
}

/// The counter value for `step` (counted from 1) of collective `seq`.
pub(super) fn mark(seq: u64, step: usize) -> u64 {
    ((seq & 0xffff_ffff) << 32) | (step as u64 & 0xffff_ffff)
}

/// Bytes of the message that accompanies a segment: its size and the collective's number.
pub(super) const GROW_MESSAGE: usize = 16;

/// Which file a descriptor refers to (`st_dev`, `st_ino`): tells segments apart whatever
/// descriptor they came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FileId {
    dev: u64,
    ino: u64,
}

/// The identity of the file behind `fd`, and its size.
fn identify(fd: RawFd) -> io::Result<(FileId, u64)> {
    // SAFETY: `stat` is a plain C struct, valid when zeroed; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is live and exclusively borrowed for the call.
    check(unsafe { libc::fstat(fd, &mut st) })?;
    let id = FileId {
        dev: st.st_dev,
        ino: st.st_ino,
    };
    Ok((id, st.st_size.max(0) as u64))
}

/// A shared mapping of a memory file; unmapped on drop.
pub(super) struct Mapping {
    ptr: *mut u8,
    len: usize,
    writable: bool,
    /// The file mapped.
    id: FileId,
}

// SAFETY: the mapping is plain memory owned by this value; moving it to another thread moves
// that ownership with it.
unsafe impl Send for Mapping {}

impl Mapping {
    fn map(fd: RawFd, len: usize, writable: bool, id: FileId) -> io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mmap with a null hint creates a new mapping and touches no existing memory;
        // `fd` is an open memory file of at least `len` bytes that cannot shrink (checked or
        // sealed by our callers), so every mapped page is backed.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            writable,
            id,
        })
    }

    /// The file this maps.
    pub(super) fn file(&self) -> FileId {
        self.id
    }

    /// The data area (after the header page).
    pub(super) fn data(&self) -> &[u8] {
        // SAFETY: `ptr+HEADER..ptr+len` lies inside a live mapping owned by `self` (unmapped only
        // in drop; `len > HEADER` by construction). Its owner may write it while we read (a
        // misbehaving peer ignoring the progress counters): the values read may then be
        // inconsistent, but they are only ever used as numbers, never as addresses or lengths.
        unsafe { std::slice::from_raw_parts(self.ptr.add(HEADER), self.len - HEADER) }
    }

    /// The data area, writable (own segments only).
    pub(super) fn data_mut(&mut self) -> &mut [u8] {
        debug_assert!(self.writable);
        // SAFETY: as in `data`; the mapping is writable, and `&mut self` makes this the only
        // reference into the data area in this process (peers can only map it read-only: the
        // file is sealed against new writable mappings).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(HEADER), self.len - HEADER) }
    }

    /// Progress counter `which` in the header page.
    pub(super) fn counter(&self, which: Counter) -> &AtomicU64 {
        // SAFETY: the header page is the first `HEADER` bytes of the live, page-aligned mapping;
        // counter slots are 64 bytes apart inside it, so the pointer is in bounds and aligned
        // for `AtomicU64`. No `&[u8]` ever covers the header (`data` starts after it), and
        // 64-bit atomic loads are plain loads on the targets we build for, so they are fine on
        // a peer's read-only mapping too.
        unsafe { &*self.ptr.add(which as usize * 64).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping created in `map` and not yet unmapped; no
        // reference into it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The seals of a segment: it can never shrink (no mapped page can vanish), grow, or be
/// written through any mapping or descriptor made after the owner's own mapping.
const SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;

/// A new segment of `len` bytes: a sealed memory file and the owner's read-write mapping of it,
/// the only writable one there will ever be.
pub(super) fn create_segment(len: usize) -> io::Result<(OwnedFd, Mapping)> {
    // SAFETY: the name is a valid NUL-terminated string; memfd_create returns a new descriptor.
    let raw = check(unsafe {
        libc::memfd_create(
            c"tandem-shared-segment".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    })?;
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let size = libc::off_t::try_from(len).map_err(io::Error::other)?;
    // SAFETY: ftruncate takes plain integers; `fd` is open.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), size) })?;
    let (id, _) = identify(fd.as_raw_fd())?;
    // Map before sealing: F_SEAL_FUTURE_WRITE keeps existing writable mappings, refuses new ones.
    let mapping = Mapping::map(fd.as_raw_fd(), len, true, id)?;
    // SAFETY: fcntl takes plain integers; `fd` is open.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) })?;
    Ok((fd, mapping))
}

/// Whether this kernel can seal segments as [`create_segment`] does (F_SEAL_FUTURE_WRITE needs
/// Linux 5.1). Without it the same-host path is not used.
pub(super) fn sealing_supported() -> bool {
    create_segment(HEADER + 4096).is_ok()
}

/// Maps a peer's segment read-only, after checking that it is a memory file sealed against
/// shrinking (so reading any of its pages can never fault) and against writing by anyone but
/// its owner, that it holds at least `len` bytes, and that it is none of the files in `taken`
/// (this rank's own segment and those other peers sent).
pub(super) fn adopt_segment(
    fd: &OwnedFd,
    len: usize,
    taken: &[FileId],
) -> std::result::Result<Mapping, String> {
    // SAFETY: fcntl takes plain integers; `fd` is open.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err("it sent a file that is not a memory file sealed against shrinking".into());
    }
    if seals & (libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_WRITE) == 0 {
        return Err(
            "it sent a segment that is not sealed against writing (F_SEAL_FUTURE_WRITE), so \
             any rank holding it could change it"
                .into(),
        );
    }
    let (id, size) =
        identify(fd.as_raw_fd()).map_err(|e| format!("fstat of its segment failed: {e}"))?;
    if taken.contains(&id) {
        return Err(
            "it sent a segment that is not its own (this rank's own segment or one another \
             rank sent)"
                .into(),
        );
    }
    if size < len as u64 {
        return Err(format!("its segment has {size} bytes, {len} were agreed"));
    }
    Mapping::map(fd.as_raw_fd(), len, false, id).map_err(|e| format!("mapping its segment: {e}"))
}

/// Sends `fd` with `message` over a Unix-domain socket.
pub(super) fn send_fd(
    sock: &UnixStream,
    fd: RawFd,
    message: &[u8; GROW_MESSAGE],
) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // u64 words keep the control buffer aligned for `cmsghdr`.
    let mut control = [0u64; 8];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    // SAFETY: `msghdr` is a plain C struct, valid when zeroed.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` points at `control`, which is at least `space` bytes and aligned, so
    // CMSG_FIRSTHDR returns a pointer into it with room for one header and one descriptor.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    loop {
        // SAFETY: `msg` describes `iov` (over `message`) and `control`, all live for the call;
        // sendmsg only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            // A few bytes into an empty socket buffer: all or nothing in practice; finish the
            // rest without the descriptor if not.
            let sent = n as usize;
            if sent < message.len() {
                let mut s = sock;
                io::Write::write_all(&mut s, &message[sent..])?;
            }
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Receives a descriptor and its message from a Unix-domain socket by `deadline`. Every
/// descriptor that arrives is owned (and so closed unless kept); `None` if none came.
pub(super) fn recv_fd(
    sock: &UnixStream,
    deadline: Instant,
) -> io::Result<(Option<OwnedFd>, [u8; GROW_MESSAGE])> {
    let mut message = [0u8; GROW_MESSAGE];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no segment arrived",
            ));
        }
        let mut fds = [libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        if poll(&mut fds, left)? > 0 {
            break;
        }
    }
    let mut iov = libc::iovec {
        iov_base: message.as_mut_ptr().cast(),
        iov_len: message.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: `msghdr` is a plain C struct, valid when zeroed.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    let n = loop {
        // SAFETY: `msg` describes `iov` (over `message`) and `control`, both live and
        // exclusively borrowed; the kernel writes at most their lengths.
        let n = unsafe {
            libc::recvmsg(
                sock.as_raw_fd(),
                &mut msg,
                libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    // Take ownership of every descriptor received, so none leaks.
    let mut received = Vec::new();
    // SAFETY: the kernel filled `control` with `msg_controllen` bytes of well-formed control
    // messages; the CMSG macros walk them without leaving that buffer.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for k in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(k));
                    received.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the channel was closed",
        ));
    }
    if n < GROW_MESSAGE {
        sock.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))?;
        let mut s = sock;
        s.read_exact(&mut message[n..])?;
    }
    let first = if received.is_empty() {
        None
    } else {
        Some(received.swap_remove(0))
    };
    Ok((first, message))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn the_owner_writes_after_sealing_and_a_peer_sees_it_but_cannot_write() {
        let len = HEADER + 4096;
        let (fd, mut own) = create_segment(len).unwrap();
        // SAFETY: fcntl takes plain integers; `fd` is open.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals, SEALS);
        let peer = adopt_segment(&fd, len, &[]).unwrap();
        own.data_mut()[..4].copy_from_slice(&[1, 2, 3, 4]);
        own.counter(Counter::Staged).store(7, Ordering::Release);
        assert_eq!(&peer.data()[..4], &[1, 2, 3, 4]);
        assert_eq!(peer.counter(Counter::Staged).load(Ordering::Acquire), 7);
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a new mapping with a null hint touches no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                rw,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_eq!(ptr, libc::MAP_FAILED, "a second writable mapping was made");
        assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        // SAFETY: the byte is live for the call; write only reads it.
        let rc = unsafe { libc::write(fd.as_raw_fd(), [9u8].as_ptr().cast(), 1) };
        assert!(rc < 0, "write(2) into a sealed segment succeeded");
        // A rank's own segment handed back to it is refused.
        let err = adopt_segment(&fd, len, &[own.file()]).err().unwrap();
        assert!(err.contains("not its own"), "{err}");
    }
}
