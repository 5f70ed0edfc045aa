//! Creating tensors: from data, filled, ranges and random.

use crate::rng::Generator;
use crate::storage::CpuStorage;
use crate::{with_element_type, DType, Device, Element, Error, Layout, Result, Storage, Tensor};

impl Tensor {
    /// A tensor that takes ownership of `data`, viewed with `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(Error::shape(
                "Tensor::from_vec",
                format!(
                    "{} elements cannot have shape {:?} ({numel} elements)",
                    data.len(),
                    shape
                ),
            ));
        }
        Tensor::from_storage(
            Storage::cpu(T::into_storage(data)),
            Layout::contiguous(shape),
        )
    }

    /// A tensor copied from `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-dimensional tensor holding `value`.
    pub fn scalar<T: Element>(value: T, device: Device) -> Result<Tensor> {
        Tensor::from_vec(vec![value], &[], device)
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel = shape.iter().product();
        Tensor::from_storage(
            Storage::cpu(CpuStorage::zeros(dtype, numel)),
            Layout::contiguous(shape),
        )
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// A tensor with every element `value` (converted to `dtype`).
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel: usize = shape.iter().product();
        with_element_type!(dtype, T => Tensor::from_vec(vec![T::from_f64(value); numel], shape, device))
    }

    /// A tensor of zeros with the shape, dtype and device of `self`.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.dims(), self.dtype(), self.device())
    }

    /// A tensor of ones with the shape, dtype and device of `self`.
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.dims(), self.dtype(), self.device())
    }

    /// `start, start+step, …` up to (not including) `end`, as a 1-D tensor.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "arange",
                format!("invalid range {start}..{end} step {step}"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        with_element_type!(dtype, T => {
            let data: Vec<T> = (0..n).map(|i| T::from_f64(start + i as f64 * step)).collect();
            Tensor::from_vec(data, &[n], device)
        })
    }

    /// Uniform samples in `[low, high)` from `generator`.
    pub fn rand(
        shape: &[usize],
        low: f64,
        high: f64,
        dtype: DType,
        device: Device,
        generator: &mut Generator,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        with_element_type!(dtype, T => {
            let data: Vec<T> =
                (0..numel).map(|_| T::from_f64(low + (high - low) * generator.uniform())).collect();
            Tensor::from_vec(data, shape, device)
        })
    }

    /// Normal samples with `mean` and `std` from `generator`.
    pub fn randn(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        device: Device,
        generator: &mut Generator,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        with_element_type!(dtype, T => {
            let data: Vec<T> =
                (0..numel).map(|_| T::from_f64(mean + std * generator.normal())).collect();
            Tensor::from_vec(data, shape, device)
        })
    }
}
