//! DistributedDataParallel with ranks as threads: equivalence with one process on the full
//! batch, Sum vs Mean, no_sync, compression hooks, BatchNorm semantics, launch order,
//! telemetry, and errors.

mod ddp_common;

use std::sync::Arc;

use ddp_common::*;
use tandem_autograd::autocast::autocast;
use tandem_autograd::TensorBackward;
use tandem_core::{DType, Tensor};
use tandem_dist::{
    CompressionHook, DdpConfig, DistributedDataParallel, GradReduction, ProcessGroup,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::{Child, Forward, TrainingFlag};
use tandem_nn::{Conv2dConfig, LinearConfig, Module};
use tandem_optim::Optimizer;

const STEPS: usize = 5;

fn equivalence(model: Model, sync_bn: bool) {
    let want = reference(model, STEPS, 1);
    for world in [1, 2, 4, 8] {
        let outcomes = run_ranks(world, |rank, group| {
            train_ddp(model, rank, group, STEPS, DdpConfig::default(), sync_bn).0
        });
        for (rank, got) in outcomes.iter().enumerate() {
            let what = format!("{model:?}, {world} ranks, rank {rank}");
            assert_close(
                &format!("{what}: first-step gradients"),
                &got.first_grads,
                &want.first_grads,
                1e-5,
            );
            assert_close(
                &format!("{what}: parameters after {STEPS} steps"),
                &got.final_params,
                &want.final_params,
                1e-5,
            );
        }
    }
}

#[test]
fn ddp_mean_matches_single_process_full_batch_mlp() {
    equivalence(Model::Mlp, false);
}

#[test]
fn ddp_mean_matches_single_process_full_batch_cnn() {
    equivalence(Model::Cnn, false);
}

#[test]
fn ddp_with_sync_batch_norm_matches_single_process_full_batch() {
    equivalence(Model::CnnBatchNorm, true);
}

#[test]
fn plain_batch_norm_matches_a_reference_that_normalises_each_rank_chunk_separately() {
    let world = 4;
    let want = reference(Model::CnnBatchNorm, 1, world);
    let outcomes = run_ranks(world, |rank, group| {
        train_ddp(
            Model::CnnBatchNorm,
            rank,
            group,
            1,
            DdpConfig::default(),
            false,
        )
        .0
    });
    for got in &outcomes {
        assert_close(
            "plain BatchNorm under DDP",
            &got.first_grads,
            &want.first_grads,
            1e-5,
        );
    }
    // And it is not the full-batch gradient: BatchNorm statistics differ per chunk.
    let full = reference(Model::CnnBatchNorm, 1, 1);
    let differs = outcomes[0]
        .first_grads
        .iter()
        .zip(&full.first_grads)
        .any(|((_, a), (_, b))| {
            a.iter()
                .zip(b)
                .any(|(x, y)| (x - y).abs() > 1e-4 * y.abs().max(1e-3))
        });
    assert!(
        differs,
        "per-rank BatchNorm should differ from full-batch BatchNorm"
    );
}

#[test]
fn sum_gives_world_size_times_the_mean() {
    let world = 4;
    let run = |reduction| {
        run_ranks(world, |rank, group| {
            let config = DdpConfig {
                reduction,
                ..DdpConfig::default()
            };
            train_ddp(Model::Mlp, rank, group, 1, config, false)
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
    assert_close("Sum vs world_size × Mean", &sum, &scaled, 1e-5);
}

#[test]
fn no_sync_over_two_micro_batches_equals_one_batch_of_both() {
    let world = 2;
    let want = reference(Model::Mlp, 1, 1);
    let grads = run_ranks(world, |rank, group| {
        let ddp = DistributedDataParallel::new(build(Model::Mlp, 7), group, DdpConfig::default())
            .unwrap();
        let (x, y) = batch(Model::Mlp, 0);
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        let half = x.dims()[0] / 2;
        let micro = |part: usize| {
            let out = ddp.forward(&rows(&x, part * half, half)).unwrap();
            let loss = cross_entropy(&out, &rows(&y, part * half, half), Reduction::Mean).unwrap();
            tandem_ops::mul_scalar(&loss, 0.5)
                .unwrap()
                .backward()
                .unwrap();
        };
        ddp.no_sync(|| micro(0));
        micro(1);
        let log = ddp.launch_log();
        assert!(
            !log.is_empty() && log.iter().all(|l| l.backward == 0),
            "only the synchronised backward launches"
        );
        snapshot_grads(ddp.module().as_ref())
    });
    for g in &grads {
        assert_close("no_sync accumulation", g, &want.first_grads, 1e-5);
    }
}

#[test]
fn bf16_and_f16_compression_hooks_agree_within_half_precision_tolerance() {
    let want = reference(Model::Mlp, 1, 1);
    for (hook, tol) in [
        (CompressionHook::bf16(), 1e-2),
        (CompressionHook::f16(), 2e-3),
    ] {
        let grads = run_ranks(4, |rank, group| {
            let config = DdpConfig {
                comm_hook: Some(Arc::new(hook)),
                ..DdpConfig::default()
            };
            train_ddp(Model::Mlp, rank, group, 1, config, false)
                .0
                .first_grads
        });
        for g in &grads {
            assert_close(&format!("{hook:?}"), g, &want.first_grads, tol);
        }
    }
}

#[test]
fn buckets_launch_in_bucket_order_and_the_first_before_backward_finishes() {
    // Tiny caps: about one parameter per bucket, so the order is visible.
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let results = run_ranks(2, |rank, group| {
        let (_, ddp) = train_ddp(Model::Mlp, rank, group, 3, config.clone(), false);
        (ddp.launch_log(), ddp.bucket_layout())
    });
    for (rank, (log, layout)) in results.iter().enumerate() {
        assert!(
            layout.len() >= 3,
            "rank {rank}: expected several buckets, got {layout:?}"
        );
        // The last layer's parameters come first (reverse layer order).
        assert!(
            layout[0].iter().all(|p| p.starts_with("4.")),
            "rank {rank}: first bucket {:?}",
            layout[0]
        );
        for backward in 0..3 {
            let launches: Vec<usize> = log
                .iter()
                .filter(|l| l.backward == backward)
                .map(|l| l.bucket)
                .collect();
            assert_eq!(
                launches,
                (0..layout.len()).collect::<Vec<_>>(),
                "rank {rank}, backward {backward}"
            );
            let first = log.iter().find(|l| l.backward == backward).unwrap();
            assert!(
                first.during_backward,
                "rank {rank}: bucket 0 must be issued while backward computes"
            );
        }
    }
    assert_eq!(
        results[0], results[1],
        "every rank issues the same sequence"
    );
}

/// A model whose second layer is only used when asked to.
#[derive(Module)]
struct Branchy {
    used: Child,
    branch: Child,
    use_both: bool,
    training: TrainingFlag,
}

impl Forward for Branchy {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        let h = self.used.forward(x)?;
        if self.use_both {
            Ok(tandem_ops::add(&h, &self.branch.forward(x)?)?)
        } else {
            Ok(h)
        }
    }
}

/// Per rank, after two steps: each parameter's gradient (`None`: it has none).
type Grads = Vec<(String, Option<Vec<f32>>)>;

fn branchy_steps(find_unused: bool) -> Vec<Result<Grads, String>> {
    run_ranks(2, move |rank, group| {
        tandem_core::rng::manual_seed(3);
        let model = Branchy {
            used: LinearConfig::new(12, CLASSES).init().unwrap().into(),
            branch: LinearConfig::new(12, CLASSES).init().unwrap().into(),
            use_both: false,
            training: TrainingFlag::new(),
        };
        let config = DdpConfig {
            find_unused_parameters: find_unused,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(Arc::new(model), group, config)
            .map_err(|e| e.to_string())?;
        for step in 0..2 {
            let (x, y) = batch(Model::Mlp, step);
            let out = ddp
                .forward(&shard(&x, rank, 2))
                .map_err(|e| e.to_string())?;
            let loss = cross_entropy(&out, &shard(&y, rank, 2), Reduction::Mean).unwrap();
            loss.backward().map_err(|e| e.to_string())?;
        }
        let grads = ddp
            .module()
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, p.grad().map(|g| g.to_vec::<f32>().unwrap())))
            .collect();
        Ok(grads)
    })
}

#[test]
fn an_unused_parameter_fails_the_next_forward_naming_its_path_and_the_option() {
    for result in branchy_steps(false) {
        let err = result.unwrap_err();
        assert!(
            err.contains("`branch.weight`") && err.contains("`branch.bias`"),
            "{err}"
        );
        assert!(!err.contains("used.weight"), "{err}");
        assert!(err.contains("find_unused_parameters"), "{err}");
    }
}

#[test]
fn find_unused_parameters_completes_buckets_and_leaves_unused_gradients_none() {
    for result in branchy_steps(true) {
        for (name, g) in result.unwrap() {
            match g {
                None => assert!(name.starts_with("branch."), "{name} has no gradient"),
                Some(g) => {
                    assert!(!name.starts_with("branch."), "{name} got a gradient");
                    assert!(g.iter().any(|&v| v != 0.0), "{name}");
                }
            }
        }
    }
}

#[test]
fn mismatched_models_fail_at_construction_naming_the_rank_and_the_parameter() {
    let errors = run_ranks(3, |rank, group| {
        tandem_core::rng::manual_seed(1);
        let width = if rank == 2 { 17 } else { 16 };
        let model = tandem_nn::Sequential::new().add(LinearConfig::new(8, width).init().unwrap());
        DistributedDataParallel::new(Arc::new(model), group, DdpConfig::default())
            .err()
            .map(|e| e.to_string())
    });
    for (rank, err) in errors.iter().enumerate() {
        let err = err
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} accepted a mismatched model"));
        assert!(
            err.contains("rank 2") && err.contains("0.weight"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn construction_broadcasts_rank_zero_parameters() {
    let params = run_ranks(4, |rank, group: Arc<dyn ProcessGroup>| {
        let ddp = DistributedDataParallel::new(
            build(Model::Mlp, rank as u64),
            group,
            DdpConfig::default(),
        )
        .unwrap();
        snapshot_params(ddp.module().as_ref())
    });
    for p in &params[1..] {
        assert_close("after broadcast", p, &params[0], 0.0);
    }
}

#[test]
fn buckets_are_rebuilt_in_ready_order_identically_on_every_rank() {
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let layouts = run_ranks(4, |rank, group| {
        train_ddp(Model::Cnn, rank, group, 2, config.clone(), false)
            .1
            .bucket_layout()
    });
    for l in &layouts[1..] {
        assert_eq!(l, &layouts[0]);
    }
    // Within a layer the weight's gradient is ready before the bias's (linear/conv backward
    // delivers input, weight, bias), so the rebuilt order puts `6.weight` first.
    assert_eq!(
        layouts[0][0],
        vec!["6.weight".to_string()],
        "{:?}",
        layouts[0]
    );
}

#[test]
fn telemetry_records_every_bucket_and_summarises_overlap() {
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let telemetry = run_ranks(2, |rank, group| {
        train_ddp(Model::Cnn, rank, group, 3, config.clone(), false)
            .1
            .telemetry()
    });
    for t in &telemetry {
        assert_eq!(t.steps().len(), 3);
        for step in t.steps() {
            assert!(!step.buckets.is_empty());
            for b in &step.buckets {
                let (s, e) = (b.started.unwrap(), b.ended.unwrap());
                assert!(b.issued <= s && s <= e && e <= step.comm_end);
            }
        }
        let summary = t.summary();
        assert!((0.0..=1.0).contains(&summary.hidden_fraction), "{summary}");
    }
    let path = std::env::temp_dir().join(format!("tandem-trace-{}.json", std::process::id()));
    telemetry[0].write_chrome_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("all_reduce bucket 0") && text.contains("backward (step 2)"));
    let _ = std::fs::remove_file(path);
}

/// `(SyncBatchNorm, BatchNorm2d)` counts in `m` and its descendants.
fn batch_norm_kinds(m: &dyn Module) -> (usize, usize) {
    let own = match m.type_name() {
        "SyncBatchNorm" => (1, 0),
        "BatchNorm2d" => (0, 1),
        _ => (0, 0),
    };
    m.children().iter().fold(own, |(s, b), (_, c)| {
        let (cs, cb) = batch_norm_kinds(c.as_ref());
        (s + cs, b + cb)
    })
}

#[test]
fn convert_sync_batch_norm_swaps_every_resnet_batch_norm_and_matches_the_full_batch() {
    const N: usize = 4;
    let mut g = tandem_core::rng::Generator::new(31);
    let x = Tensor::randn(
        &[N, 3, 8, 8],
        0.0,
        1.0,
        tandem_core::DType::F32,
        tandem_core::Device::Cpu,
        &mut g,
    )
    .unwrap();
    let resnet8 = || {
        tandem_core::rng::manual_seed(5);
        Arc::new(tandem_nn::resnet::resnet_cifar(8, CLASSES).unwrap()) as Arc<dyn Module>
    };
    // One process, plain BatchNorm over the whole batch.
    let want = resnet8().forward(&x).unwrap().to_vec_f64().unwrap();
    let per_rank = run_ranks(2, |rank, group| {
        let m = tandem_dist::convert_sync_batch_norm(resnet8(), group).unwrap();
        // stem + two per block + the two projection shortcuts
        assert_eq!(batch_norm_kinds(m.as_ref()), (9, 0));
        let out = m.forward(&shard(&x, rank, 2)).unwrap();
        out.to_vec_f64().unwrap()
    });
    let got: Vec<f64> = per_rank.concat();
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
    }
}

#[test]
fn a_backward_through_the_inner_modules_forward_is_reported_naming_ddp_forward() {
    let outcomes = run_ranks(2, |rank, group| {
        let ddp = DistributedDataParallel::new(build(Model::Mlp, 1), group, DdpConfig::default())
            .unwrap();
        let (x, y) = batch(Model::Mlp, 0);
        let (x, y) = (shard(&x, rank, 2), shard(&y, rank, 2));
        let step = |out: Tensor| cross_entropy(&out, &y, Reduction::Mean).unwrap().backward();
        step(ddp.forward(&x).unwrap()).expect("a step through DDP's forward");
        // Evaluation under no_grad has no backward: the module may be used directly.
        tandem_autograd::no_grad(|| ddp.module().forward(&x)).unwrap();
        let bypassed = step(ddp.module().forward(&x).unwrap())
            .expect_err("a backward through the module's own forward is reported")
            .to_string();
        // The gradients were reduced all the same.
        let grads = snapshot_grads(ddp.module().as_ref());
        // The next step through DDP's forward is not affected.
        step(ddp.forward(&x).unwrap()).expect("the next step through DDP's forward");
        (bypassed, grads)
    });
    for (rank, (err, _)) in outcomes.iter().enumerate() {
        assert!(
            err.contains(&format!("rank {rank}: DistributedDataParallel"))
                && err.contains("`ddp.module().forward(..)`")
                && err.contains("call `ddp.forward(..)` instead"),
            "{err}"
        );
    }
    assert_close("rank 1 vs rank 0", &outcomes[1].1, &outcomes[0].1, 0.0);
}

/// conv(1→4) → relu → linear, run under bf16 autocast. The conv's bf16 output is cast to f32
/// before the relu (the cast is where the gradient turns back into the conv's dtype); the
/// linear lowers it to bf16 again.
#[derive(Module)]
struct AmpCnn {
    conv: Child,
    fc: Child,
    training: TrainingFlag,
}

impl AmpCnn {
    fn new() -> AmpCnn {
        tandem_core::rng::manual_seed(7);
        AmpCnn {
            conv: Conv2dConfig::new(1, 4, 3)
                .with_padding(1)
                .init()
                .unwrap()
                .into(),
            fc: LinearConfig::new(4 * 8 * 8, CLASSES).init().unwrap().into(),
            training: TrainingFlag::new(),
        }
    }
}

impl Forward for AmpCnn {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        let h = tandem_ops::cast(&self.conv.forward(x)?, DType::F32)?;
        let h = tandem_ops::flatten(&tandem_ops::relu(&h)?, 1, -1)?;
        self.fc.forward(&h)
    }
}

/// One training run under bf16 autocast: full batch when `rank_world` is `None`, else this
/// rank's shard through DDP.
fn amp_run(rank_world: Option<(usize, Arc<dyn ProcessGroup>)>) -> Outcome {
    let model: Arc<dyn Module> = Arc::new(AmpCnn::new());
    let (module, ddp, rank, world) = match rank_world {
        None => (model, None, 0, 1),
        Some((rank, group)) => {
            let world = group.world_size();
            let ddp = DistributedDataParallel::new(model, group, DdpConfig::default()).unwrap();
            (ddp.module().clone(), Some(ddp), rank, world)
        }
    };
    let mut opt = sgd(module.parameters());
    let mut first_grads = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(Model::Cnn, step);
        opt.zero_grad().unwrap();
        let loss = autocast(DType::BF16, || {
            let x = shard(&x, rank, world);
            let out = match &ddp {
                Some(ddp) => ddp.forward(&x).unwrap(),
                None => module.forward(&x).unwrap(),
            };
            assert_eq!(out.dtype(), DType::BF16);
            cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap()
        })
        .unwrap();
        loss.backward().unwrap();
        if step == 0 {
            first_grads = snapshot_grads(module.as_ref());
        }
        opt.step().unwrap();
    }
    Outcome {
        first_grads,
        final_params: snapshot_params(module.as_ref()),
    }
}

#[test]
fn ddp_under_bf16_autocast_matches_single_process_full_batch_under_autocast() {
    // The ranks' per-sample activations are those of the full batch (each output element is
    // rounded once, whatever the batch); what differs is the weight gradients' sums: each rank
    // rounds its partial sum to bf16 (relative error ≤ u = 2⁻⁸) before the f32 all-reduce,
    // where one process rounds the total once. Two roundings of u, doubled for partial sums
    // that cancel: 4u = 2⁻⁶, relative to the largest gradient.
    let tol = 2f64.powi(-6);
    let want = amp_run(None);
    for world in [2, 4] {
        let outcomes = run_ranks(world, |rank, group| amp_run(Some((rank, group))));
        for (rank, got) in outcomes.iter().enumerate() {
            let what = format!("bf16 autocast, {world} ranks, rank {rank}");
            assert_close(
                &format!("{what}: first-step gradients"),
                &got.first_grads,
                &want.first_grads,
                tol,
            );
            assert_close(
                &format!("{what}: parameters after {STEPS} steps"),
                &got.final_params,
                &want.final_params,
                tol,
            );
        }
    }
}

#[test]
fn ddp_with_channels_last_models_matches_single_process_full_batch() {
    use tandem_core::MemoryFormat;
    let model = Model::Cnn;
    let want = reference(model, STEPS, 1);
    let outcomes = run_ranks(2, |rank, group| {
        let world = group.world_size();
        let m = build(model, 7);
        // Rank 0 converts before wrapping, rank 1 after (with its optimizer already made):
        // DDP and the optimizer keep the same tensors, and the buckets are read in logical
        // order, so a rank's memory format never changes what is reduced.
        if rank == 0 {
            m.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
        }
        let ddp = DistributedDataParallel::new(m, group, DdpConfig::default()).unwrap();
        let mut opt = sgd(ddp.module().parameters());
        if rank == 1 {
            ddp.module()
                .to_memory_format(MemoryFormat::ChannelsLast)
                .unwrap();
        }
        let mut first_grads = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(model, step);
            let x = shard(&x, rank, world)
                .contiguous_in(MemoryFormat::ChannelsLast)
                .unwrap();
            opt.zero_grad().unwrap();
            let out = ddp.forward(&x).unwrap();
            let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
            loss.backward().unwrap();
            if step == 0 {
                first_grads = snapshot_grads(ddp.module().as_ref());
            }
            opt.step().unwrap();
        }
        for (name, p) in ddp.module().named_parameters() {
            assert!(p.rank() != 4 || p.layout().is_channels_last(), "{name}");
        }
        Outcome {
            first_grads,
            final_params: snapshot_params(ddp.module().as_ref()),
        }
    });
    for (rank, got) in outcomes.iter().enumerate() {
        // The NHWC and NCHW f32 kernels sum in different orders.
        assert_close(
            &format!("rank {rank}: first-step gradients"),
            &got.first_grads,
            &want.first_grads,
            1e-4,
        );
        assert_close(
            &format!("rank {rank}: parameters after {STEPS} steps"),
            &got.final_params,
            &want.final_params,
            1e-4,
        );
    }
}
