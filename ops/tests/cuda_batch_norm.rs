//! GPU conformance of batch norm: `batch_norm`, `batch_norm_relu` and `batch_norm_add_relu` on
//! `cuda:0` against the same ops on the CPU with the same inputs — forward, running-statistics
//! update, and backward (input, residual, weight and bias gradients) in training and in
//! evaluation, for contiguous and strided inputs and for the ResNet-20 layer shape whose
//! reductions are split over many blocks per channel; every phase of `batch_norm::phases` on its
//! own (what SyncBatchNorm runs); gradient checks in f64 on the GPU; and errors (device mixes,
//! bad shapes) equal to the CPU's.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! The per-channel statistics are sums in a different order than the CPU's, so results agree
//! within f32 rounding, not bit for bit. Behind a ReLU, an element whose pre-activation is
//! within rounding of 0 may fall on either side of the kink on the two devices; such elements
//! (|pre-activation| < 1e-4) are left out of the gradient comparisons and counted in the
//! message. Failures name the op, shape, dtype, mode, tensor and element.

mod common;

use common::GPU;

use tandem_autograd::{gradcheck, no_grad, BackwardOptions, GradcheckOptions, TensorBackward};
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::batch_norm::phases::{
    self, ApplyArgs, BackwardApplyArgs, BackwardReduceArgs, GradMask, NormalizationArgs,
    RunningUpdate, Statistics,
};
use tandem_ops::batch_norm::{batch_norm_fused, BatchNormArgs, Epilogue};

/// Random values on the CPU.
fn randn(shape: &[usize], mean: f64, std: f64, dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, mean, std, dtype, Device::Cpu, &mut gen).unwrap()
}

/// A fresh copy of `t` on `device` (contiguous).
fn on(t: &Tensor, device: Device) -> Tensor {
    t.copy_detached().unwrap().to_device(device).unwrap()
}

/// A fresh leaf copy of `t` on `device` that requires grad.
fn leaf(t: &Tensor, device: Device) -> Tensor {
    on(t, device).with_requires_grad().unwrap()
}

/// `shape` held channels-last: a strided `[N, C, …]` view of an `[N, …, C]` storage on
/// `device`, a leaf that requires grad, with `values`' elements.
fn channels_last_leaf(values: &Tensor, device: Device) -> Tensor {
    let dims = values.dims().to_vec();
    let rank = dims.len();
    // [N, C, rest…] -> storage order [N, rest…, C]
    let mut to_last: Vec<usize> = vec![0];
    to_last.extend(2..rank);
    to_last.push(1);
    let stored_shape: Vec<usize> = to_last.iter().map(|&d| dims[d]).collect();
    let stored = values
        .view_detached(values.layout().permute("test", &to_last).unwrap())
        .unwrap()
        .copy_detached()
        .unwrap();
    assert_eq!(stored.dims(), stored_shape.as_slice());
    // back to [N, C, rest…] as a view
    let mut back = vec![0usize; rank];
    for (i, &d) in to_last.iter().enumerate() {
        back[d] = i;
    }
    let stored = stored.to_device(device).unwrap();
    stored
        .view_detached(stored.layout().permute("test", &back).unwrap())
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// The relative error of `a` against `b`, `|a − b| / (1 + |b|)`: 0 when both are NaN,
/// infinite when only one is.
fn error(a: f64, b: f64) -> f64 {
    if a.is_nan() && b.is_nan() {
        0.0
    } else if a.is_nan() || b.is_nan() {
        f64::INFINITY
    } else {
        (a - b).abs() / (1.0 + b.abs())
    }
}

/// `got` (any device) equals `want` (CPU) within `tol·(1 + |want|)` per element, skipping the
/// elements `skip` marks. The message names `what`, the shape and the first mismatches.
fn assert_close_skipping(got: &Tensor, want: &Tensor, tol: f64, skip: &[bool], what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes differ");
    let (g, w) = (values(got), values(want));
    let mut bad = Vec::new();
    let mut count = 0;
    let mut worst = 0.0f64;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        if skip.get(i).copied().unwrap_or(false) {
            continue;
        }
        let err = error(a, b);
        if err > tol {
            count += 1;
            worst = worst.max(err);
            if bad.len() < 5 {
                bad.push(format!("element {i}: cuda {a}, cpu {b}"));
            }
        }
    }
    let skipped = skip.iter().filter(|&&s| s).count();
    assert!(
        bad.is_empty(),
        "{what} {:?} {}: {count} of {} elements differ by more than {tol}·(1 + |cpu|) \
         (worst {worst:.3e}; {skipped} skipped near the ReLU kink): {}",
        want.dims(),
        want.dtype(),
        g.len(),
        bad.join("; ")
    );
}

fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    assert_close_skipping(got, want, tol, &[], what);
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-10
    } else {
        2e-4
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Plain,
    Relu,
    AddRelu,
}

/// One device's copy of a batch-norm call's tensors.
struct Side {
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
}

impl Side {
    fn new(host: &Side, device: Device, strided: bool) -> Side {
        let x = if strided {
            channels_last_leaf(&host.x, device)
        } else {
            leaf(&host.x, device)
        };
        let residual = if strided {
            channels_last_leaf(&host.residual, device)
        } else {
            leaf(&host.residual, device)
        };
        Side {
            x,
            residual,
            weight: leaf(&host.weight, device),
            bias: leaf(&host.bias, device),
            running_mean: on(&host.running_mean, device),
            running_var: on(&host.running_var, device),
        }
    }

    fn run(&self, kind: Kind, training: bool, affine: bool) -> Tensor {
        let epilogue = match kind {
            Kind::Plain => Epilogue::Plain,
            Kind::Relu => Epilogue::Relu,
            Kind::AddRelu => Epilogue::AddRelu(&self.residual),
        };
        let args = BatchNormArgs {
            running_mean: Some(&self.running_mean),
            running_var: Some(&self.running_var),
            weight: affine.then_some(&self.weight),
            bias: affine.then_some(&self.bias),
            training,
            momentum: 0.1,
            eps: 1e-5,
        };
        batch_norm_fused(&self.x, epilogue, &args).unwrap()
    }
}

