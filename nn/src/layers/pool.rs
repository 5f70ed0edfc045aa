//! Pooling layers: max, average and adaptive average over 2-D windows.

use tandem_core::Tensor;

use crate::layers::IntoPair;
use crate::{Error, Result};
use crate::{Forward, Module, TrainingFlag};

fn expect_4d(layer: &'static str, x: &Tensor) -> Result<()> {
    if x.rank() != 4 {
        return Err(Error::input(
            layer,
            format!("expected input [N, C, H, W], got shape {:?}", x.dims()),
        ));
    }
    Ok(())
}

/// The maximum over each `kernel` window. Defaults: stride = kernel, padding 0.
///
/// # Shapes
/// `[N, C, H, W]` → `[N, C, (H + 2·pad − k) / stride + 1, …]`.
#[derive(Debug, Module)]
pub struct MaxPool2d {
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    training: TrainingFlag,
}

impl MaxPool2d {
    /// Max pooling over `kernel` windows (one number or `(kh, kw)`), stride = kernel.
    pub fn new(kernel: impl IntoPair) -> Self {
        let kernel = kernel.into_pair();
        MaxPool2d {
            kernel,
            stride: kernel,
            padding: (0, 0),
            training: TrainingFlag::new(),
        }
    }

    /// The same layer with stride `stride`.
    pub fn with_stride(self, stride: impl IntoPair) -> Self {
        MaxPool2d {
            stride: stride.into_pair(),
            ..self
        }
    }

    /// The same layer with padding `padding` (padded cells never win the maximum).
    pub fn with_padding(self, padding: impl IntoPair) -> Self {
        MaxPool2d {
            padding: padding.into_pair(),
            ..self
        }
    }
}

impl Forward for MaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        expect_4d("MaxPool2d", x)?;
        Ok(tandem_ops::max_pool2d(
            x,
            self.kernel,
            self.stride,
            self.padding,
        )?)
    }
}

/// The mean over each `kernel` window, padding counted as zeros (PyTorch's default
/// `count_include_pad = true`). Defaults: stride = kernel, padding 0.
///
/// # Shapes
/// `[N, C, H, W]` → `[N, C, (H + 2·pad − k) / stride + 1, …]`.
#[derive(Debug, Module)]
pub struct AvgPool2d {
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    training: TrainingFlag,
}

impl AvgPool2d {
    /// Average pooling over `kernel` windows (one number or `(kh, kw)`), stride = kernel.
    pub fn new(kernel: impl IntoPair) -> Self {
        let kernel = kernel.into_pair();
        AvgPool2d {
            kernel,
            stride: kernel,
            padding: (0, 0),
            training: TrainingFlag::new(),
        }
    }

    /// The same layer with stride `stride`.
    pub fn with_stride(self, stride: impl IntoPair) -> Self {
        AvgPool2d {
            stride: stride.into_pair(),
            ..self
        }
    }

    /// The same layer with padding `padding`.
    pub fn with_padding(self, padding: impl IntoPair) -> Self {
        AvgPool2d {
            padding: padding.into_pair(),
            ..self
        }
    }
}

impl Forward for AvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        expect_4d("AvgPool2d", x)?;
        Ok(tandem_ops::avg_pool2d(
            x,
            self.kernel,
            self.stride,
            self.padding,
        )?)
    }
}

/// Average pooling to a fixed output size, whatever the input size (`(1, 1)` gives global
/// average pooling, as at the end of a ResNet).
///
/// # Shapes
/// `[N, C, H, W]` → `[N, C, out_h, out_w]`.
#[derive(Debug, Module)]
pub struct AdaptiveAvgPool2d {
    output: (usize, usize),
    training: TrainingFlag,
}

impl AdaptiveAvgPool2d {
    /// Pooling to `output` (one number or `(out_h, out_w)`).
    pub fn new(output: impl IntoPair) -> Self {
        AdaptiveAvgPool2d {
            output: output.into_pair(),
            training: TrainingFlag::new(),
        }
    }
}

impl Forward for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        expect_4d("AdaptiveAvgPool2d", x)?;
        Ok(tandem_ops::adaptive_avg_pool2d(x, self.output)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Device};

    #[test]
    fn pools_produce_pytorch_output_shapes() {
        let x = Tensor::from_vec(
            (0..2 * 3 * 8 * 6).map(|v| v as f32).collect(),
            &[2, 3, 8, 6],
            Device::Cpu,
        )
        .unwrap();
        assert_eq!(MaxPool2d::new(2).forward(&x).unwrap().dims(), &[2, 3, 4, 3]);
        let overlapping = MaxPool2d::new(3).with_stride(2).with_padding(1);
        assert_eq!(overlapping.forward(&x).unwrap().dims(), &[2, 3, 4, 3]);
        assert_eq!(
            AvgPool2d::new((2, 3)).forward(&x).unwrap().dims(),
            &[2, 3, 4, 2]
        );
        assert_eq!(
            AdaptiveAvgPool2d::new(1).forward(&x).unwrap().dims(),
            &[2, 3, 1, 1]
        );
    }

    #[test]
    fn max_pool_takes_the_window_maximum() {
        // One 2×4 image: windows [[0, 5], [3, 1]] and [[2, 7], [6, 4]].
        let x = Tensor::from_vec(
            vec![0.0f32, 5.0, 2.0, 7.0, 3.0, 1.0, 6.0, 4.0],
            &[1, 1, 2, 4],
            Device::Cpu,
        )
        .unwrap();
        let y = MaxPool2d::new(2).forward(&x).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![5.0, 7.0]);
        let y = AvgPool2d::new(2).forward(&x).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.25, 4.75]);
    }

    #[test]
    fn pools_reject_inputs_that_are_not_4d() {
        let x = Tensor::zeros(&[3, 8, 8], DType::F32, Device::Cpu).unwrap();
        let err = MaxPool2d::new(2).forward(&x).unwrap_err().to_string();
        assert!(
            err.contains("MaxPool2d") && err.contains("[3, 8, 8]"),
            "{err}"
        );
    }
}
