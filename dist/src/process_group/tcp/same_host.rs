//! The same-host fast path of the TCP backend: when every rank of a group runs on one machine,
//! large collectives move through shared-memory segments instead of through the TCP stack, and
//! use the TCP connections only to synchronise.
//!
//! **Trust.** Each rank owns one segment: an anonymous memory file (`memfd_create`) mapped
//! read-write by its owner, then sealed so that it can never shrink and nobody can write to it
//! any other way (`F_SEAL_FUTURE_WRITE`: the kernel refuses every later writable mapping and
//! every `write(2)`, whoever holds the file). The owner hands the file itself — not a name, not
//! an address — to each peer over an authenticated Unix-domain socket (`SCM_RIGHTS`); a peer
//! checks the seals, the size and that the file is not its own segment or another peer's, and
//! maps it read-only (it cannot do otherwise). So a rank writes only into memory it allocated
//! for the purpose, reads only from mappings whose bounds it checked itself, at offsets it
//! computes from the collective (which every rank agrees on), and no byte a peer sends is ever
//! used as an address. A misbehaving peer can at worst put wrong numbers in its own segment; it
//! cannot make a rank touch any other memory, cannot change another rank's segment, and the
//! seals mean it cannot make a rank fault by truncating its file. The `segment` module holds
//! these mechanics.
//!
//! **Setup.** Each rank listens on an abstract Unix-domain socket with a random name and
//! publishes the name in the store. Every rank connects to the sockets of the lower ranks (a
//! connect that the peer never takes — its backlog full, nothing accepted — fails at the setup
//! deadline, naming the peer and its socket, instead of blocking for ever); only if every rank
//! reached every lower rank (so all share one host and one network namespace) do all ranks
//! enable the path — they agree through the store, so all ranks always pick the same
//! algorithm. The channels then run the same handshake as the TCP links (job secret, rank,
//! world size), and a stranger on a socket is closed and logged.
//!
//! **A collective** starts with one exchange of frames over TCP that carries the usual header
//! checks (sequence number, collective, dtype, element count), so ranks that issued different
//! collectives are told so. The data then flows in pieces through a small ring of slots in each
//! segment (a few MiB, so it stays in cache), synchronised through progress counters in the
//! segment's first page (each written by the segment's owner only, read by the others): a rank
//! copies into its next slot what the peers need of piece j and advances `Staged`; for a
//! reduction it then folds its own share of piece j — a ring segment of an all-reduce, its block
//! of a reduce-scatter — reading the peers' contributions straight from their slots and its own
//! in place, in rank order so that every rank ends with identical bits, publishes the result in
//! its slot while it is still in cache and advances `Reduced`; the peers copy it out a step
//! later. A gather or broadcast just copies. A rank advances `Consumed` when it has read
//! everything of a step, and reuses a slot only when every peer has consumed it. A rank waiting
//! on a counter spins briefly, then yields, then sleeps in short naps, and checks its TCP
//! connections for a peer that died, failed or left, so such a peer is named at once. The
//! group's timeout bounds the whole collective, not each wait: its deadline is set when the
//! collective starts, and every wait of it — the exchange of frames, the segments, each
//! counter — ends by then. The segments are created at the first same-host collective, after
//! its exchange of frames.

use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::frame::Farewell;
use super::handshake::Channel;
use super::link::{drain_farewell, poll, Gone, Link};
use super::mesh::handshake_with_retry;
use super::mesh::{accept_peers, me};
use super::plan::same_host_phase;
use super::segment::{
    adopt_segment, create_segment, mark, recv_fd, sealing_supported, send_fd, Counter, FileId,
    Mapping, GROW_MESSAGE, HEADER,
};
use super::transport::{self, Ctx};
use crate::error::{fmt_left_after, fmt_ranks};
use crate::process_group::reduce;
use crate::process_group::{CollectiveKind, GroupConfig};
use crate::store::TcpStore;
use crate::{DistError, Result};

