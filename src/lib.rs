#![doc = include_str!("../README.md")]

pub use tandem_autograd as autograd;
pub use tandem_core as core;
pub use tandem_dist as dist;
pub use tandem_nn as nn;
pub use tandem_ops as ops;
pub use tandem_optim as optim;

pub use tandem_ops::TensorOps;

pub mod locate;

/// What a training program usually needs, in one import: `use tandem::prelude::*;`.
pub mod prelude {
    pub use tandem_autograd::{no_grad, TensorBackward};
    pub use tandem_core::rng::manual_seed;
    pub use tandem_core::{DType, Device, Generator, Tensor};
    pub use tandem_nn::checkpoint::{
        load_model, load_training, save_model, save_training, TrainingState,
    };
    pub use tandem_nn::data::{DataLoader, DataLoaderConfig, Dataset, Mnist, Split};
    pub use tandem_nn::loss::{cross_entropy, mse_loss, nll_loss, Reduction};
    pub use tandem_nn::metrics::{evaluate, Accuracy};
    pub use tandem_nn::models::lenet5;
    pub use tandem_nn::{
        BatchNorm2d, Conv2d, Conv2dConfig, Dropout, Flatten, Linear, MaxPool2d, Module, ReLU,
        Sequential,
    };
    pub use tandem_ops::TensorOps;
    pub use tandem_optim::{Optimizer, Sgd, SgdConfig};
}
