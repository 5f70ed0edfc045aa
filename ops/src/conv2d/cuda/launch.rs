//! Launch plans for conv2d's kernels (`conv2d.cu`): im2col and col2im for the im2col + cuBLAS
//! path, and the bias kernels both CUDA paths share.
//!
//! Each builder is a pure function from device addresses (of element 0 of contiguous buffers),
//! a [`Geometry`] and counts to a [`Launch`]; the CUDA path runs it on the compute stream and the
//! host harness (`cuda-harness/tests/conv2d.rs`) runs the very same plan on host memory against
//! the CPU op. The builders check what the kernels rely on: a dtype they exist for, non-null
//! addresses where there is work, and every size the kernels compute with in 32 bits.

use tandem_core::cuda::launch::{
    index_u32, KernelArg, KernelPod, KernelSource, Launch, LaunchConfig,
};
use tandem_core::{DType, Error, Result};

use crate::conv2d::Geometry;

/// `conv2d.cu`, embedded.
pub static CONV2D: KernelSource = KernelSource {
    name: "conv2d",
    source: include_str!("../conv2d.cu"),
    headers: &[],
};

/// Threads per block of every conv2d kernel.
pub const THREADS_PER_BLOCK: u32 = 256;

/// The bias gradient's first pass gives each block a slice of about this many (sample, pixel)
/// entries of one channel: 16 per thread, enough to hide the reduction's cost.
const BIAS_SLICE: usize = 16 * THREADS_PER_BLOCK as usize;

/// At most this many slices per channel, so that the second pass stays short.
const BIAS_MAX_SPLITS: usize = 1024;

/// The sizes of a convolution as `conv2d.cu` reads them (`conv2d_shape`), 32-bit.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    /// Input channels `C`.
    pub channels: u32,
    /// Input height.
    pub in_h: u32,
    /// Input width.
    pub in_w: u32,
    /// Kernel height.
    pub kernel_h: u32,
    /// Kernel width.
    pub kernel_w: u32,
    /// Vertical stride.
    pub stride_h: u32,
    /// Horizontal stride.
    pub stride_w: u32,
    /// Zero rows above and below.
    pub pad_h: u32,
    /// Zero columns left and right.
    pub pad_w: u32,
    /// Vertical dilation.
    pub dilation_h: u32,
    /// Horizontal dilation.
    pub dilation_w: u32,
    /// Output height.
    pub out_h: u32,
    /// Output width.
    pub out_w: u32,
    padding: u32,
}

// SAFETY: repr(C), fourteen u32 fields (the last one explicit padding to a multiple of 8
// bytes), no pointers; matches `conv2d_shape` in conv2d.cu field for field.
unsafe impl KernelPod for ConvShape {}

impl ConvShape {
    /// The 32-bit form of `g`. Errors naming `op` when a size the kernels compute with in 32 bits
    /// does not fit: the padded input height and width, one sample's input (`C·H·W`), its
    /// column threads (`C·OH·OW`), the output pixels and the kernel taps.
    pub fn new(op: &'static str, g: &Geometry) -> Result<Self> {
        let what = |name: &str| format!("{name} of conv2d geometry {g:?}");
        let (ph, pw) = g.padding;
        index_u32(op, &what("padded input height"), g.in_h + 2 * ph)?;
        index_u32(op, &what("padded input width"), g.in_w + 2 * pw)?;
        index_u32(op, &what("input elements per sample"), g.in_per_sample())?;
        let pixels = index_u32(op, &what("output pixels"), g.out_pixels())? as usize;
        index_u32(
            op,
            &what("column threads per sample"),
            g.in_channels * pixels,
        )?;
        index_u32(op, &what("kernel taps"), g.kernel.0 * g.kernel.1)?;
        index_u32(op, &what("output channels"), g.out_channels)?;
        // Everything else is bounded by the sizes above (the kernel spans fit the padded input).
        let u = |v: usize| v as u32;
        Ok(ConvShape {
            channels: u(g.in_channels),
            in_h: u(g.in_h),
            in_w: u(g.in_w),
            kernel_h: u(g.kernel.0),
            kernel_w: u(g.kernel.1),
            stride_h: u(g.stride.0),
            stride_w: u(g.stride.1),
            pad_h: u(ph),
            pad_w: u(pw),
            dilation_h: u(g.dilation.0),
            dilation_w: u(g.dilation.1),
            out_h: u(g.out_h),
            out_w: u(g.out_w),
            padding: 0,
        })
    }
}

