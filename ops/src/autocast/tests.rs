//! Autocast through the ops: the matrix ops' bf16/f16 forward and backward against f64, with a
//! tolerance derived from the formats; the weight cache seen from the ops; the f32 list; dtype
//! errors; a small conv net trained under autocast.
//!
//! # The tolerance
//!
//! Every output element of matmul, linear and conv2d (and every element of their gradients) is
//! a sum `y = Σ aᵢ·bᵢ` over some reduction length `K`. Autocast rounds each f32 operand to the
//! low format (relative error ≤ `u`, the unit roundoff: 2⁻⁸ for bf16, 2⁻¹¹ for f16), multiplies
//! and accumulates in f32 (the product of two half-precision values is exact in f32; the sum's
//! error is at most `K·2⁻²⁴·Σ|aᵢbᵢ|` in any order, written `γ`), and rounds the result once
//! (`u·|y|`). So, componentwise and to first order,
//!
//! `|ŷ − y| ≤ (3u + γ)·Σ|aᵢ|·|bᵢ|`,
//!
//! a worst-case bound (no `√K` statistical argument is needed, and the test cannot be flaky).
//! The bound `Σ|aᵢ|·|bᵢ|` is computed exactly by running the same op (and its backward) in f64
//! on the absolute values of the inputs and of the output gradient. `γ` is doubled to cover the
//! f32 kernels' transforms (Winograd, blocked sums), and `2⁻²⁴` is added absolutely for f16's
//! subnormal spacing (a sum that cancels to nearly 0). The inputs are drawn from `±[1/8, 1]`
//! so that none is subnormal in f16.

use super::*;
use crate::{
    conv2d, cross_entropy, exp, linear, log, log_softmax, matmul, mse_loss, nll_loss, pow_scalar,
    relu, reshape, softmax, sum, sum_all, Conv2dParams, Reduction,
};
use tandem_autograd::autocast::{autocast, weight_cache_stats, AutocastGuard};
use tandem_autograd::{no_grad, BackwardOptions, TensorBackward};
use tandem_core::{DType, Device, Result, Tensor};

const LOW: [DType; 2] = [DType::BF16, DType::F16];

fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        other => panic!("no half format: {other}"),
    }
}

/// `n` values in `±[1/8, 1]` from a small LCG (deterministic, no subnormals in f16).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (state >> 11) as f64 / (1u64 << 53) as f64;
            let magnitude = 0.125 + 0.875 * (2.0 * r - (2.0 * r).floor());
            if r < 0.5 {
                magnitude
            } else {
                -magnitude
            }
        })
        .collect()
}

fn tensor(v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn leaf(t: &Tensor) -> Tensor {
    t.detach().with_requires_grad().unwrap()
}

fn abs(t: &Tensor) -> Tensor {
    let v: Vec<f64> = t.to_vec_f64().unwrap().iter().map(|x| x.abs()).collect();
    tensor(&v, t.dims(), t.dtype())
}

/// The output and the input gradients of `op` at `inputs` for the output gradient `seed`.
fn run(
    op: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    seed: &Tensor,
) -> (Tensor, Vec<Tensor>) {
    let y = op(inputs).unwrap();
    let seed = seed.to_dtype(y.dtype()).unwrap();
    y.backward_with(Some(&seed), &BackwardOptions::default())
        .unwrap();
    let grads = inputs.iter().map(|t| t.grad().unwrap()).collect();
    (y, grads)
}

fn assert_within(what: &str, got: &Tensor, want: &Tensor, bound: &Tensor, scale: f64) {
    let (g, w, b) = (
        got.to_vec_f64().unwrap(),
        want.to_vec_f64().unwrap(),
        bound.to_vec_f64().unwrap(),
    );
    assert_eq!(g.len(), w.len(), "{what}");
    for (i, ((g, w), b)) in g.iter().zip(&w).zip(&b).enumerate() {
        let tol = scale * b + 2f64.powi(-24);
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: {g} vs {w} (tolerance {tol})"
        );
    }
}

