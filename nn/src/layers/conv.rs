//! The 2-D convolution layer and its configuration.

use tandem_core::{DType, Device, Tensor};
use tandem_ops::Conv2dParams;

use crate::init::{kaiming_uniform, uniform, FanMode};
use crate::layers::IntoPair;
use crate::module::parameter;
use crate::{Error, Result};
use crate::{Forward, Module, TrainingFlag};

/// How to build a [`Conv2d`]: the channels and kernel size in [`Conv2dConfig::new`], the rest
/// with `with_*` (PyTorch's defaults: stride 1, padding 0, dilation 1, with bias, on the CPU),
/// then [`Conv2dConfig::init`].
///
/// ```
/// # use tandem_nn::Conv2dConfig;
/// let conv = Conv2dConfig::new(3, 16, 3).with_padding(1).with_bias(false).init()?;
/// assert_eq!(conv.kernel_size(), (3, 3));
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dConfig {
    /// Channels of the input.
    pub in_channels: usize,
    /// Channels of the output (the number of filters).
    pub out_channels: usize,
    /// Size of the kernel, `(height, width)`.
    pub kernel_size: (usize, usize),
    /// Step of the kernel, `(height, width)`.
    pub stride: (usize, usize),
    /// Zero padding added on both sides, `(height, width)`.
    pub padding: (usize, usize),
    /// Spacing between kernel taps, `(height, width)`.
    pub dilation: (usize, usize),
    /// Whether the layer adds a learned bias per output channel.
    pub bias: bool,
    /// Where the parameters live (initialised on the CPU, from the default generator, then
    /// moved: the same seed gives the same values on every device).
    pub device: Device,
}

impl Conv2dConfig {
    /// A convolution from `in_channels` to `out_channels` with a `kernel_size` kernel (one
    /// number or `(kh, kw)`), with PyTorch's defaults for everything else.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: impl IntoPair) -> Self {
        Conv2dConfig {
            in_channels,
            out_channels,
            kernel_size: kernel_size.into_pair(),
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            bias: true,
            device: Device::Cpu,
        }
    }

    /// The same config with stride `stride` (one number or `(h, w)`).
    pub fn with_stride(self, stride: impl IntoPair) -> Self {
        Conv2dConfig {
            stride: stride.into_pair(),
            ..self
        }
    }

    /// The same config with padding `padding` (one number or `(h, w)`).
    pub fn with_padding(self, padding: impl IntoPair) -> Self {
        Conv2dConfig {
            padding: padding.into_pair(),
            ..self
        }
    }

    /// The same config with dilation `dilation` (one number or `(h, w)`).
    pub fn with_dilation(self, dilation: impl IntoPair) -> Self {
        Conv2dConfig {
            dilation: dilation.into_pair(),
            ..self
        }
    }

    /// The same config with or without bias.
    pub fn with_bias(self, bias: bool) -> Self {
        Conv2dConfig { bias, ..self }
    }

    /// The same config with parameters on `device`.
    pub fn with_device(self, device: Device) -> Self {
        Conv2dConfig { device, ..self }
    }

    /// The layer, initialised like PyTorch. Errors (naming `Conv2d` and the values) if a
    /// channel count, the kernel size, the stride or the dilation is 0.
    pub fn init(&self) -> Result<Conv2d> {
        let Conv2dConfig {
            in_channels,
            out_channels,
            kernel_size: (kh, kw),
            ..
        } = *self;
        let positive = [
            in_channels,
            out_channels,
            kh,
            kw,
            self.stride.0,
            self.stride.1,
            self.dilation.0,
            self.dilation.1,
        ];
        if positive.contains(&0) {
            return Err(Error::config(
                "Conv2d",
                format!(
                    "channels, kernel size, stride and dilation must be > 0, got in_channels \
                     {in_channels}, out_channels {out_channels}, kernel ({kh}, {kw}), stride \
                     {:?}, dilation {:?}",
                    self.stride, self.dilation
                ),
            ));
        }
        let weight = Tensor::zeros(
            &[out_channels, in_channels, kh, kw],
            DType::F32,
            Device::Cpu,
        )?;
        kaiming_uniform(&weight, 5f64.sqrt(), FanMode::FanIn)?;
        let bias = if self.bias {
            let b = Tensor::zeros(&[out_channels], DType::F32, Device::Cpu)?;
            let bound = 1.0 / ((in_channels * kh * kw) as f64).sqrt();
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
        Ok(Conv2d {
            weight,
            bias,
            params: Conv2dParams {
                stride: self.stride,
                padding: self.padding,
                dilation: self.dilation,
            },
            training: TrainingFlag::new(),
        })
    }
}