/// How the column matrices of several samples are laid out (`K = C·kh·kw` rows, `P = OH·OW`
/// output pixels per sample, `S` samples).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColumnLayout {
    /// One `K×P` matrix per sample, one after the other: entry `(s, k, p)` at `(s·K + k)·P + p`.
    /// What the forward and the input gradient multiply, one product per sample.
    PerSample,
    /// One `K×(S·P)` matrix: entry `(s, k, p)` at `k·S·P + s·P + p`. What the weight gradient
    /// multiplies, one product for all `S` samples.
    Joined,
}

impl ColumnLayout {
    /// `(row_step, sample_step)`: the distance between rows `k` and `k + 1`, and between
    /// samples `s` and `s + 1`, in elements.
    fn steps(self, g: &Geometry, samples: usize) -> (u64, u64) {
        let (k, p) = (g.patch() as u64, g.out_pixels() as u64);
        match self {
            ColumnLayout::PerSample => (p, k * p),
            ColumnLayout::Joined => (samples as u64 * p, p),
        }
    }
}

/// Elements of the column matrices of `samples` samples (either layout).
pub fn column_len(g: &Geometry, samples: usize) -> Option<usize> {
    g.patch()
        .checked_mul(g.out_pixels())
        .and_then(|n| n.checked_mul(samples))
}

/// The name of `kernel`'s instantiation for `dtype`: f32 and f64 for every kernel, f16 and bf16
/// too for the bias kernels (`low`: they compute in f32).
fn kernel_name(op: &'static str, kernel: &str, dtype: DType, low: bool) -> Result<String> {
    match dtype {
        DType::F32 | DType::F64 => Ok(format!("conv2d_{kernel}_{dtype}")),
        DType::F16 | DType::BF16 if low => Ok(format!("conv2d_{kernel}_{dtype}")),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: if low {
                "f32, f64, f16, bf16"
            } else {
                "f32, f64"
            },
        }),
    }
}

