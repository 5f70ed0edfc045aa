//! The same-host fast path of the TCP backend: when every rank of a group runs on one machine,
//! large collectives copy straight out of the other ranks' memory with `process_vm_readv(2)`
//! (cross-memory attach, as MPI implementations do) and use the TCP connections only to
//! synchronise.
//!
//! Through loopback TCP each byte is copied twice (sender into the kernel, kernel into the
//! receiver) and pays the TCP stack on the way; a cross-memory read copies it once. Whether it
//! works — same user, same PID namespace, no ptrace restrictions — is not guessed from host
//! names: when the group is set up each rank publishes the address of a random token and every
//! other rank tries to read it. Only if every rank could read every other do all ranks enable
//! the path (they agree through the store), so all ranks always pick the same algorithm.
//!
//! A collective then runs in two phases, each ended by an exchange of frames that carries the
//! usual header checks (sequence number, collective, dtype, element count). First the ranks
//! swap the addresses of their buffers (which also says "my buffer is ready"). Then each rank
//! computes its own segment of a reduction chunk by chunk — reading the others' copies of the
//! chunk, folding all contributions in rank order (so results are bit-identical everywhere) —
//! and, for an all-reduce, writes the finished chunk straight into every peer's buffer while it
//! is still in cache (`process_vm_writev`); a gather or broadcast just reads what it needs. A
//! final barrier guarantees that nobody releases a buffer another rank still reads or writes.
//! A peer that dies is noticed on its connection as on the ring path, or by the failed copy.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::frame::Farewell;
use super::link::{drain_farewell, poll, Link};
use super::plan::same_host_phase;
use super::reduce::{self, AlignedBuf};
use super::transport::{self, Ctx};
use super::{CollectiveKind, GroupConfig};
use crate::error::fmt_ranks;
use crate::store::TcpStore;
use crate::{DistError, Result};

