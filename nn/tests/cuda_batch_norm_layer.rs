//! GPU conformance of the `BatchNorm2d` layer: a layer moved to `cuda:0` with
//! `Module::to_device` and a CPU twin with the same parameters, run through the same training
//! steps (plain, fused ReLU and fused add+ReLU forwards, backward) and then in evaluation, must
//! agree on outputs, gradients, running statistics and `num_batches_tracked`; every tensor of
//! the CUDA layer stays on the device.
//!
//! Runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).

use tandem_autograd::{no_grad, BackwardOptions, TensorBackward};
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_nn::{BatchNorm2d, BatchNormConfig, Fused, Module};

const GPU: Device = Device::Cuda(0);

fn randn(shape: &[usize], mean: f64, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, mean, 1.5, DType::F32, Device::Cpu, &mut gen).unwrap()
}

fn on(t: &Tensor, device: Device) -> Tensor {
    t.copy_detached().unwrap().to_device(device).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, tol: f64, skip: &[bool], what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let bad: Vec<String> = g
        .iter()
        .zip(&w)
        .enumerate()
        .filter(|(i, (a, b))| {
            let close = (*a - *b).abs() <= tol * (1.0 + b.abs());
            !skip.get(*i).copied().unwrap_or(false) && !close
        })
        .take(5)
        .map(|(i, (a, b))| format!("element {i}: cuda {a}, cpu {b}"))
        .collect();
    assert!(
        bad.is_empty(),
        "BatchNorm2d {what} {:?}: differs beyond {tol}·(1 + |cpu|): {}",
        want.dims(),
        bad.join("; ")
    );
}

#[test]
fn batch_norm_2d_on_cuda_matches_the_cpu_layer() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let c = 6;
    let cpu = BatchNormConfig::new(c).init().unwrap();
    // Parameters that are not the initial ones, the same on both layers.
    let gpu = BatchNormConfig::new(c).init().unwrap();
    no_grad(|| {
        for layer in [&cpu, &gpu] {
            layer.weight().unwrap().copy_(&randn(&[c], 1.0, 1)).unwrap();
            layer.bias().unwrap().copy_(&randn(&[c], 0.0, 2)).unwrap();
        }
    });
    gpu.to_device(GPU).unwrap();
    for (path, _, t) in gpu.named_tensors() {
        assert_eq!(t.device(), GPU, "{path} was not moved");
    }

    let shape = [16, c, 9, 12];
    for step in 0..3u64 {
        let x = randn(&shape, 2.0, 10 + step);
        let r = randn(&shape, 0.0, 20 + step);
        let g = randn(&shape, 0.0, 30 + step);
        // one training forward of a layer: plain, fused ReLU, fused add+ReLU by step
        let run = |layer: &BatchNorm2d, device: Device| {
            let (x, r) = (on(&x, device), on(&r, device));
            match step {
                0 => layer.forward(&x),
                1 => layer.forward_relu(&x),
                _ => layer.forward_add_relu(&x, &r),
            }
            .unwrap()
        };
        let (cpu_zero, gpu_zero) = (cpu.parameters(), gpu.parameters());
        for p in cpu_zero.iter().chain(&gpu_zero) {
            p.set_grad(None).unwrap();
        }
        let want = run(&cpu, Device::Cpu);
        let got = run(&gpu, GPU);
        assert_eq!(got.device(), GPU);
        let what = format!("training step {step}");
        assert_close(&got, &want, 2e-4, &[], &format!("{what}: output"));
        want.backward_with(Some(&g), &BackwardOptions::default())
            .unwrap();
        got.backward_with(Some(&on(&g, GPU)), &BackwardOptions::default())
            .unwrap();
        for (name, a, b) in [
            ("weight", gpu.weight().unwrap(), cpu.weight().unwrap()),
            ("bias", gpu.bias().unwrap(), cpu.bias().unwrap()),
        ] {
            let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
            assert_eq!(ga.device(), GPU, "{what}: {name} gradient device");
            assert_close(&ga, &gb, 1e-3, &[], &format!("{what}: grad {name}"));
        }
        for (name, a, b) in [
            (
                "running_mean",
                gpu.running_mean().unwrap(),
                cpu.running_mean().unwrap(),
            ),
            (
                "running_var",
                gpu.running_var().unwrap(),
                cpu.running_var().unwrap(),
            ),
        ] {
            assert_close(a, b, 1e-5, &[], &format!("{what}: {name}"));
        }
        let count = gpu.num_batches_tracked().unwrap();
        assert_eq!(count.device(), GPU);
        assert_eq!(
            count.to_vec::<i64>().unwrap(),
            cpu.num_batches_tracked().unwrap().to_vec::<i64>().unwrap(),
            "{what}: num_batches_tracked"
        );
    }

    cpu.eval();
    gpu.eval();
    let x = randn(&shape, 2.0, 40);
    let want = cpu.forward_relu(&x).unwrap();
    let got = gpu.forward_relu(&on(&x, GPU)).unwrap();
    assert_close(&got, &want, 2e-4, &[], "evaluation: output");
    assert_eq!(
        gpu.num_batches_tracked().unwrap().to_vec::<i64>().unwrap(),
        vec![3],
        "evaluation must not count a batch"
    );

    // An empty batch in evaluation: an empty output and input gradient, zero parameter
    // gradients, as on the CPU.
    let empty = [0, c, 9, 12];
    for p in cpu.parameters().iter().chain(&gpu.parameters()) {
        p.set_grad(None).unwrap();
    }
    let x = randn(&empty, 2.0, 50);
    let (xc, xg) = (
        x.copy_detached().unwrap().with_requires_grad().unwrap(),
        on(&x, GPU).with_requires_grad().unwrap(),
    );
    let want = cpu.forward_relu(&xc).unwrap();
    let got = gpu.forward_relu(&xg).unwrap();
    assert_eq!(got.device(), GPU);
    assert_close(&got, &want, 0.0, &[], "empty batch in evaluation: output");
    let g = randn(&empty, 0.0, 51);
    want.backward_with(Some(&g), &BackwardOptions::default())
        .unwrap();
    got.backward_with(Some(&on(&g, GPU)), &BackwardOptions::default())
        .unwrap();
    assert_close(
        &xg.grad().unwrap(),
        &xc.grad().unwrap(),
        0.0,
        &[],
        "empty batch in evaluation: input gradient",
    );
    for (name, a, b) in [
        ("weight", gpu.weight().unwrap(), cpu.weight().unwrap()),
        ("bias", gpu.bias().unwrap(), cpu.bias().unwrap()),
    ] {
        let what = format!("empty batch in evaluation: grad {name}");
        match (a.grad(), b.grad()) {
            (Some(ga), Some(gb)) => assert_close(&ga, &gb, 0.0, &[], &what),
            (None, None) => {}
            (ga, gb) => panic!(
                "{what}: a gradient on the GPU: {}, on the CPU: {}",
                ga.is_some(),
                gb.is_some()
            ),
        }
    }
    // In training, the CPU's answer for a batch without samples (an error or not) on both.
    cpu.train();
    gpu.train();
    let (cpu_result, gpu_result) = (cpu.forward(&x), gpu.forward(&on(&x, GPU)));
    match (cpu_result, gpu_result) {
        (Ok(want), Ok(got)) => assert_close(&got, &want, 0.0, &[], "empty batch in training"),
        (Err(c), Err(g)) => assert_eq!(g.to_string(), c.to_string(), "empty batch in training"),
        (c, g) => panic!(
            "empty batch in training: on the CPU {:?}, on the GPU {:?}",
            c.err(),
            g.err()
        ),
    }
}
