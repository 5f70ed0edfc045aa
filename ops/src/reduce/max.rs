//! `max` over dims and `argmax` along one dim, with the CPU kernel they share.
//!
//! The reduced dims are moved last (a copy only when they are not already trailing dims of a
//! contiguous input), then each output element scans one contiguous block and remembers where
//! its first maximum was. NaN counts as larger than every number, so a NaN in a group is its
//! maximum, as in PyTorch. `max`'s backward sends each output gradient to that first maximal
//! element only (a subgradient at ties).

use rayon::prelude::*;
use tandem_autograd::record_fn;
use tandem_core::{
    normalize_dim, with_float_type, Element, Error, FloatElement, Layout, Result, Tensor,
};

use super::{keepdim_shape, resolve_dims};
use crate::util::{float_dtype, parallel};

/// The maximum over `dims` (all dims when empty), keeping them as size-1 dims if `keepdim`.
///
/// The gradient flows to the first maximal element (in row-major order) of each reduced group.
///
/// # Shapes
/// `x`: `[d0, …, dn]` → output: `x`'s shape without the reduced dims (with them as `1` when
/// `keepdim`). Reducing a dim of size 0 is an error.
pub fn max(x: &Tensor, dims: &[isize], keepdim: bool) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("max", tandem_core::profile::Phase::Forward);
    float_dtype("max", x)?;
    let dims = resolve_dims("max", x, dims)?;
    let kept = keepdim_shape(x, &dims);
    let (values, positions) = with_float_type!("max", x.dtype(), T => {
        let (values, positions) = reduce_max::<T>("max", x, &dims)?;
        Ok((Tensor::from_vec(values, &kept, x.device())?, positions))
    })?;
    let out = if keepdim {
        values
    } else {
        let squeezed: Vec<usize> = (0..x.rank())
            .filter(|d| !dims.contains(d))
            .map(|d| x.dims()[d])
            .collect();
        values.view_detached(Layout::contiguous(&squeezed))?
    };
    let in_shape = x.dims().to_vec();
    Ok(record_fn(out, &[x], "max", move || {
        let flat = flat_positions(&in_shape, &dims, &positions);
        move |g: &Tensor| Ok(vec![Some(scatter_to(g, &in_shape, &flat)?)])
    }))
}

/// The index of the first maximum along `dim`, as an i64 tensor. Not differentiable.
///
/// # Shapes
/// `x`: `[d0, …, dn]` → output: `x`'s shape without `dim` (with it as `1` when `keepdim`).
/// `dim` must not have size 0.
pub fn argmax(x: &Tensor, dim: isize, keepdim: bool) -> Result<Tensor> {
    float_dtype("argmax", x)?;
    let d = normalize_dim("argmax", dim, x.rank())?;
    let positions = with_float_type!("argmax", x.dtype(), T => {
        reduce_max::<T>("argmax", x, &[d]).map(|(_, positions)| positions)
    })?;
    let indices: Vec<i64> = positions.into_iter().map(|k| k as i64).collect();
    let mut shape = x.dims().to_vec();
    if keepdim {
        shape[d] = 1;
    } else {
        shape.remove(d);
    }
    Tensor::from_vec(indices, &shape, x.device())
}

/// For each output element (row-major over the kept dims): the maximum of its group and the
/// position of the first maximum within the group (row-major over the reduced dims).
fn reduce_max<T: FloatElement>(
    op: &'static str,
    x: &Tensor,
    dims: &[usize],
) -> Result<(Vec<T>, Vec<usize>)> {
    let keep: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let inner: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let outer: usize = keep.iter().map(|&d| x.dims()[d]).product();
    if outer == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    if inner == 0 {
        return Err(Error::shape(
            op,
            format!(
                "cannot take the maximum over dims {dims:?} of shape {:?}: they hold no elements",
                x.dims()
            ),
        ));
    }
    let perm: Vec<usize> = keep.iter().chain(dims).copied().collect();
    let permuted = x.view_detached(x.layout().permute(op, &perm)?)?;
    let c = permuted.contiguous_detached()?;
    let data = c.read_slice::<T>()?;
    let pairs: Vec<(T, usize)> = if parallel(outer * inner) && outer > 1 {
        data.par_chunks(inner).map(first_max).collect()
    } else {
        data.chunks(inner).map(first_max).collect()
    };
    Ok(pairs.into_iter().unzip())
}

/// The first maximum of a non-empty block and its index (NaN beats every number).
fn first_max<T: FloatElement>(block: &[T]) -> (T, usize) {
    let mut best = block[0];
    let mut at = 0;
    for (i, &v) in block.iter().enumerate().skip(1) {
        if v > best || (v.is_nan() && !best.is_nan()) {
            best = v;
            at = i;
        }
    }
    (best, at)
}

/// Turns per-group positions (as returned by [`reduce_max`]) into row-major indices into the
/// input.
fn flat_positions(shape: &[usize], dims: &[usize], positions: &[usize]) -> Vec<usize> {
    let strides = Layout::contiguous(shape).strides().clone();
    let keep: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
    // row-major decomposition of a position within a group (or of a group number) into the
    // reduced (or kept) dims, weighted by the input's strides
    let offset_of = |mut k: usize, axes: &[usize]| -> usize {
        let mut off = 0;
        for &d in axes.iter().rev() {
            off += (k % shape[d]) * strides[d];
            k /= shape[d];
        }
        off
    };
    positions
        .iter()
        .enumerate()
        .map(|(o, &k)| offset_of(o, &keep) + offset_of(k, dims))
        .collect()
}

/// A zero tensor of `shape` with `g`'s elements written at the row-major positions `flat`.
fn scatter_to(g: &Tensor, shape: &[usize], flat: &[usize]) -> Result<Tensor> {
    with_float_type!("max backward", g.dtype(), T => {
        let mut grad = vec![T::ZERO; shape.iter().product()];
        if !flat.is_empty() {
            let gc = g.contiguous_detached()?;
            let src = gc.read_slice::<T>()?;
            for (&p, &v) in flat.iter().zip(src.iter()) {
                grad[p] = v;
            }
        }
        Tensor::from_vec(grad, shape, g.device())
    })
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