/// Slots of a segment: a rank may stage this many pieces ahead of the slowest reader.
const SLOTS: usize = 4;
/// Bytes of one slot, shared by the pieces for every rank, so a segment stays in cache.
const SLOT_BYTES: usize = 1 << 20;
/// Largest group that uses the path (every rank's socket must hold all its peers' pending
/// connections while the group is set up).
const MAX_RANKS: usize = 128;
/// What a rank holds for the same-host path: a channel to each peer, its own segment and its
/// read-only mappings of the peers' segments.
pub(crate) struct SameHost {
    channels: Vec<Option<UnixStream>>,
    own: Option<Mapping>,
    peers: Vec<Option<Mapping>>,
    /// Bytes of the data area of every segment.
    capacity: usize,
    /// The `Consumed` mark this rank published last: the peers must reach it before this rank
    /// overwrites its segment.
    last_consumed: u64,
}

/// Finds out whether every rank runs on this host and, if so, connects the same-host
/// channels. Every rank of the group must call it; all get the same answer.
pub(crate) fn agree(
    store: &TcpStore,
    rank: usize,
    world: usize,
    config: &GroupConfig,
    started: Instant,
) -> Result<Option<SameHost>> {
    if world <= 1 || world > MAX_RANKS || !config.same_host_copy {
        return Ok(None);
    }
    let deadline = started + config.connect_timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let prefix = format!("tandem/{}/same_host", config.name);
    // A rank whose kernel cannot seal segments read-only for its peers publishes no socket,
    // so that no rank enables the path.
    let listener = crate::auth::nonce()
        .ok()
        .filter(|_| sealing_supported())
        .map(|n| {
            let hex: String = n[..16].iter().map(|b| format!("{b:02x}")).collect();
            format!("tandem-{hex}")
        })
        .and_then(|name| {
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).ok()?;
            Some((UnixListener::bind_addr(&addr).ok()?, name))
        });
    let published = listener.as_ref().map_or("", |(_, name)| name.as_str());
    store.set(&format!("{prefix}/socket/{rank}"), published.as_bytes())?;
    let mut outgoing = Vec::new();
    let mut reachable = listener.is_some();
    for q in 0..rank {
        if !reachable {
            break;
        }
        let name = store.get_timeout(&format!("{prefix}/socket/{q}"), left())?;
        if name.is_empty() {
            reachable = false;
            continue;
        }
        match connect_by(&name, deadline) {
            Ok(s) => outgoing.push((q, name, s)),
            // The peer's socket is there but never took the connection: waiting on would hang.
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                return Err(DistError::Connect {
                    rank,
                    detail: format!(
                        "rank {q}'s same-host socket @{} did not accept this rank's connection \
                         within the connect timeout ({:?}): {e}",
                        String::from_utf8_lossy(&name),
                        config.connect_timeout
                    ),
                });
            }
            // Not there (another host or network namespace): the ranks use TCP only.
            Err(_) => reachable = false,
        }
    }
    store.set(
        &format!("{prefix}/reachable/{rank}"),
        if reachable { b"1" } else { b"0" },
    )?;
    let mut everyone = reachable;
    for q in 0..world {
        everyone &= store.get_timeout(&format!("{prefix}/reachable/{q}"), left())? == b"1";
    }
    let Some((listener, _)) = listener.filter(|_| everyone) else {
        return Ok(None);
    };
    let me = me(store, rank, world, config, Channel::SameHost);
    let mut channels: Vec<Option<UnixStream>> = (0..world).map(|_| None).collect();
    for (q, name, first) in outgoing {
        let desc = format!("rank {q}'s same-host channel");
        // The connection made above is tried first; if rank q's listener drops it during the
        // handshake (a flood of connections evicts the oldest pending one), connect again.
        let mut first = Some(first);
        let stream = handshake_with_retry(&me, q, &desc, deadline, || match first.take() {
            Some(stream) => Ok(stream),
            None => connect_by(&name, deadline).map_err(|e| DistError::Connect {
                rank,
                detail: format!(
                    "connecting again to rank {q}'s same-host socket @{}: {e}",
                    String::from_utf8_lossy(&name)
                ),
            }),
        })?;
        channels[q] = Some(stream);
    }
    for (q, stream) in accept_peers(&listener, &me, config, started)? {
        channels[q] = Some(stream);
    }
    Ok(Some(SameHost {
        channels,
        own: None,
        peers: (0..world).map(|_| None).collect(),
        capacity: 0,
        last_consumed: 0,
    }))
}

