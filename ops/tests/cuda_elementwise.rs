//! GPU conformance of the elementwise ops, cat, the views and dropout: every op forward and
//! backward on a CUDA device against the same op on the CPU with the same inputs (f32 and f64,
//! contiguous, transposed and broadcast inputs, odd and empty sizes), `gradcheck` in f64 on the
//! device, dropout masks equal to the CPU's for the same seed, and the errors of mixed devices
//! and bad shapes.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! Add, sub, mul, div, neg, relu, sqrt, integer powers, cat, the views and dropout compute the
//! CPU's IEEE operations and agree to the last bit. What does not (see `common/tolerance.rs`):
//! the gradient of a broadcast input is a sum, added in another order on each device (within a
//! bound from the number of terms and Σ|x|); exp, log, sigmoid, tanh and fractional powers use
//! CUDA's math library and agree within a few ulp, and the backward of sigmoid and tanh within a
//! bound relative to the gradient and the saved output (cancellation near saturation). Failure
//! messages name the op, the shapes, the dtype and the first differing elements.

mod common;

use common::tolerance::{sigmoid_backward_bound, sum_order_bound, tanh_backward_bound};
use common::{assert_ulps, assert_within, broadcast_sums, epsilon, values, GPU};
use tandem_autograd::{gradcheck, GradcheckOptions};
use tandem_core::{DType, Device, Generator, Result, Tensor};
use tandem_ops as ops;

/// Normal values of `shape` and `dtype` on the CPU.
fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(
        shape,
        0.0,
        1.0,
        dtype,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
}

/// Uniform values in `[lo, hi)` of `shape` and `dtype` on the CPU.
fn uniform(shape: &[usize], lo: f64, hi: f64, dtype: DType, seed: u64) -> Tensor {
    Tensor::rand(shape, lo, hi, dtype, Device::Cpu, &mut Generator::new(seed)).unwrap()
}

