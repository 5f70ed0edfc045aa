//! `max` over dims and `argmax` along one dim.
//!
//! Each output element is the maximum of one group of elements (the reduced dims), and the
//! kernel remembers where the group's first maximum was. NaN counts as larger than every
//! number, so a NaN in a group is its maximum, as in PyTorch. `max`'s backward sends each
//! output gradient to that first maximal element only (a subgradient at ties).

use tandem_autograd::record_fn;
use tandem_core::{normalize_dim, Device, Error, Layout, Result, Tensor};

use super::{cpu, cuda, keepdim_shape, resolve_dims};
use crate::checks::float_dtype;

/// The maximum over `dims` (all dims when empty), keeping them as size-1 dims if `keepdim`.
///
/// The gradient flows to the first maximal element (in row-major order) of each reduced group.
///
/// # Shapes
/// `x`: `[d0, …, dn]` → output: `x`'s shape without the reduced dims (with them as `1` when
/// `keepdim`). Reducing a dim of size 0 is an error.
pub fn max(x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
    const OP: &str = "max";
    let _profile = tandem_core::profile::scope(OP, tandem_core::profile::Phase::Forward);
    if x.dtype().is_half() {
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| max(&w[0], dims, keepdim));
    }
    float_dtype(OP, x)?;
    let dims = resolve_dims(OP, x, dims)?;
    let kept = keepdim_shape(x, &dims);
    let (values, positions) = groups_max(OP, x, &dims, &kept)?;
    let out = if keepdim {
        values
    } else {
        values.view_detached(Layout::contiguous(&without(x.dims(), &dims)))?
    };
    let in_shape = x.dims().to_vec();
    Ok(record_fn(out, &[x], OP, move || {
        move |g: &Tensor| {
            let grad = match g.device() {
                Device::Cpu => cpu::max_backward(g, &positions, &in_shape, &dims)?,
                Device::Cuda(_) => {
                    cuda::max_backward("max backward", g, &positions, &in_shape, &dims)?
                }
            };
            Ok(vec![Some(grad)])
        }
    }))
}

/// The index of the first maximum along `dim`, as an i64 tensor. Not differentiable.
///
/// # Shapes
/// `x`: `[d0, …, dn]` → output: `x`'s shape without `dim` (with it as `1` when `keepdim`).
/// `dim` must not have size 0.
pub fn argmax(x: &Tensor, dim: isize, keepdim: bool) -> Result<Tensor> {
    const OP: &str = "argmax";
    if x.dtype().is_half() {
        // Widening is exact, so the positions are the half tensor's own.
        return argmax(&x.to_dtype(tandem_core::DType::F32)?, dim, keepdim);
    }
    float_dtype(OP, x)?;
    let d = normalize_dim(OP, dim, x.rank())?;
    let kept = keepdim_shape(x, &[d]);
    let (_, positions) = groups_max(OP, x, &[d], &kept)?;
    if keepdim {
        Ok(positions)
    } else {
        positions.view_detached(Layout::contiguous(&without(x.dims(), &[d])))
    }
}

/// `dims` of `shape` left out.
fn without(shape: &[usize], dims: &[usize]) -> Vec<usize> {
    (0..shape.len())
        .filter(|d| !dims.contains(d))
        .map(|d| shape[d])
        .collect()
}

