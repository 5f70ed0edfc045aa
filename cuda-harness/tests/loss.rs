//! The loss kernels (`ops/src/loss/loss.cu`), run on the CPU by the host harness through the
//! launches the CUDA ops use (`tandem_ops::loss::cuda::launch`), against tandem's CPU losses
//! (`cross_entropy`, `nll_loss`, `mse_loss` with `Reduction::None`, their gradients through
//! autograd), and the device-side label check against the deferred-error record's contract.
//!
//! Sizes cover rows short enough for one warp and long enough for one block, one class, no
//! samples, strided log-probabilities, labels and gradients, and a scalar gradient (the
//! backward of a reduced loss). Outputs start poisoned between guard elements; each launch also
//! runs with a grid of two one-warp blocks.

mod common;

use common::{poison, run_launch, small_grid, HostBuffer};
use rand::{Rng, SeedableRng};
use tandem_autograd::{BackwardOptions, TensorBackward};
use tandem_core::cuda::deferred::DeferredSlot;
use tandem_core::{DType, Device, Element, Layout, Tensor};
use tandem_ops::loss::cuda::launch::{
    cross_entropy_backward_launch, cross_entropy_rows_launch, mse_backward_launch,
    mse_forward_launch, nll_backward_launch, nll_forward_launch, Labels, Scales,
};
use tandem_ops::Reduction;

const SIZES: [(usize, usize); 6] = [(5, 10), (3, 1500), (33, 7), (4, 1), (0, 4), (2, 0)];

fn normal<T: Element>(n: usize, seed: u64, scale: f64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64((rng.gen::<f64>() - 0.5) * scale))
        .collect()
}

fn labels_for(n: usize, c: usize, seed: u64) -> Vec<i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(0..c.max(1)) as i64).collect()
}

fn dense() -> Layout {
    Layout::contiguous(&[0])
}

/// The deferred-error record in host memory: a claim word and four record words.
struct Record {
    claim: Vec<u32>,
    words: Vec<i64>,
}

impl Record {
    fn new() -> Self {
        Record {
            claim: vec![0],
            words: vec![0; 4],
        }
    }

    fn slot(&mut self) -> DeferredSlot {
        DeferredSlot {
            claim: self.claim.as_mut_ptr() as u64,
            record: self.words.as_mut_ptr() as u64,
            code: 7,
        }
    }
}

fn close<T: Element>(got: f64, want: f64) -> bool {
    let tolerance = if T::DTYPE == DType::F32 { 2e-5 } else { 1e-12 };
    (got - want).abs() <= tolerance * want.abs().max(1.0)
}

fn assert_close<T: Element>(got: &[T], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            close::<T>(g.to_f64(), *w),
            "{what}: element {i} is {g:?}, the CPU's {w}"
        );
    }
}

fn cpu<T: Element>(values: &[T], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, Device::Cpu).unwrap()
}

/// The CPU loss (Reduction::None) and the gradient of Σ g_i · loss_i.
fn cpu_class_loss<T: Element>(
    cross_entropy: bool,
    x: &[T],
    (n, c): (usize, usize),
    labels: &[i64],
    g: &[T],
) -> (Vec<f64>, Vec<f64>) {
    let logits = cpu(x, &[n, c]).with_requires_grad().unwrap();
    let targets = cpu(labels, &[n]);
    let loss = if cross_entropy {
        tandem_ops::cross_entropy(&logits, &targets, Reduction::None)
    } else {
        tandem_ops::nll_loss(&logits, &targets, Reduction::None)
    }
    .unwrap();
    let values = loss.to_vec_f64().unwrap();
    if n * c == 0 {
        return (values, Vec::new());
    }
    loss.backward_with(Some(&cpu(g, &[n])), &BackwardOptions::default())
        .unwrap();
    (values, logits.grad().unwrap().to_vec_f64().unwrap())
}

