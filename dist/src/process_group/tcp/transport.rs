//! Executes a [`Plan`] over the TCP connections of a group: one event loop on the comm thread
//! that moves every peer's frames at once over non-blocking sockets.
//!
//! A single thread per rank drives all sends, receives and reductions: it writes to a socket
//! until the kernel would block, reads from one until nothing is left, reduces each chunk the
//! moment it has fully arrived (which may release the send that forwards it), and sleeps in
//! `poll(2)` only when no socket can make progress. No thread hand-offs sit on the data path and
//! sending never waits for receiving, so the ring stays pipelined and nothing can deadlock on
//! full socket buffers.
//!
//! Failure handling is part of the loop. Every live connection is watched for hang-ups, not
//! only those the collective is using: a peer that closes without a goodbye frame (its process
//! died) is noted at once and fails the collective as soon as the collective needs it; a peer
//! that fails sends an *abort* frame (finishing any half-sent frame with padding first) so that
//! everyone it talks to fails too and learns the original cause. Every header is judged against
//! what the plan expects before its payload is read, and the wait ends at the collective's
//! deadline (its start plus the group's timeout).

use std::io::{self, Read};
use std::time::{Duration, Instant};

use super::frame::{self, Expected, Farewell, FrameHeader, Verdict, HEADER_LEN};
use super::link::{abort_links, drain_farewell, poll, read_message, send_parts, Gone, Link};
use super::plan::{Dest, Finish, Plan};
use crate::error::{fmt_left_after, fmt_ranks};
use crate::process_group::{reduce, CollectiveDesc, ReduceOp};
use crate::{DistError, Result};

/// How long the event loop keeps retrying without progress before it sleeps in `poll`.
const SPIN_BEFORE_POLL: Duration = Duration::from_micros(30);

/// The collective being executed and who executes it.
pub(crate) struct Ctx<'a> {
    pub rank: usize,
    pub seq: u64,
    pub desc: &'a CollectiveDesc,
    /// The group's timeout: the longest the whole collective may take.
    pub timeout: Duration,
    /// When the collective started plus `timeout`: every wait of the collective, however many
    /// it has, ends by then, so a peer that is late at every step cannot stretch it.
    pub deadline: Instant,
    /// The most recent earlier collectives `(seq, desc)`, to explain a peer whose frame belongs
    /// to one of them.
    pub history: &'a [(u64, CollectiveDesc)],
    /// Diagnoses a failure and leaves this rank's report in the store (once per collective);
    /// called before the peers are told of the failure.
    pub report: &'a dyn Fn(&mut DistError),
}

impl Ctx<'_> {
    fn lost(&self, peers: Vec<usize>, cause: String) -> DistError {
        DistError::PeerLost {
            rank: self.rank,
            peers,
            collective: self.desc.to_string(),
            seq: self.seq,
            cause,
        }
    }

    fn protocol(&self, peer: usize, problem: impl Into<String>) -> DistError {
        DistError::Protocol {
            rank: self.rank,
            peer,
            collective: self.desc.to_string(),
            seq: self.seq,
            problem: problem.into(),
        }
    }

    fn internal(&self, what: impl Into<String>) -> DistError {
        DistError::internal(
            format!(
                "rank {}: {} (collective #{})",
                self.rank, self.desc, self.seq
            ),
            what,
        )
    }

    /// The error for a needed peer that is gone.
    fn gone_error(&self, peer: usize, gone: &Gone, others: &[usize]) -> DistError {
        match gone {
            Gone::Failed { message } => DistError::PeerAborted {
                rank: self.rank,
                peer,
                collective: self.desc.to_string(),
                seq: self.seq,
                message: message.clone(),
            },
            Gone::Left { completed } => self.lost(
                vec![peer],
                format!(
                    "rank {peer} left the group (dropped its process group) {}; it never issued \
                     collective #{}",
                    fmt_left_after(*completed),
                    self.seq
                ),
            ),
            Gone::Died { how } => {
                let mut peers = vec![peer];
                peers.extend(others.iter().filter(|&&q| q != peer));
                let mut cause = how.clone();
                if peers.len() > 1 {
                    cause.push_str(&format!("; also gone: {}", fmt_ranks(&peers[1..])));
                }
                self.lost(peers, cause)
            }
        }
    }
}

struct SendState {
    item: usize,
    header: [u8; HEADER_LEN],
    /// Bytes of the current frame (header + payload) already sent.
    sent: usize,
    started: bool,
}

