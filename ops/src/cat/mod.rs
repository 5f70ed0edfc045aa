//! cat: joins tensors along an existing dim.
//!
//! # Shapes
//! `tensors`: one or more tensors of one rank (≥ 1), dtype and device whose shapes agree
//! except along `dim` → output: that shape with `dim` the sum of their sizes along `dim`.
//! Any dtype may be joined; gradients flow to the float inputs that require them, each
//! receiving its slice of the output gradient.

mod cpu;
mod cuda;

use tandem_autograd::record_fn;
use tandem_core::{checked_numel, normalize_dim, with_element_type, Device, Error, Result, Tensor};

use crate::checks::same_dtype_device;

/// Concatenates `tensors` along `dim` (negative counts from the end).
///
/// # Shapes
/// `[a0, …, k1, …, an]`, `[a0, …, k2, …, an]`, … (the `k`s at `dim`) → output
/// `[a0, …, k1 + k2 + …, …, an]`.
pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("cat", tandem_core::profile::Phase::Forward);
    let first = tensors
        .first()
        .ok_or_else(|| Error::invalid("cat", "needs at least one tensor, got an empty list"))?;
    if first.rank() == 0 {
        return Err(Error::shape(
            "cat",
            "cannot concatenate 0-dim tensors; unsqueeze them to shape [1] first",
        ));
    }
    let d = normalize_dim("cat", dim, first.rank())?;
    let mut shape = first.dims().to_vec();
    shape[d] = 0;
    for (i, t) in tensors.iter().enumerate() {
        same_dtype_device("cat", first, t)?;
        let agrees = t.rank() == first.rank()
            && (0..t.rank()).all(|k| k == d || t.dims()[k] == first.dims()[k]);
        if !agrees {
            return Err(Error::shape(
                "cat",
                format!(
                    "tensor {i} has shape {:?} but tensor 0 has shape {:?}; shapes must match \
                     in every dim except the cat dim {d}",
                    t.dims(),
                    first.dims()
                ),
            ));
        }
        shape[d] = shape[d]
            .checked_add(t.dims()[d])
            .ok_or_else(|| too_large(tensors, d))?;
    }
    checked_numel("cat", &shape)?;
    let out = match first.device() {
        Device::Cpu => with_element_type!(first.dtype(), T => cpu::cat::<T>(tensors, d, &shape))?,
        Device::Cuda(_) => cuda::cat(tensors, d, &shape)?,
    };
    let parts: Vec<(bool, Vec<usize>)> = tensors
        .iter()
        .map(|t| (t.requires_grad(), t.dims().to_vec()))
        .collect();
    Ok(record_fn(out, tensors, "cat", move || {
        move |g: &Tensor| {
            let mut start = 0;
            let mut grads = Vec::with_capacity(parts.len());
            for (needs, part_shape) in &parts {
                grads.push(if *needs {
                    Some(match g.device() {
                        Device::Cpu => with_element_type!(g.dtype(), T => {
                            cpu::slice_back::<T>(g, d, start, part_shape)
                        })?,
                        Device::Cuda(_) => cuda::slice_back(g, d, start, part_shape)?,
                    })
                } else {
                    None
                });
                start += part_shape[d];
            }
            Ok(grads)
        }
    }))
}