/// Whether `dtype` is a 16-bit float (computed in f32 by the bias kernels).
fn is_low(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

fn non_null(op: &'static str, what: &str, address: u64) -> Result<()> {
    if address == 0 {
        return Err(Error::invalid(
            op,
            format!("null device address for the non-empty {what}"),
        ));
    }
    Ok(())
}

fn launch(kernel: String, config: LaunchConfig, args: Vec<KernelArg>) -> Launch {
    Launch {
        source: &CONV2D,
        kernel,
        config,
        args,
    }
}

/// `conv2d_im2col`: the column matrices of `samples` consecutive samples of the contiguous
/// input at `x` (element 0 of the first sample), written to `cols` in `layout` (every entry,
/// zeros for the padding).
pub fn im2col_launch(
    dtype: DType,
    g: &Geometry,
    x: u64,
    cols: u64,
    samples: usize,
    layout: ColumnLayout,
) -> Result<Launch> {
    const OP: &str = "conv2d (im2col)";
    let kernel = kernel_name(OP, "im2col", dtype, false)?;
    let shape = ConvShape::new(OP, g)?;
    let threads = samples
        .checked_mul(g.in_channels * g.out_pixels())
        .ok_or_else(|| Error::invalid(OP, format!("{samples} samples of {g:?} overflow")))?;
    if threads > 0 && g.kernel.0 * g.kernel.1 > 0 {
        if g.in_per_sample() > 0 {
            non_null(OP, "input", x)?;
        }
        non_null(OP, "column buffer", cols)?;
    }
    let (row_step, sample_step) = layout.steps(g, samples);
    Ok(launch(
        kernel,
        LaunchConfig::for_elements(OP, threads, THREADS_PER_BLOCK)?,
        vec![
            KernelArg::In(x),
            KernelArg::Out(cols),
            KernelArg::pod(&shape),
            KernelArg::U64(samples as u64),
            KernelArg::U64(row_step),
            KernelArg::U64(sample_step),
        ],
    ))
}

/// `conv2d_col2im`: the input gradient of `samples` consecutive samples, written to the
/// contiguous `dx` (every element), from their column-matrix gradients at `cols`
/// ([`ColumnLayout::PerSample`]).
pub fn col2im_launch(
    dtype: DType,
    g: &Geometry,
    cols: u64,
    dx: u64,
    samples: usize,
) -> Result<Launch> {
    const OP: &str = "conv2d_backward (col2im)";
    let kernel = kernel_name(OP, "col2im", dtype, false)?;
    let shape = ConvShape::new(OP, g)?;
    let n = samples
        .checked_mul(g.in_per_sample())
        .ok_or_else(|| Error::invalid(OP, format!("{samples} samples of {g:?} overflow")))?;
    if n > 0 {
        non_null(OP, "input gradient", dx)?;
        if g.patch() * g.out_pixels() > 0 {
            non_null(OP, "column buffer", cols)?;
        }
    }
    let (row_step, sample_step) = ColumnLayout::PerSample.steps(g, samples);
    Ok(launch(
        kernel,
        LaunchConfig::for_elements(OP, n, THREADS_PER_BLOCK)?,
        vec![
            KernelArg::In(cols),
            KernelArg::Out(dx),
            KernelArg::pod(&shape),
            KernelArg::U64(samples as u64),
            KernelArg::U64(row_step),
            KernelArg::U64(sample_step),
        ],
    ))
}

/// `conv2d_bias_add`: `out[s, o, p] += bias[o]` over the contiguous `[samples, channels,
/// pixels]` output at `out`.
pub fn bias_add_launch(
    dtype: DType,
    out: u64,
    bias: u64,
    samples: usize,
    channels: usize,
    pixels: usize,
) -> Result<Launch> {
    const OP: &str = "conv2d (bias)";
    let kernel = kernel_name(OP, "bias_add", dtype, true)?;
    let n = samples
        .checked_mul(channels)
        .and_then(|n| n.checked_mul(pixels))
        .ok_or_else(|| Error::invalid(OP, "output size overflows"))?;
    if n > 0 {
        non_null(OP, "output", out)?;
        non_null(OP, "bias", bias)?;
    }
    Ok(launch(
        kernel,
        LaunchConfig::for_elements(OP, n, THREADS_PER_BLOCK)?,
        vec![
            KernelArg::Out(out),
            KernelArg::In(bias),
            KernelArg::U64(n as u64),
            KernelArg::U64(channels.max(1) as u64),
            KernelArg::U64(pixels.max(1) as u64),
        ],
    ))
}

/// How the bias gradient splits each channel's `samples·pixels` entries: `splits` slices of
/// `span` entries (the last one shorter). The first pass needs `channels · splits` partial sums
/// unless `splits` is 1, when it writes the gradient directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BiasGradSplit {
    /// Slices per channel (at least 1).
    pub splits: usize,
    /// Entries per slice (at least 1).
    pub span: usize,
}

impl BiasGradSplit {
    /// The split for `samples` samples of `pixels` output pixels.
    pub fn new(samples: usize, pixels: usize) -> Self {
        let total = samples.saturating_mul(pixels);
        let splits = total.div_ceil(BIAS_SLICE).clamp(1, BIAS_MAX_SPLITS);
        BiasGradSplit {
            splits,
            span: total.div_ceil(splits).max(1),
        }
    }

    /// Elements of the partial-sum buffer the first pass writes for f32 and f64 (0 when it
    /// writes the gradient directly).
    pub fn partials_len(&self, channels: usize) -> usize {
        match self.splits {
            1 => 0,
            s => channels * s,
        }
    }

