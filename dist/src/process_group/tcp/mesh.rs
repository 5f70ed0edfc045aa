//! Connecting the ranks of a TCP group to each other: a full mesh, one connection per pair.
//!
//! Each rank listens on the interface it uses to reach the rendezvous store (so that ranks on
//! other hosts can reach it too, and a loopback store keeps the mesh on loopback) and publishes
//! `ip:port` under `tandem/<group>/addr/<rank>`. Then it connects to every lower rank and
//! accepts a connection from every higher one — connecting never waits for the other side to
//! accept, so this order cannot deadlock. Every new connection runs the `handshake` (mutual
//! proof of the job secret, then rank, world size and group); the accepting side runs the
//! handshakes of all incoming connections in parallel, each bounded by a short
//! [`HELLO_TIMEOUT`], so idle or hostile connections (a port scanner, another job) are closed
//! and logged without delaying the real ranks. At most [`MAX_PENDING_HANDSHAKES`] handshakes
//! run at once; a new connection beyond that drops the oldest one still in its handshake (as the
//! store does), so a flood of idle connections cannot fill the slots and keep a real rank out,
//! and a connecting rank whose handshake the other side closed connects again, pausing 10 ms,
//! then twice as long each time up to 1 s, until the setup deadline. A rank that waits for
//! others says so on stderr every [`GroupConfig::wait_log_interval`], naming them.

use std::collections::BTreeMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::handshake::{
    accept_side, try_connect_side, Channel, ConnectFailure, Failure, HandshakeStream, Me,
};
use super::link::{self, Link};
use crate::error::fmt_ranks;
use crate::process_group::GroupConfig;
use crate::store::TcpStore;
use crate::{DistError, Result};

/// How long an accepted connection may take to send its hello and proof.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Most handshakes of incoming connections in progress at once; a new connection beyond them
/// drops the oldest.
pub(crate) const MAX_PENDING_HANDSHAKES: usize = 128;
/// First pause before a rank connects again after its handshake was closed; it doubles up to
/// [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(10);
/// Longest pause between two attempts to connect to a rank.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Rejected connections logged one by one; after these, only every power of two.
const LOGGED_REJECTIONS: u64 = 16;

/// An OS error `rank` met while setting up its links, kept whole (its `io::ErrorKind` tells a
/// refused connection from a timeout).
fn setup_io(rank: usize, doing: impl std::fmt::Display, err: std::io::Error) -> DistError {
    DistError::rank_io(rank, format!("setting up the process group: {doing}"), err)
}

fn connect_error(rank: usize, detail: impl Into<String>) -> DistError {
    DistError::Connect {
        rank,
        detail: detail.into(),
    }
}

/// Setup timed out waiting for `waiting_for` (named in the launcher's failure report).
fn setup_timeout(rank: usize, waiting_for: Vec<usize>, detail: String) -> DistError {
    DistError::SetupTimeout {
        rank,
        waiting_for,
        detail,
    }
}

