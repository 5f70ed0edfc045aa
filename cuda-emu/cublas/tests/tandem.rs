//! tandem's own products (tandem-ops' `matmul`, `linear`, and `conv2d` through im2col + cuBLAS,
//! forced with `set_cuda_conv_backend`, since the emulator's cuDNN would take it otherwise) on
//! the emulated device, against the same ops on the CPU. The
//! emulated cuBLAS computes with its own reference loops, so a wrong leading dimension,
//! transpose flag, offset or batch stride in tandem's cuBLAS glue gives a different answer here.

mod common;

use tandem_core::{DType, Device, Generator, Tensor};
use tandem_ops::{conv2d, linear, matmul, Conv2dParams};

const GPU: Device = Device::Cuda(0);

fn values(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut gen = Generator::new(seed);
    Tensor::randn(shape, 0.0, 1.0, dtype, Device::Cpu, &mut gen).unwrap()
}

/// The same values on the GPU, transposed in memory (a transposed view of a dense array) when
/// `transposed`, so tandem passes cuBLAS a transpose flag instead of copying.
fn on_gpu(host: &Tensor, transposed: bool) -> Tensor {
    let r = host.rank();
    if !transposed || r < 2 {
        return host.to_device(GPU).unwrap();
    }
    let swap = |t: &Tensor| {
        t.view_detached(t.layout().transpose("test", r - 2, r - 1).unwrap())
            .unwrap()
    };
    let stored = swap(host).copy_detached().unwrap().to_device(GPU).unwrap();
    swap(&stored)
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.device(), GPU, "{what}");
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let scale = 1.0 + w.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let tol = match want.dtype() {
        DType::F64 => 1e-12 * scale,
        _ => 1e-5 * scale,
    };
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what}: element {i} is {a} on the emulated GPU, {b} on the CPU (tolerance {tol:e})"
        );
    }
}

#[test]
fn matmul_on_the_emulator_matches_the_cpu() {
    common::use_emulator();
    // Square products first: there a wrong transpose flag or a swapped leading dimension stays
    // inside the buffers and cuBLAS's argument checks, and only the values tell.
    let shapes: [(&[usize], &[usize]); 11] = [
        (&[5, 5], &[5, 5]),
        (&[2, 6, 6], &[2, 6, 6]),
        (&[3, 4], &[4, 5]),
        (&[17, 9], &[9, 13]),
        (&[4], &[4]),
        (&[7], &[7, 3]),
        (&[5, 7], &[7]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4, 5]),
        (&[4, 5], &[2, 5, 3]),
        (&[2, 1, 3, 4], &[3, 4, 2]),
    ];
    for (i, (a, b)) in shapes.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let (ha, hb) = (
                    values(a, dtype, 2 * i as u64),
                    values(b, dtype, 2 * i as u64 + 1),
                );
                let want = matmul(&ha, &hb).unwrap();
                let got = matmul(&on_gpu(&ha, ta), &on_gpu(&hb, tb))
                    .unwrap_or_else(|e| panic!("matmul {a:?}·{b:?} {dtype:?}: {e}"));
                assert_close(
                    &got,
                    &want,
                    &format!("matmul {a:?}·{b:?} {dtype:?} transposed in memory {ta}/{tb}"),
                );
            }
        }
    }
}

#[test]
fn linear_on_the_emulator_matches_the_cpu() {
    common::use_emulator();
    let cases: [(&[usize], &[usize], bool); 4] = [
        (&[3, 5], &[4, 5], true),
        (&[2, 3, 5], &[4, 5], true),
        (&[5], &[4, 5], true),
        (&[7, 6], &[3, 6], false),
    ];
    for (i, (x, w, bias)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            for transposed in [false, true] {
                let seed = 100 + 3 * i as u64;
                let (hx, hw) = (values(x, dtype, seed), values(w, dtype, seed + 1));
                let hb = values(&[w[0]], dtype, seed + 2);
                let hb = bias.then_some(&hb);
                let want = linear(&hx, &hw, hb).unwrap();
                let gb = hb.map(|b| b.to_device(GPU).unwrap());
                let got = linear(
                    &on_gpu(&hx, transposed),
                    &on_gpu(&hw, !transposed),
                    gb.as_ref(),
                )
                .unwrap_or_else(|e| panic!("linear {x:?} {w:?} {dtype:?}: {e}"));
                assert_close(
                    &got,
                    &want,
                    &format!("linear {x:?} {w:?} bias {bias} {dtype:?} transposed {transposed}"),
                );
            }
        }
    }
}

#[test]
fn conv2d_through_im2col_on_the_emulator_matches_the_cpu() {
    common::use_emulator();
    // Process-wide, and no other test of this binary runs a convolution.
    tandem_ops::conv2d::set_cuda_conv_backend(tandem_ops::conv2d::CudaConvBackend::Im2col);
    let params = Conv2dParams {
        stride: (2, 1),
        padding: (1, 0),
        dilation: (1, 1),
    };
    for dtype in [DType::F32, DType::F64] {
        let (x, w, b) = (
            values(&[2, 3, 6, 5], dtype, 7),
            values(&[4, 3, 3, 2], dtype, 8),
            values(&[4], dtype, 9),
        );
        let want = conv2d(&x, &w, Some(&b), &params).unwrap();
        let (gx, gw, gb) = (
            x.to_device(GPU).unwrap(),
            w.to_device(GPU).unwrap(),
            b.to_device(GPU).unwrap(),
        );
        let got = conv2d(&gx, &gw, Some(&gb), &params)
            .unwrap_or_else(|e| panic!("conv2d {dtype:?}: {e}"));
        assert_close(&got, &want, &format!("conv2d {dtype:?}"));
    }
}