/// A 2-D convolution (cross-correlation, as in PyTorch) over `[N, C, H, W]` inputs, built with
/// [`Conv2dConfig`].
///
/// Parameters: `weight` `[out_channels, in_channels, kh, kw]`, `bias` `[out_channels]`
/// (optional). Initialised like PyTorch: U(−1/√fan_in, 1/√fan_in) with
/// `fan_in = in_channels · kh · kw`.
///
/// # Shapes
/// `x` `[N, in_channels, H, W]` → `[N, out_channels, H', W']` with
/// `H' = (H + 2·padding − dilation·(kh − 1) − 1) / stride + 1` (likewise `W'`).
#[derive(Debug, Module)]
pub struct Conv2d {
    #[param]
    weight: Tensor,
    #[param]
    bias: Option<Tensor>,
    params: Conv2dParams,
    training: TrainingFlag,
}

impl Conv2d {
    /// The weight `[out_channels, in_channels, kh, kw]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `[out_channels]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Channels of the input.
    pub fn in_channels(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Channels of the output.
    pub fn out_channels(&self) -> usize {
        self.weight.dims()[0]
    }

    /// `(kh, kw)`.
    pub fn kernel_size(&self) -> (usize, usize) {
        (self.weight.dims()[2], self.weight.dims()[3])
    }

    /// Stride, padding and dilation.
    pub fn params(&self) -> &Conv2dParams {
        &self.params
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 4 || x.dims()[1] != self.in_channels() {
            return Err(Error::input(
                "Conv2d",
                format!(
                    "expected input [N, {}, H, W] (in_channels = {}), got shape {:?}",
                    self.in_channels(),
                    self.in_channels(),
                    x.dims()
                ),
            ));
        }
        Ok(tandem_ops::conv2d(
            x,
            &self.weight,
            self.bias.as_ref(),
            &self.params,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_output_shape_follows_padding_stride_and_dilation() {
        let x = Tensor::zeros(&[2, 3, 10, 9], DType::F32, Device::Cpu).unwrap();
        let same = Conv2dConfig::new(3, 8, 3).with_padding(1).init().unwrap();
        assert_eq!(same.forward(&x).unwrap().dims(), &[2, 8, 10, 9]);
        let strided = Conv2dConfig::new(3, 4, (3, 1))
            .with_stride(2)
            .with_dilation((2, 1))
            .init()
            .unwrap();
        // H: (10 - 2*2 - 1)/2 + 1 = 3; W: (9 - 1)/2 + 1 = 5.
        assert_eq!(strided.forward(&x).unwrap().dims(), &[2, 4, 3, 5]);
    }

    #[test]
    fn conv_parameters_have_pytorch_shapes_and_init_bounds() {
        let conv = Conv2dConfig::new(6, 16, 5).init().unwrap();
        assert_eq!(conv.weight().dims(), &[16, 6, 5, 5]);
        assert_eq!(conv.bias().unwrap().dims(), &[16]);
        let bound = 1.0 / 150f64.sqrt();
        for t in [conv.weight(), conv.bias().unwrap()] {
            assert!(t.to_vec_f64().unwrap().iter().all(|v| v.abs() <= bound));
        }
        let no_bias = Conv2dConfig::new(6, 16, 5).with_bias(false).init().unwrap();
        assert_eq!(no_bias.parameters().len(), 1);
    }

    #[test]
    fn conv_rejects_wrong_channels_and_zero_sizes() {
        let conv = Conv2dConfig::new(3, 4, 3).init().unwrap();
        let x = Tensor::zeros(&[1, 2, 5, 5], DType::F32, Device::Cpu).unwrap();
        let err = conv.forward(&x).unwrap_err().to_string();
        assert!(
            err.contains("Conv2d") && err.contains("[1, 2, 5, 5]"),
            "{err}"
        );
        let err = Conv2dConfig::new(3, 4, 0).init().unwrap_err().to_string();
        assert!(
            err.contains("Conv2d") && err.contains("kernel (0, 0)"),
            "{err}"
        );
        let err = Conv2dConfig::new(3, 4, 3)
            .with_stride(0)
            .init()
            .unwrap_err();
        assert!(err.to_string().contains("stride (0, 0)"), "{err}");
        assert!(Conv2dConfig::new(0, 4, 3).init().is_err());
    }
}