/// Host values for an `[N, C, …]` input: a different mean and spread per channel (far from 0
/// for some), a residual, affine parameters and running statistics.
fn host_side(shape: &[usize], dtype: DType, seed: u64) -> Side {
    let c = shape[1];
    let x = randn(shape, 0.0, 1.0, dtype, seed);
    // per-channel offset and scale: x·(1 + c/2) + 3c − 4
    let per_channel: Vec<f64> = (0..c).map(|ch| 1.0 + ch as f64 / 2.0).collect();
    let offsets: Vec<f64> = (0..c).map(|ch| 3.0 * ch as f64 - 4.0).collect();
    let l: usize = shape[2..].iter().product();
    let xv: Vec<f64> = values(&x)
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let ch = (i / l.max(1)) % c;
            v * per_channel[ch] + offsets[ch]
        })
        .collect();
    let x = Tensor::from_vec(xv, shape, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Side {
        x,
        residual: randn(shape, 0.0, 1.0, dtype, seed + 1),
        weight: randn(&[c], 1.0, 0.5, dtype, seed + 2),
        bias: randn(&[c], 0.0, 0.5, dtype, seed + 3),
        running_mean: randn(&[c], 0.0, 1.0, dtype, seed + 4),
        running_var: randn(&[c], 0.0, 1.0, dtype, seed + 5)
            .to_vec_f64()
            .map(|v| {
                let v: Vec<f64> = v.iter().map(|x| 0.5 + x.abs()).collect();
                Tensor::from_vec(v, &[c], Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            })
            .unwrap(),
    }
}

/// The CPU's pre-activation (batch norm's output, plus the residual for add+ReLU) of a call,
/// on copies, for the kink mask.
fn pre_activation(host: &Side, kind: Kind, training: bool, affine: bool) -> Vec<f64> {
    let side = Side::new(host, Device::Cpu, false);
    let z = no_grad(|| side.run(Kind::Plain, training, affine));
    let z = values(&z);
    match kind {
        Kind::AddRelu => z
            .iter()
            .zip(values(&host.residual))
            .map(|(a, b)| a + b)
            .collect(),
        _ => z,
    }
}

/// Runs one call on both devices and compares the output, the running statistics and every
/// gradient.
fn check_against_cpu(
    shape: &[usize],
    dtype: DType,
    kind: Kind,
    training: bool,
    affine: bool,
    strided: bool,
) {
    let what = format!(
        "{kind:?} {} {shape:?} {dtype}{}{}",
        if training { "training" } else { "eval" },
        if affine { "" } else { " without affine" },
        if strided { " channels-last" } else { "" }
    );
    let host = host_side(shape, dtype, shape.iter().sum::<usize>() as u64);
    let cpu = Side::new(&host, Device::Cpu, strided);
    let gpu = Side::new(&host, GPU, strided);
    let want = cpu.run(kind, training, affine);
    let got = gpu.run(kind, training, affine);
    assert_eq!(got.device(), GPU, "{what}: output device");
    let t = tol(dtype);
    assert_close(&got, &want, t, &format!("{what}: output"));
    assert_close(
        &gpu.running_mean,
        &cpu.running_mean,
        t,
        &format!("{what}: running_mean"),
    );
    assert_close(
        &gpu.running_var,
        &cpu.running_var,
        t,
        &format!("{what}: running_var"),
    );

    let g = randn(shape, 0.0, 1.0, dtype, 99);
    want.backward_with(Some(&g), &BackwardOptions::default())
        .unwrap();
    got.backward_with(Some(&on(&g, GPU)), &BackwardOptions::default())
        .unwrap();
    let skip: Vec<bool> = match kind {
        Kind::Plain => Vec::new(),
        _ => pre_activation(&host, kind, training, affine)
            .iter()
            .map(|z| z.abs() < 1e-4)
            .collect(),
    };
    // The gradient comparisons are in the input's logical order.
    let grad = |t: &Tensor, name: &str| {
        t.grad()
            .unwrap_or_else(|| panic!("{what}: no gradient for {name}"))
    };
    let mut tensors = vec![("x", &cpu.x, &gpu.x)];
    if kind == Kind::AddRelu {
        tensors.push(("residual", &cpu.residual, &gpu.residual));
    }
    for (name, c, d) in tensors {
        let (gc, gd) = (grad(c, name), grad(d, name));
        assert_eq!(gd.device(), GPU, "{what}: {name} gradient device");
        assert_close_skipping(&gd, &gc, t, &skip, &format!("{what}: grad {name}"));
    }
    if affine {
        // Sums over the batch: a flipped element near the kink moves them by one term.
        let sum_tol = if skip.is_empty() { t } else { t.max(1e-3) };
        for (name, c, d) in [
            ("weight", &cpu.weight, &gpu.weight),
            ("bias", &cpu.bias, &gpu.bias),
        ] {
            assert_close(
                &grad(d, name),
                &grad(c, name),
                sum_tol,
                &format!("{what}: grad {name}"),
            );
        }
    }
}

#[test]
fn fused_ops_match_the_cpu_forward_and_backward_in_training_and_eval() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // Odd spatial sizes (scalar loads), whole 16-byte vectors, [N, C], rank 3.
    let shapes: [&[usize]; 4] = [&[4, 3, 5, 5], &[3, 5, 4, 8], &[9, 6], &[2, 4, 7]];
    for shape in shapes {
        for dtype in [DType::F32, DType::F64] {
            for kind in [Kind::Plain, Kind::Relu, Kind::AddRelu] {
                for training in [true, false] {
                    check_against_cpu(shape, dtype, kind, training, true, false);
                }
            }
        }
        check_against_cpu(shape, DType::F32, Kind::Plain, true, false, false);
        check_against_cpu(shape, DType::F32, Kind::Relu, false, false, false);
    }
}

#[test]
fn strided_inputs_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for kind in [Kind::Plain, Kind::Relu, Kind::AddRelu] {
        for training in [true, false] {
            check_against_cpu(&[3, 4, 5, 6], DType::F32, kind, training, true, true);
        }
    }
    check_against_cpu(&[3, 2, 8, 8], DType::F64, Kind::AddRelu, true, true, true);
}

