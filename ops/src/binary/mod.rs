//! Elementwise binary ops with NumPy broadcasting: add, sub, mul, div, their scalar forms, and
//! `add_relu` (`max(0, a + b)`, the residual join of a ResNet block, fused).
//!
//! # Shapes
//! `a` and `b` broadcast to a common shape (align right; a dim of size 1 stretches); the output
//! has that shape. Backward sums each input's gradient over the dims it was broadcast along.
//! Both inputs must share a device. Float dtypes: f32 and f64 compute as they are; f16 and bf16
//! compute in f32 and round the output once. Mixed float dtypes promote as in PyTorch (a half
//! with f32 or with the other half gives f32; f64 wins).

mod cpu;
pub mod cuda;
mod shape;

use tandem_autograd::record_fn;
use tandem_core::{broadcast_shapes, Device, Result, Tensor};

use crate::checks::{float_dtype, same_dtype_device};
use crate::reduce::sum_to_shape;

pub use shape::{BinaryKind, ScalarKind};

fn binary(op: &'static str, kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope(op, tandem_core::profile::Phase::Forward);
    same_dtype_device(op, a, b)?;
    float_dtype(op, a)?;
    let shape = broadcast_shapes(op, a.dims(), b.dims())?;
    match a.device() {
        Device::Cpu => cpu::binary(op, kind, a, b, &shape),
        Device::Cuda(_) => cuda::binary(op, kind, a, b, &shape),
    }
}

/// `a ∘ c` elementwise for a scalar `c`, dispatched on the device.
fn scalar(kind: ScalarKind, a: &Tensor, c: f64) -> Result<Tensor> {
    let op = kind.name();
    float_dtype(op, a)?;
    match (a.device(), kind) {
        (Device::Cpu, ScalarKind::Add) => cpu::scalar(op, a, move |x| x + c),
        (Device::Cpu, ScalarKind::Mul) => cpu::scalar(op, a, move |x| x * c),
        (Device::Cuda(_), _) => cuda::scalar(kind, a, c),
    }
}

/// `add` or `add_relu` (`op`) of two same-shaped tensors of one half dtype on the CPU, in one
/// pass (loaded as halves, computed in f32, stored as halves, no widened copies); `None` for
/// any other inputs. add's gradient is the output gradient for both; add_relu's is it masked
/// by the output.
fn same_shape_half_cpu(op: &'static str, a: &Tensor, b: &Tensor) -> Option<Result<Tensor>> {
    let fits = a.dtype().is_half()
        && a.dtype() == b.dtype()
        && a.dims() == b.dims()
        && a.device() == Device::Cpu
        && b.device() == Device::Cpu;
    if !fits {
        return None;
    }
    let _profile = tandem_core::profile::scope(op, tandem_core::profile::Phase::Forward);
    let relu = op == "add_relu";
    let out = if relu {
        crate::cpu::half::add_relu(op, a, b)
    } else {
        crate::cpu::half::add(op, a, b)
    };
    Some(out.map(|out| {
        let saved = relu.then(|| out.detach());
        record_fn(out, &[a, b], op, move || {
            move |g: &Tensor| {
                let g = match &saved {
                    Some(y) => crate::unary::relu_backward(g, y)?,
                    None => g.clone(),
                };
                Ok(vec![Some(g.clone()), Some(g)])
            }
        })
    }))
}

/// `a + b`, broadcasting.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(out) = same_shape_half_cpu("add", a, b) {
        return out;
    }
    if let Some(out) = crate::low_precision::binary_via(a, b, add) {
        return out;
    }
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

/// `max(0, a + b)`, broadcasting: `relu(add(a, b))` in one op.
///
/// Same-shape contiguous inputs (the residual join of a ResNet block) add and clamp in one
/// pass, and the backward masks the output gradient where the saved output is positive (the
/// gradient at exactly 0 is 0, as for `relu`) and hands that one tensor to both inputs.
/// Other inputs run as `relu(add(a, b))`, recorded and profiled as those two ops; the fused
/// path is recorded and profiled as `"add_relu"`.
///
/// # Shapes
/// `a` and `b` broadcast to a common shape; the output has that shape.
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add_relu";
    if let Some(out) = same_shape_half_cpu(OP, a, b) {
        return out;
    }
    if let Some(out) = crate::low_precision::binary_via(a, b, add_relu) {
        return out;
    }
    same_dtype_device(OP, a, b)?;
    float_dtype(OP, a)?;
    broadcast_shapes(OP, a.dims(), b.dims())?;
    // The fused pass reads both operands in storage order: same shape, and both row-major or
    // both channels-last.
    let same_layout = (a.is_contiguous() && b.is_contiguous())
        || (a.layout().is_channels_last()
            && b.is_contiguous_in(tandem_core::MemoryFormat::ChannelsLast));
    if a.dims() != b.dims() || !same_layout {
        return crate::unary::relu(&add(a, b)?);
    }
    let _profile = tandem_core::profile::scope(OP, tandem_core::profile::Phase::Forward);
    let out = match a.device() {
        Device::Cpu => cpu::add_relu(OP, a, b)?,
        Device::Cuda(_) => cuda::add_relu(a, b)?,
    };
    let saved = out.detach();
    Ok(record_fn(out, &[a, b], OP, move || {
        move |g: &Tensor| {
            let masked = crate::unary::relu_backward(g, &saved)?;
            Ok(vec![Some(masked.clone()), Some(masked)])
        }
    }))
}

