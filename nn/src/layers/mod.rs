//! The layers: each a [`Module`](crate::Module) with PyTorch's semantics, defaults and
//! parameter names, built from its config (see "Building layers" in the [crate docs](crate)).

mod activation;
mod batch_norm;
mod conv;
mod dropout;
mod flatten;
mod linear;
mod pool;
mod sequential;

pub use activation::ReLU;
pub use batch_norm::{BatchNorm2d, BatchNormConfig};
pub use conv::{Conv2d, Conv2dConfig};
pub use dropout::{Dropout, DropoutConfig};
pub use flatten::{Flatten, FlattenConfig};
pub use linear::{Linear, LinearConfig};
pub use pool::{
    AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, AvgPool2d, AvgPool2dConfig, MaxPool2d,
    MaxPool2dConfig,
};
pub use sequential::Sequential;

/// A 2-D size given as one number for both dims (`3`) or as `(height, width)`.
pub trait IntoPair {
    /// `(height, width)`.
    fn into_pair(self) -> (usize, usize);
}

impl IntoPair for usize {
    fn into_pair(self) -> (usize, usize) {
        (self, self)
    }
}

impl IntoPair for (usize, usize) {
    fn into_pair(self) -> (usize, usize) {
        self
    }
}