#[test]
fn resnet_layer_shapes_with_split_reductions_match_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // ResNet-20 at batch 128: 16 channels of 32×32 (many blocks per channel), 32 of 16×16,
    // 64 of 8×8; and one channel of many elements.
    let shapes: [&[usize]; 4] = [
        &[128, 16, 32, 32],
        &[128, 32, 16, 16],
        &[128, 64, 8, 8],
        &[64, 1, 100, 101],
    ];
    for shape in shapes {
        check_against_cpu(shape, DType::F32, Kind::Relu, true, true, false);
        check_against_cpu(shape, DType::F32, Kind::AddRelu, true, true, false);
    }
    check_against_cpu(
        &[128, 16, 32, 32],
        DType::F32,
        Kind::Plain,
        false,
        true,
        false,
    );
}

#[test]
fn a_second_call_gives_the_same_bits() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let host = host_side(&[64, 8, 32, 32], DType::F32, 5);
    let first = Side::new(&host, GPU, false);
    let second = Side::new(&host, GPU, false);
    let a = values(&first.run(Kind::Relu, true, true));
    let b = values(&second.run(Kind::Relu, true, true));
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "batch_norm_relu [64, 8, 32, 32] f32 on cuda: two runs differ"
    );
    assert_eq!(
        values(&first.running_var),
        values(&second.running_var),
        "running_var differs between two runs"
    );
}

#[test]
fn an_empty_batch_in_evaluation_gives_an_empty_output_and_gradient() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // Every epilogue, with and without affine parameters, in f32 and f64, against the CPU:
    // empty outputs and input gradients, parameter gradients of zeros (or none on both).
    for dtype in [DType::F32, DType::F64] {
        for kind in [Kind::Plain, Kind::Relu, Kind::AddRelu] {
            for affine in [true, false] {
                let what = format!("empty batch {kind:?} affine {affine} {dtype}");
                let host = host_side(&[0, 3, 4, 4], dtype, 1);
                let (cpu, dev) = (
                    Side::new(&host, Device::Cpu, false),
                    Side::new(&host, GPU, false),
                );
                let (want, got) = (cpu.run(kind, false, affine), dev.run(kind, false, affine));
                assert_eq!(got.device(), GPU, "{what}");
                assert_close(&got, &want, 0.0, &format!("{what}: output"));
                let g = randn(&[0, 3, 4, 4], 0.0, 1.0, dtype, 2);
                want.backward_with(Some(&g), &BackwardOptions::default())
                    .unwrap();
                got.backward_with(Some(&on(&g, GPU)), &BackwardOptions::default())
                    .unwrap();
                for (name, d, c) in [
                    ("x", &dev.x, &cpu.x),
                    ("residual", &dev.residual, &cpu.residual),
                    ("weight", &dev.weight, &cpu.weight),
                    ("bias", &dev.bias, &cpu.bias),
                ] {
                    match (d.grad(), c.grad()) {
                        (Some(gd), Some(gc)) => {
                            assert_close(&gd, &gc, 0.0, &format!("{what}: grad {name}"))
                        }
                        (None, None) => {}
                        (gd, gc) => panic!(
                            "{what}: a gradient of {name} on the GPU: {}, on the CPU: {}",
                            gd.is_some(),
                            gc.is_some()
                        ),
                    }
                }
                assert_close(
                    &dev.running_mean,
                    &cpu.running_mean,
                    0.0,
                    &format!("{what}: running mean"),
                );
            }
        }
    }
}

// ---- phases ----------------------------------------------------------------------------

