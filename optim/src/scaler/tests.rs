use tandem_autograd::TensorBackward;
use tandem_core::{DType, Device, Tensor};

use super::*;
use crate::{clip_grad_norm, Adam, AdamConfig, Sgd, SgdConfig};

fn param(values: &[f32]) -> Tensor {
    Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

fn set_grad(p: &Tensor, values: &[f32]) {
    p.set_grad(Some(
        Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu).unwrap(),
    ))
    .unwrap();
}

fn grad(p: &Tensor) -> Vec<f32> {
    p.grad().unwrap().to_vec::<f32>().unwrap()
}

/// `loss = sum(p * [1, 2, 3])`, scaled and back-propagated: the gradient is `scale * [1, 2, 3]`.
fn backward_scaled(scaler: &GradScaler, p: &Tensor) {
    let weights = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu).unwrap();
    let loss = tandem_ops::sum_all(&tandem_ops::mul(p, &weights).unwrap()).unwrap();
    scaler.scale(&loss).unwrap().backward().unwrap();
}

#[test]
fn defaults_are_pytorchs_and_invalid_configs_are_refused() {
    let c = GradScalerConfig::default();
    assert_eq!(
        (c.init_scale, c.growth_factor, c.backoff_factor),
        (65536.0, 2.0, 0.5)
    );
    assert_eq!((c.growth_interval, c.enabled), (2000, true));
    assert_eq!(GradScaler::new().scale_value(), 65536.0);
    for (bad, needle) in [
        (c.with_init_scale(0.0), "init_scale"),
        (c.with_init_scale(f64::NAN), "init_scale"),
        (c.with_init_scale(1e39), "init_scale"),
        (c.with_growth_factor(1.0), "growth_factor"),
        (c.with_growth_factor(f64::INFINITY), "growth_factor"),
        (c.with_backoff_factor(1.0), "backoff_factor"),
        (c.with_backoff_factor(0.0), "backoff_factor"),
        (c.with_growth_interval(0), "growth_interval"),
    ] {
        let err = bad.init().err().expect("refused").to_string();
        assert!(err.contains("GradScaler") && err.contains(needle), "{err}");
    }
}

#[test]
fn scale_multiplies_the_loss_and_its_gradients() {
    let scaler = GradScalerConfig::default()
        .with_init_scale(8.0)
        .init()
        .unwrap();
    let p = param(&[1.0, 1.0, 1.0]);
    backward_scaled(&scaler, &p);
    assert_eq!(grad(&p), [8.0, 16.0, 24.0]);
    let loss = Tensor::scalar(1.5f32, Device::Cpu).unwrap();
    assert_eq!(scaler.scale(&loss).unwrap().item().unwrap(), 12.0);
}