/// `a - b`, broadcasting.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let Some(out) = crate::low_precision::binary_via(a, b, sub) {
        return out;
    }
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
    if let Some(out) = crate::low_precision::binary_via(a, b, mul) {
        return out;
    }
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
    if let Some(out) = crate::low_precision::binary_via(a, b, div) {
        return out;
    }
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
    if a.dtype().is_half() {
        return crate::low_precision::via_f32(a.dtype(), &[a], |w| add_scalar(&w[0], c));
    }
    let out = scalar(ScalarKind::Add, a, c)?;
    Ok(record_fn(out, &[a], "add_scalar", || {
        |g: &Tensor| Ok(vec![Some(g.clone())])
    }))
}

/// `a * c` for a scalar `c`.
pub fn mul_scalar(a: &Tensor, c: f64) -> Result<Tensor> {
    if a.dtype().is_half() {
        return crate::low_precision::via_f32(a.dtype(), &[a], |w| mul_scalar(&w[0], c));
    }
    let out = scalar(ScalarKind::Mul, a, c)?;
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

    /// An f64 leaf that requires grad.
    fn leaf_from(values: Vec<f64>, shape: &[usize]) -> Tensor {
        Tensor::from_vec(values, shape, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap()
    }

    #[test]
    fn add_relu_forward_and_backward_match_f64_formulas() {
        use tandem_autograd::TensorBackward;
        // large enough for the parallel kernels, under a two-thread pool and on one thread
        for (threads, shape) in [
            (2usize, vec![4usize, 3, 5]),
            (2, vec![8, 16, 32, 32]),
            (1, vec![8, 16, 32, 32]),
        ] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let (a, b) = (rand_f64(&shape, 40), rand_f64(&shape, 41));
                let up = rand_f64(&shape, 42).detach();
                let y = add_relu(&a, &b).unwrap();
                crate::sum_all(&mul(&y, &up).unwrap())
                    .unwrap()
                    .backward()
                    .unwrap();
                let (av, bv, uv) = (
                    a.to_vec_f64().unwrap(),
                    b.to_vec_f64().unwrap(),
                    up.to_vec_f64().unwrap(),
                );
                let yv = y.to_vec_f64().unwrap();
                let (ga, gb) = (
                    a.grad().unwrap().to_vec_f64().unwrap(),
                    b.grad().unwrap().to_vec_f64().unwrap(),
                );
                for i in 0..av.len() {
                    let s = av[i] + bv[i];
                    assert_eq!(yv[i], s.max(0.0), "{i}");
                    let want = if s > 0.0 { uv[i] } else { 0.0 };
                    assert_eq!((ga[i], gb[i]), (want, want), "{i}");
                }
            });
        }
    }

    #[test]
    fn add_relu_gradient_is_zero_at_and_below_zero_sums() {
        use tandem_autograd::TensorBackward;
        let a = leaf_from(vec![1.0, -2.0, 0.5, 3.0], &[2, 2]);
        let b = leaf_from(vec![-1.0, 1.0, 0.25, -3.5], &[2, 2]);
        let y = add_relu(&a, &b).unwrap();
        assert_eq!(y.to_vec_f64().unwrap(), vec![0.0, 0.0, 0.75, 0.0]);
        crate::sum_all(&y).unwrap().backward().unwrap();
        let want = vec![0.0, 0.0, 1.0, 0.0];
        assert_eq!(a.grad().unwrap().to_vec_f64().unwrap(), want);
        assert_eq!(b.grad().unwrap().to_vec_f64().unwrap(), want);
    }

    #[test]
    fn gradcheck_add_relu_same_shape_broadcast_and_strided() {
        // Values with |v| in [0.5, 1) and b in [-0.25, 0.25): every sum is at least 0.25 from
        // the kink.
        let away = |t: Tensor, lo: f64| {
            let v: Vec<f64> = t
                .to_vec_f64()
                .unwrap()
                .iter()
                .map(|&x| x.signum() * (lo + x.abs() * lo))
                .collect();
            leaf_from(v, t.dims())
        };
        let quarter = |t: Tensor| {
            leaf_from(
                t.to_vec_f64().unwrap().iter().map(|x| x * 0.25).collect(),
                t.dims(),
            )
        };
        let a = away(rand_f64(&[3, 4, 5], 50), 0.5);
        let b = quarter(rand_f64(&[3, 4, 5], 51));
        check(|t| add_relu(&t[0], &t[1]), &[a.clone(), b.clone()]);
        // broadcasting and a strided operand take the unfused path
        check(
            |t| add_relu(&t[0], &t[1]),
            &[a, quarter(rand_f64(&[5], 52))],
        );
        let nc_away = crate::views::transpose(&away(rand_f64(&[4, 3], 53), 0.5), 0, 1)
            .unwrap()
            .detach()
            .with_requires_grad()
            .unwrap();
        assert!(!nc_away.is_contiguous());
        check(
            |t| add_relu(&t[0], &t[1]),
            &[nc_away, quarter(rand_f64(&[3, 4], 54))],
        );
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
        let err = add_relu(&a, &b).unwrap_err().to_string();
        assert!(
            err.starts_with("add_relu:") && err.contains("[4, 3]"),
            "{err}"
        );
        assert!(add_relu(&a, &c)
            .unwrap_err()
            .to_string()
            .starts_with("add_relu:"));
    }
}