#[test]
fn every_phase_matches_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for (shape, dtype) in [
        (&[8usize, 16, 32, 32][..], DType::F32),
        (&[5, 3, 7][..], DType::F64),
        (&[6, 4][..], DType::F32),
    ] {
        let what = |phase: &str| format!("{phase} {shape:?} {dtype}");
        let host = host_side(shape, dtype, 7);
        let (xc, xg) = (on(&host.x, Device::Cpu), on(&host.x, GPU));

        // statistics and the SyncBatchNorm round trip through sums
        let (sc, sg) = (
            phases::statistics(&xc).unwrap(),
            phases::statistics(&xg).unwrap(),
        );
        assert_eq!(
            sc.count.on_host(),
            sg.count.on_host(),
            "{}",
            what("statistics count")
        );
        assert_eq!(
            sg.mean.device(),
            GPU,
            "{}",
            what("statistics stay on the device")
        );
        assert_close(&sg.mean, &sc.mean, 1e-6, &what("statistics mean"));
        assert_close(&sg.var, &sc.var, 1e-5, &what("statistics var"));
        let (sums_c, sums_g) = (sc.to_sums().unwrap(), sg.to_sums().unwrap());
        assert_eq!(sums_g.device(), GPU);
        assert_close(&sums_g, &sums_c, 1e-6, &what("to_sums"));
        // two processes' sums added: the statistics of the doubled batch
        let doubled = |s: &Tensor| s.copy_detached().unwrap();
        let (dc, dg) = (doubled(&sums_c), doubled(&sums_g));
        dc.scale_(2.0).unwrap();
        dg.scale_(2.0).unwrap();
        let (back_c, back_g) = (
            Statistics::from_sums(&dc).unwrap(),
            Statistics::from_sums(&dg).unwrap(),
        );
        // The reduced count stays on the device; read here only to check it.
        assert!(
            back_g.count.on_host().is_none(),
            "{}",
            what("from_sums count")
        );
        assert_eq!(
            back_g.count.read().unwrap(),
            2 * sg.count.read().unwrap(),
            "{}",
            what("from_sums count")
        );
        assert_close(&back_g.mean, &back_c.mean, 1e-6, &what("from_sums mean"));
        assert_close(&back_g.var, &back_c.var, 1e-5, &what("from_sums var"));

        // running update, of f32 running statistics from the GPU's own statistics
        let c = shape[1];
        let rm = randn(&[c], 0.0, 1.0, DType::F32, 3);
        let rv = randn(&[c], 2.0, 0.1, DType::F32, 4);
        let (rmc, rvc, rmg, rvg) = (
            on(&rm, Device::Cpu),
            on(&rv, Device::Cpu),
            on(&rm, GPU),
            on(&rv, GPU),
        );
        let stats_on_cpu = Statistics {
            count: sg.count.clone(),
            mean: on(&sg.mean, Device::Cpu),
            var: on(&sg.var, Device::Cpu),
        };
        for (running_mean, running_var, stats) in [(&rmc, &rvc, &stats_on_cpu), (&rmg, &rvg, &sg)] {
            phases::update_running(&RunningUpdate {
                running_mean: Some(running_mean),
                running_var: Some(running_var),
                stats,
                momentum: 0.25,
            })
            .unwrap();
        }
        // Same inputs: the same bits.
        assert_eq!(
            values(&rmg),
            values(&rmc),
            "{}",
            what("update_running mean")
        );
        assert_eq!(values(&rvg), values(&rvc), "{}", what("update_running var"));

        // normalization, from the same statistics: the same bits
        let (w, b) = (host.weight.clone(), host.bias.clone());
        let norm_c = phases::normalization(&NormalizationArgs {
            mean: &stats_on_cpu.mean,
            var: &stats_on_cpu.var,
            weight: Some(&w),
            bias: Some(&b),
            eps: 1e-3,
        })
        .unwrap();
        let (wg, bg) = (on(&w, GPU), on(&b, GPU));
        let norm_g = phases::normalization(&NormalizationArgs {
            mean: &sg.mean,
            var: &sg.var,
            weight: Some(&wg),
            bias: Some(&bg),
            eps: 1e-3,
        })
        .unwrap();
        assert_eq!(norm_g.device(), GPU);
        assert_eq!(
            values(norm_g.table()),
            values(norm_c.table()),
            "{}",
            what("normalization table")
        );

        // apply and the backward phases with the same table: elementwise results to the bit
        let (rc, rg) = (on(&host.residual, Device::Cpu), on(&host.residual, GPU));
        for (name, ec, eg) in [
            ("plain", Epilogue::Plain, Epilogue::Plain),
            ("relu", Epilogue::Relu, Epilogue::Relu),
            ("add+relu", Epilogue::AddRelu(&rc), Epilogue::AddRelu(&rg)),
        ] {
            let yc = phases::apply(&ApplyArgs {
                x: &xc,
                norm: &norm_c,
                epilogue: ec,
            })
            .unwrap();
            let yg = phases::apply(&ApplyArgs {
                x: &xg,
                norm: &norm_g,
                epilogue: eg,
            })
            .unwrap();
            assert_eq!(
                values(&yg),
                values(&yc),
                "{}",
                what(&format!("apply {name}"))
            );

            let gc = randn(shape, 0.0, 1.0, dtype, 11);
            let gg = on(&gc, GPU);
            let (mask_c, mask_g) = match name {
                "plain" => (GradMask::None, GradMask::None),
                "relu" => (GradMask::Relu, GradMask::Relu),
                _ => (GradMask::Output(&yc), GradMask::Output(&yg)),
            };
            let red_c = phases::backward_reduce(&BackwardReduceArgs {
                grad: &gc,
                x: &xc,
                norm: &norm_c,
                mask: mask_c,
            })
            .unwrap();
            let red_g = phases::backward_reduce(&BackwardReduceArgs {
                grad: &gg,
                x: &xg,
                norm: &norm_g,
                mask: mask_g,
            })
            .unwrap();
            // Sums of N·L terms of either sign: rounding grows with √(N·L).
            let scale = (shape.iter().product::<usize>() as f64).sqrt();
            let sum_tol = if dtype == DType::F64 { 1e-12 } else { 1e-6 } * scale;
            assert_close(
                &red_g.sums,
                &red_c.sums,
                sum_tol,
                &what(&format!("backward_reduce sums {name}")),
            );
            match (&red_g.grad, &red_c.grad) {
                (Some(a), Some(b)) => assert_eq!(
                    values(a),
                    values(b),
                    "{}",
                    what("backward_reduce masked gradient")
                ),
                (None, None) => {}
                _ => panic!(
                    "{}: masked gradient on one side only",
                    what("backward_reduce")
                ),
            }
            // the input gradient from the same (CPU) sums: the same bits
            let sums_g = on(&red_c.sums, GPU);
            let g_bn_c = red_c.grad.as_ref().unwrap_or(&gc);
            let g_bn_g = red_g.grad.as_ref().unwrap_or(&gg);
            for training in [true, false] {
                let args = |grad, x, norm, sums| BackwardApplyArgs {
                    grad,
                    x,
                    norm,
                    sums,
                    count: &sc.count,
                    training,
                    relu_mask: name == "relu",
                };
                let gx_c =
                    phases::backward_apply(&args(g_bn_c, &xc, &norm_c, &red_c.sums)).unwrap();
                let gx_g = phases::backward_apply(&args(g_bn_g, &xg, &norm_g, &sums_g)).unwrap();
                assert_eq!(
                    values(&gx_g),
                    values(&gx_c),
                    "{}",
                    what(&format!("backward_apply {name} training {training}"))
                );
            }
            let (pw_c, pb_c) = phases::parameter_gradients(&red_c.sums, &norm_c, dtype).unwrap();
            let (pw_g, pb_g) = phases::parameter_gradients(&sums_g, &norm_g, dtype).unwrap();
            assert_eq!(values(&pw_g), values(&pw_c), "{}", what("grad weight"));
            assert_eq!(values(&pb_g), values(&pb_c), "{}", what("grad bias"));
        }
    }
}

