//! The TCP backend: ranks in separate processes, on one host or many, connected in a full
//! mesh of TCP connections.
//!
//! Ranks meet through the rendezvous store: each binds a listening socket on the interface it
//! uses to reach the store, publishes `ip:port` under `tandem/<group>/addr/<rank>`, connects to
//! every lower rank and accepts every higher one; a handshake on each new connection proves the
//! job secret both ways and checks that both ends belong to the same group and world size
//! (`handshake`); then the ranks find out whether they all share this host (the same-host
//! fast path through shared-memory segments). Collectives run on the group's comm stream, in
//! place on the tensors: by the schedules of the `plan` module (direct exchange for small
//! messages, pipelined ring or chain for large ones) executed by the `transport` event loop,
//! or, for large messages between ranks of one host, by the `same_host` module. A collective
//! that fails leaves a report for the launcher (`failure_report`) naming the ranks it blames.
//!
//! Dropping a group waits for the collectives already issued, then says goodbye to every peer,
//! so that a rank still waiting for this one learns that it left (and after how many
//! collectives) instead of waiting for the timeout.

#[cfg(test)]
mod attack_tests;
mod frame;
mod handshake;
mod link;
mod mesh;
mod plan;
mod same_host;
mod segment;
mod transport;

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tandem_core::{Stream, Tensor};

use self::frame::Algorithm;
use self::link::Link;
use self::mesh::connect_mesh;
use self::plan::choose_algorithm;
use self::transport::Ctx;
use super::progress::{self, Progress};
use super::reduce::{with_tensor_bytes, with_tensor_bytes_mut, AlignedBuf};
use super::{
    describe_all_gather, describe_all_reduce, describe_barrier, describe_broadcast,
    describe_reduce_scatter, require_cpu, tensor_error, CollectiveDesc, CommQueue, GroupConfig,
    ProcessGroup, ReduceOp, Work,
};
use crate::failure_report;
use crate::process_group::MAX_WORLD_SIZE;
use crate::store::{StoreServer, TcpStore};
use crate::{DistError, Result};

/// What the comm thread owns: the connections and reusable buffers.
struct TcpState {
    links: Vec<Option<Link>>,
    /// The shared-memory channels and segments, when every rank runs on this host.
    same_host: Option<same_host::SameHost>,
    scratch: AlignedBuf,
    staging: AlignedBuf,
    completed: u64,
    /// The last [`HISTORY`] collectives, oldest first.
    history: Vec<(u64, CollectiveDesc)>,
}

/// How many past collectives a rank remembers to explain late mismatches.
const HISTORY: usize = 16;

/// Everything a collective job needs, shared between the group handle and its comm thread.
struct Shared {
    rank: usize,
    world: usize,
    config: GroupConfig,
    state: Mutex<TcpState>,
    /// Where a failure is reported for the launcher (see `failure_report`).
    store: Arc<TcpStore>,
}

/// A process group whose ranks are processes talking over TCP. See the module docs.
pub struct TcpProcessGroup {
    shared: Arc<Shared>,
    queue: CommQueue,
    store: Arc<TcpStore>,
    _server: Option<StoreServer>,
}

impl fmt::Debug for TcpProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TcpProcessGroup(rank {} of {}, group {:?})",
            self.shared.rank, self.shared.world, self.shared.config.name
        )
    }
}

impl TcpProcessGroup {
    /// Joins the group `config.name` as `rank` of `world_size`, meeting the other ranks
    /// through `store`. Blocks until every rank has connected (at most
    /// `config.connect_timeout`).
    pub fn connect(
        store: Arc<TcpStore>,
        rank: usize,
        world_size: usize,
        config: GroupConfig,
    ) -> Result<Self> {
        Self::connect_with_server(store, rank, world_size, config, None)
    }

