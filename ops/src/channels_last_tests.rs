//! Channels-last (NHWC) inputs give the values and gradients of their row-major twins, op by
//! op, and outputs (and input gradients) in the channels-last format, computed by the NHWC
//! kernels (conv2d, batch norm and its fusions, pools, elementwise, dropout).

use tandem_autograd::{backward, BackwardOptions};
use tandem_core::{Generator, MemoryFormat, Result, Tensor};

use crate::testing::{check, rand_f64};
use crate::*;

const CL: MemoryFormat = MemoryFormat::ChannelsLast;
const ROW: MemoryFormat = MemoryFormat::Contiguous;

/// A fresh leaf with `t`'s values in `format`.
fn leaf(t: &Tensor, format: MemoryFormat) -> Tensor {
    let copy = t.contiguous_in(format).unwrap();
    let fresh = if copy.storage().same_buffer(t.storage()) {
        t.copy_detached().unwrap().contiguous_in(format).unwrap()
    } else {
        copy
    };
    fresh.with_requires_grad().unwrap()
}

fn assert_close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let (x, y) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        let ok = (p - q).abs() <= 1e-10 * (1.0 + p.abs()) || (p.is_nan() && q.is_nan());
        assert!(ok, "{what}: element {i}: {p} vs {q}");
    }
}

type Slot = std::sync::Arc<std::sync::Mutex<Option<Tensor>>>;

/// `x` unchanged, with a backward that keeps the gradient it passes on in `slot`.
fn probe(x: &Tensor, slot: &Slot) -> Tensor {
    let slot = slot.clone();
    tandem_autograd::record_fn(x.detach(), &[x], "probe", move || {
        move |g: &Tensor| {
            *slot.lock().unwrap() = Some(g.clone());
            Ok(vec![Some(g.clone())])
        }
    })
}

/// Runs `f` on row-major leaves and on leaves in `formats`, with the same upstream gradient
/// (in the output's format), and checks: equal outputs, the output in `want`, equal input
/// gradients, and each channels-last input's gradient channels-last.
fn compare(
    name: &str,
    inputs: &[Tensor],
    formats: &[MemoryFormat],
    want: MemoryFormat,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    compare_with(name, inputs, formats, want, true, f)
}

/// [`compare`], checking the input gradients' format only when `check_grad_format`.
fn compare_with(
    name: &str,
    inputs: &[Tensor],
    formats: &[MemoryFormat],
    want: MemoryFormat,
    check_grad_format: bool,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let row: Vec<Tensor> = inputs.iter().map(|t| leaf(t, ROW)).collect();
    let other: Vec<Tensor> = inputs
        .iter()
        .zip(formats)
        .map(|(t, &fmt)| leaf(t, fmt))
        .collect();
    // Probes between the leaves and the op see the gradients the op's backward produces
    // (autograd stores a leaf's gradient row-major).
    let slots: Vec<Slot> = inputs.iter().map(|_| Slot::default()).collect();
    let probed: Vec<Tensor> = other.iter().zip(&slots).map(|(t, s)| probe(t, s)).collect();
    let (ya, yb) = (f(&row).unwrap(), f(&probed).unwrap());
    assert_close(&ya, &yb, &format!("{name} output"));
    assert_eq!(yb.memory_format(), want, "{name}: output format");
    let upstream = rand_f64(ya.dims(), 77);
    for (y, inputs) in [(&ya, &row), (&yb, &other)] {
        let r = if y.rank() == 4 {
            upstream.contiguous_in(y.memory_format()).unwrap()
        } else {
            upstream.clone()
        };
        backward(y, Some(&r), &BackwardOptions::default()).unwrap();
        assert!(inputs.iter().all(|t| t.grad().is_some()), "{name}: grads");
    }
    for (i, (a, b)) in row.iter().zip(&other).enumerate() {
        let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
        assert_close(&ga, &gb, &format!("{name} grad {i}"));
        if formats[i] == CL && check_grad_format {
            let seen = slots[i].lock().unwrap().clone().unwrap();
            assert_eq!(seen.memory_format(), CL, "{name}: grad {i} format");
        }
    }
}

fn p(stride: usize, padding: usize, dilation: usize) -> Conv2dParams {
    Conv2dParams {
        stride: (stride, stride),
        padding: (padding, padding),
        dilation: (dilation, dilation),
    }
}