#[test]
fn count_batch_advances_the_counter_on_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let counter = Tensor::scalar(41i64, GPU).unwrap();
    phases::count_batch(&counter).unwrap();
    phases::count_batch(&counter).unwrap();
    assert_eq!(counter.device(), GPU);
    assert_eq!(counter.to_vec::<i64>().unwrap(), vec![43]);
}

// ---- gradient checks on the GPU ------------------------------------------------------------

fn gpu_f64(shape: &[usize], mean: f64, seed: u64) -> Tensor {
    leaf(&randn(shape, mean, 1.0, DType::F64, seed), GPU)
}

fn check_gradients(
    what: &str,
    f: impl Fn(&[Tensor]) -> tandem_core::Result<Tensor>,
    inputs: &[Tensor],
) {
    let options = GradcheckOptions {
        atol: 1e-5,
        rtol: 1e-3,
        ..GradcheckOptions::default()
    };
    if let Err(e) = gradcheck(f, inputs, &options) {
        panic!("gradcheck of {what} on cuda:0 in f64: {e}");
    }
}

/// The arguments of a gradient-checked call.
fn bn_args<'a>(
    t: &'a [Tensor],
    training: bool,
    running: Option<(&'a Tensor, &'a Tensor)>,
) -> BatchNormArgs<'a> {
    BatchNormArgs {
        running_mean: running.map(|r| r.0),
        running_var: running.map(|r| r.1),
        weight: t.get(1),
        bias: t.get(2),
        training,
        momentum: 0.1,
        eps: 1e-5,
    }
}

