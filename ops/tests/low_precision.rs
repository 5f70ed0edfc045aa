//! f16 and bf16 through every float op other than the autocast ops (matmul, linear, conv2d) on
//! the CPU: forward and backward against the f32 op on the rounded inputs within one rounding
//! of the half format (the derivation is in `common/half.rs`), PyTorch's promotion of mixed
//! float dtypes, batch norm with a half input and f32 parameters and running statistics, and
//! the errors of the ops that still take only f32 and f64.

mod common;

use common::half;
use tandem_core::{DType, Device, Tensor};

const DTYPES: [DType; 2] = [DType::BF16, DType::F16];

#[test]
fn unary_ops_compute_in_f32_and_round_once() {
    for dtype in DTYPES {
        half::unary_ops(Device::Cpu, dtype);
    }
}

#[test]
fn binary_ops_compute_in_f32_and_round_once() {
    for dtype in DTYPES {
        half::binary_ops(Device::Cpu, dtype);
    }
}

#[test]
fn mixed_float_dtypes_promote_as_pytorch_and_gradients_keep_each_inputs_dtype() {
    for dtype in DTYPES {
        half::promotion(Device::Cpu, dtype);
    }
}

#[test]
fn reductions_and_softmax_accumulate_in_f32() {
    for dtype in DTYPES {
        half::reductions(Device::Cpu, dtype);
        // 2¹⁶ terms: a half accumulator would stop growing long before (bf16 at 256).
        half::long_sum(Device::Cpu, dtype, 1 << 16);
    }
}

#[test]
fn losses_on_half_scores_return_the_scores_dtype() {
    for dtype in DTYPES {
        half::losses(Device::Cpu, dtype);
    }
}

#[test]
fn pools_compute_in_f32_and_round_once() {
    for dtype in DTYPES {
        half::pools(Device::Cpu, dtype);
    }
}

#[test]
fn batch_norm_takes_a_half_input_with_f32_parameters_and_running_statistics() {
    for dtype in DTYPES {
        half::batch_norms(Device::Cpu, dtype);
    }
}

#[test]
fn batch_norm_family_runs_native_half_passes_in_both_layouts() {
    for dtype in DTYPES {
        half::batch_norms_native(dtype);
    }
}

#[test]
fn dropout_cat_and_views_carry_half_tensors() {
    for dtype in DTYPES {
        half::data_movement(Device::Cpu, dtype);
    }
}

#[test]
fn batch_norm_with_half_running_statistics_updates_them_in_their_dtype() {
    let x = half::randn(&[8, 2, 3], 1.0, 30, Device::Cpu);
    let stats = || {
        (
            Tensor::zeros(&[2], DType::BF16, Device::Cpu).unwrap(),
            Tensor::ones(&[2], DType::BF16, Device::Cpu).unwrap(),
        )
    };
    let (m, v) = stats();
    let xl = x.to_dtype(DType::BF16).unwrap();
    let y = tandem_ops::batch_norm(&xl, Some(&m), Some(&v), None, None, true, 0.5, 1e-5).unwrap();
    assert_eq!(
        (y.dtype(), m.dtype(), v.dtype()),
        (DType::BF16, DType::BF16, DType::BF16)
    );
    let (m32, v32) = (
        Tensor::zeros(&[2], DType::F32, Device::Cpu).unwrap(),
        Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap(),
    );
    let xr = xl.to_dtype(DType::F32).unwrap();
    tandem_ops::batch_norm(&xr, Some(&m32), Some(&v32), None, None, true, 0.5, 1e-5).unwrap();
    half::assert_rounded(&m, &m32, DType::BF16, "bf16 running_mean");
    half::assert_rounded(&v, &v32, DType::BF16, "bf16 running_var");
}

#[test]
fn ops_without_a_half_path_and_non_float_inputs_keep_clear_errors() {
    let labels = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
    let err = tandem_ops::relu(&labels).unwrap_err().to_string();
    assert!(err.starts_with("relu:") && err.contains("i64"), "{err}");
    let x = Tensor::zeros(&[3], DType::BF16, Device::Cpu).unwrap();
    let err = tandem_ops::add(&x, &labels).unwrap_err().to_string();
    assert!(
        err.contains("add") && err.contains("bf16") && err.contains("i64"),
        "{err}"
    );
    let err = tandem_ops::dropout(&labels, 0.5, false, &mut tandem_core::Generator::new(1))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("dropout:") && err.contains("i64"), "{err}");
}

