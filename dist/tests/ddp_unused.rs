//! `find_unused_parameters`: a parameter no rank used keeps its `.grad` as it was (`None`), so
//! weight decay and momentum leave it bit-unchanged, as one process on the full batch does;
//! a parameter used on some ranks but not others gets the full-batch average.

mod ddp_common;

use std::sync::Arc;

use ddp_common::*;
use tandem_autograd::TensorBackward;
use tandem_core::{Device, Tensor};
use tandem_dist::{DdpConfig, DistributedDataParallel};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::{Child, Forward, TrainingFlag};
use tandem_nn::{LinearConfig, Module};
use tandem_optim::{AdamConfig, AdamW, Optimizer, Sgd, SgdConfig};

const STEPS: usize = 4;
const FEATURES: usize = 12;
/// Inputs whose last feature exceeds this go through the gated layer.
const GATE: f32 = 5.0;

/// `used(x)`, plus `gated(x)` on the rows whose last feature exceeds [`GATE`] (the layer is
/// not touched at all when no row does), and a layer `never` that forward never touches.
#[derive(Module)]
struct Gated {
    used: Child,
    gated: Child,
    never: Child,
    training: TrainingFlag,
}

impl Gated {
    fn new() -> Self {
        tandem_core::rng::manual_seed(21);
        Gated {
            used: LinearConfig::new(FEATURES, CLASSES).init().unwrap().into(),
            gated: LinearConfig::new(FEATURES, CLASSES).init().unwrap().into(),
            never: LinearConfig::new(FEATURES, CLASSES).init().unwrap().into(),
            training: TrainingFlag::new(),
        }
    }
}

impl Forward for Gated {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        let h = self.used.forward(x)?;
        let rows = x.dims()[0];
        let values = x.to_vec::<f32>()?;
        let mask: Vec<f32> = (0..rows)
            .map(|r| (values[r * FEATURES + FEATURES - 1] > GATE) as u8 as f32)
            .collect();
        if mask.iter().all(|&m| m == 0.0) {
            return Ok(h);
        }
        let mask = Tensor::from_vec(mask, &[rows, 1], Device::Cpu)?;
        let gated = tandem_ops::mul(&self.gated.forward(x)?, &mask)?;
        Ok(tandem_ops::add(&h, &gated)?)
    }
}

/// The global batch of `step`: rows `4·(step mod 4)` to `+2` pass the gate, so with 2 or 4
/// ranks the gated layer is used on one rank per step and a different one as steps go on.
fn gated_batch(step: usize) -> (Tensor, Tensor) {
    let (x, y) = batch(Model::Mlp, step);
    let mut values = x.to_vec::<f32>().unwrap();
    for r in 0..GLOBAL_BATCH {
        let gated = (4 * (step % 4)..4 * (step % 4) + 3).contains(&r);
        values[r * FEATURES + FEATURES - 1] = if gated { 10.0 } else { -1.0 };
    }
    (
        Tensor::from_vec(values, &[GLOBAL_BATCH, FEATURES], Device::Cpu).unwrap(),
        y,
    )
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    SgdDecayMomentum,
    AdamW,
}

fn optimizer(kind: Opt, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match kind {
        Opt::SgdDecayMomentum => Box::new(
            Sgd::new(
                params,
                SgdConfig::new(0.1)
                    .with_momentum(0.9)
                    .with_weight_decay(0.05),
            )
            .unwrap(),
        ),
        Opt::AdamW => Box::new(AdamW::new(params, AdamConfig::adamw(0.01)).unwrap()),
    }
}

/// Parameters (bit patterns) after `STEPS` steps, and which had no gradient at the end.
struct Trained {
    params: Vec<(String, Vec<u32>)>,
    without_grad: Vec<String>,
}

fn trained(m: &dyn Module) -> Trained {
    let named = m.named_parameters();
    Trained {
        params: named
            .iter()
            .map(|(n, p)| {
                let bits = p
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                (n.clone(), bits)
            })
            .collect(),
        without_grad: named
            .iter()
            .filter(|(_, p)| p.grad().is_none())
            .map(|(n, _)| n.clone())
            .collect(),
    }
}

fn single_process(kind: Opt) -> Trained {
    let m = Gated::new();
    let mut opt = optimizer(kind, m.parameters());
    for step in 0..STEPS {
        let (x, y) = gated_batch(step);
        opt.zero_grad().unwrap();
        let loss = cross_entropy(&m.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    trained(&m)
}

fn data_parallel(kind: Opt, world: usize) -> Vec<Trained> {
    run_ranks(world, |rank, group| {
        let config = DdpConfig {
            find_unused_parameters: true,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(Arc::new(Gated::new()), group, config).unwrap();
        let mut opt = optimizer(kind, ddp.module().parameters());
        for step in 0..STEPS {
            let (x, y) = gated_batch(step);
            opt.zero_grad().unwrap();
            let out = ddp.forward(&shard(&x, rank, world)).unwrap();
            let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        trained(ddp.module().as_ref())
    })
}

fn check(kind: Opt) {
    let initial = trained(&Gated::new());
    let want = single_process(kind);
    assert_eq!(want.without_grad, ["never.weight", "never.bias"]);
    for world in [2, 4] {
        for (rank, got) in data_parallel(kind, world).iter().enumerate() {
            let what = format!("{kind:?}, {world} ranks, rank {rank}");
            assert_eq!(got.without_grad, want.without_grad, "{what}");
            for (((name, got), (_, want)), (_, init)) in
                got.params.iter().zip(&want.params).zip(&initial.params)
            {
                if name.starts_with("never.") {
                    assert_eq!(got, init, "{what}: `{name}` moved");
                    continue;
                }
                assert_ne!(got, init, "{what}: `{name}` did not train");
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{what}: `{name}`[{i}] is {g}, one process on the full batch has {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn sgd_weight_decay_and_momentum_leave_a_parameter_no_rank_used_bit_unchanged() {
    check(Opt::SgdDecayMomentum);
}

#[test]
fn adamw_leaves_a_parameter_no_rank_used_bit_unchanged() {
    check(Opt::AdamW);
}
