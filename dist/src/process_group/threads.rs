//! The threads backend: all ranks are threads of one process and exchange data through shared
//! memory. It exists for tests (of this crate and of DDP above it): fast, deterministic, no
//! sockets, yet with the same asynchronous contract, sequence numbers, mismatch detection and
//! failure reporting as the TCP backend.
//!
//! Each collective is a rendezvous on a shared `Board`: every rank posts a snapshot of its
//! contribution under the collective's sequence number, waits until all ranks have posted, and
//! computes its own result from all contributions in rank order — the same inputs in the same
//! order on every rank, so every rank gets bit-identical results. A rank that fails (a timeout,
//! a mismatch) marks the board broken so the others fail at once naming it; a rank whose handle
//! is dropped is marked as having left, and a collective that still needs it fails naming it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tandem_core::{Stream, Tensor};

use super::board::Board;
use super::host::{self, snapshot, Target};
use super::progress::{self, Progress};
use super::reduce::AlignedBuf;
use super::{
    describe_all_gather, describe_all_reduce, describe_barrier, describe_broadcast,
    describe_reduce_scatter, require_cpu, tensor_error, CollectiveDesc, CollectiveKind, CommQueue,
    GroupConfig, ProcessGroup, ReduceOp, Work,
};
use crate::{DistError, Result};

/// One rank of a group whose ranks are threads of this process. Create a whole group with
/// [`ThreadProcessGroup::new_group`] and hand one handle to each thread.
pub struct ThreadProcessGroup {
    rank: usize,
    board: Arc<Board<Arc<AlignedBuf>>>,
    queue: CommQueue,
    completed: Arc<AtomicU64>,
    /// Every rank's progress, for the diagnosis of a timed-out collective.
    everyone: Arc<Vec<Arc<Progress>>>,
}

impl fmt::Debug for ThreadProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ThreadProcessGroup(rank {} of {})",
            self.rank,
            self.board.world()
        )
    }
}

impl ThreadProcessGroup {
    /// A group of `world_size` ranks with the default configuration; element `k` is rank `k`.
    pub fn new_group(world_size: usize) -> Result<Vec<ThreadProcessGroup>> {
        Self::new_group_with(world_size, &GroupConfig::default())
    }

    /// A group of `world_size` ranks; only `config.timeout` applies to this backend.
    pub fn new_group_with(
        world_size: usize,
        config: &GroupConfig,
    ) -> Result<Vec<ThreadProcessGroup>> {
        if world_size == 0 {
            return Err(DistError::config(
                0,
                "ThreadProcessGroup: a group needs at least one rank",
            ));
        }
        let board = Arc::new(Board::new("ThreadProcessGroup", world_size, config.timeout));
        let queues = (0..world_size)
            .map(|rank| CommQueue::new("threads", rank))
            .collect::<Result<Vec<_>>>()?;
        let everyone: Arc<Vec<Arc<Progress>>> =
            Arc::new(queues.iter().map(|q| q.progress().clone()).collect());
        Ok(queues
            .into_iter()
            .enumerate()
            .map(|(rank, queue)| ThreadProcessGroup {
                rank,
                board: board.clone(),
                queue,
                completed: Arc::new(AtomicU64::new(0)),
                everyone: everyone.clone(),
            })
            .collect())
    }

    /// Issues a collective: `contribute` (on the comm thread) returns this rank's snapshot, and
    /// the result for `target` is computed from every rank's snapshot, in rank order.
    fn issue(
        &self,
        desc: CollectiveDesc,
        contribute: impl FnOnce() -> tandem_core::Result<AlignedBuf> + Send + 'static,
        target: Target,
    ) -> Work {
        let (rank, board, completed) = (self.rank, self.board.clone(), self.completed.clone());
        let everyone = self.everyone.clone();
        self.queue.issue(desc, move |seq| {
            let mut result = contribute()
                .map_err(|e| tensor_error(rank, &desc, e))
                .and_then(|data| board.exchange(rank, seq, &desc, Arc::new(data)))
                .and_then(|all| {
                    let bytes: Vec<&[u8]> = all.iter().map(|b| b.bytes()).collect();
                    host::apply(rank, &desc, &target, &bytes)
                });
            if let Err(DistError::Timeout { diagnosis, .. }) = &mut result {
                // Every rank's position is in this process: no rank can fail to report.
                let positions: Vec<_> = everyone
                    .iter()
                    .enumerate()
                    .map(|(q, p)| (q, p.position()))
                    .collect();
                *diagnosis = Some(progress::diagnose(&positions));
            }
            match &result {
                Ok(()) => completed.store(seq, Ordering::SeqCst),
                Err(err) => board.fail(rank, err),
            }
            result
        })
    }
}

