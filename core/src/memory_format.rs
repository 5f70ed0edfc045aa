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
use parking_lot::MappedRwLockReadGuard;

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
        let already = match format {
            MemoryFormat::Contiguous => self.is_contiguous(),
            MemoryFormat::ChannelsLast => self.layout().is_channels_last(),
        };
        if already {
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
    /// a slice in storage order (for channels-last, NHWC order). Errors when the tensor is neither, is not in host memory, or
    /// `T` is not its dtype.
    pub fn read_dense_slice<T: Element>(&self) -> Result<MappedRwLockReadGuard<'_, [T]>> {
        if self.is_contiguous() {
            return self.read_slice::<T>();
        }
        if !self.is_contiguous_in(MemoryFormat::ChannelsLast) {
            return Err(Error::invalid(
                "read_dense_slice",
                format!(
                    "tensor of shape {:?} with strides {:?} is dense in no memory format",
                    self.dims(),
                    self.layout().strides()
                ),
            ));
        }
        if self.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op: "read_dense_slice",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        let (start, end) = (
            self.layout().offset(),
            self.layout().offset() + self.numel(),
        );
        let guard = self.storage().read_host("read_dense_slice")?;
        MappedRwLockReadGuard::try_map(guard, |s| T::slice(s).map(|v| &v[start..end])).map_err(
            |_| Error::DTypeMismatch {
                op: "read_dense_slice",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            },
        )
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
}
