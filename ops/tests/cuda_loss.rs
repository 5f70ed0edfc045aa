//! GPU conformance of the losses: `cross_entropy`, `nll_loss` and `mse_loss` on CUDA with every
//! `Reduction` against the same losses on the CPU with the same inputs, forward and backward
//! (f32 within rounding); `gradcheck` in f64 on the GPU; a label out of range reported (after
//! the step, at the next read) as the CPU's error, never an illegal memory access, and the
//! device usable afterwards; and the CPU's errors for bad shapes, dtypes and device mixes.
//!
//! Each test prints runs on the CUDA emulator without a GPU. Failure messages name the loss,
//! the reduction, the sizes, the dtype and the first differing element.

mod common;

use common::GPU;

use tandem_autograd::{gradcheck, BackwardOptions, GradcheckOptions, TensorBackward};
use tandem_core::{cuda, DType, Device, Generator, Tensor};
use tandem_ops::Reduction;

const REDUCTIONS: [Reduction; 3] = [Reduction::None, Reduction::Sum, Reduction::Mean];

fn randn(shape: &[usize], dtype: DType, seed: u64, scale: f64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn(shape, 0.0, scale, dtype, Device::Cpu, &mut g).unwrap()
}

fn labels(n: usize, c: usize, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    let mut v: Vec<i64> = (0..n).map(|i| (i % c.max(1)) as i64).collect();
    g.shuffle(&mut v);
    Tensor::from_vec(v, &[n], Device::Cpu).unwrap()
}

fn leaf(t: &Tensor, device: Device) -> Tensor {
    t.copy_detached()
        .unwrap()
        .to_device(device)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: the result stays on the GPU");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let g = got.to_vec_f64().unwrap();
    let w = want.to_vec_f64().unwrap();
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
            "{what}: element {i} is {a} on the GPU, {b} on the CPU"
        );
    }
}

/// Runs a classification loss on both devices and compares loss and logits gradient.
fn compare_class_loss(
    name: &str,
    f: fn(&Tensor, &Tensor, Reduction) -> tandem_core::Result<Tensor>,
    log_probs_input: bool,
) {
    for (n, c) in [(256, 10), (5, 3), (3, 1500), (1, 1), (64, 100)] {
        for dtype in [DType::F32, DType::F64] {
            for reduction in REDUCTIONS {
                for transposed in [false, true] {
                    let what =
                        format!("{name} {reduction:?} [{n}, {c}] {dtype} transposed {transposed}");
                    let mut x = randn(&[n, c], dtype, 1, 5.0);
                    if log_probs_input {
                        x = tandem_ops::log_softmax(&x, 1).unwrap();
                    }
                    let (xc, xg) = (leaf(&x, Device::Cpu), leaf(&x, GPU));
                    // A transposed view holding the same values: strided input on both sides.
                    let view = |t: &Tensor| {
                        if transposed {
                            let s =
                                tandem_ops::contiguous(&tandem_ops::transpose(t, 0, 1).unwrap())
                                    .unwrap();
                            tandem_ops::transpose(&s, 0, 1).unwrap()
                        } else {
                            t.clone()
                        }
                    };
                    let t = labels(n, c, 2);
                    let lc = f(&view(&xc), &t, reduction).unwrap();
                    let lg = f(&view(&xg), &t.to_device(GPU).unwrap(), reduction).unwrap();
                    assert_close(&lg, &lc, &what);
                    let grad = randn(lc.dims(), dtype, 3, 1.0);
                    lc.backward_with(Some(&grad), &BackwardOptions::default())
                        .unwrap();
                    lg.backward_with(
                        Some(&grad.to_device(GPU).unwrap()),
                        &BackwardOptions::default(),
                    )
                    .unwrap();
                    assert_close(
                        &xg.grad().unwrap(),
                        &xc.grad().unwrap(),
                        &format!("{what}: gradient"),
                    );
                }
            }
        }
    }
}