/// Who this rank is on the links of `config`'s group, authenticated with the store's secret.
pub(crate) fn me(
    store: &TcpStore,
    rank: usize,
    world: usize,
    config: &GroupConfig,
    channel: Channel,
) -> Me {
    Me {
        rank,
        world,
        name: config.name.clone(),
        channel,
        secret: store.secret().cloned(),
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
    let started = Instant::now();
    let deadline = started + config.connect_timeout;
    let me = me(store, rank, world, config, Channel::Link);
    let prefix = format!("tandem/{}/addr", config.name);
    let listener = TcpListener::bind(SocketAddr::new(store.local_ip(), 0))
        .map_err(|e| setup_io(rank, format!("listening on {}", store.local_ip()), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| setup_io(rank, "reading the listener's address", e))?;
    store.set(&format!("{prefix}/{rank}"), addr.to_string().as_bytes())?;

    for (peer, slot) in links.iter_mut().enumerate().take(rank) {
        let value = wait_for_key(
            store,
            &format!("{prefix}/{peer}"),
            rank,
            peer,
            config,
            started,
        )?;
        let text = String::from_utf8_lossy(&value).into_owned();
        let peer_addr: SocketAddr = text.parse().map_err(|_| {
            connect_error(
                rank,
                format!("rank {peer} published an unusable address {text:?}"),
            )
        })?;
        let stream = connect_to_peer(&me, peer, peer_addr, deadline)?;
        *slot = Some(
            Link::new(peer, stream, config.socket_buffer_bytes)
                .map_err(|e| setup_io(rank, format!("configuring the link to rank {peer}"), e))?,
        );
    }

    let accepted = accept_peers(&listener, &me, config, started)?;
    for (peer, stream) in accepted {
        links[peer] = Some(
            Link::new(peer, stream, config.socket_buffer_bytes)
                .map_err(|e| setup_io(rank, format!("configuring the link to rank {peer}"), e))?,
        );
    }
    Ok(links)
}

/// Waits for `key` (published by rank `peer`), logging every `wait_log_interval`.
fn wait_for_key(
    store: &TcpStore,
    key: &str,
    rank: usize,
    peer: usize,
    config: &GroupConfig,
    started: Instant,
) -> Result<Vec<u8>> {
    let deadline = started + config.connect_timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let slice = left.min(config.wait_log_interval.max(Duration::from_millis(1)));
        match store.get_timeout(key, slice) {
            Ok(v) => return Ok(v),
            Err(DistError::StoreTimeout { .. }) if slice < left => log_waiting(
                rank,
                &format!("rank {peer} to join (it has not published its address)"),
                started,
                config,
            ),
            Err(DistError::StoreTimeout {
                addr, timeout: _, ..
            }) => {
                return Err(setup_timeout(
                    rank,
                    vec![peer],
                    format!(
                        "timed out after {:?} waiting for rank {peer} to join through the store \
                         at {addr}; is it started, with the same MASTER_ADDR, MASTER_PORT and \
                         WORLD_SIZE?",
                        config.connect_timeout
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

fn log_waiting(rank: usize, what: &str, started: Instant, config: &GroupConfig) {
    eprintln!(
        "tandem: rank {rank}: still waiting for {what} ({:.0?} so far, timeout {:?})",
        started.elapsed(),
        config.connect_timeout
    );
}

/// Connects to rank `peer` at `addr` and runs the handshake. When the handshake is closed from
/// the other side (rank `peer` drops its oldest handshakes when flooded with connections),
/// connects again after a pause that doubles from 10 ms up to 1 s, until `deadline`.
pub(crate) fn connect_to_peer(
    me: &Me,
    peer: usize,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<TcpStream> {
    let rank = me.rank;
    handshake_with_retry(me, peer, &addr.to_string(), deadline, || {
        connect_retry(addr, deadline)
            .map_err(|e| setup_io(rank, format!("connecting to rank {peer} at {addr}"), e))
    })
}

/// Connects with `connect` and runs the connecting side of the handshake with rank `peer`
/// (described as `peer_desc`), connecting again with a growing pause (10 ms, doubling up to
/// 1 s) whenever the other side closed or reset the connection before the handshake finished
/// — a listener under a flood of connections drops its oldest pending handshake to admit new
/// ones, and that may be ours. Gives up at `deadline` with a setup timeout naming the peer.
/// Used by the TCP mesh and the same-host Unix channels alike.
pub(crate) fn handshake_with_retry<S: HandshakeStream>(
    me: &Me,
    peer: usize,
    peer_desc: &str,
    deadline: Instant,
    mut connect: impl FnMut() -> Result<S>,
) -> Result<S> {
    let rank = me.rank;
    let mut pause = FIRST_RETRY_PAUSE;
    let mut closed = 0u64;
    loop {
        let mut stream = connect()?;
        match try_connect_side(&mut stream, me, peer, peer_desc, deadline) {
            Ok(()) => return Ok(stream),
            Err(ConnectFailure::Closed(message)) if Instant::now() + pause < deadline => {
                closed += 1;
                if closed <= LOGGED_REJECTIONS || closed.is_power_of_two() {
                    eprintln!(
                        "tandem: rank {rank}: {message} (a flood of connections at rank \
                         {peer}?); connecting again in {pause:?} (attempt {})",
                        closed + 1
                    );
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_RETRY_PAUSE);
            }
            Err(ConnectFailure::Closed(message)) => {
                return Err(setup_timeout(
                    rank,
                    vec![peer],
                    format!(
                        "{message}, {} times until the setup deadline ({closed} retries); is \
                         something flooding rank {peer}'s listener with connections?",
                        closed + 1
                    ),
                ))
            }
            Err(ConnectFailure::Fatal(message)) => return Err(connect_error(rank, message)),
        }
    }
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

/// A listening socket whose connections run the handshake.
pub(crate) trait PeerListener: AsRawFd {
    /// The connected socket.
    type Stream: HandshakeStream + Send + 'static;
    /// Accepts one connection (non-blocking) and describes where it came from.
    fn accept_peer(&self) -> io::Result<(Self::Stream, String)>;
    /// Makes the listener non-blocking.
    fn set_listener_nonblocking(&self) -> io::Result<()>;
    /// Makes an accepted socket blocking again (for the handshake's timed reads).
    fn make_blocking(s: &Self::Stream) -> io::Result<()>;
    /// A second handle on an accepted socket, through which its handshake can be cut off.
    fn second_handle(s: &Self::Stream) -> io::Result<Self::Stream>;
    /// Shuts the socket down both ways, which ends a handshake blocked on it.
    fn cut_off(s: &Self::Stream);
}

impl PeerListener for TcpListener {
    type Stream = TcpStream;
    fn accept_peer(&self) -> io::Result<(TcpStream, String)> {
        self.accept().map(|(s, a)| (s, a.to_string()))
    }
    fn set_listener_nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
    fn make_blocking(s: &TcpStream) -> io::Result<()> {
        s.set_nonblocking(false)
    }
    fn second_handle(s: &TcpStream) -> io::Result<TcpStream> {
        s.try_clone()
    }
    fn cut_off(s: &TcpStream) {
        let _ = s.shutdown(Shutdown::Both);
    }
}

impl PeerListener for UnixListener {
    type Stream = UnixStream;
    fn accept_peer(&self) -> io::Result<(UnixStream, String)> {
        let (s, _) = self.accept()?;
        let who = peer_credentials(&s).map_or_else(
            || "a process on this host".to_string(),
            |c| format!("process {} (uid {}) on this host", c.pid, c.uid),
        );
        Ok((s, who))
    }
    fn set_listener_nonblocking(&self) -> io::Result<()> {
        self.set_nonblocking(true)
    }
    fn make_blocking(s: &UnixStream) -> io::Result<()> {
        s.set_nonblocking(false)
    }
    fn second_handle(s: &UnixStream) -> io::Result<UnixStream> {
        s.try_clone()
    }
    fn cut_off(s: &UnixStream) {
        let _ = s.shutdown(Shutdown::Both);
    }
}

/// Who is at the other end of a Unix-domain socket, as the kernel saw it connect.
fn peer_credentials(s: &UnixStream) -> Option<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and exclusively borrowed; the kernel writes at most
    // `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

/// Logs rejected connections, one by one at first and then sparsely.
pub(crate) struct RejectionLog {
    rank: usize,
    count: u64,
}

impl RejectionLog {
    pub(crate) fn new(rank: usize) -> Self {
        RejectionLog { rank, count: 0 }
    }

    pub(crate) fn note(&mut self, peer: &str, reason: &str) {
        self.count += 1;
        let n = self.count;
        if n <= LOGGED_REJECTIONS || n.is_power_of_two() {
            let more = if n > LOGGED_REJECTIONS {
                format!(" ({n} so far; not all are logged)")
            } else {
                String::new()
            };
            eprintln!(
                "tandem: rank {}: closed a connection from {peer}: {reason}{more}",
                self.rank
            );
        }
    }
}

/// A handshake still running on an accepted connection.
struct Pending<S> {
    /// A second handle on the socket, to cut the handshake off.
    handle: S,
    /// [`RUNNING`], then [`FINISHED`] (set by the handshake's thread) or [`EVICTED`] (set by
    /// the accepting loop), whichever comes first.
    state: Arc<AtomicU8>,
}

const RUNNING: u8 = 0;
const FINISHED: u8 = 1;
const EVICTED: u8 = 2;

/// Cuts off the oldest handshake still running in `pending` (to make room for a new
/// connection). A handshake that has just finished is left alone: its rank counts on it.
fn evict_oldest<S, L: PeerListener<Stream = S>>(pending: &mut BTreeMap<u64, Pending<S>>) {
    let victim = pending.iter().find_map(|(&id, p)| {
        p.state
            .compare_exchange(RUNNING, EVICTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(id)
    });
    if let Some(p) = victim.and_then(|id| pending.remove(&id)) {
        L::cut_off(&p.handle);
    }
}

/// What a handshake thread reports: its id, the peer's address, the stream, and the rank the
/// peer proved (or why it was refused).
type Outcome<S> = (u64, String, S, std::result::Result<usize, Failure>);

/// Accepts the connections of every rank above `me.rank` on `listener`, running their
/// handshakes in parallel. Returns `(peer rank, stream)` for each of them.
pub(crate) fn accept_peers<L: PeerListener>(
    listener: &L,
    me: &Me,
    config: &GroupConfig,
    started: Instant,
) -> Result<Vec<(usize, L::Stream)>> {
    let (rank, world) = (me.rank, me.world);
    let deadline = started + config.connect_timeout;
    let mut got: Vec<Option<L::Stream>> = (0..world).map(|_| None).collect();
    let missing = |got: &[Option<L::Stream>]| -> Vec<usize> {
        (rank + 1..world).filter(|&q| got[q].is_none()).collect()
    };
    listener
        .set_listener_nonblocking()
        .map_err(|e| setup_io(rank, "making the listener non-blocking", e))?;
    let (tx, rx) = mpsc::channel::<Outcome<L::Stream>>();
    // Handshakes in progress, by arrival (the smallest id is the oldest).
    let mut pending: BTreeMap<u64, Pending<L::Stream>> = BTreeMap::new();
    let mut next_id = 0u64;
    let mut log = RejectionLog::new(rank);
    let mut last_log = Instant::now();
    loop {
        for (id, peer, stream, outcome) in rx.try_iter() {
            if pending.remove(&id).is_none() {
                // Evicted: its socket is shut down, whatever the handshake made of it.
                log.note(
                    &peer,
                    "dropped to admit a newer connection while it was still in its handshake",
                );
                continue;
            }
            take_handshake(rank, world, &mut got, &mut log, peer, stream, outcome)?;
        }
        let waiting = missing(&got);
        if waiting.is_empty() {
            return Ok(got
                .into_iter()
                .enumerate()
                .filter_map(|(q, s)| s.map(|s| (q, s)))
                .collect());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(setup_timeout(
                rank,
                waiting.clone(),
                format!(
                    "timed out after {:?} waiting for {} to connect; are they started, with the \
                     same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?",
                    config.connect_timeout,
                    fmt_ranks(&waiting)
                ),
            ));
        }
        if now.duration_since(last_log) >= config.wait_log_interval {
            log_waiting(
                rank,
                &format!("{} to connect", fmt_ranks(&waiting)),
                started,
                config,
            );
            last_log = now;
        }
        let mut fds = [libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let _ = link::poll(&mut fds, (deadline - now).min(Duration::from_millis(20)));
        accept_new(listener, me, &tx, &mut pending, &mut next_id, &mut log);
    }
}

/// Files the outcome of one handshake from `peer`: a rank above this one that has not
/// connected yet is kept in `got`; a stranger is logged; a rank claimed twice or one that
/// should not connect here fails the set-up.
fn take_handshake<S>(
    rank: usize,
    world: usize,
    got: &mut [Option<S>],
    log: &mut RejectionLog,
    peer: String,
    stream: S,
    outcome: std::result::Result<usize, Failure>,
) -> Result<()> {
    match outcome {
        Ok(q) if q > rank && q < world && got[q].is_none() => got[q] = Some(stream),
        Ok(q) if q < world && q > rank => {
            return Err(connect_error(
                rank,
                format!(
                    "two processes claim rank {q} (the second connected from {peer}): \
                     is the same RANK given twice?"
                ),
            ))
        }
        Ok(q) => {
            return Err(connect_error(
                rank,
                format!(
                    "a member of this job at {peer} connected as rank {q}, but only \
                     ranks above {rank} (and below {world}) connect to rank {rank}: is \
                     the same RANK given twice?"
                ),
            ))
        }
        Err(Failure::Stranger(reason)) => log.note(&peer, &reason),
        Err(Failure::Fatal(problem)) => return Err(connect_error(rank, problem)),
    }
    Ok(())
}

/// Accepts every connection waiting on `listener` and starts its handshake on a thread of its
/// own (evicting the oldest handshake when too many are in progress).
fn accept_new<L: PeerListener>(
    listener: &L,
    me: &Me,
    tx: &mpsc::Sender<Outcome<L::Stream>>,
    pending: &mut BTreeMap<u64, Pending<L::Stream>>,
    next_id: &mut u64,
    log: &mut RejectionLog,
) {
    loop {
        let (stream, peer) = match listener.accept_peer() {
            Ok(x) => x,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                break
            }
            // Out of descriptors and the like: try again at the next round.
            Err(_) => break,
        };
        let handle = match L::make_blocking(&stream).and_then(|()| L::second_handle(&stream)) {
            Ok(handle) => handle,
            Err(e) => {
                log.note(&peer, &format!("could not set up its handshake: {e}"));
                continue;
            }
        };
        if pending.len() >= MAX_PENDING_HANDSHAKES {
            evict_oldest::<L::Stream, L>(pending);
        }
        *next_id += 1;
        let id = *next_id;
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (tx, me, thread_state) = (tx.clone(), me.clone(), state.clone());
        let mut stream = stream;
        let spawned = std::thread::Builder::new()
            .name("tandem-handshake".into())
            .spawn(move || {
                let hello_deadline = Instant::now() + HELLO_TIMEOUT;
                let outcome = accept_side(&mut stream, &me, &peer, hello_deadline);
                // Claim the connection before the accepting loop can evict it.
                let _ = thread_state.compare_exchange(
                    RUNNING,
                    FINISHED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                let _ = tx.send((id, peer, stream, outcome));
            });
        if spawned.is_ok() {
            pending.insert(id, Pending { handle, state });
        }
    }
}
