//! GPU conformance of the 2-D pools (`max_pool2d`, `avg_pool2d`, `adaptive_avg_pool2d`): each
//! pool on CUDA against the same pool on the CPU, forward and backward, on the same inputs;
//! strided inputs and output gradients; gradcheck in f64 on the GPU; inputs without gradients;
//! empty batches; and bad arguments, which must give the CPU's error.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! The kernels perform the CPU's operations in the CPU's order (IEEE division, no fast math), so
//! values are expected to agree to the last bit; the comparison allows f32 rounding so that a
//! failure message shows how far apart the two are, and names the pool, shape, dtype and element.

mod common;

use common::GPU;

use tandem_autograd::{backward, gradcheck, GradcheckOptions};
use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::{adaptive_avg_pool2d, avg_pool2d, max_pool2d};

type Pair = (usize, usize);

/// A pool to run on both devices.
#[derive(Clone, Copy, Debug)]
enum Pool {
    Max { k: Pair, s: Pair, p: Pair },
    Avg { k: Pair, s: Pair, p: Pair },
    Adaptive { out: Pair },
}

impl Pool {
    fn run(self, x: &Tensor) -> tandem_core::Result<Tensor> {
        match self {
            Pool::Max { k, s, p } => max_pool2d(x, k, s, p),
            Pool::Avg { k, s, p } => avg_pool2d(x, k, s, p),
            Pool::Adaptive { out } => adaptive_avg_pool2d(x, out),
        }
    }
}

fn max(k: Pair, s: Pair, p: Pair) -> Pool {
    Pool::Max { k, s, p }
}
fn avg(k: Pair, s: Pair, p: Pair) -> Pool {
    Pool::Avg { k, s, p }
}
fn adaptive(out: Pair) -> Pool {
    Pool::Adaptive { out }
}

/// Shapes and pools: the models' pools (LeNet's 2×2, ResNet's 3×3/2 stem pool and global
/// average pool), odd planes, overlapping windows, strides larger than the kernel, padding at
/// half the kernel, adaptive windows that shrink and grow, 3-D inputs, and enough elements for
/// many blocks.
fn cases() -> Vec<(Vec<usize>, Pool)> {
    vec![
        (vec![8, 6, 28, 28], max((2, 2), (2, 2), (0, 0))),
        (vec![8, 6, 28, 28], avg((2, 2), (2, 2), (0, 0))),
        (vec![3, 5, 9, 7], max((2, 2), (2, 2), (0, 0))),
        (vec![4, 8, 33, 31], max((3, 3), (2, 2), (1, 1))),
        (vec![4, 8, 33, 31], avg((3, 3), (2, 2), (1, 1))),
        (vec![2, 3, 7, 9], max((3, 2), (1, 1), (1, 1))),
        (vec![2, 3, 7, 9], avg((3, 2), (2, 1), (1, 1))),
        (vec![2, 2, 10, 11], max((2, 2), (3, 4), (0, 1))),
        (vec![2, 2, 10, 11], avg((2, 2), (3, 4), (0, 1))),
        (vec![1, 2, 5, 5], max((5, 4), (1, 1), (2, 2))),
        (vec![7, 13, 17], max((2, 3), (2, 2), (1, 1))),
        (vec![7, 13, 17], avg((2, 3), (2, 2), (1, 1))),
        (vec![128, 64, 8, 8], adaptive((1, 1))),
        (vec![2, 3, 7, 5], adaptive((3, 2))),
        (vec![2, 3, 7, 5], adaptive((4, 8))),
        (vec![3, 8, 8], adaptive((5, 3))),
    ]
}

/// Random values with runs of tied zeros, as after a ReLU (ties decide where a max pool's
/// gradient goes).
fn values(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    let x = Tensor::randn(shape, 0.0, 1.0, DType::F64, Device::Cpu, &mut gen).unwrap();
    let v: Vec<f64> = x
        .to_vec::<f64>()
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % 7 < 2 { 0.0 } else { v })
        .collect();
    Tensor::from_vec(v, shape, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Asserts that `got` (from CUDA) equals `want` (from the CPU) within f32 rounding, naming the
/// first element that differs.
fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: result is not on the GPU");
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes differ");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let same = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-6 * (1.0 + b.abs());
        assert!(
            same,
            "{what} ({:?}, {}): element {i} is {a} on CUDA, {b} on the CPU",
            want.dims(),
            want.dtype()
        );
    }
}

