//! GPU conformance of the matrix products (`matmul`, `linear`) through cuBLAS: each against the
//! same op on the CPU on the same inputs, forward and backward, over `torch.matmul`'s shapes
//! (vectors, matrices, batches that broadcast either way or both), transposed, sliced and
//! expanded operands, empty sizes, TF32 on and off; gradcheck in f64 on the GPU; and errors
//! (mixed devices, shapes, dtypes) that must match the CPU's.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! cuBLAS sums in another order than the CPU's gemm, so f32 results agree to a tolerance that
//! grows with the magnitude of the result; a failure names the op, shapes, dtype and element.
//! Every test holds one lock, because the TF32 test changes a process-wide setting.

mod common;

use common::GPU;

use std::sync::Mutex;

use tandem_autograd::{backward, gradcheck, GradcheckOptions};
use tandem_core::cuda::blas;
use tandem_core::{DType, Device, Generator, Layout, Shape, Tensor};
use tandem_ops::{linear, matmul};

/// Held by every test: the TF32 setting is global.
static SETTINGS: Mutex<()> = Mutex::new(());

/// How an operand is laid out on the GPU.
#[derive(Clone, Copy, Debug)]
enum Layouts {
    /// Dense.
    Dense,
    /// The last two dims swapped in memory (a transposed view of a dense array).
    Transposed,
    /// Every other column of a twice-as-wide array (no unit stride: cuBLAS needs a copy).
    EveryOther,
}

fn values(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, 0.0, 1.0, dtype, Device::Cpu, &mut gen).unwrap()
}

/// A leaf on `device` holding `host`'s values in the layout `how`.
fn leaf(host: &Tensor, device: Device, how: Layouts) -> Tensor {
    let r = host.rank();
    let t = match how {
        Layouts::Transposed if r >= 2 => {
            let swapped = host
                .view_detached(host.layout().transpose("test", r - 2, r - 1).unwrap())
                .unwrap()
                .copy_detached()
                .unwrap()
                .to_device(device)
                .unwrap();
            swapped
                .view_detached(swapped.layout().transpose("test", r - 2, r - 1).unwrap())
                .unwrap()
        }
        Layouts::EveryOther => {
            // Interleave the values with zeros along the last dim, then view every other one.
            let mut wide_shape = host.dims().to_vec();
            let last = wide_shape[r - 1];
            wide_shape[r - 1] = 2 * last;
            let v = host.to_vec_f64().unwrap();
            let wide: Vec<f64> = v.iter().flat_map(|&x| [x, 0.0]).collect();
            let wide = Tensor::from_vec(wide, &wide_shape, Device::Cpu)
                .unwrap()
                .to_dtype(host.dtype())
                .unwrap()
                .to_device(device)
                .unwrap();
            let mut strides: Vec<usize> = wide.layout().strides().to_vec();
            strides[r - 1] = 2;
            wide.view_detached(Layout::from_parts(
                Shape::from_slice(host.dims()),
                strides.into_iter().collect(),
                0,
            ))
            .unwrap()
        }
        _ => host.copy_detached().unwrap().to_device(device).unwrap(),
    };
    t.with_requires_grad().unwrap()
}

fn tolerance(dtype: DType, want: &[f64]) -> f64 {
    let scale = 1.0 + want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    match dtype {
        DType::F64 => 1e-11 * scale,
        _ => 3e-5 * scale,
    }
}

/// Asserts that `got` (CUDA) matches `want` (CPU), naming the first element that differs.
fn assert_close(got: &Tensor, want: &Tensor, what: &str, tol: Option<f64>) {
    assert_eq!(got.device(), GPU, "{what}: result is not on the GPU");
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes differ");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let tol = tol.unwrap_or_else(|| tolerance(want.dtype(), &w));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what} ({:?}, {}): element {i} is {a} on CUDA, {b} on the CPU (tolerance {tol:e})",
            want.dims(),
            want.dtype()
        );
    }
}

