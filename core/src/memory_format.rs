//! Memory formats of 4-D tensors: the order in which the elements of an `[N, C, H, W]` tensor
//! sit in memory, PyTorch's `torch.memory_format`.
//!
//! The logical shape never changes: a channels-last tensor is still indexed `[n, c, h, w]`;
//! only its strides differ (`[H·W·C, 1, W·C, C]`, the bytes of an NHWC array). Kernels that
//! know the format (conv2d, batch norm, pooling, the elementwise ops) read and write it
//! natively; everything else sees an ordinary strided tensor. `contiguous()` keeps meaning
//! row-major (NCHW); [`Tensor::contiguous_in`] asks for a format.

use smallvec::SmallVec;

use crate::layout::{contiguous_strides, Strides};
use parking_lot::{MappedRwLockReadGuard, MappedRwLockWriteGuard};

use crate::{Element, Error, Layout, Result, Tensor};

/// How the elements of a 4-D `[N, C, H, W]` tensor are ordered in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MemoryFormat {
    /// Row-major: NCHW for a 4-D tensor (the format of every fresh tensor).
    #[default]
    Contiguous,
    /// Channels innermost: NHWC bytes, strides `[H·W·C, 1, W·C, C]` (4-D tensors only).
    ChannelsLast,
}

impl MemoryFormat {
    /// The dense strides of a tensor of `shape` in this format, or an error naming `op` when
    /// the format needs another rank (channels-last is defined for 4-D tensors only).
    pub fn strides(self, op: &'static str, shape: &[usize]) -> Result<Strides> {
        match self {
            MemoryFormat::Contiguous => Ok(contiguous_strides(shape)),
            MemoryFormat::ChannelsLast => {
                if shape.len() != 4 {
                    return Err(Error::shape(
                        op,
                        format!(
                            "channels-last needs a 4-D [N, C, H, W] tensor, got shape {shape:?} \
                             (rank {})",
                            shape.len()
                        ),
                    ));
                }
                Ok(channels_last_strides(shape))
            }
        }
    }

    /// The dense layout of a fresh tensor of `shape` in this format (offset 0).
    pub fn layout(self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        let strides = self.strides(op, shape)?;
        Ok(Layout::from_parts(SmallVec::from_slice(shape), strides, 0))
    }
}

/// Channels-last strides of a 4-D shape: `[H·W·C, 1, W·C, C]` (sizes of 0 count as 1, as in
/// row-major strides, so the strides stay distinct).
fn channels_last_strides(shape: &[usize]) -> Strides {
    let (c, h, w) = (shape[1].max(1), shape[2].max(1), shape[3].max(1));
    SmallVec::from_slice(&[h * w * c, 1, w * c, c])
}

impl Layout {
    /// Whether the elements are dense in `format` (sizes of 1 may carry any stride, as in
    /// PyTorch's `is_contiguous(memory_format=...)`). A channels-last query on a layout that is
    /// not 4-D is false.
    pub fn is_contiguous_in(&self, format: MemoryFormat) -> bool {
        match format {
            MemoryFormat::Contiguous => self.is_contiguous(),
            MemoryFormat::ChannelsLast => {
                if self.rank() != 4 {
                    return false;
                }
                if self.numel() == 0 {
                    return true;
                }
                let (shape, strides) = (self.shape(), self.strides());
                let mut expected = 1;
                for d in [1, 3, 2, 0] {
                    if shape[d] != 1 && strides[d] != expected {
                        return false;
                    }
                    expected *= shape[d];
                }
                true
            }
        }
    }

    /// The format whose stride order these strides follow (PyTorch's
    /// `suggest_memory_format`): channels-last when the strides of a 4-D layout grow in the
    /// order C, W, H, N — including dense channels-last tensors with sizes of 1, which the
    /// strides still tell apart — and row-major otherwise (every other rank, and the ambiguous
    /// cases such as `[N, 1, 1, 1]` with equal strides).
    pub fn memory_format(&self) -> MemoryFormat {
        if self.rank() != 4 {
            return MemoryFormat::Contiguous;
        }
        let (shape, strides) = (self.shape(), self.strides());
        if strides[1] == 0 {
            return MemoryFormat::Contiguous;
        }
        let mut min = 0;
        for d in [1, 3, 2, 0] {
            if shape[d] == 0 || strides[d] < min {
                return MemoryFormat::Contiguous;
            }
            // `[N, 1, 1, 1]` with equal strides everywhere: default to row-major.
            if d == 0 && min == strides[1] {
                return MemoryFormat::Contiguous;
            }
            min = strides[d];
            if shape[d] > 1 {
                min *= shape[d];
            }
        }
        MemoryFormat::ChannelsLast
    }

