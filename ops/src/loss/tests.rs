//! Tests of the losses: gradient checks under every reduction, hand-computed values, stability
//! and the errors for bad targets.

use super::*;
use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
use tandem_autograd::TensorBackward;
use tandem_core::{Device, Generator};

const REDUCTIONS: [Reduction; 3] = [Reduction::Mean, Reduction::Sum, Reduction::None];

fn labels(values: &[i64]) -> Tensor {
    Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu).unwrap()
}

fn f32_tensor(values: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, Device::Cpu).unwrap()
}

#[test]
fn gradcheck_nll_and_cross_entropy_under_every_reduction() {
    let targets = labels(&[2, 0, 4, 4, 1]);
    for reduction in REDUCTIONS {
        check(
            |t| nll_loss(&t[0], &targets, reduction),
            &[rand_f64(&[5, 6], 1)],
        );
        check(
            |t| cross_entropy(&t[0], &targets, reduction),
            &[rand_f64(&[5, 6], 2)],
        );
        // strided scores: the transpose of a [6, 5] buffer
        check(
            |t| nll_loss(&t[0], &targets, reduction),
            &[rand_f64_noncontiguous(&[5, 6], 3)],
        );
        check(
            |t| cross_entropy(&t[0], &targets, reduction),
            &[rand_f64_noncontiguous(&[5, 6], 4)],
        );
    }
}

#[test]
fn gradcheck_mse_in_both_inputs_under_every_reduction() {
    for reduction in REDUCTIONS {
        check(
            |t| mse_loss(&t[0], &t[1], reduction),
            &[rand_f64(&[3, 4], 5), rand_f64(&[3, 4], 6)],
        );
        check(
            |t| mse_loss(&t[0], &t[1], reduction),
            &[
                rand_f64_noncontiguous(&[2, 3, 4], 7),
                rand_f64(&[2, 3, 4], 8),
            ],
        );
    }
    // only the prediction requires grad
    let target = rand_f64(&[7], 9).detach();
    check(
        |t| mse_loss(&t[0], &target, Reduction::Mean),
        &[rand_f64(&[7], 10)],
    );
}

#[test]
fn cross_entropy_matches_a_hand_computed_value() {
    // row 0: ln(e¹ + e² + e³) − 3 = ln(1 + e⁻¹ + e⁻²) = ln(1.503214724) = 0.407605964
    // row 1: three equal logits: ln 3 = 1.098612289
    let logits = f32_tensor(&[1.0, 2.0, 3.0, 1.0, 1.0, 1.0], &[2, 3]);
    let targets = labels(&[2, 0]);
    let each = cross_entropy(&logits, &targets, Reduction::None).unwrap();
    let each = each.to_vec::<f32>().unwrap();
    assert!((each[0] - 0.407_605_96).abs() < 1e-6, "{each:?}");
    assert!((each[1] - 1.098_612_3).abs() < 1e-6, "{each:?}");
    let sum = cross_entropy(&logits, &targets, Reduction::Sum).unwrap();
    assert!((sum.item().unwrap() - 1.506_218_25).abs() < 1e-6);
    let mean = cross_entropy(&logits, &targets, Reduction::Mean).unwrap();
    assert_eq!(mean.dims(), &[] as &[usize]);
    assert!((mean.item().unwrap() - 0.753_109_13).abs() < 1e-6);
}

#[test]
fn cross_entropy_gradient_is_softmax_minus_onehot_over_n() {
    let logits = f32_tensor(&[1.0, 2.0, 3.0, 1.0, 1.0, 1.0], &[2, 3])
        .with_requires_grad()
        .unwrap();
    cross_entropy(&logits, &labels(&[2, 0]), Reduction::Mean)
        .unwrap()
        .backward()
        .unwrap();
    let z = 1f64.exp() + 2f64.exp() + 3f64.exp();
    let p0 = [1f64.exp() / z, 2f64.exp() / z, 3f64.exp() / z];
    let want = [
        p0[0] / 2.0,
        p0[1] / 2.0,
        (p0[2] - 1.0) / 2.0,
        (1.0 / 3.0 - 1.0) / 2.0,
        1.0 / 6.0,
        1.0 / 6.0,
    ];
    let got = logits.grad().unwrap().to_vec_f64().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
    }
}

