//! Parameter initialisation, in place, with PyTorch's formulas (`torch.nn.init`).
//!
//! Random initialisers draw from this thread's default generator
//! ([`tandem_core::rng::with_default_generator`], seeded by [`tandem_core::rng::manual_seed`]),
//! so a model built after `manual_seed(s)` is the same on every run. Each function also has a
//! `_with` form taking an explicit [`Generator`].
//!
//! Fans follow PyTorch: for a weight of shape `[out, in, k…]`, `fan_in = in · ∏k` and
//! `fan_out = out · ∏k`.

use tandem_core::rng::with_default_generator;
use tandem_core::{Generator, Tensor};

use crate::{Error, Result};

/// Which fan the Kaiming initialisers scale by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FanMode {
    /// Preserve the variance of activations in the forward pass (PyTorch's default).
    #[default]
    FanIn,
    /// Preserve the variance of gradients in the backward pass.
    FanOut,
}

/// `(fan_in, fan_out)` of a weight of rank ≥ 2.
pub fn fans(t: &Tensor) -> Result<(usize, usize)> {
    let dims = t.dims();
    if dims.len() < 2 {
        return Err(Error::config(
            "init",
            format!(
                "fan in and fan out need a tensor of at least 2 dims, got shape {:?}",
                dims
            ),
        ));
    }
    let receptive: usize = dims[2..].iter().product();
    Ok((dims[1] * receptive, dims[0] * receptive))
}

fn check_float(t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::config(
            "init",
            format!(
                "can only initialise floating-point tensors, got {}",
                t.dtype()
            ),
        ));
    }
    Ok(())
}

/// Fills `t` with samples from U(low, high) drawn from `generator`.
pub fn uniform_with(t: &Tensor, low: f64, high: f64, generator: &mut Generator) -> Result<()> {
    check_float(t)?;
    if !(low.is_finite() && high.is_finite() && low <= high) {
        return Err(Error::config(
            "init::uniform",
            format!("need finite bounds with low <= high, got [{low}, {high})"),
        ));
    }
    let fresh = Tensor::rand(t.dims(), low, high, t.dtype(), t.device(), generator)?;
    t.copy_(&fresh)?;
    Ok(())
}

/// Fills `t` with samples from U(low, high) (default generator).
pub fn uniform(t: &Tensor, low: f64, high: f64) -> Result<()> {
    with_default_generator(|g| uniform_with(t, low, high, g))
}

/// Fills `t` with samples from N(mean, std²) drawn from `generator`.
pub fn normal_with(t: &Tensor, mean: f64, std: f64, generator: &mut Generator) -> Result<()> {
    check_float(t)?;
    if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
        return Err(Error::config(
            "init::normal",
            format!("need a finite mean and a finite std >= 0, got mean {mean}, std {std}"),
        ));
    }
    let fresh = Tensor::randn(t.dims(), mean, std, t.dtype(), t.device(), generator)?;
    t.copy_(&fresh)?;
    Ok(())
}

/// Fills `t` with samples from N(mean, std²) (default generator).
pub fn normal(t: &Tensor, mean: f64, std: f64) -> Result<()> {
    with_default_generator(|g| normal_with(t, mean, std, g))
}

/// Fills `t` with `value`.
pub fn constant(t: &Tensor, value: f64) -> Result<()> {
    t.fill_(value)?;
    Ok(())
}

/// Fills `t` with zeros.
pub fn zeros(t: &Tensor) -> Result<()> {
    constant(t, 0.0)
}

/// Fills `t` with ones.
pub fn ones(t: &Tensor) -> Result<()> {
    constant(t, 1.0)
}

/// The gain of a leaky ReLU with negative slope `a`: `sqrt(2 / (1 + a²))`.
pub fn leaky_relu_gain(a: f64) -> f64 {
    (2.0 / (1.0 + a * a)).sqrt()
}

fn kaiming_std(t: &Tensor, a: f64, mode: FanMode) -> Result<f64> {
    let (fan_in, fan_out) = fans(t)?;
    let fan = match mode {
        FanMode::FanIn => fan_in,
        FanMode::FanOut => fan_out,
    };
    if fan == 0 {
        return Err(Error::config(
            "init::kaiming",
            format!("zero fan for a tensor of shape {:?}", t.dims()),
        ));
    }
    Ok(leaky_relu_gain(a) / (fan as f64).sqrt())
}

