//! Flattening a range of dims into one.

use tandem_core::Tensor;

use crate::{Error, Result};
use crate::{Forward, Module, TrainingFlag};

/// How to build a [`Flatten`]: every setting has a default (PyTorch's: `start_dim` 1,
/// `end_dim` −1, everything but the batch dim), changed with `with_*`, then
/// [`FlattenConfig::init`]. The default layer is also [`Flatten::new`].
///
/// ```
/// # use tandem_nn::FlattenConfig;
/// // [N, C, H, W] → [N, C, H·W]
/// let spatial = FlattenConfig::new().with_start_dim(2).init()?;
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlattenConfig {
    /// First dim to merge (negative counts from the end).
    pub start_dim: isize,
    /// Last dim to merge, inclusive (negative counts from the end).
    pub end_dim: isize,
}

impl Default for FlattenConfig {
    fn default() -> Self {
        FlattenConfig {
            start_dim: 1,
            end_dim: -1,
        }
    }
}

impl FlattenConfig {
    /// The default: flatten everything after the batch dim.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same config starting at dim `start_dim`.
    pub fn with_start_dim(self, start_dim: isize) -> Self {
        FlattenConfig { start_dim, ..self }
    }

    /// The same config ending at dim `end_dim` (inclusive).
    pub fn with_end_dim(self, end_dim: isize) -> Self {
        FlattenConfig { end_dim, ..self }
    }

    /// The layer. Errors (naming `Flatten` and the dims) if `start_dim` comes after `end_dim`
    /// whatever the input's rank (both counted from the same end); dims that are out of range
    /// for an input are reported by the forward, which knows the rank.
    pub fn init(&self) -> Result<Flatten> {
        let (start, end) = (self.start_dim, self.end_dim);
        if (start >= 0) == (end >= 0) && start > end {
            return Err(Error::config(
                "Flatten",
                format!("start_dim {start} comes after end_dim {end}"),
            ));
        }
        Ok(self.build())
    }

    /// The layer, without the checks ([`Flatten::new`]'s default config passes them).
    fn build(self) -> Flatten {
        Flatten {
            start_dim: self.start_dim,
            end_dim: self.end_dim,
            training: TrainingFlag::new(),
        }
    }
}

/// Merges dims `start_dim..=end_dim` into one; by default everything but the batch dim
/// (`start_dim` 1, `end_dim` −1), turning `[N, C, H, W]` into `[N, C·H·W]`. Other dims are
/// set with [`FlattenConfig`].
#[derive(Debug, Module)]
pub struct Flatten {
    start_dim: isize,
    end_dim: isize,
    training: TrainingFlag,
}

impl Flatten {
    /// Flattens all dims after the batch dim: `FlattenConfig::default().init()`, which cannot
    /// fail, so this returns the layer itself (see the crate docs, "Building layers").
    pub fn new() -> Self {
        FlattenConfig::default().build()
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

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Device};

    #[test]
    fn flatten_merges_the_configured_dims() {
        let x = Tensor::zeros(&[2, 3, 4, 5], DType::F32, Device::Cpu).unwrap();
        assert_eq!(Flatten::new().forward(&x).unwrap().dims(), &[2, 60]);
        let spatial = FlattenConfig::new().with_start_dim(2).init().unwrap();
        assert_eq!(spatial.forward(&x).unwrap().dims(), &[2, 3, 20]);
        let head = FlattenConfig::new().with_start_dim(0).with_end_dim(1);
        assert_eq!(head.init().unwrap().forward(&x).unwrap().dims(), &[6, 4, 5]);
    }

    #[test]
    fn flatten_config_rejects_a_start_after_the_end() {
        let err = FlattenConfig::new()
            .with_start_dim(2)
            .with_end_dim(1)
            .init()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Flatten") && err.contains("start_dim 2") && err.contains("end_dim 1"),
            "{err}"
        );
        let err = FlattenConfig::new()
            .with_start_dim(-1)
            .with_end_dim(-2)
            .init();
        assert!(err.is_err());
        // Mixed signs depend on the rank: left to the forward.
        assert!(FlattenConfig::new().with_start_dim(3).init().is_ok());
    }
}
