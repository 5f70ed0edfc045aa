//! 2-D convolution (cross-correlation, like `torch.nn.functional.conv2d` with groups = 1) with
//! stride, zero padding and dilation.
//!
//! `shape.rs` works out the sizes once; the CPU kernels (`cpu/`) plan each pass into one
//! algorithm — Winograd F(2×2, 3×3) for the 3×3 unit-stride layers with 16 or more channels, an
//! implicit GEMM with a register-blocked AVX-512 kernel, pixel-major weight-gradient columns,
//! or im2col + gemm — and run it over the batch in parallel (see `cpu/mod.rs`). With unit
//! strides the input gradient is itself a convolution, of the output gradient with the flipped,
//! transposed weights. Nothing is saved for the backward beyond the input and the weight,
//! which keeps training memory at the size of the activations.
//!
//! On CUDA devices (`cuda/`) cuDNN computes the convolution and its two gradients, with
//! descriptors and algorithms cached per geometry; where cuDNN does not load, im2col + cuBLAS
//! does (`conv2d.cu` holds its kernels and the bias kernels both engines share).
//! [`set_cuda_conv_backend`] forces the fallback, [`set_cudnn_algorithm_search`] chooses between
//! measured and heuristic algorithm choice, and `tandem_core::cuda::blas::set_allow_tf32_conv`
//! turns TF32 off (it is on by default for convolutions, as in PyTorch).

mod cpu;
pub mod cuda;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{Device, Error, Result, Tensor};

use crate::autocast::{self, is_low, matrix_dtype};
use crate::checks::same_dtype_device;
pub use cuda::{
    cuda_conv_backend, cudnn_algorithm_search, cudnn_available, cudnn_cache_stats,
    set_cuda_conv_backend, set_cudnn_algorithm_search, CudaConvBackend, CudnnAlgorithmSearch,
    CudnnCacheStats,
};
use shape::Needs;
pub use shape::{Conv2dParams, Geometry};

/// Checks the inputs and derives the sizes of the convolution.
fn geometry(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    p: &Conv2dParams,
) -> Result<Geometry> {
    const OP: &str = "conv2d";
    same_dtype_device(OP, x, weight)?;
    matrix_dtype(OP, x)?;
    let (xd, wd) = (x.dims(), weight.dims());
    let geometry = Geometry::of(OP, xd, wd, p)?;
    if let Some(b) = bias {
        same_dtype_device(OP, x, b)?;
        if b.dims() != [wd[0]] {
            return Err(Error::shape(
                OP,
                format!(
                    "bias {:?} does not match weight {wd:?}: need [{}]",
                    b.dims(),
                    wd[0]
                ),
            ));
        }
    }
    Ok(geometry)
}