/// Runs `f` on CPU leaves and on GPU leaves (laid out as `layouts`) holding the same values,
/// then backward from the same output gradient; compares the outputs and every input gradient.
fn compare(
    what: &str,
    shapes: &[&[usize]],
    layouts: &[Layouts],
    dtype: DType,
    seed: u64,
    f: impl Fn(&[Tensor]) -> tandem_core::Result<Tensor>,
) {
    let hosts: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| values(s, dtype, seed + i as u64))
        .collect();
    let cpu: Vec<Tensor> = hosts
        .iter()
        .map(|h| leaf(h, Device::Cpu, Layouts::Dense))
        .collect();
    let gpu: Vec<Tensor> = hosts
        .iter()
        .zip(layouts)
        .map(|(h, &how)| leaf(h, GPU, how))
        .collect();
    let what = format!("{what} {dtype} with {shapes:?} laid out {layouts:?}");
    let y_cpu = f(&cpu).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let y_gpu = f(&gpu).unwrap_or_else(|e| panic!("{what}: CUDA: {e}"));
    assert_close(&y_gpu, &y_cpu, &format!("{what}: forward"), None);
    let g = values(y_cpu.dims(), dtype, seed + 100);
    backward(&y_cpu, Some(&g), &Default::default()).unwrap();
    backward(
        &y_gpu,
        Some(&g.to_device(GPU).unwrap()),
        &Default::default(),
    )
    .unwrap_or_else(|e| panic!("{what}: CUDA backward: {e}"));
    for (i, (c, d)) in cpu.iter().zip(&gpu).enumerate() {
        let (gc, gd) = (c.grad(), d.grad());
        match (gc, gd) {
            (Some(gc), Some(gd)) => {
                assert_close(&gd, &gc, &format!("{what}: gradient of input {i}"), None)
            }
            // An input used only through a detached view has no gradient on either device.
            (None, None) => {}
            (gc, gd) => panic!(
                "{what}: input {i} has a gradient on the CPU: {}, on CUDA: {}",
                gc.is_some(),
                gd.is_some()
            ),
        }
    }
}

/// `torch.matmul`'s shapes: every kind of operand pair.
const MATMUL_SHAPES: [(&[usize], &[usize]); 14] = [
    (&[3, 4], &[4, 5]),
    (&[65, 129], &[129, 33]),
    (&[4], &[4]),
    (&[7], &[7, 3]),
    (&[5, 7], &[7]),
    (&[2, 3, 4], &[2, 4, 5]),
    (&[2, 3, 4], &[4, 5]),
    (&[4, 5], &[2, 5, 3]),
    (&[2, 1, 3, 4], &[3, 4, 2]),
    (&[2, 3, 1, 5, 4], &[3, 6, 4, 2]),
    (&[4], &[2, 4, 3]),
    (&[2, 3, 4], &[4]),
    (&[6, 17, 31], &[31, 9]),
    (&[1, 3, 4], &[5, 4, 2]),
];

#[test]
fn matmul_on_cuda_matches_the_cpu_forward_and_backward() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for (i, (a, b)) in MATMUL_SHAPES.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            compare(
                "matmul",
                &[a, b],
                &[Layouts::Dense, Layouts::Dense],
                dtype,
                10 * i as u64,
                |t| matmul(&t[0], &t[1]),
            );
        }
    }
}

#[test]
fn matmul_on_cuda_reads_transposed_and_strided_operands() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let layouts = [Layouts::Dense, Layouts::Transposed, Layouts::EveryOther];
    for (i, (a, b)) in MATMUL_SHAPES.iter().enumerate() {
        for (j, &la) in layouts.iter().enumerate() {
            for &lb in &layouts {
                compare(
                    "matmul",
                    &[a, b],
                    &[la, lb],
                    DType::F32,
                    1000 + 10 * i as u64 + j as u64,
                    |t| matmul(&t[0], &t[1]),
                );
            }
        }
    }
    // An operand expanded along the batch (stride 0; a constant, so only the other operand
    // has a gradient), and a matrix times itself transposed (both operands in one storage).
    compare(
        "matmul of an expanded operand",
        &[&[1, 3, 4], &[5, 4, 2]],
        &[Layouts::Dense, Layouts::Transposed],
        DType::F32,
        2000,
        |t| {
            let e = t[0].view_detached(t[0].layout().expand("test", &[5, 3, 4])?)?;
            matmul(&e, &t[1])
        },
    );
    compare(
        "matmul of a matrix and its transpose",
        &[&[6, 9]],
        &[Layouts::Transposed],
        DType::F64,
        2001,
        |t| matmul(&t[0], &tandem_ops::transpose(&t[0], 0, 1)?),
    );
}

