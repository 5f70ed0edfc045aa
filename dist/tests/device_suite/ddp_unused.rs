//! DistributedDataParallel on a [`Backend`] with a parameter forward never uses, under
//! `find_unused_parameters` (the parameter keeps no gradient and SGD with momentum and weight
//! decay leaves it bit-unchanged) and without it (the next forward names the parameter).

use std::sync::Arc;

use tandem_autograd::TensorBackward;
use tandem_core::{Device, Tensor};
use tandem_dist::{DdpConfig, DistributedDataParallel, ProcessGroup};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::{Child, Forward, TrainingFlag};
use tandem_nn::{LinearConfig, Module};
use tandem_optim::{Optimizer, Sgd, SgdConfig};

use super::ddp::{on, tolerance};
use super::{on_ranks, Backend};
use crate::ddp_common::{assert_close, batch, shard, snapshot_params, Model, Snapshot, CLASSES};

/// A model with a layer forward never uses.
#[derive(Module)]
struct WithUnused {
    used: Child,
    never: Child,
    training: TrainingFlag,
}

impl WithUnused {
    fn new(device: Device) -> Self {
        tandem_core::rng::manual_seed(3);
        let m = WithUnused {
            used: LinearConfig::new(12, CLASSES).init().unwrap().into(),
            never: LinearConfig::new(12, CLASSES).init().unwrap().into(),
            training: TrainingFlag::new(),
        };
        m.to_device(device).unwrap();
        m
    }
}

impl Forward for WithUnused {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        self.used.forward(x)
    }
}

fn decaying_sgd(params: Vec<Tensor>) -> Sgd {
    Sgd::new(
        params,
        SgdConfig::new(0.1)
            .with_momentum(0.9)
            .with_weight_decay(0.1),
    )
    .unwrap()
}

/// Steps of the run with an unused parameter.
pub const UNUSED_STEPS: usize = 3;

/// Under `find_unused_parameters`, a parameter no rank used keeps no gradient, so SGD with
/// momentum and weight decay leaves it bit-unchanged; the used ones match the full batch.
/// Without the option the next forward fails naming it.
pub fn an_unused_parameter_is_left_untouched(backend: Backend) {
    let device = backend.device();
    let reference = unused_reference(device);
    let world = 2;
    let results = on_ranks(backend, world, unused_rank);
    check_unused(
        &backend.to_string(),
        &results,
        &reference,
        tolerance(device),
    );
    let errors = on_ranks(backend, world, |rank, group| {
        unused_without_the_option_rank(rank, group)
    });
    check_unused_errors(&backend.to_string(), &errors);
}

/// The model's parameters before and after [`UNUSED_STEPS`] steps of one process on the full
/// batch on `device`.
pub struct UnusedReference {
    pub initial: Snapshot,
    pub trained: Snapshot,
}