#[test]
fn cross_entropy_matches_the_cpu_for_every_reduction() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    compare_class_loss("cross_entropy", tandem_ops::cross_entropy, false);
}

#[test]
fn nll_loss_matches_the_cpu_for_every_reduction() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    compare_class_loss("nll_loss", tandem_ops::nll_loss, true);
}

#[test]
fn cross_entropy_is_stable_for_huge_logits() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = Tensor::from_vec(vec![1000.0f32, 0.0, -1000.0, 5.0], &[2, 2], Device::Cpu).unwrap();
    let t = Tensor::from_vec(vec![1i64, 0], &[2], Device::Cpu).unwrap();
    let cpu = tandem_ops::cross_entropy(&x, &t, Reduction::None).unwrap();
    let gpu = tandem_ops::cross_entropy(
        &x.to_device(GPU).unwrap(),
        &t.to_device(GPU).unwrap(),
        Reduction::None,
    )
    .unwrap();
    assert_close(&gpu, &cpu, "cross_entropy of ±1000 logits");
}

#[test]
fn mse_loss_matches_the_cpu_for_every_reduction() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for shape in [&[37][..], &[64, 10], &[3, 4, 5], &[]] {
        for dtype in [DType::F32, DType::F64] {
            for reduction in REDUCTIONS {
                let what = format!("mse_loss {reduction:?} {shape:?} {dtype}");
                let (p, t) = (randn(shape, dtype, 4, 2.0), randn(shape, dtype, 5, 2.0));
                let (pc, tc) = (leaf(&p, Device::Cpu), leaf(&t, Device::Cpu));
                let (pg, tg) = (leaf(&p, GPU), leaf(&t, GPU));
                let lc = tandem_ops::mse_loss(&pc, &tc, reduction).unwrap();
                let lg = tandem_ops::mse_loss(&pg, &tg, reduction).unwrap();
                assert_close(&lg, &lc, &what);
                let grad = randn(lc.dims(), dtype, 6, 1.0);
                lc.backward_with(Some(&grad), &BackwardOptions::default())
                    .unwrap();
                lg.backward_with(
                    Some(&grad.to_device(GPU).unwrap()),
                    &BackwardOptions::default(),
                )
                .unwrap();
                assert_close(
                    &pg.grad().unwrap(),
                    &pc.grad().unwrap(),
                    &format!("{what}: pred"),
                );
                assert_close(
                    &tg.grad().unwrap(),
                    &tc.grad().unwrap(),
                    &format!("{what}: target"),
                );
            }
        }
    }
}

