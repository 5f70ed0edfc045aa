//! The softmax kernels (`ops/src/softmax/softmax.cu`), run on the CPU by the host harness
//! through the launches the CUDA ops use (`tandem_ops::softmax::cuda::launch::softmax_launch`), against
//! tandem's CPU `softmax` and `log_softmax`, forward and backward (through autograd): rows for
//! one warp and for one block, columns (a dim other than the last), one element per group,
//! empty groups, huge logits and rows of -inf and NaN. Outputs start poisoned between guard
//! elements; each launch also runs with a grid of two one-warp blocks.

mod common;

use common::{poison, run_launch, small_grid, HostBuffer};
use rand::{Rng, SeedableRng};
use tandem_autograd::{BackwardOptions, TensorBackward};
use tandem_core::{Device, Element, Layout, Tensor};
use tandem_ops::softmax::cuda::launch::softmax_launch;

fn values<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let v = match i {
                0 => 1000.0,
                1 => -1000.0,
                _ => (rng.gen::<f64>() - 0.5) * 12.0,
            };
            T::from_f64(v)
        })
        .collect()
}

fn close(got: f64, want: f64, f32_like: bool) -> bool {
    let tolerance = if f32_like { 2e-5 } else { 1e-12 };
    (got.is_nan() && want.is_nan()) || (got - want).abs() <= tolerance * want.abs().max(1.0)
}

fn check<T: Element>(shape: &[usize], dim: usize, log: bool) {
    let what = format!(
        "{} {} {shape:?} dim {dim}",
        if log { "log_softmax" } else { "softmax" },
        T::DTYPE
    );
    let n: usize = shape.iter().product();
    let split = (
        shape[..dim].iter().product::<usize>(),
        shape[dim],
        shape[dim + 1..].iter().product::<usize>(),
    );
    let x = values::<T>(n, 3);
    let g = values::<T>(n, 4);
    let leaf = Tensor::from_vec(x.clone(), shape, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let y = if log {
        tandem_ops::log_softmax(&leaf, dim as isize)
    } else {
        tandem_ops::softmax(&leaf, dim as isize)
    }
    .unwrap();
    let want_y = y.to_vec_f64().unwrap();
    if n == 0 {
        return; // the op launches nothing
    }
    y.backward_with(
        Some(&Tensor::from_vec(g.clone(), shape, Device::Cpu).unwrap()),
        &BackwardOptions::default(),
    )
    .unwrap();
    let want_dx = leaf.grad().unwrap().to_vec_f64().unwrap();
    let f32_like = T::DTYPE == tandem_core::DType::F32;
    let d = Layout::contiguous(&[0]);
    for small in [false, true] {
        let mut xb = HostBuffer::new(&x);
        let mut yb = HostBuffer::new(&vec![poison::<T>(); n]);
        let launch = softmax_launch(
            "softmax",
            T::DTYPE,
            &[xb.view(&d).ptr],
            yb.view(&d).ptr,
            split,
            log,
            false,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        let got: Vec<f64> = yb.storage(&what).iter().map(|v| v.to_f64()).collect();
        for (i, (a, b)) in got.iter().zip(&want_y).enumerate() {
            assert!(
                close(*a, *b, f32_like),
                "{what}, small grid {small}: y[{i}] = {a}, CPU {b}"
            );
        }
        // Backward from the CPU's output (the op saves its own output).
        let y_saved: Vec<T> = want_y.iter().map(|&v| T::from_f64(v)).collect();
        let mut gb = HostBuffer::new(&g);
        let mut ys = HostBuffer::new(&y_saved);
        let mut dx = HostBuffer::new(&vec![poison::<T>(); n]);
        let launch = softmax_launch(
            "softmax",
            T::DTYPE,
            &[gb.view(&d).ptr, ys.view(&d).ptr],
            dx.view(&d).ptr,
            split,
            log,
            true,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        let got: Vec<f64> = dx.storage(&what).iter().map(|v| v.to_f64()).collect();
        for (i, (a, b)) in got.iter().zip(&want_dx).enumerate() {
            assert!(
                close(*a, *b, f32_like),
                "{what}, small grid {small}: dx[{i}] = {a}, CPU {b}"
            );
        }
    }
}

#[test]
fn softmax_and_log_softmax_match_the_cpu_over_rows_and_columns() {
    let cases: [(&[usize], usize); 9] = [
        (&[4, 10], 1),
        (&[3, 1500], 1),
        (&[37], 0),
        (&[3, 4, 5], 1),
        (&[3, 4, 5], 0),
        (&[6, 1], 1),
        (&[40, 33], 0),
        (&[0, 3], 1),
        (&[2, 0], 1),
    ];
    for (shape, dim) in cases {
        for log in [false, true] {
            check::<f32>(shape, dim, log);
            check::<f64>(shape, dim, log);
        }
    }
}

#[test]
fn rows_of_infinities_and_nan_give_the_cpu_nans() {
    for row in [
        vec![f32::NEG_INFINITY; 3],
        vec![1.0, f32::NAN, 2.0],
        vec![f32::INFINITY, 0.0, 1.0],
    ] {
        for log in [false, true] {
            let x = Tensor::from_vec(row.clone(), &[1, 3], Device::Cpu).unwrap();
            let want = if log {
                tandem_ops::log_softmax(&x, 1)
            } else {
                tandem_ops::softmax(&x, 1)
            }
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
            let mut xb = HostBuffer::new(&row);
            let mut yb = HostBuffer::new(&[poison::<f32>(); 3]);
            let d = Layout::contiguous(&[0]);
            let launch = softmax_launch(
                "softmax",
                tandem_core::DType::F32,
                &[xb.view(&d).ptr],
                yb.view(&d).ptr,
                (1, 3, 1),
                log,
                false,
            )
            .unwrap();
            run_launch(&launch, "special rows");
            let got = yb.storage("special rows").to_vec();
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a.is_nan() && b.is_nan()) || a == b,
                    "row {row:?} log {log}: got {got:?}, CPU {want:?}"
                );
            }
        }
    }
}
