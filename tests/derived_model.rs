//! A model a user writes with `#[derive(Module)]`, through the public API only (the `tandem`
//! facade): a VGG-style stack with its own residual container. It trains, keeps PyTorch's
//! dotted names, converts to SyncBatchNorm, runs under DDP on 2 ranks, saves a checkpoint whose
//! names are those of the same model written in PyTorch (`tests/fixtures/derived_model.py`),
//! moves between devices, and switches train/eval through its children.

use std::sync::Arc;

use tandem::autograd::TensorBackward;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::dist::testing::on_each_rank;
use tandem::dist::{
    convert_sync_batch_norm, DdpConfig, DistributedDataParallel, ProcessGroup, SyncBatchNorm,
    ThreadProcessGroup,
};
use tandem::nn::checkpoint::{load_module, save_checkpoint};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::{
    AdaptiveAvgPool2dConfig, BatchNorm2d, BatchNormConfig, Child, Conv2dConfig, DropoutConfig,
    Flatten, Forward, LinearConfig, Module, ReLU, Result, Sequential, TrainingFlag,
};
use tandem::optim::{Optimizer, Sgd, SgdConfig};

/// `relu(bn(conv(x)) + x)`: a residual unit that keeps the shape.
#[derive(Module)]
struct Residual {
    conv: Child,
    bn: Child,
    training: TrainingFlag,
}

impl Residual {
    fn new(channels: usize) -> Result<Self> {
        let conv = Conv2dConfig::new(channels, channels, 3)
            .with_padding(1)
            .with_bias(false);
        Ok(Residual {
            conv: conv.init()?.into(),
            bn: BatchNormConfig::new(channels).init()?.into(),
            training: TrainingFlag::new(),
        })
    }
}

impl Forward for Residual {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward_add_relu(&self.conv.forward(x)?, x)
    }
}

/// stem conv → residual units (a list) → optional dropout → pooled classifier, with a
/// learned per-class scale as the model's own parameter and a step counter as its buffer.
#[derive(Module)]
struct Net {
    #[param]
    scale: Tensor,
    #[buffer]
    steps: Tensor,
    stem: Child,
    blocks: Vec<Child>,
    dropout: Option<Child>,
    head: Child,
    training: TrainingFlag,
    classes: usize,
}

impl Net {
    fn new(dropout: bool) -> Result<Self> {
        let stem = Sequential::new()
            .add(Conv2dConfig::new(1, 4, 3).with_padding(1).init()?)
            .add(BatchNormConfig::new(4).init()?)
            .add(ReLU::new());
        let head = Sequential::new()
            .add(AdaptiveAvgPool2dConfig::new(1).init()?)
            .add(Flatten::new())
            .add(LinearConfig::new(4, 3).init()?);
        Ok(Net {
            scale: Tensor::ones(&[3], DType::F32, Device::Cpu)?.with_requires_grad()?,
            steps: Tensor::scalar(0i64, Device::Cpu)?,
            stem: stem.into(),
            blocks: vec![Residual::new(4)?.into(), Residual::new(4)?.into()],
            dropout: dropout
                .then(|| DropoutConfig::new(0.5).init().map(Child::from))
                .transpose()?,
            head: head.into(),
            training: TrainingFlag::new(),
            classes: 3,
        })
    }
}

impl Forward for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.stem.forward(x)?;
        for block in &self.blocks {
            h = block.forward(&h)?;
        }
        if let Some(d) = &self.dropout {
            h = d.forward(&h)?;
        }
        let logits = self.head.forward(&h)?;
        assert_eq!(logits.dims()[1], self.classes);
        Ok(tandem::ops::mul(&logits, &self.scale)?)
    }
}

/// The names PyTorch gives the same model's `state_dict`, in its order (the model is written
/// in PyTorch in `tests/fixtures/derived_model.py`, which prints this list).
const PYTORCH_NAMES: &[&str] = &[
    "scale",
    "steps",
    "stem.0.weight",
    "stem.0.bias",
    "stem.1.weight",
    "stem.1.bias",
    "stem.1.running_mean",
    "stem.1.running_var",
    "stem.1.num_batches_tracked",
    "blocks.0.conv.weight",
    "blocks.0.bn.weight",
    "blocks.0.bn.bias",
    "blocks.0.bn.running_mean",
    "blocks.0.bn.running_var",
    "blocks.0.bn.num_batches_tracked",
    "blocks.1.conv.weight",
    "blocks.1.bn.weight",
    "blocks.1.bn.bias",
    "blocks.1.bn.running_mean",
    "blocks.1.bn.running_var",
    "blocks.1.bn.num_batches_tracked",
    "head.2.weight",
    "head.2.bias",
];

fn names(m: &dyn Module) -> Vec<String> {
    m.named_tensors().into_iter().map(|(n, _, _)| n).collect()
}

fn batch(seed: u64) -> (Tensor, Tensor) {
    let mut g = Generator::new(seed);
    let x = Tensor::randn(&[8, 1, 6, 6], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let y: Vec<i64> = (0..8).map(|i| (i % 3) as i64).collect();
    (x, Tensor::from_vec(y, &[8], Device::Cpu).unwrap())
}

#[test]
fn derived_model_has_pytorchs_names_and_trains() {
    tandem::core::rng::manual_seed(1);
    let net = Net::new(false).unwrap();
    assert_eq!(names(&net), PYTORCH_NAMES);
    let params: Vec<String> = net.named_parameters().into_iter().map(|p| p.0).collect();
    assert_eq!(params.len(), 13, "{params:?}");
    let children: Vec<String> = net.children().into_iter().map(|c| c.0).collect();
    assert_eq!(children, ["stem", "blocks.0", "blocks.1", "head"]);

    let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1).with_momentum(0.9)).unwrap();
    let (x, y) = batch(2);
    let mut losses = Vec::new();
    for _ in 0..20 {
        opt.zero_grad().unwrap();
        let loss = cross_entropy(&net.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        losses.push(loss.to_vec_f64().unwrap()[0]);
    }
    assert!(
        losses[19] < losses[0] * 0.5,
        "loss did not fall: {losses:?}"
    );
    // every parameter, the model's own included, got a gradient and moved
    for (name, p) in net.named_parameters() {
        assert!(p.grad().is_some(), "{name} has no gradient");
    }
}