#[test]
fn matmul_on_cuda_with_tf32_stays_within_tf32_rounding_and_off_matches_f32() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    assert!(!blas::allow_tf32_matmul(), "TF32 must be off by default");
    let a = values(&[96, 256], DType::F32, 3000);
    let b = values(&[256, 80], DType::F32, 3001);
    let want = matmul(&a, &b).unwrap();
    let (ga, gb) = (a.to_device(GPU).unwrap(), b.to_device(GPU).unwrap());
    blas::set_allow_tf32_matmul(true);
    let tf32 = matmul(&ga, &gb);
    blas::set_allow_tf32_matmul(false);
    let scale = 1.0
        + want
            .to_vec_f64()
            .unwrap()
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()));
    // TF32 keeps 10 mantissa bits: each product is off by about 2⁻¹¹ relative.
    assert_close(
        &tf32.unwrap(),
        &want,
        "matmul with TF32",
        Some(2e-2 * scale),
    );
    assert_close(
        &matmul(&ga, &gb).unwrap(),
        &want,
        "matmul with TF32 off again",
        None,
    );
    // f64 never uses TF32.
    let (a64, b64) = (
        a.to_dtype(DType::F64).unwrap(),
        b.to_dtype(DType::F64).unwrap(),
    );
    blas::set_allow_tf32_matmul(true);
    let got = matmul(&a64.to_device(GPU).unwrap(), &b64.to_device(GPU).unwrap());
    blas::set_allow_tf32_matmul(false);
    assert_close(
        &got.unwrap(),
        &matmul(&a64, &b64).unwrap(),
        "f64 matmul with TF32 allowed",
        None,
    );
}

#[test]
fn linear_on_cuda_matches_the_cpu_forward_and_backward() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let cases: [(&[usize], &[usize], bool); 6] = [
        (&[3, 5], &[4, 5], true),
        (&[256, 400], &[120, 400], true),
        (&[2, 3, 5], &[4, 5], true),
        (&[5], &[4, 5], true),
        (&[7, 6], &[3, 6], false),
        (&[2, 2, 3, 17], &[10, 17], true),
    ];
    let layouts = [Layouts::Dense, Layouts::Transposed, Layouts::EveryOther];
    for (i, (x, w, bias)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            for (j, &lx) in layouts.iter().enumerate() {
                let lw = layouts[(j + i) % 3];
                let seed = 4000 + 10 * i as u64 + j as u64;
                if *bias {
                    compare(
                        "linear",
                        &[x, w, &[w[0]]],
                        &[lx, lw, Layouts::Dense],
                        dtype,
                        seed,
                        |t| linear(&t[0], &t[1], Some(&t[2])),
                    );
                } else {
                    compare("linear", &[x, w], &[lx, lw], dtype, seed, |t| {
                        linear(&t[0], &t[1], None)
                    });
                }
            }
        }
    }
}

#[test]
fn empty_products_on_cuda_match_the_cpu() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // Forward and backward: zero products (k = 0), empty outputs (m, n or a batch of 0) and
    // gradients that sum over an empty batch.
    let cases: [(&[usize], &[usize]); 7] = [
        (&[2, 0], &[0, 3]),
        (&[0, 4, 3], &[3, 5]),
        (&[3, 4], &[4, 0]),
        (&[2, 0, 4], &[2, 4, 3]),
        (&[0, 4], &[4, 3]),
        (&[0], &[0]),
        (&[2, 0, 4, 3], &[3, 2]),
    ];
    for dtype in [DType::F32, DType::F64] {
        for (a, b) in cases {
            compare(
                &format!("matmul {a:?}·{b:?}"),
                &[a, b],
                &[Layouts::Dense; 2],
                dtype,
                4000,
                |t| matmul(&t[0], &t[1]),
            );
        }
    }
    // No input features: every output row is the bias, and its gradient the column sums.
    compare(
        "linear without input features",
        &[&[3, 0], &[4, 0], &[4]],
        &[Layouts::Dense; 3],
        DType::F32,
        5000,
        |t| linear(&t[0], &t[1], Some(&t[2])),
    );
    // No samples: an empty output, zero weight and bias gradients.
    compare(
        "linear of an empty batch",
        &[&[0, 5], &[4, 5], &[4]],
        &[Layouts::Dense; 3],
        DType::F32,
        5001,
        |t| linear(&t[0], &t[1], Some(&t[2])),
    );
    // No output features.
    compare(
        "linear without output features",
        &[&[3, 5], &[0, 5], &[0]],
        &[Layouts::Dense; 3],
        DType::F32,
        5002,
        |t| linear(&t[0], &t[1], Some(&t[2])),
    );
}