/// A copy of `t` (same logical values and the same kind of layout: a transposed view stays
/// transposed) on `device`.
fn on(t: &Tensor, device: Device) -> Tensor {
    if t.is_contiguous() {
        return t.copy_detached().unwrap().to_device(device).unwrap();
    }
    // Rebuild the transposed view on the device: transpose back, copy, transpose again.
    let r = t.rank();
    let back = t
        .view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap()
        .copy_detached()
        .unwrap()
        .to_device(device)
        .unwrap();
    back.view_detached(back.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap()
}

/// `t` transposed in its last two dims as a view of a contiguous tensor with those dims swapped
/// (a strided input with the same logical values as `t`).
fn strided(t: &Tensor) -> Tensor {
    let r = t.rank();
    let swapped = t
        .view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap()
        .copy_detached()
        .unwrap();
    let view = swapped
        .view_detached(swapped.layout().transpose("test", r - 2, r - 1).unwrap())
        .unwrap();
    assert!(!view.is_contiguous() || t.numel() <= 1);
    view
}

fn leaf(t: &Tensor, device: Device) -> Tensor {
    on(t, device).with_requires_grad().unwrap()
}

/// Runs backward from `y` with the output gradient `g` (moved to `y`'s device).
fn backward(y: &Tensor, g: &Tensor) {
    let g = on(g, y.device());
    tandem_autograd::backward(y, Some(&g), &Default::default()).unwrap();
}

fn grad(t: &Tensor, what: &str) -> Tensor {
    t.grad()
        .unwrap_or_else(|| panic!("{what}: no gradient on {}", t.device()))
}

const DTYPES: [DType; 2] = [DType::F32, DType::F64];

// ---- binary ------------------------------------------------------------------------------------

type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;

const BINARY: [(&str, Binary); 5] = [
    ("add", ops::add),
    ("sub", ops::sub),
    ("mul", ops::mul),
    ("div", ops::div),
    ("add_relu", ops::add_relu),
];

/// Runs `f` on both devices with leaves holding `a` and `b`, compares the outputs and, after a
/// backward with the same output gradient, both gradients. The gradient of an input that was
/// broadcast is a sum over the broadcast dims, which the devices add in different orders: it
/// is compared within [`sum_order_bound`] of its terms (see [`broadcast_gradient_bounds`]);
/// everything else bit for bit.
fn compare_binary(name: &str, f: Binary, a: &Tensor, b: &Tensor, seed: u64) {
    let what = format!("{name} a {:?} b {:?}", a.dims(), b.dims());
    let (ca, cb) = (leaf(a, Device::Cpu), leaf(b, Device::Cpu));
    let (ga, gb) = (leaf(a, GPU), leaf(b, GPU));
    let want = f(&ca, &cb).unwrap();
    let got = f(&ga, &gb).unwrap_or_else(|e| panic!("{what} on {GPU}: {e}"));
    assert_eq!(got.device(), GPU, "{what}: output device");
    assert_ulps(&got, &want, 0.0, &format!("{what} forward"));
    let g = randn(want.dims(), want.dtype(), seed);
    backward(&want, &g);
    backward(&got, &g);
    let [bound_a, bound_b] = broadcast_gradient_bounds(f, a, b, &g);
    assert_within(
        &grad(&ga, &what),
        &grad(&ca, &what),
        &bound_a,
        &format!("{what} grad a"),
    );
    assert_within(
        &grad(&gb, &what),
        &grad(&cb, &what),
        &bound_b,
        &format!("{what} grad b"),
    );
}

/// For each input of `f(a, b)` with output gradient `g`: per element of the input, how far the
/// devices' gradients may be apart. The terms each gradient element sums are the gradient of
/// that input expanded to the output's shape (computed on the CPU with both inputs expanded
/// and made contiguous, so that nothing is summed); an input that was not broadcast has one
/// term per element and a bound of 0.
fn broadcast_gradient_bounds(f: Binary, a: &Tensor, b: &Tensor, g: &Tensor) -> [Vec<f64>; 2] {
    let shape = g.dims();
    let expanded = |t: &Tensor| {
        t.view_detached(t.layout().expand("test", shape).unwrap())
            .unwrap()
            .copy_detached()
            .unwrap()
            .with_requires_grad()
            .unwrap()
    };
    let (ea, eb) = (expanded(a), expanded(b));
    backward(&f(&ea, &eb).unwrap(), g);
    let eps = epsilon(g.dtype());
    [(a, &ea), (b, &eb)].map(|(input, full)| {
        let (len, abs_sums) = broadcast_sums(&grad(full, "expanded input"), input.dims());
        abs_sums
            .iter()
            .map(|&s| sum_order_bound(len, s, eps))
            .collect()
    })
}

#[test]
fn binary_ops_match_the_cpu_forward_and_backward_on_same_shape_inputs() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        for (i, shape) in [&[37][..], &[64, 65], &[2, 3, 129], &[1], &[0, 3]]
            .iter()
            .enumerate()
        {
            let a = randn(shape, dtype, 10 + i as u64);
            // divisors away from 0
            let b = uniform(shape, 0.5, 2.0, dtype, 20 + i as u64);
            for (name, f) in BINARY {
                compare_binary(name, f, &a, &b, 30);
                if shape.len() >= 2 {
                    compare_binary(name, f, &strided(&a), &b, 31);
                    compare_binary(name, f, &a, &strided(&b), 32);
                }
            }
        }
    }
}

/// The backward of a broadcast input sums the gradient over the broadcast dims (`sum` on the
/// device).
#[test]
fn binary_ops_match_the_cpu_forward_and_backward_with_broadcasting() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        for (i, (sa, sb)) in [
            (&[4, 1, 5][..], &[3, 5][..]),
            (&[64, 65], &[65]),
            (&[7, 1], &[1, 9]),
            (&[33], &[1]),
            (&[2, 3], &[]),
            // Empty outputs: the broadcast input's gradient sums no terms, zeros on both.
            (&[0, 3], &[3]),
            (&[2, 0], &[2, 1]),
        ]
        .iter()
        .enumerate()
        {
            let a = randn(sa, dtype, 40 + i as u64);
            let b = uniform(sb, 0.5, 2.0, dtype, 50 + i as u64);
            for (name, f) in BINARY {
                compare_binary(name, f, &a, &b, 60);
                compare_binary(name, f, &b, &a.abs_for_test(), 61);
            }
        }
    }
}

/// `|t|` + 0.5, elementwise, on the CPU (for divisors).
trait AbsForTest {
    fn abs_for_test(&self) -> Tensor;
}

