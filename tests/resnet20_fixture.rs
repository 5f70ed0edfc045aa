//! ResNet-20 against PyTorch: with the same weights and batch, tandem's training-mode forward
//! and backward give PyTorch's loss, parameter gradients and updated running statistics.
//!
//! The reference is `tests/fixtures/resnet20_fixture.safetensors`, written by
//! `tests/fixtures/make_resnet20_fixture.py` (see its doc for the tensors it holds); the test
//! reads it with the `safetensors` crate and needs no PyTorch.

use safetensors::{Dtype, SafeTensors};
use tandem::autograd::TensorBackward;
use tandem::core::{Device, Tensor};
use tandem::nn::loss::{cross_entropy, Reduction};
use tandem::nn::models::resnet20;
use tandem::nn::Module;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/resnet20_fixture.safetensors"
);

/// The fixture tensor `name` as a tandem tensor (f32 or i64).
fn load(file: &SafeTensors, name: &str) -> Tensor {
    let view = file
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture lacks `{name}`: {e}"));
    let bytes = view.data();
    match view.dtype() {
        Dtype::F32 => {
            let data = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Tensor::from_vec::<f32>(data, view.shape(), Device::Cpu).unwrap()
        }
        Dtype::I64 => {
            let data = bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Tensor::from_vec::<i64>(data, view.shape(), Device::Cpu).unwrap()
        }
        other => panic!("fixture tensor `{name}` has unexpected dtype {other:?}"),
    }
}

/// max |actual − expected| / max |expected|.
fn relative_error(actual: &Tensor, expected: &Tensor) -> f64 {
    let a = actual.to_vec_f64().unwrap();
    let e = expected.to_vec_f64().unwrap();
    assert_eq!(a.len(), e.len());
    let diff = a
        .iter()
        .zip(&e)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let scale = e.iter().map(|y| y.abs()).fold(0.0, f64::max);
    diff / scale.max(1e-12)
}

#[test]
fn resnet20_train_step_matches_pytorch_loss_and_every_gradient() {
    let bytes = std::fs::read(FIXTURE).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let model = resnet20().unwrap();
    model.train();

    // Every state_dict entry of PyTorch's model, and nothing else, exists in tandem's.
    let ours: Vec<String> = model.named_tensors().into_iter().map(|t| t.0).collect();
    let mut theirs: Vec<String> = file
        .names()
        .into_iter()
        .filter_map(|n| n.strip_prefix("state.").map(String::from))
        .collect();
    let mut sorted = ours.clone();
    sorted.sort();
    theirs.sort();
    assert_eq!(sorted, theirs);
    for (name, _, tensor) in model.named_tensors() {
        tensor
            .copy_(&load(&file, &format!("state.{name}")))
            .unwrap();
    }

    let logits = model.forward(&load(&file, "input")).unwrap();
    let loss = cross_entropy(&logits, &load(&file, "labels"), Reduction::Mean).unwrap();
    loss.backward().unwrap();
    let expected_loss = load(&file, "loss").item().unwrap();
    let got_loss = loss.item().unwrap();
    assert!(
        (got_loss - expected_loss).abs() <= 1e-4 * expected_loss.abs(),
        "loss {got_loss} vs PyTorch {expected_loss}"
    );

    let mut worst = (String::new(), 0.0);
    for (name, param) in model.named_parameters() {
        let grad = param
            .grad()
            .unwrap_or_else(|| panic!("`{name}` has no gradient"));
        let err = relative_error(&grad, &load(&file, &format!("grad.{name}")));
        assert!(err <= 1e-4, "gradient of `{name}`: relative error {err:e}");
        if err > worst.1 {
            worst = (name, err);
        }
    }
    eprintln!(
        "largest gradient relative error: {:e} ({})",
        worst.1, worst.0
    );

    for (name, buffer) in model.named_buffers() {
        if name.ends_with("running_mean") || name.ends_with("running_var") {
            let err = relative_error(&buffer, &load(&file, &format!("after.{name}")));
            assert!(
                err <= 1e-4,
                "`{name}` after the step: relative error {err:e}"
            );
        }
    }
}
