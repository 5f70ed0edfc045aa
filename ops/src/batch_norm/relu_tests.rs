//! Tests of [`batch_norm_relu`](super::batch_norm_relu): its forward, backward and running
//! statistics against direct f64 formulas, and gradient checks away from ReLU's kink.

use super::*;
use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
use tandem_autograd::TensorBackward;
use tandem_core::{DType, Device};

fn vec_tensor(v: Vec<f64>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, &[n], Device::Cpu).unwrap()
}

/// The channel of flat index `i` in an `[N, C, L]` layout.
fn channel(i: usize, c: usize, l: usize) -> usize {
    (i / l) % c
}

/// Direct-loop per-channel batch mean and biased variance of `[N, C, L]` values.
fn batch_moments(v: &[f64], c: usize, l: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut sum, mut count) = (vec![0.0; c], vec![0.0; c]);
    for (i, &x) in v.iter().enumerate() {
        sum[channel(i, c, l)] += x;
        count[channel(i, c, l)] += 1.0;
    }
    let mean: Vec<f64> = (0..c).map(|ch| sum[ch] / count[ch]).collect();
    let mut sq = vec![0.0; c];
    for (i, &x) in v.iter().enumerate() {
        let ch = channel(i, c, l);
        sq[ch] += (x - mean[ch]).powi(2);
    }
    let var = (0..c).map(|ch| sq[ch] / count[ch]).collect();
    (mean, var)
}