/// The address of the abstract Unix-domain socket `name`, and its length.
pub(super) fn abstract_address(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: `sockaddr_un` is a plain C struct, valid when zeroed.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // An abstract name: a NUL byte, then the name (not NUL-terminated).
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    for (to, &from) in addr.sun_path[1..].iter_mut().zip(name) {
        *to = from as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

/// Connects to the abstract Unix-domain socket `name` by `deadline`. A blocking connect to a
/// socket whose backlog is full waits until its owner accepts — for ever, if it never does — so
/// the socket is non-blocking and a full backlog (`EAGAIN`) is retried in short naps until the
/// deadline, then reported as `TimedOut`. Other failures (nothing listening) return at once.
fn connect_by(name: &[u8], deadline: Instant) -> io::Result<UnixStream> {
    let (addr, len) = abstract_address(name)?;
    // SAFETY: socket(2) takes plain integers and returns a new descriptor.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut nap = Duration::from_millis(1);
    loop {
        // SAFETY: `addr` is a live, initialised `sockaddr_un` of at least `len` bytes; connect
        // only reads it.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
                len,
            )
        };
        if rc == 0 {
            break;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EISCONN) => break,
            // Backlog full (or, on other socket kinds, still in progress): wait and retry.
            Some(libc::EAGAIN | libc::EINPROGRESS | libc::EALREADY) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "its backlog stayed full (it accepts no connection)",
                    ));
                }
                std::thread::sleep(nap.min(left));
                nap = (nap * 2).min(Duration::from_millis(50));
            }
            _ => return Err(err),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

impl SameHost {
    /// Makes this rank's segment hold at least `needed` bytes, sending a new one to every peer
    /// if it must grow. Returns whether it grew (then the peers' new segments are to be
    /// received with [`SameHost::receive_segments`]).
    fn ensure_capacity(&mut self, ctx: &Ctx<'_>, needed: usize) -> Result<bool> {
        if needed <= self.capacity && self.own.is_some() {
            return Ok(false);
        }
        let capacity = needed;
        let (fd, mapping) = create_segment(HEADER + capacity).map_err(|e| {
            internal(
                ctx,
                format!("creating a shared segment of {capacity} bytes: {e}"),
            )
        })?;
        let mut message = [0u8; GROW_MESSAGE];
        message[..8].copy_from_slice(&(capacity as u64).to_le_bytes());
        message[8..].copy_from_slice(&ctx.seq.to_le_bytes());
        for (q, channel) in self.channels.iter().enumerate() {
            if let Some(channel) = channel {
                // A peer that stopped reading its channel must not hold this rank past the
                // collective's deadline either.
                let left = ctx.deadline.saturating_duration_since(Instant::now());
                channel
                    .set_write_timeout(Some(left.max(Duration::from_millis(1))))
                    .and_then(|()| send_fd(channel, fd.as_raw_fd(), &message))
                    .map_err(|e| match e.kind() {
                        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => timed_out(ctx, q),
                        _ => lost(
                            ctx,
                            q,
                            format!("sending rank {q} this rank's segment failed: {e}"),
                        ),
                    })?;
            }
        }
        self.own = Some(mapping);
        self.capacity = capacity;
        Ok(true)
    }