/// One process on the full batch, the reference of [`check_unused`].
pub fn unused_reference(device: Device) -> UnusedReference {
    let single = WithUnused::new(device);
    let initial = snapshot_params(&single);
    let mut opt = decaying_sgd(single.parameters());
    for step in 0..UNUSED_STEPS {
        let (x, y) = batch(Model::Mlp, step);
        opt.zero_grad().unwrap();
        let out = single.forward(&on(device, &x)).unwrap();
        cross_entropy(&out, &on(device, &y), Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
    }
    UnusedReference {
        initial,
        trained: snapshot_params(&single),
    }
}

/// What one rank of the run under `find_unused_parameters` reports: its parameters after
/// [`UNUSED_STEPS`] steps, and whether each parameter has a gradient (1) or not (0).
pub struct UnusedOutcome {
    pub params: Snapshot,
    pub has_grad: Snapshot,
}

/// One rank training the model with an unused layer under `find_unused_parameters` on its
/// group's device.
pub fn unused_rank(rank: usize, group: Arc<dyn ProcessGroup>) -> UnusedOutcome {
    let device = group.comm_stream().device();
    let world = group.world_size();
    let config = DdpConfig {
        find_unused_parameters: true,
        ..DdpConfig::default()
    };
    let ddp =
        DistributedDataParallel::new(Arc::new(WithUnused::new(device)), group, config).unwrap();
    let mut opt = decaying_sgd(ddp.module().parameters());
    for step in 0..UNUSED_STEPS {
        let (x, y) = batch(Model::Mlp, step);
        opt.zero_grad().unwrap();
        let out = ddp.forward(&on(device, &shard(&x, rank, world))).unwrap();
        cross_entropy(&out, &on(device, &shard(&y, rank, world)), Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap_or_else(|e| panic!("{device} rank {rank}, step {step}: backward: {e}"));
        opt.step().unwrap();
    }
    let has_grad = ddp
        .module()
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, vec![if p.grad().is_some() { 1.0 } else { 0.0 }]))
        .collect();
    UnusedOutcome {
        params: snapshot_params(ddp.module().as_ref()),
        has_grad,
    }
}

/// Every rank's outcome against the reference: the unused layer bit-unchanged and without a
/// gradient, the used one trained as one process on the full batch (within `tol`).
pub fn check_unused(
    backend: &str,
    results: &[UnusedOutcome],
    reference: &UnusedReference,
    tol: f64,
) {
    let steps = UNUSED_STEPS;
    for (rank, outcome) in results.iter().enumerate() {
        for (name, has) in &outcome.has_grad {
            let has = has == &[1.0];
            assert_eq!(
                has,
                name.starts_with("used."),
                "{backend} rank {rank}: `{name}` {} a gradient",
                if has { "has" } else { "has no" }
            );
        }
        let (never, used): (Vec<_>, Vec<_>) = outcome
            .params
            .iter()
            .cloned()
            .partition(|(n, _)| n.starts_with("never."));
        let initial_never: Vec<_> = reference
            .initial
            .iter()
            .filter(|(n, _)| n.starts_with("never."))
            .cloned()
            .collect();
        assert_close(
            &format!("{backend} rank {rank}: the never-used layer after {steps} steps (must be bit-unchanged)"),
            &never,
            &initial_never,
            0.0,
        );
        let want_used: Vec<_> = reference
            .trained
            .iter()
            .filter(|(n, _)| n.starts_with("used."))
            .cloned()
            .collect();
        assert_close(
            &format!("{backend} rank {rank}: the used layer after {steps} steps vs one process"),
            &used,
            &want_used,
            tol,
        );
    }
}

/// One rank without `find_unused_parameters`: one step, then the error of the next forward
/// (`None` if it succeeded).
pub fn unused_without_the_option_rank(rank: usize, group: Arc<dyn ProcessGroup>) -> Option<String> {
    let device = group.comm_stream().device();
    let world = group.world_size();
    let ddp = DistributedDataParallel::new(
        Arc::new(WithUnused::new(device)),
        group,
        DdpConfig::default(),
    )
    .unwrap();
    let (x, y) = batch(Model::Mlp, 0);
    let (x, y) = (
        on(device, &shard(&x, rank, world)),
        on(device, &shard(&y, rank, world)),
    );
    let out = ddp.forward(&x).unwrap();
    cross_entropy(&out, &y, Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    ddp.forward(&x).err().map(|e| e.to_string())
}

/// Every rank's forward after an unused parameter, without the option, failed naming it.
pub fn check_unused_errors(backend: &str, errors: &[Option<String>]) {
    for (rank, err) in errors.iter().enumerate() {
        let err = err.as_ref().unwrap_or_else(|| {
            panic!("{backend} rank {rank}: the forward after an unused parameter must fail")
        });
        assert!(
            err.contains("`never.weight`") && err.contains("find_unused_parameters"),
            "{backend} rank {rank}: {err}"
        );
    }
}