impl ProcessGroup for ThreadProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.board.world()
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn comm_stream(&self) -> &Stream {
        self.queue.stream()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_all_reduce(self.rank, tensor, op)?;
        require_cpu(self.rank, &desc, &[("tensor", tensor)])?;
        let t = tensor.clone();
        Ok(self.issue(
            desc,
            move || snapshot(&t),
            Target::AllReduce(tensor.clone()),
        ))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let desc = describe_broadcast(self.rank, self.board.world(), tensor, root)?;
        require_cpu(self.rank, &desc, &[("tensor", tensor)])?;
        let (t, rank) = (tensor.clone(), self.rank);
        let contribute = move || {
            if rank == root {
                snapshot(&t)
            } else {
                Ok(AlignedBuf::default())
            }
        };
        let target = Target::Broadcast {
            tensor: tensor.clone(),
            root,
        };
        Ok(self.issue(desc, contribute, target))
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        let desc = describe_all_gather(self.rank, self.board.world(), input, output)?;
        require_cpu(self.rank, &desc, &[("input", input), ("output", output)])?;
        let input = input.clone();
        Ok(self.issue(
            desc,
            move || snapshot(&input),
            Target::AllGather(output.clone()),
        ))
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_reduce_scatter(self.rank, self.board.world(), input, output, op)?;
        require_cpu(self.rank, &desc, &[("input", input), ("output", output)])?;
        let input = input.clone();
        Ok(self.issue(
            desc,
            move || snapshot(&input),
            Target::ReduceScatter(output.clone()),
        ))
    }

    fn barrier(&self) -> Result<Work> {
        let desc = describe_barrier();
        debug_assert_eq!(desc.kind, CollectiveKind::Barrier);
        Ok(self.issue(desc, || Ok(AlignedBuf::default()), Target::Barrier))
    }
}