/// Runs `pool` on `x` (on the CPU) and on a copy of `x` on the GPU, made strided by `strided`
/// when set, then backward from the same output gradient; compares outputs and gradients.
fn compare(shape: &[usize], pool: Pool, dtype: DType, seed: u64, strided: bool) {
    let what = format!(
        "{pool:?} {dtype} on {shape:?}{}",
        if strided { " (strided)" } else { "" }
    );
    let x = values(shape, dtype, seed);
    let x_cpu = x.copy_detached().unwrap().with_requires_grad().unwrap();
    let x_gpu = if strided {
        // A leaf whose H and W are swapped in memory: same values, transposed strides.
        let r = shape.len();
        let t = x
            .view_detached(x.layout().transpose("test", r - 2, r - 1).unwrap())
            .unwrap();
        let t = t.copy_detached().unwrap().to_device(GPU).unwrap();
        t.view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
            .unwrap()
    } else {
        x.to_device(GPU).unwrap()
    };
    assert_eq!(x_gpu.is_contiguous(), !strided, "{what}: test setup");
    let x_gpu = x_gpu.with_requires_grad().unwrap();

    let y_cpu = pool
        .run(&x_cpu)
        .unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let y_gpu = pool
        .run(&x_gpu)
        .unwrap_or_else(|e| panic!("{what}: CUDA: {e}"));
    assert_close(&y_gpu, &y_cpu, &format!("{what}: forward"));

    let g = values(y_cpu.dims(), dtype, seed + 1);
    let g_gpu = if strided && g.rank() >= 2 {
        let r = g.rank();
        let t = g
            .view_detached(g.layout().transpose("test", r - 2, r - 1).unwrap())
            .unwrap();
        let t = t.copy_detached().unwrap().to_device(GPU).unwrap();
        t.view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
            .unwrap()
    } else {
        g.to_device(GPU).unwrap()
    };
    backward(&y_cpu, Some(&g), &Default::default()).unwrap();
    backward(&y_gpu, Some(&g_gpu), &Default::default())
        .unwrap_or_else(|e| panic!("{what}: CUDA backward: {e}"));
    let (gc, gg) = (x_cpu.grad().unwrap(), x_gpu.grad().unwrap());
    assert_close(&gg, &gc, &format!("{what}: input gradient"));
}

#[test]
fn pools_on_cuda_match_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for (i, (shape, pool)) in cases().into_iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            compare(&shape, pool, dtype, 10 * i as u64, false);
        }
    }
}

#[test]
fn pools_on_cuda_accept_strided_inputs_and_gradients() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for (i, (shape, pool)) in cases().into_iter().enumerate() {
        compare(&shape, pool, DType::F32, 500 + i as u64, true);
    }
}

#[test]
fn max_pool_on_cuda_routes_nan_and_infinities_like_the_cpu() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let shape = [2, 3, 9, 8];
    let mut v = values(&shape, DType::F32, 77).to_vec::<f32>().unwrap();
    v[3] = f32::NAN;
    v[20] = f32::INFINITY;
    v[40] = f32::NEG_INFINITY;
    v[100..116].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
    let x = Tensor::from_vec(v, &shape, Device::Cpu).unwrap();
    let x_cpu = x.copy_detached().unwrap().with_requires_grad().unwrap();
    let x_gpu = x.to_device(GPU).unwrap().with_requires_grad().unwrap();
    for pool in [max((2, 2), (2, 2), (0, 0)), max((3, 3), (2, 2), (1, 1))] {
        let what = format!("{pool:?} with NaN and infinities");
        let y_cpu = pool.run(&x_cpu).unwrap();
        let y_gpu = pool.run(&x_gpu).unwrap();
        assert_close(&y_gpu, &y_cpu, &format!("{what}: forward"));
        let g = values(y_cpu.dims(), DType::F32, 78);
        x_cpu.set_grad(None).unwrap();
        x_gpu.set_grad(None).unwrap();
        backward(&y_cpu, Some(&g), &Default::default()).unwrap();
        backward(
            &y_gpu,
            Some(&g.to_device(GPU).unwrap()),
            &Default::default(),
        )
        .unwrap();
        assert_close(
            &x_gpu.grad().unwrap(),
            &x_cpu.grad().unwrap(),
            &format!("{what}: input gradient"),
        );
    }
}