#[test]
fn gradcheck_matmul_and_linear_in_f64_on_cuda() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let on_gpu =
        |shape: &[usize], seed: u64, how: Layouts| leaf(&values(shape, DType::F64, seed), GPU, how);
    for (i, (a, b)) in MATMUL_SHAPES.iter().enumerate() {
        if a.iter().chain(b.iter()).product::<usize>() > 5000 {
            continue;
        }
        let how = if i % 2 == 0 {
            Layouts::Dense
        } else {
            Layouts::Transposed
        };
        let inputs = [
            on_gpu(a, 6000 + i as u64, how),
            on_gpu(b, 6100 + i as u64, Layouts::Dense),
        ];
        gradcheck(
            |t| matmul(&t[0], &t[1]),
            &inputs,
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("matmul {a:?}·{b:?} (f64, cuda:0, {how:?}): {e}"));
    }
    let inputs = [
        on_gpu(&[2, 3, 5], 6200, Layouts::Transposed),
        on_gpu(&[4, 5], 6201, Layouts::EveryOther),
        on_gpu(&[4], 6202, Layouts::Dense),
    ];
    gradcheck(
        |t| linear(&t[0], &t[1], Some(&t[2])),
        &inputs,
        &GradcheckOptions::default(),
    )
    .unwrap_or_else(|e| panic!("linear [2, 3, 5]·[4, 5]ᵀ + [4] (f64, cuda:0): {e}"));
    let inputs = [
        on_gpu(&[5], 6203, Layouts::Dense),
        on_gpu(&[3, 5], 6204, Layouts::Dense),
    ];
    gradcheck(
        |t| linear(&t[0], &t[1], None),
        &inputs,
        &GradcheckOptions::default(),
    )
    .unwrap_or_else(|e| panic!("linear [5]·[3, 5]ᵀ (f64, cuda:0): {e}"));
}

#[test]
fn bad_products_give_the_cpu_errors_on_cuda() {
    let _settings = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let z = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, Device::Cpu).unwrap();
    let both =
        |f: &dyn Fn(&[Tensor]) -> tandem_core::Result<Tensor>, inputs: Vec<Tensor>, what: &str| {
            let want = match f(&inputs) {
                Ok(_) => panic!("{what}: the CPU accepted it"),
                Err(e) => e.to_string(),
            };
            let on_gpu: Vec<Tensor> = inputs.iter().map(|t| t.to_device(GPU).unwrap()).collect();
            let got = match f(&on_gpu) {
                Ok(_) => panic!("{what}: CUDA accepted it (CPU: {want})"),
                Err(e) => e.to_string(),
            };
            assert_eq!(got, want, "{what}");
        };
    let mm = |t: &[Tensor]| matmul(&t[0], &t[1]);
    both(
        &mm,
        vec![z(&[2, 3], DType::F32), z(&[4, 5], DType::F32)],
        "inner dims differ",
    );
    both(
        &mm,
        vec![z(&[2, 3, 4], DType::F32), z(&[3, 4, 5], DType::F32)],
        "batches differ",
    );
    both(
        &mm,
        vec![z(&[2, 3], DType::F32), z(&[3, 5], DType::F64)],
        "dtypes differ",
    );
    both(
        &mm,
        vec![z(&[2, 3], DType::I64), z(&[3, 5], DType::I64)],
        "integer operands",
    );
    let lin = |t: &[Tensor]| linear(&t[0], &t[1], Some(&t[2]));
    both(
        &lin,
        vec![
            z(&[2, 3], DType::F32),
            z(&[4, 5], DType::F32),
            z(&[4], DType::F32),
        ],
        "linear weight does not fit",
    );
    both(
        &lin,
        vec![
            z(&[2, 3], DType::F32),
            z(&[4, 3], DType::F32),
            z(&[5], DType::F32),
        ],
        "linear bias does not fit",
    );
    // Operands on two devices: an error naming both, never a read of the wrong memory.
    let a = z(&[2, 3], DType::F32).to_device(GPU).unwrap();
    let b = z(&[3, 4], DType::F32);
    for (what, result) in [
        ("matmul cuda·cpu", matmul(&a, &b)),
        ("matmul cpu·cuda", matmul(&z(&[4, 2], DType::F32), &a)),
        (
            "linear with a CPU weight",
            linear(&a, &z(&[4, 3], DType::F32), None),
        ),
    ] {
        let err = match result {
            Ok(_) => panic!("{what}: ran across devices"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("cpu") && err.contains("cuda:0"),
            "{what}: {err}"
        );
    }
}