    /// Receives every peer's new segment (sent when the ranks grew theirs at this collective),
    /// by the collective's deadline.
    fn receive_segments(&mut self, ctx: &Ctx<'_>) -> Result<()> {
        let mut received = Vec::new();
        for q in 0..self.channels.len() {
            let Some(channel) = &self.channels[q] else {
                continue;
            };
            let (fd, message) = recv_fd(channel, ctx.deadline).map_err(|e| match e.kind() {
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => timed_out(ctx, q),
                _ => lost(ctx, q, format!("receiving rank {q}'s segment failed: {e}")),
            })?;
            let fd = fd.ok_or_else(|| protocol(ctx, q, "its segment message carried no file"))?;
            let mut word = [0u8; 8];
            word.copy_from_slice(&message[..8]);
            let capacity = u64::from_le_bytes(word);
            word.copy_from_slice(&message[8..]);
            let seq = u64::from_le_bytes(word);
            if capacity != self.capacity as u64 || seq != ctx.seq {
                return Err(protocol(
                    ctx,
                    q,
                    format!(
                        "it sent a segment of {capacity} bytes at collective #{seq}; {} bytes at \
                         #{} were expected",
                        self.capacity, ctx.seq
                    ),
                ));
            }
            // Every segment must be a different file: a peer handing this rank its own segment
            // (or another peer's) back would have it read what it wrote as the peer's data.
            let mut taken: Vec<FileId> = self.own.iter().map(Mapping::file).collect();
            taken.extend(received.iter().map(|(_, m): &(usize, Mapping)| m.file()));
            let mapping = adopt_segment(&fd, HEADER + self.capacity, &taken)
                .map_err(|m| protocol(ctx, q, m))?;
            received.push((q, mapping));
        }
        for (q, mapping) in received {
            self.peers[q] = Some(mapping);
        }
        Ok(())
    }

    fn peer(&self, ctx: &Ctx<'_>, q: usize) -> Result<&Mapping> {
        self.peers[q]
            .as_ref()
            .ok_or_else(|| internal(ctx, format!("no segment of rank {q}")))
    }

    fn own(&mut self, ctx: &Ctx<'_>) -> Result<&mut Mapping> {
        self.own
            .as_mut()
            .ok_or_else(|| internal(ctx, "no own segment"))
    }

    fn publish(&self, which: Counter, value: u64) {
        if let Some(own) = &self.own {
            own.counter(which).store(value, Ordering::Release);
        }
    }

    /// Waits until every rank in `from` has published at least `target` in counter `which`.
    /// Ends at the collective's deadline (not a fresh timeout per wait, so a peer that publishes
    /// each step just in time cannot stretch the collective); a peer that closes its connection
    /// (it died, failed or left) ends the wait at once with the reason.
    fn wait(
        &self,
        links: &mut [Option<Link>],
        ctx: &Ctx<'_>,
        from: impl Iterator<Item = usize> + Clone,
        which: Counter,
        target: u64,
    ) -> Result<()> {
        let mut spins = 0u64;
        loop {
            let mut behind = None;
            for q in from.clone() {
                if self.peer(ctx, q)?.counter(which).load(Ordering::Acquire) < target {
                    behind = Some(q);
                    break;
                }
            }
            let Some(q) = behind else {
                return Ok(());
            };
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
                continue;
            }
            // On a busy machine the peer may need this core: yield, then nap.
            if spins < 4096 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
            if spins & 255 == 0 {
                check_links(links, ctx)?;
                if Instant::now() >= ctx.deadline {
                    return Err(timed_out(ctx, q));
                }
            }
        }
    }
}

/// Runs the collective `ctx` on `main` through the shared segments.
pub(crate) fn run(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    sh: &mut SameHost,
    main: &mut [u8],
    chunk_bytes: usize,
) -> Result<()> {
    match run_pieces(links, ctx, sh, main, chunk_bytes) {
        Err(err) if !matches!(err, DistError::Io { .. } | DistError::Internal { .. }) => {
            Err(explain(links, ctx, err))
        }
        other => other,
    }
}