/// `max(0, batch_norm(x))` and its gradients in f64, from [`reference`].
struct Reference {
    z: Vec<f64>,
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

/// Reference forward and backward of `max(0, batch_norm(x))` for the upstream gradient `g`
/// (batch statistics when `stats` is `None`), straight from the definitions: `z = x̂·w + b`, `y = max(0, z)`, `g' = g·[z > 0]`, and in training
/// `dx = (w/σ)·(g' − mean(g') − x̂·mean(g'·x̂))`, in evaluation `dx = g'·w/σ`;
/// `dw = Σ g'·x̂`, `db = Σ g'`.
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f64],
    g: &[f64],
    c: usize,
    l: usize,
    w: &[f64],
    b: &[f64],
    stats: Option<(&[f64], &[f64])>,
    eps: f64,
) -> Reference {
    let (mean, var) = match stats {
        Some((m, v)) => (m.to_vec(), v.to_vec()),
        None => batch_moments(x, c, l),
    };
    let sigma: Vec<f64> = var.iter().map(|v| (v + eps).sqrt()).collect();
    let xhat: Vec<f64> = (0..x.len())
        .map(|i| (x[i] - mean[channel(i, c, l)]) / sigma[channel(i, c, l)])
        .collect();
    let z: Vec<f64> = (0..x.len())
        .map(|i| xhat[i] * w[channel(i, c, l)] + b[channel(i, c, l)])
        .collect();
    let y = z.iter().map(|&v| v.max(0.0)).collect();
    let gm: Vec<f64> = (0..x.len())
        .map(|i| if z[i] > 0.0 { g[i] } else { 0.0 })
        .collect();
    let (mut dw, mut db, mut count) = (vec![0.0; c], vec![0.0; c], vec![0.0; c]);
    for i in 0..x.len() {
        let ch = channel(i, c, l);
        dw[ch] += gm[i] * xhat[i];
        db[ch] += gm[i];
        count[ch] += 1.0;
    }
    let dx = (0..x.len())
        .map(|i| {
            let ch = channel(i, c, l);
            let k = w[ch] / sigma[ch];
            if stats.is_some() {
                gm[i] * k
            } else {
                k * (gm[i] - db[ch] / count[ch] - xhat[i] * dw[ch] / count[ch])
            }
        })
        .collect();
    Reference { z, y, dx, dw, db }
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// Runs the fused op on `x` `[N, C, ...]` with random affine parameters and an upstream
/// gradient, and checks output, running statistics and all gradients against [`reference`].
fn check_against_reference(shape: &[usize], training: bool, seed: u64) {
    let (c, l): (usize, usize) = (shape[1], shape[2..].iter().product());
    let x = rand_f64(shape, seed);
    let w = rand_f64(&[c], seed + 1);
    let b = rand_f64(&[c], seed + 2);
    let up = rand_f64(shape, seed + 3).detach();
    let rm = vec_tensor((0..c).map(|i| 0.1 * i as f64 - 0.2).collect());
    let rv = vec_tensor((0..c).map(|i| 0.5 + 0.25 * i as f64).collect());
    let (old_m, old_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
    let eps = 1e-5;
    let y = batch_norm_relu(
        &x,
        Some(&rm),
        Some(&rv),
        Some(&w),
        Some(&b),
        training,
        0.1,
        eps,
    )
    .unwrap();
    let xv = x.to_vec_f64().unwrap();
    let stats = (!training).then_some((old_m.as_slice(), old_v.as_slice()));
    let r = reference(
        &xv,
        &up.to_vec_f64().unwrap(),
        c,
        l,
        &w.to_vec_f64().unwrap(),
        &b.to_vec_f64().unwrap(),
        stats,
        eps,
    );
    assert_close(&y.to_vec_f64().unwrap(), &r.y, 1e-12, "y");
    assert!(r.z.iter().any(|&z| z < 0.0) && r.z.iter().any(|&z| z > 0.0));
    // The running statistics move exactly as batch_norm's do.
    let (new_m, new_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
    if training {
        let (mean, var) = batch_moments(&xv, c, l);
        let m = (xv.len() / c) as f64;
        for ch in 0..c {
            let want_m = 0.9 * old_m[ch] + 0.1 * mean[ch];
            let want_v = 0.9 * old_v[ch] + 0.1 * var[ch] * m / (m - 1.0);
            assert!((new_m[ch] - want_m).abs() < 1e-12 && (new_v[ch] - want_v).abs() < 1e-12);
        }
    } else {
        assert_eq!((new_m, new_v), (old_m, old_v));
    }
    backward_with(&y, &up);
    assert_close(&x.grad().unwrap().to_vec_f64().unwrap(), &r.dx, 1e-10, "dx");
    assert_close(&w.grad().unwrap().to_vec_f64().unwrap(), &r.dw, 1e-10, "dw");
    assert_close(&b.grad().unwrap().to_vec_f64().unwrap(), &r.db, 1e-10, "db");
}

/// Back-propagates `Σ y·up` (so `y` receives the gradient `up`).
fn backward_with(y: &Tensor, up: &Tensor) {
    crate::sum_all(&crate::mul(y, up).unwrap())
        .unwrap()
        .backward()
        .unwrap();
}

#[test]
fn fused_training_matches_f64_formulas_including_running_stats() {
    // the last shape is large enough for the parallel kernels
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let cases: [&[usize]; 4] = [&[4, 3, 2, 5], &[6, 3], &[2, 3, 7], &[9, 3, 40, 40]];
    for (i, shape) in cases.into_iter().enumerate() {
        pool.install(|| check_against_reference(shape, true, 30 + 10 * i as u64));
    }
    // and on the calling thread alone
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one.install(|| check_against_reference(&[9, 3, 40, 40], true, 90));
}

#[test]
fn fused_eval_matches_f64_formulas_and_leaves_running_stats_alone() {
    check_against_reference(&[4, 3, 2, 5], false, 100);
    check_against_reference(&[5, 4], false, 110);
    check_against_reference(&[8, 3, 40, 40], false, 120);
}

#[test]
fn output_and_gradient_are_zero_exactly_where_the_normalised_value_is_not_positive() {
    // Evaluation with running mean 0.5 and unit weight: z = (x − 0.5)/σ is exactly 0 at
    // x = 0.5, negative below and positive above. Only the positive ones pass a gradient.
    let x = Tensor::from_vec(
        vec![0.5, 0.25, 0.75, 0.5, -1.0, 2.0],
        &[2, 1, 3],
        Device::Cpu,
    )
    .unwrap()
    .with_requires_grad()
    .unwrap();
    let (rm, rv) = (vec_tensor(vec![0.5]), vec_tensor(vec![1.0]));
    let y = batch_norm_relu(&x, Some(&rm), Some(&rv), None, None, false, 0.1, 0.0).unwrap();
    assert_eq!(y.to_vec_f64().unwrap(), vec![0.0, 0.0, 0.25, 0.0, 0.0, 1.5]);
    crate::sum_all(&y).unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec_f64().unwrap(),
        vec![0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    );
    // All normalised values at or below zero (bias −10): no gradient reaches anything.
    let x = rand_f64(&[4, 2, 3], 130);
    let w = rand_f64(&[2], 131);
    let b = vec_tensor(vec![-10.0, -10.0]).with_requires_grad().unwrap();
    let y = batch_norm_relu(&x, None, None, Some(&w), Some(&b), true, 0.1, 1e-5).unwrap();
    assert!(y.to_vec_f64().unwrap().iter().all(|&v| v == 0.0));
    crate::sum_all(&y).unwrap().backward().unwrap();
    for t in [&x, &w, &b] {
        assert!(t
            .grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .all(|&v| v == 0.0));
    }
}

#[test]
fn f32_fused_forward_equals_relu_of_batch_norm() {
    let mut gen = tandem_core::Generator::new(140);
    let x = Tensor::randn(&[8, 4, 6, 6], 0.5, 2.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let w = Tensor::randn(&[4], 1.0, 0.5, DType::F32, Device::Cpu, &mut gen).unwrap();
    let b = Tensor::randn(&[4], 0.0, 0.5, DType::F32, Device::Cpu, &mut gen).unwrap();
    let fused = batch_norm_relu(&x, None, None, Some(&w), Some(&b), true, 0.1, 1e-5).unwrap();
    let plain = batch_norm(&x, None, None, Some(&w), Some(&b), true, 0.1, 1e-5).unwrap();
    let want: Vec<f32> = plain
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&v| v.max(0.0))
        .collect();
    assert_eq!(fused.to_vec::<f32>().unwrap(), want);
}

/// Asserts that every normalised value the check's perturbations could move stays clear of
/// ReLU's kink at 0 (the finite differences are only meaningful away from it).
fn assert_away_from_kink(x: &Tensor, w: &Tensor, b: &Tensor, stats: Option<(&[f64], &[f64])>) {
    let c = x.dims()[1];
    let l: usize = x.dims()[2..].iter().product();
    let xv = x.to_vec_f64().unwrap();
    let g = vec![0.0; xv.len()];
    let (wv, bv) = (w.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let r = reference(&xv, &g, c, l, &wv, &bv, stats, 1e-5);
    let closest = r.z.iter().fold(f64::INFINITY, |m, z| m.min(z.abs()));
    assert!(
        closest > 1e-3,
        "a normalised value is {closest} from the kink"
    );
    assert!(r.z.iter().any(|&z| z < 0.0) && r.z.iter().any(|&z| z > 0.0));
}

#[test]
fn gradcheck_batch_norm_relu_training_and_eval() {
    let bn_train = |t: &[Tensor]| {
        batch_norm_relu(&t[0], None, None, Some(&t[1]), Some(&t[2]), true, 0.1, 1e-5)
    };
    let cases = [
        [
            rand_f64(&[4, 3, 2, 3], 150),
            rand_f64(&[3], 151),
            rand_f64(&[3], 152),
        ],
        [
            rand_f64(&[5, 4], 153),
            rand_f64(&[4], 154),
            rand_f64(&[4], 155),
        ],
        [
            rand_f64_noncontiguous(&[3, 2, 4, 3], 156),
            rand_f64(&[2], 157),
            rand_f64(&[2], 158),
        ],
    ];
    for inputs in &cases {
        assert_away_from_kink(&inputs[0], &inputs[1], &inputs[2], None);
        check(bn_train, inputs);
    }
    let (m, v) = (vec![0.2, -0.1, 0.4], vec![0.8, 1.3, 2.0]);
    let (rm, rv) = (vec_tensor(m.clone()), vec_tensor(v.clone()));
    let inputs = [
        rand_f64_noncontiguous(&[2, 3, 4], 160),
        rand_f64(&[3], 161),
        rand_f64(&[3], 162),
    ];
    assert_away_from_kink(&inputs[0], &inputs[1], &inputs[2], Some((&m, &v)));
    check(
        |t| {
            batch_norm_relu(
                &t[0],
                Some(&rm),
                Some(&rv),
                Some(&t[1]),
                Some(&t[2]),
                false,
                0.1,
                1e-5,
            )
        },
        &inputs,
    );
}

#[test]
fn fused_errors_name_the_fused_op() {
    let x = Tensor::zeros(&[2, 4, 5, 5], DType::F32, Device::Cpu).unwrap();
    let short = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
    let err = batch_norm_relu(&x, Some(&short), None, None, None, true, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("batch_norm_relu:") && err.contains("[3]"),
        "{err}"
    );
    let err = batch_norm_relu(&x, None, None, None, None, false, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("running_mean"), "{err}");
}
