//! cuDNN descriptors, owned: each wraps one descriptor, created and set in one call, destroyed
//! when dropped. A [`Plan`] holds those of one plan key, created once and cached with the
//! algorithm chosen for each pass.

use std::ffi::c_int;

use cudarc::cudnn::result::{self as cudnn, CudnnResult};
use cudarc::cudnn::sys;
use tandem_core::DType;

use super::choice::Choice;
use crate::conv2d::cuda::Format;
use crate::conv2d::Geometry;

/// cuDNN's name for the data type of tensors of `dtype` (f32, f64, f16, bf16; conv2d's entry
/// checks refuse the others).
pub(super) fn data_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F64 => sys::cudnnDataType_t::CUDNN_DATA_DOUBLE,
        DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        _ => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    }
}

/// The compute type of a convolution over `dtype` data: double for f64, float otherwise (f16
/// and bf16 accumulate in f32, cuDNN's "pseudo-half" configuration).
pub(super) fn compute_type(dtype: DType) -> sys::cudnnDataType_t {
    match dtype {
        DType::F64 => sys::cudnnDataType_t::CUDNN_DATA_DOUBLE,
        _ => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    }
}

/// cuDNN's memory format of a [`Format`].
fn tensor_format(format: Format) -> sys::cudnnTensorFormat_t {
    match format {
        Format::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        Format::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    }
}

/// `v` as a C int; the caller has checked that the geometry fits cuDNN ([`fits`]).
fn int(v: usize) -> c_int {
    v as c_int
}

/// Whether cuDNN's legacy API can take `g`: every size a C int, and no tensor with more than
/// `i32::MAX` elements (cuDNN indexes them with 32 bits). Larger geometries go to im2col.
pub(super) fn fits(g: &Geometry) -> bool {
    let small = |v: usize| v <= i32::MAX as usize;
    let numel = |dims: [usize; 4]| {
        dims.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .is_some_and(small)
    };
    numel([g.batch, g.in_channels, g.in_h, g.in_w])
        && numel(g.out_shape())
        && numel([g.out_channels, g.in_channels, g.kernel.0, g.kernel.1])
        && [
            g.padding.0,
            g.padding.1,
            g.stride.0,
            g.stride.1,
            g.dilation.0,
            g.dilation.1,
        ]
        .into_iter()
        .all(small)
}

/// A 4-d tensor descriptor.
pub(super) struct TensorDesc(pub sys::cudnnTensorDescriptor_t);

impl TensorDesc {
    /// A dense descriptor of `dims` (`[N, C, H, W]`) in memory order `format` (NCHW, or NHWC:
    /// channels last).
    pub fn new(dims: [usize; 4], dtype: DType, format: Format) -> CudnnResult<Self> {
        let desc = TensorDesc(cudnn::create_tensor_descriptor()?);
        // SAFETY: `desc.0` was just created and is destroyed only by its drop.
        unsafe {
            cudnn::set_tensor4d_descriptor(
                desc.0,
                tensor_format(format),
                data_type(dtype),
                dims.map(int),
            )
        }?;
        Ok(desc)
    }
}

impl Drop for TensorDesc {
    fn drop(&mut self) {
        // SAFETY: created by `new` and destroyed only here. A failure leaks a few bytes.
        let _ = unsafe { cudnn::destroy_tensor_descriptor(self.0) };
    }
}

/// A filter descriptor of weights `[O, C, kh, kw]`.
pub(super) struct FilterDesc(pub sys::cudnnFilterDescriptor_t);

impl FilterDesc {
    /// The descriptor of dense weights `dims` in memory order `format` (NHWC: `[O, kh, kw, C]`
    /// in memory, as cuDNN wants with NHWC tensors).
    pub fn new(dims: [usize; 4], dtype: DType, format: Format) -> CudnnResult<Self> {
        let desc = FilterDesc(cudnn::create_filter_descriptor()?);
        // SAFETY: `desc.0` was just created and is destroyed only by its drop.
        unsafe {
            cudnn::set_filter4d_descriptor(
                desc.0,
                data_type(dtype),
                tensor_format(format),
                dims.map(int),
            )
        }?;
        Ok(desc)
    }
}

