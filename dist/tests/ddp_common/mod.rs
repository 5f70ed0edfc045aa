//! Shared pieces of the DDP tests: the models, the data, a single-process reference trainer
//! and a way to run ranks as threads.

#![allow(dead_code)]

use std::sync::Arc;

use tandem_autograd::TensorBackward;
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_dist::{DdpConfig, DistributedDataParallel, ProcessGroup, ThreadProcessGroup};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::{
    BatchNormConfig, Conv2dConfig, Flatten, LinearConfig, MaxPool2dConfig, Module, ReLU, Sequential,
};
use tandem_optim::{Optimizer, Sgd, SgdConfig};

/// Which model a test trains.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Model {
    Mlp,
    Cnn,
    CnnBatchNorm,
}

pub const GLOBAL_BATCH: usize = 16;
pub const CLASSES: usize = 5;

pub fn build(model: Model, seed: u64) -> Arc<dyn Module> {
    tandem_core::rng::manual_seed(seed);
    let m: Sequential = match model {
        Model::Mlp => Sequential::new()
            .add(LinearConfig::new(12, 16).init().unwrap())
            .add(ReLU::new())
            .add(LinearConfig::new(16, 16).init().unwrap())
            .add(ReLU::new())
            .add(LinearConfig::new(16, CLASSES).init().unwrap()),
        Model::Cnn => Sequential::new()
            .add(Conv2dConfig::new(1, 4, 3).with_padding(1).init().unwrap())
            .add(ReLU::new())
            .add(MaxPool2dConfig::new(2).init().unwrap())
            .add(Conv2dConfig::new(4, 6, 3).with_padding(1).init().unwrap())
            .add(ReLU::new())
            .add(Flatten::new())
            .add(LinearConfig::new(6 * 4 * 4, CLASSES).init().unwrap()),
        Model::CnnBatchNorm => Sequential::new()
            .add(Conv2dConfig::new(1, 4, 3).with_padding(1).init().unwrap())
            .add(BatchNormConfig::new(4).init().unwrap())
            .add(ReLU::new())
            .add(MaxPool2dConfig::new(2).init().unwrap())
            .add(Conv2dConfig::new(4, 6, 3).with_padding(1).init().unwrap())
            .add(BatchNormConfig::new(6).init().unwrap())
            .add(ReLU::new())
            .add(Flatten::new())
            .add(LinearConfig::new(6 * 4 * 4, CLASSES).init().unwrap()),
    };
    Arc::new(m)
}

/// The global batch of step `step`: inputs and labels.
pub fn batch(model: Model, step: usize) -> (Tensor, Tensor) {
    let mut g = Generator::new(1000 + step as u64);
    let shape: &[usize] = match model {
        Model::Mlp => &[GLOBAL_BATCH, 12],
        _ => &[GLOBAL_BATCH, 1, 8, 8],
    };
    let x = Tensor::randn(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let labels: Vec<i64> = (0..GLOBAL_BATCH).map(|_| g.below(CLASSES) as i64).collect();
    (
        x,
        Tensor::from_vec(labels, &[GLOBAL_BATCH], Device::Cpu).unwrap(),
    )
}

/// Rows `start..start+len` of a batch.
pub fn rows(t: &Tensor, start: usize, len: usize) -> Tensor {
    tandem_ops::narrow(t, 0, start, len)
        .unwrap()
        .contiguous_detached()
        .unwrap()
}

/// Rank `rank`'s share of a global batch split over `world` ranks.
pub fn shard(t: &Tensor, rank: usize, world: usize) -> Tensor {
    let per = t.dims()[0] / world;
    rows(t, rank * per, per)
}

pub fn sgd(params: Vec<Tensor>) -> Sgd {
    Sgd::new(params, SgdConfig::new(0.1).with_momentum(0.9)).unwrap()
}

/// Named tensors' values, in registration order.
pub type Snapshot = Vec<(String, Vec<f32>)>;

/// What a run leaves behind: the gradients of the first step and the parameters after all steps.
pub struct Outcome {
    pub first_grads: Vec<(String, Vec<f32>)>,
    pub final_params: Vec<(String, Vec<f32>)>,
}

pub fn snapshot_grads(m: &dyn Module) -> Vec<(String, Vec<f32>)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().unwrap().to_vec::<f32>().unwrap()))
        .collect()
}

pub fn snapshot_params(m: &dyn Module) -> Vec<(String, Vec<f32>)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.to_vec::<f32>().unwrap()))
        .collect()
}

