//! ResNets for 32×32 images (CIFAR-10), after He et al., "Deep Residual Learning for Image
//! Recognition", section 4.2: ResNet-20, -32, -56 and any depth 6n + 2.
//!
//! The network is a 3×3 stem convolution with 16 channels, three stages of `n`
//! [`BasicBlock`]s with 16, 32 and 64 channels (the second and third start with stride 2),
//! global average pooling and one fully connected layer. Where a block changes the shape, its
//! shortcut is a 1×1 convolution with stride 2 and a batch norm ("option B"). Parameter and
//! buffer paths, and their order, are those of the same model written in PyTorch with
//! attributes `conv1`, `bn1`, `layer1`…`layer3`, `avgpool`, `fc` (`layer2.0.downsample.0.weight`,
//! `layer1.0.bn1.running_mean`, `fc.bias`), so a PyTorch `state_dict` maps onto it by name.

use tandem_core::Tensor;

use crate::layers::{
    AdaptiveAvgPool2dConfig, BatchNormConfig, Conv2d, Conv2dConfig, Flatten, LinearConfig,
    Sequential,
};
use crate::{Child, Forward, Module, TrainingFlag};
use crate::{Error, Result};

/// A 3×3 convolution without bias, padding 1.
fn conv3x3(in_channels: usize, out_channels: usize, stride: usize) -> Result<Conv2d> {
    Conv2dConfig::new(in_channels, out_channels, 3)
        .with_stride(stride)
        .with_padding(1)
        .with_bias(false)
        .init()
}

/// The residual block of ResNet-18/34 and the CIFAR ResNets:
/// `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`.
///
/// `conv1` is 3×3 with the block's stride, `conv2` 3×3 with stride 1. The shortcut is the
/// identity, or — when the stride is not 1 or the channel count changes — the child
/// `downsample`: a 1×1 convolution with the block's stride and no bias (`downsample.0`) and a
/// batch norm (`downsample.1`).
///
/// The ReLUs run fused: `bn1` through [`Child::forward_relu`] (one pass with the
/// normalisation when the child is [`Fused`](crate::Fused), a `BatchNorm2d` or a synchronised
/// one; `relu(forward)` for any other module), and the join through `bn2`'s
/// [`Child::forward_add_relu`] (batch norm, residual add and ReLU in one pass where fused,
/// `add_relu(forward, shortcut)` otherwise).
///
/// Children can be swapped through [`Module::replace_child`] (so that a `BatchNorm2d` can
/// become a synchronised one); each is a [`Child`], and `forward` runs on a snapshot of it.
///
/// # Shapes
/// `[N, in, H, W]` → `[N, out, H / stride, W / stride]` (rounded up).
#[derive(Module)]
pub struct BasicBlock {
    conv1: Child,
    bn1: Child,
    conv2: Child,
    bn2: Child,
    downsample: Option<Child>,
    training: TrainingFlag,
}

impl BasicBlock {
    /// A block from `in_channels` to `out_channels` whose first convolution has `stride`.
    pub fn new(in_channels: usize, out_channels: usize, stride: usize) -> Result<Self> {
        if stride == 0 {
            return Err(Error::config("BasicBlock", "stride must be > 0"));
        }
        let projection = stride != 1 || in_channels != out_channels;
        Ok(BasicBlock {
            conv1: conv3x3(in_channels, out_channels, stride)?.into(),
            bn1: BatchNormConfig::new(out_channels).init()?.into(),
            conv2: conv3x3(out_channels, out_channels, 1)?.into(),
            bn2: BatchNormConfig::new(out_channels).init()?.into(),
            downsample: if projection {
                Some(downsample(in_channels, out_channels, stride)?.into())
            } else {
                None
            },
            training: TrainingFlag::new(),
        })
    }

    /// Whether the shortcut is a projection (`downsample`) rather than the identity.
    pub fn has_downsample(&self) -> bool {
        self.downsample.is_some()
    }
}

