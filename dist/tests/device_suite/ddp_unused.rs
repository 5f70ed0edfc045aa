//! DistributedDataParallel on a [`Backend`] with a parameter forward never uses, under
//! `find_unused_parameters` (the parameter keeps no gradient and SGD with momentum and weight
//! decay leaves it bit-unchanged) and without it (the next forward names the parameter).

use std::sync::Arc;

use tandem_autograd::TensorBackward;
use tandem_core::{Device, Tensor};
use tandem_dist::{DdpConfig, DistributedDataParallel};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_nn::module::{ParamKind, TrainingFlag};
use tandem_nn::{Linear, Module};
use tandem_optim::{Optimizer, Sgd, SgdConfig};

use super::ddp::{on, tolerance};
use super::{on_ranks, Backend};
use crate::ddp_common::{assert_close, batch, shard, snapshot_params, Model, CLASSES};

/// A model with a layer forward never uses.
struct WithUnused {
    used: Linear,
    never: Linear,
    training: TrainingFlag,
}

impl WithUnused {
    fn new(device: Device) -> Self {
        tandem_core::rng::manual_seed(3);
        let m = WithUnused {
            used: Linear::new(12, CLASSES, true).unwrap(),
            never: Linear::new(12, CLASSES, true).unwrap(),
            training: TrainingFlag::new(),
        };
        m.to_device(device).unwrap();
        m
    }
}

impl Module for WithUnused {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        self.used.forward(x)
    }
    fn training_flag(&self) -> &TrainingFlag {
        &self.training
    }
    fn visit_own(&self, visitor: &mut dyn FnMut(&str, ParamKind, &Tensor)) {
        self.used.visit("used", visitor);
        self.never.visit("never", visitor);
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

/// Under `find_unused_parameters`, a parameter no rank used keeps no gradient, so SGD with
/// momentum and weight decay leaves it bit-unchanged; the used ones match the full batch.
/// Without the option the next forward fails naming it.
pub fn an_unused_parameter_is_left_untouched(backend: Backend) {
    let device = backend.device();
    let steps = 3;
    // One process on the full batch.
    let single = WithUnused::new(device);
    let initial = snapshot_params(&single);
    let mut opt = decaying_sgd(single.parameters());
    for step in 0..steps {
        let (x, y) = batch(Model::Mlp, step);
        opt.zero_grad().unwrap();
        let out = single.forward(&on(device, &x)).unwrap();
        cross_entropy(&out, &on(device, &y), Reduction::Mean)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
    }
    let want = snapshot_params(&single);

    let world = 2;
    let results = on_ranks(backend, world, |rank, group| {
        let config = DdpConfig {
            find_unused_parameters: true,
            ..DdpConfig::default()
        };
        let ddp =
            DistributedDataParallel::new(Arc::new(WithUnused::new(device)), group, config).unwrap();
        let mut opt = decaying_sgd(ddp.module().parameters());
        for step in 0..steps {
            let (x, y) = batch(Model::Mlp, step);
            opt.zero_grad().unwrap();
            let out = ddp.forward(&on(device, &shard(&x, rank, world))).unwrap();
            cross_entropy(&out, &on(device, &shard(&y, rank, world)), Reduction::Mean)
                .unwrap()
                .backward()
                .unwrap_or_else(|e| panic!("{backend} rank {rank}, step {step}: backward: {e}"));
            opt.step().unwrap();
        }
        let never_grads: Vec<(String, bool)> = ddp
            .module()
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, p.grad().is_some()))
            .collect();
        (snapshot_params(ddp.module().as_ref()), never_grads)
    });
    for (rank, (params, has_grad)) in results.iter().enumerate() {
        for (name, has) in has_grad {
            assert_eq!(
                *has,
                name.starts_with("used."),
                "{backend} rank {rank}: `{name}` {} a gradient",
                if *has { "has" } else { "has no" }
            );
        }
        let (never, used): (Vec<_>, Vec<_>) = params
            .iter()
            .cloned()
            .partition(|(n, _)| n.starts_with("never."));
        let initial_never: Vec<_> = initial
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
        let want_used: Vec<_> = want
            .iter()
            .filter(|(n, _)| n.starts_with("used."))
            .cloned()
            .collect();
        assert_close(
            &format!("{backend} rank {rank}: the used layer after {steps} steps vs one process"),
            &used,
            &want_used,
            tolerance(device),
        );
    }

    // Without the option: the next forward names the parameters.
    let errors = on_ranks(backend, world, |rank, group| {
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
    });
    for (rank, err) in errors.into_iter().enumerate() {
        let err = err.unwrap_or_else(|| {
            panic!("{backend} rank {rank}: the forward after an unused parameter must fail")
        });
        assert!(
            err.contains("`never.weight`") && err.contains("find_unused_parameters"),
            "{backend} rank {rank}: {err}"
        );
    }
}
