//! DistributedDataParallel on a device group, against one process training on the full batch on
//! the same device (which is itself checked against the CPU first, so that a kernel that is off
//! is not mistaken for a DDP bug).

use std::sync::Arc;

use tandem_autograd::TensorBackward;
use tandem_core::{Device, Tensor};
use tandem_dist::{
    CompressionHook, DdpConfig, DistributedDataParallel, GradReduction, ProcessGroup,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::Module;
use tandem_optim::Optimizer;

use super::{on_ranks, Backend};
use crate::ddp_common::{
    assert_close, batch, build, reference, rows, sgd, shard, snapshot_grads, snapshot_params,
    Model, Outcome, Snapshot, GLOBAL_BATCH,
};

/// Steps of the equivalence runs.
pub const STEPS: usize = 5;

/// How close DDP must come to the single-process run on the same device (relative to each
/// tensor's largest value). The CPU suite's 1e-5 holds there; on a GPU the batch is split
/// differently across kernels (per-rank shards, then the average), so allow f32 noise of 1e-4.
pub fn tolerance(device: Device) -> f64 {
    match device {
        Device::Cpu => 1e-5,
        Device::Cuda(_) => 1e-4,
    }
}

/// `t` copied to `device`.
pub fn on(device: Device, t: &Tensor) -> Tensor {
    t.to_device(device)
        .unwrap_or_else(|e| panic!("copying a {:?} batch to {device}: {e}", t.dims()))
}

/// `model` with the test's initial weights, moved to `device`. On a GPU, f32 products and
/// convolutions are made to round as f32, not TF32: TF32 would round the same on every rank, but
/// a convolution's algorithm (and with it where TF32 rounds) may change with the batch size,
/// which differs between the ranks and the full-batch reference by design.
pub fn build_on(model: Model, seed: u64, device: Device) -> Arc<dyn Module> {
    if let Device::Cuda(_) = device {
        tandem_core::cuda::blas::set_allow_tf32_matmul(false);
        tandem_core::cuda::blas::set_allow_tf32_conv(false);
    }
    let m = build(model, seed);
    m.to_device(device)
        .unwrap_or_else(|e| panic!("moving {model:?} to {device}: {e}"));
    m
}

/// One process training `model` on the full global batch on `device` (`chunks` > 1: BatchNorm
/// sees each of `chunks` equal parts separately and the loss is the mean of the parts' losses).
pub fn reference_on(device: Device, model: Model, steps: usize, chunks: usize) -> Outcome {
    let m = build_on(model, 7, device);
    let mut opt = sgd(m.parameters());
    let mut first_grads = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(model, step);
        let (x, y) = (on(device, &x), on(device, &y));
        opt.zero_grad().unwrap();
        let per = GLOBAL_BATCH / chunks;
        let mut total: Option<Tensor> = None;
        for c in 0..chunks {
            let what = || format!("reference {model:?} on {device}, step {step}, chunk {c}");
            let out = m
                .forward(&rows(&x, c * per, per))
                .unwrap_or_else(|e| panic!("{}: forward: {e}", what()));
            let loss = cross_entropy(&out, &rows(&y, c * per, per), Reduction::Mean)
                .unwrap_or_else(|e| panic!("{}: cross_entropy: {e}", what()));
            let loss = tandem_ops::mul_scalar(&loss, 1.0 / chunks as f64).unwrap();
            total = Some(match total {
                None => loss,
                Some(t) => tandem_ops::add(&t, &loss).unwrap(),
            });
        }
        total.unwrap().backward().unwrap_or_else(|e| {
            panic!("reference {model:?} on {device}, step {step}: backward: {e}")
        });
        if step == 0 {
            first_grads = snapshot_grads(m.as_ref());
        }
        opt.step()
            .unwrap_or_else(|e| panic!("reference {model:?} on {device}, step {step}: SGD: {e}"));
    }
    Outcome {
        first_grads,
        final_params: snapshot_params(m.as_ref()),
    }
}

/// DDP training of `model` on this rank's shard, on the group's device, for `steps` steps.
pub fn train_ddp_on(
    model: Model,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    steps: usize,
    config: DdpConfig,
) -> (Outcome, DistributedDataParallel) {
    train_ddp_with(model, rank, group, steps, config, false)
}