/// The error for inputs whose sizes along the cat dim add up past `usize`.
fn too_large(tensors: &[&Tensor], d: usize) -> Error {
    let sizes: Vec<usize> = tensors.iter().map(|t| t.dims()[d]).collect();
    Error::shape(
        "cat",
        format!(
            "the sizes {sizes:?} along dim {d} add up to more elements than any tensor can hold"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device, Generator};

    #[test]
    fn gradcheck_cat_along_several_dims() {
        let (a, b, c) = (
            rand_f64(&[2, 3, 4], 1),
            rand_f64(&[2, 1, 4], 2),
            rand_f64(&[2, 5, 4], 3),
        );
        check(|t| cat(&[&t[0], &t[1], &t[2]], 1), &[a, b, c]);
        check(
            |t| cat(&[&t[0], &t[1]], 0),
            &[rand_f64(&[1, 3, 4], 4), rand_f64(&[3, 3, 4], 5)],
        );
        check(
            |t| cat(&[&t[0], &t[1]], -1),
            &[rand_f64(&[2, 3, 2], 6), rand_f64(&[2, 3, 5], 7)],
        );
        // strided inputs, and one input that needs no gradient
        let fixed = rand_f64(&[4, 2], 8).detach();
        check(
            |t| cat(&[&t[0], &fixed, &t[1]], 1),
            &[
                rand_f64_noncontiguous(&[4, 3], 9),
                rand_f64_noncontiguous(&[4, 5], 10),
            ],
        );
        check(|t| cat(&[&t[0], &t[0]], 0), &[rand_f64(&[2, 3], 11)]);
    }

    #[test]
    fn values_are_placed_in_order_along_the_dim() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap();
        let b = Tensor::from_vec(vec![5.0f32, 6.0], &[2, 1], Device::Cpu).unwrap();
        let c = cat(&[&a, &b], 1).unwrap();
        assert_eq!(c.dims(), &[2, 3]);
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![1., 2., 5., 3., 4., 6.]);
        let r = cat(&[&a, &a], 0).unwrap();
        assert_eq!(
            r.to_vec::<f32>().unwrap(),
            vec![1., 2., 3., 4., 1., 2., 3., 4.]
        );
        // integer tensors too
        let l = Tensor::from_vec(vec![3i64, 1], &[2], Device::Cpu).unwrap();
        let m = Tensor::from_vec(vec![7i64], &[1], Device::Cpu).unwrap();
        assert_eq!(
            cat(&[&l, &m], 0).unwrap().to_vec::<i64>().unwrap(),
            vec![3, 1, 7]
        );
        // a zero-size part is allowed
        let empty = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu).unwrap();
        assert_eq!(cat(&[&a, &empty], 1).unwrap().dims(), &[2, 2]);
    }

    #[test]
    fn large_strided_inputs_match_an_index_loop() {
        let mut g = Generator::new(12);
        let a = Tensor::randn(&[200, 300], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let at = a
            .view_detached(a.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        let b = Tensor::randn(&[300, 50], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let c = cat(&[&at, &b], 1).unwrap();
        assert_eq!(c.dims(), &[300, 250]);
        let (av, bv, cv) = (
            a.to_vec::<f32>().unwrap(),
            b.to_vec::<f32>().unwrap(),
            c.to_vec::<f32>().unwrap(),
        );
        for i in 0..300 {
            for j in 0..250 {
                let want = if j < 200 {
                    av[j * 300 + i]
                } else {
                    bv[i * 50 + j - 200]
                };
                assert_eq!(cv[i * 250 + j], want);
            }
        }
    }

    #[test]
    fn mismatched_inputs_are_errors_naming_cat_and_the_shapes() {
        let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[4, 3], DType::F32, Device::Cpu).unwrap();
        let err = cat(&[&a, &b], 1).unwrap_err().to_string();
        assert!(
            err.starts_with("cat:") && err.contains("[2, 3]") && err.contains("[4, 3]"),
            "{err}"
        );
        assert_eq!(cat(&[&a, &b], 0).unwrap().dims(), &[6, 3]);
        let c = Tensor::zeros(&[2, 3, 1], DType::F32, Device::Cpu).unwrap();
        let err = cat(&[&a, &c], 0).unwrap_err().to_string();
        assert!(err.contains("[2, 3, 1]"), "{err}");
        let d = Tensor::zeros(&[2, 3], DType::F64, Device::Cpu).unwrap();
        assert!(cat(&[&a, &d], 0).unwrap_err().to_string().contains("dtype"));
        assert!(cat(&[], 0).unwrap_err().to_string().starts_with("cat:"));
        let err = cat(&[&a], 2).unwrap_err().to_string();
        assert!(err.contains("cat") && err.contains("out of range"), "{err}");
        let s = Tensor::scalar(1.0f32, Device::Cpu).unwrap();
        assert!(cat(&[&s, &s], 0).unwrap_err().to_string().contains("0-dim"));
    }
}
