//! A connection to one peer of a TCP group, and the socket primitives the transport is built
//! on: non-blocking vectored sends that never raise SIGPIPE, `poll(2)`, and the last words a
//! rank sends before it closes a connection — an *abort* frame when it failed, a *goodbye*
//! frame when it leaves cleanly — together with the reading side that recovers them from a
//! connection the peer has closed.

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use super::frame::{self, Farewell, FrameHeader, MAX_ABORT_MESSAGE};
use crate::DistError;

/// How long a failing rank tries to deliver its abort frame to one peer.
const FAREWELL_SEND_TIME: Duration = Duration::from_secs(1);
/// How much a rank reads from a closed connection looking for the peer's last words.
const DRAIN_CAP: usize = 8 << 20;

/// The connection to one peer.
pub(crate) struct Link {
    pub peer: usize,
    pub stream: TcpStream,
    /// This side has been shut down (after an abort or goodbye); nothing more may be sent.
    pub shut: bool,
    /// The peer has gone; why.
    pub gone: Option<Gone>,
}

/// How a peer went away.
#[derive(Clone, Debug)]
pub(crate) enum Gone {
    /// It left cleanly (dropped its group) after completing this many collectives.
    Left { completed: u64 },
    /// Its connection closed or was reset without a goodbye: its process died.
    Died { how: String },
    /// It failed and told us why (an abort frame) before closing.
    Failed { message: String },
}

impl Link {
    /// A link over a connected stream (made non-blocking here, with Nagle's algorithm off
    /// and, when `buffer_bytes > 0`, socket buffers of that size instead of autotuned ones).
    pub(crate) fn new(peer: usize, stream: TcpStream, buffer_bytes: usize) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        if buffer_bytes > 0 {
            let size = buffer_bytes.min(i32::MAX as usize) as libc::c_int;
            for option in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
                set_socket_option(stream.as_raw_fd(), option, size)?;
            }
        }
        Ok(Link {
            peer,
            stream,
            shut: false,
            gone: None,
        })
    }

    /// The socket's file descriptor.
    pub(crate) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
}

fn set_socket_option(fd: RawFd, option: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: `value` is a live c_int and the length passed is its size; setsockopt only reads
    // it during the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Tells every peer that this rank failed with `err` at collective `seq`, then shuts the
/// connections down. Half-sent frames (`partial`: peer, bytes missing) are completed with zero
/// padding first so that the abort frame lands on a frame boundary.
pub(crate) fn abort_links(
    links: &mut [Option<Link>],
    seq: u64,
    err: &DistError,
    partial: &[(usize, usize)],
) {
    let mut message = err.to_string();
    if message.len() as u64 > MAX_ABORT_MESSAGE {
        let mut cut = MAX_ABORT_MESSAGE as usize;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    let culprit = err.blamed_ranks().first().copied();
    let header = FrameHeader::abort(seq, culprit, message.len()).encode();
    let zeros = [0u8; 64 << 10];
    for link in links.iter_mut().flatten() {
        if link.shut || link.gone.is_some() {
            continue;
        }
        let deadline = Instant::now() + FAREWELL_SEND_TIME;
        let mut missing = partial
            .iter()
            .find(|(p, _)| *p == link.peer)
            .map_or(0, |&(_, m)| m);
        let mut ok = true;
        while missing > 0 && ok {
            let n = missing.min(zeros.len());
            ok = send_all(link.fd(), &zeros[..n], deadline).is_ok();
            missing -= n;
        }
        if ok {
            let _ = send_all(link.fd(), &header, deadline)
                .and_then(|()| send_all(link.fd(), message.as_bytes(), deadline));
        }
        let _ = link.stream.shutdown(Shutdown::Write);
        link.shut = true;
    }
}

/// Tells every peer that this rank leaves the group after `completed` collectives, then shuts
/// the connections down.
pub(crate) fn say_goodbye(links: &mut [Option<Link>], completed: u64) {
    let header = FrameHeader::goodbye(completed).encode();
    for link in links.iter_mut().flatten() {
        if link.shut || link.gone.is_some() {
            continue;
        }
        let _ = send_all(link.fd(), &header, Instant::now() + FAREWELL_SEND_TIME);
        let _ = link.stream.shutdown(Shutdown::Write);
        link.shut = true;
    }
}

/// Reads what a hung-up peer left in the connection and returns its abort or goodbye.
pub(crate) fn drain_farewell(link: &mut Link) -> Option<Farewell> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 16 << 10];
    while bytes.len() < DRAIN_CAP {
        match link.stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    frame::find_farewell(&bytes)
}

/// Reads an abort message of `len` bytes (already capped by the decoder), waiting a little for
/// bytes still in flight.
pub(crate) fn read_message(link: &mut Link, len: usize) -> String {
    let mut msg = vec![0u8; len];
    let mut got = 0;
    let deadline = Instant::now() + FAREWELL_SEND_TIME;
    while got < len {
        match link.stream.read(&mut msg[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                let mut fd = [libc::pollfd {
                    fd: link.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                let _ = poll(&mut fd, deadline - now);
            }
            Err(_) => break,
        }
    }
    msg.truncate(got);
    let mut text = String::from_utf8_lossy(&msg).into_owned();
    if got < len {
        text.push_str(" […truncated]");
    }
    text
}

/// Sends all of `bytes` on a non-blocking socket, waiting for room until `deadline`.
pub(crate) fn send_all(fd: RawFd, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        match send_parts(fd, bytes, &[]) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "peer is not reading",
                    ));
                }
                let mut fds = [libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                }];
                poll(&mut fds, deadline - now)?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One `sendmsg` of `a` then `b`, without blocking and without raising SIGPIPE on a closed
/// connection. Returns the number of bytes the kernel took.
pub(crate) fn send_parts(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    // SAFETY: `msghdr` is a plain C struct; all-zero bytes (null pointers, zero lengths) are a
    // valid value of it.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = if b.is_empty() { 1 } else { 2 };
    // SAFETY: `msg` points at `iov`, whose entries point at the live slices `a` and `b`; all of
    // them outlive the call, and sendmsg only reads through these pointers.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// `poll(2)` over `fds` for at most `timeout` (rounded up to whole milliseconds).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed array of `pollfd` of the given length for
    // the duration of the call; poll writes only the `revents` fields.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
