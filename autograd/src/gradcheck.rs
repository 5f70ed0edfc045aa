//! Finite-difference gradient checking.
//!
//! [`gradcheck`] compares the gradients backward computes with central differences
//! `(f(x+ε) − f(x−ε)) / 2ε` in f64. A non-scalar output is reduced with a fixed random vector
//! `v` (the check compares Jᵀv), so every output element takes part.

use tandem_core::{DType, Error, Generator, Layout, Result, Shape, Tensor};

use crate::engine::{backward, BackwardOptions};
use crate::grad_mode::no_grad;

/// Tolerances of a gradient check.
#[derive(Clone, Debug)]
pub struct GradcheckOptions {
    /// Step of the central difference (default 1e-6).
    pub eps: f64,
    /// Absolute tolerance (default 1e-6).
    pub atol: f64,
    /// Relative tolerance (default 1e-4).
    pub rtol: f64,
    /// Seed of the projection vector.
    pub seed: u64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions {
            eps: 1e-6,
            atol: 1e-6,
            rtol: 1e-4,
            seed: 0,
        }
    }
}

/// Checks the gradients of `f` at `inputs` (f64 tensors; those with `requires_grad` are
/// checked, the others held fixed). Returns an error naming the first input and element whose
/// analytic and numeric gradients disagree.
pub fn gradcheck(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    options: &GradcheckOptions,
) -> Result<()> {
    for (i, x) in inputs.iter().enumerate() {
        if x.dtype() != DType::F64 {
            return Err(Error::invalid(
                "gradcheck",
                format!("input {i} is {}, gradcheck runs in f64", x.dtype()),
            ));
        }
        if x.requires_grad() && !x.is_leaf() {
            return Err(Error::invalid(
                "gradcheck",
                format!("input {i} must be a leaf"),
            ));
        }
    }
    let out = f(inputs)?;
    let mut gen = Generator::new(options.seed);
    let v = Tensor::randn(out.dims(), 0.0, 1.0, DType::F64, out.device(), &mut gen)?;
    let v_values = v.to_vec::<f64>()?;
    let project = |t: &Tensor| -> Result<f64> {
        Ok(t.to_vec::<f64>()?
            .iter()
            .zip(&v_values)
            .map(|(a, b)| a * b)
            .sum())
    };

    for x in inputs {
        x.set_grad(None)?;
    }
    if !out.requires_grad() {
        return Err(Error::invalid(
            "gradcheck",
            "the output does not depend on any input that requires grad",
        ));
    }
    backward(&out, Some(&v), &BackwardOptions::default())?;

    for (i, x) in inputs.iter().enumerate().filter(|(_, x)| x.requires_grad()) {
        let analytic = match x.grad() {
            Some(g) => g.to_vec::<f64>()?,
            None => vec![0.0; x.numel()],
        };
        let mut positions = Vec::with_capacity(x.numel());
        x.layout().for_each_index(|p| positions.push(p));
        for (k, &pos) in positions.iter().enumerate() {
            let original = read_at(x, pos)?;
            write_at(x, pos, original + options.eps)?;
            let plus = no_grad(|| f(inputs)).and_then(|t| project(&t));
            write_at(x, pos, original - options.eps)?;
            let minus = no_grad(|| f(inputs)).and_then(|t| project(&t));
            write_at(x, pos, original)?;
            let numeric = (plus? - minus?) / (2.0 * options.eps);
            let a = analytic[k];
            if (a - numeric).abs() > options.atol + options.rtol * numeric.abs() {
                return Err(Error::autograd(format!(
                    "gradcheck: input {i} (shape {:?}) element {k}: analytic {a:.8e} vs numeric {numeric:.8e}",
                    x.dims()
                )));
            }
        }
    }
    Ok(())
}

/// The element at storage index `pos` of `x`, as a one-element view (device-neutral, so the
/// check runs wherever `x` lives).
fn element(x: &Tensor, pos: usize) -> Result<Tensor> {
    x.view_detached(Layout::from_parts(Shape::new(), Shape::new(), pos))
}

fn read_at(x: &Tensor, pos: usize) -> Result<f64> {
    element(x, pos)?.item()
}

fn write_at(x: &Tensor, pos: usize, value: f64) -> Result<()> {
    element(x, pos)?.fill_(value)
}