/// 2-D convolution of `x` with `weight`, plus `bias` per output channel.
///
/// `out[n, o, i, j] = bias[o] + Σ_{c, a, b} weight[o, c, a, b] ·
/// x[n, c, i·sh + a·dh − ph, j·sw + b·dw − pw]`, with zeros outside the input.
///
/// # Shapes
/// - `x`: `[N, C, H, W]`;
/// - `weight`: `[O, C, kh, kw]`;
/// - `bias`: `[O]` (optional);
/// - output: `[N, O, OH, OW]` with `OH = (H + 2·ph − dh·(kh − 1) − 1) / sh + 1` (floor) and
///   likewise `OW`.
///
/// Errors (naming the shapes) when the channel counts differ, the dilated kernel is larger than
/// the padded input, a stride or dilation is 0, or dtypes/devices differ.
///
/// The dtype is f32/f64, or f16/bf16 on the CPU (computed with f32 accumulation, rounded
/// once). Under autocast f32 inputs are cast to the autocast dtype first, the weight and bias
/// through the weight cache (see `crate::autocast`).
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    params: &Conv2dParams,
) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("conv2d", tandem_core::profile::Phase::Forward);
    let (x, weight) = (&autocast::lower(x)?, &autocast::lower(weight)?);
    let bias = autocast::lower_opt(bias)?;
    let bias = bias.as_ref();
    let geo = geometry(x, weight, bias, params)?;
    let out = match x.device() {
        Device::Cpu if is_low(x.dtype()) => cpu::low_precision::conv2d(x, weight, bias, &geo)?,
        Device::Cpu => cpu::conv2d(x, weight, bias, &geo)?,
        Device::Cuda(_) => cuda::conv2d(x, weight, bias, &geo)?,
    };

    let needs = Needs {
        input: x.requires_grad(),
        weight: weight.requires_grad(),
        bias: bias.is_some_and(|b| b.requires_grad()),
    };
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    Ok(record_fn(out, &inputs, "conv2d", move || {
        let (dx, dw) = (x.detach(), weight.detach());
        move |g: &Tensor| {
            let [input, weight, bias] = match g.device() {
                Device::Cpu if is_low(dx.dtype()) => {
                    cpu::low_precision::conv2d_backward(&dx, &dw, g, &geo, needs)?
                }
                Device::Cpu => cpu::conv2d_backward(&dx, &dw, g, &geo, needs)?,
                Device::Cuda(_) => cuda::conv2d_backward(&dx, &dw, g, &geo, needs)?,
            };
            let mut grads = vec![input, weight];
            if has_bias {
                grads.push(bias);
            }
            Ok(grads)
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device, Generator};

    /// Direct-loop reference convolution in f64.
    fn naive(
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        p: &Conv2dParams,
    ) -> (Vec<usize>, Vec<f64>) {
        let (xd, wd) = (x.dims().to_vec(), w.dims().to_vec());
        let (xv, wv) = (x.to_vec_f64().unwrap(), w.to_vec_f64().unwrap());
        let bv = b.map(|b| b.to_vec_f64().unwrap());
        let oh = (xd[2] + 2 * p.padding.0 - p.dilation.0 * (wd[2] - 1) - 1) / p.stride.0 + 1;
        let ow = (xd[3] + 2 * p.padding.1 - p.dilation.1 * (wd[3] - 1) - 1) / p.stride.1 + 1;
        let mut out = Vec::new();
        for n in 0..xd[0] {
            for o in 0..wd[0] {
                for i in 0..oh {
                    for j in 0..ow {
                        let mut acc = bv.as_ref().map_or(0.0, |b| b[o]);
                        for c in 0..xd[1] {
                            for a in 0..wd[2] {
                                for bb in 0..wd[3] {
                                    let y = (i * p.stride.0 + a * p.dilation.0) as isize
                                        - p.padding.0 as isize;
                                    let z = (j * p.stride.1 + bb * p.dilation.1) as isize
                                        - p.padding.1 as isize;
                                    if y < 0 || z < 0 || y >= xd[2] as isize || z >= xd[3] as isize
                                    {
                                        continue;
                                    }
                                    let xi =
                                        ((n * xd[1] + c) * xd[2] + y as usize) * xd[3] + z as usize;
                                    let wi = ((o * wd[1] + c) * wd[2] + a) * wd[3] + bb;
                                    acc += xv[xi] * wv[wi];
                                }
                            }
                        }
                        out.push(acc);
                    }
                }
            }
        }
        (vec![xd[0], wd[0], oh, ow], out)
    }

    fn params(
        stride: (usize, usize),
        padding: (usize, usize),
        dilation: (usize, usize),
    ) -> Conv2dParams {
        Conv2dParams {
            stride,
            padding,
            dilation,
        }
    }

    #[test]
    fn conv2d_matches_direct_loops_across_strides_padding_and_dilation() {
        let cases = [
            ([2, 3, 7, 9], [4, 3, 3, 2], params((1, 1), (0, 0), (1, 1))),
            ([3, 2, 9, 8], [5, 2, 3, 3], params((2, 1), (1, 2), (1, 2))),
            ([1, 1, 28, 28], [6, 1, 5, 5], params((1, 1), (2, 2), (1, 1))),
            (
                [5, 6, 10, 10],
                [16, 6, 5, 5],
                params((1, 1), (0, 0), (1, 1)),
            ),
            ([4, 4, 8, 8], [8, 4, 1, 1], params((2, 2), (0, 0), (1, 1))),
            ([2, 2, 11, 7], [3, 2, 2, 3], params((3, 2), (1, 1), (2, 1))),
            ([2, 3, 9, 8], [4, 3, 3, 5], params((1, 1), (1, 2), (1, 1))),
            ([3, 2, 8, 8], [4, 2, 3, 3], params((1, 1), (2, 2), (2, 2))),
            ([2, 6, 13, 13], [4, 6, 5, 5], params((1, 1), (2, 2), (1, 1))),
            (
                [2, 16, 25, 25],
                [3, 16, 3, 3],
                params((2, 2), (1, 1), (1, 1)),
            ),
        ];
        for (i, (xs, ws, p)) in cases.iter().enumerate() {
            let x = rand_f64(xs, i as u64);
            let w = rand_f64(ws, 10 + i as u64);
            let b = rand_f64(&[ws[0]], 20 + i as u64);
            let (shape, want) = naive(&x, &w, Some(&b), p);
            let got = conv2d(&x, &w, Some(&b), p).unwrap();
            assert_eq!(got.dims(), shape.as_slice(), "case {i}");
            for (k, (g, e)) in got.to_vec_f64().unwrap().iter().zip(&want).enumerate() {
                assert!((g - e).abs() < 1e-12, "case {i} element {k}: {g} vs {e}");
            }
            let (_, want) = naive(&x, &w, None, p);
            let got = conv2d(&x, &w, None, p).unwrap().to_vec_f64().unwrap();
            assert!(got.iter().zip(&want).all(|(g, e)| (g - e).abs() < 1e-12));
        }
    }

    #[test]
    fn empty_batch_gives_an_empty_output_and_zero_weight_gradient() {
        let x = rand_f64(&[0, 2, 5, 5], 1);
        let w = rand_f64(&[3, 2, 3, 3], 2);
        let y = conv2d(&x, &w, None, &params((1, 1), (1, 1), (1, 1))).unwrap();
        assert_eq!(y.dims(), &[0, 3, 5, 5]);
        let loss = crate::sum_all(&y).unwrap();
        tandem_autograd::backward(&loss, None, &Default::default()).unwrap();
        assert!(w
            .grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .all(|&v| v == 0.0));
    }

    #[test]
    fn f32_conv2d_agrees_with_the_f64_reference() {
        let mut g = Generator::new(3);
        let x = Tensor::rand(&[6, 4, 12, 12], -1.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let w = Tensor::rand(&[8, 4, 3, 3], -1.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let p = params((1, 1), (1, 1), (1, 1));
        let (_, want) = naive(&x, &w, None, &p);
        let got = conv2d(&x, &w, None, &p).unwrap().to_vec_f64().unwrap();
        for (g, e) in got.iter().zip(&want) {
            assert!((g - e).abs() < 1e-4, "{g} vs {e}");
        }
    }

    #[test]
    fn f32_gradients_agree_with_the_finite_difference_checked_f64_ones() {
        // Shapes that take the f32 kernels: implicit gemm forward and weight gradient with
        // unit and larger strides, the input gradient as a convolution or through col2im.
        let cases = [
            ([3, 8, 10, 9], [16, 8, 3, 3], params((1, 1), (1, 1), (1, 1))),
            (
                [2, 3, 12, 12],
                [16, 3, 3, 3],
                params((1, 1), (1, 1), (1, 1)),
            ),
            (
                [3, 16, 11, 12],
                [32, 16, 3, 3],
                params((2, 2), (1, 1), (1, 1)),
            ),
            (
                [2, 6, 14, 14],
                [16, 6, 5, 5],
                params((1, 1), (0, 0), (1, 1)),
            ),
            (
                [2, 5, 13, 11],
                [24, 5, 3, 2],
                params((2, 3), (2, 1), (2, 1)),
            ),
            // Strided with few output channels: Wᵀ·g of the col2im path by the tile kernel,
            // with a ragged channel block.
            ([2, 4, 9, 10], [12, 4, 3, 3], params((2, 2), (1, 1), (1, 1))),
        ];
        for (i, (xs, ws, p)) in cases.iter().enumerate() {
            let leaves = [
                rand_f64(xs, 70 + i as u64),
                rand_f64(ws, 80 + i as u64),
                rand_f64(&[ws[0]], 90 + i as u64),
            ];
            let singles: Vec<Tensor> = leaves
                .iter()
                .map(|t| {
                    t.to_dtype(DType::F32)
                        .unwrap()
                        .detach()
                        .with_requires_grad()
                        .unwrap()
                })
                .collect();
            let y64 = conv2d(&leaves[0], &leaves[1], Some(&leaves[2]), p).unwrap();
            let gy = rand_f64(y64.dims(), 100 + i as u64).detach();
            tandem_autograd::backward(&y64, Some(&gy), &Default::default()).unwrap();
            let y32 = conv2d(&singles[0], &singles[1], Some(&singles[2]), p).unwrap();
            let gy32 = gy.to_dtype(DType::F32).unwrap();
            tandem_autograd::backward(&y32, Some(&gy32), &Default::default()).unwrap();
            for (name, (a, b)) in ["x", "weight", "bias"]
                .iter()
                .zip(leaves.iter().zip(&singles))
            {
                let want = a.grad().unwrap().to_vec_f64().unwrap();
                let got = b.grad().unwrap().to_vec_f64().unwrap();
                for (k, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() < 1e-4 * (1.0 + e.abs()),
                        "case {i} grad {name} element {k}: {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn gradcheck_conv2d_with_stride_padding_dilation_and_odd_kernels() {
        let cases = [
            ([2, 3, 7, 9], [4, 3, 3, 2], params((1, 1), (0, 0), (1, 1))),
            ([2, 2, 9, 8], [3, 2, 3, 3], params((2, 2), (1, 1), (1, 1))),
            ([3, 2, 9, 7], [2, 2, 2, 3], params((1, 2), (1, 0), (2, 2))),
            ([1, 3, 6, 5], [2, 3, 1, 1], params((2, 1), (0, 1), (1, 1))),
            // "Same" padding: the shifted-plane im2col path, also dilated.
            ([2, 2, 6, 7], [3, 2, 3, 3], params((1, 1), (1, 1), (1, 1))),
            ([1, 2, 7, 6], [2, 2, 3, 5], params((1, 1), (2, 4), (2, 2))),
            // Enough channels for the pixel-major weight-gradient path (kw·C ≥ 16), strided
            // and dilated along either dim.
            ([2, 8, 5, 6], [3, 8, 3, 3], params((2, 1), (1, 1), (2, 1))),
            ([1, 16, 5, 5], [2, 16, 2, 3], params((1, 2), (1, 2), (1, 2))),
            // Outputs large enough to be processed in several pixel tiles, split mid-row.
            ([1, 6, 13, 13], [2, 6, 5, 5], params((1, 1), (2, 2), (1, 1))),
            (
                [1, 16, 25, 25],
                [2, 16, 3, 3],
                params((2, 2), (1, 1), (1, 1)),
            ),
            (
                [1, 3, 16, 16],
                [2, 3, 11, 5],
                params((1, 1), (5, 2), (1, 1)),
            ),
        ];
        for (i, (xs, ws, p)) in cases.iter().enumerate() {
            let inputs = [
                rand_f64(xs, 30 + i as u64),
                rand_f64(ws, 40 + i as u64),
                rand_f64(&[ws[0]], 50 + i as u64),
            ];
            check(|t| conv2d(&t[0], &t[1], Some(&t[2]), p), &inputs);
        }
        // Strided (transposed) input and weight; no bias; only some inputs needing grad.
        let p = params((2, 1), (1, 1), (1, 2));
        check(
            |t| conv2d(&t[0], &t[1], None, &p),
            &[
                rand_f64_noncontiguous(&[2, 2, 7, 8], 60),
                rand_f64_noncontiguous(&[3, 2, 3, 2], 61),
            ],
        );
        let fixed_x = rand_f64(&[2, 2, 6, 6], 62).detach();
        check(
            |t| conv2d(&fixed_x, &t[0], Some(&t[1]), &p),
            &[rand_f64(&[3, 2, 2, 2], 63), rand_f64(&[3], 64)],
        );
        let fixed_w = rand_f64(&[3, 2, 2, 2], 65).detach();
        check(
            |t| conv2d(&t[0], &fixed_w, None, &p),
            &[rand_f64(&[3, 2, 6, 5], 66)],
        );
    }

    #[test]
    fn bad_shapes_are_errors_naming_both_shapes() {
        let x = Tensor::zeros(&[2, 3, 8, 8], DType::F32, Device::Cpu).unwrap();
        let w = Tensor::zeros(&[4, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
        let err = conv2d(&x, &w, None, &Conv2dParams::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("conv2d:")
                && err.contains("[2, 3, 8, 8]")
                && err.contains("[4, 2, 3, 3]"),
            "{err}"
        );
        let w = Tensor::zeros(&[4, 3, 11, 3], DType::F32, Device::Cpu).unwrap();
        let err = conv2d(&x, &w, None, &params((1, 1), (1, 1), (1, 1)))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("conv2d:")
                && err.contains("[2, 3, 8, 8]")
                && err.contains("[4, 3, 11, 3]"),
            "{err}"
        );
        let w = Tensor::zeros(&[4, 3, 3, 3], DType::F32, Device::Cpu).unwrap();
        let dilated = params((1, 1), (0, 0), (4, 1));
        assert!(conv2d(&x, &w, None, &dilated)
            .unwrap_err()
            .to_string()
            .contains("dilation"));
        let flat = Tensor::zeros(&[3, 8, 8], DType::F32, Device::Cpu).unwrap();
        let err = conv2d(&flat, &w, None, &Conv2dParams::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("[3, 8, 8]"), "{err}");
        let zero_stride = params((0, 1), (0, 0), (1, 1));
        assert!(conv2d(&x, &w, None, &zero_stride).is_err());
        let b = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
        assert!(conv2d(&x, &w, Some(&b), &Conv2dParams::default())
            .unwrap_err()
            .to_string()
            .contains("[3]"));
    }
}
