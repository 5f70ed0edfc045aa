//! Tests of [`batch_norm_add_relu`](super::batch_norm_add_relu): forward, backward (input,
//! residual, weight and bias) and running statistics against direct f64 formulas in training
//! and evaluation, gradient checks away from ReLU's kink, and errors naming the op.

use super::*;
use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
use tandem_autograd::TensorBackward;
use tandem_core::{DType, Device};

fn vec_tensor(v: Vec<f64>) -> Tensor {
    let n = v.len();
    Tensor::from_vec(v, &[n], Device::Cpu).unwrap()
}

/// An f64 leaf of `shape` that requires grad.
fn leaf(values: Vec<f64>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(values, shape, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

/// The channel of flat index `i` in an `[N, C, L]` layout.
fn channel(i: usize, c: usize, l: usize) -> usize {
    (i / l) % c
}

/// `max(0, batch_norm(x) + r)` and its gradients in f64.
struct Reference {
    /// The pre-ReLU sums `x̂·w + b + r`.
    s: Vec<f64>,
    y: Vec<f64>,
    dx: Vec<f64>,
    dr: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

/// Straight from the definitions, for upstream gradient `g` (batch statistics, biased
/// variance, when `stats` is `None`): `s = x̂·w + b + r`, `y = max(0, s)`, `g' = g·[s > 0]`,
/// `dr = g'`, `dw = Σ g'·x̂`, `db = Σ g'`, and in training
/// `dx = (w/σ)·(g' − mean(g') − x̂·mean(g'·x̂))`, in evaluation `dx = g'·w/σ`.
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f64],
    r: &[f64],
    g: &[f64],
    c: usize,
    l: usize,
    w: &[f64],
    b: &[f64],
    stats: Option<(&[f64], &[f64])>,
    eps: f64,
) -> Reference {
    let ch = |i: usize| channel(i, c, l);
    let count = (x.len() / c) as f64;
    let (mean, var) = match stats {
        Some((m, v)) => (m.to_vec(), v.to_vec()),
        None => {
            let mut mean = vec![0.0; c];
            for (i, &v) in x.iter().enumerate() {
                mean[ch(i)] += v / count;
            }
            let mut var = vec![0.0; c];
            for (i, &v) in x.iter().enumerate() {
                var[ch(i)] += (v - mean[ch(i)]).powi(2) / count;
            }
            (mean, var)
        }
    };
    let sigma: Vec<f64> = var.iter().map(|v| (v + eps).sqrt()).collect();
    let xhat: Vec<f64> = (0..x.len())
        .map(|i| (x[i] - mean[ch(i)]) / sigma[ch(i)])
        .collect();
    let s: Vec<f64> = (0..x.len())
        .map(|i| xhat[i] * w[ch(i)] + b[ch(i)] + r[i])
        .collect();
    let y = s.iter().map(|&v| v.max(0.0)).collect();
    let gm: Vec<f64> = (0..x.len())
        .map(|i| if s[i] > 0.0 { g[i] } else { 0.0 })
        .collect();
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    for i in 0..x.len() {
        dw[ch(i)] += gm[i] * xhat[i];
        db[ch(i)] += gm[i];
    }
    let dx = (0..x.len())
        .map(|i| {
            let k = w[ch(i)] / sigma[ch(i)];
            if stats.is_some() {
                gm[i] * k
            } else {
                k * (gm[i] - db[ch(i)] / count - xhat[i] * dw[ch(i)] / count)
            }
        })
        .collect();
    Reference {
        s,
        y,
        dx,
        dr: gm,
        dw,
        db,
    }
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

/// Back-propagates `Σ y·up` (so `y` receives the gradient `up`).
fn backward_with(y: &Tensor, up: &Tensor) {
    crate::sum_all(&crate::mul(y, up).unwrap())
        .unwrap()
        .backward()
        .unwrap();
}

/// Runs the fused op on `x` `[N, C, ...]` (and a residual of that shape, strided when
/// `strided_residual`) with random affine parameters and an upstream gradient, and checks
/// output, running statistics and all four gradients against [`reference`].
fn check_against_reference(shape: &[usize], training: bool, strided_residual: bool, seed: u64) {
    let (c, l): (usize, usize) = (shape[1], shape[2..].iter().product());
    let x = rand_f64(shape, seed);
    let res = if strided_residual {
        rand_f64_noncontiguous(shape, seed + 4)
    } else {
        rand_f64(shape, seed + 4)
    };
    let w = rand_f64(&[c], seed + 1);
    let b = rand_f64(&[c], seed + 2);
    let up = rand_f64(shape, seed + 3).detach();
    let rm = vec_tensor((0..c).map(|i| 0.1 * i as f64 - 0.2).collect());
    let rv = vec_tensor((0..c).map(|i| 0.5 + 0.25 * i as f64).collect());
    let (old_m, old_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
    let eps = 1e-5;
    let y = batch_norm_add_relu(
        &x,
        &res,
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
        &res.to_vec_f64().unwrap(),
        &up.to_vec_f64().unwrap(),
        c,
        l,
        &w.to_vec_f64().unwrap(),
        &b.to_vec_f64().unwrap(),
        stats,
        eps,
    );
    assert_close(&y.to_vec_f64().unwrap(), &r.y, 1e-12, "y");
    assert!(r.s.iter().any(|&s| s < 0.0) && r.s.iter().any(|&s| s > 0.0));
    let (new_m, new_v) = (rm.to_vec_f64().unwrap(), rv.to_vec_f64().unwrap());
    if training {
        // the running statistics move by the direct-loop batch moments
        let m = (xv.len() / c) as f64;
        for ch in 0..c {
            let vals: Vec<f64> = (0..xv.len())
                .filter(|&i| channel(i, c, l) == ch)
                .map(|i| xv[i])
                .collect();
            let mean = vals.iter().sum::<f64>() / m;
            let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / m;
            let want_m = 0.9 * old_m[ch] + 0.1 * mean;
            let want_v = 0.9 * old_v[ch] + 0.1 * var * m / (m - 1.0);
            assert!((new_m[ch] - want_m).abs() < 1e-12 && (new_v[ch] - want_v).abs() < 1e-12);
        }
    } else {
        assert_eq!((new_m, new_v), (old_m, old_v));
    }
    backward_with(&y, &up);
    let grad = |t: &Tensor| t.grad().unwrap().to_vec_f64().unwrap();
    assert_close(&grad(&x), &r.dx, 1e-10, "dx");
    assert_close(&grad(&res), &r.dr, 1e-12, "dr");
    assert_close(&grad(&w), &r.dw, 1e-10, "dw");
    assert_close(&grad(&b), &r.db, 1e-10, "db");
}

#[test]
fn training_matches_f64_formulas_including_running_stats() {
    // the last shape is large enough for the parallel kernels
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let cases: [&[usize]; 4] = [&[4, 3, 2, 5], &[6, 3], &[2, 3, 7], &[9, 3, 40, 40]];
    for (i, shape) in cases.into_iter().enumerate() {
        pool.install(|| check_against_reference(shape, true, i % 2 == 1, 200 + 10 * i as u64));
    }
    // and on the calling thread alone
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one.install(|| check_against_reference(&[9, 3, 40, 40], true, false, 290));
}

#[test]
fn eval_matches_f64_formulas_and_leaves_running_stats_alone() {
    check_against_reference(&[4, 3, 2, 5], false, false, 300);
    check_against_reference(&[5, 4], false, true, 310);
    check_against_reference(&[8, 3, 40, 40], false, false, 320);
}

#[test]
fn output_and_gradients_are_zero_exactly_where_the_sum_is_not_positive() {
    // Evaluation with running mean 0 and variance 1, eps 0: z = x, so y = max(0, x + r).
    let x = leaf(vec![0.5, -0.25, 1.0, 2.0, -1.0, 0.0], &[2, 1, 3]);
    let r = leaf(vec![-0.5, 0.5, -2.0, -1.0, 3.0, 0.0], &[2, 1, 3]);
    let (rm, rv) = (vec_tensor(vec![0.0]), vec_tensor(vec![1.0]));
    let y = batch_norm_add_relu(&x, &r, Some(&rm), Some(&rv), None, None, false, 0.1, 0.0).unwrap();
    assert_eq!(y.to_vec_f64().unwrap(), vec![0.0, 0.25, 0.0, 1.0, 2.0, 0.0]);
    crate::sum_all(&y).unwrap().backward().unwrap();
    let want = vec![0.0, 1.0, 0.0, 1.0, 1.0, 0.0];
    assert_eq!(x.grad().unwrap().to_vec_f64().unwrap(), want);
    assert_eq!(r.grad().unwrap().to_vec_f64().unwrap(), want);
}

#[test]
fn a_residual_without_grad_still_passes_the_masked_gradient_to_the_input() {
    let shape = [4, 2, 3];
    let x = rand_f64(&shape, 330);
    let res = rand_f64(&shape, 331).detach();
    let w = rand_f64(&[2], 332);
    let up = rand_f64(&shape, 333).detach();
    let y = batch_norm_add_relu(&x, &res, None, None, Some(&w), None, true, 0.1, 1e-5).unwrap();
    backward_with(&y, &up);
    let r = reference(
        &x.to_vec_f64().unwrap(),
        &res.to_vec_f64().unwrap(),
        &up.to_vec_f64().unwrap(),
        2,
        3,
        &w.to_vec_f64().unwrap(),
        &[0.0, 0.0],
        None,
        1e-5,
    );
    assert_close(&x.grad().unwrap().to_vec_f64().unwrap(), &r.dx, 1e-10, "dx");
    assert_close(&w.grad().unwrap().to_vec_f64().unwrap(), &r.dw, 1e-10, "dw");
    assert!(res.grad().is_none());
}

#[test]
fn f32_fused_forward_equals_relu_of_batch_norm_plus_residual() {
    let mut gen = tandem_core::Generator::new(340);
    let x = Tensor::randn(&[8, 4, 6, 6], 0.5, 2.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let res = Tensor::randn(&[8, 4, 6, 6], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let w = Tensor::randn(&[4], 1.0, 0.5, DType::F32, Device::Cpu, &mut gen).unwrap();
    let b = Tensor::randn(&[4], 0.0, 0.5, DType::F32, Device::Cpu, &mut gen).unwrap();
    let fused =
        batch_norm_add_relu(&x, &res, None, None, Some(&w), Some(&b), true, 0.1, 1e-5).unwrap();
    let plain = batch_norm(&x, None, None, Some(&w), Some(&b), true, 0.1, 1e-5).unwrap();
    let (p, r) = (plain.to_vec::<f32>().unwrap(), res.to_vec::<f32>().unwrap());
    let want: Vec<f32> = p.iter().zip(&r).map(|(&a, &b)| (a + b).max(0.0)).collect();
    assert_eq!(fused.to_vec::<f32>().unwrap(), want);
}

/// Inputs for a gradient check: `x`, a residual placing every pre-ReLU sum `x̂·w + b + r`
/// between 0.25 and 0.75 away from the kink (half of them on each side), `w` and `b`.
fn away_from_kink(x: Tensor, seed: u64, stats: Option<(&[f64], &[f64])>) -> [Tensor; 4] {
    let (c, l): (usize, usize) = (x.dims()[1], x.dims()[2..].iter().product());
    let (w, b) = (rand_f64(&[c], seed), rand_f64(&[c], seed + 1));
    let xv = x.to_vec_f64().unwrap();
    let (wv, bv) = (w.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    let zero = vec![0.0; xv.len()];
    let z = reference(&xv, &zero, &zero, c, l, &wv, &bv, stats, 1e-5).s;
    let offsets = rand_f64(x.dims(), seed + 2).to_vec_f64().unwrap();
    let r: Vec<f64> = z
        .iter()
        .zip(&offsets)
        .enumerate()
        .map(|(i, (&z, &u))| {
            let side = if i % 2 == 0 { 1.0 } else { -1.0 };
            -z + side * (0.25 + 0.5 * u.abs().min(1.0))
        })
        .collect();
    let r = leaf(r, x.dims());
    [x, r, w, b]
}

#[test]
fn gradcheck_batch_norm_add_relu_training_and_eval() {
    let train = |t: &[Tensor]| {
        batch_norm_add_relu(
            &t[0],
            &t[1],
            None,
            None,
            Some(&t[2]),
            Some(&t[3]),
            true,
            0.1,
            1e-5,
        )
    };
    for (i, shape) in [&[4usize, 3, 2, 3][..], &[5, 4], &[3, 2, 4, 3]]
        .into_iter()
        .enumerate()
    {
        let seed = 400 + 10 * i as u64;
        let x = if i == 2 {
            rand_f64_noncontiguous(shape, seed)
        } else {
            rand_f64(shape, seed)
        };
        check(train, &away_from_kink(x, seed + 1, None));
    }
    let (m, v) = (vec![0.2, -0.1, 0.4], vec![0.8, 1.3, 2.0]);
    let (rm, rv) = (vec_tensor(m.clone()), vec_tensor(v.clone()));
    let inputs = away_from_kink(rand_f64_noncontiguous(&[2, 3, 4], 450), 451, Some((&m, &v)));
    check(
        |t| {
            batch_norm_add_relu(
                &t[0],
                &t[1],
                Some(&rm),
                Some(&rv),
                Some(&t[2]),
                Some(&t[3]),
                false,
                0.1,
                1e-5,
            )
        },
        &inputs,
    );
}

#[test]
fn a_residual_of_another_shape_dtype_or_a_bad_parameter_is_an_error_naming_the_op() {
    let x = Tensor::zeros(&[2, 4, 5, 5], DType::F32, Device::Cpu).unwrap();
    let wrong = Tensor::zeros(&[2, 4, 5, 1], DType::F32, Device::Cpu).unwrap();
    let err = batch_norm_add_relu(&x, &wrong, None, None, None, None, true, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("batch_norm_add_relu:")
            && err.contains("residual")
            && err.contains("[2, 4, 5, 1]")
            && err.contains("[2, 4, 5, 5]"),
        "{err}"
    );
    let f64_res = Tensor::zeros(&[2, 4, 5, 5], DType::F64, Device::Cpu).unwrap();
    let err = batch_norm_add_relu(&x, &f64_res, None, None, None, None, true, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("batch_norm_add_relu:"), "{err}");
    let short = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
    let err = batch_norm_add_relu(&x, &x, None, None, Some(&short), None, true, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("batch_norm_add_relu:") && err.contains("[3]"),
        "{err}"
    );
    let err = batch_norm_add_relu(&x, &x, None, None, None, None, false, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("running_mean"), "{err}");
}