    /// Whether this layout is dense channels-last *and* its strides say so (the kernels'
    /// test for taking their NHWC path: the memory format such a tensor reports is
    /// channels-last).
    pub fn is_channels_last(&self) -> bool {
        self.is_contiguous_in(MemoryFormat::ChannelsLast)
            && self.memory_format() == MemoryFormat::ChannelsLast
    }
}

impl Tensor {
    /// Whether the elements are dense in `format` (see [`Layout::is_contiguous_in`]).
    pub fn is_contiguous_in(&self, format: MemoryFormat) -> bool {
        self.layout().is_contiguous_in(format)
    }

    /// The memory format this tensor's strides follow (PyTorch's `suggest_memory_format`;
    /// row-major for every rank but 4). Ops that keep the format give their outputs this one.
    pub fn memory_format(&self) -> MemoryFormat {
        self.layout().memory_format()
    }

    /// A tensor with the same elements, dense in `format`: `self` (a detached handle) when it
    /// already is, otherwise a copy on the same device. Not recorded by autograd; the
    /// differentiable version is `tandem_ops::to_memory_format`. Channels-last needs a 4-D
    /// tensor (an error naming the shape otherwise).
    pub fn contiguous_in(&self, format: MemoryFormat) -> Result<Tensor> {
        const OP: &str = "contiguous_in";
        let layout = format.layout(OP, self.dims())?;
        if self.is_dense_as(format) {
            return Ok(self.detach());
        }
        let out = Tensor::empty(self.dims(), self.dtype(), self.device())?.view_detached(layout)?;
        out.copy_(self)?;
        Ok(out)
    }

    /// The format this tensor is dense in, as the format its outputs should keep: channels-last
    /// when [`Layout::is_channels_last`], else row-major when contiguous, else `None` (a
    /// strided view). The storage order of a dense tensor is its format's order.
    pub fn dense_format(&self) -> Option<MemoryFormat> {
        if self.layout().is_channels_last() {
            Some(MemoryFormat::ChannelsLast)
        } else if self.is_contiguous() {
            Some(MemoryFormat::Contiguous)
        } else {
            None
        }
    }

    /// Borrows the elements of a CPU tensor that is dense row-major or dense channels-last as
    /// a slice in storage order (for channels-last, NHWC order). Errors when the tensor is
    /// neither, is not in host memory, or `T` is not its dtype.
    pub fn read_dense_slice<T: Element>(&self) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        if self.is_contiguous() {
            return self.read_slice::<T>();
        }
        let run = self.channels_last_run::<T>("read_dense_slice")?;
        Ok(MappedRwLockReadGuard::map(
            self.storage().read_host("read_dense_slice")?,
            |s| &T::slice(s).expect("dtype checked")[run],
        ))
    }

    /// Mutably borrows the elements of a CPU tensor that is dense row-major or dense
    /// channels-last as a slice in storage order (the writing twin of
    /// [`Tensor::read_dense_slice`], with the same errors). Writes are seen by every view of
    /// the storage; autograd does not record them.
    pub fn write_dense_slice<T: Element>(&self) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        if self.is_contiguous() {
            return self.write_slice::<T>();
        }
        let run = self.channels_last_run::<T>("write_dense_slice")?;
        Ok(MappedRwLockWriteGuard::map(
            self.storage().write_host("write_dense_slice")?,
            |s| &mut T::slice_mut(s).expect("dtype checked")[run],
        ))
    }

    /// The run of storage a dense channels-last tensor of element type `T` covers; errors
    /// naming `op` for another layout or dtype.
    fn channels_last_run<T: Element>(&self, op: &'static str) -> Result<std::ops::Range<usize>> {
        if !self.is_contiguous_in(MemoryFormat::ChannelsLast) {
            return Err(Error::invalid(
                op,
                format!(
                    "tensor of shape {:?} with strides {:?} is dense in no memory format",
                    self.dims(),
                    self.layout().strides()
                ),
            ));
        }
        self.expect_dtype::<T>(op)?;
        let start = self.layout().offset();
        Ok(start..start + self.numel())
    }

    /// A CPU tensor of `shape` dense in `format` that takes ownership of `data`, given in
    /// storage order (NHWC for channels-last), moved to `device`.
    pub fn from_vec_in<T: Element>(
        data: Vec<T>,
        shape: &[usize],
        device: crate::Device,
        format: MemoryFormat,
    ) -> Result<Tensor> {
        let layout = format.layout("Tensor::from_vec_in", shape)?;
        let flat = Tensor::from_vec(data, shape, crate::Device::Cpu)?.view_detached(layout)?;
        if device == crate::Device::Cpu {
            Ok(flat)
        } else {
            // Uploads keep the layout only for contiguous tensors: re-lay the copy.
            flat.to_device(device)?.contiguous_in(format)
        }
    }

    /// A fresh tensor of `shape` whose elements are unspecified, dense in `format` (for results
    /// that are about to be overwritten entirely).
    pub fn empty_in(
        shape: &[usize],
        dtype: crate::DType,
        device: crate::Device,
        format: MemoryFormat,
    ) -> Result<Tensor> {
        let layout = format.layout("Tensor::empty_in", shape)?;
        Tensor::empty(shape, dtype, device)?.view_detached(layout)
    }
}