impl AbsForTest for Tensor {
    fn abs_for_test(&self) -> Tensor {
        let t = self.copy_detached().unwrap();
        t.map_inplace_f64("test", |v| v.abs() + 0.5).unwrap();
        t
    }
}

#[test]
fn scalar_ops_match_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        let x = randn(&[129, 3], dtype, 70);
        let empty = randn(&[0, 3], dtype, 72);
        for input in [x.clone(), strided(&x), empty.clone(), strided(&empty)] {
            for c in [0.3, -2.5, 1e10] {
                for (name, f) in [
                    (
                        "add_scalar",
                        ops::add_scalar as fn(&Tensor, f64) -> Result<Tensor>,
                    ),
                    ("mul_scalar", ops::mul_scalar),
                ] {
                    let what = format!("{name}({c}) x {:?}", input.dims());
                    let (cx, gx) = (leaf(&input, Device::Cpu), leaf(&input, GPU));
                    let want = f(&cx, c).unwrap();
                    let got = f(&gx, c).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_ulps(&got, &want, 0.0, &what);
                    let g = randn(want.dims(), dtype, 71);
                    backward(&want, &g);
                    backward(&got, &g);
                    assert_ulps(&grad(&gx, &what), &grad(&cx, &what), 0.0, &what);
                }
            }
        }
    }
}

// ---- unary -------------------------------------------------------------------------------------

type Unary = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

/// How a unary op's input gradient on the device may differ from the CPU's.
#[derive(Clone, Copy, Debug)]
enum BackwardBound {
    /// The same IEEE operations on the same values: bit for bit.
    Exact,
    /// Within this many ulp of the CPU's result.
    Ulps(f64),
    /// [`sigmoid_backward_bound`] of the gradient and the saved output.
    Sigmoid,
    /// [`tanh_backward_bound`] of the gradient and the saved output.
    Tanh,
}

/// A unary op under test.
struct UnaryCase {
    name: String,
    f: Unary,
    /// How far the forward may be from the CPU's, in ulp of the result (0: bit for bit).
    forward_ulps: f64,
    backward: BackwardBound,
    needs_positive: bool,
}

fn unary(
    name: &str,
    f: Unary,
    forward_ulps: f64,
    backward: BackwardBound,
    needs_positive: bool,
) -> UnaryCase {
    UnaryCase {
        name: name.into(),
        f,
        forward_ulps,
        backward,
        needs_positive,
    }
}

/// Every unary op with its tolerances. The math library's bounds (CUDA Math API appendix:
/// expf 2 ulp, logf 1, tanhf 2, powf 4; exp 1, log 1, tanh 2, pow 2 in f64; tandem's CPU f32
/// exp 2 ulp, the C library's under 1 ulp for log and pow and 2 for tanh) add up to at most 4
/// ulp between the devices for exp, log and tanh and 5 for pow. sigmoid is `1 / (1 + e^−x)`: the
/// 4 ulp of e^−x, then one rounding each of the sum and the quotient on each side: 6. The
/// backward reads the saved output for exp, sqrt, relu, sigmoid and tanh and the input for log
/// and pow: exp's `g·y` inherits the forward's ulps plus one rounding; log's `g / x`, sqrt's
/// `(½·g) / y` (sqrt is correctly rounded on both devices), relu's and integer powers' are the
/// same IEEE operations on the same values; a fractional power's `(g·p)·x^(p−1)` calls pow
/// (5 ulp) and rounds once more (8 with headroom) — pow_scalar(0.5) included, whose forward is
/// an exact sqrt but whose backward is `x^−½`.
fn unary_ops() -> Vec<UnaryCase> {
    use BackwardBound::{Exact, Sigmoid, Tanh, Ulps};
    let mut v = vec![
        unary("neg", Box::new(ops::neg), 0.0, Exact, false),
        unary("exp", Box::new(ops::exp), 4.0, Ulps(5.0), false),
        unary("log", Box::new(ops::log), 4.0, Exact, true),
        unary("sqrt", Box::new(ops::sqrt), 0.0, Exact, true),
        unary("relu", Box::new(ops::relu), 0.0, Exact, false),
        unary("sigmoid", Box::new(ops::sigmoid), 6.0, Sigmoid, false),
        unary("tanh", Box::new(ops::tanh), 4.0, Tanh, false),
    ];
    for p in [2.0, 0.5, 3.0, -2.0, 0.0, 1.0, 1.7, -0.3] {
        // The forward is exact for squares, square roots and integer powers; the backward for
        // p ∈ {0, 1, 2} and an integer p − 1.
        let forward_ulps = if p == 0.5 || f64::fract(p) == 0.0 {
            0.0
        } else {
            8.0
        };
        let backward = if f64::fract(p) == 0.0 {
            Exact
        } else {
            Ulps(8.0)
        };
        v.push(unary(
            &format!("pow_scalar({p})"),
            Box::new(move |x| ops::pow_scalar(x, p)),
            forward_ulps,
            backward,
            f64::fract(p) != 0.0,
        ));
    }
    v
}