/// How a collective's buffer is cut into pieces and where each piece lies in a segment.
struct Layout {
    rank: usize,
    world: usize,
    kind: CollectiveKind,
    /// Bytes of the whole buffer.
    total: usize,
    /// Bytes of one rank's block (the whole buffer, except for all_gather and reduce_scatter).
    block: usize,
    elem: usize,
    /// Pieces per rank's range.
    pieces: usize,
    /// Largest piece; a slot holds one piece for every rank.
    piece_max: usize,
    slot_bytes: usize,
}

impl Layout {
    /// Rank q's range of the buffer (its share of an all-reduce; the block offset is added
    /// where needed for the others).
    fn range_of(&self, q: usize) -> Range<usize> {
        if self.kind == CollectiveKind::AllReduce {
            share(q, self.world, self.total, self.elem)
        } else {
            0..self.block
        }
    }

    /// Piece `j` of rank q's range.
    fn piece_of(&self, q: usize, j: usize) -> Range<usize> {
        piece(self.range_of(q), self.pieces, j, self.elem)
    }

    /// Where piece j for rank `sub` lies in a segment.
    fn slot(&self, j: usize, sub: usize, len: usize) -> Range<usize> {
        let at = (j % SLOTS) * self.slot_bytes + sub * self.piece_max;
        at..at + len
    }

    /// The ranks other than this one.
    fn peers(&self) -> impl Iterator<Item = usize> + Clone {
        let rank = self.rank;
        (0..self.world).filter(move |&q| q != rank)
    }
}

fn run_pieces(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    sh: &mut SameHost,
    main: &mut [u8],
    chunk_bytes: usize,
) -> Result<()> {
    let (rank, world, desc) = (ctx.rank, sh.channels.len(), ctx.desc);
    let dtype = desc
        .dtype
        .ok_or_else(|| internal(ctx, "same-host copy of a barrier"))?;
    let elem = dtype.size_in_bytes();
    let total = main.len();
    let block = match desc.kind {
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => total / world,
        _ => total,
    };
    if block == 0 {
        return Ok(());
    }
    let peers = (0..world).filter(move |&q| q != rank);
    // Every rank is at this collective (the frames check it), so the counters below are theirs.
    let plan = same_host_phase(rank, world, 0, 0);
    transport::execute(links, ctx, &plan, &mut [], &mut [])?;
    // Nobody still reads this rank's segment from the previous collective.
    if sh.own.is_some() {
        sh.wait(links, ctx, peers, Counter::Consumed, sh.last_consumed)?;
    }
    // A slot holds one piece for every rank; pieces are multiples of 64 bytes (any element).
    let piece_max = (chunk_bytes.min(SLOT_BYTES / world) / 64 * 64).max(64);
    let slot_bytes = world * piece_max;
    if sh.ensure_capacity(ctx, SLOTS * slot_bytes)? {
        sh.receive_segments(ctx)?;
    }
    let mut layout = Layout {
        rank,
        world,
        kind: desc.kind,
        total,
        block,
        elem,
        pieces: 1,
        piece_max,
        slot_bytes,
    };
    let widest = (0..world)
        .map(|q| layout.range_of(q).len())
        .max()
        .unwrap_or(0);
    layout.pieces = widest.div_ceil(piece_max).max(1);
    for j in 0..layout.pieces {
        if j >= SLOTS {
            // The slot is free once every peer has read what was staged in it SLOTS ago.
            let freed = mark(ctx.seq, j + 1 - SLOTS);
            sh.wait(links, ctx, layout.peers(), Counter::Consumed, freed)?;
        }
        stage_piece(ctx, sh, &layout, main, j)?;
        sh.publish(Counter::Staged, mark(ctx.seq, j + 1));
        collect_piece(links, ctx, sh, &layout, main, j)?;
    }
    if desc.kind == CollectiveKind::AllReduce {
        gather_reduced(links, ctx, sh, main, &layout, layout.pieces - 1)?;
    }
    sh.last_consumed = mark(ctx.seq, layout.pieces);
    Ok(())
}