#[test]
fn conv2d_channels_last_matches_contiguous_forward_and_backward() {
    let cases = [
        ([2, 3, 7, 6], [4, 3, 3, 3], p(1, 1, 1)),
        ([3, 5, 9, 9], [6, 5, 3, 3], p(2, 1, 1)),
        ([2, 4, 6, 5], [3, 4, 1, 1], p(1, 0, 1)),
        ([2, 4, 8, 8], [8, 4, 1, 1], p(2, 0, 1)),
        ([1, 2, 9, 8], [3, 2, 3, 2], p(1, 2, 2)),
        // More pixels than one tile of the kernel.
        ([2, 16, 12, 12], [16, 16, 3, 3], p(1, 1, 1)),
    ];
    for (i, (xs, ws, params)) in cases.iter().enumerate() {
        let inputs = [
            rand_f64(xs, i as u64),
            rand_f64(ws, 10 + i as u64),
            rand_f64(&[ws[0]], 20 + i as u64),
        ];
        let f = |t: &[Tensor]| conv2d(&t[0], &t[1], Some(&t[2]), params);
        for formats in [[CL, ROW, ROW], [CL, CL, ROW], [ROW, CL, ROW]] {
            compare(
                &format!("conv2d case {i} {formats:?}"),
                &inputs,
                &formats,
                CL,
                f,
            );
        }
        let g = |t: &[Tensor]| conv2d(&t[0], &t[1], None, params);
        compare(
            &format!("conv2d case {i} no bias"),
            &inputs[..2],
            &[CL, CL],
            CL,
            g,
        );
    }
}

#[test]
fn gradcheck_conv2d_channels_last_path() {
    for (xs, ws, params) in [
        ([2, 3, 5, 4], [2, 3, 3, 3], p(1, 1, 1)),
        ([1, 2, 7, 7], [3, 2, 3, 2], p(2, 1, 2)),
        ([2, 3, 4, 4], [2, 3, 1, 1], p(1, 0, 1)),
    ] {
        let inputs = [rand_f64(&xs, 1), rand_f64(&ws, 2), rand_f64(&[ws[0]], 3)];
        check(
            |t| {
                let x = to_memory_format(&t[0], CL)?;
                let w = to_memory_format(&t[1], CL)?;
                let y = conv2d(&x, &w, Some(&t[2]), &params)?;
                assert_eq!(y.memory_format(), CL);
                Ok(y)
            },
            &inputs,
        );
    }
}

#[test]
fn batch_norm_family_channels_last_matches_contiguous() {
    let x = rand_f64(&[3, 5, 4, 3], 1);
    let (w, b) = (rand_f64(&[5], 2), rand_f64(&[5], 3));
    let r = rand_f64(&[3, 5, 4, 3], 4);
    for training in [true, false] {
        let stats = || {
            (
                Tensor::from_vec(vec![0.1f64; 5], &[5], tandem_core::Device::Cpu).unwrap(),
                Tensor::from_vec(vec![1.5f64; 5], &[5], tandem_core::Device::Cpu).unwrap(),
            )
        };
        let inputs = [x.clone(), w.clone(), b.clone(), r.clone()];
        let formats = [CL, ROW, ROW, CL];
        compare("batch_norm", &inputs[..3], &formats[..3], CL, |t| {
            let (m, v) = stats();
            batch_norm(
                &t[0],
                Some(&m),
                Some(&v),
                Some(&t[1]),
                Some(&t[2]),
                training,
                0.1,
                1e-5,
            )
        });
        compare("batch_norm_relu", &inputs[..3], &formats[..3], CL, |t| {
            let (m, v) = stats();
            batch_norm_relu(
                &t[0],
                Some(&m),
                Some(&v),
                Some(&t[1]),
                Some(&t[2]),
                training,
                0.1,
                1e-5,
            )
        });
        compare("batch_norm_add_relu", &inputs, &formats, CL, |t| {
            let (m, v) = stats();
            batch_norm_add_relu(
                &t[0],
                &t[3],
                Some(&m),
                Some(&v),
                Some(&t[1]),
                Some(&t[2]),
                training,
                0.1,
                1e-5,
            )
        });
    }
    // The running statistics move the same way.
    let (m1, v1) = (
        Tensor::zeros(&[5], tandem_core::DType::F64, tandem_core::Device::Cpu).unwrap(),
        Tensor::ones(&[5], tandem_core::DType::F64, tandem_core::Device::Cpu).unwrap(),
    );
    let (m2, v2) = (m1.copy_detached().unwrap(), v1.copy_detached().unwrap());
    batch_norm(&x, Some(&m1), Some(&v1), None, None, true, 0.1, 1e-5).unwrap();
    let xc = x.contiguous_in(CL).unwrap();
    batch_norm(&xc, Some(&m2), Some(&v2), None, None, true, 0.1, 1e-5).unwrap();
    assert_close(&m1, &m2, "running mean");
    assert_close(&v1, &v2, "running var");
}

