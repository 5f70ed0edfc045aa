//! Launch plans shared by the CUDA code of the elementwise ops (binary, unary, dropout): the
//! checks every such launch needs, the choice between a kernel's dense and strided forms, and
//! running a plan into a fresh output.
//!
//! An elementwise kernel `<name>` comes in two forms per dtype (see `tandem_map_dense` and
//! friends in `tandem.cuh`): `<name>_<dtype>(out, x0, x1, …, n, scalars…)` when every input is
//! dense, taking the address of each input's first element and moving 16-byte packs, and
//! `<name>_strided_<dtype>(out, x0, layout0, x1, layout1, …, n, scalars…)` otherwise. The output
//! is always dense: row-major, or channels-last seen through an NHWC permutation of every view
//! (see [`run_into_new`]). Builders check what the kernels rely on: float dtype, matching shapes and
//! dtypes, a dense destination, and inputs that do not overlap it other than as the very same
//! view (each element is read and written by one thread).

use smallvec::SmallVec;
use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use tandem_core::cuda::runtime_kernels::{overlaps_other_than_same_view, DeviceView};
use tandem_core::cuda::{device_pointer, launch_on_compute};
use tandem_core::{DType, Device, Error, Layout, MemoryFormat, Result, Tensor};

/// Threads per block of the elementwise kernels.
pub(crate) const THREADS_PER_BLOCK: u32 = 256;

/// Bytes one thread moves per access in the dense kernels (a 128-bit pack).
const PACK_BYTES: usize = 16;

/// Checks the dtype (f32 or f64), that every input has the destination's shape and dtype, that
/// the destination is dense, and that no input overlaps it other than as the same view.
fn check(op: &'static str, out: &DeviceView, inputs: &[DeviceView]) -> Result<()> {
    if !matches!(out.dtype, DType::F32 | DType::F64) {
        return Err(Error::UnsupportedDType {
            op,
            dtype: out.dtype,
            supported: "f32, f64",
        });
    }
    if !StridedLayout::new(op, out.layout)?.is_contiguous() {
        return Err(Error::invalid(
            op,
            format!(
                "the output must be dense; got shape {:?} with strides {:?}",
                out.layout.shape().as_slice(),
                out.layout.strides().as_slice()
            ),
        ));
    }
    for (i, x) in inputs.iter().enumerate() {
        if x.dtype != out.dtype {
            return Err(Error::DTypeMismatch {
                op,
                lhs: out.dtype,
                rhs: x.dtype,
            });
        }
        if x.layout.shape() != out.layout.shape() {
            return Err(Error::shape(
                op,
                format!(
                    "input {i} has shape {:?}, the output {:?}",
                    x.layout.shape().as_slice(),
                    out.layout.shape().as_slice()
                ),
            ));
        }
        if overlaps_other_than_same_view(out, x)? {
            return Err(Error::invalid(
                op,
                format!(
                    "input {i} ({:?} at {:#x}) overlaps the output ({:?} at {:#x})",
                    x.layout, x.ptr, out.layout, out.ptr
                ),
            ));
        }
    }
    Ok(())
}

/// The launch of kernel `name` from `source` writing `out` from `inputs` (all of `out`'s shape
/// and dtype), followed by `scalars`: the dense form when every input is dense, the strided
/// form otherwise (see the module documentation).
pub(crate) fn elementwise_launch(
    op: &'static str,
    source: &'static KernelSource,
    name: &str,
    out: DeviceView,
    inputs: &[DeviceView],
    scalars: &[KernelArg],
) -> Result<Launch> {
    check(op, &out, inputs)?;
    let n = out.layout.numel();
    let layouts: SmallVec<[StridedLayout; 2]> = inputs
        .iter()
        .map(|x| StridedLayout::new(op, x.layout))
        .collect::<Result<_>>()?;
    let dense = layouts.iter().all(StridedLayout::is_contiguous);
    let mut args = Vec::with_capacity(2 + 2 * inputs.len() + scalars.len());
    args.push(KernelArg::Out(out.first_element(op)?));
    let (kernel, config) = if dense {
        for x in inputs {
            args.push(KernelArg::In(x.first_element(op)?));
        }
        let width = PACK_BYTES / out.dtype.size_in_bytes();
        (
            format!("{name}_{}", out.dtype),
            LaunchConfig::for_elements(op, n.div_ceil(width), THREADS_PER_BLOCK)?,
        )
    } else {
        for (x, layout) in inputs.iter().zip(&layouts) {
            args.push(KernelArg::In(x.ptr));
            args.push(KernelArg::pod(layout));
        }
        (
            format!("{name}_strided_{}", out.dtype),
            LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        )
    };
    args.push(KernelArg::U64(n as u64));
    args.extend_from_slice(scalars);
    Ok(Launch {
        source,
        kernel,
        config,
        args,
    })
}

/// The dims of a 4-D tensor in the storage order of channels-last (N, H, W, C): permuting a
/// layout by these makes a dense channels-last one row-major.
const CHANNELS_LAST_ORDER: [usize; 4] = [0, 2, 3, 1];

/// A fresh tensor of `shape` and `dtype` on `device`, dense in `format`, written by the launch
/// `build` makes from its view and the views of `inputs` (each a CUDA tensor on `device` read
/// through the given layout, of `shape`), run on the device's compute stream.
///
/// For channels-last, every view is permuted to NHWC order first: the output's view is then
/// row-major, so the kernels write it in storage order, and inputs dense in channels-last are
/// row-major too and take the kernels' dense form (other inputs are read through their
/// permuted strides).
pub(crate) fn run_into_new(
    op: &'static str,
    shape: &[usize],
    dtype: DType,
    device: Device,
    format: MemoryFormat,
    inputs: &[(&Tensor, &Layout)],
    build: impl FnOnce(DeviceView, &[DeviceView]) -> Result<Launch>,
) -> Result<Tensor> {
    let out = Tensor::empty_in(shape, dtype, device, format)?;
    let (dev, out_ptr) = device_pointer(op, &out)?;
    let storage_order = |l: &Layout| -> Result<Layout> {
        match format {
            MemoryFormat::Contiguous => Ok(l.clone()),
            MemoryFormat::ChannelsLast => l.permute(op, &CHANNELS_LAST_ORDER),
        }
    };
    let mut layouts: SmallVec<[Layout; 2]> = SmallVec::new();
    let mut ptrs: SmallVec<[u64; 2]> = SmallVec::new();
    for (t, layout) in inputs {
        t.device().same_as(device, op)?;
        let (_, ptr) = device_pointer(op, t)?;
        ptrs.push(ptr);
        layouts.push(storage_order(layout)?);
    }
    let views: SmallVec<[DeviceView; 2]> = inputs
        .iter()
        .zip(&ptrs)
        .zip(&layouts)
        .map(|(((t, _), &ptr), layout)| DeviceView {
            ptr,
            dtype: t.dtype(),
            layout,
        })
        .collect();
    let out_layout = storage_order(out.layout())?;
    let view = DeviceView {
        ptr: out_ptr,
        dtype,
        layout: &out_layout,
    };
    let launch = build(view, &views)?;
    launch_on_compute(&dev, &launch, out.numel())?;
    Ok(out)
}
