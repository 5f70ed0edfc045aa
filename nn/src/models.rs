//! Ready-made networks: LeNet-5 for MNIST here, and the CIFAR ResNets of [`crate::resnet`] and
//! the ImageNet ResNets of [`crate::resnet_imagenet`] re-exported.

use crate::layers::{Conv2dConfig, Flatten, LinearConfig, MaxPool2dConfig, ReLU, Sequential};
use crate::Result;

/// LeNet-5 for 28×28 single-channel images (MNIST), as in the PyTorch examples:
///
/// ```text
/// features:   0 conv 1→6 5×5 pad 2 · 1 relu · 2 maxpool 2
///             3 conv 6→16 5×5      · 4 relu · 5 maxpool 2
/// flatten                                          [N, 16·5·5 = 400]
/// classifier: 0 fc 400→120 · 1 relu · 2 fc 120→84 · 3 relu · 4 fc 84→10
/// ```
///
/// Parameters are named `features.0.weight`, …, `classifier.4.bias` (61 706 in all). Takes
/// `[N, 1, 28, 28]`, returns logits `[N, 10]`.
pub fn lenet5() -> Result<Sequential> {
    let features = Sequential::new()
        .add(Conv2dConfig::new(1, 6, 5).with_padding(2).init()?)
        .add(ReLU::new())
        .add(MaxPool2dConfig::new(2).init()?)
        .add(Conv2dConfig::new(6, 16, 5).init()?)
        .add(ReLU::new())
        .add(MaxPool2dConfig::new(2).init()?);
    let classifier = Sequential::new()
        .add(LinearConfig::new(16 * 5 * 5, 120).init()?)
        .add(ReLU::new())
        .add(LinearConfig::new(120, 84).init()?)
        .add(ReLU::new())
        .add(LinearConfig::new(84, 10).init()?);
    Sequential::new()
        .add_named("features", features)?
        .add_named("flatten", Flatten::new())?
        .add_named("classifier", classifier)
}

pub use crate::resnet::{resnet20, resnet32, resnet56, resnet_cifar, BasicBlock, CifarResNet};
pub use crate::resnet_imagenet::{
    resnet101, resnet152, resnet18, resnet34, resnet50, resnet_imagenet, Block, Bottleneck,
    ImageNetResNet,
};
