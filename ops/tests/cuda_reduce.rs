//! GPU conformance of the reductions and of softmax/log_softmax: `sum`, `mean`, `max`,
//! `argmax`, `softmax`, `log_softmax` on CUDA against the same ops on the CPU with the same
//! inputs, forward and backward (f32, within rounding), over every kernel plan (warp rows,
//! block rows, column sums, the two-pass sum, softmax over rows and over columns) and strided
//! inputs; `gradcheck` in f64 on the GPU; and the CPU's errors for bad arguments.
//!
//! Each test prints `skipped: no CUDA device` without a GPU. Failure messages name the op, the
//! case, the dtype and the first differing element.

use tandem_autograd::{gradcheck, BackwardOptions, GradcheckOptions, TensorBackward};
use tandem_core::{cuda, DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);

fn gpu() -> bool {
    if cuda::is_available() {
        true
    } else {
        println!("skipped: no CUDA device");
        false
    }
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn(shape, 0.0, 2.0, dtype, Device::Cpu, &mut g).unwrap()
}

/// A CPU tensor and its copy on the GPU (a transposed view of both when `transpose`), leaves
/// that require grad.
fn pair(shape: &[usize], dtype: DType, seed: u64, transpose: bool) -> (Tensor, Tensor) {
    let base = randn(shape, dtype, seed);
    let cpu = base.copy_detached().unwrap();
    let gpu = base.to_device(GPU).unwrap();
    let view = |t: Tensor| {
        let t = if transpose && t.rank() >= 2 {
            let r = t.rank();
            t.view_detached(t.layout().transpose("test", 0, r - 1).unwrap())
                .unwrap()
        } else {
            t
        };
        t.with_requires_grad().unwrap()
    };
    (view(cpu), view(gpu))
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.device(), GPU, "{what}: the result stays on the GPU");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let g = got.to_vec_f64().unwrap();
    let w = want.to_vec_f64().unwrap();
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        assert!(
            ok,
            "{what}: element {i} is {a} on the GPU, {b} on the CPU (shape {:?})",
            want.dims()
        );
    }
}

/// Runs `f` on both devices, compares outputs, then backward with the same output gradient
/// and compares the input gradients.
fn compare(
    what: &str,
    shape: &[usize],
    transpose: bool,
    f: impl Fn(&Tensor) -> tandem_core::Result<Tensor>,
) {
    for dtype in [DType::F32, DType::F64] {
        let what = format!("{what} {dtype} {shape:?} transposed {transpose}");
        let (c, g) = pair(shape, dtype, 5, transpose);
        let (yc, yg) = (f(&c).unwrap(), f(&g).unwrap());
        assert_close(&yg, &yc, &what);
        let grad = randn(yc.dims(), dtype, 9);
        yc.backward_with(Some(&grad), &BackwardOptions::default())
            .unwrap();
        yg.backward_with(
            Some(&grad.to_device(GPU).unwrap()),
            &BackwardOptions::default(),
        )
        .unwrap();
        assert_close(
            &g.grad().unwrap(),
            &c.grad().unwrap(),
            &format!("{what}: input gradient"),
        );
    }
}

const SHAPES: [&[usize]; 6] = [
    &[37],
    &[5, 1300],
    &[7, 33],
    &[3, 4, 5],
    &[2, 3, 4, 5],
    &[0, 4],
];

#[test]
fn sum_and_mean_match_the_cpu_forward_and_backward() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let rank = shape.len() as isize;
        let mut dim_sets: Vec<Vec<isize>> = vec![vec![], vec![0], vec![-1]];
        if rank >= 3 {
            dim_sets.extend([vec![1], vec![0, 2], vec![0, 1]]);
        }
        for dims in &dim_sets {
            for keepdim in [false, true] {
                for transpose in [false, true] {
                    let what = format!("sum over {dims:?} keepdim {keepdim}");
                    compare(&what, shape, transpose, |x| {
                        tandem_ops::sum(x, dims, keepdim)
                    });
                    if shape.iter().product::<usize>() > 0 {
                        let what = format!("mean over {dims:?} keepdim {keepdim}");
                        compare(&what, shape, transpose, |x| {
                            tandem_ops::mean(x, dims, keepdim)
                        });
                    }
                }
            }
        }
    }
    // One long row: the two-pass sum.
    compare("sum of everything", &[300, 700], false, tandem_ops::sum_all);
    compare(
        "mean of everything",
        &[300, 700],
        true,
        tandem_ops::mean_all,
    );
}

