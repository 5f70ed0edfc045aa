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

/// The checks PyTorch makes when a pooling layer is built: positive kernel size and stride,
/// padding at most half the kernel size.
fn check_windows(
    layer: &'static str,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<()> {
    if [kernel.0, kernel.1, stride.0, stride.1].contains(&0) {
        return Err(Error::config(
            layer,
            format!("kernel size and stride must be > 0, got kernel {kernel:?}, stride {stride:?}"),
        ));
    }
    if padding.0 > kernel.0 / 2 || padding.1 > kernel.1 / 2 {
        return Err(Error::config(
            layer,
            format!("padding {padding:?} must be at most half of kernel {kernel:?}"),
        ));
    }
    Ok(())
}

/// How to build a [`MaxPool2d`]: the kernel size in [`MaxPool2dConfig::new`], the rest with `with_*`
/// (PyTorch's defaults: stride = kernel size, padding 0), then [`MaxPool2dConfig::init`].
///
/// ```
/// # use tandem_nn::MaxPool2dConfig;
/// let pool = MaxPool2dConfig::new(3).with_stride(2).with_padding(1).init()?;
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2dConfig {
    /// Size of the window, `(height, width)`.
    pub kernel_size: (usize, usize),
    /// Step of the window, `(height, width)`.
    pub stride: (usize, usize),
    /// Implicit padding on both sides, `(height, width)`; padded cells never win the maximum.
    pub padding: (usize, usize),
}

impl MaxPool2dConfig {
    /// Pooling over `kernel_size` windows (one number or `(kh, kw)`), stride = kernel size.
    pub fn new(kernel_size: impl IntoPair) -> Self {
        let kernel_size = kernel_size.into_pair();
        MaxPool2dConfig {
            kernel_size,
            stride: kernel_size,
            padding: (0, 0),
        }
    }

    /// The same config with stride `stride` (one number or `(h, w)`).
    pub fn with_stride(self, stride: impl IntoPair) -> Self {
        MaxPool2dConfig {
            stride: stride.into_pair(),
            ..self
        }
    }

    /// The same config with padding `padding` (one number or `(h, w)`).
    pub fn with_padding(self, padding: impl IntoPair) -> Self {
        MaxPool2dConfig {
            padding: padding.into_pair(),
            ..self
        }
    }

    /// The layer. Errors (naming `MaxPool2d` and the values) if the kernel size or the stride is
    /// 0, or the padding is more than half the kernel size (PyTorch's rule).
    pub fn init(&self) -> Result<MaxPool2d> {
        check_windows("MaxPool2d", self.kernel_size, self.stride, self.padding)?;
        Ok(MaxPool2d {
            kernel: self.kernel_size,
            stride: self.stride,
            padding: self.padding,
            training: TrainingFlag::new(),
        })
    }
}

/// The maximum over each `kernel` window; built with [`MaxPool2dConfig`].
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

/// How to build an [`AvgPool2d`]: the kernel size in [`AvgPool2dConfig::new`], the rest with `with_*`
/// (PyTorch's defaults: stride = kernel size, padding 0), then [`AvgPool2dConfig::init`].
///
/// ```
/// # use tandem_nn::AvgPool2dConfig;
/// let pool = AvgPool2dConfig::new(2).init()?;
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPool2dConfig {
    /// Size of the window, `(height, width)`.
    pub kernel_size: (usize, usize),
    /// Step of the window, `(height, width)`.
    pub stride: (usize, usize),
    /// Zero padding added on both sides, `(height, width)` (counted in the mean).
    pub padding: (usize, usize),
}

impl AvgPool2dConfig {
    /// Pooling over `kernel_size` windows (one number or `(kh, kw)`), stride = kernel size.
    pub fn new(kernel_size: impl IntoPair) -> Self {
        let kernel_size = kernel_size.into_pair();
        AvgPool2dConfig {
            kernel_size,
            stride: kernel_size,
            padding: (0, 0),
        }
    }

    /// The same config with stride `stride` (one number or `(h, w)`).
    pub fn with_stride(self, stride: impl IntoPair) -> Self {
        AvgPool2dConfig {
            stride: stride.into_pair(),
            ..self
        }
    }

    /// The same config with padding `padding` (one number or `(h, w)`).
    pub fn with_padding(self, padding: impl IntoPair) -> Self {
        AvgPool2dConfig {
            padding: padding.into_pair(),
            ..self
        }
    }

