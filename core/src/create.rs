//! Creating tensors: from data, filled, ranges and random.

use crate::layout::checked_numel;
use crate::rng::Generator;
use crate::storage::CpuStorage;
use crate::{with_element_type, DType, Device, Element, Error, Layout, Result, Storage, Tensor};

impl Tensor {
    /// A tensor that takes ownership of `data`, viewed with `shape`, placed on `device` (a copy
    /// when `device` is not the CPU).
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize], device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel = checked_numel("Tensor::from_vec", shape)?;
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
        let host = Tensor::from_storage(
            Storage::cpu(T::into_storage(data)),
            Layout::contiguous(shape),
        )?;
        host.to_device(device)
    }

    /// A tensor copied from `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-dimensional tensor holding `value`.
    pub fn scalar<T: Element>(value: T, device: Device) -> Result<Tensor> {
        Tensor::from_vec(vec![value], &[], device)
    }

    /// A tensor whose elements are unspecified (memory reused from the caching allocator):
    /// for results that are about to be overwritten entirely.
    pub fn empty(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel = checked_numel("Tensor::empty", shape)?;
        match device {
            Device::Cpu => Tensor::from_storage(
                Storage::cpu(CpuStorage::try_uninit("Tensor::empty", dtype, numel)?),
                Layout::contiguous(shape),
            ),
            Device::Cuda(n) => crate::cuda::runtime::empty("Tensor::empty", n, shape, dtype, numel),
        }
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        let numel = checked_numel("Tensor::zeros", shape)?;
        match device {
            Device::Cpu => Tensor::from_storage(
                Storage::cpu(CpuStorage::try_zeros("Tensor::zeros", dtype, numel)?),
                Layout::contiguous(shape),
            ),
            _ => {
                let t = Tensor::empty(shape, dtype, device)?;
                t.fill_(0.0)?;
                Ok(t)
            }
        }
    }

    /// A tensor of ones.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// A tensor with every element `value` (converted to `dtype`).
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        let t = Tensor::empty(shape, dtype, device)?;
        t.fill_(value)?;
        Ok(t)
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
        let count = ((end - start) / step).ceil().max(0.0);
        if count > crate::layout::MAX_NUMEL as f64 {
            return Err(Error::invalid(
                "arange",
                format!("range {start}..{end} step {step} has too many elements ({count})"),
            ));
        }
        let n = count as usize;
        with_element_type!(dtype, T => {
            let mut data = crate::alloc::try_uninit::<T>("arange", n)?;
            data.iter_mut().enumerate().for_each(|(i, x)| *x = T::from_f64(start + i as f64 * step));
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
        let numel = checked_numel("Tensor::rand", shape)?;
        with_element_type!(dtype, T => {
            let mut data = crate::alloc::try_uninit::<T>("Tensor::rand", numel)?;
            data.iter_mut().for_each(|x| *x = T::from_f64(low + (high - low) * generator.uniform()));
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
        let numel = checked_numel("Tensor::randn", shape)?;
        with_element_type!(dtype, T => {
            let mut data = crate::alloc::try_uninit::<T>("Tensor::randn", numel)?;
            data.iter_mut().for_each(|x| *x = T::from_f64(mean + std * generator.normal()));
            Tensor::from_vec(data, shape, device)
        })
    }
}
