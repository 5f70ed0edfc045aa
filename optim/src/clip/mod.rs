//! Gradient clipping by total norm, with PyTorch's rule (`torch.nn.utils.clip_grad_norm_`).
//!
//! The norm is taken over all gradients together, as if they were one vector, and computed in
//! f64 whatever the gradients' dtype. Gradients are scaled in place, so a gradient that is a
//! view into a communication bucket stays one.
//!
//! The function checks its arguments here and dispatches once on the gradients' device: host
//! loops (`cpu.rs`), or on a CUDA device multi-tensor kernels that compute the norm and scale
//! every gradient without a host round trip; only the returned norm is read back, once
//! (`cuda.rs`).

mod cpu;
mod cuda;

use tandem_core::{Device, Tensor};

use crate::{Error, Result};

/// Clips the gradients of `params` so that their total norm is at most about `max_norm`, and
/// returns the total norm *before* clipping.
///
/// `norm_type` is the order `p` of the norm: `2.0` for the usual Euclidean norm, any finite
/// `p > 0`, or `f64::INFINITY` for the largest absolute value. Parameters without a gradient
/// are ignored (with none at all the norm is 0). As in PyTorch, every gradient is multiplied by
/// `max_norm / (total + 1e-6)` when that factor is below 1, i.e. when `total + 1e-6 >
/// max_norm`.
///
/// Errors if `max_norm` is negative or not finite, `norm_type` is not a positive number, the
/// gradients are on different devices, or the total norm is NaN or infinite (a gradient
/// overflowed); gradients are left untouched then.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64, norm_type: f64) -> Result<f64> {
    let bad = |msg: String| Err(Error::Clip { msg });
    if !max_norm.is_finite() || max_norm < 0.0 {
        return bad(format!("max_norm must be finite and >= 0, got {max_norm}"));
    }
    if norm_type.is_nan() || norm_type <= 0.0 {
        return bad(format!(
            "norm_type must be > 0 (2.0 for the Euclidean norm, f64::INFINITY for the maximum), \
             got {norm_type}"
        ));
    }
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let Some(device) = grads.first().map(Tensor::device) else {
        return Ok(0.0);
    };
    if let Some(other) = grads.iter().find(|g| g.device() != device) {
        return bad(format!(
            "gradients on {device} and {} cannot be clipped together; move the model to one \
             device",
            other.device()
        ));
    }
    match device {
        Device::Cpu => cpu::clip(&grads, max_norm, norm_type),
        Device::Cuda(ordinal) => cuda::clip(ordinal, &grads, max_norm, norm_type),
    }
}

