//! The fully connected layer.

use tandem_core::{DType, Device, Tensor};

use crate::init::{kaiming_uniform, uniform, FanMode};
use crate::module::parameter;
use crate::{Error, Result};
use crate::{Forward, Module, TrainingFlag};

/// How to build a [`Linear`]: the feature counts in [`LinearConfig::new`], the rest with
/// `with_*` (PyTorch's defaults: with bias, on the CPU), then [`LinearConfig::init`].
///
/// ```
/// # use tandem_nn::LinearConfig;
/// let fc = LinearConfig::new(512, 10).with_bias(false).init()?;
/// assert_eq!((fc.in_features(), fc.out_features()), (512, 10));
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearConfig {
    /// Size of each input sample.
    pub in_features: usize,
    /// Size of each output sample.
    pub out_features: usize,
    /// Whether the layer adds a learned bias.
    pub bias: bool,
    /// Where the parameters live (initialised on the CPU, from the default generator, then
    /// moved: the same seed gives the same values on every device).
    pub device: Device,
}

impl LinearConfig {
    /// A layer from `in_features` to `out_features`, with a bias, on the CPU.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        LinearConfig {
            in_features,
            out_features,
            bias: true,
            device: Device::Cpu,
        }
    }

    /// The same config with or without bias.
    pub fn with_bias(self, bias: bool) -> Self {
        LinearConfig { bias, ..self }
    }

    /// The same config with parameters on `device`.
    pub fn with_device(self, device: Device) -> Self {
        LinearConfig { device, ..self }
    }

    /// The layer, initialised like PyTorch. Errors (naming `Linear` and the values) if a
    /// feature count is 0.
    pub fn init(&self) -> Result<Linear> {
        let LinearConfig {
            in_features,
            out_features,
            ..
        } = *self;
        if in_features == 0 || out_features == 0 {
            return Err(Error::config(
                "Linear",
                format!(
                    "in_features and out_features must be > 0, got {in_features} and \
                     {out_features}"
                ),
            ));
        }
        let weight = Tensor::zeros(&[out_features, in_features], DType::F32, Device::Cpu)?;
        kaiming_uniform(&weight, 5f64.sqrt(), FanMode::FanIn)?;
        let bias = if self.bias {
            let b = Tensor::zeros(&[out_features], DType::F32, Device::Cpu)?;
            let bound = 1.0 / (in_features as f64).sqrt();
            uniform(&b, -bound, bound)?;
            Some(parameter(b)?)
        } else {
            None
        };
        let weight = parameter(weight)?;
        weight.move_to_device(self.device)?;
        if let Some(b) = &bias {
            b.move_to_device(self.device)?;
        }
        Ok(Linear {
            weight,
            bias,
            training: TrainingFlag::new(),
        })
    }
}

/// `y = x · weightᵀ + bias`, applied to the last dim of `x`; built with [`LinearConfig`].
///
/// Parameters: `weight` `[out_features, in_features]`, `bias` `[out_features]` (optional).
/// Initialised like PyTorch: both from U(−1/√in_features, 1/√in_features) (the weight via
/// Kaiming-uniform with `a = √5`), drawn from the thread's default generator.
///
/// # Shapes
/// `x` `[…, in_features]` → `[…, out_features]`.
#[derive(Debug, Module)]
pub struct Linear {
    #[param]
    weight: Tensor,
    #[param]
    bias: Option<Tensor>,
    training: TrainingFlag,
}

impl Linear {
    /// The weight `[out_features, in_features]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[out_features]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Size of each input sample.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Size of each output sample.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dims().last() != Some(&self.in_features()) {
            return Err(Error::input(
                "Linear",
                format!(
                    "expected input [.., {}] (in_features = {}), got shape {:?}",
                    self.in_features(),
                    self.in_features(),
                    x.dims()
                ),
            ));
        }
        Ok(tandem_ops::linear(x, &self.weight, self.bias.as_ref())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_computes_x_times_weight_transposed_plus_bias() {
        let layer = LinearConfig::new(3, 2).init().unwrap();
        let x = Tensor::from_vec(
            vec![1.0f32, -2.0, 0.5, 3.0, 0.0, -1.0],
            &[2, 3],
            Device::Cpu,
        )
        .unwrap();
        let y = layer.forward(&x).unwrap().to_vec_f64().unwrap();
        let (w, b) = (
            layer.weight().to_vec_f64().unwrap(),
            layer.bias().unwrap().to_vec_f64().unwrap(),
        );
        let xv = x.to_vec_f64().unwrap();
        for n in 0..2 {
            for o in 0..2 {
                let want: f64 = (0..3).map(|i| xv[n * 3 + i] * w[o * 3 + i]).sum::<f64>() + b[o];
                assert!((y[n * 2 + o] - want).abs() < 1e-5, "{y:?}");
            }
        }
    }

    #[test]
    fn linear_initialisation_stays_within_one_over_sqrt_fan_in() {
        let layer = LinearConfig::new(100, 50).init().unwrap();
        let bound = 0.1; // 1 / sqrt(100)
        for t in [layer.weight(), layer.bias().unwrap()] {
            assert!(t.to_vec_f64().unwrap().iter().all(|v| v.abs() <= bound));
            assert!(t.requires_grad() && t.dtype() == DType::F32);
        }
        let spread = layer
            .weight()
            .to_vec_f64()
            .unwrap()
            .iter()
            .cloned()
            .fold(0.0, f64::max);
        assert!(
            spread > 0.09,
            "weights do not fill the interval: max {spread}"
        );
    }

    #[test]
    fn linear_without_bias_has_only_a_weight() {
        let layer = LinearConfig::new(4, 3).with_bias(false).init().unwrap();
        let names: Vec<String> = layer
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["weight"]);
        assert_eq!((layer.in_features(), layer.out_features()), (4, 3));
    }

    #[test]
    fn linear_rejects_a_wrong_feature_count_naming_the_shapes() {
        let layer = LinearConfig::new(4, 3).init().unwrap();
        let x = Tensor::zeros(&[2, 5], DType::F32, Device::Cpu).unwrap();
        let err = layer.forward(&x).unwrap_err().to_string();
        assert!(
            err.contains("Linear") && err.contains("[2, 5]") && err.contains("4"),
            "{err}"
        );
        let err = LinearConfig::new(0, 3).init().unwrap_err().to_string();
        assert!(
            err.contains("Linear") && err.contains("got 0 and 3"),
            "{err}"
        );
    }
}