struct RecvState {
    item: usize,
    header: [u8; HEADER_LEN],
    /// Bytes of the current frame (header + payload) already received.
    got: usize,
}

impl SendState {
    fn new() -> Self {
        SendState {
            item: 0,
            header: [0; HEADER_LEN],
            sent: 0,
            started: false,
        }
    }
}

impl RecvState {
    fn new() -> Self {
        RecvState {
            item: 0,
            header: [0; HEADER_LEN],
            got: 0,
        }
    }
}

/// Runs `plan` for collective `ctx` over `links` (indexed by rank; `None` for this rank).
/// `main` is the collective's buffer, `scratch` at least `plan.scratch_len` bytes. On failure
/// the failure is reported ([`Ctx::report`]) and the peers are told (abort frames) before the
/// error is returned.
pub(crate) fn execute(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    plan: &Plan,
    main: &mut [u8],
    scratch: &mut [u8],
) -> Result<()> {
    let world = links.len();
    let mut exec = Exec {
        ctx,
        plan,
        links,
        sends: (0..world).map(|_| SendState::new()).collect(),
        recvs: (0..world).map(|_| RecvState::new()).collect(),
        recvs_done: 0,
        deadline: ctx.deadline,
    };
    let mut result = exec.run(main, scratch);
    if result.is_ok() {
        result = finish(ctx, plan, main, scratch);
    }
    if let Err(err) = &mut result {
        (ctx.report)(err);
        let partial: Vec<(usize, usize)> = exec
            .sends
            .iter()
            .enumerate()
            .filter(|(_, s)| s.started && s.sent > 0)
            .filter_map(|(p, s)| {
                let item = plan.sends[p].get(s.item)?;
                Some((p, HEADER_LEN + item.range.len() - s.sent))
            })
            .collect();
        abort_links(exec.links, ctx.seq, err, &partial);
    }
    result
}

fn finish(ctx: &Ctx<'_>, plan: &Plan, main: &mut [u8], scratch: &mut [u8]) -> Result<()> {
    let Finish::FoldSlots { own, len } = plan.finish else {
        return Ok(());
    };
    let world = plan.sends.len();
    let (Some(dtype), Some(op)) = (ctx.desc.dtype, ctx.desc.op) else {
        return Err(ctx.internal("fold without a dtype and reduce op"));
    };
    let out = main
        .get_mut(own..own + len)
        .ok_or_else(|| ctx.internal("fold range outside the buffer"))?;
    let mine = scratch
        .get_mut(ctx.rank * len..(ctx.rank + 1) * len)
        .ok_or_else(|| ctx.internal("fold slot outside scratch"))?;
    mine.copy_from_slice(out);
    let slots: Vec<&[u8]> = scratch.chunks_exact(len.max(1)).take(world).collect();
    if len == 0 {
        return Ok(());
    }
    reduce::reduce_all(dtype, op, &slots, out).map_err(|e| ctx.internal(e))
}

struct Exec<'a, 'b> {
    ctx: &'a Ctx<'b>,
    plan: &'a Plan,
    links: &'a mut [Option<Link>],
    sends: Vec<SendState>,
    recvs: Vec<RecvState>,
    recvs_done: usize,
    deadline: Instant,
}

impl Exec<'_, '_> {
    fn needed(&self, p: usize) -> bool {
        self.recvs[p].item < self.plan.recvs[p].len()
            || self.sends[p].item < self.plan.sends[p].len()
    }

    fn gone_peers(&self) -> Vec<usize> {
        self.links
            .iter()
            .flatten()
            .filter(|l| matches!(l.gone, Some(Gone::Died { .. })))
            .map(|l| l.peer)
            .collect()
    }

    fn all_done(&self) -> bool {
        (0..self.links.len()).all(|p| !self.needed(p))
    }