/// Kaiming (He) uniform initialisation for a layer followed by a leaky ReLU of slope `a`:
/// U(−b, b) with `b = gain(a) · sqrt(3 / fan)`, drawn from `generator`.
///
/// With `a = √5` and `FanIn` this is PyTorch's default for `Linear` and `Conv2d` weights,
/// U(−1/√fan_in, 1/√fan_in).
pub fn kaiming_uniform_with(
    t: &Tensor,
    a: f64,
    mode: FanMode,
    generator: &mut Generator,
) -> Result<()> {
    let bound = 3f64.sqrt() * kaiming_std(t, a, mode)?;
    uniform_with(t, -bound, bound, generator)
}

/// [`kaiming_uniform_with`] on the default generator.
pub fn kaiming_uniform(t: &Tensor, a: f64, mode: FanMode) -> Result<()> {
    with_default_generator(|g| kaiming_uniform_with(t, a, mode, g))
}

/// Kaiming (He) normal initialisation: N(0, (gain(a) / sqrt(fan))²) (default generator).
/// `kaiming_normal(w, 0.0, FanMode::FanOut)` is the usual choice for ResNet convolutions.
pub fn kaiming_normal(t: &Tensor, a: f64, mode: FanMode) -> Result<()> {
    let std = kaiming_std(t, a, mode)?;
    normal(t, 0.0, std)
}

/// Xavier (Glorot) uniform initialisation: U(−b, b) with
/// `b = gain · sqrt(6 / (fan_in + fan_out))` (default generator).
pub fn xavier_uniform(t: &Tensor, gain: f64) -> Result<()> {
    let (fan_in, fan_out) = fans(t)?;
    if fan_in + fan_out == 0 {
        return Err(Error::config(
            "init::xavier_uniform",
            format!("zero fans for a tensor of shape {:?}", t.dims()),
        ));
    }
    let bound = gain * (6.0 / (fan_in + fan_out) as f64).sqrt();
    uniform(t, -bound, bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::rng::manual_seed;
    use tandem_core::{DType, Device};

    fn empty(shape: &[usize]) -> Tensor {
        Tensor::zeros(shape, DType::F32, Device::Cpu).unwrap()
    }

    #[test]
    fn fans_of_a_conv_weight_include_the_kernel() {
        assert_eq!(fans(&empty(&[16, 6, 5, 5])).unwrap(), (150, 400));
        assert_eq!(fans(&empty(&[10, 84])).unwrap(), (84, 10));
        assert!(fans(&empty(&[7])).is_err());
    }

    #[test]
    fn kaiming_uniform_with_sqrt5_is_bounded_by_one_over_sqrt_fan_in() {
        let w = empty(&[64, 150]);
        kaiming_uniform(&w, 5f64.sqrt(), FanMode::FanIn).unwrap();
        let bound = 1.0 / 150f64.sqrt();
        let v = w.to_vec_f64().unwrap();
        assert!(v.iter().all(|x| x.abs() <= bound));
        // Spread over the whole interval: the extremes come close to the bound.
        let max = v.iter().cloned().fold(f64::MIN, f64::max);
        let min = v.iter().cloned().fold(f64::MAX, f64::min);
        assert!(max > 0.95 * bound && min < -0.95 * bound, "{min} {max}");
        // Variance of U(-b, b) is b²/3.
        let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        assert!((var - bound * bound / 3.0).abs() < 0.1 * bound * bound / 3.0);
    }

    #[test]
    fn same_seed_gives_the_same_initialisation() {
        let (a, b) = (empty(&[4, 4]), empty(&[4, 4]));
        manual_seed(11);
        xavier_uniform(&a, 1.0).unwrap();
        manual_seed(11);
        xavier_uniform(&b, 1.0).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let bound = (6.0f64 / 8.0).sqrt();
        assert!(a.to_vec_f64().unwrap().iter().all(|x| x.abs() <= bound));
    }

    #[test]
    fn normal_matches_requested_moments() {
        let t = empty(&[100, 100]);
        normal_with(&t, 1.0, 2.0, &mut Generator::new(3)).unwrap();
        let v = t.to_vec_f64().unwrap();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.1 && (var.sqrt() - 2.0).abs() < 0.1);
    }

    #[test]
    fn integer_tensors_and_bad_bounds_are_rejected() {
        let labels = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
        assert!(uniform(&labels, 0.0, 1.0).is_err());
        assert!(uniform(&empty(&[3]), 1.0, 0.0).is_err());
        assert!(normal(&empty(&[3]), 0.0, -1.0).is_err());
    }
}