/// The epilogue of `kind`, its residual being `t[3]`.
fn epilogue_of(kind: Kind, t: &[Tensor]) -> Epilogue<'_> {
    match kind {
        Kind::Plain => Epilogue::Plain,
        Kind::Relu => Epilogue::Relu,
        Kind::AddRelu => Epilogue::AddRelu(&t[3]),
    }
}

#[test]
fn gradcheck_in_f64_on_the_gpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let inputs = || {
        vec![
            gpu_f64(&[3, 2, 3, 3], 0.5, 1),
            gpu_f64(&[2], 1.0, 2),
            gpu_f64(&[2], 0.0, 3),
            gpu_f64(&[3, 2, 3, 3], 0.0, 4),
        ]
    };
    let rm = on(&randn(&[2], 0.3, 0.2, DType::F64, 5), GPU);
    let rv = on(
        &Tensor::full(&[2], 1.7, DType::F64, Device::Cpu).unwrap(),
        GPU,
    );
    for (name, kind) in [
        ("batch_norm", Kind::Plain),
        ("batch_norm_relu", Kind::Relu),
        ("batch_norm_add_relu", Kind::AddRelu),
    ] {
        check_gradients(
            &format!("{name} training"),
            |t: &[Tensor]| batch_norm_fused(&t[0], epilogue_of(kind, t), &bn_args(t, true, None)),
            &inputs(),
        );
        check_gradients(
            &format!("{name} eval"),
            |t: &[Tensor]| {
                batch_norm_fused(
                    &t[0],
                    epilogue_of(kind, t),
                    &bn_args(t, false, Some((&rm, &rv))),
                )
            },
            &inputs(),
        );
    }
    // [N, C] input without affine parameters (t has no weight or bias)
    check_gradients(
        "batch_norm [5, 3] training without affine",
        |t: &[Tensor]| batch_norm_fused(&t[0], Epilogue::Plain, &bn_args(t, true, None)),
        &[gpu_f64(&[5, 3], 2.0, 9)],
    );
}

// ---- errors ----------------------------------------------------------------------------

/// The error of `f` on the CPU and on the GPU, with the device names made alike.
fn errors(f: impl Fn(Device) -> tandem_core::Result<Tensor>) -> (String, String) {
    let cpu = f(Device::Cpu)
        .expect_err("the CPU call must fail")
        .to_string();
    let gpu = f(GPU)
        .expect_err("the CUDA call must fail")
        .to_string()
        .replace("cuda:0", "cpu");
    (cpu, gpu)
}

/// A call that is run on either device.
type Call<'a> = Box<dyn Fn(Device) -> tandem_core::Result<Tensor> + 'a>;