impl Tensor {
    /// Re-lays this tensor out in `format`, in place: the same tensor (same id, the same
    /// handles everywhere, the same `requires_grad`, hooks and gradient slot) with the same
    /// values, now dense in `format` — what PyTorch's `model.to(memory_format=...)` does to a
    /// parameter by replacing `param.data`. Optimizers, DDP and anything else holding the
    /// tensor keep working with it. Nothing happens when the tensor is already dense in
    /// `format`. Its accumulated gradient, when it owns its storage, is re-laid out too; a
    /// gradient that is a view into a shared buffer (a DDP bucket) keeps its layout, which every
    /// consumer of gradients reads in logical order.
    ///
    /// Only a leaf that owns all of its storage can change layout: a non-leaf (its graph
    /// recorded the old layout), a view of part of a storage, and a tensor whose storage another
    /// tensor shares (a view of it, a detached handle, a copy saved for a backward still to run)
    /// are refused with an error naming the shape, as is channels-last for a tensor that is not
    /// 4-D.
    ///
    /// The elements are copied once into a buffer in the new order, which then replaces the
    /// storage's buffer; the layout is swapped after. Do not run it while another thread uses
    /// the tensor (as with any in-place update of a parameter); such a reader can see the new
    /// values with the old strides, never memory outside the storage (both layouts cover
    /// exactly the same elements of it). Each re-layout that changes the strides keeps the old
    /// layout (a few dozen bytes) for the tensor's life, since references to it may be out, and
    /// adds one step to every later read of the layout: convert a model once, not every step.
    pub fn to_memory_format_(&self, format: MemoryFormat) -> Result<()> {
        const OP: &str = "to_memory_format_";
        let layout = format.layout(OP, self.dims())?;
        if !self.is_leaf() {
            return Err(Error::autograd(format!(
                "{OP}: tensor {:?} {} was computed by a recorded op (`{}`); only a leaf (a \
                 parameter, a buffer, a detached tensor) can be re-laid out in place",
                self.dims(),
                self.dtype(),
                self.grad_fn().map_or("?", |n| n.name())
            )));
        }
        let grad = self.lock_grad();
        if !self.is_dense_as(format) {
            self.check_owns_storage(OP)?;
            let relaid = Tensor::empty(self.dims(), self.dtype(), self.device())?
                .view_detached(layout.clone())?;
            relaid.copy_(self)?;
            let donor = relaid.storage().clone();
            drop(relaid);
            self.storage().adopt(OP, donor)?;
            self.replace_layout(layout);
        }
        if let Some(g) = grad.as_ref() {
            if g.is_leaf() && g.check_owns_storage(OP).is_ok() {
                g.to_memory_format_(format)?;
            }
        }
        Ok(())
    }