/// Checks `op` under autocast in bf16 and f16 against f64 within the bound of the module doc:
/// output in the low dtype, f32 gradients for the f32 leaves. `k` is the longest reduction
/// of the forward and the backward.
fn check_against_f64(
    name: &str,
    op: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    shapes: &[&[usize]],
    k: usize,
) {
    let f32s: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            tensor(&values(n, 10 + i as u64), s, DType::F32)
        })
        .collect();
    let out_shape = op(&f32s).unwrap().dims().to_vec();
    let n_out = out_shape.iter().product();
    for dtype in LOW {
        let u = unit_roundoff(dtype);
        // The output gradient is representable in the low dtype: it arrives rounded.
        let seed = tensor(&values(n_out, 99), &out_shape, dtype);
        let wide: Vec<Tensor> = f32s
            .iter()
            .map(|t| leaf(&t.to_dtype(DType::F64).unwrap()))
            .collect();
        let (want, want_grads) = run(op, &wide, &seed);
        let absolute: Vec<Tensor> = wide.iter().map(|t| leaf(&abs(t))).collect();
        let (bound, bound_grads) = run(op, &absolute, &abs(&seed));

        let low: Vec<Tensor> = f32s.iter().map(leaf).collect();
        let y = autocast(dtype, || op(&low).unwrap()).unwrap();
        assert_eq!(y.dtype(), dtype, "{name}: autocast output dtype");
        y.backward_with(Some(&seed), &BackwardOptions::default())
            .unwrap();
        let scale = 3.0 * u + 2.0 * (k as f64 + 2.0) * 2f64.powi(-24);
        assert_within(&format!("{name} {dtype} forward"), &y, &want, &bound, scale);
        for (i, t) in low.iter().enumerate() {
            let g = t.grad().unwrap();
            assert_eq!(g.dtype(), DType::F32, "{name}: gradient of f32 input {i}");
            let what = format!("{name} {dtype} gradient of input {i}");
            assert_within(&what, &g, &want_grads[i], &bound_grads[i], scale);
        }
    }
}

#[test]
fn matmul_in_bf16_and_f16_matches_f64_within_the_formats_bound() {
    check_against_f64(
        "matmul",
        &|t| matmul(&t[0], &t[1]),
        &[&[6, 40], &[40, 5]],
        40,
    );
    // Batched with a broadcast right operand: its gradient sums over 3·5 rows.
    check_against_f64(
        "batched matmul",
        &|t| matmul(&t[0], &t[1]),
        &[&[3, 5, 24], &[24, 7]],
        24,
    );
    check_against_f64(
        "matmul vector",
        &|t| matmul(&t[0], &t[1]),
        &[&[24], &[2, 24, 3]],
        24,
    );
}

#[test]
fn linear_in_bf16_and_f16_matches_f64_within_the_formats_bound() {
    check_against_f64(
        "linear",
        &|t| linear(&t[0], &t[1], Some(&t[2])),
        &[&[4, 3, 32], &[10, 32], &[10]],
        32,
    );
    check_against_f64(
        "linear without bias",
        &|t| linear(&t[0], &t[1], None),
        &[&[7, 9], &[5, 9]],
        9,
    );
}

#[test]
fn conv2d_in_bf16_and_f16_matches_f64_within_the_formats_bound() {
    let padded = Conv2dParams {
        padding: (1, 1),
        ..Default::default()
    };
    let strided = Conv2dParams {
        stride: (2, 2),
        padding: (1, 0),
        dilation: (1, 2),
    };
    for (name, shapes, params, k) in [
        (
            "conv2d",
            [&[2usize, 3, 8, 8][..], &[4, 3, 3, 3], &[4]],
            padded,
            128,
        ),
        (
            "conv2d strided",
            [&[2, 2, 9, 9][..], &[3, 2, 3, 2], &[3]],
            strided,
            40,
        ),
        // 16 channels on both sides: the f32 kernels take the Winograd path.
        (
            "conv2d winograd",
            [&[1, 16, 6, 6][..], &[16, 16, 3, 3], &[16]],
            padded,
            144,
        ),
    ] {
        check_against_f64(
            name,
            &|t| conv2d(&t[0], &t[1], Some(&t[2]), &params),
            &shapes,
            k,
        );
    }
}

#[test]
fn half_precision_operands_outside_autocast_give_the_autocast_results_and_own_dtype_gradients() {
    let a = tensor(&values(6 * 8, 1), &[6, 8], DType::F32);
    let b = tensor(&values(8 * 3, 2), &[8, 3], DType::F32);
    for dtype in LOW {
        let (al, bl) = (
            leaf(&a.to_dtype(dtype).unwrap()),
            leaf(&b.to_dtype(dtype).unwrap()),
        );
        let direct = matmul(&al, &bl).unwrap();
        let cast = autocast(dtype, || matmul(&a, &b).unwrap()).unwrap();
        assert_eq!(direct.dtype(), dtype);
        assert_eq!(direct.to_vec_f64().unwrap(), cast.to_vec_f64().unwrap());
        direct
            .backward_with(
                Some(&direct.ones_like().unwrap()),
                &BackwardOptions::default(),
            )
            .unwrap();
        assert_eq!(al.grad().unwrap().dtype(), dtype);
        assert_eq!(bl.grad().unwrap().dtype(), dtype);
    }
}

