//! GPU conformance of channels-last (NHWC) tensors through the ops of a ResNet step other than
//! conv2d: batch norm and its ReLU / add+ReLU fusions (training and evaluation), the unary and
//! binary elementwise ops (the residual add and add_relu among them), dropout, and the pools.
//! Each op runs on the CPU and on CUDA on the same inputs laid out the same way; the CUDA
//! output must have the CPU's values and memory format, and so must the input gradients its
//! backward produces (seen by a probe between the leaf and the op: autograd stores a leaf's
//! gradient row-major).
//!
//! Each test runs on the GPU, or on the CUDA emulator without one
//! (`tandem_test_support::select_cuda`). Inputs are small: the emulator runs kernels on the host.

mod common;

use std::sync::{Arc, Mutex};

use common::GPU;
use tandem_autograd::{backward, record_fn, BackwardOptions};
use tandem_core::{Device, Generator, MemoryFormat, Result, Tensor};
use tandem_ops::*;

const CL: MemoryFormat = MemoryFormat::ChannelsLast;
const ROW: MemoryFormat = MemoryFormat::Contiguous;

/// Deterministic f32 values in about [-2, 2) of `shape`, row-major, on the CPU.
fn values(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n as u64)
        .map(|i| ((i * 7919 + seed * 104_729 + 13) % 1009) as f32 / 252.0 - 2.0)
        .collect();
    Tensor::from_vec(v, shape, Device::Cpu).unwrap()
}

type Slot = Arc<Mutex<Option<Tensor>>>;

/// A unary op of the crate.
type UnaryOp = fn(&Tensor) -> Result<Tensor>;

/// `x` unchanged, with a backward that keeps the gradient it passes on in `slot`.
fn probe(x: &Tensor, slot: &Slot) -> Tensor {
    let slot = slot.clone();
    record_fn(x.detach(), &[x], "probe", move || {
        move |g: &Tensor| {
            *slot.lock().unwrap() = Some(g.clone());
            Ok(vec![Some(g.clone())])
        }
    })
}

/// The output and the gradients the op's backward hands each input, on `device`.
fn run_on(
    device: Device,
    inputs: &[Tensor],
    formats: &[MemoryFormat],
    f: &impl Fn(&[Tensor]) -> Result<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .zip(formats)
        .map(|(t, &fmt)| {
            let t = t.to_device(device).unwrap();
            let t = if t.rank() == 4 {
                t.contiguous_in(fmt).unwrap()
            } else {
                t
            };
            t.with_requires_grad().unwrap()
        })
        .collect();
    let slots: Vec<Slot> = inputs.iter().map(|_| Slot::default()).collect();
    let probed: Vec<Tensor> = leaves
        .iter()
        .zip(&slots)
        .map(|(t, s)| probe(t, s))
        .collect();
    let y = f(&probed).unwrap();
    let upstream = values(y.dims(), 77).to_device(device).unwrap();
    let upstream = if y.rank() == 4 {
        upstream.contiguous_in(y.memory_format()).unwrap()
    } else {
        upstream
    };
    backward(&y, Some(&upstream), &BackwardOptions::default()).unwrap();
    let grads = slots
        .iter()
        .map(|s| s.lock().unwrap().clone().expect("a gradient"))
        .collect();
    (y, grads)
}

fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (g, w) = (common::values(got), common::values(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a - b).abs() <= tol * (1.0 + b.abs()) || (a.is_nan() && b.is_nan());
        assert!(ok, "{what}: element {i}: {a} on CUDA, {b} on the CPU");
    }
}

/// Runs `f` on both devices with `inputs` in `formats`; the CUDA output must be in `want` and
/// in the CPU output's format, with the CPU's values (within `tol`, relative), and each input
/// gradient must have the CPU's values and format.
fn compare(
    name: &str,
    inputs: &[Tensor],
    formats: &[MemoryFormat],
    want: MemoryFormat,
    tol: f64,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let (yc, gc) = run_on(Device::Cpu, inputs, formats, &f);
    let (yg, gg) = run_on(GPU, inputs, formats, &f);
    assert_eq!(yc.memory_format(), want, "{name}: CPU output format");
    assert_eq!(yg.memory_format(), want, "{name}: CUDA output format");
    assert!(yg.is_contiguous_in(want), "{name}: CUDA output dense");
    assert_close(&yg, &yc, tol, &format!("{name} output"));
    for (i, (a, b)) in gg.iter().zip(&gc).enumerate() {
        assert_eq!(
            a.memory_format(),
            b.memory_format(),
            "{name}: grad {i} format"
        );
        assert_close(a, b, tol, &format!("{name} grad {i}"));
    }
}

