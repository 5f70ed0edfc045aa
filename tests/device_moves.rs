//! Moving a model between devices keeps every parameter's identity: a hook registered before
//! the move still fires after it, an optimizer made before the move still updates the same
//! tensors with the state it had gathered, and a round trip leaves the values unchanged.
//!
//! The round trip goes through `cuda:0` when this machine has a CUDA device, and stays on the
//! CPU otherwise (the identity checks hold either way); asking for CUDA without it is a clear
//! error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem::autograd::register_grad_ready_hook;
use tandem::prelude::*;

fn batch(gen: &mut Generator, device: Device) -> (Tensor, Tensor) {
    let x = Tensor::randn(&[8, 1, 28, 28], 0.0, 1.0, DType::F32, Device::Cpu, gen).unwrap();
    let y: Vec<i64> = (0..8).map(|i| i % 10).collect();
    let y = Tensor::from_vec(y, &[8], Device::Cpu).unwrap();
    (x.to_device(device).unwrap(), y.to_device(device).unwrap())
}

fn step(model: &dyn Module, opt: &mut Sgd, x: &Tensor, y: &Tensor) {
    let loss = cross_entropy(&model.forward(x).unwrap(), y, Reduction::Mean).unwrap();
    opt.zero_grad().unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
}

fn values(model: &dyn Module) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

#[test]
fn moving_a_model_keeps_parameter_identity_hooks_and_optimizer_state() {
    let away = if tandem::core::cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    manual_seed(3);
    let moved = lenet5().unwrap();
    manual_seed(3);
    let stayed = lenet5().unwrap();
    let config = SgdConfig::new(0.05).with_momentum(0.9);
    let mut opt_moved = Sgd::new(moved.parameters(), config).unwrap();
    let mut opt_stayed = Sgd::new(stayed.parameters(), config).unwrap();
    let ids: Vec<_> = moved.parameters().iter().map(|p| p.id()).collect();
    let fired = Arc::new(AtomicUsize::new(0));
    let counter = fired.clone();
    register_grad_ready_hook(&moved.parameters()[0], move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(())
    })
    .unwrap();

    let mut gen = Generator::new(9);
    let (x, y) = batch(&mut gen, Device::Cpu);
    step(&moved, &mut opt_moved, &x, &y);
    step(&stayed, &mut opt_stayed, &x, &y);
    assert_eq!(values(&moved), values(&stayed));

    // There and back: same tensors, same values, the momentum gathered so far kept.
    moved.to_device(away).unwrap();
    assert_eq!(moved.device(), away);
    assert!(moved.parameters().iter().all(|p| p.device() == away));
    moved.to_device(Device::Cpu).unwrap();
    let after: Vec<_> = moved.parameters().iter().map(|p| p.id()).collect();
    assert_eq!(ids, after, "parameters keep their identity");
    assert_eq!(
        values(&moved),
        values(&stayed),
        "a round trip keeps the values"
    );

    step(&moved, &mut opt_moved, &x, &y);
    step(&stayed, &mut opt_stayed, &x, &y);
    assert_eq!(
        fired.load(Ordering::Relaxed),
        2,
        "the hook fires before and after the move"
    );
    assert_eq!(
        values(&moved),
        values(&stayed),
        "the optimizer's momentum survived the move"
    );
}

#[test]
fn moving_a_model_to_cuda_without_cuda_names_what_is_missing() {
    if tandem::core::cuda::is_available() {
        println!("skipped: this machine has a CUDA device");
        return;
    }
    let model = lenet5().unwrap();
    let err = model.to_device(Device::Cuda(0)).unwrap_err().to_string();
    assert!(
        err.contains("cuda:0") && err.contains("libcuda.so.1"),
        "{err}"
    );
    // the failing tensor is named as a tensor, not as a module
    assert!(
        err.starts_with("tensor `features.0.weight` of the Sequential: ")
            && !err.contains("module"),
        "{err}"
    );
    assert!(model.parameters().iter().all(|p| p.device() == Device::Cpu));
}