/// Stages this rank's piece `j` for the others in its own segment.
fn stage_piece(
    ctx: &Ctx<'_>,
    sh: &mut SameHost,
    layout: &Layout,
    main: &[u8],
    j: usize,
) -> Result<()> {
    let (rank, block) = (layout.rank, layout.block);
    let root = ctx.desc.root.unwrap_or(0) as usize;
    let own = sh.own(ctx)?.data_mut();
    match layout.kind {
        CollectiveKind::AllReduce => {
            for q in layout.peers() {
                let p = layout.piece_of(q, j);
                own[layout.slot(j, q, p.len())].copy_from_slice(&main[p]);
            }
        }
        CollectiveKind::ReduceScatter => {
            let p = layout.piece_of(rank, j);
            for q in layout.peers() {
                let at = q * block;
                own[layout.slot(j, q, p.len())].copy_from_slice(&main[at + p.start..at + p.end]);
            }
        }
        CollectiveKind::AllGather => {
            let (p, at) = (layout.piece_of(rank, j), rank * block);
            own[layout.slot(j, 0, p.len())].copy_from_slice(&main[at + p.start..at + p.end]);
        }
        CollectiveKind::Broadcast => {
            if rank == root {
                let p = layout.piece_of(rank, j);
                own[layout.slot(j, 0, p.len())].copy_from_slice(&main[p]);
            }
        }
        CollectiveKind::Barrier => return Err(internal(ctx, "same-host copy of a barrier")),
    }
    Ok(())
}

/// Once the others staged piece `j`: reduces this rank's share of it, or copies what this
/// rank receives; tells the others how far it got.
fn collect_piece(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    sh: &mut SameHost,
    layout: &Layout,
    main: &mut [u8],
    j: usize,
) -> Result<()> {
    let (rank, block, desc) = (layout.rank, layout.block, ctx.desc);
    let root = desc.root.unwrap_or(0) as usize;
    let now = mark(ctx.seq, j + 1);
    match desc.kind {
        CollectiveKind::AllReduce | CollectiveKind::ReduceScatter => {
            reduce_piece(links, ctx, sh, layout, main, j)?;
        }
        CollectiveKind::AllGather => {
            for q in layout.peers() {
                sh.wait(links, ctx, std::iter::once(q), Counter::Staged, now)?;
                let (p, at) = (layout.piece_of(q, j), q * block);
                let from = layout.slot(j, 0, p.len());
                main[at + p.start..at + p.end].copy_from_slice(&sh.peer(ctx, q)?.data()[from]);
            }
            sh.publish(Counter::Consumed, now);
        }
        CollectiveKind::Broadcast => {
            if rank != root {
                sh.wait(links, ctx, std::iter::once(root), Counter::Staged, now)?;
                let p = layout.piece_of(root, j);
                let from = layout.slot(j, 0, p.len());
                main[p].copy_from_slice(&sh.peer(ctx, root)?.data()[from]);
            }
            sh.publish(Counter::Consumed, now);
        }
        CollectiveKind::Barrier => {}
    }
    Ok(())
}