/// A half tensor used by two ops gets the sum of their half gradients computed in f32 and
/// rounded once (each contribution rounded by its own op first), channels-last kept.
#[test]
fn two_half_gradients_of_one_tensor_sum_in_f32_and_round_once() {
    use tandem_autograd::{backward, BackwardOptions};
    use tandem_core::{Generator, MemoryFormat};
    for dtype in DTYPES {
        let mut g = Generator::new(5);
        let shape = [2, 3, 4, 5];
        let mut randn = |s: &[usize]| {
            Tensor::randn(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .contiguous_in(MemoryFormat::ChannelsLast)
                .unwrap()
        };
        let (a, b, dy) = (randn(&shape), randn(&shape), randn(&shape));
        let x = randn(&shape).with_requires_grad().unwrap();
        let y = tandem_ops::add(
            &tandem_ops::mul(&x, &a).unwrap(),
            &tandem_ops::mul(&x, &b).unwrap(),
        )
        .unwrap();
        backward(&y, Some(&dy), &BackwardOptions::default()).unwrap();
        let grad = x.grad().unwrap();
        assert_eq!(grad.dtype(), dtype);
        assert_eq!(grad.memory_format(), MemoryFormat::ChannelsLast);
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        let round = |v: f32| {
            Tensor::from_vec(vec![v], &[1], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()[0]
        };
        let (av, bv, dv) = (f(&a), f(&b), f(&dy));
        let want: Vec<f32> = (0..av.len())
            .map(|i| round(round(dv[i] * av[i]) + round(dv[i] * bv[i])))
            .collect();
        assert_eq!(f(&grad), want, "{dtype}");
    }
}

/// A bf16 convolution whose weight is channels-last (a model converted with
/// `to_memory_format`) gives the outputs and gradients of the same weight row-major, bit for
/// bit: the AMX path reads the weight in its own storage order.
#[test]
fn bf16_conv2d_reads_a_channels_last_weight_as_a_row_major_one() {
    use tandem_autograd::{backward, BackwardOptions};
    use tandem_core::{Generator, MemoryFormat};
    use tandem_ops::Conv2dParams;
    let mut g = Generator::new(9);
    let mut randn = |s: &[usize]| {
        Tensor::randn(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let cl = MemoryFormat::ChannelsLast;
    for (k, stride, pad) in [(3, 1, 1), (3, 2, 1), (1, 2, 0), (1, 1, 0)] {
        let x = randn(&[2, 16, 8, 8]).contiguous_in(cl).unwrap();
        let w = randn(&[32, 16, k, k]);
        let params = Conv2dParams {
            stride: (stride, stride),
            padding: (pad, pad),
            ..Conv2dParams::default()
        };
        let run = |format: MemoryFormat| {
            let x = x
                .copy_detached()
                .unwrap()
                .contiguous_in(cl)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let w = w
                .contiguous_in(format)
                .unwrap()
                .copy_detached()
                .unwrap()
                .contiguous_in(format)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let y = tandem_ops::conv2d(&x, &w, None, &params).unwrap();
            let dy = y.ones_like().unwrap().contiguous_in(cl).unwrap();
            backward(&y, Some(&dy), &BackwardOptions::default()).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            (
                f(&y),
                f(&x.grad().unwrap()),
                f(&w.grad().unwrap()),
                w.memory_format(),
            )
        };
        let (row_major, channels_last) = (run(MemoryFormat::Contiguous), run(cl));
        assert_eq!(channels_last.3, cl, "k={k}");
        assert_eq!(
            row_major.0, channels_last.0,
            "output, k={k} stride={stride}"
        );
        assert_eq!(
            row_major.1, channels_last.1,
            "input gradient, k={k} stride={stride}"
        );
        assert_eq!(
            row_major.2, channels_last.2,
            "weight gradient, k={k} stride={stride}"
        );
    }
}