#[test]
fn bad_arguments_give_the_cpus_errors() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = randn(&[2, 4, 3, 3], 0.0, 1.0, DType::F32, 1);
    let four = randn(&[4], 1.0, 0.1, DType::F32, 2);
    let three = randn(&[3], 1.0, 0.1, DType::F32, 3);
    let bn =
        |x: &Tensor, rm: Option<&Tensor>, rv: Option<&Tensor>, w: Option<&Tensor>, training| {
            tandem_ops::batch_norm(x, rm, rv, w, None, training, 0.1, 1e-5)
        };
    let cases: Vec<(&str, Call<'_>)> = vec![
        (
            "a weight of the wrong length",
            Box::new(|d| bn(&on(&x, d), None, None, Some(&on(&three, d)), true)),
        ),
        (
            "a running_var of the wrong length",
            Box::new(|d| {
                bn(
                    &on(&x, d),
                    Some(&on(&four, d)),
                    Some(&on(&three, d)),
                    None,
                    false,
                )
            }),
        ),
        (
            "evaluation without running statistics",
            Box::new(|d| bn(&on(&x, d), None, None, None, false)),
        ),
        (
            "training on one value per channel",
            Box::new(|d| {
                bn(
                    &on(&randn(&[1, 4], 0.0, 1.0, DType::F32, 4), d),
                    None,
                    None,
                    None,
                    true,
                )
            }),
        ),
        (
            "a rank-1 input",
            Box::new(|d| bn(&on(&four, d), None, None, None, true)),
        ),
        (
            "an i64 input",
            Box::new(|d| {
                bn(
                    &on(&x, d).to_dtype(DType::I64).unwrap(),
                    None,
                    None,
                    None,
                    true,
                )
            }),
        ),
        (
            "a residual of another shape",
            Box::new(|d| {
                tandem_ops::batch_norm_add_relu(
                    &on(&x, d),
                    &on(&randn(&[2, 4, 3, 2], 0.0, 1.0, DType::F32, 5), d),
                    None,
                    None,
                    None,
                    None,
                    true,
                    0.1,
                    1e-5,
                )
            }),
        ),
    ];
    for (what, f) in cases {
        let (cpu, gpu) = errors(f);
        assert_eq!(gpu, cpu, "{what}: the CUDA error differs from the CPU's");
        assert!(cpu.starts_with("batch_norm"), "{what}: {cpu}");
    }
}

#[test]
fn mixing_devices_is_an_error_naming_both() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = on(&randn(&[2, 3, 4], 0.0, 1.0, DType::F32, 1), GPU);
    let w = randn(&[3], 1.0, 0.1, DType::F32, 2);
    for (what, result) in [
        (
            "weight on the CPU",
            tandem_ops::batch_norm(&x, None, None, Some(&w), None, true, 0.1, 1e-5),
        ),
        (
            "running stats on the CPU",
            tandem_ops::batch_norm(&x, Some(&w), Some(&w), None, None, false, 0.1, 1e-5),
        ),
        (
            "residual on the CPU",
            tandem_ops::batch_norm_add_relu(
                &x,
                &randn(&[2, 3, 4], 0.0, 1.0, DType::F32, 3),
                None,
                None,
                None,
                None,
                true,
                0.1,
                1e-5,
            ),
        ),
    ] {
        let err = result.expect_err(what).to_string();
        assert!(
            err.contains("batch_norm") && err.contains("cuda:0") && err.contains("cpu"),
            "{what}: {err}"
        );
    }
    // A phase given statistics from the other device.
    let stats = phases::statistics(&x).unwrap();
    let err = phases::normalization(&NormalizationArgs {
        mean: &stats.mean,
        var: &on(&stats.var, Device::Cpu),
        weight: None,
        bias: None,
        eps: 1e-5,
    })
    .expect_err("mean on cuda, var on the cpu")
    .to_string();
    assert!(
        err.contains("batch_norm_normalization") && err.contains("cuda:0") && err.contains("cpu"),
        "{err}"
    );
    // Sums whose count is 1: no variance can be taken; the same error as on the CPU.
    let one = Tensor::from_vec(vec![1.0f64, 0.5, 0.25], &[3], Device::Cpu).unwrap();
    let cpu = Statistics::from_sums(&one)
        .expect_err("a count of 1 on the cpu")
        .to_string();
    // On the GPU the count stays on the device and the kernel checks it, reporting at the next
    // read of the device: `cuda_batch_norm_count.rs` checks that alone in its binary, since
    // any test's read here could report it.
    assert!(cpu.contains("batch_norm_statistics"), "{cpu}");
}