/// Losses of no samples (and of no classes for an empty batch): `None` and `Sum` give the
/// CPU's empty tensor or zero and empty gradients; `Mean` is the CPU's error on both devices.
#[test]
fn empty_batches_match_the_cpu_for_every_reduction() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    type ClassLoss = fn(&Tensor, &Tensor, Reduction) -> tandem_core::Result<Tensor>;
    let class_losses: [(&str, ClassLoss); 2] = [
        ("cross_entropy", tandem_ops::cross_entropy),
        ("nll_loss", tandem_ops::nll_loss),
    ];
    let backward_both = |lc: &Tensor, lg: &Tensor, dtype: DType| {
        let grad = randn(lc.dims(), dtype, 3, 1.0);
        lc.backward_with(Some(&grad), &BackwardOptions::default())
            .unwrap();
        lg.backward_with(
            Some(&grad.to_device(GPU).unwrap()),
            &BackwardOptions::default(),
        )
        .unwrap();
    };
    for dtype in [DType::F32, DType::F64] {
        for (name, f) in class_losses {
            for c in [10, 0] {
                for reduction in REDUCTIONS {
                    let what = format!("{name} {reduction:?} [0, {c}] {dtype}");
                    let x = randn(&[0, c], dtype, 1, 1.0);
                    let (xc, xg) = (leaf(&x, Device::Cpu), leaf(&x, GPU));
                    let t = labels(0, c, 2);
                    let (lc, lg) = (
                        f(&xc, &t, reduction),
                        f(&xg, &t.to_device(GPU).unwrap(), reduction),
                    );
                    let (lc, lg) = match (lc, lg) {
                        (Ok(lc), Ok(lg)) => (lc, lg),
                        (Err(c), Err(g)) => {
                            assert_eq!(g.to_string(), c.to_string(), "{what}: the error");
                            continue;
                        }
                        (c, g) => panic!("{what}: CPU {:?}, GPU {:?}", c.err(), g.err()),
                    };
                    assert_close(&lg, &lc, &what);
                    backward_both(&lc, &lg, dtype);
                    assert_close(
                        &xg.grad().unwrap(),
                        &xc.grad().unwrap(),
                        &format!("{what}: gradient"),
                    );
                }
            }
        }
        for shape in [&[0][..], &[0, 3], &[4, 0, 2]] {
            for reduction in REDUCTIONS {
                let what = format!("mse_loss {reduction:?} {shape:?} {dtype}");
                let (p, t) = (randn(shape, dtype, 4, 2.0), randn(shape, dtype, 5, 2.0));
                let (pc, tc) = (leaf(&p, Device::Cpu), leaf(&t, Device::Cpu));
                let (pg, tg) = (leaf(&p, GPU), leaf(&t, GPU));
                let (lc, lg) = match (
                    tandem_ops::mse_loss(&pc, &tc, reduction),
                    tandem_ops::mse_loss(&pg, &tg, reduction),
                ) {
                    (Ok(lc), Ok(lg)) => (lc, lg),
                    (Err(c), Err(g)) => {
                        assert_eq!(g.to_string(), c.to_string(), "{what}: the error");
                        continue;
                    }
                    (c, g) => panic!("{what}: CPU {:?}, GPU {:?}", c.err(), g.err()),
                };
                assert_close(&lg, &lc, &what);
                backward_both(&lc, &lg, dtype);
                assert_close(
                    &pg.grad().unwrap(),
                    &pc.grad().unwrap(),
                    &format!("{what}: pred"),
                );
                assert_close(
                    &tg.grad().unwrap(),
                    &tc.grad().unwrap(),
                    &format!("{what}: target"),
                );
            }
        }
    }
}

#[test]
fn gradcheck_in_f64_on_the_gpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let opts = GradcheckOptions::default();
    let x = leaf(&randn(&[6, 5], DType::F64, 7, 2.0), GPU);
    let y = leaf(&randn(&[6, 5], DType::F64, 8, 2.0), GPU);
    let t = labels(6, 5, 9).to_device(GPU).unwrap();
    for reduction in REDUCTIONS {
        let t1 = t.clone();
        gradcheck(
            move |a| {
                let l = tandem_ops::cross_entropy(&a[0], &t1, reduction)?;
                tandem_ops::sum_all(&l)
            },
            std::slice::from_ref(&x),
            &opts,
        )
        .unwrap_or_else(|e| panic!("gradcheck of cross_entropy {reduction:?} on the GPU: {e}"));
        let t2 = t.clone();
        gradcheck(
            move |a| {
                let lp = tandem_ops::log_softmax(&a[0], 1)?;
                tandem_ops::sum_all(&tandem_ops::nll_loss(&lp, &t2, reduction)?)
            },
            std::slice::from_ref(&x),
            &opts,
        )
        .unwrap_or_else(|e| panic!("gradcheck of nll_loss {reduction:?} on the GPU: {e}"));
        gradcheck(
            move |a| tandem_ops::sum_all(&tandem_ops::mse_loss(&a[0], &a[1], reduction)?),
            &[x.clone(), y.clone()],
            &opts,
        )
        .unwrap_or_else(|e| panic!("gradcheck of mse_loss {reduction:?} on the GPU: {e}"));
    }
}