/// [`train_ddp_on`], with the model's BatchNorm layers turned into SyncBatchNorm over the
/// group first when `sync_bn` is set.
pub fn train_ddp_with(
    model: Model,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    steps: usize,
    config: DdpConfig,
    sync_bn: bool,
) -> (Outcome, DistributedDataParallel) {
    let device = group.comm_stream().device();
    let world = group.world_size();
    let what =
        |step: usize| format!("DDP {model:?} on {device}, rank {rank} of {world}, step {step}");
    let mut m = build_on(model, 7, device);
    if sync_bn {
        m = tandem_dist::convert_sync_batch_norm(m, group.clone())
            .unwrap_or_else(|e| panic!("{}: convert_sync_batch_norm: {e}", what(0)));
    }
    let ddp = DistributedDataParallel::new(m, group, config)
        .unwrap_or_else(|e| panic!("{}: DistributedDataParallel::new: {e}", what(0)));
    let mut opt = sgd(ddp.module().parameters());
    let mut first_grads = Vec::new();
    for step in 0..steps {
        let (x, y) = rank_batch(model, step, rank, world, device);
        opt.zero_grad().unwrap();
        let out = ddp
            .forward(&x)
            .unwrap_or_else(|e| panic!("{}: forward: {e}", what(step)));
        let loss = cross_entropy(&out, &y, Reduction::Mean)
            .unwrap_or_else(|e| panic!("{}: cross_entropy: {e}", what(step)));
        loss.backward()
            .unwrap_or_else(|e| panic!("{}: backward: {e}", what(step)));
        if step == 0 {
            first_grads = snapshot_grads(ddp.module().as_ref());
        }
        opt.step()
            .unwrap_or_else(|e| panic!("{}: SGD: {e}", what(step)));
    }
    let outcome = Outcome {
        first_grads,
        final_params: snapshot_params(ddp.module().as_ref()),
    };
    (outcome, ddp)
}

/// Rank `rank`'s share (of `world`) of step `step`'s batch, on `device`.
pub fn rank_batch(
    model: Model,
    step: usize,
    rank: usize,
    world: usize,
    device: Device,
) -> (Tensor, Tensor) {
    let (x, y) = batch(model, step);
    (
        on(device, &shard(&x, rank, world)),
        on(device, &shard(&y, rank, world)),
    )
}

/// The single-process run on `device` against the same run on the CPU: if this fails, an op's
/// kernel on the device is off and the DDP comparisons below it mean nothing.
fn check_reference_against_cpu(device: Device, model: Model, want: &Outcome) {
    if device == Device::Cpu {
        return;
    }
    let cpu = reference(model, STEPS, 1);
    let what = format!(
        "{model:?}: one process on {device} vs one process on the CPU (an op's CUDA kernel, \
         not DDP, is off)"
    );
    assert_close(
        &format!("{what}: first-step gradients"),
        &want.first_grads,
        &cpu.first_grads,
        1e-3,
    );
    assert_close(
        &format!("{what}: parameters after {STEPS} steps"),
        &want.final_params,
        &cpu.final_params,
        1e-3,
    );
}

/// N ranks of `backend` with B/N samples each against one process with batch B, for each N in
/// `worlds`: the gradients after the first step and the parameters after [`STEPS`] steps agree
/// within [`tolerance`], and every rank ends with bit-identical parameters.
pub fn equivalence(backend: Backend, model: Model, worlds: &[usize]) {
    run_equivalence(backend, model, false, worlds);
}

/// SyncBatchNorm normalises with the statistics of the global batch, so DDP over N ranks of
/// `backend` with every BatchNorm turned into SyncBatchNorm equals one process with plain
/// BatchNorm on the full batch (gradients after one step, parameters after [`STEPS`] steps).
pub fn sync_batch_norm_matches_the_full_batch(backend: Backend, worlds: &[usize]) {
    run_equivalence(backend, Model::CnnBatchNorm, true, worlds);
}

fn run_equivalence(backend: Backend, model: Model, sync_bn: bool, worlds: &[usize]) {
    let device = backend.device();
    let want = reference_checked_on(device, model);
    for &world in worlds {
        let outcomes = on_ranks(backend, world, |rank, group| {
            train_ddp_with(model, rank, group, STEPS, DdpConfig::default(), sync_bn).0
        });
        let layers = if sync_bn { " with SyncBatchNorm" } else { "" };
        check_equivalence(
            &format!("{model:?}{layers} on the {backend}, {world} ranks"),
            &outcomes,
            &want,
            tolerance(device),
        );
    }
}

/// The single-process run of `model` on the full batch on `device` for [`STEPS`] steps, checked
/// against the same run on the CPU: the reference of the equivalence runs.
pub fn reference_checked_on(device: Device, model: Model) -> Outcome {
    let want = reference_on(device, model, STEPS, 1);
    check_reference_against_cpu(device, model, &want);
    want
}

