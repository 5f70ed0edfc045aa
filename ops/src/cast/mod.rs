//! The differentiable dtype conversion: `cast(x, dtype)` rounds `x` to `dtype` and its backward
//! converts the gradient back to `x`'s dtype. Autocast is built on it: the f32 master weights
//! receive f32 gradients from the low-precision copies the matrix ops use.

use tandem_autograd::record_fn;
use tandem_core::{DType, Error, Result, Tensor};

/// `x` converted to `dtype` (round to nearest for floats), recorded for autograd: the gradient
/// flowing back is converted to `x`'s dtype. Casting to `x`'s own dtype returns `x` itself.
///
/// # Shapes
/// Any; the output has `x`'s shape (contiguous).
///
/// A tensor that requires grad can only be cast to a float dtype (f32, f64, f16, bf16); other
/// conversions are allowed for tensors outside the graph.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    if x.requires_grad() && !dtype.is_float() {
        return Err(Error::UnsupportedDType {
            op: "cast",
            dtype,
            supported: "f32, f64, f16, bf16 for a tensor that requires grad",
        });
    }
    let _profile = tandem_core::profile::scope("cast", tandem_core::profile::Phase::Forward);
    let out = x.to_dtype(dtype)?;
    let source = x.dtype();
    Ok(record_fn(out, &[x], "cast", move || {
        move |g: &Tensor| Ok(vec![Some(g.to_dtype(source)?)])
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_autograd::TensorBackward;
    use tandem_core::Device;

    #[test]
    fn cast_rounds_forward_and_returns_gradients_in_the_source_dtype() {
        let x = Tensor::from_vec(vec![1.0f32, 1.0 + 1.0 / 512.0, -3.25], &[3], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        for (dtype, second) in [(DType::BF16, 1.0), (DType::F16, 1.0 + 1.0 / 512.0)] {
            let y = cast(&x, dtype).unwrap();
            assert_eq!(y.dtype(), dtype);
            // 1 + 2^-9 is below bf16's resolution at 1 (2^-7) and exact in f16 (2^-10).
            assert_eq!(y.to_vec_f64().unwrap(), vec![1.0, second, -3.25]);
            let seed = Tensor::from_vec(vec![0.5f64, 2.0, -1.0], &[3], Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            x.set_grad(None).unwrap();
            y.backward_with(Some(&seed), &Default::default()).unwrap();
            let g = x.grad().unwrap();
            assert_eq!(g.dtype(), DType::F32);
            assert_eq!(g.to_vec_f64().unwrap(), vec![0.5, 2.0, -1.0]);
        }
        assert!(cast(&x, DType::F32).unwrap().same_tensor(&x));
        let err = cast(&x, DType::I64).unwrap_err().to_string();
        assert!(err.contains("cast") && err.contains("i64"), "{err}");
        let plain = x.detach();
        assert_eq!(cast(&plain, DType::I64).unwrap().dtype(), DType::I64);
    }
}