#[test]
fn pools_channels_last_match_contiguous() {
    let x = rand_f64(&[2, 3, 7, 6], 5);
    let inputs = std::slice::from_ref(&x);
    compare("max 2x2", inputs, &[CL], CL, |t| {
        max_pool2d(&t[0], (2, 2), (2, 2), (0, 0))
    });
    compare("max 3x3 s2 p1", inputs, &[CL], CL, |t| {
        max_pool2d(&t[0], (3, 3), (2, 2), (1, 1))
    });
    compare("avg 3x3 s2 p1", inputs, &[CL], CL, |t| {
        avg_pool2d(&t[0], (3, 3), (2, 2), (1, 1))
    });
    compare("adaptive 1x1", inputs, &[CL], CL, |t| {
        adaptive_avg_pool2d(&t[0], (1, 1))
    });
    compare("adaptive 2x4", inputs, &[CL], CL, |t| {
        adaptive_avg_pool2d(&t[0], (2, 4))
    });
    // A NaN wins its window in both layouts.
    let mut v = x.to_vec::<f64>().unwrap();
    v[7] = f64::NAN;
    let xn = Tensor::from_vec(v, x.dims(), x.device()).unwrap();
    let a = max_pool2d(&xn, (2, 2), (2, 2), (0, 0)).unwrap();
    let b = max_pool2d(&xn.contiguous_in(CL).unwrap(), (2, 2), (2, 2), (0, 0)).unwrap();
    assert_close(&a, &b, "max with NaN");
}

#[test]
fn elementwise_ops_keep_the_channels_last_format() {
    let (a, b) = (rand_f64(&[2, 3, 4, 5], 1), rand_f64(&[2, 3, 4, 5], 2));
    let bias = rand_f64(&[1, 3, 1, 1], 3);
    let ab = [a.clone(), b.clone()];
    compare("relu", &ab[..1], &[CL], CL, |t| relu(&t[0]));
    compare("exp", &ab[..1], &[CL], CL, |t| exp(&t[0]));
    compare("tanh", &ab[..1], &[CL], CL, |t| tanh(&t[0]));
    compare("add", &ab, &[CL, CL], CL, |t| add(&t[0], &t[1]));
    compare("mul", &ab, &[CL, CL], CL, |t| mul(&t[0], &t[1]));
    compare("add_relu", &ab, &[CL, CL], CL, |t| add_relu(&t[0], &t[1]));
    compare("add_scalar", &ab[..1], &[CL], CL, |t| {
        add_scalar(&t[0], 0.5)
    });
    compare("mul_scalar", &ab[..1], &[CL], CL, |t| {
        mul_scalar(&t[0], 2.0)
    });
    // Mixed formats: the first full-shaped operand decides (PyTorch's rule).
    compare("add cl+row", &ab, &[CL, ROW], CL, |t| add(&t[0], &t[1]));
    compare_with("sub row+cl", &ab, &[ROW, CL], ROW, false, |t| {
        sub(&t[0], &t[1])
    });
    compare("add_relu cl+row", &ab, &[CL, ROW], CL, |t| {
        add_relu(&t[0], &t[1])
    });
    // A broadcast bias has no say.
    let with_bias = [a.clone(), bias.clone()];
    compare("add bias", &with_bias, &[CL, ROW], CL, |t| {
        add(&t[0], &t[1])
    });
    compare("bias + x", &with_bias, &[CL, ROW], CL, |t| {
        add(&t[1], &t[0])
    });
}