/// The maximum of each group over `dims` and the position of its first maximum (see
/// [`cpu::max`]), after checking that the groups are not empty.
fn groups_max(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
    kept: &[usize],
) -> Result<(Tensor, Tensor)> {
    let inner: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let outer: usize = kept.iter().product();
    if inner == 0 && outer > 0 {
        return Err(Error::shape(
            op,
            format!(
                "cannot take the maximum over dims {dims:?} of shape {:?}: they hold no elements",
                x.dims()
            ),
        ));
    }
    match x.device() {
        Device::Cpu => cpu::max(op, x, dims, kept),
        Device::Cuda(_) => cuda::max(op, x, dims, kept),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64_noncontiguous};
    use tandem_autograd::TensorBackward;
    use tandem_core::{DType, Device, Generator};

    /// A leaf whose values are a shuffle of `0, 0.01, 0.02, …` (minus an offset): every group
    /// has a maximum at least 0.01 clear of the rest, far from the ties where `max` has a kink.
    fn spaced(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut values: Vec<f64> = (0..n).map(|i| i as f64 * 0.01 - 0.3).collect();
        Generator::new(seed).shuffle(&mut values);
        Tensor::from_vec(values, shape, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap()
    }

    #[test]
    fn gradcheck_max_over_single_multiple_and_all_dims() {
        let x = spaced(&[3, 4, 5], 1);
        check(|t| max(&t[0], &[1], false), std::slice::from_ref(&x));
        check(|t| max(&t[0], &[-1], true), std::slice::from_ref(&x));
        check(|t| max(&t[0], &[0, 2], false), std::slice::from_ref(&x));
        check(|t| max(&t[0], &[2, 0], true), std::slice::from_ref(&x));
        check(|t| max(&t[0], &[], false), &[x]);
        // strided input: the spaced values moved into a transposed view
        let nc = rand_f64_noncontiguous(&[4, 6], 2);
        nc.copy_(&spaced(&[4, 6], 3).detach()).unwrap();
        check(|t| max(&t[0], &[0], false), std::slice::from_ref(&nc));
        check(|t| max(&t[0], &[1], true), &[nc]);
    }

    #[test]
    fn max_values_match_a_direct_loop() {
        let x = spaced(&[3, 4, 5], 4).detach();
        let v = x.to_vec::<f64>().unwrap();
        let m = max(&x, &[0, 2], false).unwrap();
        assert_eq!(m.dims(), &[4]);
        let want: Vec<f64> = (0..4)
            .map(|j| {
                let mut best = f64::NEG_INFINITY;
                for i in 0..3 {
                    for k in 0..5 {
                        best = best.max(v[i * 20 + j * 5 + k]);
                    }
                }
                best
            })
            .collect();
        assert_eq!(m.to_vec::<f64>().unwrap(), want);
        assert_eq!(max(&x, &[0, 2], true).unwrap().dims(), &[1, 4, 1]);
        let all = max(&x, &[], false).unwrap();
        assert_eq!(all.dims(), &[] as &[usize]);
        assert_eq!(
            all.item().unwrap(),
            v.iter().cloned().fold(f64::MIN, f64::max)
        );
    }

    #[test]
    fn max_gradient_goes_to_the_first_of_tied_maxima() {
        let x = Tensor::from_vec(vec![1.0f32, 3.0, 3.0, 2.0, 5.0, 5.0], &[2, 3], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        let m = max(&x, &[1], false).unwrap();
        assert_eq!(m.to_vec::<f32>().unwrap(), vec![3.0, 5.0]);
        crate::reduce::sum_all(&m).unwrap().backward().unwrap();
        assert_eq!(
            x.grad().unwrap().to_vec::<f32>().unwrap(),
            vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
        );
    }

    #[test]
    fn nan_is_the_maximum_of_its_group() {
        let x = Tensor::from_vec(vec![1.0f32, f32::NAN, 7.0, 2.0], &[1, 4], Device::Cpu).unwrap();
        assert!(max(&x, &[1], false).unwrap().item().unwrap().is_nan());
        assert_eq!(
            argmax(&x, 1, false).unwrap().to_vec::<i64>().unwrap(),
            vec![1]
        );
    }

    #[test]
    fn argmax_returns_first_index_of_the_maximum_as_i64() {
        let x = Tensor::from_vec(
            vec![0.5f32, 2.0, 2.0, -1.0, /* row 1 */ 9.0, 0.0, 3.0, 9.0],
            &[2, 4],
            Device::Cpu,
        )
        .unwrap()
        .with_requires_grad()
        .unwrap();
        let rows = argmax(&x, -1, false).unwrap();
        assert_eq!(rows.dtype(), DType::I64);
        assert!(!rows.requires_grad());
        assert_eq!(rows.to_vec::<i64>().unwrap(), vec![1, 0]);
        let cols = argmax(&x, 0, true).unwrap();
        assert_eq!(cols.dims(), &[1, 4]);
        assert_eq!(cols.to_vec::<i64>().unwrap(), vec![1, 0, 1, 1]);
        // strided input, large enough for the parallel path
        let mut g = Generator::new(9);
        let big = Tensor::randn(&[300, 200], 0.0, 1.0, DType::F64, Device::Cpu, &mut g).unwrap();
        let t = big
            .view_detached(big.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        let got = argmax(&t, 1, false).unwrap().to_vec::<i64>().unwrap();
        let v = big.to_vec::<f64>().unwrap();
        for (j, &k) in got.iter().enumerate() {
            let column: Vec<f64> = (0..300).map(|i| v[i * 200 + j]).collect();
            let best = column.iter().cloned().fold(f64::MIN, f64::max);
            assert_eq!(column[k as usize], best);
        }
    }

    #[test]
    fn bad_input_is_an_error_naming_the_op() {
        let empty = Tensor::zeros(&[3, 0], DType::F32, Device::Cpu).unwrap();
        let err = max(&empty, &[1], false).unwrap_err().to_string();
        assert!(err.starts_with("max:") && err.contains("[3, 0]"), "{err}");
        assert_eq!(max(&empty, &[0], false).unwrap().dims(), &[0]);
        let err = argmax(&empty, 1, false).unwrap_err().to_string();
        assert!(err.starts_with("argmax:"), "{err}");
        let labels = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
        assert!(max(&labels, &[0], false)
            .unwrap_err()
            .to_string()
            .contains("i64"));
        let x = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let err = argmax(&x, 2, false).unwrap_err().to_string();
        assert!(
            err.contains("argmax") && err.contains("out of range"),
            "{err}"
        );
        let err = max(&x, &[0, 0], false).unwrap_err().to_string();
        assert!(err.contains("max") && err.contains("twice"), "{err}");
    }
}