/// The error for a total norm that is NaN or infinite.
fn non_finite(total: f64, norm_type: f64, grads: usize) -> Error {
    Error::Clip {
        msg: format!(
            "the total norm of order {norm_type} of the gradients of {grads} parameters is \
             {total} (non-finite); a gradient holds NaN or infinity, or overflowed"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::DType;

    fn param_with_grad(grad: &[f32], shape: &[usize]) -> Tensor {
        let p = Tensor::zeros(shape, DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        p.set_grad(Some(
            Tensor::from_vec(grad.to_vec(), shape, Device::Cpu).unwrap(),
        ))
        .unwrap();
        p
    }

    fn grads(params: &[Tensor]) -> Vec<Vec<f64>> {
        params
            .iter()
            .map(|p| p.grad().unwrap().to_vec_f64().unwrap())
            .collect()
    }

    fn assert_close(got: f64, want: f64) {
        assert!(
            (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
            "got {got}, want {want}"
        );
    }

    #[test]
    fn two_norm_over_all_gradients_is_returned_and_used_to_scale() {
        // Norm of (3, 4, 12) is 13.
        let params = [
            param_with_grad(&[3.0, 4.0], &[2]),
            param_with_grad(&[12.0], &[1, 1]),
        ];
        let total = clip_grad_norm(&params, 6.5, 2.0).unwrap();
        assert_close(total, 13.0);
        let c = 6.5 / (13.0 + 1e-6);
        let got = grads(&params);
        for (g, w) in got.concat().iter().zip([3.0 * c, 4.0 * c, 12.0 * c]) {
            assert_close(*g, w);
        }
        // The clipped gradients now have norm max_norm (up to the 1e-6).
        let clipped = clip_grad_norm(&params, 100.0, 2.0).unwrap();
        assert_close(clipped, 6.5);
    }

    #[test]
    fn gradients_within_the_limit_are_left_alone() {
        let params = [param_with_grad(&[0.3, -0.4], &[2])];
        let total = clip_grad_norm(&params, 1.0, 2.0).unwrap();
        assert_close(total, 0.5);
        assert_eq!(grads(&params), vec![vec![0.3f32 as f64, -0.4f32 as f64]]);
    }

    #[test]
    fn infinity_norm_is_the_largest_absolute_value() {
        let params = [
            param_with_grad(&[1.0, -7.0], &[2]),
            param_with_grad(&[2.0, 5.0, -3.0], &[3]),
        ];
        let total = clip_grad_norm(&params, 3.5, f64::INFINITY).unwrap();
        assert_close(total, 7.0);
        let c = 3.5 / (7.0 + 1e-6);
        let want = [1.0, -7.0, 2.0, 5.0, -3.0].map(|x| x * c);
        for (g, w) in grads(&params).concat().iter().zip(want) {
            assert_close(*g, w);
        }
    }

    #[test]
    fn other_orders_follow_the_p_norm_formula() {
        let params = [param_with_grad(&[1.0, -2.0, 3.0], &[3])];
        let want = (1.0f64 + 8.0 + 27.0).powf(1.0 / 3.0);
        assert_close(clip_grad_norm(&params, 100.0, 3.0).unwrap(), want);
        assert_close(clip_grad_norm(&params, 100.0, 1.0).unwrap(), 6.0);
    }

    #[test]
    fn parameters_without_gradient_are_ignored() {
        let none = Tensor::zeros(&[2], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        assert_eq!(
            clip_grad_norm(std::slice::from_ref(&none), 1.0, 2.0).unwrap(),
            0.0
        );
        let params = [none, param_with_grad(&[6.0, 8.0], &[2])];
        assert_close(clip_grad_norm(&params, 1.0, 2.0).unwrap(), 10.0);
        assert!(params[0].grad().is_none());
    }

    #[test]
    fn non_contiguous_gradients_are_measured_and_scaled_through_their_view() {
        let p = Tensor::zeros(&[2, 2], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        let base = Tensor::from_vec(vec![1.0f32, 2.0, 2.0, 4.0], &[2, 2], Device::Cpu).unwrap();
        let view = base
            .view_detached(base.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        assert!(!view.is_contiguous());
        p.set_grad(Some(view)).unwrap();
        assert_close(clip_grad_norm(&[p], 2.5, 2.0).unwrap(), 5.0);
        let c = 2.5 / (5.0 + 1e-6);
        for (g, w) in base.to_vec_f64().unwrap().iter().zip([1.0, 2.0, 2.0, 4.0]) {
            assert_close(*g, w * c);
        }
    }

    #[test]
    fn non_finite_norm_is_an_error_and_leaves_gradients_alone() {
        for bad in [f32::NAN, f32::INFINITY] {
            for norm_type in [2.0, f64::INFINITY] {
                let params = [
                    param_with_grad(&[1.0, bad], &[2]),
                    param_with_grad(&[3.0], &[1]),
                ];
                let err = clip_grad_norm(&params, 1.0, norm_type)
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("clip_grad_norm") && err.contains("non-finite"),
                    "{err}"
                );
                assert_eq!(grads(&params)[1], vec![3.0]);
            }
        }
    }

    #[test]
    fn invalid_arguments_are_rejected() {
        let params = [param_with_grad(&[1.0], &[1])];
        for (max_norm, norm_type, needle) in [
            (-1.0, 2.0, "max_norm"),
            (f64::NAN, 2.0, "max_norm"),
            (1.0, 0.0, "norm_type"),
            (1.0, f64::NAN, "norm_type"),
            (1.0, -2.0, "norm_type"),
        ] {
            let err = clip_grad_norm(&params, max_norm, norm_type)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
