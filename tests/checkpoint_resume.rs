//! Checkpoints across frameworks and across a restart.
//!
//! `tests/fixtures/torch_small.safetensors` is the state_dict of a small PyTorch model
//! (Conv2d-BatchNorm2d-ReLU-Flatten-Linear), written by `safetensors.torch.save_file`;
//! `torch_small_expected.json` holds a fixed input and that model's eval-mode output. Both come
//! from `tests/fixtures/make_checkpoint_fixture.py`, which can also check a tandem-written file
//! with PyTorch's own loader (`--check PATH`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tandem::autograd::TensorBackward;
use tandem::core::rng::manual_seed;
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::nn::checkpoint::{
    load_checkpoint, load_module, load_state_dict, save_checkpoint, OPTIMIZER_PREFIX,
};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::Sequential;
use tandem::nn::{BatchNormConfig, Conv2dConfig, Flatten, LinearConfig, Module, ParamKind, ReLU};
use tandem::optim::{Optimizer, Sgd, SgdConfig};
use tandem::prelude::{load_training, save_training, TrainingState};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A scratch directory inside the target dir, kept after the test so the file tandem wrote can
/// be checked by hand with `make_checkpoint_fixture.py --check`.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("checkpoint_resume")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// tandem's twin of the fixture's `nn.Sequential(Conv2d(1, 2, 3), BatchNorm2d(2), ReLU(),
/// Flatten(), Linear(32, 3))`, with the same parameter names.
fn small_model() -> Sequential {
    Sequential::new()
        .add(Conv2dConfig::new(1, 2, 3).init().unwrap())
        .add(BatchNormConfig::new(2).init().unwrap())
        .add(ReLU::new())
        .add(Flatten::new())
        .add(LinearConfig::new(2 * 4 * 4, 3).init().unwrap())
}

fn json_tensor(json: &serde_json::Value, values: &str, shape: &str) -> Tensor {
    let data: Vec<f32> = json[values]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let dims: Vec<usize> = json[shape]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    Tensor::from_vec(data, &dims, Device::Cpu).unwrap()
}

#[test]
fn pytorch_checkpoint_loads_and_matches_pytorch_output_in_eval_mode() {
    let model = small_model();
    let checkpoint = load_module(fixture("torch_small.safetensors"), &model, true).unwrap();
    assert!(checkpoint.extras().is_empty());
    let batches = &model.named_buffers()[2].1;
    assert_eq!(batches.to_vec::<i64>().unwrap(), [3], "num_batches_tracked");

    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("torch_small_expected.json")).unwrap(),
    )
    .unwrap();
    let input = json_tensor(&expected, "input", "input_shape");
    let want = json_tensor(&expected, "output", "output_shape");
    model.eval();
    let got = model.forward(&input).unwrap();
    assert_eq!(got.dims(), want.dims());
    for (i, (g, w)) in got
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .zip(want.to_vec::<f32>().unwrap())
        .enumerate()
    {
        assert!((g - w).abs() <= 1e-5, "output {i}: tandem {g}, PyTorch {w}");
    }
}

#[test]
fn tandem_checkpoint_has_exactly_pytorchs_names_dtypes_shapes_and_bytes() {
    let model = small_model();
    load_module(fixture("torch_small.safetensors"), &model, true).unwrap();
    let path = scratch("interop").join("tandem_small.safetensors");
    save_checkpoint(&path, &model, &[], &BTreeMap::new()).unwrap();

    let ours = std::fs::read(&path).unwrap();
    let theirs = std::fs::read(fixture("torch_small.safetensors")).unwrap();
    let ours = SafeTensors::deserialize(&ours).unwrap();
    let theirs = SafeTensors::deserialize(&theirs).unwrap();
    let mut our_names = ours.names();
    let mut their_names = theirs.names();
    our_names.sort();
    their_names.sort();
    assert_eq!(our_names, their_names);
    for name in their_names {
        let (a, b) = (ours.tensor(name).unwrap(), theirs.tensor(name).unwrap());
        assert_eq!(a.dtype(), b.dtype(), "{name}");
        assert_eq!(a.shape(), b.shape(), "{name}");
        assert_eq!(a.data(), b.data(), "{name}: the same values, byte for byte");
    }
}

