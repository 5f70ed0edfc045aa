//! `tandem-nn`: layers, initialisation and data loading for building and training models.
//!
//! Models implement [`Module`]: `forward`, named parameters and buffers with PyTorch's dotted
//! paths, and a train/eval switch, all through `&self` so a model can be shared across threads
//! as `Arc<dyn Module>`. Layers ([`Linear`], [`Conv2d`], [`BatchNorm2d`], …) are composed with
//! [`Sequential`]; [`init`] holds PyTorch's initialisers; [`data`] has datasets, samplers, a
//! prefetching [`DataLoader`](data::DataLoader) and MNIST; [`models`] has ready-made networks.
//! The losses of `tandem-ops` are re-exported in [`loss`] for convenience.

pub mod checkpoint;
pub mod data;
pub mod error;
pub mod init;
pub mod layers;
pub mod metrics;
pub mod models;
pub mod module;
pub mod resnet;
pub mod resnet_imagenet;

pub use error::{Error, Result};
pub use layers::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, BatchNormConfig, Conv2d, Conv2dConfig, Dropout,
    Flatten, IntoPair, Linear, MaxPool2d, ReLU, Sequential,
};
pub use module::{join_path, AsAny, Module, ParamKind, TrainingFlag};

/// The loss functions of `tandem-ops` (`cross_entropy`, `nll_loss`, `mse_loss`, `Reduction`).
pub mod loss {
    pub use tandem_ops::loss::{cross_entropy, mse_loss, nll_loss, Reduction};
}

#[cfg(test)]
mod tests;
