//! Tests that cross layers: parameter paths of composed models, the train/eval switch,
//! error paths, swapping children, and a small end-to-end training run.

use std::sync::Arc;

use tandem_autograd::{no_grad, TensorBackward};
use tandem_core::rng::manual_seed;
use tandem_core::{DType, Device, Generator, Tensor};

use crate::data::{DataLoader, DataLoaderConfig, TensorDataset};
use crate::loss::{cross_entropy, Reduction};
use crate::models::lenet5;
use crate::*;

fn names(pairs: &[(String, Tensor)]) -> Vec<&str> {
    pairs.iter().map(|(n, _)| n.as_str()).collect()
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(
        shape,
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
}

#[test]
fn nested_sequential_names_parameters_and_buffers_in_registration_order() {
    let block = Sequential::new()
        .add(Conv2dConfig::new(3, 4, 3).with_bias(false).init().unwrap())
        .add(BatchNormConfig::new(4).init().unwrap())
        .add(ReLU::new());
    let model = Sequential::new()
        .add_named("stem", block)
        .unwrap()
        .add_named("pool", AdaptiveAvgPool2dConfig::new(1).init().unwrap())
        .unwrap()
        .add_named("flatten", Flatten::new())
        .unwrap()
        .add_named("fc", LinearConfig::new(4, 2).init().unwrap())
        .unwrap();
    assert_eq!(
        names(&model.named_parameters()),
        [
            "stem.0.weight",
            "stem.1.weight",
            "stem.1.bias",
            "fc.weight",
            "fc.bias"
        ]
    );
    let buffers = model.named_buffers();
    assert_eq!(
        names(&buffers),
        [
            "stem.1.running_mean",
            "stem.1.running_var",
            "stem.1.num_batches_tracked"
        ]
    );
    assert_eq!(buffers[2].1.dtype(), DType::I64);
    assert!(model
        .parameters()
        .iter()
        .all(|p| p.requires_grad() && p.is_leaf()));
    assert!(buffers.iter().all(|(_, b)| !b.requires_grad()));
    let modules: Vec<String> = model.named_modules().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        modules,
        ["stem", "stem.0", "stem.1", "stem.2", "pool", "flatten", "fc"]
    );
    let y = model.forward(&randn(&[2, 3, 6, 6], 1)).unwrap();
    assert_eq!(y.dims(), &[2, 2]);
}

#[test]
fn lenet5_has_pytorch_paths_and_shapes() {
    let model = lenet5().unwrap();
    let params = model.named_parameters();
    let shapes: Vec<(&str, Vec<usize>)> = params
        .iter()
        .map(|(n, t)| (n.as_str(), t.dims().to_vec()))
        .collect();
    assert_eq!(
        shapes,
        [
            ("features.0.weight", vec![6, 1, 5, 5]),
            ("features.0.bias", vec![6]),
            ("features.3.weight", vec![16, 6, 5, 5]),
            ("features.3.bias", vec![16]),
            ("classifier.0.weight", vec![120, 400]),
            ("classifier.0.bias", vec![120]),
            ("classifier.2.weight", vec![84, 120]),
            ("classifier.2.bias", vec![84]),
            ("classifier.4.weight", vec![10, 84]),
            ("classifier.4.bias", vec![10]),
        ]
    );
    assert_eq!(model.num_parameters(), 61_706);
    let y = model.forward(&randn(&[3, 1, 28, 28], 2)).unwrap();
    assert_eq!(y.dims(), &[3, 10]);
}

#[test]
fn same_seed_builds_the_same_model() {
    manual_seed(42);
    let a = lenet5().unwrap();
    manual_seed(42);
    let b = lenet5().unwrap();
    for ((_, x), (_, y)) in a.named_parameters().iter().zip(b.named_parameters()) {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
    }
}

#[test]
fn set_training_reaches_every_descendant() {
    let model = Sequential::new()
        .add(Sequential::new().add(DropoutConfig::new(0.5).init().unwrap()))
        .add(BatchNormConfig::new(2).init().unwrap());
    assert!(model.is_training());
    model.eval();
    assert!(!model.is_training());
    for (path, m) in model.named_modules() {
        assert!(!m.is_training(), "{path} still training");
    }
    model.train();
    assert!(model.named_modules().iter().all(|(_, m)| m.is_training()));
}

#[test]
fn errors_inside_containers_name_the_full_module_path() {
    let model = Sequential::new()
        .add_named(
            "features",
            Sequential::new()
                .add(ReLU::new())
                .add(LinearConfig::new(4, 2).init().unwrap()),
        )
        .unwrap();
    let err = model.forward(&randn(&[2, 3], 3)).unwrap_err().to_string();
    assert!(
        err.contains("features.1") && err.contains("Linear") && err.contains("[2, 3]"),
        "{err}"
    );
}