/// Every rank's `outcomes` (in rank order) against the single-process run `want`: the gradients
/// after the first step and the parameters after the last within `tol`, and the parameters of
/// every rank bit-identical to rank 0's. `what` names the run (model, backend, world size).
pub fn check_equivalence(what: &str, outcomes: &[Outcome], want: &Outcome, tol: f64) {
    for (rank, got) in outcomes.iter().enumerate() {
        let what = format!("{what}, rank {rank}");
        assert_close(
            &format!("{what}: first-step gradients vs one process on the full batch"),
            &got.first_grads,
            &want.first_grads,
            tol,
        );
        assert_close(
            &format!("{what}: parameters at the end vs one process on the full batch"),
            &got.final_params,
            &want.final_params,
            tol,
        );
        assert_close(
            &format!("{what}: parameters at the end vs rank 0 (replicas must agree bit for bit)"),
            &got.final_params,
            &outcomes[0].final_params,
            0.0,
        );
    }
}

/// Plain BatchNorm normalises each rank's shard with its own statistics: DDP over 4 ranks
/// equals one process whose BatchNorm sees the 4 chunks separately.
pub fn plain_batch_norm_matches_the_chunked_reference(backend: Backend) {
    let device = backend.device();
    let world = 4;
    let want = reference_on(device, Model::CnnBatchNorm, 1, world);
    let outcomes = on_ranks(backend, world, |rank, group| {
        train_ddp_on(Model::CnnBatchNorm, rank, group, 1, DdpConfig::default()).0
    });
    for (rank, got) in outcomes.iter().enumerate() {
        assert_close(
            &format!(
                "CnnBatchNorm on {backend}, rank {rank} of {world}: first-step gradients vs one \
                 process normalising each rank's chunk separately"
            ),
            &got.first_grads,
            &want.first_grads,
            tolerance(device),
        );
    }
}

/// `Sum` gives world × the `Mean` gradients.
pub fn sum_is_world_size_times_mean(backend: Backend) {
    let device = backend.device();
    let world = 4;
    let run = |reduction| {
        on_ranks(backend, world, |rank, group| {
            let config = DdpConfig {
                reduction,
                ..DdpConfig::default()
            };
            train_ddp_on(Model::Mlp, rank, group, 1, config)
                .0
                .first_grads
        })
        .remove(0)
    };
    let mean = run(GradReduction::Mean);
    let sum = run(GradReduction::Sum);
    let scaled: Vec<(String, Vec<f32>)> = mean
        .iter()
        .map(|(n, g)| (n.clone(), g.iter().map(|v| v * world as f32).collect()))
        .collect();
    assert_close(
        &format!("{backend}: GradReduction::Sum vs {world} × Mean"),
        &sum,
        &scaled,
        tolerance(device),
    );
}

/// Two micro-batches, the first under `no_sync`, give the gradient of one batch of both; only
/// the synchronised backward launches buckets.
pub fn no_sync_accumulates_locally(backend: Backend) {
    let device = backend.device();
    let want = reference_on(device, Model::Mlp, 1, 1);
    let grads = on_ranks(backend, 2, |rank, group| {
        no_sync_rank(&backend.to_string(), rank, group)
    });
    check_no_sync(&backend.to_string(), &grads, &want, tolerance(device));
}

/// One rank of the no_sync case on `group`'s device: a micro-batch under `no_sync`, then a
/// synchronised one; panics (naming `backend`) if a bucket is launched under `no_sync`.
/// Returns the accumulated gradients.
pub fn no_sync_rank(backend: &str, rank: usize, group: Arc<dyn ProcessGroup>) -> Snapshot {
    let device = group.comm_stream().device();
    let world = group.world_size();
    let ddp =
        DistributedDataParallel::new(build_on(Model::Mlp, 7, device), group, DdpConfig::default())
            .unwrap();
    let (x, y) = batch(Model::Mlp, 0);
    let (x, y) = (
        on(device, &shard(&x, rank, world)),
        on(device, &shard(&y, rank, world)),
    );
    let half = x.dims()[0] / 2;
    let micro = |part: usize| {
        let out = ddp.forward(&rows(&x, part * half, half)).unwrap();
        let loss = cross_entropy(&out, &rows(&y, part * half, half), Reduction::Mean).unwrap();
        tandem_ops::mul_scalar(&loss, 0.5)
            .unwrap()
            .backward()
            .unwrap_or_else(|e| panic!("{backend} rank {rank}: micro-batch {part}: {e}"));
    };
    ddp.no_sync(|| micro(0));
    let launched_under_no_sync = ddp.launch_log().len();
    micro(1);
    let log = ddp.launch_log();
    assert_eq!(
        launched_under_no_sync, 0,
        "{backend} rank {rank}: no bucket may be launched under no_sync"
    );
    assert!(
        !log.is_empty() && log.iter().all(|l| l.backward == 0),
        "{backend} rank {rank}: only the synchronised backward launches: {log:?}"
    );
    snapshot_grads(ddp.module().as_ref())
}