/// Reduces this rank's share of piece `j` from the others' staged copies; for an all-reduce
/// publishes it for the others and collects their previous pieces.
fn reduce_piece(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    sh: &mut SameHost,
    layout: &Layout,
    main: &mut [u8],
    j: usize,
) -> Result<()> {
    let (rank, desc) = (layout.rank, ctx.desc);
    let now = mark(ctx.seq, j + 1);
    let dtype = desc
        .dtype
        .ok_or_else(|| internal(ctx, "same-host copy of a barrier"))?;
    let op = desc
        .op
        .ok_or_else(|| internal(ctx, "reduction without an op"))?;
    sh.wait(links, ctx, layout.peers(), Counter::Staged, now)?;
    let p = layout.piece_of(rank, j);
    let at = if desc.kind == CollectiveKind::AllReduce {
        0
    } else {
        rank * layout.block
    };
    let out = at + p.start..at + p.end;
    let theirs = layout.slot(j, rank, p.len());
    let sources = (0..layout.world)
        .map(|q| {
            if q == rank {
                Ok(None)
            } else {
                sh.peer(ctx, q).map(|m| Some(&m.data()[theirs.clone()]))
            }
        })
        .collect::<Result<Vec<_>>>()?;
    reduce::reduce_in_place(dtype, op, &sources, &mut main[out.clone()])
        .map_err(|e| internal(ctx, e))?;
    if desc.kind == CollectiveKind::AllReduce {
        // Publish the finished piece while it is still in cache; collect the peers'
        // previous pieces, which are most likely ready by now.
        sh.own(ctx)?.data_mut()[theirs].copy_from_slice(&main[out]);
        sh.publish(Counter::Reduced, now);
        if j > 0 {
            gather_reduced(links, ctx, sh, main, layout, j - 1)?;
        }
    } else {
        sh.publish(Counter::Consumed, now);
    }
    Ok(())
}

/// Copies piece `j` of every peer's reduced share into `main`, then tells the peers that
/// this rank has read everything of step `j`.
fn gather_reduced(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    sh: &SameHost,
    main: &mut [u8],
    layout: &Layout,
    j: usize,
) -> Result<()> {
    let at = mark(ctx.seq, j + 1);
    for q in (0..sh.channels.len()).filter(|&q| q != ctx.rank) {
        sh.wait(links, ctx, std::iter::once(q), Counter::Reduced, at)?;
        let p = layout.piece_of(q, j);
        let from = layout.slot(j, q, p.len());
        main[p].copy_from_slice(&sh.peer(ctx, q)?.data()[from]);
    }
    sh.publish(Counter::Consumed, at);
    Ok(())
}

/// Piece `j` of `pieces` near-equal pieces of the byte range `range` (cut on elements).
fn piece(range: Range<usize>, pieces: usize, j: usize, elem: usize) -> Range<usize> {
    let n = range.len() / elem;
    range.start + (n * j / pieces) * elem..range.start + (n * (j + 1) / pieces) * elem
}

/// Fails at once if a peer has closed its connection (it died, failed or left), with the
/// reason it left behind; marks it gone so later collectives know.
fn check_links(links: &mut [Option<Link>], ctx: &Ctx<'_>) -> Result<()> {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut owners = Vec::new();
    for link in links
        .iter()
        .flatten()
        .filter(|l| l.gone.is_none() && !l.shut)
    {
        // Hang-ups only: a frame waiting here may be a peer's next collective, not ours to read.
        fds.push(libc::pollfd {
            fd: link.fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        });
        owners.push(link.peer);
    }
    if poll(&mut fds, Duration::ZERO).unwrap_or(0) == 0 {
        return Ok(());
    }
    for (fd, peer) in fds.iter().zip(owners) {
        if fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0 {
            continue;
        }
        let Some(link) = links[peer].as_mut() else {
            continue;
        };
        let (gone, err) = match drain_farewell(link) {
            Some(Farewell::Abort { message, .. }) => (
                Gone::Failed {
                    message: message.clone(),
                },
                DistError::PeerAborted {
                    rank: ctx.rank,
                    peer,
                    collective: ctx.desc.to_string(),
                    seq: ctx.seq,
                    message,
                },
            ),
            Some(Farewell::Goodbye { completed }) => (
                Gone::Left { completed },
                lost(
                    ctx,
                    peer,
                    format!(
                        "rank {peer} left the group (dropped its process group) {}; it never \
                         finished collective #{}",
                        fmt_left_after(completed),
                        ctx.seq
                    ),
                ),
            ),
            None => {
                let how = format!(
                    "rank {peer} closed its connection without leaving the group cleanly (its \
                     process probably exited or was killed)"
                );
                (Gone::Died { how: how.clone() }, lost(ctx, peer, how))
            }
        };
        link.gone = Some(gone);
        return Err(err);
    }
    Ok(())
}

