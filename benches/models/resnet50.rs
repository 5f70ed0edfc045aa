//! ResNet-50 (He et al. 2016, v1.5: the stride sits on the 3×3 convolution, as in torchvision)
//! for the data-parallel benchmark: 25 557 032 parameters, ~97.5 MiB of f32 gradients, with
//! torchvision's parameter order, so DDP's buckets are those of the real model.

use std::sync::Arc;

use tandem::core::Tensor;
use tandem::nn::{
    AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Conv2dConfig, Flatten, Linear, MaxPool2d, Module,
    Sequential, TrainingFlag,
};

type Result<T> = tandem::nn::Result<T>;

fn conv(i: usize, o: usize, k: usize, stride: usize, padding: usize) -> Result<Conv2d> {
    let config = Conv2dConfig::default()
        .with_stride(stride)
        .with_padding(padding)
        .with_bias(false);
    Conv2d::new(i, o, k, config)
}

/// `relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))) + shortcut(x))`; `conv2` carries
/// the stride; the shortcut is a 1×1 convolution and batch norm where the shape changes.
struct Bottleneck {
    children: Vec<(String, Arc<dyn Module>)>,
    training: TrainingFlag,
}

impl Bottleneck {
    fn new(in_channels: usize, width: usize, stride: usize) -> Result<Self> {
        let out = width * 4;
        let mut children: Vec<(String, Arc<dyn Module>)> = vec![
            ("conv1".into(), Arc::new(conv(in_channels, width, 1, 1, 0)?)),
            ("bn1".into(), Arc::new(BatchNorm2d::new(width)?)),
            ("conv2".into(), Arc::new(conv(width, width, 3, stride, 1)?)),
            ("bn2".into(), Arc::new(BatchNorm2d::new(width)?)),
            ("conv3".into(), Arc::new(conv(width, out, 1, 1, 0)?)),
            ("bn3".into(), Arc::new(BatchNorm2d::new(out)?)),
        ];
        if stride != 1 || in_channels != out {
            let downsample = Sequential::new()
                .add(conv(in_channels, out, 1, stride, 0)?)
                .add(BatchNorm2d::new(out)?);
            children.push(("downsample".into(), Arc::new(downsample)));
        }
        Ok(Bottleneck {
            children,
            training: TrainingFlag::new(),
        })
    }
}

impl Module for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = &self.children;
        let out = c[0].1.forward(x)?;
        let out = c[1].1.forward_relu(&out)?;
        let out = c[2].1.forward(&out)?;
        let out = c[3].1.forward_relu(&out)?;
        let out = c[4].1.forward(&out)?;
        let shortcut = match c.get(6) {
            Some((_, d)) => d.forward(x)?,
            None => x.clone(),
        };
        c[5].1.forward_add_relu(&out, &shortcut)
    }

    fn training_flag(&self) -> &TrainingFlag {
        &self.training
    }

    fn children(&self) -> Vec<(String, Arc<dyn Module>)> {
        self.children.clone()
    }
}

/// The stem (7×7 convolution with stride 2, batch norm, ReLU, 3×3 max pool with stride 2),
/// four stages of 3, 4, 6 and 3 bottlenecks of widths 64…512, global pooling and a
/// 2048 → `classes` fully connected layer.
struct ResNet50 {
    children: Vec<(String, Arc<dyn Module>)>,
    training: TrainingFlag,
}

impl Module for ResNet50 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = x.clone();
        for (name, child) in &self.children {
            out = if name == "bn1" {
                child.forward_relu(&out)?
            } else {
                child.forward(&out)?
            };
        }
        Ok(out)
    }

    fn training_flag(&self) -> &TrainingFlag {
        &self.training
    }

    fn children(&self) -> Vec<(String, Arc<dyn Module>)> {
        self.children.clone()
    }
}

/// ResNet-50 for `classes` classes.
pub fn resnet50(classes: usize) -> Result<Arc<dyn Module>> {
    let mut children: Vec<(String, Arc<dyn Module>)> = vec![
        ("conv1".into(), Arc::new(conv(3, 64, 7, 2, 3)?)),
        ("bn1".into(), Arc::new(BatchNorm2d::new(64)?)),
        (
            "maxpool".into(),
            Arc::new(MaxPool2d::new(3).with_stride(2).with_padding(1)),
        ),
    ];
    let mut in_channels = 64;
    for (stage, (width, blocks, stride)) in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]
        .into_iter()
        .enumerate()
    {
        let mut layer = Sequential::new();
        for i in 0..blocks {
            let s = if i == 0 { stride } else { 1 };
            layer = layer.add(Bottleneck::new(in_channels, width, s)?);
            in_channels = width * 4;
        }
        children.push((format!("layer{}", stage + 1), Arc::new(layer)));
    }
    children.push(("avgpool".into(), Arc::new(AdaptiveAvgPool2d::new(1))));
    children.push(("flatten".into(), Arc::new(Flatten::new())));
    children.push(("fc".into(), Arc::new(Linear::new(2048, classes, true)?)));
    Ok(Arc::new(ResNet50 {
        children,
        training: TrainingFlag::new(),
    }))
}