    fn run(&mut self, main: &mut [u8], scratch: &mut [u8]) -> Result<()> {
        for p in 0..self.links.len() {
            if !self.needed(p) {
                continue;
            }
            let Some(link) = &self.links[p] else {
                return Err(self.ctx.internal(format!("no connection to rank {p}")));
            };
            if let Some(gone) = &link.gone {
                return Err(self.ctx.gone_error(p, gone, &self.gone_peers()));
            }
        }
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.links.len());
        let mut owners: Vec<usize> = Vec::with_capacity(self.links.len());
        let mut idle_since: Option<Instant> = None;
        loop {
            let mut progressed = false;
            for p in 0..self.links.len() {
                if self.needed(p) {
                    progressed |= self.pump_recv(p, main, scratch)?;
                    progressed |= self.pump_send(p, main)?;
                }
            }
            if self.all_done() {
                return Ok(());
            }
            if progressed {
                idle_since = None;
                continue;
            }
            // Briefly retry before sleeping in poll: a peer's next frame is often microseconds
            // away, and a wake-up from poll costs more than that on a busy machine. Yielding
            // keeps the retries from starving threads that have work to do.
            let idle = *idle_since.get_or_insert_with(Instant::now);
            if idle.elapsed() < SPIN_BEFORE_POLL {
                std::thread::yield_now();
                continue;
            }
            idle_since = None;
            fds.clear();
            owners.clear();
            for link in self.links.iter().flatten() {
                if link.gone.is_some() || link.shut {
                    continue;
                }
                let p = link.peer;
                let mut events = if self.recvs[p].item < self.plan.recvs[p].len() {
                    libc::POLLIN
                } else {
                    libc::POLLRDHUP
                };
                if self.plan.sends[p]
                    .get(self.sends[p].item)
                    .is_some_and(|s| self.recvs_done >= s.needs_recvs)
                {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd: link.fd(),
                    events,
                    revents: 0,
                });
                owners.push(p);
            }
            let now = Instant::now();
            if now >= self.deadline {
                return Err(self.timeout());
            }
            match poll(&mut fds, self.deadline - now) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let c = self.ctx;
                    let context = format!("{} (collective #{}): poll", c.desc, c.seq);
                    return Err(DistError::rank_io(c.rank, context, e));
                }
            }
            for (fd, &p) in fds.iter().zip(&owners) {
                let hangup = fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
                // A peer we are reading from reveals its end through the read itself.
                if hangup && self.recvs[p].item >= self.plan.recvs[p].len() {
                    self.hung_up(p)?;
                }
            }
        }
    }

    fn timeout(&self) -> DistError {
        let mut waiting: Vec<usize> = (0..self.links.len())
            .filter(|&p| self.recvs[p].item < self.plan.recvs[p].len())
            .collect();
        if waiting.is_empty() {
            waiting = (0..self.links.len()).filter(|&p| self.needed(p)).collect();
        }
        DistError::Timeout {
            rank: self.ctx.rank,
            collective: self.ctx.desc.to_string(),
            seq: self.ctx.seq,
            timeout: self.ctx.timeout,
            waiting_for: waiting,
            diagnosis: None,
        }
    }

    /// A peer we are not reading from hung up: learn why, and fail if it matters.
    fn hung_up(&mut self, p: usize) -> Result<()> {
        let farewell = self.links[p].as_mut().and_then(drain_farewell);
        self.note_farewell(p, farewell, &format!("rank {p} closed its connection"))?;
        if self.needed(p) {
            if let Some(gone) = self.links[p].as_ref().and_then(|l| l.gone.clone()) {
                return Err(self.ctx.gone_error(p, &gone, &self.gone_peers()));
            }
        }
        Ok(())
    }

    /// Records what a closed peer said last; an abort report fails the collective at once.
    fn note_farewell(&mut self, p: usize, farewell: Option<Farewell>, how: &str) -> Result<()> {
        let gone = match farewell {
            Some(Farewell::Abort { message, .. }) => {
                if let Some(link) = self.links[p].as_mut() {
                    link.gone = Some(Gone::Failed {
                        message: message.clone(),
                    });
                }
                return Err(DistError::PeerAborted {
                    rank: self.ctx.rank,
                    peer: p,
                    collective: self.ctx.desc.to_string(),
                    seq: self.ctx.seq,
                    message,
                });
            }
            Some(Farewell::Goodbye { completed }) => Gone::Left { completed },
            None => Gone::Died {
                how: format!(
                    "{how}, and rank {p} did not leave the group cleanly (its process probably \
                     exited or was killed)"
                ),
            },
        };
        if let Some(link) = self.links[p].as_mut() {
            link.gone = Some(gone);
        }
        Ok(())
    }

    /// The error for a needed peer whose stream ended or failed while this rank used it.
    fn stream_ended(&mut self, p: usize, how: String, at_boundary: bool) -> DistError {
        let farewell = if at_boundary {
            self.links[p].as_mut().and_then(drain_farewell)
        } else {
            None
        };
        if let Err(e) = self.note_farewell(p, farewell, &how) {
            return e;
        }
        self.notice_other_hangups(p);
        match self.links[p].as_ref().and_then(|l| l.gone.clone()) {
            Some(gone) => self.ctx.gone_error(p, &gone, &self.gone_peers()),
            None => self.ctx.lost(vec![p], how),
        }
    }

    /// Marks other peers that have hung up by now, so the error can name every rank that died.
    fn notice_other_hangups(&mut self, except: usize) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut owners = Vec::new();
        for link in self.links.iter().flatten() {
            if link.peer != except && link.gone.is_none() && !link.shut {
                fds.push(libc::pollfd {
                    fd: link.fd(),
                    events: libc::POLLRDHUP,
                    revents: 0,
                });
                owners.push(link.peer);
            }
        }
        if poll(&mut fds, Duration::from_millis(20)).unwrap_or(0) == 0 {
            return;
        }
        for (fd, p) in fds.iter().zip(owners) {
            if fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
                && self.recvs[p].got == 0
            {
                let farewell = self.links[p].as_mut().and_then(drain_farewell);
                let _ = self.note_farewell(p, farewell, &format!("rank {p} closed its connection"));
            }
        }
    }

    fn io_error(&mut self, p: usize, err: io::Error, at_boundary: bool) -> DistError {
        let how = match err.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => {
                format!("the connection to rank {p} was reset")
            }
            io::ErrorKind::BrokenPipe => format!("rank {p} closed its connection"),
            _ => format!("the connection to rank {p} failed ({err})"),
        };
        self.stream_ended(p, how, at_boundary)
    }

    /// Receives as much as is available from peer `p`. Returns whether any byte moved.
    fn pump_recv(&mut self, p: usize, main: &mut [u8], scratch: &mut [u8]) -> Result<bool> {
        let plan = self.plan;
        let mut progressed = false;
        loop {
            let st_item = self.recvs[p].item;
            let Some(item) = plan.recvs[p].get(st_item) else {
                return Ok(progressed);
            };
            let Some(link) = self.links[p].as_mut() else {
                return Err(self.ctx.internal(format!("no connection to rank {p}")));
            };
            let st = &mut self.recvs[p];
            if st.got < HEADER_LEN {
                match link.stream.read(&mut st.header[st.got..]) {
                    Ok(0) => {
                        let at_boundary = st.got == 0;
                        let how = if at_boundary {
                            format!("rank {p} closed its connection")
                        } else {
                            format!(
                                "rank {p} closed its connection in the middle of a frame header"
                            )
                        };
                        return Err(self.stream_ended(p, how, at_boundary));
                    }
                    Ok(n) => {
                        st.got += n;
                        progressed = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        let at_boundary = st.got == 0;
                        return Err(self.io_error(p, e, at_boundary));
                    }
                }
                if st.got < HEADER_LEN {
                    continue;
                }
                let header =
                    FrameHeader::decode(&st.header).map_err(|m| self.ctx.protocol(p, m))?;
                let index = plan.first_index + st_item as u64;
                self.judge_header(p, &header, index, item.len)?;
                // The payload is read on the next turn, with fresh borrows.
                continue;
            }
            let done = st.got - HEADER_LEN;
            if done < item.len {
                let (buf, at) = match item.dest {
                    Dest::Main(o) => (&mut *main, o),
                    Dest::Scratch(o) => (&mut *scratch, o),
                };
                let Some(dest) = buf.get_mut(at + done..at + item.len) else {
                    return Err(self.ctx.internal("receive range outside its buffer"));
                };
                match link.stream.read(dest) {
                    Ok(0) => {
                        let how =
                            format!("rank {p} closed its connection in the middle of a frame");
                        return Err(self.stream_ended(p, how, false));
                    }
                    Ok(n) => {
                        st.got += n;
                        progressed = true;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(self.io_error(p, e, false)),
                }
                if st.got - HEADER_LEN < item.len {
                    continue;
                }
            }
            st.item += 1;
            st.got = 0;
            self.recvs_done += 1;
            if let Some(into) = item.reduce_into {
                self.reduce_chunk(item.len, item.dest, into, item.divide, main, scratch)?;
            }
        }
    }

    /// Checks a received header against what the plan expects next from peer `p` (frame
    /// `index` of `payload_len` bytes): a mismatch, an abort, a goodbye or a malformed frame is
    /// an error naming the peer.
    fn judge_header(
        &mut self,
        p: usize,
        header: &FrameHeader,
        index: u64,
        payload_len: usize,
    ) -> Result<()> {
        let want = Expected {
            seq: self.ctx.seq,
            desc: self.ctx.desc,
            algorithm: self.plan.algorithm,
            index,
            payload_len,
        };
        let Some(link) = self.links[p].as_mut() else {
            return Err(self.ctx.internal(format!("no connection to rank {p}")));
        };
        match frame::judge(header, &want) {
            Verdict::Expected => Ok(()),
            Verdict::Mismatch { their_seq, theirs } => {
                // A frame of a collective this rank already completed (without needing
                // that peer) is best explained by what this rank issued back then.
                let past = self.ctx.history.iter().find(|(s, _)| *s == their_seq);
                let (seq, ours) = match past {
                    Some((s, d)) if their_seq < self.ctx.seq => (*s, d.to_string()),
                    _ => (self.ctx.seq, self.ctx.desc.to_string()),
                };
                Err(DistError::Mismatch {
                    rank: self.ctx.rank,
                    peer: p,
                    seq,
                    their_seq,
                    ours,
                    theirs,
                })
            }
            Verdict::Abort { .. } => {
                let message = read_message(link, header.payload_len as usize);
                let farewell = Farewell::Abort {
                    seq: header.seq,
                    culprit: None,
                    message,
                };
                Err(self
                    .note_farewell(p, Some(farewell), "")
                    .err()
                    .unwrap_or_else(|| self.ctx.internal("abort frame not reported")))
            }
            Verdict::Goodbye { completed } => {
                link.gone = Some(Gone::Left { completed });
                Err(self.ctx.gone_error(p, &Gone::Left { completed }, &[]))
            }
            Verdict::Bad(problem) => Err(self.ctx.protocol(p, problem)),
        }
    }

    fn reduce_chunk(
        &self,
        len: usize,
        dest: Dest,
        into: usize,
        divide: bool,
        main: &mut [u8],
        scratch: &[u8],
    ) -> Result<()> {
        let Dest::Scratch(from) = dest else {
            return Err(self.ctx.internal("reduce from the main buffer"));
        };
        let dtype = self
            .ctx
            .desc
            .dtype
            .ok_or_else(|| self.ctx.internal("reduce without a dtype"))?;
        let op = self.ctx.desc.op.unwrap_or(ReduceOp::Sum);
        let src = scratch
            .get(from..from + len)
            .ok_or_else(|| self.ctx.internal("scratch range"))?;
        let acc = main
            .get_mut(into..into + len)
            .ok_or_else(|| self.ctx.internal("reduce range"))?;
        reduce::combine(dtype, op, acc, src).map_err(|e| self.ctx.internal(e))?;
        if divide {
            reduce::divide(dtype, acc, self.links.len()).map_err(|e| self.ctx.internal(e))?;
        }
        Ok(())
    }

    /// Sends as much as the socket takes to peer `p`. Returns whether any byte moved.
    fn pump_send(&mut self, p: usize, main: &[u8]) -> Result<bool> {
        let plan = self.plan;
        let mut progressed = false;
        loop {
            let st = &mut self.sends[p];
            let Some(item) = plan.sends[p].get(st.item) else {
                return Ok(progressed);
            };
            if self.recvs_done < item.needs_recvs {
                return Ok(progressed);
            }
            let Some(payload) = main.get(item.range.clone()) else {
                return Err(self.ctx.internal("send range outside the buffer"));
            };
            if !st.started {
                st.header = FrameHeader::data(
                    *self.ctx.desc,
                    plan.algorithm,
                    self.ctx.seq,
                    plan.first_index + st.item as u64,
                    payload.len() as u64,
                )
                .encode();
                st.started = true;
                st.sent = 0;
            }
            let Some(link) = self.links[p].as_ref() else {
                return Err(self.ctx.internal(format!("no connection to rank {p}")));
            };
            let head = &st.header[st.sent.min(HEADER_LEN)..];
            let body = &payload[st.sent.saturating_sub(HEADER_LEN)..];
            match send_parts(link.fd(), head, body) {
                Ok(n) => {
                    st.sent += n;
                    progressed = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(progressed),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let at_boundary = self.recvs[p].got == 0;
                    return Err(self.io_error(p, e, at_boundary));
                }
            }
            if st.sent == HEADER_LEN + payload.len() {
                st.item += 1;
                st.started = false;
            }
        }
    }
}