impl Drop for ThreadProcessGroup {
    fn drop(&mut self) {
        self.queue.drain();
        self.board
            .leave(self.rank, self.completed.load(Ordering::SeqCst));
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testing::{conformance, on_each_rank};
    use tandem_core::{DType, Device};

    #[test]
    fn every_collective_matches_the_serial_reference_on_1_2_3_4_and_8_ranks() {
        for world in [1, 2, 3, 4, 8] {
            let results = on_each_rank(ThreadProcessGroup::new_group(world).unwrap(), |pg| {
                conformance(&pg, 7 + world as u64, &[0, 1, 5, 1001, 20_003])
            });
            for r in results {
                r.unwrap();
            }
        }
    }

    #[test]
    fn ranks_issuing_different_collectives_get_an_error_naming_both() {
        let errors = on_each_rank(ThreadProcessGroup::new_group(2).unwrap(), |pg| {
            let t = Tensor::zeros(&[100], DType::F32, Device::Cpu).unwrap();
            pg.barrier().unwrap().wait().unwrap();
            let work = if pg.rank() == 0 {
                pg.broadcast(&t, 0).unwrap()
            } else {
                pg.all_reduce(&t, ReduceOp::Sum).unwrap()
            };
            work.wait().unwrap_err().to_string()
        });
        for err in &errors {
            assert!(
                err.contains("collective #2")
                    && err.contains("broadcast(f32, 100, root 0)")
                    && err.contains("all_reduce(f32, 100, sum)"),
                "{err}"
            );
            assert!(err.contains("rank 0") && err.contains("rank 1"), "{err}");
        }
    }

    #[test]
    fn a_dropped_rank_fails_the_others_naming_it_instead_of_hanging() {
        let mut groups = ThreadProcessGroup::new_group(3).unwrap();
        drop(groups.pop());
        let started = Instant::now();
        let errors = on_each_rank(groups, |pg| {
            let t = Tensor::ones(&[8], DType::F32, Device::Cpu).unwrap();
            pg.all_reduce(&t, ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap_err()
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        for err in errors {
            assert_eq!(err.blamed_ranks(), vec![2], "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains("rank 2 left the group") && msg.contains("collective #1"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_missing_rank_times_out_naming_it_and_breaks_the_group() {
        let config = GroupConfig {
            timeout: Duration::from_millis(200),
            ..GroupConfig::default()
        };
        let groups = ThreadProcessGroup::new_group_with(2, &config).unwrap();
        let (first, _second) = (&groups[0], &groups[1]);
        let err = first.barrier().unwrap().wait().unwrap_err();
        assert!(
            matches!(&err, DistError::Timeout { waiting_for, seq: 1, .. } if waiting_for == &[1]),
            "{err}"
        );
        let later = first.barrier().unwrap().wait().unwrap_err().to_string();
        assert!(
            later.contains("broken") && later.contains("collective #2"),
            "{later}"
        );
    }

    /// Three ranks all-reduce buckets 0, 1, 2 (labelled as DDP does); `straggler` (rank 2)
    /// issues only the buckets in `its_buckets`, after `delay`, and keeps its handle past the
    /// others' timeout. Returns the errors of ranks 0 and 1.
    fn hang_with(its_buckets: &'static [usize], delay: Duration) -> Vec<String> {
        let config = GroupConfig {
            timeout: Duration::from_millis(300),
            ..GroupConfig::default()
        };
        let groups = ThreadProcessGroup::new_group_with(3, &config).unwrap();
        let results = on_each_rank(groups, move |pg| {
            let buckets: &[usize] = if pg.rank() == 2 {
                its_buckets
            } else {
                &[0, 1, 2]
            };
            let mut outcome = Ok(());
            for &b in buckets {
                if pg.rank() == 2 && b == 2 {
                    std::thread::sleep(delay);
                }
                let t = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
                let label = super::super::CollectiveLabel::Bucket(b);
                outcome =
                    super::super::with_collective_label(label, || pg.all_reduce(&t, ReduceOp::Sum))
                        .and_then(|w| w.wait());
                if outcome.is_err() {
                    break;
                }
            }
            if pg.rank() == 2 {
                // Alive but issuing nothing while the others time out.
                std::thread::sleep(Duration::from_millis(1500));
            }
            outcome.map_err(|e| e.to_string())
        });
        results
            .into_iter()
            .take(2)
            .map(|r| r.unwrap_err())
            .collect()
    }

    #[test]
    fn a_rank_that_skips_a_collective_is_named_with_its_position() {
        for err in hang_with(&[0, 2], Duration::ZERO) {
            assert!(
                err.contains(
                    "rank 2 is at all_reduce #2 (bucket 2; f32 × 4), completed, and has issued \
                     nothing since, while ranks 0, 1 wait at all_reduce #3 (bucket 2; f32 × 4)"
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn a_rank_that_stops_past_the_timeout_is_named() {
        for err in hang_with(&[0, 1, 2], Duration::from_millis(1200)) {
            assert!(
                err.contains(
                    "rank 2 is at all_reduce #2 (bucket 1; f32 × 4), completed, and has issued \
                     nothing since, while ranks 0, 1 wait at all_reduce #3 (bucket 2; f32 × 4)"
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn collectives_are_asynchronous_and_complete_when_every_rank_has_issued() {
        let groups = ThreadProcessGroup::new_group(2).unwrap();
        let a = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
        let work = groups[0].all_reduce(&a, ReduceOp::Sum).unwrap();
        assert!(
            !work.wait_timeout(Duration::from_millis(50)).unwrap(),
            "rank 1 has not issued yet"
        );
        assert!(!work.is_completed());
        groups[1]
            .all_reduce(&b, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        work.wait().unwrap();
        assert!(work.event().is_complete());
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![2.0; 4]);
        assert_eq!(work.sequence_number(), 1);
    }

    #[test]
    fn dropping_the_last_handle_from_its_own_comm_stream_does_not_deadlock() {
        let pg = std::sync::Arc::new(ThreadProcessGroup::new_group(1).unwrap().remove(0));
        let t = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
        let work = pg.all_reduce(&t, ReduceOp::Sum).unwrap();
        let stream = pg.comm_stream().clone();
        let done = tandem_core::Event::pending();
        let finished = done.clone();
        stream
            .enqueue(move || {
                drop(pg);
                finished.complete();
            })
            .unwrap();
        assert!(
            done.wait_timeout(Duration::from_secs(10)).unwrap(),
            "drop on the comm stream hung"
        );
        work.wait().unwrap();
    }
}
