//! Reading and writing a tensor's elements, and the device-neutral runtime operations that
//! autograd, optimizers, layers and collectives use instead of touching memory: fill, copy,
//! scale, accumulate, cast, move between devices, read back. None of these are recorded by
//! autograd. Each checks its arguments here and dispatches once on the device to the host
//! runtime (`cpu/runtime.rs`) or the CUDA runtime.
//!
//! Host slices ([`Tensor::read_slice`], [`Tensor::write_slice`]) exist for the CPU kernels;
//! they fail with an error naming the device for a tensor that is not in host memory.

use parking_lot::{MappedRwLockReadGuard, MappedRwLockWriteGuard};

use crate::cpu::runtime as cpu;
use crate::cuda::runtime as cuda;
use crate::{
    with_element_type, with_float_type, with_half_type, DType, Device, Element, Error, Result,
    Tensor,
};

impl Tensor {
    pub(crate) fn expect_dtype<T: Element>(&self, op: &'static str) -> Result<()> {
        if self.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        Ok(())
    }

    /// Borrows the elements of a contiguous CPU tensor as a slice.
    ///
    /// Errors if the tensor is not in host memory, not contiguous (call `contiguous()` first)
    /// or `T` is not its dtype. Holding the guard blocks writers to the same storage.
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
        Ok(MappedRwLockReadGuard::map(
            self.storage().read_host("read_slice")?,
            |s| &T::slice(s).expect("dtype checked")[start..end],
        ))
    }

    /// Mutably borrows the elements of a contiguous CPU tensor. Writes are seen by every view
    /// of the storage; autograd does not record them.
    pub fn write_slice<T: Element>(&self) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        self.expect_dtype::<T>("write_slice")?;
        if !self.is_contiguous() {
            return Err(Error::invalid("write_slice", "tensor is not contiguous"));
        }
        let (start, end) = (
            self.layout().offset(),
            self.layout().offset() + self.numel(),
        );
        Ok(MappedRwLockWriteGuard::map(
            self.storage().write_host("write_slice")?,
            |s| &mut T::slice_mut(s).expect("dtype checked")[start..end],
        ))
    }

    /// The elements in row-major order (any layout), copied into host memory.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype::<T>("to_vec")?;
        match self.device() {
            Device::Cpu => cpu::to_vec::<T>(self),
            Device::Cuda(_) => cuda::to_vec::<T>(self),
        }
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

    /// A fresh contiguous copy of the elements on the same device, outside the graph.
    pub fn copy_detached(&self) -> Result<Tensor> {
        let out = Tensor::empty(self.dims(), self.dtype(), self.device())?;
        out.copy_(self)?;
        Ok(out)
    }

    /// The elements converted to `dtype` (a fresh tensor on the same device; rounds to nearest
    /// for floats, truncates toward zero for integers). Not recorded by autograd.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return self.copy_detached();
        }
        match self.device() {
            Device::Cpu => cpu::cast(self, dtype),
            Device::Cuda(_) => cuda::cast(self, dtype),
        }
    }

    /// The tensor on `device`: `self` when it is already there, otherwise a contiguous copy
    /// (outside the graph).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        device.ensure_available()?;
        if device == self.device() {
            return Ok(self.clone());
        }
        match device {
            Device::Cpu => cuda::download(self),
            Device::Cuda(n) => cuda::upload(self, n),
        }
    }

    /// A copy of this CPU tensor on `device`, made in order on `stream` — a stream of that
    /// device other than its compute stream, so that the copy overlaps computation (a data
    /// loader's prefetch, say) — and the event after which the copy is complete. Make the
    /// compute stream wait for the event (`Stream::wait_event`, which does not block the host)
    /// before using the copy. Dropping the copy frees its memory on the compute stream after the
    /// compute stream's uses and after this event — not after later work on `stream`, such as
    /// the copies of batches prefetched since. For a CPU `device` this is `to_device` and a
    /// completed event.
    pub fn to_device_on(
        &self,
        device: Device,
        stream: &crate::Stream,
    ) -> Result<(Tensor, crate::Event)> {
        match (self.device(), device) {
            (Device::Cpu, Device::Cuda(n)) => {
                device.same_as(stream.device(), "to_device_on")?;
                cuda::upload_on(self, n, stream)
            }
            _ => Ok((self.to_device(device)?, crate::Event::completed())),
        }
    }

    /// Moves this tensor's storage — and with it every view sharing the storage — to `device`,
    /// in place, and its accumulated gradient with it. Unlike [`Tensor::to_device`], which
    /// returns a copy, the tensor keeps its identity: hooks registered on it, optimizer state
    /// keyed by it and gradient buckets that refer to it keep working. This is how a module's
    /// parameters move (`Module::to_device`).
    pub fn move_to_device(&self, device: Device) -> Result<()> {
        self.storage().move_to(device)?;
        if let Some(grad) = self.grad() {
            grad.storage().move_to(device)?;
        }
        Ok(())
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

    /// Sets every element to `value`, in place.
    pub fn fill_(&self, value: f64) -> Result<()> {
        match self.device() {
            Device::Cpu => cpu::fill(self, value),
            Device::Cuda(_) => cuda::fill(self, value),
        }
    }

    /// Sets every element to zero, in place.
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }

    /// Copies `src`'s elements into `self`, in place (same shape, dtype and device).
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        self.check_same_shape("copy_", src)?;
        match self.device() {
            Device::Cpu => cpu::copy(self, src),
            Device::Cuda(_) => cuda::copy(self, src),
        }
    }

    /// Multiplies every element by `factor`, in place (float dtypes; f16 and bf16 compute in f32
    /// and round once).
    pub fn scale_(&self, factor: f64) -> Result<()> {
        match self.device() {
            Device::Cpu if self.dtype().is_half() => {
                with_half_type!("scale_", self.dtype(), T => cpu::scale_half::<T>(self, factor))
            }
            Device::Cpu => {
                with_float_type!("scale_", self.dtype(), T => cpu::scale::<T>(self, factor))
            }
            Device::Cuda(_) => cuda::scale(self, factor),
        }
    }

    /// `self += alpha * src`, in place (same shape; float dtypes; f16 and bf16 compute in f32 and
    /// round once). Gradient accumulation and optimizer updates are built on this.
    pub fn add_scaled_(&self, src: &Tensor, alpha: f64) -> Result<()> {
        self.check_same_shape("add_scaled_", src)?;
        match self.device() {
            Device::Cpu if self.dtype().is_half() => {
                with_half_type!("add_scaled_", self.dtype(), T => cpu::add_scaled_half::<T>(self, src, alpha))
            }
            Device::Cpu => {
                with_float_type!("add_scaled_", self.dtype(), T => cpu::add_scaled::<T>(self, src, alpha))
            }
            Device::Cuda(_) => cuda::add_scaled(self, src, alpha),
        }
    }

    /// `self += src`, in place.
    pub fn add_(&self, src: &Tensor) -> Result<()> {
        self.add_scaled_(src, 1.0)
    }

    /// Notes that work on `stream` (another stream of this tensor's device) uses this tensor's
    /// memory, so the memory is not reused before that work is done (PyTorch's
    /// `record_stream`). Nothing to do on the CPU, where memory is freed by the host.
    pub fn record_stream(&self, stream: &crate::Stream) -> Result<()> {
        self.device().same_as(stream.device(), "record_stream")?;
        if let Some(s) = stream.cuda_stream() {
            self.storage()
                .cuda_memory("record_stream")?
                .buffer()
                .record_stream(s);
        }
        Ok(())
    }

    /// Applies a float function to every element in place, on the host: a CPU tensor is
    /// updated where it is; a device tensor is read back, mapped and written again. For tests
    /// and set-up code; the training path uses the device kernels.
    pub fn map_inplace_f64(&self, op: &'static str, f: impl Fn(f64) -> f64) -> Result<()> {
        with_float_type!(op, self.dtype(), T => match self.device() {
            Device::Cpu => cpu::map_in_place::<T>(op, self, |x| *x = T::from_f64(f(x.to_f64()))),
            _ => {
                let mapped: Vec<T> = self.to_vec::<T>()?.into_iter().map(|x| T::from_f64(f(x.to_f64()))).collect();
                self.copy_(&Tensor::from_vec(mapped, self.dims(), Device::Cpu)?.to_device(self.device())?)
            }
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
    fn cuda_without_a_driver_is_a_clear_error_naming_what_is_missing() {
        if crate::cuda::is_available() {
            println!("skipped: this machine has a CUDA device");
            return;
        }
        let err = Tensor::zeros(&[2], DType::F32, Device::Cuda(0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cuda:0") && err.contains("libcuda"), "{err}");
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

    #[test]
    fn shape_products_that_overflow_are_errors_not_empty_tensors() {
        let huge = 1usize << 40;
        for err in [
            Tensor::zeros(&[huge, huge], DType::F32, Device::Cpu).unwrap_err(),
            Tensor::full(&[huge, huge, 2], 1.0, DType::F32, Device::Cpu).unwrap_err(),
            Tensor::from_vec(Vec::<f32>::new(), &[huge, huge], Device::Cpu).unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(msg.contains("more elements than any tensor"), "{msg}");
        }
        let t = Tensor::zeros(&[1, 3], DType::F32, Device::Cpu).unwrap();
        assert!(t.layout().expand("expand", &[huge, huge, 3]).is_err());
        assert!(t.layout().narrow("narrow", 1, usize::MAX, 2).is_err());
        assert!(t
            .layout()
            .infer_shape("reshape", &[-1, isize::MAX, isize::MAX])
            .is_err());
    }

    #[test]
    fn an_allocation_that_cannot_be_made_is_an_error_not_an_abort() {
        // 2^40 f32 elements (4 TiB): a valid shape whose memory no machine here has.
        let err = Tensor::zeros(&[1 << 20, 1 << 20], DType::F32, Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("out of memory") && err.contains("Tensor::zeros"),
            "{err}"
        );
    }

    #[test]
    fn moving_a_tensor_keeps_its_identity_and_its_views() {
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap();
        let view = t
            .view_detached(t.layout().transpose("t", 0, 1).unwrap())
            .unwrap();
        let id = t.id();
        t.move_to_device(Device::Cpu).unwrap();
        assert_eq!(t.id(), id);
        assert_eq!(view.to_vec::<f32>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
        if !crate::cuda::is_available() {
            let err = t.move_to_device(Device::Cuda(0)).unwrap_err().to_string();
            assert!(err.contains("cuda:0") && err.contains("libcuda"), "{err}");
            assert_eq!(
                t.device(),
                Device::Cpu,
                "a failed move leaves the tensor where it was"
            );
        }
    }
}