impl Forward for BasicBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.bn1.forward_relu(&self.conv1.forward(x)?)?;
        let out = self.conv2.forward(&out)?;
        let shortcut = match &self.downsample {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        self.bn2.forward_add_relu(&out, &shortcut)
    }
}

/// The projection shortcut: a 1×1 convolution with `stride` and no bias (`0`), then a batch
/// norm (`1`).
pub(crate) fn downsample(
    in_channels: usize,
    out_channels: usize,
    stride: usize,
) -> Result<Sequential> {
    let conv = Conv2dConfig::new(in_channels, out_channels, 1)
        .with_stride(stride)
        .with_bias(false)
        .init()?;
    Ok(Sequential::new()
        .add(conv)
        .add(BatchNormConfig::new(out_channels).init()?))
}

/// A ResNet for 32×32 images: see the [module documentation](self).
///
/// Children, in order: `conv1`, `bn1`, `layer1`, `layer2`, `layer3` (each a [`Sequential`] of
/// [`BasicBlock`]s named `0`, `1`, …), `avgpool`, `flatten`, `fc`. Like those of its blocks
/// and stages, they can be swapped through [`Module::replace_child`].
///
/// # Shapes
/// `[N, 3, 32, 32]` → logits `[N, num_classes]` (any `H, W` ≥ 1 work, thanks to the global
/// pooling).
#[derive(Module)]
pub struct CifarResNet {
    depth: usize,
    conv1: Child,
    bn1: Child,
    layer1: Child,
    layer2: Child,
    layer3: Child,
    avgpool: Child,
    flatten: Child,
    fc: Child,
    training: TrainingFlag,
}

impl CifarResNet {
    /// The network's depth (6n + 2).
    pub fn depth(&self) -> usize {
        self.depth
    }
}

impl Forward for CifarResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = self.bn1.forward_relu(&self.conv1.forward(x)?)?;
        for child in [
            &self.layer1,
            &self.layer2,
            &self.layer3,
            &self.avgpool,
            &self.flatten,
            &self.fc,
        ] {
            out = child.forward(&out)?;
        }
        Ok(out)
    }
}

/// A CIFAR ResNet of `depth` = 6n + 2 layers (20, 32, 44, 56, 110, …) with `num_classes`
/// outputs. Errors if `depth` is not of that form or `num_classes` is 0.
pub fn resnet_cifar(depth: usize, num_classes: usize) -> Result<CifarResNet> {
    if depth < 8 || !(depth - 2).is_multiple_of(6) {
        return Err(Error::config(
            "resnet_cifar",
            format!("depth must be 6n + 2 with n ≥ 1 (20, 32, 44, 56, 110), got {depth}"),
        ));
    }
    if num_classes == 0 {
        return Err(Error::config("resnet_cifar", "num_classes must be > 0"));
    }
    let blocks = (depth - 2) / 6;
    let stage = |in_channels: usize, channels: usize, stride: usize| -> Result<Child> {
        let mut layer = Sequential::new();
        for i in 0..blocks {
            let (from, block_stride) = if i == 0 {
                (in_channels, stride)
            } else {
                (channels, 1)
            };
            layer = layer.add(BasicBlock::new(from, channels, block_stride)?);
        }
        Ok(layer.into())
    };
    Ok(CifarResNet {
        depth,
        conv1: conv3x3(3, 16, 1)?.into(),
        bn1: BatchNormConfig::new(16).init()?.into(),
        layer1: stage(16, 16, 1)?,
        layer2: stage(16, 32, 2)?,
        layer3: stage(32, 64, 2)?,
        avgpool: AdaptiveAvgPool2dConfig::new(1).init()?.into(),
        flatten: Flatten::new().into(),
        fc: LinearConfig::new(64, num_classes).init()?.into(),
        training: TrainingFlag::new(),
    })
}

