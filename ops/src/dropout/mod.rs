//! Dropout: during training, zero each element with probability `p` and scale the survivors
//! by `1 / (1 − p)` ("inverted" dropout, so evaluation needs no rescaling).
//!
//! The mask comes from a counter-based generator seeded by one draw from the caller's
//! [`Generator`], so a seeded generator reproduces it exactly, and the CPU and a CUDA device
//! draw the same mask for the same seed; backward multiplies the gradient by the same mask and
//! scale. In evaluation mode,
//! or with `p == 0`, dropout is the identity: it returns `x` itself and draws nothing.
//!
//! # Shapes
//! `x`: any shape, f32 or f64 (f16 and bf16 compute in f32 and keep their dtype) → output: the
//! same shape.

mod cpu;
pub mod cuda;

use tandem_autograd::record_fn;
use tandem_core::{Device, Error, Generator, Result, Tensor};

use crate::checks::{float_dtype, float_or_half};

/// Inverted dropout with drop probability `p` (in `[0, 1)`).
///
/// When `training`, each element is zeroed with probability `p` (mask drawn from `generator`)
/// and the others are multiplied by `1 / (1 − p)`; the gradient flows through the same mask.
/// When not `training`, or when `p == 0`, returns `x` unchanged.
///
/// # Shapes
/// `x`: any shape → output: the same shape.
pub fn dropout(x: &Tensor, p: f64, training: bool, generator: &mut Generator) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("dropout", tandem_core::profile::Phase::Forward);
    if !(0.0..1.0).contains(&p) {
        return Err(Error::invalid(
            "dropout",
            format!(
                "drop probability p must be in [0, 1), got {p} (input shape {:?})",
                x.dims()
            ),
        ));
    }
    if !training || p == 0.0 {
        float_or_half("dropout", x)?;
        return Ok(x.clone());
    }
    if x.dtype().is_half() {
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| {
            dropout(&w[0], p, training, generator)
        });
    }
    float_dtype("dropout", x)?;
    let scale = 1.0 / (1.0 - p);
    let seed = generator.next_u64();
    let threshold = keep_threshold(p);
    // The keep-mask (u8, 1 = keep) lives where `x` does, for the backward.
    let (out, mask) = match x.device() {
        Device::Cpu => cpu::forward(x, seed, threshold, scale)?,
        Device::Cuda(_) => cuda::forward(x, seed, threshold, scale)?,
    };
    Ok(record_fn(out, &[x], "dropout", move || {
        move |g: &Tensor| {
            let grad = match g.device() {
                Device::Cpu => cpu::apply_mask(g, &mask, scale)?,
                Device::Cuda(_) => cuda::apply_mask(g, &mask, scale)?,
            };
            Ok(vec![Some(grad)])
        }
    }))
}

