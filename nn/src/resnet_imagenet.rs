//! ResNets for ImageNet-sized images (224×224), after He et al., with torchvision's layout and
//! parameter names: ResNet-18 and -34 ([`BasicBlock`]s) and ResNet-50, -101 and -152
//! ([`Bottleneck`]s, stride on the 3×3 convolution as in torchvision's "v1.5").
//!
//! The network is a 7×7 stride-2 stem convolution with 64 channels, batch norm, ReLU and a 3×3
//! stride-2 max pool, four stages (`layer1`…`layer4`, widths 64, 128, 256, 512; the last three
//! start with stride 2), global average pooling and one fully connected layer. Paths and their
//! order are torchvision's (`conv1.weight`, `layer3.5.bn2.running_var`,
//! `layer2.0.downsample.0.weight`, `fc.bias`), so a torchvision `state_dict` loads by name —
//! `tests/resnet50_layout.rs` checks ResNet-50 against the list torchvision itself produced.
//! Initialisation follows torchvision: Kaiming-normal (fan out, ReLU gain) convolutions, batch
//! norms with weight 1 and bias 0, and PyTorch's default for the fully connected layer.

use tandem_core::Tensor;

use crate::init::{kaiming_normal, FanMode};
use crate::layers::{
    AdaptiveAvgPool2dConfig, BatchNormConfig, Conv2d, Conv2dConfig, Flatten, LinearConfig,
    MaxPool2dConfig, Sequential,
};
use crate::resnet::BasicBlock;
use crate::{Child, Forward, Module, TrainingFlag};
use crate::{Error, Result};

/// A convolution without bias (initialised Kaiming-normal by [`resnet_imagenet`] once the
/// whole network exists, as torchvision does).
fn conv(
    in_channels: usize,
    out_channels: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Result<Conv2d> {
    Conv2dConfig::new(in_channels, out_channels, kernel)
        .with_stride(stride)
        .with_padding(padding)
        .with_bias(false)
        .init()
}

/// The projection shortcut: a 1×1 convolution with `stride` and a batch norm
/// (`downsample.0`, `downsample.1`).
fn downsample(in_channels: usize, out_channels: usize, stride: usize) -> Result<Sequential> {
    Ok(Sequential::new()
        .add(conv(in_channels, out_channels, 1, stride, 0)?)
        .add(BatchNormConfig::new(out_channels).init()?))
}

/// The residual block of ResNet-50/101/152:
/// `relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))`, with `conv1` a 1×1
/// reduction to `width`, `conv2` a 3×3 convolution with the block's stride, and `conv3` a 1×1
/// expansion to `4·width`. The shortcut is the identity, or `downsample` (1×1 convolution with
/// the stride, then batch norm) when the shape changes. The ReLUs run fused into the batch
/// norms where the child can ([`Child::forward_relu`], [`Child::forward_add_relu`]), and
/// children can be swapped ([`Module::replace_child`]) so the batch norms can become
/// synchronised ones.
///
/// # Shapes
/// `[N, in, H, W]` → `[N, 4·width, H / stride, W / stride]` (rounded up).
#[derive(Module)]
pub struct Bottleneck {
    conv1: Child,
    bn1: Child,
    conv2: Child,
    bn2: Child,
    conv3: Child,
    bn3: Child,
    downsample: Option<Child>,
    training: TrainingFlag,
}

impl Bottleneck {
    /// How many times wider a bottleneck's output is than its inner `width`.
    pub const EXPANSION: usize = 4;

    /// A block from `in_channels` to `4·width` channels whose 3×3 convolution has `stride`.
    pub fn new(in_channels: usize, width: usize, stride: usize) -> Result<Self> {
        if stride == 0 || width == 0 || in_channels == 0 {
            return Err(Error::config(
                "Bottleneck",
                format!(
                    "channels, width and stride must be > 0, got in_channels {in_channels}, \
                     width {width}, stride {stride}"
                ),
            ));
        }
        let out_channels = width * Self::EXPANSION;
        let downsample = if stride != 1 || in_channels != out_channels {
            Some(downsample(in_channels, out_channels, stride)?.into())
        } else {
            None
        };
        Ok(Bottleneck {
            conv1: conv(in_channels, width, 1, 1, 0)?.into(),
            bn1: BatchNormConfig::new(width).init()?.into(),
            conv2: conv(width, width, 3, stride, 1)?.into(),
            bn2: BatchNormConfig::new(width).init()?.into(),
            conv3: conv(width, out_channels, 1, 1, 0)?.into(),
            bn3: BatchNormConfig::new(out_channels).init()?.into(),
            downsample,
            training: TrainingFlag::new(),
        })
    }
}

impl Forward for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.bn1.forward_relu(&self.conv1.forward(x)?)?;
        let out = self.bn2.forward_relu(&self.conv2.forward(&out)?)?;
        let out = self.conv3.forward(&out)?;
        let shortcut = match &self.downsample {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        self.bn3.forward_add_relu(&out, &shortcut)
    }
}

/// Which block an ImageNet ResNet is built of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// Two 3×3 convolutions (ResNet-18, -34).
    Basic,
    /// 1×1, 3×3, 1×1 with a 4× expansion (ResNet-50, -101, -152).
    Bottleneck,
}