#[test]
fn pools_on_cuda_without_gradients_and_on_empty_batches() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let pools = [
        max((2, 2), (2, 2), (0, 0)),
        avg((3, 3), (2, 2), (1, 1)),
        adaptive((2, 3)),
    ];
    for pool in pools {
        // No input needs a gradient: the max pool saves no indices.
        let x = values(&[3, 4, 10, 9], DType::F32, 5);
        let want = pool.run(&x).unwrap();
        let got = pool.run(&x.to_device(GPU).unwrap()).unwrap();
        assert!(!got.requires_grad(), "{pool:?}: output requires grad");
        assert_close(&got, &want, &format!("{pool:?} without gradients"));
        // An empty batch, no channels, no planes of a 3-D input: an empty output of the CPU's
        // shape, and an empty gradient.
        for shape in [&[0, 4, 10, 9][..], &[2, 0, 10, 9], &[0, 10, 9]] {
            for dtype in [DType::F32, DType::F64] {
                compare(shape, pool, dtype, 6, false);
            }
        }
    }
}

#[test]
fn gradcheck_pools_in_f64_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let cases = [
        (vec![2, 2, 7, 6], max((2, 2), (2, 2), (0, 0))),
        (vec![1, 2, 7, 6], max((3, 3), (2, 2), (1, 1))),
        (vec![2, 2, 7, 6], avg((3, 2), (2, 1), (1, 1))),
        (vec![2, 6, 5], avg((2, 2), (1, 1), (0, 0))),
        (vec![2, 2, 5, 7], adaptive((3, 4))),
        (vec![2, 2, 5, 7], adaptive((7, 9))),
    ];
    for (i, (shape, pool)) in cases.into_iter().enumerate() {
        // Distinct values (no ties within the finite-difference step) for the max pools.
        let mut gen = Generator::new(900 + i as u64);
        let x = Tensor::randn(&shape, 0.0, 1.0, DType::F64, Device::Cpu, &mut gen)
            .unwrap()
            .to_device(GPU)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        gradcheck(|t| pool.run(&t[0]), &[x], &GradcheckOptions::default())
            .unwrap_or_else(|e| panic!("{pool:?} on {shape:?} (f64, cuda:0): {e}"));
    }
}

#[test]
fn bad_pool_arguments_give_the_cpu_error_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let cases: Vec<(Vec<usize>, DType, Pool)> = vec![
        // Rank 2, an integer dtype, a kernel larger than the padded input, padding over half
        // the kernel, a zero stride, an empty adaptive output, empty planes.
        (vec![8, 8], DType::F32, max((2, 2), (2, 2), (0, 0))),
        (vec![1, 2, 8, 8], DType::I64, max((2, 2), (2, 2), (0, 0))),
        (vec![1, 2, 3, 3], DType::F32, avg((5, 5), (1, 1), (0, 0))),
        (vec![1, 2, 8, 8], DType::F32, max((2, 2), (2, 2), (2, 2))),
        (vec![1, 2, 8, 8], DType::F32, avg((2, 2), (0, 2), (0, 0))),
        (vec![1, 2, 8, 8], DType::F32, adaptive((0, 2))),
        (vec![1, 2, 0, 8], DType::F32, max((1, 1), (1, 1), (0, 0))),
        (vec![1, 2, 0, 8], DType::F32, adaptive((1, 1))),
    ];
    for (shape, dtype, pool) in cases {
        let cpu = Tensor::zeros(&shape, dtype, Device::Cpu).unwrap();
        let want = match pool.run(&cpu) {
            Ok(_) => panic!("{pool:?} on {shape:?} {dtype}: the CPU accepted it"),
            Err(e) => e.to_string(),
        };
        let got = match pool.run(&cpu.to_device(GPU).unwrap()) {
            Ok(_) => panic!("{pool:?} on {shape:?} {dtype}: CUDA accepted it (CPU: {want})"),
            Err(e) => e.to_string(),
        };
        assert_eq!(got, want, "{pool:?} on {shape:?} {dtype}");
    }
}
