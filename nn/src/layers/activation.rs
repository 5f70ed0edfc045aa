//! Activation layers.

use tandem_core::Tensor;

use crate::module::{Module, TrainingFlag};
use crate::Result;

/// `max(x, 0)` elementwise. No parameters.
#[derive(Debug, Default)]
pub struct ReLU {
    training: TrainingFlag,
}

impl ReLU {
    /// A ReLU layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Module for ReLU {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(tandem_ops::relu(x)?)
    }

    fn training_flag(&self) -> &TrainingFlag {
        &self.training
    }
}