/// Every rank's gradients of the no_sync case against one batch of both micro-batches.
pub fn check_no_sync(backend: &str, grads: &[Snapshot], want: &Outcome, tol: f64) {
    for (rank, g) in grads.iter().enumerate() {
        assert_close(
            &format!("{backend} rank {rank}: no_sync micro-batch then a synchronised one vs one batch of both"),
            g,
            &want.first_grads,
            tol,
        );
    }
}

/// The bf16 and f16 compression hooks (casts on the comm stream) agree with the full-batch
/// gradients within half precision.
pub fn compression_hooks_agree_within_half_precision(backend: Backend) {
    let device = backend.device();
    let want = reference_on(device, Model::Mlp, 1, 1);
    for (hook, tol) in compression_hooks() {
        let grads = on_ranks(backend, 4, |rank, group| {
            compression_rank(hook, rank, group)
        });
        check_compression(&backend.to_string(), &hook, &grads, &want, tol);
    }
}

/// The compression hooks and how close each must come to the full-batch gradients (relative).
pub fn compression_hooks() -> [(CompressionHook, f64); 2] {
    [
        (CompressionHook::bf16(), 1e-2),
        (CompressionHook::f16(), 2e-3),
    ]
}

/// One rank of the compression case: the first-step gradients of the Mlp under `hook`.
pub fn compression_rank(
    hook: CompressionHook,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
) -> Snapshot {
    let config = DdpConfig {
        comm_hook: Some(Arc::new(hook)),
        ..DdpConfig::default()
    };
    train_ddp_on(Model::Mlp, rank, group, 1, config)
        .0
        .first_grads
}

/// Every rank's gradients under `hook` against the full-batch gradients, within `tol`.
pub fn check_compression(
    backend: &str,
    hook: &CompressionHook,
    grads: &[Snapshot],
    want: &Outcome,
    tol: f64,
) {
    let world = grads.len();
    for (rank, g) in grads.iter().enumerate() {
        assert_close(
            &format!("{backend} rank {rank} of {world}, {hook:?}: first-step gradients"),
            g,
            &want.first_grads,
            tol,
        );
    }
}

/// Tiny buckets (about one parameter each): after the first step every rank rebuilds them in
/// the observed ready order, identically, and training still matches the full batch.
pub fn buckets_rebuild_identically_and_training_still_matches(backend: Backend) {
    let device = backend.device();
    let want = reference_on(device, Model::Cnn, REBUILD_STEPS, 1);
    let results = on_ranks(backend, 4, rebuild_rank);
    check_rebuild(&backend.to_string(), &results, &want, tolerance(device));
}

/// Steps of the bucket-rebuild case.
pub const REBUILD_STEPS: usize = 3;

/// What one rank of the bucket-rebuild case reports.
pub struct RebuildOutcome {
    pub outcome: Outcome,
    /// The buckets after the rebuild: parameter paths per bucket.
    pub layout: Vec<Vec<String>>,
    /// For each synchronised backward, the buckets in the order they were launched.
    pub launches: Vec<Vec<usize>>,
}

/// One rank of the bucket-rebuild case: the Cnn with tiny buckets for [`REBUILD_STEPS`] steps.
pub fn rebuild_rank(rank: usize, group: Arc<dyn ProcessGroup>) -> RebuildOutcome {
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let (outcome, ddp) = train_ddp_on(Model::Cnn, rank, group, REBUILD_STEPS, config);
    let log = ddp.launch_log();
    let launches = (0..REBUILD_STEPS as u64)
        .map(|backward| {
            log.iter()
                .filter(|l| l.backward == backward)
                .map(|l| l.bucket)
                .collect()
        })
        .collect();
    RebuildOutcome {
        outcome,
        layout: ddp.bucket_layout(),
        launches,
    }
}