/// The 32-bit threshold of drop probability `p`: an element is kept when its uniform 32-bit
/// draw is at least this, so P(keep) = 1 − threshold / 2³².
pub fn keep_threshold(p: f64) -> u32 {
    ((p * 4_294_967_296.0).round() as u64).min(u32::MAX as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_autograd::TensorBackward;
    use tandem_core::{DType, Device};

    /// A leaf of ones plus uniform noise in [0, 1): no element is 0 before dropout.
    fn nonzero_f32(shape: &[usize], seed: u64) -> Tensor {
        let mut g = Generator::new(seed);
        Tensor::rand(shape, 1.0, 2.0, DType::F32, Device::Cpu, &mut g).unwrap()
    }

    #[test]
    fn drops_about_p_of_the_elements_and_scales_the_rest() {
        for p in [0.1, 0.3, 0.5, 0.9] {
            let x = nonzero_f32(&[250, 400], 1);
            let y = dropout(&x, p, true, &mut Generator::new(2)).unwrap();
            let (xs, ys) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
            let zeros = ys.iter().filter(|&&v| v == 0.0).count();
            let fraction = zeros as f64 / ys.len() as f64;
            // 100k Bernoulli(p) draws: the standard deviation of the fraction is ≤ 0.0016
            assert!((fraction - p).abs() < 0.01, "p {p}: dropped {fraction}");
            let scale = 1.0 / (1.0 - p);
            for (&a, &b) in xs.iter().zip(&ys) {
                if b != 0.0 {
                    let want = a as f64 * scale;
                    assert!((b as f64 - want).abs() <= 1e-6 * want, "{b} vs {want}");
                }
            }
        }
    }

    #[test]
    fn backward_uses_the_forward_mask() {
        let x = nonzero_f32(&[64, 50], 3).with_requires_grad().unwrap();
        let y = dropout(&x, 0.4, true, &mut Generator::new(4)).unwrap();
        crate::reduce::sum_all(&y).unwrap().backward().unwrap();
        let grad = x.grad().unwrap().to_vec::<f32>().unwrap();
        let ys = y.to_vec::<f32>().unwrap();
        let scale = (1.0 / 0.6) as f32;
        for (g, y) in grad.iter().zip(&ys) {
            if *y == 0.0 {
                assert_eq!(*g, 0.0);
            } else {
                assert!((g - scale).abs() < 1e-6, "{g}");
            }
        }
    }

    #[test]
    fn gradcheck_with_a_fixed_seed() {
        // each evaluation draws from a fresh generator with the same seed: the same mask
        check(
            |t| dropout(&t[0], 0.3, true, &mut Generator::new(5)),
            &[rand_f64(&[6, 7], 6)],
        );
        check(
            |t| dropout(&t[0], 0.5, true, &mut Generator::new(7)),
            &[rand_f64_noncontiguous(&[5, 8], 8)],
        );
    }

    #[test]
    fn same_seed_same_mask_and_the_generator_advances() {
        let x = nonzero_f32(&[300, 300], 9);
        let a = dropout(&x, 0.5, true, &mut Generator::new(10)).unwrap();
        let b = dropout(&x, 0.5, true, &mut Generator::new(10)).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let mut g = Generator::new(10);
        let first = dropout(&x, 0.5, true, &mut g).unwrap();
        let second = dropout(&x, 0.5, true, &mut g).unwrap();
        assert_ne!(
            first.to_vec::<f32>().unwrap(),
            second.to_vec::<f32>().unwrap()
        );
        let other = dropout(&x, 0.5, true, &mut Generator::new(11)).unwrap();
        assert_ne!(a.to_vec::<f32>().unwrap(), other.to_vec::<f32>().unwrap());
    }

    #[test]
    fn identity_in_eval_mode_and_for_p_zero() {
        let x = nonzero_f32(&[4, 5], 12).with_requires_grad().unwrap();
        let mut g = Generator::new(13);
        let before = g.clone().next_u64();
        let eval = dropout(&x, 0.5, false, &mut g).unwrap();
        assert!(eval.same_tensor(&x));
        let zero_p = dropout(&x, 0.0, true, &mut g).unwrap();
        assert_eq!(zero_p.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        // nothing was drawn
        assert_eq!(g.next_u64(), before);
    }

    #[test]
    fn p_outside_zero_one_is_an_error_naming_dropout_and_p() {
        let x = nonzero_f32(&[3], 14);
        let mut g = Generator::new(15);
        for p in [1.0, 1.5, -0.1, f64::NAN] {
            let err = dropout(&x, p, true, &mut g).unwrap_err().to_string();
            assert!(
                err.starts_with("dropout:") && err.contains(&format!("{p}")),
                "{err}"
            );
        }
        let empty = Tensor::zeros(&[2, 0], DType::F32, Device::Cpu).unwrap();
        assert_eq!(dropout(&empty, 0.5, true, &mut g).unwrap().dims(), &[2, 0]);
        let labels = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
        let err = dropout(&labels, 0.5, true, &mut g).unwrap_err().to_string();
        assert!(err.starts_with("dropout:") && err.contains("i64"), "{err}");
    }
}