/// Whether `python3` can import torch (the strict-load check runs only then).
fn python_with_torch() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn model_file_of_a_training_checkpoint_loads_strictly_in_pytorch() {
    let model = small_model();
    load_module(fixture("torch_small.safetensors"), &model, true).unwrap();
    let momentum = Tensor::zeros(&[2, 1, 3, 3], DType::F32, Device::Cpu).unwrap();
    let state = TrainingState::new()
        .with_optimizer(
            "optimizer",
            vec![
                ("0.momentum_buffer".to_string(), momentum),
                (
                    "step".to_string(),
                    Tensor::scalar(3i64, Device::Cpu).unwrap(),
                ),
            ],
        )
        .with_metadata("epoch", "1");
    let path = scratch("strict").join("model.safetensors");
    save_training(&path, &model, &state).unwrap();

    // The model file holds exactly the state dict's names: nothing for a strict load to trip on.
    let ours = std::fs::read(&path).unwrap();
    let theirs = std::fs::read(fixture("torch_small.safetensors")).unwrap();
    let (ours, theirs) = (
        SafeTensors::deserialize(&ours).unwrap(),
        SafeTensors::deserialize(&theirs).unwrap(),
    );
    let mut our_names = ours.names();
    let mut their_names = theirs.names();
    our_names.sort();
    their_names.sort();
    assert_eq!(our_names, their_names);
    let back = load_training(&path, &small_model()).unwrap();
    assert_eq!(back.optimizer("optimizer").len(), 2);

    if !python_with_torch() {
        println!("note: python3 with torch not found; PyTorch's strict load not checked");
        return;
    }
    let output = std::process::Command::new("python3")
        .arg(fixture("make_checkpoint_fixture.py"))
        .arg("--check")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "PyTorch's strict load_state_dict failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Batch `step` of a synthetic classification task: the same batch for the same step in every
/// run, so a resumed run sees exactly the data the straight run saw.
fn batch(step: u64) -> (Tensor, Tensor) {
    let mut generator = Generator::new(1000 + step);
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
    (x, Tensor::from_vec(labels, &[8], Device::Cpu).unwrap())
}

fn optimizer(model: &Sequential) -> Sgd {
    let config = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_weight_decay(1e-3);
    Sgd::new(model.parameters(), config).unwrap()
}

fn train(model: &Sequential, optimizer: &mut Sgd, steps: std::ops::Range<u64>) {
    model.train();
    for step in steps {
        let (x, y) = batch(step);
        optimizer.zero_grad().unwrap();
        let loss = cross_entropy(&model.forward(&x).unwrap(), &y, Reduction::Mean).unwrap();
        loss.backward().unwrap();
        optimizer.step().unwrap();
    }
}

/// Every parameter and buffer, exactly (f32 bits, i64 counters).
fn snapshot(model: &Sequential) -> Vec<(String, ParamKind, Vec<f32>, Vec<i64>)> {
    model
        .named_tensors()
        .into_iter()
        .map(|(name, kind, t)| match t.dtype() {
            DType::I64 => (name, kind, Vec::new(), t.to_vec::<i64>().unwrap()),
            _ => (name, kind, t.to_vec::<f32>().unwrap(), Vec::new()),
        })
        .collect()
}

#[test]
fn resuming_from_a_checkpoint_is_bit_identical_to_training_straight_through() {
    manual_seed(7);
    let straight = small_model();
    let initial = scratch("resume").join("initial.safetensors");
    save_checkpoint(&initial, &straight, &[], &BTreeMap::new()).unwrap();
    let mut straight_optimizer = optimizer(&straight);
    train(&straight, &mut straight_optimizer, 0..6);

    // The interrupted run starts from the same initial weights, trains 3 steps and saves.
    let first = small_model();
    load_module(&initial, &first, true).unwrap();
    let mut first_optimizer = optimizer(&first);
    train(&first, &mut first_optimizer, 0..3);
    let path = scratch("resume").join("step3.safetensors");
    let mut extra: Vec<(String, Tensor)> = first_optimizer
        .state()
        .into_iter()
        .map(|(name, t)| (format!("{OPTIMIZER_PREFIX}{name}"), t))
        .collect();
    extra.push((
        "trainer.step".to_string(),
        Tensor::scalar(3i64, Device::Cpu).unwrap(),
    ));
    let metadata = BTreeMap::from([("epoch".to_string(), "0".to_string())]);
    save_checkpoint(&path, &first, &extra, &metadata).unwrap();
    drop((first, first_optimizer));

    // A fresh process: differently initialised model, new optimizer, everything from the file.
    manual_seed(12345);
    let resumed = small_model();
    let checkpoint = load_checkpoint(&path).unwrap();
    let report = load_state_dict(&resumed, &checkpoint, true).unwrap();
    assert!(report.missing_keys.is_empty() && report.unexpected_keys.is_empty());
    let mut resumed_optimizer = optimizer(&resumed);
    resumed_optimizer
        .load_state(&checkpoint.extra(OPTIMIZER_PREFIX))
        .unwrap();
    assert_eq!(resumed_optimizer.step_count(), 3);
    assert_eq!(checkpoint.metadata()["epoch"], "0");
    let start = checkpoint.extra("trainer.")[0].1.to_vec::<i64>().unwrap()[0] as u64;
    assert_eq!(start, 3);
    train(&resumed, &mut resumed_optimizer, start..6);

    let want = snapshot(&straight);
    let got = snapshot(&resumed);
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        assert_eq!(w.0, g.0);
        assert!(
            w.2 == g.2 && w.3 == g.3,
            "`{}` differs after resuming: resumed {:?}, straight {:?}",
            w.0,
            &g.2[..g.2.len().min(4)],
            &w.2[..w.2.len().min(4)]
        );
    }
    // Training really moved the weights, so the comparison means something.
    let moved = small_model();
    load_module(&initial, &moved, true).unwrap();
    assert_ne!(snapshot(&moved)[0].2, want[0].2);
}