    /// Whether the tensor is dense in `format` with strides that say so (what
    /// [`Tensor::contiguous_in`] leaves alone).
    fn is_dense_as(&self, format: MemoryFormat) -> bool {
        match format {
            MemoryFormat::Contiguous => self.is_contiguous(),
            MemoryFormat::ChannelsLast => self.layout().is_channels_last(),
        }
    }

    /// Errors (naming `op`) unless this tensor's layout covers its whole storage and no other
    /// tensor shares the storage, so that replacing the storage's buffer changes this tensor
    /// alone.
    fn check_owns_storage(&self, op: &'static str) -> Result<()> {
        let storage = self.storage();
        if self.layout().offset() != 0 || storage.len() != self.numel() {
            return Err(Error::invalid(
                op,
                format!(
                    "tensor {:?} {} is a view of part of a storage (offset {}, {} of its {} \
                     elements); only a tensor that owns all of its storage can be re-laid out \
                     in place",
                    self.dims(),
                    self.dtype(),
                    self.layout().offset(),
                    self.numel(),
                    storage.len()
                ),
            ));
        }
        if !storage.is_unique() {
            return Err(Error::invalid(
                op,
                format!(
                    "tensor {:?} {} shares its storage with another tensor (a view of it, a \
                     detached handle, or a copy saved for a backward still to run); drop those \
                     first or re-lay out a copy",
                    self.dims(),
                    self.dtype()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device};

    fn iota(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_vec((0..n).map(|v| v as f32).collect(), shape, Device::Cpu).unwrap()
    }

    #[test]
    fn channels_last_copy_keeps_values_and_has_nhwc_strides() {
        let x = iota(&[2, 3, 4, 5]);
        assert_eq!(x.memory_format(), MemoryFormat::Contiguous);
        let y = x.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
        assert_eq!(y.layout().strides().as_slice(), &[60, 1, 15, 3]);
        assert_eq!(y.memory_format(), MemoryFormat::ChannelsLast);
        assert!(y.is_contiguous_in(MemoryFormat::ChannelsLast));
        assert!(!y.is_contiguous());
        assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        // The storage holds NHWC order: element (n=0, c=1, h=0, w=0) is second.
        assert_eq!(y.read_dense_slice::<f32>().unwrap()[1], 20.0);
        let back = y.contiguous_in(MemoryFormat::Contiguous).unwrap();
        assert!(back.is_contiguous());
        assert_eq!(back.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        // Already in the format: the same storage, no copy.
        let again = y.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
        assert!(again.storage().same_buffer(y.storage()));
    }

    #[test]
    fn fills_and_scales_of_channels_last_tensors_walk_their_storage_run() {
        let cl = MemoryFormat::ChannelsLast;
        let x = iota(&[2, 3, 4, 5]).contiguous_in(cl).unwrap();
        x.scale_(2.0).unwrap();
        let want: Vec<f32> = iota(&[2, 3, 4, 5])
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| 2.0 * v)
            .collect();
        assert_eq!(x.to_vec::<f32>().unwrap(), want);
        x.fill_(1.5).unwrap();
        assert!(x.to_vec::<f32>().unwrap().iter().all(|&v| v == 1.5));
        assert_eq!(x.memory_format(), cl);
        // A channels-last view of one sample inside a larger buffer: only its run changes.
        let whole = iota(&[2, 3, 4, 5]).contiguous_in(cl).unwrap();
        let second = whole
            .view_detached(crate::Layout::from_parts(
                crate::layout::Shape::from_slice(&[1, 3, 4, 5]),
                crate::layout::Strides::from_slice(&[60, 1, 15, 3]),
                60,
            ))
            .unwrap();
        assert!(second.is_contiguous_in(cl));
        second.zero_().unwrap();
        let got = whole.to_vec::<f32>().unwrap();
        let before = iota(&[2, 3, 4, 5]).to_vec::<f32>().unwrap();
        assert_eq!(&got[..60], &before[..60]);
        assert!(got[60..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn half_in_place_sums_widen_add_and_round_each_element_once() {
        use half::{bf16, f16};
        let shape = [3, 7, 9, 11]; // 2079 elements: chunks of 512 and a tail
        let n: usize = shape.iter().product();
        let values = |k: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.37 + k).sin() * 300.0) / (1.0 + i as f32 % 13.0))
                .collect()
        };
        let (a, b) = (values(0.0), values(1.0));
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            for dtype in [DType::BF16, DType::F16] {
                let t = |v: &[f32]| {
                    Tensor::from_vec(v.to_vec(), &shape, Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                        .contiguous_in(format)
                        .unwrap()
                };
                let (x, y) = (t(&a), t(&b));
                let (xv, yv) = (
                    x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
                    y.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
                );
                x.add_scaled_(&y, -0.75).unwrap();
                let want: Vec<f32> = xv
                    .iter()
                    .zip(&yv)
                    .map(|(&x, &y)| {
                        let v = x + -0.75f32 * y;
                        match dtype {
                            DType::BF16 => bf16::from_f32(v).to_f32(),
                            _ => f16::from_f32(v).to_f32(),
                        }
                    })
                    .collect();
                assert_eq!(
                    x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
                    want,
                    "{dtype} {format:?}"
                );
                assert_eq!(x.memory_format(), format);
            }
        }
    }

    #[test]
    fn casts_and_in_place_sums_keep_channels_last_and_the_values() {
        let cl = MemoryFormat::ChannelsLast;
        let (x, y) = (iota(&[2, 3, 4, 5]), iota(&[2, 3, 4, 5]));
        let (xc, yc) = (x.contiguous_in(cl).unwrap(), y.contiguous_in(cl).unwrap());
        // A cast runs in storage order and keeps the layout (PyTorch's preserve_format).
        let half = xc.to_dtype(DType::BF16).unwrap();
        assert_eq!(half.memory_format(), cl);
        let wide = half.to_dtype(DType::F32).unwrap();
        assert_eq!(wide.memory_format(), cl);
        assert_eq!(wide.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        // Two channels-last tensors add element by element; a row-major one into a
        // channels-last one pairs elements by position too.
        wide.add_(&yc).unwrap();
        wide.add_(&y).unwrap();
        let want: Vec<f32> = x.to_vec::<f32>().unwrap().iter().map(|v| 3.0 * v).collect();
        assert_eq!(wide.to_vec::<f32>().unwrap(), want);
        assert_eq!(wide.memory_format(), cl);
    }

    #[test]
    fn formats_of_size_one_dims_follow_pytorch() {
        // [N, 1, H, W] in channels-last strides reports channels-last; row-major reports
        // contiguous, although both are dense in both formats.
        let x = iota(&[2, 1, 3, 3]);
        assert_eq!(x.memory_format(), MemoryFormat::Contiguous);
        let y = x.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
        assert_eq!(y.memory_format(), MemoryFormat::ChannelsLast);
        // [N, C, 1, 1] likewise.
        let x = iota(&[2, 3, 1, 1]);
        assert_eq!(x.memory_format(), MemoryFormat::Contiguous);
        let y = x.contiguous_in(MemoryFormat::ChannelsLast).unwrap();
        assert_eq!(y.memory_format(), MemoryFormat::ChannelsLast);
        // A transposed (not dense) layout is neither.
        let t = x
            .view_detached(x.layout().permute("t", &[0, 2, 1, 3]).unwrap())
            .unwrap();
        assert!(!t.is_contiguous_in(MemoryFormat::ChannelsLast) || t.dims()[1] == 1);
    }

    #[test]
    fn channels_last_needs_rank_four() {
        let x = iota(&[2, 3, 4]);
        let err = x
            .contiguous_in(MemoryFormat::ChannelsLast)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("contiguous_in") && err.contains("[2, 3, 4]"),
            "{err}"
        );
        assert!(!x.is_contiguous_in(MemoryFormat::ChannelsLast));
        assert_eq!(x.memory_format(), MemoryFormat::Contiguous);
        let e = Tensor::empty_in(
            &[1, 2, 3, 4],
            DType::F64,
            Device::Cpu,
            MemoryFormat::ChannelsLast,
        )
        .unwrap();
        assert_eq!(e.layout().strides().as_slice(), &[24, 1, 8, 2]);
    }

    #[test]
    fn relayout_in_place_keeps_identity_values_grad_and_hooks() {
        let w = iota(&[3, 2, 2, 2]).with_requires_grad().unwrap();
        let handle = w.clone();
        let id = w.id();
        let values = w.to_vec::<f32>().unwrap();
        w.set_grad(Some(iota(&[3, 2, 2, 2]))).unwrap();
        let hook: crate::graph::GradReadyHook = std::sync::Arc::new(|_| Ok(()));
        w.hooks()
            .lock()
            .grad_ready
            .push((crate::graph::HookId::fresh(), hook));

        w.to_memory_format_(MemoryFormat::ChannelsLast).unwrap();
        for t in [&w, &handle] {
            assert_eq!(t.id(), id);
            assert!(t.layout().is_channels_last());
            assert_eq!(t.layout().strides().as_slice(), &[8, 1, 4, 2]);
            assert_eq!(t.to_vec::<f32>().unwrap(), values);
            assert!(t.requires_grad() && t.is_leaf());
        }
        assert_eq!(w.hooks().lock().grad_ready.len(), 1);
        let grad = w.grad().unwrap();
        assert!(grad.layout().is_channels_last());
        assert_eq!(grad.to_vec::<f32>().unwrap(), values);
        // Storage order is NHWC now.
        assert_eq!(
            &w.read_dense_slice::<f32>().unwrap()[..4],
            &[0.0, 4.0, 1.0, 5.0]
        );

        // Again: nothing to do. Back: row-major storage again, same values.
        w.to_memory_format_(MemoryFormat::ChannelsLast).unwrap();
        w.to_memory_format_(MemoryFormat::Contiguous).unwrap();
        assert!(handle.is_contiguous());
        assert_eq!(&handle.read_slice::<f32>().unwrap()[..], values.as_slice());
        assert!(w.grad().unwrap().is_contiguous());
    }

    #[test]
    fn relayout_refuses_what_it_cannot_change_alone() {
        let rank3 = iota(&[2, 3, 4]);
        let err = rank3
            .to_memory_format_(MemoryFormat::ChannelsLast)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("to_memory_format_") && err.contains("[2, 3, 4]"),
            "{err}"
        );
        // Row-major is every rank's format: nothing to do.
        rank3.to_memory_format_(MemoryFormat::Contiguous).unwrap();

        let x = iota(&[2, 3, 2, 2]);
        let view = x.detach();
        let err = x
            .to_memory_format_(MemoryFormat::ChannelsLast)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shares its storage") && err.contains("[2, 3, 2, 2]"),
            "{err}"
        );
        assert!(x.is_contiguous(), "a refused re-layout changes nothing");
        drop(view);

        let part = iota(&[4, 3, 2, 2]);
        let first = part
            .view_detached(part.layout().narrow("n", 0, 1, 2).unwrap())
            .unwrap();
        drop(part);
        let err = first
            .to_memory_format_(MemoryFormat::ChannelsLast)
            .unwrap_err()
            .to_string();
        assert!(err.contains("view of part"), "{err}");
    }

    #[test]
    fn relayout_refuses_a_non_leaf() {
        struct Nothing;
        impl crate::BackwardOp for Nothing {
            fn name(&self) -> &'static str {
                "nothing"
            }
            fn backward(&self, _: &Tensor) -> Result<Vec<Option<Tensor>>> {
                Ok(vec![])
            }
        }
        let y = iota(&[1, 2, 2, 2]).with_grad_fn(crate::Node::new(Box::new(Nothing), vec![]));
        let err = y
            .to_memory_format_(MemoryFormat::ChannelsLast)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`nothing`") && err.contains("leaf"), "{err}");
    }

    #[test]
    fn a_gradient_viewing_a_shared_buffer_keeps_its_layout() {
        let w = iota(&[2, 2, 1, 2]).with_requires_grad().unwrap();
        let bucket = Tensor::zeros(&[16], DType::F32, Device::Cpu).unwrap();
        let slot = bucket
            .view_detached(Layout::contiguous(&[2, 2, 1, 2]))
            .unwrap();
        w.set_grad(Some(slot.clone())).unwrap();
        w.to_memory_format_(MemoryFormat::ChannelsLast).unwrap();
        assert!(w.layout().is_channels_last());
        assert!(w.grad().unwrap().same_tensor(&slot));
        assert!(slot.is_contiguous());
    }
}