/// ResNet-20 (3 blocks a stage, 272 474 parameters) for 10 classes.
pub fn resnet20() -> Result<CifarResNet> {
    resnet_cifar(20, 10)
}

/// ResNet-32 (5 blocks a stage) for 10 classes.
pub fn resnet32() -> Result<CifarResNet> {
    resnet_cifar(32, 10)
}

/// ResNet-56 (9 blocks a stage) for 10 classes.
pub fn resnet56() -> Result<CifarResNet> {
    resnet_cifar(56, 10)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::BatchNorm2d;
    use std::sync::Arc;
    use tandem_core::{DType, Device};

    #[test]
    fn resnet20_has_pytorch_parameter_paths_in_state_dict_order() {
        let model = resnet20().unwrap();
        let names: Vec<String> = model.named_tensors().into_iter().map(|t| t.0).collect();
        assert_eq!(
            &names[..7],
            [
                "conv1.weight",
                "bn1.weight",
                "bn1.bias",
                "bn1.running_mean",
                "bn1.running_var",
                "bn1.num_batches_tracked",
                "layer1.0.conv1.weight",
            ]
        );
        let ds = names
            .iter()
            .position(|n| n == "layer2.0.downsample.0.weight")
            .unwrap();
        assert_eq!(names[ds - 1], "layer2.0.bn2.num_batches_tracked");
        assert_eq!(names[ds + 1], "layer2.0.downsample.1.weight");
        assert!(!names.iter().any(|n| n.starts_with("layer1.0.downsample")));
        assert_eq!(&names[names.len() - 2..], ["fc.weight", "fc.bias"]);
    }

    #[test]
    fn resnet_parameter_counts_match_the_paper() {
        // He et al. report 0.27M, 0.46M and 0.85M; these are PyTorch's exact counts with
        // option-B shortcuts.
        assert_eq!(resnet20().unwrap().num_parameters(), 272_474);
        assert_eq!(resnet32().unwrap().num_parameters(), 466_906);
        assert_eq!(resnet56().unwrap().num_parameters(), 855_770);
    }

    #[test]
    fn resnet_maps_32x32_images_to_logits() {
        let model = resnet_cifar(8, 7).unwrap();
        let x = Tensor::zeros(&[2, 3, 32, 32], DType::F32, Device::Cpu).unwrap();
        assert_eq!(model.forward(&x).unwrap().dims(), &[2, 7]);
    }

    #[test]
    fn resnet_rejects_depths_not_of_the_form_6n_plus_2() {
        for depth in [0, 2, 18, 21] {
            let err = resnet_cifar(depth, 10).err().unwrap().to_string();
            assert!(
                err.contains("6n + 2") && err.contains(&depth.to_string()),
                "{err}"
            );
        }
        assert!(resnet_cifar(20, 0).is_err());
    }

    /// A batch norm that does not fuse: `forward_relu` falls back to `relu(forward)` and
    /// `forward_add_relu` to `add_relu(forward, residual)`.
    #[derive(Module)]
    struct Unfused {
        #[module(delegate)]
        bn: Arc<BatchNorm2d>,
    }

    impl Forward for Unfused {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.bn.forward(x)
        }
    }

    fn unfused(channels: usize) -> Arc<Unfused> {
        Arc::new(Unfused {
            bn: Arc::new(BatchNormConfig::new(channels).init().unwrap()),
        })
    }

    fn child(m: &dyn Module, name: &str) -> Arc<dyn Module> {
        m.children().into_iter().find(|(n, _)| n == name).unwrap().1
    }

    /// The block's output and input gradient for `x` (summed output as the loss).
    fn output_and_grad(block: &BasicBlock, x: &Tensor) -> (Vec<f64>, Vec<f64>) {
        use tandem_autograd::TensorBackward;
        let x = x.detach().with_requires_grad().unwrap();
        let y = block.forward(&x).unwrap();
        tandem_ops::sum_all(&y).unwrap().backward().unwrap();
        let gx = x.grad().unwrap().to_vec_f64().unwrap();
        (y.to_vec_f64().unwrap(), gx)
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(p, q)| (p - q).abs() < 1e-4)
    }

    #[test]
    fn fused_block_matches_its_unfused_composition_and_a_non_fusing_batch_norm() {
        use tandem_autograd::TensorBackward;
        let block = BasicBlock::new(4, 8, 2).unwrap();
        let mut gen = tandem_core::Generator::new(3);
        let x = Tensor::randn(&[3, 4, 6, 6], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let (y, gx) = output_and_grad(&block, &x);
        // the same block written with separate relu/add ops
        let x2 = x.detach().with_requires_grad().unwrap();
        let run = |name: &str, t: &Tensor| child(&block, name).forward(t).unwrap();
        let out = tandem_ops::relu(&run("bn1", &run("conv1", &x2))).unwrap();
        let out = run("bn2", &run("conv2", &out));
        let shortcut = run("downsample", &x2);
        let y2 = tandem_ops::relu(&tandem_ops::add(&out, &shortcut).unwrap()).unwrap();
        tandem_ops::sum_all(&y2).unwrap().backward().unwrap();
        assert!(close(&y, &y2.to_vec_f64().unwrap()));
        assert!(close(&gx, &x2.grad().unwrap().to_vec_f64().unwrap()));
        // bn1 swapped for a module without a fused forward_relu: same values, same paths
        let names = |m: &dyn Module| -> Vec<String> {
            m.named_tensors().into_iter().map(|t| t.0).collect()
        };
        let before = names(&block);
        let old = block.replace_child("bn1", unfused(8)).unwrap();
        assert!(old.is::<BatchNorm2d>());
        assert_eq!(names(&block), before);
        let (y3, gx3) = output_and_grad(&block, &x);
        assert!(close(&y, &y3) && close(&gx, &gx3));
        // and bn2 too: the join falls back to add_relu(forward, shortcut)
        block.replace_child("bn2", unfused(8)).unwrap();
        assert_eq!(names(&block), before);
        let (y4, gx4) = output_and_grad(&block, &x);
        assert!(close(&y, &y4) && close(&gx, &gx4));
        let err = block
            .replace_child("bn3", Arc::new(BatchNormConfig::new(8).init().unwrap()))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("bn3") && err.contains("downsample"), "{err}");
        let plain = BasicBlock::new(8, 8, 1).unwrap();
        assert!(plain
            .replace_child(
                "downsample",
                Arc::new(BatchNormConfig::new(8).init().unwrap())
            )
            .is_err());
    }

    #[test]
    fn resnet_children_can_be_swapped_keeping_paths_and_outputs() {
        let model = resnet_cifar(8, 3).unwrap();
        let x = Tensor::zeros(&[2, 3, 8, 8], DType::F32, Device::Cpu).unwrap();
        let before = model.forward(&x).unwrap().to_vec_f64().unwrap();
        let names: Vec<String> = model.named_tensors().into_iter().map(|t| t.0).collect();
        // a fresh batch norm has the same parameters as the one it replaces
        let old = model.replace_child("bn1", unfused(16)).unwrap();
        assert!(old.is::<BatchNorm2d>());
        let after: Vec<String> = model.named_tensors().into_iter().map(|t| t.0).collect();
        assert_eq!(after, names);
        assert!(close(
            &before,
            &model.forward(&x).unwrap().to_vec_f64().unwrap()
        ));
        assert!(model
            .replace_child("bn9", Arc::new(BatchNormConfig::new(16).init().unwrap()))
            .is_err());
    }

    #[test]
    fn resnet_errors_name_the_failing_layer() {
        let model = resnet20().unwrap();
        let x = Tensor::zeros(&[1, 1, 32, 32], DType::F32, Device::Cpu).unwrap();
        let err = model.forward(&x).unwrap_err().to_string();
        assert!(err.contains("conv1"), "{err}");
    }
}
