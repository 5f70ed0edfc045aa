//! Issuing one NCCL collective: numbering it, ordering the comm stream after the compute
//! stream, optionally checking it against the next rank's, having NCCL enqueue it, and
//! handing back its [`Work`] while the watchdog keeps it among the collectives in flight.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::{Event, Tensor};

use super::comm::CommFailure;
use super::ffi::{Api, NcclStatus, RawComm, RawStream};
use super::{record, Issuing, NcclProcessGroup, Pending};
use crate::process_group::work::DeviceWork;
use crate::process_group::{CollectiveDesc, CollectiveKind, Work};
use crate::{DistError, Result};

impl NcclProcessGroup {
    /// Issues one collective: orders the comm stream after the compute stream, has NCCL
    /// enqueue it (`call`, skipped for an empty collective), records its end, and hands back
    /// the work. `tensors` are held by the work and marked as used on the comm stream; `uses`
    /// says which device addresses NCCL reads and writes (for the stream sanitizer).
    pub(super) fn issue(
        &self,
        desc: CollectiveDesc,
        tensors: Vec<Tensor>,
        uses: &[(u64, Use)],
        blocks_host: bool,
        call: impl FnOnce(&'static Api, RawComm, RawStream) -> NcclStatus,
    ) -> Result<Work> {
        let s = &*self.shared;
        let mut next = s.next_seq.lock();
        let seq = *next;
        if let Some(cause) = s.make_room() {
            return Err(s.group_broken(&desc, seq, cause));
        }
        *s.issuing.lock() = Some(Issuing {
            seq,
            desc,
            since: Instant::now(),
        });
        let issued = self.issue_locked(seq, desc, &tensors, uses, call);
        *s.issuing.lock() = None;
        let (start, end) = match issued {
            Ok(events) => events,
            Err(Failure::BeforeIssue(e)) => return Err(e),
            Err(Failure::Fatal(e)) => {
                s.fail(e.clone());
                return Err(s.broken().map_or(e, |first| first));
            }
        };
        s.monitor.record_issue(seq, &desc);
        *next = seq + 1;
        drop(next);
        let work = Work::on_device(
            seq,
            desc,
            end.clone(),
            DeviceWork {
                rank: s.rank,
                compute: s.compute.clone(),
                start: start.clone(),
                keep_alive: Mutex::new(tensors),
                blocks_host,
            },
        );
        let mut pending = s.pending.lock();
        match s.broken() {
            // The watchdog failed the group while this collective was being issued, after it
            // settled the collectives it knew of: settle this one too.
            Some(cause) => work.settle(Err(s.group_broken(&desc, seq, cause))),
            None => pending.push_back(Pending {
                work: work.clone(),
                seq,
                desc,
                start,
                end,
                started_at: None,
            }),
        }
        Ok(work)
    }

    /// The steps of [`NcclProcessGroup::issue`] that may fail; returns the start and end events.
    fn issue_locked(
        &self,
        seq: u64,
        desc: CollectiveDesc,
        tensors: &[Tensor],
        uses: &[(u64, Use)],
        call: impl FnOnce(&'static Api, RawComm, RawStream) -> NcclStatus,
    ) -> std::result::Result<(Event, Event), Failure> {
        let s = &*self.shared;
        let label = format!("{desc} (collective #{seq})");
        let device_err = |what: &str, e: tandem_core::Error| {
            DistError::tensor(
                s.rank,
                format!("{} (collective #{seq}): {what}", desc.kind.name()),
                e,
            )
        };
        if s.config.check_every_collective {
            self.check_with_neighbour(seq, &desc)?;
        }
        // Nothing has been issued yet: a failure here leaves the group intact.
        s.cuda
            .bind("NCCL collective")
            .map_err(|e| Failure::BeforeIssue(device_err("binding the device", e)))?;
        let ready = s
            .compute
            .record_event()
            .map_err(|e| Failure::BeforeIssue(device_err("recording the compute stream", e)))?;
        // From here on the comm stream has work queued for this collective, so any failure
        // breaks the group (the other ranks expect this collective).
        let fatal = |what: &str, e: tandem_core::Error| Failure::Fatal(device_err(what, e));
        s.comm_stream
            .wait_event(&ready)
            .map_err(|e| fatal("ordering the comm stream after the compute stream", e))?;
        let start = s
            .comm_stream
            .record_event()
            .map_err(|e| fatal("recording the start", e))?;
        // Marked before the call, so that a tensor freed after NCCL refused the call (the
        // sanitizer has seen its buffers declared on the comm stream by then) still waits for
        // the comm stream: a free waits for the comm stream's work queued by then.
        for t in tensors {
            t.record_stream(&s.comm_stream)
                .map_err(|e| fatal("marking a tensor as used by the comm stream", e))?;
        }
        if desc.numel > 0 || desc.kind == CollectiveKind::Barrier {
            let timeout = s.group.timeout;
            let since = Instant::now();
            let interrupt = || {
                s.broken().or_else(|| {
                    (since.elapsed() > timeout).then(|| DistError::Timeout {
                        rank: s.rank,
                        collective: desc.to_string(),
                        seq,
                        timeout,
                        waiting_for: Vec::new(),
                        diagnosis: None,
                    })
                })
            };
            // The collective's buffers, declared once the comm stream is ordered after compute.
            if let Some(cuda) = s.comm_stream.cuda_stream() {
                sanitizer::access(s.comm_stream.device(), cuda, nccl_name(desc.kind), uses)
                    .map_err(|e| fatal("the stream sanitizer", e))?;
            }
            let raw_stream = s.raw_stream;
            s.comm
                .enqueue(&label, &interrupt, |api, comm| call(api, comm, raw_stream))
                .map_err(|failure| {
                    Failure::Fatal(match failure {
                        CommFailure::Interrupted(e) => e,
                        CommFailure::Nccl(detail) => s.explain_nccl_error(DistError::Nccl {
                            rank: s.rank,
                            op: label.clone(),
                            detail,
                        }),
                        CommFailure::Gone => s.broken().unwrap_or_else(|| DistError::Nccl {
                            rank: s.rank,
                            op: label.clone(),
                            detail: "the communicator was aborted".into(),
                        }),
                    })
                })?;
        }
        let end = s
            .comm_stream
            .record_event()
            .map_err(|e| fatal("recording the end", e))?;
        Ok((start, end))
    }

    /// `check_every_collective`: publishes this collective's descriptor and compares it with
    /// the next rank's for the same sequence number (the reader deletes the key it read).
    fn check_with_neighbour(
        &self,
        seq: u64,
        desc: &CollectiveDesc,
    ) -> std::result::Result<(), Failure> {
        let s = &*self.shared;
        if s.world < 2 {
            return Ok(());
        }
        let peer = (s.rank + 1) % s.world;
        let mine = format!("{}/check/{seq}/{}", s.prefix, s.rank);
        let theirs = format!("{}/check/{seq}/{peer}", s.prefix);
        s.store
            .set(&mine, &record::encode_desc(desc))
            .map_err(Failure::BeforeIssue)?;
        let deadline = Instant::now() + s.group.timeout;
        let bytes = loop {
            match s.store.get_timeout(&theirs, Duration::from_millis(100)) {
                Ok(bytes) => break bytes,
                Err(DistError::StoreTimeout { .. }) => {
                    if let Some(cause) = s.broken() {
                        return Err(Failure::BeforeIssue(s.group_broken(desc, seq, cause)));
                    }
                    if Instant::now() > deadline {
                        return Err(Failure::Fatal(DistError::Timeout {
                            rank: s.rank,
                            collective: desc.to_string(),
                            seq,
                            timeout: s.group.timeout,
                            waiting_for: vec![peer],
                            diagnosis: None,
                        }));
                    }
                }
                Err(e) => return Err(Failure::BeforeIssue(e)),
            }
        };
        let _ = s.store.delete(&theirs);
        let theirs = record::decode_desc(&bytes).map_err(|problem| {
            Failure::Fatal(DistError::Protocol {
                rank: s.rank,
                peer,
                collective: desc.to_string(),
                seq,
                problem: format!("its descriptor in the store is malformed: {problem}"),
            })
        })?;
        if theirs != *desc {
            return Err(Failure::Fatal(DistError::Mismatch {
                rank: s.rank,
                peer,
                seq,
                their_seq: seq,
                ours: desc.to_string(),
                theirs: theirs.to_string(),
            }));
        }
        Ok(())
    }
}

/// How issuing a collective failed.
enum Failure {
    /// Before anything was queued: the group is intact.
    BeforeIssue(DistError),
    /// After work was queued, or a mismatch: the group must fail.
    Fatal(DistError),
}

impl From<DistError> for Failure {
    fn from(e: DistError) -> Self {
        Failure::Fatal(e)
    }
}

/// The NCCL function a collective calls, as the stream sanitizer names it.
fn nccl_name(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::AllReduce | CollectiveKind::Barrier => "ncclAllReduce",
        CollectiveKind::Broadcast => "ncclBroadcast",
        CollectiveKind::AllGather => "ncclAllGather",
        CollectiveKind::ReduceScatter => "ncclReduceScatter",
    }
}
