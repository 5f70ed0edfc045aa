//! Checkpoints across devices (GPU test; on the CUDA emulator without a GPU): a
//! checkpoint written from a model and optimizer on a GPU loads on the CPU bit for bit, and the
//! reverse, and training goes on from it on the other device.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tandem::autograd::TensorBackward;
use tandem::core::rng::manual_seed;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::nn::checkpoint::{load_checkpoint, load_state_dict, save_checkpoint, OPTIMIZER_PREFIX};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::{BatchNormConfig, Conv2dConfig, Flatten, LinearConfig, Module, ReLU, Sequential};
use tandem::optim::{Optimizer, Sgd, SgdConfig};

const GPU: Device = Device::Cuda(0);

/// A file in this process's scratch folder, found at run time (`TANDEM_SCRATCH_DIR`, else the
/// system's temporary folder): the test binary runs in the GPU bundle, away from the folder
/// it was built in.
fn scratch(name: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tandem::locate::scratch_dir("cuda_checkpoint").unwrap())
        .join(name)
}

fn small_model() -> Sequential {
    Sequential::new()
        .add(Conv2dConfig::new(1, 4, 3).init().unwrap())
        .add(BatchNormConfig::new(4).init().unwrap())
        .add(ReLU::new())
        .add(Flatten::new())
        .add(LinearConfig::new(4 * 4 * 4, 3).init().unwrap())
}

fn optimizer(model: &Sequential) -> Sgd {
    let config = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_weight_decay(1e-3);
    Sgd::new(model.parameters(), config).unwrap()
}

/// The same batch for the same step, on `device`.
fn batch(step: u64, device: Device) -> (Tensor, Tensor) {
    let mut generator = Generator::new(500 + step);
    let x = Tensor::randn(
        &[8, 1, 6, 6],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut generator,
    )
    .unwrap();
    let labels: Vec<i64> = (0..8).map(|_| generator.below(3) as i64).collect();
    let y = Tensor::from_vec(labels, &[8], Device::Cpu).unwrap();
    (x.to_device(device).unwrap(), y.to_device(device).unwrap())
}

fn train(model: &Sequential, optimizer: &mut Sgd, steps: std::ops::Range<u64>, device: Device) {
    model.train();
    for step in steps {
        let (x, y) = batch(step, device);
        optimizer.zero_grad().unwrap();
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        optimizer.step().unwrap();
    }
}

/// Every parameter, buffer and optimizer state tensor as raw bytes on the host, by name.
fn state_bytes(model: &Sequential, optimizer: &Sgd) -> BTreeMap<String, Vec<u8>> {
    let bytes = |t: &Tensor| -> Vec<u8> {
        match t.dtype() {
            DType::I64 => t
                .to_vec::<i64>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            DType::F32 => t
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            other => panic!("unexpected dtype {other:?}"),
        }
    };
    let mut out: BTreeMap<String, Vec<u8>> = model
        .named_tensors()
        .into_iter()
        .map(|(name, _, t)| (name, bytes(&t)))
        .collect();
    for (name, t) in optimizer.state() {
        out.insert(format!("{OPTIMIZER_PREFIX}{name}"), bytes(&t));
    }
    out
}

/// Trains 3 steps on `from`, saves, loads into a fresh model and optimizer on `to`, checks the
/// state bit for bit, then trains 3 more steps on both and checks they stay close (the devices'
/// kernels round differently, so not bit for bit).
fn round_trip(from: Device, to: Device, name: &str) {
    manual_seed(3);
    let source = small_model();
    source.to_device(from).unwrap();
    let mut source_optimizer = optimizer(&source);
    train(&source, &mut source_optimizer, 0..3, from);
    let extra: Vec<(String, Tensor)> = source_optimizer
        .state()
        .into_iter()
        .map(|(n, t)| (format!("{OPTIMIZER_PREFIX}{n}"), t))
        .collect();
    let path = scratch(name);
    save_checkpoint(&path, &source, &extra, &BTreeMap::new()).unwrap();

    manual_seed(99);
    let target = small_model();
    target.to_device(to).unwrap();
    let checkpoint = load_checkpoint(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let report = load_state_dict(&target, &checkpoint, true).unwrap();
    assert!(report.missing_keys.is_empty() && report.unexpected_keys.is_empty());
    let mut target_optimizer = optimizer(&target);
    target_optimizer
        .load_state(&checkpoint.extra(OPTIMIZER_PREFIX))
        .unwrap();
    for (_, _, t) in target.named_tensors() {
        assert_eq!(t.device(), to, "a loaded tensor left {to}");
    }
    assert_eq!(
        state_bytes(&source, &source_optimizer),
        state_bytes(&target, &target_optimizer),
        "{from} → {to}: the loaded state differs from the saved one"
    );

    train(&source, &mut source_optimizer, 3..6, from);
    train(&target, &mut target_optimizer, 3..6, to);
    for ((name, _, a), (_, _, b)) in source.named_tensors().iter().zip(target.named_tensors()) {
        if a.dtype() != DType::F32 {
            assert_eq!(
                a.to_vec::<i64>().unwrap(),
                b.to_vec::<i64>().unwrap(),
                "{name}"
            );
            continue;
        }
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 + 1e-3 * x.abs(),
                "{from} → {to}: `{name}`[{i}] after 3 more steps: {x} on {from}, {y} on {to}"
            );
        }
    }
}

#[test]
fn a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu() {
    if tandem_test_support::select_cuda().is_some() {
        round_trip(GPU, Device::Cpu, "gpu_to_cpu.safetensors");
    }
}

#[test]
fn a_checkpoint_saved_on_the_cpu_resumes_on_the_gpu() {
    if tandem_test_support::select_cuda().is_some() {
        round_trip(Device::Cpu, GPU, "cpu_to_gpu.safetensors");
    }
}
