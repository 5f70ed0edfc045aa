//! DDP on a GPU never makes the host wait for the device inside backward (issue 21, item 4):
//! the buckets are all-reduced on the comm stream while backward goes on issuing kernels, and
//! the end of backward makes the compute stream — not the host — wait for them. A host
//! synchronisation there (a stream or event synchronize, a blocking copy, …) would leave the
//! GPU idle while the host waits, once per bucket. Counted by the CUDA emulator
//! ([`tandem_test_support::emulator_counters`]); after backward, reading the loss may (and
//! must, to be read) synchronise.
//!
//! [`count_backward`] is written once for any process group whose ranks run DDP on a CUDA
//! device: the device-threads group (ranks are threads of this process, `cuda_ddp_syncs.rs`)
//! and, with the emulated NCCL, one rank per process — see [`Meeting`].

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tandem_autograd::TensorBackward;
use tandem_core::Device;
use tandem_dist::{DdpConfig, DistributedDataParallel, ProcessGroup};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_optim::Optimizer;
use tandem_test_support::emulator_counters::{self, table, Counters};

use super::ddp::{build_on, rank_batch};
use crate::ddp_common::{sgd, Model};

/// Steps per measured run: the first backward (gradients copied into fresh bucket slots), the
/// ones after it (accumulated in place), and the bucket rebuild in between.
pub const STEPS: usize = 3;

/// Small buckets (512 bytes), so that several are all-reduced while backward runs (the Mlp's
/// six parameter tensors are 2.2 KiB in all, 0.3 to 1 KiB per layer).
pub fn config() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 0.0005,
        first_bucket_mb: 0.0005,
        ..DdpConfig::default()
    }
}

/// How the ranks of a measurement meet, since the emulator's counters are per process.
pub enum Meeting<'a> {
    /// Ranks are threads of this process sharing its counters: they meet at `barrier` just
    /// before and just after each measured backward, so the window holds every rank's backward
    /// and nothing else, and rank 0 reads the counters.
    Threads(&'a RankBarrier),
    /// This process holds one rank (the NCCL group, one process per rank): its counters are its
    /// own, so it measures its backward alone.
    Process,
}

/// A barrier for the ranks of this process that gives up (panics) after a minute, so that a
/// rank that panicked leaves the others a message instead of a hang.
pub struct RankBarrier {
    ranks: usize,
    /// Arrived so far in this round, and the round.
    state: Mutex<(usize, u64)>,
    turned: Condvar,
}

impl RankBarrier {
    pub fn new(ranks: usize) -> Self {
        RankBarrier {
            ranks,
            state: Mutex::new((0, 0)),
            turned: Condvar::new(),
        }
    }