/// One process trains on the full global batch (`chunks` > 1: BatchNorm sees each of `chunks`
/// equal parts separately and the loss is the mean of the parts' losses).
pub fn reference(model: Model, steps: usize, chunks: usize) -> Outcome {
    let m = build(model, 7);
    let mut opt = sgd(m.parameters());
    let mut first_grads = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(model, step);
        opt.zero_grad().unwrap();
        let per = GLOBAL_BATCH / chunks;
        let mut total: Option<Tensor> = None;
        for c in 0..chunks {
            let out = m.forward(&rows(&x, c * per, per)).unwrap();
            let loss = cross_entropy(&out, &rows(&y, c * per, per), Reduction::Mean).unwrap();
            let loss = tandem_ops::mul_scalar(&loss, 1.0 / chunks as f64).unwrap();
            total = Some(match total {
                None => loss,
                Some(t) => tandem_ops::add(&t, &loss).unwrap(),
            });
        }
        total.unwrap().backward().unwrap();
        if step == 0 {
            first_grads = snapshot_grads(m.as_ref());
        }
        opt.step().unwrap();
    }
    Outcome {
        first_grads,
        final_params: snapshot_params(m.as_ref()),
    }
}

/// Runs `f(rank, group)` on `world` ranks as threads of this process.
pub fn run_ranks<T: Send>(
    world: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    let groups = ThreadProcessGroup::new_group(world).unwrap();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| s.spawn(move || f(rank, Arc::new(g) as Arc<dyn ProcessGroup>)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// DDP training of `model` on this rank's shard for `steps` steps; `prepare` may convert the
/// model (e.g. to SyncBatchNorm) before wrapping.
pub fn train_ddp(
    model: Model,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    steps: usize,
    config: DdpConfig,
    sync_bn: bool,
) -> (Outcome, DistributedDataParallel) {
    let world = group.world_size();
    let mut m = build(model, 7);
    if sync_bn {
        m = tandem_dist::convert_sync_batch_norm(m, group.clone()).unwrap();
    }
    let ddp = DistributedDataParallel::new(m, group, config).unwrap();
    let mut opt = sgd(ddp.module().parameters());
    let mut first_grads = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(model, step);
        opt.zero_grad().unwrap();
        let out = ddp.forward(&shard(&x, rank, world)).unwrap();
        let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
        loss.backward().unwrap();
        if step == 0 {
            first_grads = snapshot_grads(ddp.module().as_ref());
        }
        opt.step().unwrap();
    }
    let outcome = Outcome {
        first_grads,
        final_params: snapshot_params(ddp.module().as_ref()),
    };
    (outcome, ddp)
}

/// Largest |a − b| over the largest |b|, per named tensor; panics past `tol`. Gradients that
/// are zero in exact arithmetic (a bias followed by BatchNorm) are compared with an absolute
/// floor of 1e-6 instead, since their float values are rounding noise.
pub fn assert_close(what: &str, got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: different parameter lists");
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn);
        let scale = w
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs() as f64))
            .max(1e-12);
        let err = g
            .iter()
            .zip(w)
            .fold(0.0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
        assert!(
            err <= tol * scale || (scale < 1e-5 && err <= 1e-6),
            "{what}: `{gn}` relative error {:.3e} > {tol:.0e} (largest value {scale:.3e})",
            err / scale
        );
    }
}

/// Prints `snapshot` for a parent process to read back with [`parse_snapshot`]: one line
/// `<tag> <name> <v>,<v>,…` a tensor (Rust prints the shortest decimal that parses back to the
/// same f32, so the values travel bit for bit).
pub fn print_snapshot(tag: &str, snapshot: &[(String, Vec<f32>)]) {
    for (name, values) in snapshot {
        let text: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        println!("{tag} {name} {}", text.join(","));
    }
}

/// The tensors a child printed with [`print_snapshot`] under `tag`, in order.
pub fn parse_snapshot(tag: &str, output: &str) -> Snapshot {
    tagged_lines(tag, output)
        .map(|l| {
            let (name, values) = l
                .split_once(' ')
                .unwrap_or_else(|| panic!("`{tag}` line without values: {l:?}"));
            let values = if values.is_empty() {
                Vec::new()
            } else {
                values
                    .split(',')
                    .map(|v| {
                        v.parse()
                            .unwrap_or_else(|e| panic!("{tag} {name}: {v:?}: {e}"))
                    })
                    .collect()
            };
            (name.to_string(), values)
        })
        .collect()
}

/// What follows `<tag> ` on each line of `output` that has it, in order. libtest may print
/// "test worker ... " in front of a worker's first line; the tag must be a word of its own
/// (`grads` does not match `first-grads`).
pub fn tagged_lines<'a>(tag: &str, output: &'a str) -> impl Iterator<Item = &'a str> {
    let marker = format!("{tag} ");
    output.lines().filter_map(move |l| {
        l.match_indices(&marker)
            .find(|(at, _)| *at == 0 || l[..*at].ends_with(' '))
            .map(|(at, _)| &l[at + marker.len()..])
    })
}