/// Every rank rebuilt the same several buckets, starting with the last layer's weight, launched
/// them in bucket order in every backward, and trained as one process on the full batch (`want`,
/// within `tol`).
pub fn check_rebuild(backend: &str, results: &[RebuildOutcome], want: &Outcome, tol: f64) {
    let layout0 = &results[0].layout;
    for (rank, result) in results.iter().enumerate() {
        let layout = &result.layout;
        assert_eq!(
            layout, layout0,
            "{backend}: rank {rank}'s rebuilt buckets differ from rank 0's"
        );
        assert!(
            layout.len() >= 3,
            "{backend}: expected several buckets, got {layout:?}"
        );
        // Within a layer the weight's gradient is ready before the bias's.
        assert_eq!(
            layout[0],
            vec!["6.weight".to_string()],
            "{backend} rank {rank}: rebuilt first bucket; layout {layout:?}"
        );
        assert_eq!(
            result.launches.len(),
            REBUILD_STEPS,
            "{backend} rank {rank}: launch orders of every backward"
        );
        for (backward, launches) in result.launches.iter().enumerate() {
            assert_eq!(
                launches,
                &(0..layout.len()).collect::<Vec<_>>(),
                "{backend} rank {rank}, backward {backward}: buckets launch in bucket order"
            );
        }
        assert_close(
            &format!(
                "{backend} rank {rank}: parameters after {REBUILD_STEPS} steps with rebuilt tiny \
                 buckets"
            ),
            &result.outcome.final_params,
            &want.final_params,
            tol,
        );
    }
}

/// Every gradient lives on the device, as a view into its bucket: the gradients of one bucket
/// share one buffer, different buckets do not, and the views survive the optimizer's steps.
pub fn gradients_are_views_into_device_buckets(backend: Backend) {
    let device = backend.device();
    let config = DdpConfig {
        bucket_cap_mb: 0.004,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    on_ranks(backend, 2, |rank, group| {
        let (_, ddp) = train_ddp_on(Model::Cnn, rank, group, 2, config.clone());
        let params: std::collections::HashMap<String, Tensor> =
            ddp.module().named_parameters().into_iter().collect();
        let layout = ddp.bucket_layout();
        assert!(
            layout.len() >= 2,
            "{backend}: expected several buckets: {layout:?}"
        );
        let grad = |path: &str| {
            let g = params[path]
                .grad()
                .unwrap_or_else(|| panic!("{backend} rank {rank}: `{path}` has no gradient"));
            assert_eq!(
                g.device(),
                device,
                "{backend} rank {rank}: gradient of `{path}`"
            );
            g
        };
        for (b, bucket) in layout.iter().enumerate() {
            let first = grad(&bucket[0]);
            for path in &bucket[1..] {
                assert!(
                    grad(path).storage().same_buffer(first.storage()),
                    "{backend} rank {rank}: `{path}` and `{}` are in bucket {b} but their \
                     gradients do not share its buffer",
                    bucket[0]
                );
            }
            if let Some(next) = layout.get(b + 1) {
                assert!(
                    !grad(&next[0]).storage().same_buffer(first.storage()),
                    "{backend} rank {rank}: buckets {b} and {} share a buffer",
                    b + 1
                );
            }
        }
    });
}

/// Telemetry comes from events: every step and bucket is timed, in order on the comm stream.
pub fn telemetry_times_every_bucket(backend: Backend) {
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let telemetry = on_ranks(backend, 2, |rank, group| {
        train_ddp_on(Model::Cnn, rank, group, 3, config.clone())
            .1
            .telemetry()
    });
    for (rank, t) in telemetry.iter().enumerate() {
        assert_eq!(t.steps().len(), 3, "{backend} rank {rank}: steps recorded");
        for (i, step) in t.steps().iter().enumerate() {
            assert!(
                !step.buckets.is_empty(),
                "{backend} rank {rank} step {i}: no buckets"
            );
            assert!(
                step.forward_end <= step.backward_compute_end,
                "{backend} rank {rank} step {i}: backward ended before forward"
            );
            for b in &step.buckets {
                let (Some(s), Some(e)) = (b.started, b.ended) else {
                    panic!(
                        "{backend} rank {rank} step {i}: bucket {} untimed: {b:?}",
                        b.bucket
                    );
                };
                assert!(
                    s <= e && e <= step.comm_end,
                    "{backend} rank {rank} step {i}: bucket {} start {s:?}, end {e:?}, comm end {:?}",
                    b.bucket,
                    step.comm_end
                );
            }
        }
        let summary = t.summary();
        assert!(
            (0.0..=1.0).contains(&summary.hidden_fraction),
            "{backend} rank {rank}: {summary}"
        );
    }
}