#[test]
fn a_parameter_used_twice_is_cast_once_per_scope_and_freed_after() {
    let x = tensor(&values(4 * 6, 3), &[4, 6], DType::F32);
    let w = leaf(&tensor(&values(6 * 6, 4), &[6, 6], DType::F32));
    let b = leaf(&tensor(&values(6, 5), &[6], DType::F32));
    let before = weight_cache_stats();
    let y = autocast(DType::BF16, || {
        let h = linear(&x, &w, Some(&b)).unwrap();
        let y = linear(&h, &w, Some(&b)).unwrap();
        assert_eq!(weight_cache_stats().cached, 2, "weight and bias");
        y
    })
    .unwrap();
    let after = weight_cache_stats();
    assert_eq!(
        after.casts - before.casts,
        2,
        "one cast each for the weight and the bias"
    );
    assert_eq!(after.hits - before.hits, 2, "the second layer reuses both");
    assert_eq!(after.cached, 0, "freed when the scope ended");
    // The activation x (no grad) and h (not a leaf) were never cached; the weight gets one f32
    // gradient summed over both uses.
    sum_all(&cast(&y, DType::F32).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
}

#[test]
fn in_place_updates_are_seen_after_a_backward_or_a_new_scope_but_not_within_one_forward() {
    let x = tensor(&[1.0; 4], &[1, 4], DType::F32);
    let w = leaf(&tensor(&[1.0; 8], &[2, 4], DType::F32));
    let forward = || linear(&x, &w, None).unwrap().to_vec_f64().unwrap();
    let set = |v: f64| no_grad(|| w.fill_(v)).unwrap();
    autocast(DType::BF16, || {
        assert_eq!(forward(), vec![4.0, 4.0]);
        set(2.0);
        // Documented: the cached copy is keyed by the tensor, as in PyTorch, so an update in
        // the middle of a forward is not seen until the next backward or scope.
        assert_eq!(forward(), vec![4.0, 4.0]);
        // A backward (what precedes an optimizer step) frees the cache.
        let y = linear(&x, &w, None).unwrap();
        sum_all(&cast(&y, DType::F32).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(forward(), vec![8.0, 8.0]);
        set(3.0);
    })
    .unwrap();
    autocast(DType::BF16, || assert_eq!(forward(), vec![12.0, 12.0])).unwrap();
}

#[test]
fn the_f32_list_computes_in_f32_and_f64_and_disabled_regions_are_left_alone() {
    let x = tensor(&values(12, 6), &[3, 4], DType::BF16);
    let positive = abs(&x);
    let targets = Tensor::from_vec(vec![0i64, 3, 1], &[3], Device::Cpu).unwrap();
    autocast(DType::BF16, || {
        let outputs = [
            softmax(&x, 1).unwrap(),
            log_softmax(&x, -1).unwrap(),
            cross_entropy(&x, &targets, Reduction::Mean).unwrap(),
            nll_loss(&x, &targets, Reduction::Sum).unwrap(),
            mse_loss(&x, &positive, Reduction::Mean).unwrap(),
            exp(&x).unwrap(),
            log(&positive).unwrap(),
            pow_scalar(&x, 2.0).unwrap(),
            sum(&x, &[1], false).unwrap(),
            sum_all(&x).unwrap(),
        ];
        for (i, y) in outputs.iter().enumerate() {
            assert_eq!(y.dtype(), DType::F32, "f32-list op {i}");
        }
        let x64 = tensor(&values(12, 7), &[3, 4], DType::F64);
        let w64 = tensor(&values(8, 8), &[2, 4], DType::F64);
        assert_eq!(linear(&x64, &w64, None).unwrap().dtype(), DType::F64);
        let x32 = x64.to_dtype(DType::F32).unwrap();
        let w32 = w64.to_dtype(DType::F32).unwrap();
        let _f32_region = AutocastGuard::disabled();
        assert_eq!(linear(&x32, &w32, None).unwrap().dtype(), DType::F32);
    })
    .unwrap();
}

#[test]
fn mismatched_half_dtypes_are_errors_naming_the_op_and_both_dtypes() {
    let a = tensor(&values(4, 1), &[2, 2], DType::BF16);
    let f = tensor(&values(4, 2), &[2, 2], DType::F32);
    let h = tensor(&values(4, 3), &[2, 2], DType::F16);
    let text = matmul(&a, &f).unwrap_err().to_string();
    assert!(
        text.contains("matmul") && text.contains("bf16") && text.contains("f32"),
        "{text}"
    );
    // Under a bf16 scope the f32 operand becomes bf16, an f16 one stays f16.
    let text = autocast(DType::BF16, || linear(&h, &f, None))
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("linear") && text.contains("f16") && text.contains("bf16"),
        "{text}"
    );
    let x = tensor(&values(16, 4), &[1, 1, 4, 4], DType::BF16);
    let w = tensor(&values(4, 5), &[1, 1, 2, 2], DType::BF16);
    let b = tensor(&[0.5], &[1], DType::F16);
    let text = conv2d(&x, &w, Some(&b), &Conv2dParams::default())
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("conv2d") && text.contains("f16") && text.contains("bf16"),
        "{text}"
    );
    let i = Tensor::from_vec(vec![1i64; 4], &[2, 2], Device::Cpu).unwrap();
    let text = matmul(&i, &i).unwrap_err().to_string();
    assert!(text.contains("matmul") && text.contains("i64"), "{text}");
}

