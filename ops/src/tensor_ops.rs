//! Method syntax for the differentiable ops: `x.matmul(&w)?.relu()?` instead of
//! `relu(&matmul(&x, &w)?)?`. Every method forwards to the function of the same name in this
//! crate, whose docs give shapes and errors. It lives here so that the layers (`tandem-nn`)
//! and `tandem-dist` can use it; the `tandem` facade re-exports it (and its prelude brings it
//! in).

use tandem_core::{Generator, Result, Tensor};

use crate as ops;

/// Differentiable ops as methods on [`Tensor`]; brought in by `use tandem::prelude::*` (or
/// `use tandem_ops::TensorOps`).
pub trait TensorOps {
    /// See [`ops::add`].
    fn add(&self, other: &Tensor) -> Result<Tensor>;
    /// See [`ops::sub`].
    fn sub(&self, other: &Tensor) -> Result<Tensor>;
    /// See [`ops::mul`].
    fn mul(&self, other: &Tensor) -> Result<Tensor>;
    /// See [`ops::div`].
    fn div(&self, other: &Tensor) -> Result<Tensor>;
    /// See [`ops::add_scalar`].
    fn add_scalar(&self, c: f64) -> Result<Tensor>;
    /// See [`ops::mul_scalar`].
    fn mul_scalar(&self, c: f64) -> Result<Tensor>;
    /// See [`ops::unary::neg`].
    fn neg(&self) -> Result<Tensor>;
    /// See [`ops::unary::exp`].
    fn exp(&self) -> Result<Tensor>;
    /// See [`ops::unary::log`].
    fn log(&self) -> Result<Tensor>;
    /// See [`ops::unary::sqrt`].
    fn sqrt(&self) -> Result<Tensor>;
    /// See [`ops::unary::pow_scalar`].
    fn pow_scalar(&self, p: f64) -> Result<Tensor>;
    /// See [`ops::unary::relu`].
    fn relu(&self) -> Result<Tensor>;
    /// See [`ops::unary::sigmoid`].
    fn sigmoid(&self) -> Result<Tensor>;
    /// See [`ops::unary::tanh`].
    fn tanh(&self) -> Result<Tensor>;
    /// See [`ops::sum`].
    fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor>;
    /// See [`ops::sum_all`].
    fn sum_all(&self) -> Result<Tensor>;
    /// See [`ops::mean`].
    fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor>;
    /// See [`ops::mean_all`].
    fn mean_all(&self) -> Result<Tensor>;
    /// See [`ops::reduce::max`].
    fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor>;
    /// See [`ops::reduce::argmax`].
    fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor>;
    /// See [`ops::softmax::softmax`].
    fn softmax(&self, dim: isize) -> Result<Tensor>;
    /// See [`ops::softmax::log_softmax`].
    fn log_softmax(&self, dim: isize) -> Result<Tensor>;
    /// See [`ops::matmul::matmul`].
    fn matmul(&self, other: &Tensor) -> Result<Tensor>;
    /// See [`ops::reshape`].
    fn reshape(&self, shape: &[isize]) -> Result<Tensor>;
    /// See [`ops::transpose`].
    fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor>;
    /// See [`ops::permute`].
    fn permute(&self, perm: &[usize]) -> Result<Tensor>;
    /// See [`ops::narrow`].
    fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor>;
    /// See [`ops::expand`].
    fn expand(&self, shape: &[usize]) -> Result<Tensor>;
    /// See [`ops::squeeze`].
    fn squeeze(&self, dim: isize) -> Result<Tensor>;
    /// See [`ops::unsqueeze`].
    fn unsqueeze(&self, dim: isize) -> Result<Tensor>;
    /// See [`ops::flatten`].
    fn flatten(&self, start_dim: isize, end_dim: isize) -> Result<Tensor>;
    /// See [`ops::contiguous`].
    fn contiguous(&self) -> Result<Tensor>;
    /// See [`ops::dropout::dropout`].
    fn dropout(&self, p: f64, training: bool, generator: &mut Generator) -> Result<Tensor>;
}

impl TensorOps for Tensor {
    fn add(&self, other: &Tensor) -> Result<Tensor> {
        ops::add(self, other)
    }
    fn sub(&self, other: &Tensor) -> Result<Tensor> {
        ops::sub(self, other)
    }
    fn mul(&self, other: &Tensor) -> Result<Tensor> {
        ops::mul(self, other)
    }
    fn div(&self, other: &Tensor) -> Result<Tensor> {
        ops::div(self, other)
    }
    fn add_scalar(&self, c: f64) -> Result<Tensor> {
        ops::add_scalar(self, c)
    }
    fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        ops::mul_scalar(self, c)
    }
    fn neg(&self) -> Result<Tensor> {
        ops::unary::neg(self)
    }
    fn exp(&self) -> Result<Tensor> {
        ops::unary::exp(self)
    }
    fn log(&self) -> Result<Tensor> {
        ops::unary::log(self)
    }
    fn sqrt(&self) -> Result<Tensor> {
        ops::unary::sqrt(self)
    }
    fn pow_scalar(&self, p: f64) -> Result<Tensor> {
        ops::unary::pow_scalar(self, p)
    }
    fn relu(&self) -> Result<Tensor> {
        ops::unary::relu(self)
    }
    fn sigmoid(&self) -> Result<Tensor> {
        ops::unary::sigmoid(self)
    }
    fn tanh(&self) -> Result<Tensor> {
        ops::unary::tanh(self)
    }
    fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        ops::sum(self, dims, keepdim)
    }
    fn sum_all(&self) -> Result<Tensor> {
        ops::sum_all(self)
    }
    fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        ops::mean(self, dims, keepdim)
    }
    fn mean_all(&self) -> Result<Tensor> {
        ops::mean_all(self)
    }
    fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        ops::reduce::max(self, dims, keepdim)
    }
    fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        ops::reduce::argmax(self, dim, keepdim)
    }
    fn softmax(&self, dim: isize) -> Result<Tensor> {
        ops::softmax::softmax(self, dim)
    }
    fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        ops::softmax::log_softmax(self, dim)
    }
    fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        ops::matmul::matmul(self, other)
    }
    fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        ops::reshape(self, shape)
    }
    fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        ops::transpose(self, d0, d1)
    }
    fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        ops::permute(self, perm)
    }
    fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        ops::narrow(self, dim, start, len)
    }
    fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        ops::expand(self, shape)
    }
    fn squeeze(&self, dim: isize) -> Result<Tensor> {
        ops::squeeze(self, dim)
    }
    fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        ops::unsqueeze(self, dim)
    }
    fn flatten(&self, start_dim: isize, end_dim: isize) -> Result<Tensor> {
        ops::flatten(self, start_dim, end_dim)
    }
    fn contiguous(&self) -> Result<Tensor> {
        ops::contiguous(self)
    }
    fn dropout(&self, p: f64, training: bool, generator: &mut Generator) -> Result<Tensor> {
        ops::dropout::dropout(self, p, training, generator)
    }
}