#[test]
fn sequential_child_can_be_replaced_through_a_shared_handle() {
    let model: Arc<dyn Module> = Arc::new(
        Sequential::new()
            .add(LinearConfig::new(2, 2).with_bias(false).init().unwrap())
            .add(BatchNormConfig::new(3).init().unwrap()),
    );
    // Find the BatchNorm layers the way a SyncBatchNorm converter would.
    let found: Vec<String> = model
        .named_modules()
        .into_iter()
        .filter(|(_, m)| m.is::<BatchNorm2d>())
        .map(|(n, _)| n)
        .collect();
    assert_eq!(found, ["1"]);
    let old = model.replace_child("1", Arc::new(ReLU::new())).unwrap();
    assert_eq!(old.type_name(), "BatchNorm2d");
    assert!(old.as_any().downcast_ref::<BatchNorm2d>().is_some());
    let bn: Arc<BatchNorm2d> = old.downcast_arc::<BatchNorm2d>().ok().unwrap();
    assert_eq!(bn.num_features(), 3);
    assert!(model.named_buffers().is_empty());
    assert_eq!(model.children()[1].1.type_name(), "ReLU");
    let err = model
        .replace_child("7", Arc::new(ReLU::new()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("`7`") && err.contains("[\"0\", \"1\"]"),
        "{err}"
    );
    let leaf = LinearConfig::new(2, 2).init().unwrap();
    assert!(leaf.replace_child("0", Arc::new(ReLU::new())).is_err());
}

#[test]
fn add_named_rejects_bad_and_duplicate_names() {
    let twice = Sequential::new()
        .add_named("a", ReLU::new())
        .unwrap()
        .add_named("a", ReLU::new());
    assert!(twice.err().unwrap().to_string().contains("already taken"));
    assert!(Sequential::new().add_named("a.b", ReLU::new()).is_err());
    assert!(Sequential::new().add_named("3", ReLU::new()).is_err());
}

#[test]
fn add_named_reserves_every_all_digit_name_for_positions() {
    // Past usize's range and with leading zeros: still digits, still refused.
    for name in ["007", "123456789012345678901234567890"] {
        let err = Sequential::new()
            .add_named(name, ReLU::new())
            .err()
            .unwrap();
        assert!(err.to_string().contains("positional"), "{name}: {err}");
    }
    assert!(Sequential::new().add_named("layer3", ReLU::new()).is_ok());
}

#[test]
fn add_after_named_children_names_each_child_by_its_free_position() {
    let model = Sequential::new()
        .add(ReLU::new())
        .add_named("named", ReLU::new())
        .unwrap()
        .add(ReLU::new())
        .add_shared(Arc::new(ReLU::new()));
    let names: Vec<String> = model.children().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0", "named", "2", "3"]);
}

#[test]
fn small_mlp_learns_a_synthetic_classification_task() {
    manual_seed(7);
    // Two Gaussian blobs per class in 4-D; the class is which blob a point came from.
    let n = 256;
    let mut gen = Generator::new(9);
    let mut xs = Vec::with_capacity(n * 4);
    let mut ys = Vec::with_capacity(n);
    for i in 0..n {
        let class = (i % 3) as i64;
        for d in 0..4 {
            let centre = if d as i64 == class { 2.0 } else { 0.0 };
            xs.push((centre + 0.5 * gen.normal()) as f32);
        }
        ys.push(class);
    }
    let inputs = Tensor::from_vec(xs, &[n, 4], Device::Cpu).unwrap();
    let targets = Tensor::from_vec(ys, &[n], Device::Cpu).unwrap();
    let dataset = Arc::new(TensorDataset::new(inputs.clone(), targets.clone()).unwrap());
    let loader = DataLoader::new(
        dataset,
        DataLoaderConfig {
            batch_size: 32,
            shuffle: true,
            ..Default::default()
        },
    )
    .unwrap();
    let model = Sequential::new()
        .add(LinearConfig::new(4, 16).init().unwrap())
        .add(ReLU::new())
        .add(LinearConfig::new(16, 3).init().unwrap());
    let full_loss = |model: &Sequential| {
        no_grad(|| {
            cross_entropy(&model.forward(&inputs).unwrap(), &targets, Reduction::Mean)
                .unwrap()
                .item()
                .unwrap()
        })
    };
    let before = full_loss(&model);
    let lr = 0.2;
    for _ in 0..5 {
        for batch in loader.iter() {
            let batch = batch.unwrap();
            let loss = cross_entropy(
                &model.forward(&batch.inputs).unwrap(),
                &batch.targets,
                Reduction::Mean,
            )
            .unwrap();
            for p in model.parameters() {
                p.set_grad(None).unwrap();
            }
            loss.backward().unwrap();
            for p in model.parameters() {
                let g = p.grad().unwrap();
                p.add_scaled_(&g, -lr).unwrap();
            }
        }
    }
    let after = full_loss(&model);
    assert!(
        after < 0.5 * before && after < 0.3,
        "loss {before} -> {after}"
    );
}

#[test]
fn a_child_run_before_its_parent_named_it_reports_the_error_without_an_empty_path() {
    use crate::{Child, Conv2dConfig};
    let child = Child::new(Conv2dConfig::new(3, 4, 3).init().unwrap());
    let x = Tensor::zeros(&[1, 2, 5, 5], DType::F32, Device::Cpu).unwrap();
    let err = child.forward(&x).unwrap_err().to_string();
    assert!(err.starts_with("Conv2d: ") && !err.contains("``"), "{err}");
    child.bind_name("conv");
    let err = child.forward(&x).unwrap_err().to_string();
    assert!(err.starts_with("in module `conv` (Conv2d): "), "{err}");
}