#[test]
fn a_thread_started_inside_a_scope_runs_in_f32() {
    let x = tensor(&values(8, 1), &[2, 4], DType::F32);
    let w = leaf(&tensor(&values(12, 2), &[3, 4], DType::F32));
    autocast(DType::BF16, || {
        assert_eq!(linear(&x, &w, None).unwrap().dtype(), DType::BF16);
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(linear(&x, &w, None).unwrap().dtype(), DType::F32));
        });
    })
    .unwrap();
}

/// conv(1→4, 3×3, pad 1) → relu → linear(4·6·6 → 3) → cross_entropy. The conv's
/// low-precision output is cast to f32 before the relu so that the net runs on ops that
/// take f32 only; the linear lowers it again.
struct Net {
    conv_w: Tensor,
    conv_b: Tensor,
    fc_w: Tensor,
    fc_b: Tensor,
}

impl Net {
    fn new() -> Net {
        let p = |n: usize, shape: &[usize], seed: u64, scale: f64| {
            let v: Vec<f64> = values(n, seed).iter().map(|x| x * scale).collect();
            leaf(&tensor(&v, shape, DType::F32))
        };
        Net {
            conv_w: p(36, &[4, 1, 3, 3], 21, 0.5),
            conv_b: p(4, &[4], 22, 0.1),
            fc_w: p(3 * 144, &[3, 144], 23, 0.1),
            fc_b: p(3, &[3], 24, 0.1),
        }
    }

    fn params(&self) -> [&Tensor; 4] {
        [&self.conv_w, &self.conv_b, &self.fc_w, &self.fc_b]
    }

    fn loss(&self, x: &Tensor, targets: &Tensor) -> Tensor {
        let padded = Conv2dParams {
            padding: (1, 1),
            ..Default::default()
        };
        let h = conv2d(x, &self.conv_w, Some(&self.conv_b), &padded).unwrap();
        let h = relu(&cast(&h, DType::F32).unwrap()).unwrap();
        let h = reshape(&h, &[x.dims()[0] as isize, -1]).unwrap();
        let logits = linear(&h, &self.fc_w, Some(&self.fc_b)).unwrap();
        cross_entropy(&logits, targets, Reduction::Mean).unwrap()
    }

    /// One SGD step; returns the loss and the gradients before the step.
    fn step(&self, x: &Tensor, targets: &Tensor, amp: Option<DType>) -> (f64, Vec<Vec<f64>>) {
        for p in self.params() {
            p.set_grad(None).unwrap();
        }
        let loss = match amp {
            Some(dtype) => autocast(dtype, || self.loss(x, targets)).unwrap(),
            None => self.loss(x, targets),
        };
        assert_eq!(loss.dtype(), DType::F32);
        loss.backward().unwrap();
        let grads = self
            .params()
            .iter()
            .map(|p| {
                let g = p.grad().unwrap();
                assert_eq!(g.dtype(), DType::F32);
                g.to_vec_f64().unwrap()
            })
            .collect();
        no_grad(|| {
            for p in self.params() {
                p.add_scaled_(&p.grad().unwrap(), -0.5).unwrap();
            }
        });
        (loss.item().unwrap(), grads)
    }
}

fn relative_distance(a: &[f64], b: &[f64]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    (diff / norm).sqrt()
}

#[test]
fn a_small_conv_net_trains_under_autocast_with_gradients_close_to_f32() {
    let x = tensor(&values(8 * 36, 31), &[8, 1, 6, 6], DType::F32);
    let targets = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], &[8], Device::Cpu).unwrap();
    for dtype in LOW {
        let (reference, amp) = (Net::new(), Net::new());
        let (_, want) = reference.step(&x, &targets, None);
        let (first, got) = amp.step(&x, &targets, Some(dtype));
        // Each gradient passes through at most four roundings to the format (two operands,
        // the layer's output, the cast back), each ≤ u relative: 4u in norm.
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = relative_distance(g, w);
            assert!(
                d <= 4.0 * unit_roundoff(dtype),
                "{dtype} parameter {i}: {d}"
            );
        }
        let mut last = first;
        for _ in 0..15 {
            last = amp.step(&x, &targets, Some(dtype)).0;
        }
        assert!(last < 0.5 * first, "{dtype}: loss {first} -> {last}");
    }
}