/// Rank `q`'s share of a reduction over `len` bytes: the ring's balanced segment, in bytes.
fn share(q: usize, world: usize, len: usize, elem: usize) -> std::ops::Range<usize> {
    let n = len / elem;
    (q * n / world) * elem..((q + 1) * n / world) * elem
}

/// The best explanation of a failure: an abort report or hang-up found on the connections,
/// else `err` itself.
fn explain(links: &mut [Option<Link>], ctx: &Ctx<'_>, err: DistError) -> DistError {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut owners = Vec::new();
    for link in links
        .iter()
        .flatten()
        .filter(|l| l.gone.is_none() && !l.shut)
    {
        fds.push(libc::pollfd {
            fd: link.fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        });
        owners.push(link.peer);
    }
    if poll(&mut fds, Duration::ZERO).unwrap_or(0) == 0 {
        return err;
    }
    let mut dead = Vec::new();
    for (fd, peer) in fds.iter().zip(owners) {
        if fd.revents == 0 {
            continue;
        }
        let Some(link) = links[peer].as_mut() else {
            continue;
        };
        // Between phases every connection sits on a frame boundary, so what is there parses.
        match drain_farewell(link) {
            Some(Farewell::Abort { message, .. }) => {
                return DistError::PeerAborted {
                    rank: ctx.rank,
                    peer,
                    collective: ctx.desc.to_string(),
                    seq: ctx.seq,
                    message,
                }
            }
            Some(Farewell::Goodbye { .. }) => {}
            None if fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 => {
                dead.push(peer)
            }
            None => {}
        }
    }
    if dead.is_empty() {
        return err;
    }
    let mut cause = format!(
        "{} closed {} connection without leaving the group cleanly (the process probably exited \
         or was killed)",
        fmt_ranks(&dead),
        if dead.len() == 1 { "its" } else { "their" }
    );
    if !err.blamed_ranks().iter().all(|r| dead.contains(r)) {
        cause.push_str(&format!("; also: {err}"));
    }
    DistError::PeerLost {
        rank: ctx.rank,
        peers: dead,
        collective: ctx.desc.to_string(),
        seq: ctx.seq,
        cause,
    }
}

/// The collective's deadline passed while this rank waited for `peer`.
fn timed_out(ctx: &Ctx<'_>, peer: usize) -> DistError {
    DistError::Timeout {
        rank: ctx.rank,
        collective: ctx.desc.to_string(),
        seq: ctx.seq,
        timeout: ctx.timeout,
        waiting_for: vec![peer],
        diagnosis: None,
    }
}

fn internal(ctx: &Ctx<'_>, what: impl Into<String>) -> DistError {
    DistError::internal(
        format!("rank {}: {} (collective #{})", ctx.rank, ctx.desc, ctx.seq),
        what,
    )
}

fn protocol(ctx: &Ctx<'_>, peer: usize, problem: impl Into<String>) -> DistError {
    DistError::Protocol {
        rank: ctx.rank,
        peer,
        collective: ctx.desc.to_string(),
        seq: ctx.seq,
        problem: problem.into(),
    }
}

fn lost(ctx: &Ctx<'_>, peer: usize, cause: String) -> DistError {
    DistError::PeerLost {
        rank: ctx.rank,
        peers: vec![peer],
        collective: ctx.desc.to_string(),
        seq: ctx.seq,
        cause,
    }
}