    /// Whether the first pass writes the gradient of `dtype` directly: one slice per channel,
    /// and a dtype that is its own compute type (the partial sums of f16 and bf16 are f32, so
    /// they always take the second pass, which rounds once).
    pub fn direct(&self, dtype: DType) -> bool {
        self.splits == 1 && !is_low(dtype)
    }

    /// Bytes of the partial-sum buffer for `channels` channels of `dtype` (f32 partial sums for
    /// f16 and bf16; 0 when the first pass writes the gradient directly).
    pub fn partials_bytes(&self, channels: usize, dtype: DType) -> usize {
        if self.direct(dtype) {
            0
        } else if is_low(dtype) {
            channels * self.splits * DType::F32.size_in_bytes()
        } else {
            channels * self.splits * dtype.size_in_bytes()
        }
    }
}

/// The launches of the bias gradient `grad[o] = Σ_{s,p} gy[s, o, p]` of the contiguous output
/// gradient `gy` of shape `[samples, channels, pixels]`, into `grad` (`[channels]`, every element
/// written, zeros when there are no samples or pixels): one launch when `split.splits` is 1,
/// else a first pass into `partials` (`split.partials_len(channels)` elements) and a second
/// into `grad`. For f16 and bf16 the partial sums are f32 and there are always two passes
/// (`partials` then holds [`BiasGradSplit::partials_bytes`]).
pub fn bias_grad_launches(
    dtype: DType,
    gy: u64,
    grad: u64,
    partials: u64,
    [samples, channels, pixels]: [usize; 3],
    split: BiasGradSplit,
) -> Result<Vec<Launch>> {
    const OP: &str = "conv2d_backward (bias)";
    let partial = kernel_name(OP, "bias_grad_partial", dtype, true)?;
    let finish = kernel_name(OP, "bias_grad_finish", dtype, true)?;
    if split.splits == 0 || split.span == 0 {
        return Err(Error::invalid(OP, format!("empty bias split {split:?}")));
    }
    let total = samples
        .checked_mul(pixels)
        .ok_or_else(|| Error::invalid(OP, "output size overflows"))?;
    if split.splits.saturating_mul(split.span) < total {
        return Err(Error::invalid(
            OP,
            format!("bias split {split:?} does not cover {total} entries per channel"),
        ));
    }
    let rows = channels
        .checked_mul(split.splits)
        .ok_or_else(|| Error::invalid(OP, "bias split overflows"))?;
    if channels > 0 {
        non_null(OP, "bias gradient", grad)?;
        if total > 0 {
            non_null(OP, "output gradient", gy)?;
        }
    }
    let direct = split.direct(dtype);
    let first_out = if direct { grad } else { partials };
    if !direct && channels > 0 {
        non_null(OP, "partial sums", partials)?;
    }
    let mut launches = vec![launch(
        partial,
        LaunchConfig::for_rows(OP, rows, THREADS_PER_BLOCK, 0)?,
        vec![
            KernelArg::In(gy),
            KernelArg::Out(first_out),
            KernelArg::U64(samples as u64),
            KernelArg::U64(channels as u64),
            KernelArg::U64(pixels.max(1) as u64),
            KernelArg::U64(split.splits as u64),
            KernelArg::U64(split.span as u64),
        ],
    )];
    if !direct {
        launches.push(launch(
            finish,
            LaunchConfig::for_elements(OP, channels, THREADS_PER_BLOCK)?,
            vec![
                KernelArg::In(partials),
                KernelArg::Out(grad),
                KernelArg::U64(channels as u64),
                KernelArg::U64(split.splits as u64),
            ],
        ));
    }
    Ok(launches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conv2d::Conv2dParams;

    fn geometry(x: [usize; 4], w: [usize; 4], p: Conv2dParams) -> Geometry {
        Geometry::of("test", &x, &w, &p).unwrap()
    }

    #[test]
    fn shape_struct_has_the_layout_of_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<ConvShape>(), 14 * 4);
        let g = geometry([2, 3, 7, 9], [4, 3, 3, 2], Conv2dParams::default());
        let s = ConvShape::new("test", &g).unwrap();
        assert_eq!((s.channels, s.out_h, s.out_w), (3, 5, 8));
    }

    #[test]
    fn column_layouts_step_as_documented() {
        let g = geometry([3, 2, 5, 5], [4, 2, 3, 3], Conv2dParams::default());
        // K = 18, P = 9.
        assert_eq!(ColumnLayout::PerSample.steps(&g, 3), (9, 162));
        assert_eq!(ColumnLayout::Joined.steps(&g, 3), (27, 9));
        assert_eq!(column_len(&g, 3), Some(18 * 9 * 3));
    }

    #[test]
    fn sizes_beyond_32_bits_are_errors_naming_the_size() {
        let g = geometry([1, 1, 1 << 31, 1], [1, 1, 1, 1], Conv2dParams::default());
        let err = ConvShape::new("conv2d", &g).unwrap_err().to_string();
        assert!(err.contains("padded input height"), "{err}");
    }

    #[test]
    fn bias_splits_cover_every_entry() {
        for (samples, pixels) in [(0, 5), (1, 1), (3, 1000), (128, 1024), (5000, 5000)] {
            let s = BiasGradSplit::new(samples, pixels);
            assert!(s.splits >= 1 && s.span >= 1 && s.splits <= BIAS_MAX_SPLITS);
            assert!(s.splits * s.span >= samples * pixels, "{s:?}");
            // No slice is empty except when there is nothing to sum.
            assert!(samples * pixels == 0 || (s.splits - 1) * s.span < samples * pixels);
        }
        assert_eq!(BiasGradSplit::new(2, 10).partials_len(7), 0);
        assert_eq!(BiasGradSplit::new(128, 1024).partials_len(16), 16 * 32);
    }

    #[test]
    fn other_dtypes_and_null_addresses_are_refused() {
        let g = geometry([1, 1, 4, 4], [1, 1, 3, 3], Conv2dParams::default());
        let err = im2col_launch(DType::F16, &g, 8, 8, 1, ColumnLayout::PerSample).unwrap_err();
        assert!(err.to_string().contains("f16"), "{err}");
        let err = col2im_launch(DType::F32, &g, 8, 0, 1).unwrap_err();
        assert!(err.to_string().contains("null"), "{err}");
        // Nothing to do: null is fine.
        assert!(im2col_launch(DType::F32, &g, 0, 0, 0, ColumnLayout::Joined).is_ok());
    }

    #[test]
    fn low_precision_bias_kernels_sum_in_f32_partials_and_always_finish() {
        let add = bias_add_launch(DType::BF16, 8, 16, 2, 3, 4).unwrap();
        assert_eq!(add.kernel, "conv2d_bias_add_bf16");
        // One slice per channel: f32 writes the gradient directly, f16 sums into f32 partials
        // and rounds in the second pass.
        let split = BiasGradSplit::new(2, 10);
        assert!(split.direct(DType::F32) && !split.direct(DType::F16));
        assert_eq!(split.partials_bytes(7, DType::F32), 0);
        assert_eq!(split.partials_bytes(7, DType::F16), 7 * 4);
        let launches = bias_grad_launches(DType::F16, 8, 16, 32, [2, 7, 5], split).unwrap();
        let names: Vec<_> = launches.iter().map(|l| l.kernel.as_str()).collect();
        assert_eq!(
            names,
            [
                "conv2d_bias_grad_partial_f16",
                "conv2d_bias_grad_finish_f16"
            ]
        );
        let wide = BiasGradSplit::new(128, 1024);
        assert_eq!(wide.partials_bytes(16, DType::BF16), 16 * 32 * 4);
        assert_eq!(wide.partials_bytes(16, DType::F64), 16 * 32 * 8);
        let err = im2col_launch(
            DType::BF16,
            &geometry([1, 1, 4, 4], [1, 1, 3, 3], Conv2dParams::default()),
            8,
            8,
            1,
            ColumnLayout::PerSample,
        )
        .unwrap_err();
        assert!(err.to_string().contains("f32, f64"), "{err}");
    }
}