#[test]
fn train_and_eval_reach_every_child_and_errors_name_the_child() {
    let net = Net::new(true).unwrap();
    net.eval();
    for (path, m) in net.named_modules() {
        assert!(!m.is_training(), "{path} is still training");
    }
    // dropout is off in eval: two runs agree
    let (x, _) = batch(3);
    let a = net.forward(&x).unwrap().to_vec_f64().unwrap();
    let b = net.forward(&x).unwrap().to_vec_f64().unwrap();
    assert_eq!(a, b);
    net.train();
    assert!(net.named_modules().iter().all(|(_, m)| m.is_training()));

    // a wrong input fails in the stem's convolution, and the error says so
    let fresh = Net::new(false).unwrap();
    let bad = Tensor::zeros(&[1, 2, 6, 6], DType::F32, Device::Cpu).unwrap();
    let err = fresh.forward(&bad).unwrap_err().to_string();
    assert!(err.contains("stem.0") && err.contains("Conv2d"), "{err}");
    let bad_block = Tensor::zeros(&[1, 5, 6, 6], DType::F32, Device::Cpu).unwrap();
    let err = fresh.blocks[1].forward(&bad_block).unwrap_err().to_string();
    assert!(err.contains("blocks.1.conv"), "{err}");
}

#[test]
fn derived_model_converts_to_sync_batch_norm_and_runs_under_ddp_on_two_ranks() {
    let groups = ThreadProcessGroup::new_group(2).unwrap();
    let outs = on_each_rank(groups, |group| {
        let rank = group.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        tandem::core::rng::manual_seed(7);
        let net: Arc<dyn Module> = Arc::new(Net::new(false).unwrap());
        let before = names(net.as_ref());
        let net = convert_sync_batch_norm(net, group.clone()).unwrap();
        assert_eq!(names(net.as_ref()), before, "conversion keeps every name");
        let syncs = net
            .named_modules()
            .into_iter()
            .filter(|(_, m)| m.is::<SyncBatchNorm>())
            .count();
        assert_eq!(syncs, 3, "stem.1, blocks.0.bn and blocks.1.bn");
        assert!(!net
            .named_modules()
            .iter()
            .any(|(_, m)| m.is::<BatchNorm2d>()));
        let ddp = DistributedDataParallel::new(net, group, DdpConfig::default()).unwrap();
        let mut opt = Sgd::new(ddp.module().parameters(), SgdConfig::new(0.05)).unwrap();
        for step in 0..2 {
            let (x, y) = batch(10 + 2 * step + rank as u64);
            opt.zero_grad().unwrap();
            let out = ddp.forward(&x).unwrap();
            let loss = cross_entropy(&out, &y, Reduction::Mean).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        ddp.module()
            .named_tensors()
            .into_iter()
            .flat_map(|(_, _, t)| t.to_vec_f64().unwrap())
            .collect::<Vec<f64>>()
    });
    assert_eq!(outs[0], outs[1], "the ranks hold the same model");
}

#[test]
fn derived_model_saves_pytorchs_names_and_moves_between_devices() {
    tandem::core::rng::manual_seed(5);
    let net = Net::new(false).unwrap();
    let dir = std::env::temp_dir().join(format!("tandem-derived-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("net.safetensors");
    save_checkpoint(&file, &net, &[], &Default::default()).unwrap();
    // the file holds exactly the model's tensors, by PyTorch's names
    let bytes = std::fs::read(&file).unwrap();
    let saved = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut saved: Vec<String> = saved.names().into_iter().map(String::from).collect();
    saved.sort();
    let mut want: Vec<String> = PYTORCH_NAMES.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(saved, want);
    // `TANDEM_DERIVED_MODEL_OUT=FILE` keeps a copy for `tests/fixtures/derived_model.py FILE`,
    // which loads it into the PyTorch model with `strict=True`.
    if let Ok(keep) = std::env::var("TANDEM_DERIVED_MODEL_OUT") {
        std::fs::copy(&file, keep).unwrap();
    }
    // and loads back into a fresh model
    let other = Net::new(false).unwrap();
    load_module(&file, &other, true).unwrap();
    let values = |m: &Net| -> Vec<Vec<f64>> {
        m.named_tensors()
            .into_iter()
            .map(|(_, _, t)| t.to_vec_f64().unwrap())
            .collect()
    };
    assert_eq!(values(&other), values(&net));
    std::fs::remove_dir_all(&dir).ok();

    // to another device and back (the CUDA emulator without a GPU), every tensor with it
    let away = match tandem_test_support::select_cuda() {
        Some(_) => Device::Cuda(0),
        None => Device::Cpu,
    };
    println!("moving to {away:?} and back");
    let before = values(&net);
    net.to_device(away).unwrap();
    assert!(net
        .named_tensors()
        .iter()
        .all(|(_, _, t)| t.device() == away));
    let (x, _) = batch(6);
    net.eval();
    let out = net.forward(&x.to_device(away).unwrap()).unwrap();
    assert_eq!(out.dims(), &[8, 3]);
    net.to_device(Device::Cpu).unwrap();
    assert_eq!(values(&net), before);
}