#[test]
fn a_label_out_of_range_is_the_cpu_error_at_the_next_read() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = randn(&[4, 3], DType::F32, 1, 1.0);
    for bad in [3i64, -1, 1 << 40] {
        let t = Tensor::from_vec(vec![0i64, 2, bad, 1], &[4], Device::Cpu).unwrap();
        for (name, f) in [
            (
                "cross_entropy",
                tandem_ops::cross_entropy as fn(&_, &_, _) -> _,
            ),
            ("nll_loss", tandem_ops::nll_loss),
        ] {
            let cpu_err = f(&x, &t, Reduction::Mean).unwrap_err().to_string();
            // The GPU op returns (no host read inside the op); the read reports the error.
            let loss = f(
                &x.to_device(GPU).unwrap(),
                &t.to_device(GPU).unwrap(),
                Reduction::Mean,
            )
            .unwrap_or_else(|e| panic!("{name} label {bad}: the op itself failed: {e}"));
            let err = loss
                .item()
                .expect_err("the next read reports the bad label")
                .to_string();
            assert!(
                err.starts_with(&cpu_err),
                "{name} label {bad}: the GPU error\n  {err}\nshould start with the CPU's\n  {cpu_err}"
            );
            // Reported once; the device works afterwards.
            cuda::device(0).unwrap().synchronize().unwrap();
            let t_ok = Tensor::from_vec(vec![0i64, 2, 1, 1], &[4], Device::Cpu).unwrap();
            let ok = f(
                &x.to_device(GPU).unwrap(),
                &t_ok.to_device(GPU).unwrap(),
                Reduction::Mean,
            )
            .unwrap()
            .item()
            .unwrap();
            let want = f(&x, &t_ok, Reduction::Mean).unwrap().item().unwrap();
            assert!(
                (ok - want).abs() < 1e-5,
                "{name}: {ok} vs {want} after an error"
            );
        }
    }
}

#[test]
fn bad_arguments_give_the_cpu_errors() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = randn(&[4, 3], DType::F32, 1, 1.0);
    let xg = x.to_device(GPU).unwrap();
    let t = labels(4, 3, 2);
    let tg = t.to_device(GPU).unwrap();
    let short = labels(3, 3, 2);
    let cases: Vec<(&str, String, String)> = vec![
        (
            "targets of the wrong length",
            tandem_ops::cross_entropy(&x, &short, Reduction::Mean)
                .unwrap_err()
                .to_string(),
            tandem_ops::cross_entropy(&xg, &short.to_device(GPU).unwrap(), Reduction::Mean)
                .unwrap_err()
                .to_string(),
        ),
        (
            "f32 targets",
            tandem_ops::nll_loss(
                &x,
                &tandem_ops::narrow(&x, 1, 0, 1).unwrap(),
                Reduction::Sum,
            )
            .unwrap_err()
            .to_string(),
            tandem_ops::nll_loss(
                &xg,
                &tandem_ops::narrow(&xg, 1, 0, 1).unwrap(),
                Reduction::Sum,
            )
            .unwrap_err()
            .to_string(),
        ),
        (
            "mse shapes",
            tandem_ops::mse_loss(
                &x,
                &tandem_ops::narrow(&x, 1, 0, 2).unwrap(),
                Reduction::Mean,
            )
            .unwrap_err()
            .to_string(),
            tandem_ops::mse_loss(
                &xg,
                &tandem_ops::narrow(&xg, 1, 0, 2).unwrap(),
                Reduction::Mean,
            )
            .unwrap_err()
            .to_string(),
        ),
    ];
    for (what, cpu, gpu) in cases {
        assert_eq!(gpu, cpu, "{what}");
    }
    // Mixing devices is an error naming the op.
    let err = tandem_ops::cross_entropy(&xg, &t, Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cross_entropy"), "{err}");
    let err = tandem_ops::mse_loss(&xg, &x, Reduction::Mean)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mse_loss"), "{err}");
    let _ = tg;
}