    /// Like [`TcpProcessGroup::connect`], keeping `server` (the store this rank serves) alive
    /// as long as the group.
    pub(crate) fn connect_with_server(
        store: Arc<TcpStore>,
        rank: usize,
        world_size: usize,
        config: GroupConfig,
        server: Option<StoreServer>,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size || world_size > MAX_WORLD_SIZE {
            return Err(DistError::config(
                rank,
                format!(
                    "TcpProcessGroup: rank {rank} is not in a group of {world_size} (a group has \
                     1 to {MAX_WORLD_SIZE} ranks)"
                ),
            ));
        }
        let started = Instant::now();
        let setup = connect_mesh(&store, rank, world_size, &config).and_then(|links| {
            let same_host = same_host::agree(&store, rank, world_size, &config, started)?;
            Ok((links, same_host))
        });
        // A rank that timed out waiting for others tells the launcher whom it waited for.
        let (links, same_host) =
            setup.inspect_err(|err| failure_report::post(&store, rank, err))?;
        let queue = CommQueue::new("tcp", rank)?;
        let state = TcpState {
            links,
            same_host,
            scratch: AlignedBuf::default(),
            staging: AlignedBuf::default(),
            completed: 0,
            history: Vec::new(),
        };
        Ok(TcpProcessGroup {
            shared: Arc::new(Shared {
                rank,
                world: world_size,
                config,
                state: Mutex::new(state),
                store: store.clone(),
            }),
            queue,
            store,
            _server: server,
        })
    }

    /// The rendezvous store the group met through (usable for the application's own keys).
    pub fn store(&self) -> &Arc<TcpStore> {
        &self.store
    }

    /// The group's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.shared.config
    }

    fn issue(
        &self,
        desc: CollectiveDesc,
        body: impl FnOnce(&Shared, &mut TcpState, &Ctx<'_>) -> Result<()> + Send + 'static,
    ) -> Work {
        let shared = self.shared.clone();
        let progress = self.queue.progress().clone();
        self.queue.issue(desc, move |seq| {
            let mut state = shared.state.lock();
            let history = std::mem::take(&mut state.history);
            // The first failure only: the group refuses later collectives anyway.
            let first_failure = state.completed + 1 == seq;
            // A failure is diagnosed and reported to the store before the peers are told: a
            // peer that learns of it may exit at once, and its launcher then stops this rank,
            // so a report left after telling the peers could be lost.
            let reported = Cell::new(false);
            let report = |err: &mut DistError| {
                if !reported.replace(true) {
                    diagnose(&shared, &progress, seq, err);
                    if first_failure {
                        failure_report::post(&shared.store, shared.rank, err);
                    }
                }
            };
            let ctx = Ctx {
                rank: shared.rank,
                seq,
                desc: &desc,
                timeout: shared.config.timeout,
                deadline: deadline_after(shared.config.timeout),
                history: &history,
                report: &report,
            };
            // A panic (a bug) must still tell the peers, or they would wait for the timeout.
            let mut result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                body(&shared, &mut state, &ctx)
            }))
            .unwrap_or_else(|_| {
                Err(DistError::internal(
                    format!("rank {}: {desc} (collective #{seq})", shared.rank),
                    "the collective panicked",
                ))
            });
            state.history = history;
            if state.history.len() == HISTORY {
                state.history.remove(0);
            }
            state.history.push((seq, desc));
            match &mut result {
                Ok(()) => state.completed = seq,
                // Failures inside the transport have been reported and told the peers already;
                // this covers the rest (a tensor that could not be locked, …). Telling twice is
                // harmless.
                Err(err) => {
                    report(err);
                    link::abort_links(&mut state.links, seq, err, &[]);
                }
            }
            result
        })
    }
}

