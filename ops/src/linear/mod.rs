//! The affine map of a fully connected layer, `y = x·Wᵀ + b`, as one gemm with the bias fused
//! in (the output starts as the bias and the product accumulates onto it; on CUDA one
//! broadcast copy writes the bias and cuBLAS accumulates with `beta = 1`).
//!
//! The weight is read transposed through its strides, and the leading dims of `x` fold into the
//! rows of a single product. The backward is two more products, `grad_x = g·W` and
//! `grad_W = gᵀ·x` (the leading dims fold into the contraction), and `grad_b`, the column sums
//! of `g`.

mod cpu;
mod cuda;

use tandem_autograd::record_fn;
use tandem_core::{Device, Error, Layout, Result, Tensor};

use crate::autocast::{self, is_low, matrix_dtype};
use crate::checks::same_dtype_device;
use crate::matmul::batched_product;

/// `x` as a matrix: a 1-D input becomes a one-row view.
fn as_matrix(x: &Tensor) -> Result<Tensor> {
    if x.rank() == 1 {
        x.view_detached(x.layout().unsqueeze("linear", 0)?)
    } else {
        Ok(x.detach())
    }
}

fn check_inputs(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<()> {
    same_dtype_device("linear", x, weight)?;
    matrix_dtype("linear", x)?;
    if weight.rank() != 2 || x.rank() == 0 || x.dims()[x.rank() - 1] != weight.dims()[1] {
        return Err(Error::shape(
            "linear",
            format!(
                "input {:?} and weight {:?} do not fit: need input [.., in] and weight [out, in]",
                x.dims(),
                weight.dims()
            ),
        ));
    }
    if let Some(b) = bias {
        same_dtype_device("linear", x, b)?;
        if b.dims() != [weight.dims()[0]] {
            return Err(Error::shape(
                "linear",
                format!(
                    "bias {:?} does not match weight {:?}: need bias [{}]",
                    b.dims(),
                    weight.dims(),
                    weight.dims()[0]
                ),
            ));
        }
    }
    Ok(())
}

/// `x·weightᵀ + bias`: the fully connected layer.
///
/// # Shapes
/// - `x`: `[.., in]` (any number of leading dims, including none);
/// - `weight`: `[out, in]`;
/// - `bias`: `[out]` (optional);
/// - output: `[.., out]`.
///
/// All inputs share a float dtype and a device: f32/f64, or f16/bf16 on the CPU (computed with
/// f32 accumulation, rounded once). Under autocast f32 inputs are cast to the autocast dtype
/// first, the weight and bias through the weight cache (see `crate::autocast`). Mismatched
/// sizes are errors naming the shapes.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("linear", tandem_core::profile::Phase::Forward);
    let (x, weight) = (&autocast::lower(x)?, &autocast::lower(weight)?);
    let bias = autocast::lower_opt(bias)?;
    let bias = bias.as_ref();
    check_inputs(x, weight, bias)?;
    let xm = as_matrix(x)?;
    let batch = xm.dims()[..xm.rank() - 2].to_vec();
    let out = batched_product("linear", &xm, false, weight, true, &batch, &batch, bias)?;
    let mut out_shape = x.dims()[..x.rank() - 1].to_vec();
    out_shape.push(weight.dims()[0]);
    let out = out.view_detached(Layout::contiguous(&out_shape))?;

    let needs = (x.requires_grad(), weight.requires_grad());
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    Ok(record_fn(out, &inputs, "linear", move || {
        let (dx, dw) = (xm, weight.detach());
        move |g: &Tensor| {
            let gm = as_matrix(g)?;
            let grad_x = if needs.0 {
                let gx = batched_product(
                    "linear_backward",
                    &gm,
                    false,
                    &dw,
                    false,
                    &batch,
                    &batch,
                    None,
                )?;
                Some(gx.view_detached(Layout::contiguous(&input_shape(&dx, g)))?)
            } else {
                None
            };
            let grad_w = if needs.1 {
                Some(batched_product(
                    "linear_backward",
                    &gm,
                    true,
                    &dx,
                    false,
                    &batch,
                    &[],
                    None,
                )?)
            } else {
                None
            };
            let mut grads = vec![grad_x, grad_w];
            if has_bias {
                grads.push(Some(match g.device() {
                    Device::Cpu if is_low(g.dtype()) => cpu::low_precision_column_sums(g)?,
                    Device::Cpu => cpu::column_sums(g)?,
                    Device::Cuda(_) => cuda::column_sums("linear_backward", g)?,
                }));
            }
            Ok(grads)
        }
    }))
}

/// The shape of the original input: the matrix view's shape, minus the added row dim when the
/// input was a vector (then `g` is 1-D too).
fn input_shape(xm: &Tensor, g: &Tensor) -> Vec<usize> {
    if g.rank() == 1 {
        vec![xm.dims()[1]]
    } else {
        xm.dims().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device};

    #[test]
    fn linear_matches_a_direct_loop_with_bias() {
        let x = rand_f64(&[2, 3, 5], 1);
        let w = rand_f64(&[4, 5], 2);
        let b = rand_f64(&[4], 3);
        let y = linear(&x, &w, Some(&b)).unwrap();
        assert_eq!(y.dims(), &[2, 3, 4]);
        let (xv, wv, bv) = (
            x.to_vec_f64().unwrap(),
            w.to_vec_f64().unwrap(),
            b.to_vec_f64().unwrap(),
        );
        let yv = y.to_vec_f64().unwrap();
        for r in 0..6 {
            for o in 0..4 {
                let want: f64 = bv[o] + (0..5).map(|i| xv[r * 5 + i] * wv[o * 5 + i]).sum::<f64>();
                assert!((yv[r * 4 + o] - want).abs() < 1e-12);
            }
        }
        let v = rand_f64(&[5], 4);
        assert_eq!(linear(&v, &w, None).unwrap().dims(), &[4]);
    }

    #[test]
    fn gradcheck_linear_with_and_without_bias() {
        check(
            |t| linear(&t[0], &t[1], Some(&t[2])),
            &[
                rand_f64(&[3, 5], 10),
                rand_f64(&[4, 5], 11),
                rand_f64(&[4], 12),
            ],
        );
        check(
            |t| linear(&t[0], &t[1], Some(&t[2])),
            &[
                rand_f64(&[2, 3, 5], 13),
                rand_f64(&[4, 5], 14),
                rand_f64(&[4], 15),
            ],
        );
        check(
            |t| linear(&t[0], &t[1], None),
            &[rand_f64(&[5], 16), rand_f64(&[4, 5], 17)],
        );
        // Strided input and weight (transposed views).
        check(
            |t| linear(&t[0], &t[1], Some(&t[2])),
            &[
                rand_f64_noncontiguous(&[2, 3, 5], 18),
                rand_f64_noncontiguous(&[4, 5], 19),
                rand_f64(&[4], 20),
            ],
        );
    }

    #[test]
    fn mismatched_shapes_are_errors_naming_them() {
        let x = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let w = Tensor::zeros(&[4, 5], DType::F32, Device::Cpu).unwrap();
        let err = linear(&x, &w, None).unwrap_err().to_string();
        assert!(
            err.starts_with("linear:") && err.contains("[2, 3]") && err.contains("[4, 5]"),
            "{err}"
        );
        let w = Tensor::zeros(&[4, 3], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[5], DType::F32, Device::Cpu).unwrap();
        let err = linear(&x, &w, Some(&b)).unwrap_err().to_string();
        assert!(err.contains("[5]") && err.contains("[4, 3]"), "{err}");
    }
}