    /// The layer. Errors (naming `AvgPool2d` and the values) if the kernel size or the stride is
    /// 0, or the padding is more than half the kernel size (PyTorch's rule).
    pub fn init(&self) -> Result<AvgPool2d> {
        check_windows("AvgPool2d", self.kernel_size, self.stride, self.padding)?;
        Ok(AvgPool2d {
            kernel: self.kernel_size,
            stride: self.stride,
            padding: self.padding,
            training: TrainingFlag::new(),
        })
    }
}

/// The mean over each `kernel` window, padding counted as zeros (PyTorch's default
/// `count_include_pad = true`); built with [`AvgPool2dConfig`].
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

/// How to build an [`AdaptiveAvgPool2d`]: the output size in [`AdaptiveAvgPool2dConfig::new`],
/// then [`AdaptiveAvgPool2dConfig::init`].
///
/// ```
/// # use tandem_nn::AdaptiveAvgPool2dConfig;
/// let global = AdaptiveAvgPool2dConfig::new(1).init()?;
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveAvgPool2dConfig {
    /// Size of the output, `(out_h, out_w)`.
    pub output_size: (usize, usize),
}

impl AdaptiveAvgPool2dConfig {
    /// Pooling to `output_size` (one number or `(out_h, out_w)`).
    pub fn new(output_size: impl IntoPair) -> Self {
        AdaptiveAvgPool2dConfig {
            output_size: output_size.into_pair(),
        }
    }

    /// The layer. Errors (naming `AdaptiveAvgPool2d` and the value) if an output size is 0.
    pub fn init(&self) -> Result<AdaptiveAvgPool2d> {
        let (h, w) = self.output_size;
        if h == 0 || w == 0 {
            return Err(Error::config(
                "AdaptiveAvgPool2d",
                format!("output size must be > 0, got ({h}, {w})"),
            ));
        }
        Ok(AdaptiveAvgPool2d {
            output: self.output_size,
            training: TrainingFlag::new(),
        })
    }
}

/// Average pooling to a fixed output size, whatever the input size (`(1, 1)` gives global
/// average pooling, as at the end of a ResNet). Built with [`AdaptiveAvgPool2dConfig`].
///
/// # Shapes
/// `[N, C, H, W]` → `[N, C, out_h, out_w]`.
#[derive(Debug, Module)]
pub struct AdaptiveAvgPool2d {
    output: (usize, usize),
    training: TrainingFlag,
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
        assert_eq!(
            MaxPool2dConfig::new(2)
                .init()
                .unwrap()
                .forward(&x)
                .unwrap()
                .dims(),
            &[2, 3, 4, 3]
        );
        let overlapping = MaxPool2dConfig::new(3)
            .with_stride(2)
            .with_padding(1)
            .init()
            .unwrap();
        assert_eq!(overlapping.forward(&x).unwrap().dims(), &[2, 3, 4, 3]);
        assert_eq!(
            AvgPool2dConfig::new((2, 3))
                .init()
                .unwrap()
                .forward(&x)
                .unwrap()
                .dims(),
            &[2, 3, 4, 2]
        );
        assert_eq!(
            AdaptiveAvgPool2dConfig::new(1)
                .init()
                .unwrap()
                .forward(&x)
                .unwrap()
                .dims(),
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
        let y = MaxPool2dConfig::new(2).init().unwrap().forward(&x).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![5.0, 7.0]);
        let y = AvgPool2dConfig::new(2).init().unwrap().forward(&x).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.25, 4.75]);
    }

    #[test]
    fn pools_reject_inputs_that_are_not_4d() {
        let x = Tensor::zeros(&[3, 8, 8], DType::F32, Device::Cpu).unwrap();
        let err = MaxPool2dConfig::new(2)
            .init()
            .unwrap()
            .forward(&x)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("MaxPool2d") && err.contains("[3, 8, 8]"),
            "{err}"
        );
    }

    #[test]
    fn pool_configs_reject_zero_sizes_and_oversized_padding() {
        let err = MaxPool2dConfig::new(0).init().unwrap_err().to_string();
        assert!(
            err.contains("MaxPool2d") && err.contains("kernel (0, 0)"),
            "{err}"
        );
        let err = AvgPool2dConfig::new(2).with_stride(0).init().unwrap_err();
        assert!(err.to_string().contains("stride (0, 0)"), "{err}");
        let err = MaxPool2dConfig::new(3).with_padding(2).init().unwrap_err();
        assert!(err.to_string().contains("padding (2, 2)"), "{err}");
        let err = AdaptiveAvgPool2dConfig::new((1, 0)).init().unwrap_err();
        assert!(
            err.to_string().contains("AdaptiveAvgPool2d") && err.to_string().contains("(1, 0)")
        );
    }
}
