//! Elementwise binary ops with NumPy broadcasting: add, sub, mul, div, and their scalar forms.
//!
//! # Shapes
//! `a` and `b` broadcast to a common shape (align right; a dim of size 1 stretches); the output
//! has that shape. Backward sums each input's gradient over the dims it was broadcast along.
//! Both inputs must share dtype (f32 or f64) and device.

mod cpu;

use tandem_autograd::record_fn;
use tandem_core::{broadcast_shapes, Result, Tensor};

use crate::util::{float_dtype, same_dtype_device, sum_to_shape};

pub(crate) use cpu::BinaryKind;

fn binary(op: &'static str, kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope(op, tandem_core::profile::Phase::Forward);
    same_dtype_device(op, a, b)?;
    float_dtype(op, a)?;
    let shape = broadcast_shapes(op, a.dims(), b.dims())?;
    cpu::binary(op, kind, a, b, &shape)
}

/// `a + b`, broadcasting.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = binary("add", BinaryKind::Add, a, b)?;
    let (sa, sb) = (a.dims().to_vec(), b.dims().to_vec());
    Ok(record_fn(out, &[a, b], "add", move || {
        move |g: &Tensor| {
            Ok(vec![
                Some(sum_to_shape(g, &sa)?),
                Some(sum_to_shape(g, &sb)?),
            ])
        }
    }))
}

/// `a - b`, broadcasting.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = binary("sub", BinaryKind::Sub, a, b)?;
    let (sa, sb) = (a.dims().to_vec(), b.dims().to_vec());
    Ok(record_fn(out, &[a, b], "sub", move || {
        move |g: &Tensor| {
            Ok(vec![
                Some(sum_to_shape(g, &sa)?),
                Some(sum_to_shape(&mul_scalar(g, -1.0)?, &sb)?),
            ])
        }
    }))
}

/// `a * b` elementwise, broadcasting.
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = binary("mul", BinaryKind::Mul, a, b)?;
    let (da, db) = (a.detach(), b.detach());
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    Ok(record_fn(out, &[a, b], "mul", move || {
        move |g: &Tensor| {
            let ga = if need_a {
                Some(sum_to_shape(&mul(g, &db)?, da.dims())?)
            } else {
                None
            };
            let gb = if need_b {
                Some(sum_to_shape(&mul(g, &da)?, db.dims())?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
    }))
}

/// `a / b` elementwise, broadcasting.
pub fn div(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = binary("div", BinaryKind::Div, a, b)?;
    let (da, db) = (a.detach(), b.detach());
    let (need_a, need_b) = (a.requires_grad(), b.requires_grad());
    Ok(record_fn(out, &[a, b], "div", move || {
        move |g: &Tensor| {
            let ga = if need_a {
                Some(sum_to_shape(&div(g, &db)?, da.dims())?)
            } else {
                None
            };
            let gb = if need_b {
                // d(a/b)/db = -a / b²
                let t = div(&mul(g, &da)?, &mul(&db, &db)?)?;
                Some(sum_to_shape(&mul_scalar(&t, -1.0)?, db.dims())?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }
    }))
}

/// `a + c` for a scalar `c`.
pub fn add_scalar(a: &Tensor, c: f64) -> Result<Tensor> {
    float_dtype("add_scalar", a)?;
    let out = cpu::scalar("add_scalar", a, move |x| x + c)?;
    Ok(record_fn(out, &[a], "add_scalar", || {
        |g: &Tensor| Ok(vec![Some(g.clone())])
    }))
}

/// `a * c` for a scalar `c`.
pub fn mul_scalar(a: &Tensor, c: f64) -> Result<Tensor> {
    float_dtype("mul_scalar", a)?;
    let out = cpu::scalar("mul_scalar", a, move |x| x * c)?;
    Ok(record_fn(out, &[a], "mul_scalar", move || {
        move |g: &Tensor| Ok(vec![Some(mul_scalar(g, c)?)])
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device};

    #[test]
    fn gradcheck_binary_ops_with_broadcasting_and_strided_inputs() {
        let shapes: [(&[usize], &[usize]); 4] = [
            (&[3, 4], &[3, 4]),
            (&[2, 3, 4], &[4]),
            (&[3, 1], &[1, 5]),
            (&[2, 1, 4], &[3, 1]),
        ];
        for (i, (sa, sb)) in shapes.iter().enumerate() {
            let a = rand_f64(sa, i as u64);
            let b = rand_f64(sb, 100 + i as u64);
            // keep divisors away from zero
            let b_pos = add_scalar(&b.detach(), 2.0)
                .unwrap()
                .detach()
                .with_requires_grad()
                .unwrap();
            check(|t| add(&t[0], &t[1]), &[a.clone(), b.clone()]);
            check(|t| sub(&t[0], &t[1]), &[a.clone(), b.clone()]);
            check(|t| mul(&t[0], &t[1]), &[a.clone(), b.clone()]);
            check(|t| div(&t[0], &t[1]), &[a.clone(), b_pos]);
        }
        let nc = rand_f64_noncontiguous(&[3, 4], 7);
        check(|t| mul(&t[0], &t[1]), &[nc.clone(), rand_f64(&[3, 4], 8)]);
        check(|t| add(&t[0], &t[1]), &[nc.clone(), rand_f64(&[4], 9)]);
        check(|t| mul_scalar(&add_scalar(&t[0], 0.5)?, -3.0), &[nc]);
    }

    #[test]
    fn broadcast_values_match_a_hand_computed_reference() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3, 1], Device::Cpu).unwrap();
        let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2], Device::Cpu).unwrap();
        let c = add(&a, &b).unwrap();
        assert_eq!(c.dims(), &[3, 2]);
        assert_eq!(
            c.to_vec::<f32>().unwrap(),
            vec![11., 21., 12., 22., 13., 23.]
        );
    }

    #[test]
    fn mismatches_are_errors_naming_the_op() {
        let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros(&[4, 3], DType::F32, Device::Cpu).unwrap();
        let err = add(&a, &b).unwrap_err().to_string();
        assert!(
            err.starts_with("add:") && err.contains("[2, 3]") && err.contains("[4, 3]"),
            "{err}"
        );
        let c = Tensor::zeros(&[2, 3], DType::F64, Device::Cpu).unwrap();
        assert!(mul(&a, &c).unwrap_err().to_string().contains("dtype"));
    }
}