#[test]
fn elementwise_ops_keep_channels_last_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let shape = [2, 5, 3, 4];
    let (a, b) = (values(&shape, 1), values(&shape, 2));
    let bias = values(&[1, 5, 1, 1], 3);
    let unary: [(&str, UnaryOp); 5] = [
        ("relu", relu),
        ("neg", neg),
        ("exp", exp),
        ("sigmoid", sigmoid),
        ("tanh", tanh),
    ];
    for (name, op) in unary {
        compare(name, std::slice::from_ref(&a), &[CL], CL, 1e-6, |t| {
            op(&t[0])
        });
    }
    compare(
        "add_scalar",
        std::slice::from_ref(&a),
        &[CL],
        CL,
        1e-6,
        |t| add_scalar(&t[0], 0.5),
    );
    compare(
        "mul_scalar",
        std::slice::from_ref(&a),
        &[CL],
        CL,
        1e-6,
        |t| mul_scalar(&t[0], -1.5),
    );
    let pair = [a.clone(), b.clone()];
    for (formats, want) in [([CL, CL], CL), ([CL, ROW], CL), ([ROW, CL], ROW)] {
        compare(
            &format!("add {formats:?}"),
            &pair,
            &formats,
            want,
            1e-6,
            |t| add(&t[0], &t[1]),
        );
        compare(
            &format!("mul {formats:?}"),
            &pair,
            &formats,
            want,
            1e-6,
            |t| mul(&t[0], &t[1]),
        );
    }
    compare("add_relu", &pair, &[CL, CL], CL, 1e-6, |t| {
        add_relu(&t[0], &t[1])
    });
    // A broadcast per-channel operand has no say: the full-shape operand's format wins.
    let with_bias = [a.clone(), bias];
    compare("mul bias", &with_bias, &[CL, ROW], CL, 1e-6, |t| {
        mul(&t[0], &t[1])
    });
    compare("sub bias first", &with_bias, &[CL, ROW], CL, 1e-6, |t| {
        sub(&t[1], &t[0])
    });
}

#[test]
fn dropout_keeps_channels_last_and_the_cpu_mask_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for shape in [[2, 5, 3, 4], [1, 3, 1, 5]] {
        compare(
            &format!("dropout {shape:?}"),
            &[values(&shape, 4)],
            &[CL],
            CL,
            1e-6,
            |t| dropout(&t[0], 0.4, true, &mut Generator::new(11)),
        );
    }
}

#[test]
fn pools_keep_channels_last_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let x = [values(&[2, 3, 7, 6], 5)];
    compare("max_pool2d 3/2/1", &x, &[CL], CL, 1e-6, |t| {
        max_pool2d(&t[0], (3, 3), (2, 2), (1, 1))
    });
    compare("max_pool2d 2/2/0", &x, &[CL], CL, 1e-6, |t| {
        max_pool2d(&t[0], (2, 2), (2, 2), (0, 0))
    });
    compare("avg_pool2d 3/2/1", &x, &[CL], CL, 1e-6, |t| {
        avg_pool2d(&t[0], (3, 3), (2, 2), (1, 1))
    });
    compare("adaptive_avg_pool2d 1x1", &x, &[CL], CL, 1e-6, |t| {
        adaptive_avg_pool2d(&t[0], (1, 1))
    });
    compare("adaptive_avg_pool2d 3x4", &x, &[CL], CL, 1e-6, |t| {
        adaptive_avg_pool2d(&t[0], (3, 4))
    });
}

/// Per-channel running statistics for `c` channels on `device` (fresh per run: training
/// updates them).
fn running(c: usize, device: Device) -> (Tensor, Tensor) {
    let mean = values(&[c], 8).to_device(device).unwrap();
    let var = Tensor::from_vec(
        (0..c).map(|i| 0.5 + i as f32 * 0.25).collect::<Vec<f32>>(),
        &[c],
        Device::Cpu,
    )
    .unwrap()
    .to_device(device)
    .unwrap();
    (mean, var)
}