#[test]
fn nll_matches_a_hand_computed_value() {
    let log_probs = f32_tensor(&[-0.5, -1.0, -2.0, -0.1, -3.0, -0.7], &[2, 3]);
    let targets = labels(&[1, 2]);
    let each = nll_loss(&log_probs, &targets, Reduction::None).unwrap();
    assert_eq!(each.to_vec::<f32>().unwrap(), vec![1.0, 0.7]);
    let sum = nll_loss(&log_probs, &targets, Reduction::Sum).unwrap();
    assert!((sum.item().unwrap() - 1.7).abs() < 1e-6);
    let mean = nll_loss(&log_probs, &targets, Reduction::Mean).unwrap();
    assert!((mean.item().unwrap() - 0.85).abs() < 1e-6);
}

#[test]
fn cross_entropy_agrees_with_log_softmax_then_nll_and_is_stable_for_huge_logits() {
    let mut g = Generator::new(11);
    // 600 × 100: large enough for the parallel row path
    let logits = Tensor::randn(&[600, 100], 0.0, 4.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let targets: Vec<i64> = (0..600).map(|i| (i * 37 % 100) as i64).collect();
    let targets = labels(&targets);
    let fused = cross_entropy(&logits, &targets, Reduction::None)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    // reference in f64 from the definition
    let x = logits.to_vec_f64().unwrap();
    let t = targets.to_vec::<i64>().unwrap();
    for i in 0..600 {
        let row = &x[i * 100..(i + 1) * 100];
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        let want = lse - row[t[i] as usize];
        assert!((fused[i] - want).abs() < 1e-5 * want.abs().max(1.0), "{i}");
    }
    let composed = nll_loss(
        &crate::softmax::log_softmax(&logits, 1).unwrap(),
        &targets,
        Reduction::None,
    )
    .unwrap()
    .to_vec_f64()
    .unwrap();
    for (a, b) in fused.iter().zip(&composed) {
        assert!((a - b).abs() < 1e-5 * b.abs().max(1.0));
    }

    let huge = f32_tensor(&[1000.0, 0.0, -1000.0, 1000.0, 1000.0, 990.0], &[2, 3])
        .with_requires_grad()
        .unwrap();
    let loss = cross_entropy(&huge, &labels(&[0, 2]), Reduction::None).unwrap();
    let l = loss.to_vec_f64().unwrap();
    assert_eq!(l[0], 0.0);
    // ln(2 + e⁻¹⁰) + 10
    let want = (2.0 + (-10f64).exp()).ln() + 10.0;
    assert!((l[1] - want).abs() < 1e-4, "{l:?}");
    crate::reduce::sum_all(&loss).unwrap().backward().unwrap();
    assert!(huge
        .grad()
        .unwrap()
        .to_vec_f64()
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
}

#[test]
fn mse_matches_a_hand_computed_value() {
    let pred = f32_tensor(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let target = f32_tensor(&[1.5, 2.0, 1.0, 5.0], &[2, 2]);
    // squared errors: 0.25, 0, 4, 1
    let each = mse_loss(&pred, &target, Reduction::None).unwrap();
    assert_eq!(each.dims(), &[2, 2]);
    assert_eq!(each.to_vec::<f32>().unwrap(), vec![0.25, 0.0, 4.0, 1.0]);
    let sum = mse_loss(&pred, &target, Reduction::Sum).unwrap();
    assert_eq!(sum.item().unwrap(), 5.25);
    let mean = mse_loss(&pred, &target, Reduction::Mean).unwrap();
    assert_eq!(mean.item().unwrap(), 1.3125);
    // a large input (parallel path) against an f64 loop
    let mut g = Generator::new(12);
    let a = Tensor::randn(&[300, 300], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let b = Tensor::randn(&[300, 300], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let want: f64 = a
        .to_vec_f64()
        .unwrap()
        .iter()
        .zip(b.to_vec_f64().unwrap())
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        / 90_000.0;
    let got = mse_loss(&a, &b, Reduction::Mean).unwrap().item().unwrap();
    assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
}

#[test]
fn label_out_of_range_is_an_error_naming_op_label_and_class_count() {
    let logits = Tensor::zeros(&[4, 10], DType::F32, Device::Cpu).unwrap();
    let err = cross_entropy(&logits, &labels(&[0, 3, 10, 1]), Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cross_entropy:") && err.contains("target 10") && err.contains("C = 10"),
        "{err}"
    );
    let err = nll_loss(&logits, &labels(&[0, -1, 2, 1]), Reduction::Sum)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("nll_loss:") && err.contains("target -1") && err.contains("C = 10"),
        "{err}"
    );
}

#[test]
fn targets_of_wrong_dtype_or_shape_are_errors() {
    let logits = Tensor::zeros(&[4, 10], DType::F32, Device::Cpu).unwrap();
    let float_targets = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
    let err = cross_entropy(&logits, &float_targets, Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cross_entropy:") && err.contains("i64") && err.contains("f32"),
        "{err}"
    );
    let err = cross_entropy(&logits, &labels(&[0, 1, 2]), Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cross_entropy") && err.contains("[3]") && err.contains("[4, 10]"),
        "{err}"
    );
    let two_d = Tensor::zeros(&[4, 1], DType::I64, Device::Cpu).unwrap();
    let err = nll_loss(&logits, &two_d, Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nll_loss") && err.contains("[4, 1]"), "{err}");
    let flat = Tensor::zeros(&[10], DType::F32, Device::Cpu).unwrap();
    let err = cross_entropy(&flat, &labels(&[1]), Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cross_entropy") && err.contains("[10]"),
        "{err}"
    );
    let int_logits = Tensor::zeros(&[4, 10], DType::I64, Device::Cpu).unwrap();
    assert!(cross_entropy(&int_logits, &labels(&[0, 1, 2, 3]), Reduction::Mean).is_err());
}

#[test]
fn mse_shape_or_dtype_mismatch_and_empty_means_are_errors() {
    let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros(&[3, 2], DType::F32, Device::Cpu).unwrap();
    let err = mse_loss(&a, &b, Reduction::Mean).unwrap_err().to_string();
    assert!(
        err.starts_with("mse_loss:") && err.contains("[2, 3]") && err.contains("[3, 2]"),
        "{err}"
    );
    let c = Tensor::zeros(&[2, 3], DType::F64, Device::Cpu).unwrap();
    let err = mse_loss(&a, &c, Reduction::Mean).unwrap_err().to_string();
    assert!(err.contains("mse_loss") && err.contains("dtype"), "{err}");
    let empty = Tensor::zeros(&[0], DType::F32, Device::Cpu).unwrap();
    let err = mse_loss(&empty, &empty, Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mse_loss") && err.contains("empty"), "{err}");
    assert_eq!(
        mse_loss(&empty, &empty, Reduction::Sum)
            .unwrap()
            .item()
            .unwrap(),
        0.0
    );
    let flat_empty = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu).unwrap();
    let sum = mse_loss(&flat_empty, &flat_empty, Reduction::Sum).unwrap();
    assert_eq!(sum.item().unwrap(), 0.0);
    let none = mse_loss(&flat_empty, &flat_empty, Reduction::None).unwrap();
    assert_eq!(none.dims(), &[2, 0]);
    let no_classes = Tensor::zeros(&[0, 0], DType::F32, Device::Cpu).unwrap();
    let none = cross_entropy(&no_classes, &labels(&[]), Reduction::None).unwrap();
    assert_eq!(none.dims(), &[0]);
    let no_rows = Tensor::zeros(&[0, 10], DType::F32, Device::Cpu).unwrap();
    let err = cross_entropy(&no_rows, &labels(&[]), Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cross_entropy") && err.contains("empty"),
        "{err}"
    );
}