/// On a timeout, gathers the other ranks' positions through the store (a bounded wait) and
/// adds the diagnosis to `err`; on any other failure, only leaves this rank's position there
/// for the others' diagnoses.
fn diagnose(shared: &Shared, progress: &Progress, seq: u64, err: &mut DistError) {
    let own = progress.position();
    let group = &shared.config.name;
    match err {
        DistError::Timeout {
            waiting_for,
            diagnosis,
            ..
        } => {
            let positions = progress::gather(
                &shared.store,
                group,
                (shared.rank, shared.world),
                own,
                (seq, waiting_for),
                progress::gather_bound(shared.config.timeout),
            );
            *diagnosis = Some(progress::diagnose(&positions));
        }
        _ => progress::post(&shared.store, group, shared.rank, &own),
    }
}

/// Now plus `timeout`; a timeout too large to add (`Duration::MAX` for "never") means a
/// deadline a century away rather than a panic on the comm thread.
fn deadline_after(timeout: std::time::Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(std::time::Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Runs collective `ctx` on `main` by the algorithm every rank picks for it.
fn run(shared: &Shared, state: &mut TcpState, ctx: &Ctx<'_>, main: &mut [u8]) -> Result<()> {
    let algorithm = choose_algorithm(
        ctx.desc,
        shared.world,
        &shared.config,
        state.same_host.is_some(),
    );
    if let (Algorithm::SameHost, Some(same_host)) = (algorithm, &mut state.same_host) {
        let chunk = shared.config.chunk_bytes;
        return same_host::run(&mut state.links, ctx, same_host, main, chunk);
    }
    let plan = plan::plan(shared.rank, shared.world, ctx.desc, &shared.config);
    state.scratch.resize(plan.scratch_len);
    transport::execute(
        &mut state.links,
        ctx,
        &plan,
        main,
        state.scratch.bytes_mut(),
    )
}

impl ProcessGroup for TcpProcessGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn comm_stream(&self) -> &Stream {
        self.queue.stream()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_all_reduce(self.shared.rank, tensor, op)?;
        require_cpu(self.shared.rank, &desc, &[("tensor", tensor)])?;
        let tensor = tensor.clone();
        Ok(self.issue(desc, move |shared, state, ctx| {
            with_tensor_bytes_mut(&tensor, |main| run(shared, state, ctx, main))
                .map_err(|e| tensor_error(shared.rank, &desc, e))?
        }))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let desc = describe_broadcast(self.shared.rank, self.shared.world, tensor, root)?;
        require_cpu(self.shared.rank, &desc, &[("tensor", tensor)])?;
        let tensor = tensor.clone();
        Ok(self.issue(desc, move |shared, state, ctx| {
            with_tensor_bytes_mut(&tensor, |main| run(shared, state, ctx, main))
                .map_err(|e| tensor_error(shared.rank, &desc, e))?
        }))
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        let desc = describe_all_gather(self.shared.rank, self.shared.world, input, output)?;
        require_cpu(
            self.shared.rank,
            &desc,
            &[("input", input), ("output", output)],
        )?;
        let (input, output) = (input.clone(), output.clone());
        Ok(self.issue(desc, move |shared, state, ctx| {
            let block = desc.total_bytes(1);
            let at = shared.rank * block;
            let terr = |e| tensor_error(shared.rank, &desc, e);
            // Input and output may share storage (input a view of the output's block): copy
            // the input out first rather than hold two locks on one buffer.
            let mut staged = std::mem::take(&mut state.staging);
            with_tensor_bytes(&input, |b| {
                staged.resize(b.len());
                staged.bytes_mut().copy_from_slice(b);
            })
            .map_err(terr)?;
            let result = with_tensor_bytes_mut(&output, |main| {
                main[at..at + block].copy_from_slice(staged.bytes());
                run(shared, state, ctx, main)
            })
            .map_err(terr);
            state.staging = staged;
            result?
        }))
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work> {
        let desc = describe_reduce_scatter(self.shared.rank, self.shared.world, input, output, op)?;
        require_cpu(
            self.shared.rank,
            &desc,
            &[("input", input), ("output", output)],
        )?;
        let (input, output) = (input.clone(), output.clone());
        Ok(self.issue(desc, move |shared, state, ctx| {
            let block = desc.total_bytes(1);
            let at = shared.rank * block;
            let terr = |e| tensor_error(shared.rank, &desc, e);
            // The input must survive, so the collective works on a copy of it.
            let mut work = std::mem::take(&mut state.staging);
            with_tensor_bytes(&input, |b| {
                work.resize(b.len());
                work.bytes_mut().copy_from_slice(b);
            })
            .map_err(terr)?;
            let result = run(shared, state, ctx, work.bytes_mut());
            let result = result.and_then(|()| {
                with_tensor_bytes_mut(&output, |out| {
                    out.copy_from_slice(&work.bytes()[at..at + block])
                })
                .map_err(terr)
            });
            state.staging = work;
            result
        }))
    }

    fn barrier(&self) -> Result<Work> {
        let desc = describe_barrier();
        Ok(self.issue(desc, move |shared, state, ctx| {
            run(shared, state, ctx, &mut [])
        }))
    }
}

impl Drop for TcpProcessGroup {
    fn drop(&mut self) {
        // Collectives already issued still run (each bounded by the timeout); then the peers
        // are told that this rank leaves, so none of them waits for it in vain.
        self.queue.drain();
        let mut state = self.shared.state.lock();
        let completed = state.completed;
        link::say_goodbye(&mut state.links, completed);
    }
}

#[cfg(test)]
mod tests {
    use super::frame::{FrameHeader, HEADER_LEN};
    use super::handshake::{connect_side, Channel, Me};
    use super::*;
    use crate::testing::{conformance, on_each_rank};
    use std::io::Write;
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;
    use tandem_core::{DType, Device};

    /// A whole group of `world` ranks connected over loopback inside this process.
    fn groups(world: usize, config: &GroupConfig) -> Vec<TcpProcessGroup> {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let mut groups: Vec<TcpProcessGroup> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (addr, config) = (addr.clone(), config.clone());
                    s.spawn(move || {
                        let store =
                            Arc::new(TcpStore::connect(&addr, Duration::from_secs(10)).unwrap());
                        TcpProcessGroup::connect(store, rank, world, config).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        groups[0]._server = Some(server);
        groups
    }

    /// Small thresholds, so that modest tensors take the large-message paths in many chunks.
    fn small_chunks(same_host_copy: bool) -> GroupConfig {
        GroupConfig {
            small_message_bytes: 1 << 10,
            chunk_bytes: 4 << 10,
            same_host_copy,
            ..GroupConfig::default()
        }
    }

    #[test]
    fn every_collective_matches_the_serial_reference_with_pipelined_rings() {
        for world in [2, 3, 4] {
            let all = groups(world, &small_chunks(false));
            assert!(all
                .iter()
                .all(|g| g.shared.state.lock().same_host.is_none()));
            for r in on_each_rank(all, |pg| conformance(&pg, 11, &[0, 1, 5, 1001, 20_003])) {
                r.unwrap();
            }
        }
    }

    #[test]
    fn every_collective_matches_the_serial_reference_with_same_host_copies() {
        for world in [2, 3, 4] {
            let all = groups(world, &small_chunks(true));
            let enabled = all
                .iter()
                .all(|g| g.shared.state.lock().same_host.is_some());
            assert!(
                enabled,
                "threads of one process can read each other's memory"
            );
            for r in on_each_rank(all, |pg| conformance(&pg, 13, &[0, 1, 5, 1001, 20_003])) {
                r.unwrap();
            }
        }
    }

    #[test]
    fn every_collective_matches_the_serial_reference_on_8_ranks_with_default_settings() {
        for r in on_each_rank(groups(8, &GroupConfig::default()), |pg| {
            conformance(&pg, 12, &[0, 3, 20_003])
        }) {
            r.unwrap();
        }
    }

    #[test]
    fn ranks_issuing_different_collectives_get_an_error_naming_both() {
        let errors = on_each_rank(groups(2, &GroupConfig::default()), |pg| {
            let t = Tensor::zeros(&[100], DType::F32, Device::Cpu).unwrap();
            let out = Tensor::zeros(&[200], DType::F32, Device::Cpu).unwrap();
            pg.barrier().unwrap().wait().unwrap();
            let work = if pg.rank() == 0 {
                pg.all_reduce(&t, ReduceOp::Sum)
            } else {
                pg.all_gather(&t, &out)
            };
            work.unwrap().wait().unwrap_err().to_string()
        });
        for err in &errors {
            assert!(err.contains("as collective #2"), "{err}");
            assert!(
                err.contains("rank 0 issued all_reduce(f32, 100, sum)")
                    || err.contains("rank 1 issued all_gather"),
                "{err}"
            );
            assert!(
                err.contains("all_reduce(f32, 100, sum)")
                    && err.contains("all_gather(f32, 100 per rank)"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_rank_that_completed_a_mismatched_broadcast_learns_of_it_at_its_next_collective() {
        let errors = on_each_rank(groups(2, &GroupConfig::default()), |pg| {
            let t = Tensor::zeros(&[100], DType::F32, Device::Cpu).unwrap();
            if pg.rank() == 0 {
                // The root of a broadcast only sends, so it completes…
                pg.broadcast(&t, 0).unwrap().wait().unwrap();
                pg.barrier().unwrap().wait().unwrap_err().to_string()
            } else {
                pg.all_reduce(&t, ReduceOp::Sum)
                    .unwrap()
                    .wait()
                    .unwrap_err()
                    .to_string()
            }
        });
        // …and then learns of the mismatch from rank 1's abort or from rank 1's stale frame;
        // either way both sides of collective #1 are named.
        let rank_0_view = "rank 1 issued all_reduce(f32, 100, sum) as collective #1 but rank 0 \
                           issued broadcast(f32, 100, root 0)";
        let rank_1_view = "rank 0 issued broadcast(f32, 100, root 0) as collective #1 but rank 1 \
                           issued all_reduce(f32, 100, sum)";
        assert!(errors[1].contains(rank_1_view), "{}", errors[1]);
        assert!(
            errors[0].contains(rank_0_view) || errors[0].contains(rank_1_view),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn a_rank_that_leaves_is_named_by_the_ranks_still_waiting_for_it() {
        let mut all = groups(3, &GroupConfig::default());
        let leaver = all.pop().unwrap();
        let started = Instant::now();
        let errors = std::thread::scope(|s| {
            s.spawn(move || {
                leaver.barrier().unwrap().wait().unwrap();
                drop(leaver);
            });
            let handles: Vec<_> = all
                .into_iter()
                .map(|pg| {
                    s.spawn(move || {
                        pg.barrier().unwrap().wait().unwrap();
                        let t = Tensor::ones(&[1 << 16], DType::F32, Device::Cpu).unwrap();
                        pg.all_reduce(&t, ReduceOp::Sum)
                            .unwrap()
                            .wait()
                            .unwrap_err()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(started.elapsed() < Duration::from_secs(10));
        for err in errors {
            let msg = err.to_string();
            assert!(
                msg.contains("rank 2 left the group") && msg.contains("collective #2"),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_silent_rank_times_out_naming_it() {
        let config = GroupConfig {
            timeout: Duration::from_millis(300),
            ..GroupConfig::default()
        };
        let all = groups(2, &config);
        let started = Instant::now();
        let err = all[0].barrier().unwrap().wait().unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(
            matches!(&err, DistError::Timeout { waiting_for, seq: 1, .. } if waiting_for == &[1]),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("barrier() (collective #1) timed out"),
            "{err}"
        );
    }

    /// Rank 0 is a real group; rank 1 is this test speaking raw bytes to it.
    fn with_fake_rank_1(garbage: impl FnOnce(&mut TcpStream), check: impl FnOnce(DistError)) {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let config = GroupConfig {
            timeout: Duration::from_secs(10),
            ..GroupConfig::default()
        };
        let real = std::thread::spawn({
            let (addr, config) = (addr.clone(), config.clone());
            move || {
                let store = Arc::new(TcpStore::connect(&addr, Duration::from_secs(10)).unwrap());
                let pg = TcpProcessGroup::connect(store, 0, 2, config).unwrap();
                let t = Tensor::ones(&[100], DType::F32, Device::Cpu).unwrap();
                pg.all_reduce(&t, ReduceOp::Sum)
                    .unwrap()
                    .wait()
                    .unwrap_err()
            }
        });
        let store = TcpStore::connect(&addr, Duration::from_secs(10)).unwrap();
        let rank0: SocketAddr = String::from_utf8(store.get("tandem/default/addr/0").unwrap())
            .unwrap()
            .parse()
            .unwrap();
        // Decline the same-host fast path, so rank 0 talks to us over the socket only.
        store.set("tandem/default/same_host/socket/1", b"").unwrap();
        store
            .set("tandem/default/same_host/reachable/1", b"0")
            .unwrap();
        let mut conn = TcpStream::connect(rank0).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let me = Me {
            rank: 1,
            world: 2,
            name: "default".into(),
            channel: Channel::Link,
            secret: None,
        };
        connect_side(&mut conn, &me, 0, "rank 0", deadline).unwrap();
        garbage(&mut conn);
        let started = Instant::now();
        let err = real.join().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "failed promptly"
        );
        check(err);
    }

    fn all_reduce_header(payload_len: u64) -> [u8; HEADER_LEN] {
        let t = Tensor::ones(&[100], DType::F32, Device::Cpu).unwrap();
        let desc = describe_all_reduce(1, &t, ReduceOp::Sum).unwrap();
        FrameHeader::data(desc, super::frame::Algorithm::Direct, 1, 0, payload_len).encode()
    }

    #[test]
    fn garbage_on_the_wire_is_a_protocol_error_naming_the_sender() {
        with_fake_rank_1(
            |c| c.write_all(&[0xAB; 64]).unwrap(),
            |err| {
                assert!(
                    matches!(
                        err,
                        DistError::Protocol {
                            peer: 1,
                            seq: 1,
                            ..
                        }
                    ),
                    "{err}"
                );
                assert!(err.to_string().contains("bad magic"), "{err}");
            },
        );
    }

    #[test]
    fn an_oversized_frame_is_rejected_before_its_payload_is_read() {
        with_fake_rank_1(
            |c| c.write_all(&all_reduce_header(1 << 29)).unwrap(),
            |err| {
                assert!(matches!(err, DistError::Protocol { peer: 1, .. }), "{err}");
                assert!(
                    err.to_string()
                        .contains("536870912 payload bytes where 400 were expected"),
                    "{err}"
                );
            },
        );
    }

    #[test]
    fn a_truncated_frame_fails_naming_the_rank_that_hung_up() {
        with_fake_rank_1(
            |c| {
                c.write_all(&all_reduce_header(400)).unwrap();
                c.write_all(&[0u8; 100]).unwrap();
                c.shutdown(std::net::Shutdown::Both).unwrap();
            },
            |err| {
                assert_eq!(err.blamed_ranks(), vec![1], "{err}");
                assert!(
                    err.to_string()
                        .contains("rank 1 closed its connection in the middle of a frame"),
                    "{err}"
                );
            },
        );
    }

    #[test]
    fn a_rank_that_vanishes_without_goodbye_is_reported_as_dead() {
        with_fake_rank_1(
            |c| c.shutdown(std::net::Shutdown::Both).unwrap(),
            |err| {
                assert_eq!(err.blamed_ranks(), vec![1], "{err}");
                assert!(
                    err.to_string().contains("probably exited or was killed"),
                    "{err}"
                );
            },
        );
    }
}