/// A ResNet for 224×224 images: see the [module documentation](self).
///
/// Children, in order: `conv1`, `bn1`, `maxpool`, `layer1`…`layer4` (each a [`Sequential`] of
/// blocks named `0`, `1`, …), `avgpool`, `flatten`, `fc`; they can be swapped through
/// [`Module::replace_child`].
///
/// # Shapes
/// `[N, 3, H, W]` → logits `[N, num_classes]` (224×224 in the paper; any size ≥ 32 works
/// thanks to the global pooling).
#[derive(Module)]
pub struct ImageNetResNet {
    conv1: Child,
    bn1: Child,
    maxpool: Child,
    layer1: Child,
    layer2: Child,
    layer3: Child,
    layer4: Child,
    avgpool: Child,
    flatten: Child,
    fc: Child,
    training: TrainingFlag,
}

impl Forward for ImageNetResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = self.bn1.forward_relu(&self.conv1.forward(x)?)?;
        for child in [
            &self.maxpool,
            &self.layer1,
            &self.layer2,
            &self.layer3,
            &self.layer4,
            &self.avgpool,
            &self.flatten,
            &self.fc,
        ] {
            out = child.forward(&out)?;
        }
        Ok(out)
    }
}

/// An ImageNet ResNet of `block`s, `blocks[i]` of them in stage `i + 1`, with `num_classes`
/// outputs.
pub fn resnet_imagenet(
    block: Block,
    blocks: [usize; 4],
    num_classes: usize,
) -> Result<ImageNetResNet> {
    if num_classes == 0 || blocks.contains(&0) {
        return Err(Error::config(
            "resnet_imagenet",
            format!("every stage needs a block and num_classes must be > 0, got {blocks:?} and {num_classes}"),
        ));
    }
    let mut in_channels = 64;
    let mut stages = Vec::with_capacity(4);
    for (stage, (&count, width)) in blocks.iter().zip([64, 128, 256, 512]).enumerate() {
        let stride = if stage == 0 { 1 } else { 2 };
        let mut layer = Sequential::new();
        for i in 0..count {
            let s = if i == 0 { stride } else { 1 };
            layer = match block {
                Block::Basic => {
                    let b = BasicBlock::new(in_channels, width, s)?;
                    in_channels = width;
                    layer.add(b)
                }
                Block::Bottleneck => {
                    let b = Bottleneck::new(in_channels, width, s)?;
                    in_channels = width * Bottleneck::EXPANSION;
                    layer.add(b)
                }
            };
        }
        stages.push(Child::new(layer));
    }
    let [layer1, layer2, layer3, layer4]: [Child; 4] = stages
        .try_into()
        .unwrap_or_else(|_| unreachable!("four stages were built"));
    let model = ImageNetResNet {
        conv1: conv(3, 64, 7, 2, 3)?.into(),
        bn1: BatchNormConfig::new(64).init()?.into(),
        maxpool: MaxPool2dConfig::new(3)
            .with_stride(2)
            .with_padding(1)
            .init()?
            .into(),
        layer1,
        layer2,
        layer3,
        layer4,
        avgpool: AdaptiveAvgPool2dConfig::new(1).init()?.into(),
        flatten: Flatten::new().into(),
        fc: LinearConfig::new(in_channels, num_classes).init()?.into(),
        training: TrainingFlag::new(),
    };
    // torchvision initialises every convolution Kaiming-normal (fan out), the basic blocks'
    // included.
    for (path, t) in model.named_parameters() {
        if t.rank() == 4 && !path.starts_with("fc") {
            kaiming_normal(&t, 0.0, FanMode::FanOut)?;
        }
    }
    Ok(model)
}

/// ResNet-18 (1000 classes, 11.7 M parameters).
pub fn resnet18() -> Result<ImageNetResNet> {
    resnet_imagenet(Block::Basic, [2, 2, 2, 2], 1000)
}

/// ResNet-34 (1000 classes, 21.8 M parameters).
pub fn resnet34() -> Result<ImageNetResNet> {
    resnet_imagenet(Block::Basic, [3, 4, 6, 3], 1000)
}

/// ResNet-50 (1000 classes, 25 557 032 parameters, torchvision's layout).
pub fn resnet50() -> Result<ImageNetResNet> {
    resnet_imagenet(Block::Bottleneck, [3, 4, 6, 3], 1000)
}

/// ResNet-101 (1000 classes).
pub fn resnet101() -> Result<ImageNetResNet> {
    resnet_imagenet(Block::Bottleneck, [3, 4, 23, 3], 1000)
}

/// ResNet-152 (1000 classes).
pub fn resnet152() -> Result<ImageNetResNet> {
    resnet_imagenet(Block::Bottleneck, [3, 8, 36, 3], 1000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::{DType, Device};

    #[test]
    fn resnet18_and_a_bottleneck_resnet_run_on_small_images() {
        for model in [
            resnet_imagenet(Block::Basic, [1, 1, 1, 1], 7).unwrap(),
            resnet_imagenet(Block::Bottleneck, [1, 1, 1, 1], 5).unwrap(),
        ] {
            let x = Tensor::zeros(&[2, 3, 64, 64], DType::F32, Device::Cpu).unwrap();
            let y = model.forward(&x).unwrap();
            assert_eq!(y.dims()[0], 2);
        }
        assert_eq!(resnet18().unwrap().num_parameters(), 11_689_512);
    }

    #[test]
    fn bad_configurations_are_errors() {
        assert!(resnet_imagenet(Block::Basic, [1, 0, 1, 1], 10).is_err());
        assert!(resnet_imagenet(Block::Bottleneck, [1, 1, 1, 1], 0).is_err());
        assert!(Bottleneck::new(64, 64, 0).is_err());
    }
}
