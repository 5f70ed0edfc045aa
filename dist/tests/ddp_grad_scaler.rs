//! The gradient scaler under DDP, ranks as threads: DDP all-reduces the gradients before the
//! scaler sees them, so a non-finite local gradient on one rank makes every rank's gradients
//! non-finite, every rank skips that step, and the scale backs off identically everywhere,
//! with no communication of the scaler's own.
//!
//! Also the scaler's state through a checkpoint (here because this crate's tests see both
//! `tandem-nn` and `tandem-optim`): a run saved mid-way with `TrainingState::with_grad_scaler`
//! and resumed in fresh objects continues with the same scale, growth tracker and skipped-step
//! count, and takes exactly the steps the uninterrupted run takes (the same skips,
//! bit-identical parameters).

mod ddp_common;

use std::sync::Arc;

use ddp_common::*;
use tandem_autograd::TensorBackward;
use tandem_core::rng::manual_seed;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_dist::{DdpConfig, DistributedDataParallel, ProcessGroup};
use tandem_nn::checkpoint::{load_training, save_training, TrainingState};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::{LinearConfig, Module, Sequential};
use tandem_optim::{GradScaler, GradScalerConfig, Optimizer, Sgd, SgdConfig, StepOutcome};

const STEPS: usize = 6;
/// The steps at which one rank's local gradients are made infinite before the all-reduce.
const BAD_STEPS: [usize; 2] = [1, 4];

fn scaler() -> GradScaler {
    GradScalerConfig::default()
        .with_growth_interval(2)
        .init()
        .unwrap()
}

/// What a rank's (or the reference's) run leaves behind.
#[derive(Debug, PartialEq)]
struct Run {
    outcomes: Vec<StepOutcome>,
    scales: Vec<f64>,
    skipped: u64,
    params: Snapshot,
}

/// `loss`, scaled, made infinite at the bad steps when `poison`.
fn scaled_loss(scaler: &GradScaler, loss: &Tensor, step: usize, poison: bool) -> Tensor {
    let scaled = scaler.scale(loss).unwrap();
    if poison && BAD_STEPS.contains(&step) {
        tandem_ops::mul_scalar(&scaled, f64::INFINITY).unwrap()
    } else {
        scaled
    }
}

fn train_rank(rank: usize, group: Arc<dyn ProcessGroup>, poisoned_rank: usize) -> Run {
    let world = group.world_size();
    let model = Model::Mlp;
    let ddp = DistributedDataParallel::new(build(model, 7), group, DdpConfig::default()).unwrap();
    let mut opt = sgd(ddp.module().parameters());
    let mut scaler = scaler();
    let (mut outcomes, mut scales) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch(model, step);
        opt.zero_grad().unwrap();
        let out = ddp.forward(&shard(&x, rank, world)).unwrap();
        let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
        scaled_loss(&scaler, &loss, step, rank == poisoned_rank)
            .backward()
            .unwrap();
        outcomes.push(scaler.step(&mut opt).unwrap());
        scaler.update().unwrap();
        scales.push(scaler.scale_value());
    }
    Run {
        outcomes,
        scales,
        skipped: scaler.skipped_steps(),
        params: snapshot_params(ddp.module().as_ref()),
    }
}

/// One process on the full batch, its loss made infinite at the same steps.
fn reference() -> Run {
    let model = Model::Mlp;
    let m = build(model, 7);
    let mut opt = sgd(m.parameters());
    let mut scaler = scaler();
    let (mut outcomes, mut scales) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch(model, step);
        opt.zero_grad().unwrap();
        let loss = cross_entropy(&m.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        scaled_loss(&scaler, &loss, step, true).backward().unwrap();
        outcomes.push(scaler.step(&mut opt).unwrap());
        scaler.update().unwrap();
        scales.push(scaler.scale_value());
    }
    Run {
        outcomes,
        scales,
        skipped: scaler.skipped_steps(),
        params: snapshot_params(m.as_ref()),
    }
}