    fn wait(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let round = st.1;
        st.0 += 1;
        if st.0 == self.ranks {
            *st = (0, round + 1);
            self.turned.notify_all();
            return;
        }
        while st.1 == round {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "the ranks did not all reach the measurement's barrier within a minute (one \
                 panicked? its message is above)"
            );
            st = self
                .turned
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Meeting<'_> {
    fn meet(&self) {
        if let Meeting::Threads(barrier) = self {
            barrier.wait();
        }
    }

    fn reads(&self, rank: usize) -> bool {
        match self {
            Meeting::Threads(_) => rank == 0,
            Meeting::Process => true,
        }
    }
}

/// What one step asked of the device, as the emulator counted it.
#[derive(Clone, Copy, Debug)]
pub struct StepSyncs {
    pub step: usize,
    /// From just before `loss.backward()` to its return (every rank's, for [`Meeting::Threads`]).
    pub backward: Counters,
    /// The optimizer's step and `loss.item()` after backward (this rank's and whatever the
    /// others did meanwhile): at least one synchronisation, which shows the counters are live.
    pub after: Counters,
}

/// Trains `model` with DDP (`config`) on `group` for `steps` steps, on the group's device, and
/// counts every backward and what follows it. `None` where the emulator's counters are not
/// available (a real GPU), and on ranks that do not read them ([`Meeting`]).
pub fn count_backward(
    model: Model,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    config: DdpConfig,
    steps: usize,
    meeting: &Meeting<'_>,
) -> Option<Vec<StepSyncs>> {
    let device = group.comm_stream().device();
    let world = group.world_size();
    let what =
        |step: usize| format!("DDP {model:?} on {device}, rank {rank} of {world}, step {step}");
    choose_convolution_algorithms(model, rank, world, device, &what(0));
    let ddp = DistributedDataParallel::new(build_on(model, 7, device), group, config)
        .unwrap_or_else(|e| panic!("{}: DistributedDataParallel::new: {e}", what(0)));
    let mut opt = sgd(ddp.module().parameters());
    let reads = meeting.reads(rank);
    if reads && std::env::var_os("TANDEM_TRACE_HOST_SYNCS").is_some() {
        emulator_counters::trace_host_syncs(true);
    }
    let mut counted = Vec::new();
    for step in 0..steps {
        let (x, y) = rank_batch(model, step, rank, world, device);
        opt.zero_grad().unwrap();
        let out = ddp
            .forward(&x)
            .unwrap_or_else(|e| panic!("{}: forward: {e}", what(step)));
        let loss = cross_entropy(&out, &y, Reduction::Mean)
            .unwrap_or_else(|e| panic!("{}: cross_entropy: {e}", what(step)));
        // Every rank has issued its forward; the window opens once they all stand here.
        meeting.meet();
        let before = reads.then(emulator_counters::counters).flatten();
        meeting.meet();
        loss.backward()
            .unwrap_or_else(|e| panic!("{}: backward: {e}", what(step)));
        meeting.meet();
        let backward_end = reads.then(emulator_counters::counters).flatten();
        meeting.meet();
        opt.step()
            .unwrap_or_else(|e| panic!("{}: SGD: {e}", what(step)));
        let value = loss
            .item()
            .unwrap_or_else(|e| panic!("{}: reading the loss: {e}", what(step)));
        assert!(value.is_finite(), "{}: loss {value}", what(step));
        meeting.meet();
        let after = reads.then(emulator_counters::counters).flatten();
        meeting.meet();
        if let (Some(before), Some(backward_end), Some(after)) = (before, backward_end, after) {
            counted.push(StepSyncs {
                step,
                backward: backward_end.since(&before),
                after: after.since(&backward_end),
            });
        }
    }
    emulator_counters::trace_host_syncs(false);
    (reads && counted.len() == steps).then_some(counted)
}

/// Runs one forward and backward of `model` on this rank's batch shapes, outside DDP and
/// outside the counted window, so that cuDNN's algorithms for each convolution are chosen
/// before DDP's first step. tandem chooses them on a geometry's first call by measuring them
/// (`cudnnFind…AlgorithmEx`, which runs and waits for the candidates on a GPU as on the
/// emulator), once per geometry, pass and thread: a one-time cost of a process's first step that
/// is not DDP's, and without this the Cnn's first backward counts those waits.
fn choose_convolution_algorithms(
    model: Model,
    rank: usize,
    world: usize,
    device: Device,
    what: &str,
) {
    let (x, y) = rank_batch(model, 0, rank, world, device);
    let m = build_on(model, 7, device);
    let out = m
        .forward(&x)
        .unwrap_or_else(|e| panic!("{what}: choosing the convolutions' algorithms: {e}"));
    cross_entropy(&out, &y, Reduction::Mean)
        .and_then(|loss| loss.backward())
        .unwrap_or_else(|e| panic!("{what}: choosing the convolutions' algorithms: {e}"));
}

/// No host synchronisation inside any counted backward; buckets were launched there (the
/// window saw the collectives' work), and the read after it synchronised (the counters are
/// this process's). `what` names the model, group and world in the messages.
pub fn assert_no_host_sync_in_backward(what: &str, steps: &[StepSyncs]) {
    assert!(!steps.is_empty(), "{what}: no step was counted");
    for s in steps {
        let b = &s.backward;
        println!(
            "{what}, step {}: backward\n{}\noptimizer step and loss.item():\n{}",
            s.step,
            table(b),
            table(&s.after)
        );
        assert_eq!(
            b.host_syncs,
            0,
            "{what}, step {}: backward made the host wait for the device {} time(s) (stream \
             synchronize {}, event synchronize {}, context synchronize {}, blocking copies {}, \
             blocking frees {}); rerun with TANDEM_TRACE_HOST_SYNCS=1 to see where\n{}",
            s.step,
            b.host_syncs,
            b.stream_syncs,
            b.event_syncs,
            b.context_syncs,
            b.blocking_copies,
            b.blocking_frees,
            table(b)
        );
        assert!(
            b.launches > 0 && b.stream_waits > 0,
            "{what}, step {}: backward launched no kernel or made no stream wait: not DDP on \
             the GPU?\n{}",
            s.step,
            table(b)
        );
        assert!(
            s.after.host_syncs >= 1,
            "{what}, step {}: reading the loss did not synchronise: the counters are not this \
             process's?\n{}",
            s.step,
            table(&s.after)
        );
    }
}
