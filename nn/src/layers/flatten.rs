//! Flattening a range of dims into one.

use tandem_core::Tensor;

use crate::Result;
use crate::{Forward, Module, TrainingFlag};

/// Merges dims `start_dim..=end_dim` into one; by default everything but the batch dim
/// (`start_dim` 1, `end_dim` −1), turning `[N, C, H, W]` into `[N, C·H·W]`.
#[derive(Debug, Module)]
pub struct Flatten {
    start_dim: isize,
    end_dim: isize,
    training: TrainingFlag,
}

impl Flatten {
    /// Flattens all dims after the batch dim.
    pub fn new() -> Self {
        Self::with_dims(1, -1)
    }

    /// Flattens `start_dim..=end_dim` (negative counts from the end).
    pub fn with_dims(start_dim: isize, end_dim: isize) -> Self {
        Flatten {
            start_dim,
            end_dim,
            training: TrainingFlag::new(),
        }
    }
}

impl Default for Flatten {
    fn default() -> Self {
        Self::new()
    }
}

impl Forward for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tandem_ops::flatten(x, self.start_dim, self.end_dim)?)
    }
}