impl Drop for FilterDesc {
    fn drop(&mut self) {
        // SAFETY: created by `new` and destroyed only here.
        let _ = unsafe { cudnn::destroy_filter_descriptor(self.0) };
    }
}

/// A convolution descriptor: padding, stride, dilation, cross-correlation (what tandem's conv2d
/// computes), the compute type and a math type.
pub(super) struct ConvDesc(pub sys::cudnnConvolutionDescriptor_t);

impl ConvDesc {
    /// The descriptor of `g` over `dtype` data (computing in [`compute_type`]), with math type
    /// `math`.
    pub fn new(g: &Geometry, dtype: DType, math: sys::cudnnMathType_t) -> CudnnResult<Self> {
        let desc = ConvDesc(cudnn::create_convolution_descriptor()?);
        // SAFETY: `desc.0` was just created and is destroyed only by its drop.
        unsafe {
            cudnn::set_convolution2d_descriptor(
                desc.0,
                int(g.padding.0),
                int(g.padding.1),
                int(g.stride.0),
                int(g.stride.1),
                int(g.dilation.0),
                int(g.dilation.1),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute_type(dtype),
            )
        }?;
        desc.set_math(math)?;
        Ok(desc)
    }

    /// Sets the math type (which kernels cuDNN may run: FMA only, or tensor cores too).
    pub fn set_math(&self, math: sys::cudnnMathType_t) -> CudnnResult<()> {
        // SAFETY: a live descriptor owned by `self`.
        unsafe { cudnn::set_convolution_math_type(self.0, math) }
    }
}

impl Drop for ConvDesc {
    fn drop(&mut self) {
        // SAFETY: created by `new` and destroyed only here.
        let _ = unsafe { cudnn::destroy_convolution_descriptor(self.0) };
    }
}

/// A cuDNN algorithm chosen for one pass of one plan: the algorithm with its own convolution
/// descriptor (whose math type is the one the algorithm was chosen with) and workspace size.
pub(super) struct Algorithm<A> {
    pub conv: ConvDesc,
    pub algo: A,
    pub workspace: usize,
}

impl<A: std::fmt::Debug> std::fmt::Debug for Algorithm<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ({} bytes of workspace)", self.algo, self.workspace)
    }
}

/// What runs one pass of a plan, once chosen.
pub(super) type PassChoice<A> = Option<Choice<Algorithm<A>>>;

/// The descriptors of one geometry, dtype and memory format.
pub(super) struct Descriptors {
    /// The input `[N, C, H, W]` (and its gradient).
    pub x: TensorDesc,
    /// The output `[N, O, OH, OW]` (and its gradient).
    pub y: TensorDesc,
    /// The weights `[O, C, kh, kw]` (and their gradient).
    pub w: FilterDesc,
}

/// The descriptors of one plan key, and the choice made for each pass (on first use of that
/// pass, remade when cuDNN refuses it: see `choice.rs`).
pub(super) struct Plan {
    pub descriptors: Descriptors,
    pub forward: PassChoice<sys::cudnnConvolutionFwdAlgo_t>,
    pub data: PassChoice<sys::cudnnConvolutionBwdDataAlgo_t>,
    pub filter: PassChoice<sys::cudnnConvolutionBwdFilterAlgo_t>,
}

impl Plan {
    /// The descriptors of `g` in `dtype` and `format` (which [`fits`] cuDNN), no pass chosen
    /// yet.
    pub fn new(g: &Geometry, dtype: DType, format: Format) -> CudnnResult<Self> {
        Ok(Plan {
            descriptors: Descriptors {
                x: TensorDesc::new([g.batch, g.in_channels, g.in_h, g.in_w], dtype, format)?,
                y: TensorDesc::new(g.out_shape(), dtype, format)?,
                w: FilterDesc::new(
                    [g.out_channels, g.in_channels, g.kernel.0, g.kernel.1],
                    dtype,
                    format,
                )?,
            },
            forward: None,
            data: None,
            filter: None,
        })
    }
}
