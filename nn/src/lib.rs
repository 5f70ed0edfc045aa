//! `tandem-nn`: layers, initialisation and data loading for building and training models.
//!
//! Models implement [`Module`]: `forward`, named parameters and buffers with PyTorch's dotted
//! paths, and a train/eval switch, all through `&self` so a model can be shared across threads
//! as `Arc<dyn Module>`. Layers ([`Linear`], [`Conv2d`], [`BatchNorm2d`], …) are composed with
//! [`Sequential`]; [`init`] holds PyTorch's initialisers; [`data`] has datasets, samplers, a
//! prefetching [`DataLoader`](data::DataLoader) and MNIST; [`models`] has ready-made networks.
//! The losses of `tandem-ops` are re-exported in [`loss`] for convenience.
//!
//! # Building layers
//!
//! Every layer with settings is built the same way: its config's `new` takes the settings
//! that have no default, `with_*` methods change the optional ones (PyTorch's defaults
//! otherwise; `with_device` on every layer that holds tensors, CPU by default), and `init()`
//! builds the layer:
//!
//! ```
//! use tandem_nn::{BatchNormConfig, Conv2dConfig, LinearConfig, MaxPool2dConfig};
//!
//! let conv = Conv2dConfig::new(3, 64, 3).with_padding(1).with_bias(false).init()?;
//! let bn = BatchNormConfig::new(64).with_momentum(0.01).init()?;
//! let pool = MaxPool2dConfig::new(3).with_stride(2).with_padding(1).init()?;
//! let fc = LinearConfig::new(64, 10).init()?;
//! # Ok::<(), tandem_nn::Error>(())
//! ```
//!
//! The rule: **a constructor returns `Result` exactly when its arguments can be invalid.**
//! `init()` checks the settings and returns an error naming the layer and the bad value
//! (a kernel size of 0, a dropout probability outside `[0, 1)`, …), so every `init()` returns
//! `Result`. A layer with no settings ([`ReLU`]) is built with `X::new()` (or `Default`); a
//! layer whose every setting has a default ([`Flatten`]) also has `X::new()` (and `Default`),
//! equal to `XConfig::default().init()`. Neither takes arguments, so neither can fail, and both
//! return the layer itself. Settings are named at the call site (`with_bias(false)`), never
//! positional booleans.
//!
//! Containers follow the same rule: [`Sequential::add`] names a child by its position and
//! cannot fail, [`Sequential::add_named`] takes a user's name, which can be invalid, and
//! returns `Result`.
#![warn(missing_docs)]

// The derive names this crate `::tandem_nn`; inside it, that is the crate itself.
extern crate self as tandem_nn;

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
    AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, AvgPool2d, AvgPool2dConfig, BatchNorm2d,
    BatchNormConfig, Conv2d, Conv2dConfig, Dropout, DropoutConfig, Flatten, FlattenConfig,
    IntoPair, Linear, LinearConfig, MaxPool2d, MaxPool2dConfig, ReLU, Sequential,
};
pub use module::{join_path, AsAny, Child, Forward, Fused, Module, ParamKind, TrainingFlag};
/// The memory formats [`Module::to_memory_format`] takes (from `tandem-core`).
pub use tandem_core::MemoryFormat;
pub use tandem_nn_derive::Module;

/// What the code written by `#[derive(Module)]` refers to; not for use by hand.
#[doc(hidden)]
pub mod __derive {
    pub use crate::module::no_such_child;
    pub use std::sync::Arc;
    pub use tandem_core::Tensor;
}

/// The loss functions of `tandem-ops` (`cross_entropy`, `nll_loss`, `mse_loss`, `Reduction`).
pub mod loss {
    pub use tandem_ops::loss::{cross_entropy, mse_loss, nll_loss, Reduction};
}

#[cfg(test)]
mod tests;