#[test]
fn one_ranks_infinite_gradient_makes_every_rank_skip_and_back_off_alike() {
    let want = reference();
    let skipped: Vec<usize> = (0..STEPS)
        .filter(|&s| want.outcomes[s].is_skipped())
        .collect();
    assert_eq!(skipped, BAD_STEPS, "the reference skips the poisoned steps");
    // Growth interval 2: clean (2^16 kept); skip (2^15); clean; clean: grow (2^16); skip
    // (2^15); clean.
    let k = |e: i32| 2f64.powi(e);
    assert_eq!(want.scales, [k(16), k(15), k(15), k(16), k(15), k(15)]);
    for world in [2, 4] {
        let runs = run_ranks(world, |rank, group| train_rank(rank, group, world - 1));
        for (rank, got) in runs.iter().enumerate() {
            let what = format!("{world} ranks, rank {rank} (rank {} poisoned)", world - 1);
            assert_eq!(got.outcomes, want.outcomes, "{what}: outcomes");
            assert_eq!(got.scales, want.scales, "{what}: scales");
            assert_eq!(got.skipped, 2, "{what}: skipped steps");
            assert_eq!(
                got.params, runs[0].params,
                "{what}: parameters differ between ranks"
            );
            assert_close(&what, &got.params, &want.params, 1e-5);
        }
    }
}

fn small_model() -> Sequential {
    manual_seed(3);
    Sequential::new().add(LinearConfig::new(6, 4).init().unwrap())
}

fn resume_config() -> GradScalerConfig {
    GradScalerConfig::default()
        .with_init_scale(1000.0)
        .with_growth_factor(1.7)
        .with_backoff_factor(0.3)
        .with_growth_interval(2)
}

/// Steps at which the scaled loss is made infinite.
const RESUME_BAD: [usize; 3] = [1, 4, 5];

fn train_resumable(
    model: &Sequential,
    opt: &mut Sgd,
    scaler: &mut GradScaler,
    steps: std::ops::Range<usize>,
) -> Vec<(StepOutcome, f64)> {
    let mut out = Vec::new();
    for step in steps {
        let mut g = Generator::new(50 + step as u64);
        let x = Tensor::randn(&[8, 6], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let y =
            Tensor::from_vec((0..8).map(|i| (i % 4) as i64).collect(), &[8], Device::Cpu).unwrap();
        opt.zero_grad().unwrap();
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        let mut scaled = scaler.scale(&loss).unwrap();
        if RESUME_BAD.contains(&step) {
            scaled = tandem_ops::mul_scalar(&scaled, f64::INFINITY).unwrap();
        }
        scaled.backward().unwrap();
        out.push((scaler.step(opt).unwrap(), 0.0));
        scaler.update().unwrap();
        out.last_mut().unwrap().1 = scaler.scale_value();
    }
    out
}

fn parameter_values(m: &Sequential) -> Vec<Vec<f32>> {
    m.parameters().iter().map(|p| p.to_vec().unwrap()).collect()
}

#[test]
fn a_resumed_run_continues_with_the_same_scale_and_skips() {
    let sgd = |m: &Sequential| Sgd::new(m.parameters(), SgdConfig::new(0.1).with_momentum(0.9));
    let straight = small_model();
    let mut straight_opt = sgd(&straight).unwrap();
    let mut straight_scaler = resume_config().init().unwrap();
    let want = train_resumable(&straight, &mut straight_opt, &mut straight_scaler, 0..8);

    let first = small_model();
    let mut opt = sgd(&first).unwrap();
    let mut scaler = resume_config().init().unwrap();
    let mut got = train_resumable(&first, &mut opt, &mut scaler, 0..3);
    let dir = std::env::temp_dir().join(format!("tandem-grad-scaler-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.safetensors");
    let state = TrainingState::new()
        .with_optimizer("optimizer", opt.state())
        .with_grad_scaler(scaler.state());
    save_training(&path, &first, &state).unwrap();

    // A fresh process: new model, optimizer and a scaler with PyTorch's defaults.
    let resumed = small_model();
    let loaded = load_training(&path, &resumed).unwrap();
    let mut opt = sgd(&resumed).unwrap();
    opt.load_state(&loaded.optimizer("optimizer")).unwrap();
    let mut scaler = GradScaler::new();
    scaler.load_state(&loaded.grad_scaler()).unwrap();
    assert_eq!(scaler.scale_value(), got[2].1);
    assert_eq!((scaler.growth_tracker(), scaler.skipped_steps()), (1, 1));
    assert_eq!(scaler.config().growth_factor, 1.7);
    got.extend(train_resumable(&resumed, &mut opt, &mut scaler, 3..8));

    assert_eq!(got, want);
    assert_eq!(scaler.skipped_steps(), 3);
    assert_eq!(scaler.skipped_steps(), straight_scaler.skipped_steps());
    assert_eq!(parameter_values(&resumed), parameter_values(&straight));
    std::fs::remove_dir_all(&dir).unwrap();
}