fn check_cross_entropy<T: Element>((n, c): (usize, usize)) {
    let what = format!("cross_entropy {} [{n}, {c}]", T::DTYPE);
    let x = normal::<T>(n * c, 1, 20.0);
    let labels = labels_for(n, c, 2);
    let g = normal::<T>(n, 3, 2.0);
    if n > 0 && c == 0 {
        // The op refuses it before launching; so does the builder.
        let mut record = Record::new();
        assert!(cross_entropy_rows_launch(
            "cross_entropy",
            T::DTYPE,
            1,
            Labels { ptr: 2, stride: 1 },
            (3, 4, 5),
            n,
            c,
            record.slot()
        )
        .is_err());
        return;
    }
    let (want_loss, want_grad) = cpu_class_loss(true, &x, (n, c), &labels, &g);
    for small in [false, true] {
        let mut record = Record::new();
        let mut xb = HostBuffer::new(&x);
        let mut lb = HostBuffer::new(&labels);
        let mut losses = HostBuffer::new(&vec![poison::<T>(); n]);
        let mut max = HostBuffer::new(&vec![poison::<T>(); n]);
        let mut log_sum = HostBuffer::new(&vec![poison::<T>(); n]);
        let d = dense();
        let labels_arg = Labels {
            ptr: lb.view(&d).ptr,
            stride: 1,
        };
        let launch = cross_entropy_rows_launch(
            "cross_entropy",
            T::DTYPE,
            xb.view(&d).ptr,
            labels_arg,
            (losses.view(&d).ptr, max.view(&d).ptr, log_sum.view(&d).ptr),
            n,
            c,
            record.slot(),
        )
        .unwrap();
        if n == 0 {
            continue;
        }
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_close(losses.storage(&what), &want_loss, &what);
        // The gradient, with one gradient per sample (stride 1) and with a mean's scalar.
        for (g_values, stride, scale) in [
            (g.clone(), 1usize, 1.0),
            (vec![T::from_f64(1.5)], 0, 1.0 / n as f64),
        ] {
            let mut gb = HostBuffer::new(&g_values);
            let mut grad = HostBuffer::new(&vec![poison::<T>(); n * c]);
            let launch = cross_entropy_backward_launch(
                "cross_entropy",
                T::DTYPE,
                xb.view(&d).ptr,
                labels_arg,
                (max.view(&d).ptr, log_sum.view(&d).ptr),
                Scales {
                    ptr: gb.view(&d).ptr,
                    stride,
                    scale,
                },
                grad.view(&d).ptr,
                (n, c),
                record.slot(),
            )
            .unwrap();
            run_launch(&if small { small_grid(&launch) } else { launch }, &what);
            let want: Vec<f64> = if stride == 1 {
                want_grad.clone()
            } else {
                // The mean's gradient: 1.5 / n · (softmax − onehot), from the CPU op.
                let logits = cpu(&x, &[n, c]).with_requires_grad().unwrap();
                let loss = tandem_ops::cross_entropy(&logits, &cpu(&labels, &[n]), Reduction::Mean)
                    .unwrap();
                loss.backward_with(
                    Some(&Tensor::scalar(T::from_f64(1.5), Device::Cpu).unwrap()),
                    &BackwardOptions::default(),
                )
                .unwrap();
                logits.grad().unwrap().to_vec_f64().unwrap()
            };
            assert_close(
                grad.storage(&what),
                &want,
                &format!("{what} gradient, stride {stride}"),
            );
        }
        assert_eq!(record.claim[0], 0, "{what}: valid labels recorded nothing");
    }
}

#[test]
fn cross_entropy_rows_and_gradient_match_the_cpu() {
    for size in SIZES {
        check_cross_entropy::<f32>(size);
        check_cross_entropy::<f64>(size);
    }
}