#[test]
fn max_and_argmax_match_the_cpu() {
    if !gpu() {
        return;
    }
    for shape in [&[37][..], &[5, 1300], &[7, 33], &[3, 4, 5]] {
        for dims in [vec![0isize], vec![-1], vec![]] {
            for transpose in [false, true] {
                let what = format!("max over {dims:?}");
                compare(&what, shape, transpose, |x| {
                    tandem_ops::max(x, &dims, false)
                });
            }
        }
        let (c, g) = pair(shape, DType::F32, 3, false);
        let a = tandem_ops::argmax(&g, -1, false).unwrap();
        assert_eq!(a.dtype(), DType::I64);
        assert_eq!(
            a.to_vec::<i64>().unwrap(),
            tandem_ops::argmax(&c, -1, false)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            "argmax {shape:?}"
        );
    }
    // Ties go to the first maximum, NaN wins, on both devices.
    let x = Tensor::from_vec(
        vec![1.0f32, 3.0, 3.0, f32::NAN, 2.0, 5.0],
        &[2, 3],
        Device::Cpu,
    )
    .unwrap()
    .to_device(GPU)
    .unwrap();
    let x = x.with_requires_grad().unwrap();
    let m = tandem_ops::max(&x, &[1], false).unwrap();
    let v = m.to_vec::<f32>().unwrap();
    assert_eq!(v[0], 3.0);
    assert!(v[1].is_nan());
    tandem_ops::sum_all(&m).unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    );
}

#[test]
fn softmax_and_log_softmax_match_the_cpu() {
    if !gpu() {
        return;
    }
    for shape in [&[4, 10][..], &[3, 1500], &[3, 4, 5], &[64, 10], &[0, 3]] {
        for dim in [0isize, -1] {
            for transpose in [false, true] {
                compare(&format!("softmax dim {dim}"), shape, transpose, |x| {
                    tandem_ops::softmax(x, dim)
                });
                compare(&format!("log_softmax dim {dim}"), shape, transpose, |x| {
                    tandem_ops::log_softmax(x, dim)
                });
            }
        }
    }
    // Large logits stay finite.
    let x = Tensor::from_vec(
        vec![1000.0f32, 1001.0, 1002.0, -1000.0],
        &[2, 2],
        Device::Cpu,
    )
    .unwrap()
    .to_device(GPU)
    .unwrap();
    let y = tandem_ops::log_softmax(&x, 1)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
}

/// A function of the gradcheck inputs.
type OpOfInputs = dyn Fn(&[Tensor]) -> tandem_core::Result<Tensor>;

#[test]
fn gradcheck_in_f64_on_the_gpu() {
    if !gpu() {
        return;
    }
    let opts = GradcheckOptions::default();
    let x = randn(&[3, 4, 5], DType::F64, 1)
        .to_device(GPU)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let checks: Vec<(&str, Box<OpOfInputs>)> = vec![
        ("sum [1]", Box::new(|t| tandem_ops::sum(&t[0], &[1], false))),
        (
            "sum [0, 2]",
            Box::new(|t| tandem_ops::sum(&t[0], &[0, 2], true)),
        ),
        (
            "mean [-1]",
            Box::new(|t| tandem_ops::mean(&t[0], &[-1], false)),
        ),
        ("max [1]", Box::new(|t| tandem_ops::max(&t[0], &[1], false))),
        ("softmax 1", Box::new(|t| tandem_ops::softmax(&t[0], 1))),
        ("softmax -1", Box::new(|t| tandem_ops::softmax(&t[0], -1))),
        (
            "log_softmax 0",
            Box::new(|t| tandem_ops::log_softmax(&t[0], 0)),
        ),
        (
            "log_softmax -1",
            Box::new(|t| tandem_ops::log_softmax(&t[0], -1)),
        ),
    ];
    for (name, f) in checks {
        gradcheck(f, std::slice::from_ref(&x), &opts)
            .unwrap_or_else(|e| panic!("gradcheck of {name} on the GPU: {e}"));
    }
}

#[test]
fn bad_arguments_give_the_cpu_errors() {
    if !gpu() {
        return;
    }
    let (c, g) = pair(&[2, 3], DType::F32, 1, false);
    for (what, cpu, gpu) in [
        (
            "sum dim",
            tandem_ops::sum(&c, &[2], false),
            tandem_ops::sum(&g, &[2], false),
        ),
        (
            "sum twice",
            tandem_ops::sum(&c, &[0, 0], false),
            tandem_ops::sum(&g, &[0, 0], false),
        ),
        (
            "max dim",
            tandem_ops::max(&c, &[5], false),
            tandem_ops::max(&g, &[5], false),
        ),
        (
            "softmax dim",
            tandem_ops::softmax(&c, 2),
            tandem_ops::softmax(&g, 2),
        ),
    ] {
        assert_eq!(
            gpu.unwrap_err().to_string(),
            cpu.unwrap_err().to_string(),
            "{what}"
        );
    }
    let empty = Tensor::zeros(&[3, 0], DType::F32, GPU).unwrap();
    let err = tandem_ops::max(&empty, &[1], false)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("max:") && err.contains("[3, 0]"), "{err}");
    let labels = Tensor::zeros(&[3], DType::I64, GPU).unwrap();
    assert!(tandem_ops::sum(&labels, &[0], false).is_err());
}
