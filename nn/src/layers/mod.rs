//! The layers: each a [`Module`](crate::Module) with PyTorch's semantics, defaults and
//! parameter names.

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
pub use dropout::Dropout;
pub use flatten::Flatten;
pub use linear::Linear;
pub use pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
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
