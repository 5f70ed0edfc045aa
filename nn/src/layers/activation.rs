//! Activation layers.

use tandem_core::Tensor;

use crate::Result;
use crate::{Forward, Module, TrainingFlag};

/// `max(x, 0)` elementwise. No parameters.
#[derive(Debug, Default, Module)]
pub struct ReLU {
    training: TrainingFlag,
}

impl ReLU {
    /// A ReLU layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Forward for ReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tandem_ops::relu(x)?)
    }
}