#[test]
fn a_label_out_of_range_is_recorded_once_and_never_read_through() {
    let (n, c) = (6, 5);
    let x = normal::<f32>(n * c, 4, 4.0);
    // Labels -1 (row 2) and 5 (row 4) are out of range; only one finding is recorded.
    let labels = vec![0i64, 4, -1, 2, 5, 1];
    let mut record = Record::new();
    let mut xb = HostBuffer::new(&x);
    let mut lb = HostBuffer::new(&labels);
    let mut losses = HostBuffer::new(&vec![poison::<f32>(); n]);
    let mut aux = HostBuffer::new(&vec![poison::<f32>(); 2 * n]);
    let d = dense();
    let aux_ptr = aux.view(&d).ptr;
    let labels_arg = Labels {
        ptr: lb.view(&d).ptr,
        stride: 1,
    };
    let launch = cross_entropy_rows_launch(
        "cross_entropy",
        DType::F32,
        xb.view(&d).ptr,
        labels_arg,
        (losses.view(&d).ptr, aux_ptr, aux_ptr + 4 * n as u64),
        n,
        c,
        record.slot(),
    )
    .unwrap();
    run_launch(&launch, "bad labels");
    let got = losses.storage("bad labels").to_vec();
    assert!(got[2].is_nan() && got[4].is_nan(), "{got:?}");
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, v)| i == 2 || i == 4 || v.is_finite()));
    assert_eq!(record.claim[0], 1, "the record is claimed");
    let (code, position, value, bound) = (
        record.words[0],
        record.words[1],
        record.words[2],
        record.words[3],
    );
    assert_eq!((code, bound), (7, 5), "{:?}", record.words);
    assert!(
        (position, value) == (2, -1) || (position, value) == (4, 5),
        "{:?}",
        record.words
    );
    // A claimed record is not overwritten by later findings (the host reports the first).
    let mut nll_losses = HostBuffer::new(&vec![poison::<f32>(); n]);
    let first = record.words.clone();
    let launch = nll_forward_launch(
        "nll_loss",
        DType::F32,
        xb.view(&d).ptr,
        (c, 1),
        labels_arg,
        nll_losses.view(&d).ptr,
        (n, c),
        record.slot(),
    )
    .unwrap();
    run_launch(&launch, "bad labels, nll");
    assert_eq!(record.words, first);
    let got = nll_losses.storage("nll").to_vec();
    assert!(
        got[2].is_nan() && got[4].is_nan() && got[0] == -x[0],
        "{got:?}"
    );
    // The gradient of a bad row is NaN; other rows are untouched by it.
    let mut fresh = Record::new();
    let mut grad = HostBuffer::new(&vec![poison::<f32>(); n * c]);
    let mut gb = HostBuffer::new(&[1.0f32]);
    let launch = nll_backward_launch(
        "nll_loss",
        DType::F32,
        labels_arg,
        Scales {
            ptr: gb.view(&d).ptr,
            stride: 0,
            scale: 1.0,
        },
        grad.view(&d).ptr,
        (n, c),
        fresh.slot(),
    )
    .unwrap();
    run_launch(&launch, "bad labels, nll backward");
    let got = grad.storage("nll backward").to_vec();
    assert!(got[2 * c..3 * c].iter().all(|v| v.is_nan()));
    assert_eq!(&got[..c], &[-1.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(fresh.claim[0], 1);
    assert_eq!(fresh.words[0], 7);
}

fn check_nll<T: Element>((n, c): (usize, usize)) {
    let what = format!("nll_loss {} [{n}, {c}]", T::DTYPE);
    if c == 0 && n > 0 {
        return; // every label is out of range: covered by the bad-label test
    }
    // log_probs stored transposed ([c, n] storage): strides (1, n).
    let storage = normal::<T>(n * c, 5, 6.0);
    let t = Layout::contiguous(&[c, n]).transpose("t", 0, 1).unwrap();
    let lp: Vec<T> = common::cpu_view(&storage, &t)
        .to_vec_f64()
        .unwrap()
        .into_iter()
        .map(T::from_f64)
        .collect();
    // Labels with stride 2 (every other element of a longer storage).
    let labels = labels_for(n, c, 6);
    let mut label_storage = vec![-99i64; 2 * n];
    for (i, &l) in labels.iter().enumerate() {
        label_storage[2 * i] = l;
    }
    let g = normal::<T>(2 * n, 7, 2.0);
    let g_every_other: Vec<T> = g.iter().step_by(2).copied().collect();
    let (want_loss, want_grad) = cpu_class_loss(false, &lp, (n, c), &labels, &g_every_other);
    for small in [false, true] {
        let mut record = Record::new();
        let mut xb = HostBuffer::new(&storage);
        let mut lb = HostBuffer::new(&label_storage);
        let mut losses = HostBuffer::new(&vec![poison::<T>(); n]);
        let d = dense();
        let labels_arg = Labels {
            ptr: lb.view(&d).ptr,
            stride: 2,
        };
        let launch = nll_forward_launch(
            "nll_loss",
            T::DTYPE,
            xb.view(&d).ptr,
            (1, n),
            labels_arg,
            losses.view(&d).ptr,
            (n, c),
            record.slot(),
        )
        .unwrap();
        if n == 0 {
            continue;
        }
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_close(losses.storage(&what), &want_loss, &what);
        let mut gb = HostBuffer::new(&g);
        let mut grad = HostBuffer::new(&vec![poison::<T>(); n * c]);
        let launch = nll_backward_launch(
            "nll_loss",
            T::DTYPE,
            labels_arg,
            Scales {
                ptr: gb.view(&d).ptr,
                stride: 2,
                scale: 1.0,
            },
            grad.view(&d).ptr,
            (n, c),
            record.slot(),
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_close(grad.storage(&what), &want_grad, &format!("{what} gradient"));
        assert_eq!(record.claim[0], 0, "{what}");
    }
}

#[test]
fn nll_loss_and_gradient_match_the_cpu_for_strided_inputs() {
    for size in SIZES {
        check_nll::<f32>(size);
        check_nll::<f64>(size);
    }
}

fn check_mse<T: Element>(shape: &[usize], transposed_target: bool, scalar_g: bool) {
    let what = format!(
        "mse_loss {} {shape:?}, transposed target {transposed_target}, scalar g {scalar_g}",
        T::DTYPE
    );
    let n: usize = shape.iter().product();
    if n == 0 {
        return; // the ops launch nothing for empty inputs (and refuse a mean of nothing)
    }
    let a = normal::<T>(n, 8, 4.0);
    let b_storage = normal::<T>(n, 9, 4.0);
    let b_layout = if transposed_target && shape.len() == 2 {
        Layout::contiguous(&[shape[1], shape[0]])
            .transpose("t", 0, 1)
            .unwrap()
    } else {
        Layout::contiguous(shape)
    };
    let a_layout = Layout::contiguous(shape);
    let pred = cpu(&a, shape).with_requires_grad().unwrap();
    let target = common::cpu_view(&b_storage, &b_layout)
        .with_requires_grad()
        .unwrap();
    let g_values = if scalar_g {
        vec![T::from_f64(0.75)]
    } else {
        normal::<T>(n, 10, 2.0)
    };
    let (loss, g_cpu, scale) = if scalar_g {
        (
            tandem_ops::mse_loss(&pred, &target, Reduction::Mean).unwrap(),
            Tensor::scalar(g_values[0], Device::Cpu).unwrap(),
            1.0 / n.max(1) as f64,
        )
    } else {
        (
            tandem_ops::mse_loss(&pred, &target, Reduction::None).unwrap(),
            cpu(&g_values, shape),
            1.0,
        )
    };
    let squares = tandem_ops::mse_loss(&pred.detach(), &target.detach(), Reduction::None)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    if n == 0 {
        return;
    }
    loss.backward_with(Some(&g_cpu), &BackwardOptions::default())
        .unwrap();
    let want_pred = pred.grad().unwrap().to_vec_f64().unwrap();
    let want_target = target.grad().unwrap().to_vec_f64().unwrap();
    let g_layout = if scalar_g {
        tandem_core::Layout::from_parts(
            shape.iter().copied().collect(),
            shape.iter().map(|_| 0).collect(),
            0,
        )
    } else {
        Layout::contiguous(shape)
    };
    for small in [false, true] {
        let mut ab = HostBuffer::new(&a);
        let mut bb = HostBuffer::new(&b_storage);
        let mut out = HostBuffer::new(&vec![poison::<T>(); n]);
        let d = dense();
        let (ap, bp) = (ab.view(&d).ptr, bb.view(&d).ptr);
        let launch = mse_forward_launch(
            "mse_loss",
            T::DTYPE,
            (ap, &a_layout),
            (bp, &b_layout),
            out.view(&d).ptr,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_close(out.storage(&what), &squares, &what);
        let mut gb = HostBuffer::new(&g_values);
        let mut gp = HostBuffer::new(&vec![poison::<T>(); n]);
        let mut gt = HostBuffer::new(&vec![poison::<T>(); n]);
        let launch = mse_backward_launch(
            "mse_loss",
            T::DTYPE,
            (ap, &a_layout),
            (bp, &b_layout),
            (gb.view(&d).ptr, &g_layout),
            scale,
            gp.view(&d).ptr,
            Some(gt.view(&d).ptr),
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_close(
            gp.storage(&what),
            &want_pred,
            &format!("{what}: pred gradient"),
        );
        assert_close(
            gt.storage(&what),
            &want_target,
            &format!("{what}: target gradient"),
        );
    }
}

#[test]
fn mse_squares_and_gradients_match_the_cpu() {
    for shape in [&[37][..], &[6, 5], &[3, 4, 5], &[], &[0, 3]] {
        for transposed in [false, true] {
            for scalar_g in [false, true] {
                check_mse::<f32>(shape, transposed, scalar_g);
                check_mse::<f64>(shape, transposed, scalar_g);
            }
        }
    }
}