/// Finds out whether every rank can read every other rank's memory. Returns the ranks' process
/// ids if so. Every rank of the group must call it.
pub(crate) fn agree(
    store: &TcpStore,
    rank: usize,
    world: usize,
    config: &GroupConfig,
    deadline: Instant,
) -> Result<Option<Vec<i32>>> {
    if world <= 1 {
        return Ok(None);
    }
    let prefix = format!("tandem/{}/same_host", config.name);
    let mut token = [0u8; 32];
    for chunk in token.chunks_mut(8) {
        let mut h = RandomState::new().build_hasher();
        h.write_usize(chunk.as_ptr() as usize);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    let pid = std::process::id() as i32;
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    store.set(
        &format!("{prefix}/probe/{rank}"),
        format!("{pid} {} {hex}", token.as_ptr() as usize).as_bytes(),
    )?;

    let mut pids = vec![pid; world];
    let mut all_readable = config.same_host_copy;
    for (q, slot) in pids.iter_mut().enumerate() {
        if q == rank || !all_readable {
            continue;
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        let text =
            String::from_utf8_lossy(&store.get_timeout(&format!("{prefix}/probe/{q}"), remaining)?)
                .into_owned();
        let mut fields = text.split(' ');
        let parsed = (|| {
            Some((
                fields.next()?.parse::<i32>().ok()?,
                fields.next()?.parse::<usize>().ok()?,
                fields.next()?.to_string(),
            ))
        })();
        let Some((their_pid, addr, their_hex)) = parsed else {
            all_readable = false;
            continue;
        };
        let mut seen = [0u8; 32];
        let readable = read_remote(their_pid, addr, &mut seen).is_ok()
            && seen.iter().map(|b| format!("{b:02x}")).collect::<String>() == their_hex;
        *slot = their_pid;
        all_readable &= readable;
    }
    store.set(
        &format!("{prefix}/ok/{rank}"),
        if all_readable { b"1" } else { b"0" },
    )?;
    // The token must stay readable until every rank has finished probing it, which is when
    // every rank has published its verdict.
    let mut everyone = all_readable;
    for q in 0..world {
        let remaining = deadline.saturating_duration_since(Instant::now());
        everyone &= store.get_timeout(&format!("{prefix}/ok/{q}"), remaining)? == b"1";
    }
    std::hint::black_box(&token);
    Ok(everyone.then_some(pids))
}

/// Copies `local.len()` bytes from address `addr` of process `pid` into `local`.
fn read_remote(pid: i32, addr: usize, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let rest = &mut local[done..];
        let local_iov = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        let remote_iov = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `local_iov` describes `rest`, a live, exclusively borrowed buffer, and the
        // kernel writes at most `rest.len()` bytes into it. `remote_iov` names memory of another
        // process; the kernel checks it (EFAULT) and never touches this process's memory
        // through it.
        let n = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the remote range ended early",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Copies `local` to address `addr` of process `pid`.
fn write_remote(pid: i32, addr: usize, local: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let rest = &local[done..];
        let local_iov = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        let remote_iov = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `local_iov` describes `rest`, a live slice that the kernel only reads (the
        // pointer is `*mut` because `iovec` is shared with reads). `remote_iov` names memory of
        // another process, checked by the kernel; nothing in this process is written.
        let n = unsafe { libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the remote range ended early",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Runs the collective `ctx` on `main` with direct copies between the ranks `pids`.
pub(crate) fn run(
    links: &mut [Option<Link>],
    ctx: &Ctx<'_>,
    pids: &[i32],
    main: &mut [u8],
    scratch: &mut AlignedBuf,
    chunk_bytes: usize,
) -> Result<()> {
    let (rank, world, desc) = (ctx.rank, pids.len(), ctx.desc);
    let dtype = desc
        .dtype
        .ok_or_else(|| internal(ctx, "same-host copy of a barrier"))?;
    let elem = dtype.size_in_bytes();
    let n = desc.numel as usize;

    // Phase 0: every rank learns where the others' buffers are.
    let mut table = vec![0u8; world * 16];
    table[rank * 16..rank * 16 + 8].copy_from_slice(&(main.as_ptr() as usize as u64).to_le_bytes());
    table[rank * 16 + 8..rank * 16 + 16].copy_from_slice(&(main.len() as u64).to_le_bytes());
    transport::execute(
        links,
        ctx,
        &same_host_phase(rank, world, 16, 0),
        &mut table,
        &mut [],
    )?;
    let mut addrs = Vec::with_capacity(world);
    for q in 0..world {
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&table[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (addr, len) = (word(q * 16), word(q * 16 + 8));
        if len != main.len() as u64 {
            return Err(protocol(
                ctx,
                q,
                format!("its buffer has {len} bytes, this rank's {}", main.len()),
            ));
        }
        addrs.push(
            usize::try_from(addr).map_err(|_| protocol(ctx, q, "buffer address out of range"))?,
        );
    }
    // A failed read usually means the peer failed or died; its abort frame or hang-up, already
    // waiting on the connections, then names the root cause better than the read does.
    let remote_failed = std::cell::Cell::new(false);
    let read = |q: usize, range: Range<usize>, dest: &mut [u8]| {
        read_remote(pids[q], addrs[q] + range.start, dest).map_err(|e| {
            remote_failed.set(true);
            remote_error(ctx, q, pids[q], e)
        })
    };

    let write = |q: usize, at: usize, src: &[u8]| {
        write_remote(pids[q], addrs[q] + at, src).map_err(|e| {
            remote_failed.set(true);
            remote_error(ctx, q, pids[q], e)
        })
    };

    let mut copy = || -> Result<()> {
        match desc.kind {
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter => {
                // All-reduce: the ring's balanced segments; reduce-scatter: output-sized blocks.
                let own = match desc.kind {
                    CollectiveKind::AllReduce => {
                        (rank * n / world) * elem..((rank + 1) * n / world) * elem
                    }
                    _ => rank * n * elem..(rank + 1) * n * elem,
                };
                let chunk = chunk_bytes.max(elem) / elem * elem;
                scratch.resize(world * chunk);
                let op = desc
                    .op
                    .ok_or_else(|| internal(ctx, "reduction without an op"))?;
                let mut at = own.start;
                while at < own.end {
                    let end = (at + chunk).min(own.end);
                    let len = end - at;
                    let slots = scratch.bytes_mut();
                    for q in (0..world).filter(|&q| q != rank) {
                        read(q, at..end, &mut slots[q * chunk..q * chunk + len])?;
                    }
                    // This rank's own contribution is read in place (the `None`).
                    let sources: Vec<Option<&[u8]>> = (0..world)
                        .map(|q| (q != rank).then(|| &slots[q * chunk..q * chunk + len]))
                        .collect();
                    reduce::reduce_in_place(dtype, op, &sources, &mut main[at..end])
                        .map_err(|e| internal(ctx, e))?;
                    if desc.kind == CollectiveKind::AllReduce {
                        // Push the finished chunk, still in cache, into every peer's copy of
                        // this segment. Only this rank ever reads that part of a peer's buffer,
                        // and it has just done so, so the write cannot race a reader.
                        for q in (0..world).filter(|&q| q != rank) {
                            write(q, at, &main[at..end])?;
                        }
                    }
                    at = end;
                }
            }
            CollectiveKind::AllGather => {
                for q in (0..world).filter(|&q| q != rank) {
                    let range = q * n * elem..(q + 1) * n * elem;
                    read(q, range.clone(), &mut main[range])?;
                }
            }
            CollectiveKind::Broadcast => {
                let root = desc.root.unwrap_or(0) as usize;
                if rank != root {
                    let len = main.len();
                    read(root, 0..len, main)?;
                }
            }
            CollectiveKind::Barrier => return Err(internal(ctx, "same-host copy of a barrier")),
        }
        Ok(())
    };
    match copy() {
        Ok(()) => {}
        Err(err) if remote_failed.get() => return Err(explain(links, ctx, err)),
        Err(err) => return Err(err),
    };
    // Phase 1: nobody returns (and reuses or frees its buffer) while another rank may still
    // read from it or write into it.
    transport::execute(
        links,
        ctx,
        &same_host_phase(rank, world, 0, 1),
        &mut [],
        &mut [],
    )
}

/// The best explanation of a failed read: an abort report or hang-up found on the
/// connections, else `err` itself.
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

fn internal(ctx: &Ctx<'_>, what: impl Into<String>) -> DistError {
    DistError::Io {
        context: format!("rank {}: {} (collective #{})", ctx.rank, ctx.desc, ctx.seq),
        message: format!("internal error: {}", what.into()),
    }
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

fn remote_error(ctx: &Ctx<'_>, peer: usize, pid: i32, err: io::Error) -> DistError {
    if err.raw_os_error() == Some(libc::ESRCH) {
        DistError::PeerLost {
            rank: ctx.rank,
            peers: vec![peer],
            collective: ctx.desc.to_string(),
            seq: ctx.seq,
            cause: format!("rank {peer}'s process (pid {pid}) no longer exists"),
        }
    } else {
        protocol(
            ctx,
            peer,
            format!("reading its buffer (pid {pid}) failed: {err}"),
        )
    }
}
