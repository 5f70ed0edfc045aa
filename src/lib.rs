#![warn(missing_docs)]
#![doc = include_str!("../README.md")]

pub use tandem_autograd as autograd;
pub use tandem_core as core;
pub use tandem_dist as dist;
pub use tandem_nn as nn;
pub use tandem_ops as ops;
pub use tandem_optim as optim;

pub use tandem_autograd::autocast::{autocast, autocast_dtype, AutocastGuard};
pub use tandem_ops::{cast, TensorOps};

pub mod locate;

/// What a training program usually needs, in one import: `use tandem::prelude::*;`.
///
/// That includes every layer and its config (see "Building layers" in [`nn`]), and the
/// [`LrSchedule`](tandem_optim::LrSchedule) trait, whose `then` composes schedules:
///
/// ```
/// use tandem::prelude::*;
///
/// let model = Sequential::new()
///     .add(LinearConfig::new(4, 8).init()?)
///     .add(ReLU::new())
///     .add(DropoutConfig::new(0.1).init()?)
///     .add(LinearConfig::new(8, 2).with_bias(false).init()?);
/// let mut optimizer = Sgd::new(model.parameters(), SgdConfig::new(0.1))?;
/// let warmup_then_cosine = LinearWarmup::new(5, 0.25)?.then(CosineAnnealingLr::new(95, 0.0)?)?;
/// let mut scheduler = Scheduler::new(warmup_then_cosine, &mut optimizer)?;
/// scheduler.step(&mut optimizer)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub mod prelude {
    pub use tandem_autograd::autocast::{autocast, autocast_dtype, AutocastGuard};
    pub use tandem_autograd::{no_grad, TensorBackward};
    pub use tandem_core::rng::manual_seed;
    pub use tandem_core::{DType, Device, Generator, MemoryFormat, Tensor};
    pub use tandem_nn::checkpoint::{
        load_model, load_training, save_model, save_training, TrainingState,
    };
    pub use tandem_nn::data::{DataLoader, DataLoaderConfig, Dataset, Mnist, Split};
    pub use tandem_nn::loss::{cross_entropy, mse_loss, nll_loss, Reduction};
    pub use tandem_nn::metrics::{evaluate, Accuracy};
    pub use tandem_nn::models::lenet5;
    pub use tandem_nn::{
        AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, AvgPool2d, AvgPool2dConfig, BatchNorm2d,
        BatchNormConfig, Child, Conv2d, Conv2dConfig, Dropout, DropoutConfig, Flatten,
        FlattenConfig, Forward, Fused, Linear, LinearConfig, MaxPool2d, MaxPool2dConfig, Module,
        ReLU, Sequential, TrainingFlag,
    };
    pub use tandem_ops::{cast, TensorOps};
    pub use tandem_optim::{
        CosineAnnealingLr, LinearWarmup, LrSchedule, MultiStepLr, Optimizer, Scheduler, Sgd,
        SgdConfig, StepLr,
    };
}
