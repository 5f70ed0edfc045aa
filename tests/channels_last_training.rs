//! A model converted to channels-last in place (`Module::to_memory_format`) trains exactly as
//! the row-major one: the same loss and the same parameters after SGD-momentum steps of
//! ResNet-20 (with an optimizer made before the conversion), the same Adam/AdamW updates, the
//! same unscaled and clipped gradients under a `GradScaler`, and checkpoints that move values
//! between converted and unconverted models in logical order.

use std::path::{Path, PathBuf};

use tandem::nn::resnet::resnet20;
use tandem::optim::{clip_grad_norm, Adam, AdamConfig, AdamW, GradScalerConfig, StepOutcome};
use tandem::prelude::*;

fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("channels_last_training")
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn twin_resnets() -> (Box<dyn Module>, Box<dyn Module>) {
    manual_seed(3);
    let a = resnet20().unwrap();
    manual_seed(3);
    let b = resnet20().unwrap();
    (Box::new(a), Box::new(b))
}

/// `got` within `tol` of `want`, relative to `want`'s largest magnitude.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what} element {i}: {g} vs {w} (scale {scale})"
        );
    }
}

fn assert_same_parameters(what: &str, got: &dyn Module, want: &dyn Module, tol: f64) {
    for ((name, g), (_, w)) in got.named_parameters().iter().zip(want.named_parameters()) {
        assert_close(
            &format!("{what}: {name}"),
            &g.to_vec_f64().unwrap(),
            &w.to_vec_f64().unwrap(),
            tol,
        );
    }
}