/// The bound of each element of a unary op's input gradient, from the output gradient `g` and
/// the CPU's forward output `y` (logical order, like the gradients).
fn unary_backward_bounds(case: &UnaryCase, g: &Tensor, y: &Tensor) -> Vec<f64> {
    let eps = epsilon(y.dtype());
    let (g, y) = (values(g), values(y));
    let f = case.forward_ulps;
    g.iter()
        .zip(&y)
        .map(|(&g, &y)| match case.backward {
            BackwardBound::Sigmoid => sigmoid_backward_bound(g, y, f, eps),
            BackwardBound::Tanh => tanh_backward_bound(g, y, f, eps),
            // assert_ulps covers these.
            BackwardBound::Exact | BackwardBound::Ulps(_) => 0.0,
        })
        .collect()
}

#[test]
fn unary_ops_match_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        for (i, shape) in [&[37][..], &[64, 65], &[3, 5, 130], &[0], &[4, 0, 3]]
            .iter()
            .enumerate()
        {
            // Normal values reach |x| ≈ 4, where tanh and sigmoid saturate in f32.
            let signed = randn(shape, dtype, 80 + i as u64);
            let positive = uniform(shape, 0.1, 3.0, dtype, 90 + i as u64);
            for case in unary_ops() {
                let x = if case.needs_positive {
                    &positive
                } else {
                    &signed
                };
                let mut inputs = vec![x.clone()];
                if shape.len() >= 2 {
                    inputs.push(strided(x));
                }
                for input in inputs {
                    let what = format!(
                        "{} x {:?}{}",
                        case.name,
                        input.dims(),
                        if input.is_contiguous() {
                            ""
                        } else {
                            " (transposed)"
                        }
                    );
                    let (cx, gx) = (leaf(&input, Device::Cpu), leaf(&input, GPU));
                    let want = (case.f)(&cx).unwrap();
                    let got = (case.f)(&gx).unwrap_or_else(|e| panic!("{what} on {GPU}: {e}"));
                    assert_ulps(&got, &want, case.forward_ulps, &format!("{what} forward"));
                    let g = randn(want.dims(), dtype, 100);
                    backward(&want, &g);
                    backward(&got, &g);
                    let (got_grad, want_grad) = (grad(&gx, &what), grad(&cx, &what));
                    let what = format!("{what} backward");
                    match case.backward {
                        BackwardBound::Exact => assert_ulps(&got_grad, &want_grad, 0.0, &what),
                        BackwardBound::Ulps(u) => assert_ulps(&got_grad, &want_grad, u, &what),
                        BackwardBound::Sigmoid | BackwardBound::Tanh => {
                            let bounds = unary_backward_bounds(&case, &g, &want);
                            assert_within(&got_grad, &want_grad, &bounds, &what)
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn relu_keeps_nan_and_zeroes_negatives_on_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = Tensor::from_vec(vec![-2.0f32, -0.0, 0.5, f32::NAN, 0.0], &[5], GPU).unwrap();
    let y = ops::relu(&x).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(&y[..3], &[0.0, 0.0, 0.5], "relu on {GPU}: {y:?}");
    assert!(y[3].is_nan(), "relu(NaN) on {GPU}: {}", y[3]);
}

// ---- gradcheck on the device -------------------------------------------------------------------

fn gradcheck_gpu(what: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    let inputs: Vec<Tensor> = inputs.iter().map(|t| leaf(t, GPU)).collect();
    gradcheck(f, &inputs, &GradcheckOptions::default())
        .unwrap_or_else(|e| panic!("gradcheck of {what} on {GPU} in f64: {e}"));
}

#[test]
fn gradcheck_every_op_in_f64_on_the_device() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let a = randn(&[3, 4], DType::F64, 110);
    let b = uniform(&[3, 4], 0.5, 2.0, DType::F64, 111);
    for (name, f) in BINARY {
        // add_relu has a kink at 0: keep the sum away from it.
        let (x, y) = if name == "add_relu" {
            (a.abs_for_test(), b.clone())
        } else {
            (a.clone(), b.clone())
        };
        gradcheck_gpu(name, |t| f(&t[0], &t[1]), &[x.clone(), y.clone()]);
        gradcheck_gpu(name, |t| f(&t[0], &t[1]), &[strided(&x), y]);
    }
    gradcheck_gpu(
        "broadcast mul",
        |t| ops::mul(&t[0], &t[1]),
        &[
            randn(&[3, 1], DType::F64, 112),
            randn(&[1, 4], DType::F64, 113),
        ],
    );
    gradcheck_gpu(
        "add_scalar",
        |t| ops::add_scalar(&t[0], 0.7),
        std::slice::from_ref(&a),
    );
    gradcheck_gpu(
        "mul_scalar",
        |t| ops::mul_scalar(&t[0], -1.3),
        std::slice::from_ref(&a),
    );
    let positive = uniform(&[3, 4], 0.3, 2.0, DType::F64, 114);
    for UnaryCase {
        name,
        f,
        needs_positive,
        ..
    } in unary_ops()
    {
        let x = if needs_positive || name == "relu" {
            // relu: away from its kink
            positive.clone()
        } else {
            a.clone()
        };
        gradcheck_gpu(&name, |t| f(&t[0]), std::slice::from_ref(&x));
        gradcheck_gpu(&name, |t| f(&t[0]), &[strided(&x)]);
    }
    gradcheck_gpu(
        "cat",
        |t| ops::cat(&[&t[0], &t[1]], 1),
        &[
            randn(&[2, 3], DType::F64, 115),
            randn(&[2, 5], DType::F64, 116),
        ],
    );
    gradcheck_gpu(
        "dropout",
        |t| ops::dropout(&t[0], 0.3, true, &mut Generator::new(117)),
        std::slice::from_ref(&a),
    );
}

// ---- cat ---------------------------------------------------------------------------------------

#[test]
fn cat_matches_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        let cases: Vec<(Vec<Tensor>, isize)> = vec![
            (
                vec![
                    randn(&[2, 3, 4], dtype, 120),
                    randn(&[2, 1, 4], dtype, 121),
                    randn(&[2, 5, 4], dtype, 122),
                ],
                1,
            ),
            (
                vec![randn(&[1, 33], dtype, 123), randn(&[3, 33], dtype, 124)],
                0,
            ),
            (
                vec![randn(&[4, 3], dtype, 125), randn(&[4, 0], dtype, 126)],
                -1,
            ),
            // Nothing but empty parts: an empty output and empty gradients.
            (
                vec![randn(&[0, 3], dtype, 130), randn(&[0, 2], dtype, 131)],
                1,
            ),
            (
                vec![randn(&[0, 3], dtype, 132), randn(&[0, 3], dtype, 133)],
                0,
            ),
            (
                vec![
                    strided(&randn(&[6, 5], dtype, 127)),
                    randn(&[6, 2], dtype, 128),
                ],
                1,
            ),
        ];
        for (parts, dim) in cases {
            let shapes: Vec<&[usize]> = parts.iter().map(|t| t.dims()).collect();
            let what = format!("cat {shapes:?} along {dim}");
            let cpu: Vec<Tensor> = parts.iter().map(|t| leaf(t, Device::Cpu)).collect();
            let dev: Vec<Tensor> = parts.iter().map(|t| leaf(t, GPU)).collect();
            let want = ops::cat(&cpu.iter().collect::<Vec<_>>(), dim).unwrap();
            let got = ops::cat(&dev.iter().collect::<Vec<_>>(), dim)
                .unwrap_or_else(|e| panic!("{what} on {GPU}: {e}"));
            assert_ulps(&got, &want, 0.0, &format!("{what} forward"));
            let g = randn(want.dims(), dtype, 129);
            backward(&want, &g);
            backward(&got, &g);
            for (i, (d, c)) in dev.iter().zip(&cpu).enumerate() {
                let what = format!("{what} grad of part {i}");
                assert_ulps(&grad(d, &what), &grad(c, &what), 0.0, &what);
            }
        }
    }
    // Integer tensors join too.
    let l = Tensor::from_vec(vec![3i64, 1], &[2], GPU).unwrap();
    let m = Tensor::from_vec(vec![7i64], &[1], GPU).unwrap();
    assert_eq!(
        ops::cat(&[&l, &m], 0).unwrap().to_vec::<i64>().unwrap(),
        vec![3, 1, 7],
        "cat of i64 tensors on {GPU}"
    );
}

// ---- views -------------------------------------------------------------------------------------

#[test]
fn views_match_the_cpu_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    type View = Box<dyn Fn(&Tensor) -> Result<Tensor>>;
    let views: Vec<(&str, View)> = vec![
        ("reshape", Box::new(|x| ops::reshape(x, &[5, -1]))),
        ("transpose", Box::new(|x| ops::transpose(x, 0, 2))),
        ("permute", Box::new(|x| ops::permute(x, &[2, 0, 1]))),
        ("narrow", Box::new(|x| ops::narrow(x, 1, 1, 2))),
        (
            "expand",
            Box::new(|x| ops::expand(&ops::narrow(x, 1, 0, 1)?, &[6, 2, 3, 5])),
        ),
        (
            "squeeze",
            Box::new(|x| ops::squeeze(&ops::narrow(x, 1, 1, 1)?, 1)),
        ),
        ("unsqueeze", Box::new(|x| ops::unsqueeze(x, 1))),
        ("flatten", Box::new(|x| ops::flatten(x, 0, 1))),
        (
            "contiguous",
            Box::new(|x| ops::contiguous(&ops::transpose(x, 0, 2)?)),
        ),
    ];
    for dtype in DTYPES {
        let x = randn(&[2, 3, 5], dtype, 130);
        // An empty input of the same rank, through the views that need no element of dim 1.
        let empty = randn(&[6, 0, 5], dtype, 132);
        let for_empty = ["transpose", "permute", "unsqueeze", "flatten", "contiguous"];
        for input in [x.clone(), strided(&x), empty.clone(), strided(&empty)] {
            for (name, f) in views
                .iter()
                .filter(|(name, _)| input.numel() > 0 || for_empty.contains(name))
            {
                let what = format!(
                    "{name} of {:?}{}",
                    input.dims(),
                    if input.is_contiguous() {
                        ""
                    } else {
                        " (transposed)"
                    }
                );
                let (cx, gx) = (leaf(&input, Device::Cpu), leaf(&input, GPU));
                let want = f(&cx).unwrap();
                let got = f(&gx).unwrap_or_else(|e| panic!("{what} on {GPU}: {e}"));
                assert_ulps(&got, &want, 0.0, &format!("{what} forward"));
                let g = randn(want.dims(), dtype, 131);
                backward(&want, &g);
                backward(&got, &g);
                if *name == "expand" {
                    // expand's backward sums the gradient over the broadcast dims (18 terms an
                    // element of the narrowed window [2, 1, 5]) in the reduction's order on the
                    // device: within the summation bound there, exactly 0 elsewhere.
                    let (len, abs_sums) = broadcast_sums(&g, &[2, 1, 5]);
                    let eps = epsilon(dtype);
                    let bounds: Vec<f64> = (0..input.numel())
                        .map(|flat| {
                            let (i, j, k) = (flat / 15, flat / 5 % 3, flat % 5);
                            if j == 0 {
                                sum_order_bound(len, abs_sums[i * 5 + k], eps)
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    assert_within(
                        &grad(&gx, &what),
                        &grad(&cx, &what),
                        &bounds,
                        &format!("{what} grad"),
                    );
                    continue;
                }
                assert_ulps(
                    &grad(&gx, &what),
                    &grad(&cx, &what),
                    0.0,
                    &format!("{what} grad"),
                );
            }
        }
    }
}

// ---- dropout -----------------------------------------------------------------------------------

#[test]
fn dropout_draws_the_cpu_mask_for_the_same_seed_forward_and_backward() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in DTYPES {
        // No zeros in the input, so the output is zero exactly where an element was dropped.
        let x = uniform(&[257, 129], 1.0, 2.0, dtype, 140);
        let empty = uniform(&[0, 129], 1.0, 2.0, dtype, 145);
        let empty_middle = uniform(&[3, 0, 2], 1.0, 2.0, dtype, 146);
        for input in [
            x.clone(),
            strided(&x),
            empty.clone(),
            strided(&empty),
            empty_middle,
        ] {
            for p in [0.1, 0.5, 0.9] {
                let what = format!("dropout p {p} x {:?} {dtype}", input.dims());
                let (cx, gx) = (leaf(&input, Device::Cpu), leaf(&input, GPU));
                let want = ops::dropout(&cx, p, true, &mut Generator::new(141)).unwrap();
                let got = ops::dropout(&gx, p, true, &mut Generator::new(141))
                    .unwrap_or_else(|e| panic!("{what} on {GPU}: {e}"));
                assert_ulps(&got, &want, 0.0, &format!("{what} forward (the mask)"));
                let g = randn(want.dims(), dtype, 142);
                backward(&want, &g);
                backward(&got, &g);
                assert_ulps(
                    &grad(&gx, &what),
                    &grad(&cx, &what),
                    0.0,
                    &format!("{what} grad"),
                );
            }
        }
    }
    // The generator advances: two draws give different masks; eval mode is the identity.
    let x = uniform(&[1000], 1.0, 2.0, DType::F32, 143)
        .to_device(GPU)
        .unwrap();
    let mut gen = Generator::new(144);
    let first = ops::dropout(&x, 0.5, true, &mut gen)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let second = ops::dropout(&x, 0.5, true, &mut gen)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_ne!(
        first, second,
        "dropout on {GPU}: two draws gave the same mask"
    );
    let dropped = first.iter().filter(|&&v| v == 0.0).count();
    assert!(
        (400..600).contains(&dropped),
        "dropout p 0.5 on {GPU} dropped {dropped} of 1000"
    );
    assert!(ops::dropout(&x, 0.5, false, &mut gen)
        .unwrap()
        .same_tensor(&x));
}

// ---- errors ------------------------------------------------------------------------------------

/// The error text of `r`, which must be an error.
fn err(r: Result<Tensor>, what: &str) -> String {
    match r {
        Ok(t) => panic!(
            "{what}: expected an error, got a tensor of shape {:?}",
            t.dims()
        ),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mixed_devices_and_bad_shapes_are_the_cpu_errors() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let c = randn(&[2, 3], DType::F32, 150);
    let g = on(&c, GPU);
    for (name, f) in BINARY {
        let e = err(f(&c, &g), name);
        assert!(
            e.starts_with(name) && e.contains("cuda"),
            "{name} cpu + {GPU}: {e}"
        );
        let e = err(f(&g, &c), name);
        assert!(
            e.starts_with(name) && e.contains("cuda"),
            "{name} {GPU} + cpu: {e}"
        );
        let (c4, g4) = (
            randn(&[4], DType::F32, 151),
            on(&randn(&[4], DType::F32, 151), GPU),
        );
        assert_eq!(
            err(f(&g, &g4), name),
            err(f(&c, &c4), name),
            "{name} of [2, 3] and [4]: the device's error differs from the CPU's"
        );
    }
    let e = err(ops::cat(&[&c, &g], 0), "cat");
    assert!(
        e.starts_with("cat") && e.contains("cuda"),
        "cat cpu + {GPU}: {e}"
    );
    let (c5, g5) = (
        randn(&[4, 5], DType::F32, 152),
        on(&randn(&[4, 5], DType::F32, 152), GPU),
    );
    assert_eq!(
        err(ops::cat(&[&g, &g5], 1), "cat"),
        err(ops::cat(&[&c, &c5], 1), "cat"),
        "cat of [2, 3] and [4, 5]: the device's error differs from the CPU's"
    );
    let labels = Tensor::zeros(&[3], DType::I64, GPU).unwrap();
    assert_eq!(
        err(ops::relu(&labels), "relu"),
        err(
            ops::relu(&Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap()),
            "relu"
        ),
        "relu of i64"
    );
    assert_eq!(
        err(
            ops::dropout(&labels, 0.5, true, &mut Generator::new(1)),
            "dropout"
        ),
        err(
            ops::dropout(
                &Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap(),
                0.5,
                true,
                &mut Generator::new(1)
            ),
            "dropout"
        ),
        "dropout of i64"
    );
}
