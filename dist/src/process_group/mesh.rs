//! Connecting the ranks of a TCP group to each other: a full mesh, one connection per pair.
//!
//! Each rank listens on the interface it uses to reach the rendezvous store (so that ranks on
//! other hosts can reach it too) and publishes `ip:port` under `tandem/<group>/addr/<rank>`.
//! Then it connects to every lower rank and accepts a connection from every higher one —
//! connecting never waits for the other side to accept, so this order cannot deadlock. Each
//! new connection starts with hello frames both ways that name the sender's rank, the world
//! size and the group, so a stray connection (a port scanner, another job) is dropped, not
//! mistaken for a rank.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::frame::{FrameHeader, FrameKind, HEADER_LEN};
use super::link::{self, Link};
use super::GroupConfig;
use crate::store::TcpStore;
use crate::{DistError, Result};

fn connect_error(rank: usize, detail: impl Into<String>) -> DistError {
    DistError::Connect {
        rank,
        detail: detail.into(),
    }
}

/// Connects `rank` to every other rank: to lower ranks by connecting, from higher ranks by
/// accepting. Returns the links indexed by peer rank.
pub(crate) fn connect_mesh(
    store: &TcpStore,
    rank: usize,
    world: usize,
    config: &GroupConfig,
) -> Result<Vec<Option<Link>>> {
    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    if world == 1 {
        return Ok(links);
    }
    let deadline = Instant::now() + config.connect_timeout;
    let prefix = format!("tandem/{}/addr", config.name);
    let listener = TcpListener::bind(SocketAddr::new(store.local_ip(), 0))
        .map_err(|e| connect_error(rank, format!("cannot listen on {}: {e}", store.local_ip())))?;
    let addr = listener
        .local_addr()
        .map_err(|e| connect_error(rank, e.to_string()))?;
    store.set(&format!("{prefix}/{rank}"), addr.to_string().as_bytes())?;

    for (peer, slot) in links.iter_mut().enumerate().take(rank) {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let value = store.get_timeout(&format!("{prefix}/{peer}"), remaining)?;
        let text = String::from_utf8_lossy(&value).into_owned();
        let peer_addr: SocketAddr = text.parse().map_err(|_| {
            connect_error(
                rank,
                format!("rank {peer} published an unusable address {text:?}"),
            )
        })?;
        let stream = connect_retry(peer_addr, deadline).map_err(|e| {
            connect_error(
                rank,
                format!("cannot connect to rank {peer} at {peer_addr}: {e}"),
            )
        })?;
        hello(&stream, rank, world, &config.name, deadline).map_err(|e| {
            connect_error(
                rank,
                format!("handshake with rank {peer} at {peer_addr}: {e}"),
            )
        })?;
        let (who, _) = read_hello(&stream, world, &config.name, deadline).map_err(|e| {
            connect_error(
                rank,
                format!("handshake with rank {peer} at {peer_addr}: {e}"),
            )
        })?;
        if who != peer {
            return Err(connect_error(
                rank,
                format!("{peer_addr} answered as rank {who}, expected rank {peer}"),
            ));
        }
        *slot = Some(
            Link::new(peer, stream, config.socket_buffer_bytes)
                .map_err(|e| connect_error(rank, e.to_string()))?,
        );
    }

    listener
        .set_nonblocking(true)
        .map_err(|e| connect_error(rank, e.to_string()))?;
    while links
        .iter()
        .enumerate()
        .any(|(q, l)| q > rank && l.is_none())
    {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (rank + 1..world).filter(|&q| links[q].is_none()).collect();
            return Err(connect_error(
                rank,
                format!(
                    "timed out after {:?} waiting for ranks {missing:?} to connect",
                    config.connect_timeout
                ),
            ));
        }
        let mut fds = [libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let _ = link::poll(&mut fds, (deadline - now).min(Duration::from_secs(1)));
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(connect_error(rank, format!("accept failed: {e}"))),
        };
        // A stranger (a port scanner, another job) is dropped without ending the wait.
        let Ok(stream) = stream.set_nonblocking(false).map(|()| stream) else {
            continue;
        };
        let hello_deadline = (Instant::now() + Duration::from_secs(10)).min(deadline);
        let Ok((who, _)) = read_hello(&stream, world, &config.name, hello_deadline) else {
            continue;
        };
        if who <= rank || links[who].is_some() {
            continue;
        }
        if hello(&stream, rank, world, &config.name, deadline).is_err() {
            continue;
        }
        links[who] = Some(
            Link::new(who, stream, config.socket_buffer_bytes)
                .map_err(|e| connect_error(rank, e.to_string()))?,
        );
    }
    Ok(links)
}

fn connect_retry(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            remaining.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        ) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

pub(crate) fn hello(
    mut stream: &TcpStream,
    rank: usize,
    world: usize,
    name: &str,
    deadline: Instant,
) -> io::Result<()> {
    stream.set_write_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))?;
    let mut msg = FrameHeader::hello(rank, world, name.len())
        .encode()
        .to_vec();
    msg.extend_from_slice(name.as_bytes());
    stream.write_all(&msg)
}

/// Reads a hello frame; returns the sender's rank and its group name.
pub(crate) fn read_hello(
    mut stream: &TcpStream,
    world: usize,
    name: &str,
    deadline: Instant,
) -> io::Result<(usize, String)> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    stream.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))?;
    let mut head = [0u8; HEADER_LEN];
    stream.read_exact(&mut head)?;
    let h = FrameHeader::decode(&head).map_err(bad)?;
    if h.kind != FrameKind::Hello {
        return Err(bad(format!("expected a hello frame, got {:?}", h.kind)));
    }
    let mut theirs = vec![0u8; h.payload_len as usize];
    stream.read_exact(&mut theirs)?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    if h.index != world as u64 || theirs != name {
        return Err(bad(format!(
            "peer belongs to group {theirs:?} of {} ranks, this rank to group {name:?} of {world}",
            h.index
        )));
    }
    if h.aux as usize >= world {
        return Err(bad(format!(
            "peer claims rank {} in a group of {world}",
            h.aux
        )));
    }
    Ok((h.aux as usize, theirs))
}