#[test]
fn batch_norm_and_fusions_keep_channels_last_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let c = 6;
    let shape = [3, c, 4, 5];
    let inputs = [
        values(&shape, 6),
        values(&[c], 7),
        values(&[c], 9),
        values(&shape, 10),
    ];
    let formats = [CL, ROW, ROW, CL];
    for training in [true, false] {
        let bn = |t: &[Tensor]| {
            let (m, v) = running(c, t[0].device());
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
        };
        compare(
            &format!("batch_norm training={training}"),
            &inputs[..3],
            &formats[..3],
            CL,
            1e-4,
            bn,
        );
        let bn_relu = |t: &[Tensor]| {
            let (m, v) = running(c, t[0].device());
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
        };
        compare(
            &format!("batch_norm_relu training={training}"),
            &inputs[..3],
            &formats[..3],
            CL,
            1e-4,
            bn_relu,
        );
        let bn_add_relu = |t: &[Tensor]| {
            let (m, v) = running(c, t[0].device());
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
        };
        compare(
            &format!("batch_norm_add_relu training={training}"),
            &inputs,
            &formats,
            CL,
            1e-4,
            bn_add_relu,
        );
    }
}

#[test]
fn batch_norm_running_statistics_from_channels_last_match_row_major_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let c = 4;
    let x = values(&[2, c, 3, 3], 12).to_device(GPU).unwrap();
    let mut stats = Vec::new();
    for format in [ROW, CL] {
        let (m, v) = running(c, GPU);
        let xf = x.contiguous_in(format).unwrap();
        batch_norm(&xf, Some(&m), Some(&v), None, None, true, 0.1, 1e-5).unwrap();
        stats.push((m, v));
    }
    assert_close(&stats[1].0, &stats[0].0, 1e-6, "running mean");
    assert_close(&stats[1].1, &stats[0].1, 1e-6, "running var");
}

/// A ResNet basic block on channels-last data (conv → BN+ReLU → conv → BN+add+ReLU, then the
/// global average pool): every intermediate stays channels-last on CUDA (nothing converts back
/// and forth), and the output and the gradients of the input and the weights are the CPU's.
#[test]
fn a_resnet_block_stays_channels_last_on_cuda() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let c = 4;
    let inputs = [
        values(&[2, c, 5, 5], 21),
        values(&[c, c, 3, 3], 22).mul_scalar_f32(0.2),
        values(&[c, c, 3, 3], 23).mul_scalar_f32(0.2),
    ];
    let params = Conv2dParams {
        stride: (1, 1),
        padding: (1, 1),
        dilation: (1, 1),
    };
    let block = |t: &[Tensor]| {
        let stays = |y: Tensor, what: &str| {
            assert_eq!(y.memory_format(), CL, "{what} on {}", y.device());
            y
        };
        let h = stays(conv2d(&t[0], &t[1], None, &params)?, "conv1");
        let h = stays(
            batch_norm_relu(&h, None, None, None, None, true, 0.1, 1e-5)?,
            "bn1+relu",
        );
        let h = stays(conv2d(&h, &t[2], None, &params)?, "conv2");
        let h = stays(
            batch_norm_add_relu(&h, &t[0], None, None, None, None, true, 0.1, 1e-5)?,
            "bn2+add+relu",
        );
        let h = stays(adaptive_avg_pool2d(&h, (1, 1))?, "pool");
        mul_scalar(&h, 2.0)
    };
    compare("resnet block", &inputs, &[CL, CL, CL], CL, 1e-4, block);
}

/// `t * k` for an f32 CPU tensor, outside the graph.
trait ScaleF32 {
    fn mul_scalar_f32(self, k: f32) -> Tensor;
}

impl ScaleF32 for Tensor {
    fn mul_scalar_f32(self, k: f32) -> Tensor {
        let v: Vec<f32> = self
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x * k)
            .collect();
        Tensor::from_vec(v, self.dims(), Device::Cpu).unwrap()
    }
}
