//! Reading and writing a tensor's elements, casts, and the few in-place kernels the runtime
//! itself needs (fill, copy, scale, accumulate) — the ones gradient accumulation, optimizers
//! and collectives use. None of these are recorded by autograd.

use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockWriteGuard,
};

use crate::{
    with_element_type, with_float_type, DType, Device, Element, Error, Layout, Result, Tensor,
};

impl Tensor {
    fn expect_dtype<T: Element>(&self, op: &'static str) -> Result<()> {
        if self.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        Ok(())
    }

    /// Borrows the elements of a contiguous tensor as a slice.
    ///
    /// Errors if the tensor is not contiguous (call `contiguous()` first) or `T` is not its
    /// dtype. Holding the guard blocks writers to the same storage.
    pub fn read_slice<T: Element>(&self) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        self.expect_dtype::<T>("read_slice")?;
        if !self.is_contiguous() {
            return Err(Error::invalid(
                "read_slice",
                "tensor is not contiguous; call contiguous() first",
            ));
        }
        let (start, end) = (
            self.layout().offset(),
            self.layout().offset() + self.numel(),
        );
        Ok(RwLockReadGuard::map(self.storage().read(), |s| {
            &T::slice(s).expect("dtype checked")[start..end]
        }))
    }

    /// Mutably borrows the elements of a contiguous tensor. Writes are seen by every view of
    /// the storage; autograd does not record them.
    pub fn write_slice<T: Element>(&self) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        self.expect_dtype::<T>("write_slice")?;
        if !self.is_contiguous() {
            return Err(Error::invalid("write_slice", "tensor is not contiguous"));
        }
        let (start, end) = (
            self.layout().offset(),
            self.layout().offset() + self.numel(),
        );
        Ok(RwLockWriteGuard::map(self.storage().write(), |s| {
            &mut T::slice_mut(s).expect("dtype checked")[start..end]
        }))
    }

    /// The elements in row-major order (any layout).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype::<T>("to_vec")?;
        let guard = self.storage().read();
        let data = T::slice(&guard).expect("dtype checked");
        if self.is_contiguous() {
            let off = self.layout().offset();
            return Ok(data[off..off + self.numel()].to_vec());
        }
        let mut out = crate::alloc::uninit::<T>(self.numel());
        let row_len = self.dims().last().copied().unwrap_or(1);
        let mut rows = out.chunks_mut(row_len.max(1));
        self.layout().for_each_row(|start, stride| {
            let row = rows.next().expect("one output row per layout row");
            if stride == 1 {
                row.copy_from_slice(&data[start..start + row.len()]);
            } else {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = data[start + j * stride];
                }
            }
        });
        Ok(out)
    }

    /// The elements converted to f64, in row-major order.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        with_element_type!(self.dtype(), T => Ok(self.to_vec::<T>()?.into_iter().map(|x| x.to_f64()).collect()))
    }

    /// The single element of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "item",
                format!(
                    "tensor of shape {:?} has {} elements, not 1",
                    self.dims(),
                    self.numel()
                ),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// A contiguous tensor with the same elements: `self` (detached view) if already
    /// contiguous, otherwise a copy. Not recorded by autograd; see `tandem-ops` for that.
    pub fn contiguous_detached(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.detach());
        }
        self.copy_detached()
    }

    /// A fresh contiguous copy of the elements, outside the graph.
    pub fn copy_detached(&self) -> Result<Tensor> {
        with_element_type!(self.dtype(), T => Tensor::from_vec(self.to_vec::<T>()?, self.dims(), self.device()))
    }

    /// The elements converted to `dtype` (a fresh tensor; rounds to nearest for floats,
    /// truncates toward zero for integers). Not recorded by autograd.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return self.copy_detached();
        }
        let values = self.to_vec_f64()?;
        with_element_type!(dtype, T => {
            Tensor::from_vec(values.into_iter().map(T::from_f64).collect::<Vec<T>>(), self.dims(), self.device())
        })
    }

    /// The tensor on `device` (a copy when the device differs).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        if device == self.device() {
            return Ok(self.clone());
        }
        self.copy_detached()
    }

    fn check_same_shape(&self, op: &'static str, src: &Tensor) -> Result<()> {
        self.device().same_as(src.device(), op)?;
        if self.dims() != src.dims() {
            return Err(Error::shape(
                op,
                format!("destination {:?} vs source {:?}", self.dims(), src.dims()),
            ));
        }
        if self.dtype() != src.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: src.dtype(),
            });
        }
        Ok(())
    }

    /// Applies `f(dst, src)` elementwise in place. Reading from the same storage as the
    /// destination is handled by copying the source first.
    fn zip_in_place<T: Element>(&self, src: &Tensor, mut f: impl FnMut(&mut T, T)) -> Result<()> {
        if self.is_contiguous() && src.is_contiguous() && !self.storage().same_buffer(src.storage())
        {
            // The common case (gradient accumulation, optimizer updates): two dense buffers.
            let source = src.read_slice::<T>()?;
            let mut dest = self.write_slice::<T>()?;
            dest.iter_mut()
                .zip(source.iter())
                .for_each(|(d, &s)| f(d, s));
            return Ok(());
        }
        let src_values: Vec<T> = src.to_vec::<T>()?;
        let layout: Layout = self.layout().clone();
        let mut guard = self.storage().write();
        let data = T::slice_mut(&mut guard).expect("dtype checked");
        let mut k = 0;
        layout.for_each_index(|i| {
            f(&mut data[i], src_values[k]);
            k += 1;
        });
        Ok(())
    }

    fn map_in_place<T: Element>(&self, mut f: impl FnMut(&mut T)) {
        let layout = self.layout().clone();
        let mut guard = self.storage().write();
        let data = T::slice_mut(&mut guard).expect("dtype checked");
        if layout.is_contiguous() {
            let off = layout.offset();
            data[off..off + layout.numel()].iter_mut().for_each(f);
        } else {
            layout.for_each_index(|i| f(&mut data[i]));
        }
    }

    /// Sets every element to `value`, in place.
    pub fn fill_(&self, value: f64) -> Result<()> {
        with_element_type!(self.dtype(), T => {
            let v = T::from_f64(value);
            self.map_in_place::<T>(|x| *x = v);
            Ok(())
        })
    }

    /// Sets every element to zero, in place.
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }

    /// Copies `src`'s elements into `self`, in place (same shape and dtype).
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        self.check_same_shape("copy_", src)?;
        with_element_type!(self.dtype(), T => self.zip_in_place::<T>(src, |d, s| *d = s))
    }

    /// Multiplies every element by `factor`, in place (float dtypes).
    pub fn scale_(&self, factor: f64) -> Result<()> {
        with_float_type!("scale_", self.dtype(), T => {
            let f = T::from_f64(factor);
            self.map_in_place::<T>(|x| *x *= f);
            Ok(())
        })
    }

    /// `self += alpha * src`, in place (same shape; float dtypes). Gradient accumulation and
    /// optimizer updates are built on this.
    pub fn add_scaled_(&self, src: &Tensor, alpha: f64) -> Result<()> {
        self.check_same_shape("add_scaled_", src)?;
        with_float_type!("add_scaled_", self.dtype(), T => {
            let a = T::from_f64(alpha);
            self.zip_in_place::<T>(src, |d, s| *d += a * s)
        })
    }

    /// `self += src`, in place.
    pub fn add_(&self, src: &Tensor) -> Result<()> {
        self.add_scaled_(src, 1.0)
    }

    /// Applies a float function to every element in place. For optimizers and runtime code that
    /// must update parameters without recording a graph.
    pub fn map_inplace_f64(&self, op: &'static str, f: impl Fn(f64) -> f64) -> Result<()> {
        with_float_type!(op, self.dtype(), T => {
            self.map_in_place::<T>(|x| *x = T::from_f64(f(x.to_f64())));
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_kernels_respect_views() {
        let t = Tensor::from_vec((0..6).map(|x| x as f32).collect(), &[2, 3], Device::Cpu).unwrap();
        let col = t
            .view_detached(t.layout().narrow("n", 1, 1, 1).unwrap())
            .unwrap();
        col.fill_(9.0).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0., 9., 2., 3., 9., 5.]);
        t.add_(&t.copy_detached().unwrap()).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0., 18., 4., 6., 18., 10.]);
        t.add_scaled_(&t, -0.5).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0., 9., 2., 3., 9., 5.]);
    }

    #[test]
    fn casts_round_trip_through_half_types() {
        let t = Tensor::from_vec(vec![1.5f32, -2.25, 3.0], &[3], Device::Cpu).unwrap();
        for dt in [DType::F16, DType::BF16, DType::F64] {
            let back = t.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(back.to_vec::<f32>().unwrap(), vec![1.5, -2.25, 3.0]);
        }
        assert_eq!(
            t.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(),
            vec![1, -2, 3]
        );
    }

    #[test]
    fn cuda_is_a_clear_error_until_the_backend_lands() {
        let err = Tensor::zeros(&[2], DType::F32, Device::Cuda(0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cuda:0") && err.contains("not built"), "{err}");
    }

    #[test]
    fn from_vec_checks_element_count() {
        let err = Tensor::from_vec(vec![1.0f32; 5], &[2, 3], Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("5 elements") && err.contains("[2, 3]"),
            "{err}"
        );
    }
}