fn conv_weight_twins(seed: u64) -> (Tensor, Tensor) {
    let mut g = Generator::new(seed);
    let w = Tensor::randn(&[4, 3, 3, 3], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let row_major = w.copy_detached().unwrap().with_requires_grad().unwrap();
    let channels_last = w.copy_detached().unwrap().with_requires_grad().unwrap();
    channels_last
        .to_memory_format_(MemoryFormat::ChannelsLast)
        .unwrap();
    (row_major, channels_last)
}

/// Gives each twin the same gradient, each in its parameter's memory format.
fn set_twin_grads(twins: &(Tensor, Tensor), grad: &Tensor) {
    twins
        .0
        .set_grad(Some(grad.copy_detached().unwrap()))
        .unwrap();
    twins
        .1
        .set_grad(Some(
            grad.contiguous_in(MemoryFormat::ChannelsLast).unwrap(),
        ))
        .unwrap();
}

#[test]
fn resnet20_sgd_momentum_steps_match_after_an_in_place_conversion() {
    let (reference, converted) = twin_resnets();
    let config = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_weight_decay(5e-4);
    let mut opt_ref = Sgd::new(reference.parameters(), config).unwrap();
    // Made before the conversion: it must update the converted tensors.
    let mut opt = Sgd::new(converted.parameters(), config).unwrap();
    converted
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap();

    let mut gen = Generator::new(11);
    for step in 0..2 {
        let x =
            Tensor::randn(&[4, 3, 16, 16], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let y = Tensor::from_vec(vec![1i64, 4, 0, 9], &[4], Device::Cpu).unwrap();
        let x_cl = x.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
        let mut losses = Vec::new();
        for (model, opt, x) in [
            (&reference, &mut opt_ref, &x),
            (&converted, &mut opt, &x_cl),
        ] {
            opt.zero_grad().unwrap();
            let loss = cross_entropy(&model.forward(x).unwrap(), &y, Reduction::Mean).unwrap();
            loss.backward().unwrap();
            losses.push(loss.item().unwrap());
            opt.step().unwrap();
        }
        assert!(
            (losses[0] - losses[1]).abs() <= 1e-5 * losses[0].abs(),
            "step {step}: loss {} vs {}",
            losses[0],
            losses[1]
        );
        // The f32 NHWC and NCHW kernels sum in different orders.
        assert_same_parameters(&format!("step {step}"), &*converted, &*reference, 1e-4);
    }
    for (name, p) in converted.named_parameters() {
        if p.rank() == 4 {
            assert!(p.layout().is_channels_last(), "{name} stays channels-last");
            let grad = p.grad().unwrap();
            assert!(grad.layout().is_channels_last(), "{name}'s gradient");
        }
    }
}

#[test]
fn adam_and_adamw_update_a_channels_last_weight_as_a_row_major_one() {
    for decoupled in [false, true] {
        let twins = conv_weight_twins(5);
        let config = AdamConfig::new(0.01).with_weight_decay(0.1);
        let make = |p: &Tensor| -> Box<dyn Optimizer> {
            if decoupled {
                Box::new(AdamW::new(vec![p.clone()], config).unwrap())
            } else {
                Box::new(Adam::new(vec![p.clone()], config).unwrap())
            }
        };
        let (mut opt_ref, mut opt) = (make(&twins.0), make(&twins.1));
        let mut gen = Generator::new(6);
        for _ in 0..3 {
            let g =
                Tensor::randn(&[4, 3, 3, 3], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
            set_twin_grads(&twins, &g);
            opt_ref.step().unwrap();
            opt.step().unwrap();
        }
        assert!(twins.1.layout().is_channels_last());
        assert_close(
            &format!("adam (decoupled: {decoupled})"),
            &twins.1.to_vec_f64().unwrap(),
            &twins.0.to_vec_f64().unwrap(),
            1e-6,
        );
    }
}

#[test]
fn grad_scaler_and_clipping_see_a_channels_last_gradient_in_logical_order() {
    let twins = conv_weight_twins(8);
    let mut gen = Generator::new(9);
    let g = Tensor::randn(&[4, 3, 3, 3], 0.0, 64.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    set_twin_grads(&twins, &g);
    let mut results = Vec::new();
    for p in [&twins.0, &twins.1] {
        let mut opt = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
        let mut scaler = GradScalerConfig::default()
            .with_init_scale(64.0)
            .init()
            .unwrap();
        scaler.unscale(&mut opt).unwrap();
        let norm = clip_grad_norm(std::slice::from_ref(p), 0.5, 2.0).unwrap();
        let grad = p.grad().unwrap();
        assert_eq!(grad.memory_format(), p.memory_format(), "layout kept");
        let outcome = scaler.step(&mut opt).unwrap();
        assert_eq!(outcome, StepOutcome::Applied);
        results.push((norm, grad.to_vec_f64().unwrap(), p.to_vec_f64().unwrap()));
    }
    assert!((results[0].0 - results[1].0).abs() <= 1e-6 * results[0].0);
    assert_close(
        "unscaled, clipped gradient",
        &results[1].1,
        &results[0].1,
        1e-6,
    );
    assert_close(
        "parameter after the step",
        &results[1].2,
        &results[0].2,
        1e-6,
    );

    // An infinity in the channels-last gradient skips the step.
    let before = twins.1.to_vec_f64().unwrap();
    let mut bad = g.to_vec::<f32>().unwrap();
    bad[5] = f32::INFINITY;
    let bad = Tensor::from_vec(bad, &[4, 3, 3, 3], Device::Cpu).unwrap();
    set_twin_grads(&twins, &bad);
    let mut opt = Sgd::new(vec![twins.1.clone()], SgdConfig::new(0.1)).unwrap();
    let mut scaler = GradScalerConfig::default().init().unwrap();
    assert_eq!(scaler.step(&mut opt).unwrap(), StepOutcome::Skipped);
    assert_eq!(twins.1.to_vec_f64().unwrap(), before);
}

#[test]
fn checkpoints_move_values_between_converted_and_row_major_models() {
    let dir = scratch("round_trip");
    let (row_major, converted) = twin_resnets();
    converted
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap();
    // Make the converted model's values differ from its twin's, then save it.
    for p in converted.parameters() {
        p.map_inplace_f64("test", |v| v * 0.5 + 0.25).unwrap();
    }
    let from_converted = dir.join("converted.safetensors");
    save_model(&from_converted, &*converted).unwrap();

    // Into a row-major model: the same logical values.
    load_model(&from_converted, &*row_major).unwrap();
    assert_same_parameters("loaded into row-major", &*row_major, &*converted, 0.0);

    // A row-major file into a converted model lands right and keeps its layout.
    let (fresh, target) = twin_resnets();
    target.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    for p in fresh.parameters() {
        p.map_inplace_f64("test", |v| v - 1.0).unwrap();
    }
    let from_row_major = dir.join("row_major.safetensors");
    save_model(&from_row_major, &*fresh).unwrap();
    load_model(&from_row_major, &*target).unwrap();
    assert_same_parameters("loaded into channels-last", &*target, &*fresh, 0.0);
    for (name, p) in target.named_parameters() {
        assert!(p.rank() != 4 || p.layout().is_channels_last(), "{name}");
    }
}