/// Runs `steps` steps of SGD (lr 0.1) on `loss = sum(p * [1, 2, 3])` through `scaler`, putting
/// `bad[step]` into element 1 of the gradient at the chosen steps; returns the outcomes and
/// the scale after each update.
fn run_pattern(
    scaler: &mut GradScaler,
    bad: &[(usize, f32)],
    steps: usize,
) -> (Tensor, Vec<StepOutcome>, Vec<f32>) {
    let p = param(&[1.0, 1.0, 1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
    let (mut outcomes, mut scales) = (Vec::new(), Vec::new());
    for step in 0..steps {
        sgd.zero_grad().unwrap();
        backward_scaled(scaler, &p);
        if let Some(&(_, value)) = bad.iter().find(|(s, _)| *s == step) {
            let g = p.grad().unwrap();
            g.write_slice::<f32>().unwrap()[1] = value;
        }
        outcomes.push(scaler.step(&mut sgd).unwrap());
        scaler.update().unwrap();
        scales.push(scaler.scale_value() as f32);
    }
    (p, outcomes, scales)
}

const BAD: [(usize, f32); 4] = [
    (0, f32::INFINITY),
    (1, f32::NAN),
    (5, f32::NEG_INFINITY),
    (9, f32::NAN),
];

#[test]
fn exactly_the_steps_with_non_finite_gradients_are_skipped() {
    let mut scaler = GradScalerConfig::default()
        .with_growth_interval(3)
        .init()
        .unwrap();
    let (p, outcomes, _) = run_pattern(&mut scaler, &BAD, 14);
    for (step, outcome) in outcomes.iter().enumerate() {
        let injected = BAD.iter().any(|(s, _)| *s == step);
        assert_eq!(outcome.is_skipped(), injected, "step {step}: {outcome:?}");
    }
    assert_eq!(scaler.skipped_steps(), 4);
    assert_eq!(scaler.steps(), 14);
    // 10 applied steps of lr 0.1 on the true (unscaled) gradient [1, 2, 3].
    let want: Vec<f32> = [1.0f32, 2.0, 3.0]
        .iter()
        .map(|g| (0..10).fold(1.0f32, |p, _| p - 0.1 * g))
        .collect();
    assert_eq!(p.to_vec::<f32>().unwrap(), want);
}

#[test]
fn the_scale_follows_the_hand_computed_schedule() {
    let mut scaler = GradScalerConfig::default()
        .with_growth_interval(3)
        .init()
        .unwrap();
    let (_, _, scales) = run_pattern(&mut scaler, &BAD, 14);
    // Back off at 0 and 1 (2^16 -> 2^15 -> 2^14); clean 2, 3, 4: grow after the third (2^15);
    // back off at 5; clean 6, 7, 8: grow; back off at 9; clean 10, 11, 12: grow; 13 clean.
    let k = |e: i32| 2f32.powi(e);
    let want = [
        k(15),
        k(14),
        k(14),
        k(14),
        k(15),
        k(14),
        k(14),
        k(14),
        k(15),
        k(14),
        k(14),
        k(14),
        k(15),
        k(15),
    ];
    assert_eq!(scales, want);
    assert_eq!(scaler.growth_tracker(), 1);
}

/// The scales `torch.amp.GradScaler("cpu", ...)` (PyTorch 2.15) reported through `get_scale()`
/// after each `update()` for the same problem and the same injected values (`BAD`), as f32
/// bits. Recorded with:
///
/// ```text
/// import torch
/// def run(init, growth, backoff, interval, bad, n):
///     s = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth,
///                              backoff_factor=backoff, growth_interval=interval)
///     p = torch.nn.Parameter(torch.ones(3)); opt = torch.optim.SGD([p], lr=0.1); out = []
///     for step in range(n):
///         opt.zero_grad(); s.scale((p * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
///         if step in bad: p.grad[1] = bad[step]
///         s.step(opt); s.update(); out.append(s.get_scale())
///     return out
/// bad = {0: inf, 1: nan, 5: -inf, 9: nan}
/// run(2.**16, 2.0, 0.5, 3, bad, 14); run(1000.0, 1.7, 0.3, 2, bad, 14)
/// ```
const TORCH_POWERS_OF_TWO: [u32; 14] = [
    0x47000000, 0x46800000, 0x46800000, 0x46800000, 0x47000000, 0x46800000, 0x46800000, 0x46800000,
    0x47000000, 0x46800000, 0x46800000, 0x46800000, 0x47000000, 0x47000000,
];
const TORCH_ODD_FACTORS: [u32; 14] = [
    0x43960000, 0x42b40000, 0x42b40000, 0x43190000, 0x43190000, 0x4237999a, 0x4237999a, 0x429c0f5c,
    0x429c0f5c, 0x41bb45a2, 0x41bb45a2, 0x421f2e63, 0x421f2e63, 0x42874dd4,
];

#[test]
fn the_scale_sequence_is_pytorchs_bit_for_bit() {
    let configs = [
        (
            GradScalerConfig::default().with_growth_interval(3),
            TORCH_POWERS_OF_TWO,
        ),
        (
            GradScalerConfig::default()
                .with_init_scale(1000.0)
                .with_growth_factor(1.7)
                .with_backoff_factor(0.3)
                .with_growth_interval(2),
            TORCH_ODD_FACTORS,
        ),
    ];
    for (config, torch) in configs {
        let mut scaler = config.init().unwrap();
        let (_, _, scales) = run_pattern(&mut scaler, &BAD, 14);
        let bits: Vec<u32> = scales.iter().map(|s| s.to_bits()).collect();
        assert_eq!(bits, torch, "{config:?}: {scales:?}");
    }
}

#[test]
fn growth_stops_where_f32_would_overflow() {
    let mut scaler = GradScalerConfig::default()
        .with_init_scale(f32::MAX as f64 / 1.5)
        .with_growth_interval(1)
        .init()
        .unwrap();
    let before = scaler.scale_value();
    let p = param(&[1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
    for _ in 0..2 {
        set_grad(&p, &[1.0]);
        assert_eq!(scaler.step(&mut sgd).unwrap(), StepOutcome::Applied);
        scaler.update().unwrap();
        assert_eq!(scaler.scale_value(), before);
        assert_eq!(scaler.growth_tracker(), 0);
    }
}

#[test]
fn unscale_before_clipping_clips_the_true_gradients() {
    let true_grads = [[3.0f32, -4.0, 12.0], [0.5, 0.25, -1.0]];
    let update = |scaled: bool| {
        let params: Vec<Tensor> = true_grads.iter().map(|_| param(&[1.0, 2.0, 3.0])).collect();
        let mut sgd = Sgd::new(params.clone(), SgdConfig::new(0.5)).unwrap();
        let mut scaler = GradScalerConfig::default()
            .with_init_scale(1024.0)
            .init()
            .unwrap();
        for (p, g) in params.iter().zip(&true_grads) {
            let g: Vec<f32> = g
                .iter()
                .map(|x| if scaled { x * 1024.0 } else { *x })
                .collect();
            set_grad(p, &g);
        }
        let norm = if scaled {
            scaler.unscale(&mut sgd).unwrap();
            let norm = clip_grad_norm(&params, 2.0, 2.0).unwrap();
            assert_eq!(scaler.step(&mut sgd).unwrap(), StepOutcome::Applied);
            scaler.update().unwrap();
            norm
        } else {
            let norm = clip_grad_norm(&params, 2.0, 2.0).unwrap();
            sgd.step().unwrap();
            norm
        };
        let values: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec().unwrap()).collect();
        (norm, values)
    };
    let (norm, values) = update(true);
    let (want_norm, want_values) = update(false);
    assert_eq!(norm, want_norm);
    assert_eq!(values, want_values);
}

#[test]
fn unscale_divides_once_and_step_uses_it() {
    let p = param(&[1.0, 1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::new(1.0)).unwrap();
    let mut scaler = GradScalerConfig::default()
        .with_init_scale(4.0)
        .init()
        .unwrap();
    set_grad(&p, &[8.0, -2.0]);
    scaler.unscale(&mut sgd).unwrap();
    assert_eq!(grad(&p), [2.0, -0.5]);
    let err = scaler.unscale(&mut sgd).unwrap_err().to_string();
    assert!(
        err.contains("already been called") && err.contains("SGD"),
        "{err}"
    );
    assert_eq!(grad(&p), [2.0, -0.5], "not divided twice");
    assert_eq!(scaler.step(&mut sgd).unwrap(), StepOutcome::Applied);
    assert_eq!(p.to_vec::<f32>().unwrap(), [-1.0, 1.5]);
    let err = scaler.step(&mut sgd).unwrap_err().to_string();
    assert!(err.contains("step() has already been called"), "{err}");
    let err = scaler.unscale(&mut sgd).unwrap_err().to_string();
    assert!(err.contains("after step()"), "{err}");
    scaler.update().unwrap();
    let err = scaler.update().unwrap_err().to_string();
    assert!(err.contains("no gradients were checked"), "{err}");
    // The next step starts afresh.
    set_grad(&p, &[4.0, 4.0]);
    assert_eq!(scaler.step(&mut sgd).unwrap(), StepOutcome::Applied);
    scaler.update().unwrap();
}

#[test]
fn a_skipped_step_leaves_adam_and_its_step_count_alone() {
    let p = param(&[1.0, 2.0]);
    let mut adam = Adam::new(vec![p.clone()], AdamConfig::new(0.1)).unwrap();
    let mut scaler = GradScaler::new();
    set_grad(&p, &[f32::NAN, 1.0]);
    assert_eq!(scaler.step(&mut adam).unwrap(), StepOutcome::Skipped);
    assert_eq!(adam.step_count(), 0);
    assert_eq!(p.to_vec::<f32>().unwrap(), [1.0, 2.0]);
    scaler.update().unwrap();
    assert_eq!(scaler.scale_value(), 32768.0);
    set_grad(&p, &[32768.0, 32768.0]);
    assert_eq!(scaler.step(&mut adam).unwrap(), StepOutcome::Applied);
    assert_eq!(adam.step_count(), 1);
}

#[test]
fn large_strided_and_f64_gradients_are_unscaled_and_checked_in_one_pass() {
    let n = 3 * crate::multi_tensor::CHUNK_ELEMENTS as usize + 5;
    let big = Tensor::zeros(&[n], DType::F32, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let strided = Tensor::zeros(&[2, 2], DType::F32, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let double = Tensor::zeros(&[3], DType::F64, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let mut sgd = Sgd::new(
        vec![big.clone(), strided.clone(), double.clone()],
        SgdConfig::new(0.0),
    )
    .unwrap();
    for bad_at in [None, Some(n - 1), Some(7)] {
        let mut values: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 2.0).collect();
        if let Some(i) = bad_at {
            values[i] = f32::INFINITY;
        }
        big.set_grad(Some(
            Tensor::from_vec(values.clone(), &[n], Device::Cpu).unwrap(),
        ))
        .unwrap();
        let base = Tensor::from_vec(vec![2.0f32, 4.0, 6.0, 8.0], &[2, 2], Device::Cpu).unwrap();
        let view = base
            .view_detached(base.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        strided.set_grad(Some(view)).unwrap();
        double
            .set_grad(Some(
                Tensor::from_vec(vec![2.0f64, -6.0, 1.0], &[3], Device::Cpu).unwrap(),
            ))
            .unwrap();
        let mut scaler = GradScalerConfig::default()
            .with_init_scale(2.0)
            .init()
            .unwrap();
        let outcome = scaler.step(&mut sgd).unwrap();
        assert_eq!(outcome.is_skipped(), bad_at.is_some(), "bad at {bad_at:?}");
        let got = grad(&big);
        for (i, (g, v)) in got.iter().zip(&values).enumerate() {
            if v.is_finite() {
                assert_eq!(*g, v / 2.0, "element {i}");
            }
        }
        assert_eq!(base.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(
            double.grad().unwrap().to_vec::<f64>().unwrap(),
            [1.0, -3.0, 0.5]
        );
    }
}

#[test]
fn low_precision_gradients_are_refused_by_name() {
    let p = Tensor::zeros(&[2], DType::F16, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
    p.set_grad(Some(Tensor::zeros(&[2], DType::F16, Device::Cpu).unwrap()))
        .unwrap();
    let err = GradScaler::new().unscale(&mut sgd).unwrap_err().to_string();
    assert!(
        err.contains("parameter 0") && err.contains("f16") && err.contains("f32"),
        "{err}"
    );
}

#[test]
fn a_disabled_scaler_passes_everything_through() {
    let mut scaler = GradScalerConfig::default()
        .with_enabled(false)
        .init()
        .unwrap();
    let p = param(&[1.0, 1.0, 1.0]);
    let mut sgd = Sgd::new(vec![p.clone()], SgdConfig::new(1.0)).unwrap();
    backward_scaled(&scaler, &p);
    assert_eq!(grad(&p), [1.0, 2.0, 3.0]);
    scaler.unscale(&mut sgd).unwrap();
    scaler.unscale(&mut sgd).unwrap();
    assert_eq!(scaler.step(&mut sgd).unwrap(), StepOutcome::Applied);
    scaler.update().unwrap();
    assert_eq!(scaler.scale_value(), 1.0);
    assert!(scaler.state().is_empty());
    scaler.load_state(&[]).unwrap();
}

#[test]
fn state_round_trips_and_bad_state_is_refused() {
    let config = GradScalerConfig::default()
        .with_init_scale(1000.0)
        .with_growth_factor(1.7)
        .with_backoff_factor(0.3)
        .with_growth_interval(4);
    let mut scaler = config.init().unwrap();
    run_pattern(&mut scaler, &BAD[..2], 4);
    let state = scaler.state();
    let mut resumed = GradScaler::new();
    resumed.load_state(&state).unwrap();
    assert_eq!(resumed.scale_value(), scaler.scale_value());
    assert_eq!(resumed.growth_tracker(), 2);
    assert_eq!(resumed.skipped_steps(), 2);
    assert_eq!(resumed.steps(), 4);
    assert_eq!(resumed.config().growth_factor, 1.7);
    assert_eq!(resumed.config().growth_interval, 4);
    // Both continue identically.
    let (_, _, a) = run_pattern(&mut scaler, &[(3, f32::NAN)], 6);
    let (_, _, b) = run_pattern(&mut resumed, &[(3, f32::NAN)], 6);
    assert_eq!(a, b);

    let err = resumed.load_state(&[]).unwrap_err().to_string();
    assert!(err.contains("disabled GradScaler"), "{err}");
    let without = |name: &str| -> Vec<(String, Tensor)> {
        state.iter().filter(|(n, _)| n != name).cloned().collect()
    };
    let err = resumed
        .load_state(&without("scale"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing entry `scale`"), "{err}");
    let mut extra = state.clone();
    extra.push(("bogus".into(), Tensor::scalar(1i64, Device::Cpu).unwrap()));
    let err = resumed.load_state(&extra).unwrap_err().to_string();
    assert!(err.contains("unknown entry `bogus`"), "{err}");
    let mut negative = without("scale");
    negative.push((
        "scale".into(),
        Tensor::scalar(-1.0f32, Device::Cpu).unwrap(),
    ));
    let err = resumed.load_state(&negative).unwrap_err().to_string();
    assert!(err.contains("init_scale"), "{err}");
    assert_eq!(resumed.scale_value(), scaler.scale_value(), "unchanged");
}