#[test]
fn dropout_channels_last_drops_the_same_elements() {
    let x = rand_f64(&[2, 3, 4, 5], 1);
    compare("dropout", std::slice::from_ref(&x), &[CL], CL, |t| {
        dropout(&t[0], 0.4, true, &mut Generator::new(7))
    });
}

#[test]
fn flatten_and_reshape_of_channels_last_keep_logical_order() {
    let x = rand_f64(&[2, 3, 4, 5], 1);
    let y = x.contiguous_in(CL).unwrap();
    let (fa, fb) = (flatten(&x, 1, -1).unwrap(), flatten(&y, 1, -1).unwrap());
    assert_eq!(fa.to_vec::<f64>().unwrap(), fb.to_vec::<f64>().unwrap());
    assert!(fb.is_contiguous());
    let r = reshape(&y, &[6, 20]).unwrap();
    assert_eq!(r.to_vec::<f64>().unwrap(), x.to_vec::<f64>().unwrap());
    // The gradient of a reshape is reshaped back: row-major, as in PyTorch.
    compare_with(
        "flatten",
        std::slice::from_ref(&x),
        &[CL],
        ROW,
        false,
        |t| flatten(&t[0], 1, -1),
    );
}

#[test]
fn gradcheck_to_memory_format_and_its_errors() {
    let x = rand_f64(&[2, 3, 2, 2], 1);
    check(
        |t| {
            let y = to_memory_format(&t[0], CL)?;
            to_memory_format(&mul(&y, &y)?, ROW)
        },
        std::slice::from_ref(&x),
    );
    let y = to_memory_format(&x, CL).unwrap();
    assert_eq!(y.memory_format(), CL);
    assert!(to_memory_format(&y, CL).unwrap().same_tensor(&y));
    let err = to_memory_format(&rand_f64(&[2, 3], 1), CL)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[2, 3]") && err.contains("channels-last"),
        "{err}"
    );
}

/// Times conv2d forward + backward in both formats at ResNet-20's shapes (batch 32, one
/// thread), medians of 7 runs. A measurement, not a test: run with `--ignored --nocapture`.
#[test]
#[ignore]
fn measure_nhwc_against_nchw_conv_at_resnet20_shapes() {
    crate::set_num_threads(1).unwrap();
    let shapes = [
        ("conv1 3->16 32x32", [32, 3, 32, 32], [16, 3, 3, 3], 1),
        ("16->16 32x32", [32, 16, 32, 32], [16, 16, 3, 3], 1),
        ("16->32 s2 32x32", [32, 16, 32, 32], [32, 16, 3, 3], 2),
        ("32->32 16x16", [32, 32, 16, 16], [32, 32, 3, 3], 1),
        ("64->64 8x8", [32, 64, 8, 8], [64, 64, 3, 3], 1),
    ];
    for (name, xs, ws, stride) in shapes {
        let mut g = Generator::new(1);
        let x = Tensor::randn(
            &xs,
            0.0,
            1.0,
            tandem_core::DType::F32,
            tandem_core::Device::Cpu,
            &mut g,
        )
        .unwrap();
        let w = Tensor::randn(
            &ws,
            0.0,
            0.1,
            tandem_core::DType::F32,
            tandem_core::Device::Cpu,
            &mut g,
        )
        .unwrap();
        let params = p(stride, 1, 1);
        let mut report = Vec::new();
        for format in [ROW, CL] {
            let (xf, wf) = (leaf(&x, format), leaf(&w, format));
            let mut fwd = Vec::new();
            let mut total = Vec::new();
            for _ in 0..7 {
                let t0 = std::time::Instant::now();
                let y = conv2d(&xf, &wf, None, &params).unwrap();
                let t1 = std::time::Instant::now();
                let loss = sum_all(&y).unwrap();
                backward(&loss, None, &BackwardOptions::default()).unwrap();
                let t2 = std::time::Instant::now();
                fwd.push((t1 - t0).as_secs_f64() * 1e3);
                total.push((t2 - t0).as_secs_f64() * 1e3);
            }
            fwd.sort_by(f64::total_cmp);
            total.sort_by(f64::total_cmp);
            report.push(format!(
                "{format:?}: fwd {:.2} ms, fwd+bwd {:.2} ms",
                fwd[3], total[3]
            ));
        }
        println!("{name}: {}", report.join(" | "));
    }
}
