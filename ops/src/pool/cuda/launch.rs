//! Launch plans for the pooling kernels (`pool.cu`): a [`PoolGeometry`] describing the windows,
//! and one pure builder per kernel from device addresses and layouts to a [`Launch`], which the
//! CUDA path runs on a device and the host harness (`cuda-harness/tests/pool.rs`) on the CPU.
//!
//! The builders check everything the kernels rely on: f32/f64 with matching dtypes, dense
//! layouts whose sizes match the geometry, non-null and non-overlapping buffers, a geometry
//! whose window arithmetic cannot overflow 64 bits, and planes small enough for the 32-bit
//! indices of the max pool's saved maxima. A geometry made [`PoolGeometry::channels_last`]
//! takes channels-last data: the builders' `[planes, H, W]` arrays are then `[N, H, W, C]`
//! (views in NHWC order, dense).

use tandem_core::cuda::launch::{
    index_u32, KernelArg, KernelPod, KernelSource, Launch, LaunchConfig,
};
use tandem_core::cuda::runtime_kernels::{byte_ranges_overlap, DeviceView};
use tandem_core::{DType, Error, Result};

use crate::pool::shape::PoolWindows;

/// `pool.cu`, embedded.
pub static POOL_SOURCE: KernelSource = KernelSource {
    name: "pool",
    source: include_str!("../pool.cu"),
    headers: &[],
};

/// Threads per block of the pooling kernels (one element per thread).
pub const THREADS_PER_BLOCK: u32 = 256;

/// The geometry of a 2-D pool as the kernels take it (`pool_geometry` in `pool.cu`): `planes`
/// planes of `in_h × in_w` pixels of `channels` interleaved values each (1 for row-major NCHW
/// planes; C for channels-last samples, see [`PoolGeometry::channels_last`]) pooled to
/// `out_h × out_w`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    planes: u64,
    in_h: u64,
    in_w: u64,
    out_h: u64,
    out_w: u64,
    kernel_h: u64,
    kernel_w: u64,
    stride_h: u64,
    stride_w: u64,
    pad_h: u64,
    pad_w: u64,
    divisor: u64,
    adaptive: u64,
    channels: u64,
}

// SAFETY: repr(C), fourteen u64 fields and no padding; matches `pool_geometry` in pool.cu.
unsafe impl KernelPod for PoolGeometry {}

/// The output size of sliding windows along one dim: `(len + 2·pad − kernel) / stride + 1`,
/// or `None` when the padded input is smaller than the kernel or a size overflows.
fn sliding_len(len: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = len.checked_add(pad.checked_mul(2)?)?;
    Some(padded.checked_sub(kernel)? / stride + 1)
}

impl PoolGeometry {
    /// The geometry of a pool of `planes` planes of `input` = `(H, W)` into `output` =
    /// `(OH, OW)` over `windows`; `divisor` is what a sliding average divides by (`None` for
    /// max pooling; adaptive windows divide by their own size). Errors, naming `op`, when the
    /// sizes do not describe such a pool or its window arithmetic could overflow.
    pub fn new(
        op: &'static str,
        planes: usize,
        input: (usize, usize),
        output: (usize, usize),
        windows: PoolWindows,
        divisor: Option<usize>,
    ) -> Result<Self> {
        let bad = |why: String| {
            Err(Error::invalid(
                op,
                format!("pool geometry {input:?} → {output:?} over {windows:?}: {why}"),
            ))
        };
        if input.0 == 0 || input.1 == 0 {
            return bad("the input planes are empty".into());
        }
        let (kernel, stride, padding, adaptive) = match windows {
            PoolWindows::Sliding {
                kernel,
                stride,
                padding,
            } => {
                if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
                    return bad("kernel and stride must be at least 1".into());
                }
                if padding.0 > kernel.0 / 2 || padding.1 > kernel.1 / 2 {
                    return bad("padding must be at most half the kernel".into());
                }
                let want = (
                    sliding_len(input.0, kernel.0, stride.0, padding.0),
                    sliding_len(input.1, kernel.1, stride.1, padding.1),
                );
                if want != (Some(output.0), Some(output.1)) {
                    return bad(format!("the windows give {want:?}, not {output:?}"));
                }
                (kernel, stride, padding, 0)
            }
            PoolWindows::Adaptive => {
                if output.0 == 0 || output.1 == 0 {
                    return bad("the output must not be empty".into());
                }
                // The kernels compute (x + 1)·out + in − 1 and (o + 1)·in + out − 1.
                let fits = |a: usize, b: usize| {
                    (a as u64 + 1)
                        .checked_mul(b as u64 + 1)
                        .is_some_and(|p| p <= u64::MAX / 2)
                };
                if !fits(input.0, output.0) || !fits(input.1, output.1) {
                    return bad("sizes too large for the window arithmetic".into());
                }
                ((1, 1), (1, 1), (0, 0), 1)
            }
        };
        let divisor = match (adaptive, divisor) {
            (0, Some(d)) if d > 0 => d,
            (0, Some(_)) => return bad("the divisor must be positive".into()),
            _ => 0,
        };
        Ok(PoolGeometry {
            planes: planes as u64,
            in_h: input.0 as u64,
            in_w: input.1 as u64,
            out_h: output.0 as u64,
            out_w: output.1 as u64,
            kernel_h: kernel.0 as u64,
            kernel_w: kernel.1 as u64,
            stride_h: stride.0 as u64,
            stride_w: stride.1 as u64,
            pad_h: padding.0 as u64,
            pad_w: padding.1 as u64,
            divisor: divisor as u64,
            adaptive,
            channels: 1,
        })
    }

    /// The same pool over channels-last data: the `planes` planes of [`PoolGeometry::new`] are
    /// `planes / channels` samples of `H × W` pixels with `channels` values each, the channel
    /// innermost (dense `[N, H, W, C]` in, dense `[N, OH, OW, C]` out). Errors, naming `op`,
    /// when `channels` is 0 or does not divide the planes.
    pub fn channels_last(mut self, op: &'static str, channels: usize) -> Result<Self> {
        let c = channels as u64;
        if c == 0 || self.channels != 1 || !self.planes.is_multiple_of(c) {
            return Err(Error::invalid(
                op,
                format!(
                    "{} planes of {}x{} are not whole samples of {channels} channels",
                    self.planes * self.channels,
                    self.in_h,
                    self.in_w
                ),
            ));
        }
        self.planes /= c;
        self.channels = c;
        Ok(self)
    }

    /// Elements of the input (`planes · H · W · channels`), or an error naming `op` when it
    /// overflows.
    pub fn input_len(&self, op: &'static str) -> Result<usize> {
        product(
            op,
            "input",
            &[self.planes, self.in_h, self.in_w, self.channels],
        )
    }

    /// Elements of the output (`planes · OH · OW · channels`), or an error naming `op` when it
    /// overflows.
    pub fn output_len(&self, op: &'static str) -> Result<usize> {
        product(
            op,
            "output",
            &[self.planes, self.out_h, self.out_w, self.channels],
        )
    }

    /// Elements of one input plane (`H · W`).
    fn plane_len(&self, op: &'static str) -> Result<usize> {
        product(op, "plane", &[self.in_h, self.in_w])
    }

    fn is_adaptive(&self) -> bool {
        self.adaptive != 0
    }
}

fn product(op: &'static str, what: &str, sizes: &[u64]) -> Result<usize> {
    sizes
        .iter()
        .try_fold(1u64, |acc, &s| acc.checked_mul(s))
        .and_then(|p| usize::try_from(p).ok())
        .ok_or_else(|| Error::invalid(op, format!("the pool's {what} size {sizes:?} overflows")))
}

/// The dense byte range of `view` (contiguous, `len` elements of `dtype`), or an error naming
/// `what` when it is not dense, has another length or dtype, or is null while non-empty.
fn dense(
    op: &'static str,
    what: &str,
    view: &DeviceView,
    dtype: DType,
    len: usize,
) -> Result<(u64, u64)> {
    if view.dtype != dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dtype,
            rhs: view.dtype,
        });
    }
    if !view.layout.is_contiguous() || view.layout.numel() != len {
        return Err(Error::invalid(
            op,
            format!(
                "{what} must be a dense array of {len} elements, got shape {:?} strides {:?}",
                view.layout.shape().as_slice(),
                view.layout.strides().as_slice()
            ),
        ));
    }
    let size = dtype.size_in_bytes() as u64;
    byte_range(op, what, view.ptr, view.layout.offset(), len, size)
}

/// `[ptr + offset·size, + len·size)`, checked for overflow and a null base.
fn byte_range(
    op: &'static str,
    what: &str,
    ptr: u64,
    offset: usize,
    len: usize,
    size: u64,
) -> Result<(u64, u64)> {
    if len == 0 {
        return Ok((ptr, ptr));
    }
    if ptr == 0 {
        return Err(Error::invalid(op, format!("{what}: null device pointer")));
    }
    let start = (offset as u64)
        .checked_mul(size)
        .and_then(|b| ptr.checked_add(b));
    let end = start.and_then(|s| {
        (len as u64)
            .checked_mul(size)
            .and_then(|b| s.checked_add(b))
    });
    match (start, end) {
        (Some(s), Some(e)) => Ok((s, e)),
        _ => Err(Error::invalid(
            op,
            format!("{what} at {ptr:#x} reaches beyond the 64-bit address space"),
        )),
    }
}

/// Errors unless the byte ranges are pairwise disjoint (empty ranges never overlap).
fn disjoint(op: &'static str, ranges: &[(&str, (u64, u64))]) -> Result<()> {
    for (i, (a, (a0, a1))) in ranges.iter().enumerate() {
        for (b, (b0, b1)) in &ranges[i + 1..] {
            if byte_ranges_overlap((*a0, *a1), (*b0, *b1)) {
                return Err(Error::invalid(
                    op,
                    format!("{a} and {b} overlap in memory ({a0:#x}..{a1:#x}, {b0:#x}..{b1:#x})"),
                ));
            }
        }
    }
    Ok(())
}

fn float_kernel(op: &'static str, name: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 | DType::F64 => Ok(format!("{name}_{dtype}")),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64",
        }),
    }
}

fn launch(op: &'static str, kernel: String, n: usize, args: Vec<KernelArg>) -> Result<Launch> {
    Ok(Launch {
        source: &POOL_SOURCE,
        kernel,
        config: LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        args,
    })
}

/// Max pooling of `x` (dense `[planes, H, W]`) into `out` (dense `[planes, OH, OW]`, same
/// dtype), writing the index within its plane of each maximum to `indices` (`planes·OH·OW`
/// u32 values) unless it is 0. Sliding windows only.
pub fn max_pool2d_launch(
    op: &'static str,
    x: DeviceView,
    out: DeviceView,
    indices: u64,
    geometry: &PoolGeometry,
) -> Result<Launch> {
    if geometry.is_adaptive() {
        return Err(Error::invalid(op, "max pooling takes sliding windows"));
    }
    index_u32(op, "the plane size H·W", geometry.plane_len(op)?)?;
    let kernel = float_kernel(op, "max_pool2d", x.dtype)?;
    let n = geometry.output_len(op)?;
    let xr = dense(op, "input", &x, x.dtype, geometry.input_len(op)?)?;
    let or = dense(op, "output", &out, x.dtype, n)?;
    let mut ranges = vec![("input", xr), ("output", or)];
    if indices != 0 {
        ranges.push(("indices", byte_range(op, "indices", indices, 0, n, 4)?));
    }
    disjoint(op, &ranges)?;
    launch(
        op,
        kernel,
        n,
        vec![
            KernelArg::In(xr.0),
            KernelArg::Out(or.0),
            KernelArg::Out(indices),
            KernelArg::pod(geometry),
        ],
    )
}

/// The backward of [`max_pool2d_launch`]: `grad_x` (dense `[planes, H, W]`) gets, at every
/// element, the sum of the output gradients (`grad_out`, dense `[planes, OH, OW]`) of the
/// windows whose maximum (`indices`, as the forward wrote them) it was.
pub fn max_pool2d_backward_launch(
    op: &'static str,
    grad_out: DeviceView,
    indices: u64,
    grad_x: DeviceView,
    geometry: &PoolGeometry,
) -> Result<Launch> {
    if geometry.is_adaptive() {
        return Err(Error::invalid(op, "max pooling takes sliding windows"));
    }
    index_u32(op, "the plane size H·W", geometry.plane_len(op)?)?;
    let kernel = float_kernel(op, "max_pool2d_backward", grad_out.dtype)?;
    let n_out = geometry.output_len(op)?;
    let n = geometry.input_len(op)?;
    let gr = dense(op, "output gradient", &grad_out, grad_out.dtype, n_out)?;
    let xr = dense(op, "input gradient", &grad_x, grad_out.dtype, n)?;
    let ir = byte_range(op, "indices", indices, 0, n_out, 4)?;
    disjoint(
        op,
        &[
            ("output gradient", gr),
            ("input gradient", xr),
            ("indices", ir),
        ],
    )?;
    launch(
        op,
        kernel,
        n,
        vec![
            KernelArg::In(gr.0),
            KernelArg::In(ir.0),
            KernelArg::Out(xr.0),
            KernelArg::pod(geometry),
        ],
    )
}

/// Average pooling (sliding windows divided by the geometry's divisor, or adaptive windows
/// divided by their size) of `x` (dense `[planes, H, W]`) into `out` (dense `[planes, OH, OW]`).
pub fn avg_pool2d_launch(
    op: &'static str,
    x: DeviceView,
    out: DeviceView,
    geometry: &PoolGeometry,
) -> Result<Launch> {
    check_average(op, geometry)?;
    let kernel = float_kernel(op, "avg_pool2d", x.dtype)?;
    let n = geometry.output_len(op)?;
    let xr = dense(op, "input", &x, x.dtype, geometry.input_len(op)?)?;
    let or = dense(op, "output", &out, x.dtype, n)?;
    disjoint(op, &[("input", xr), ("output", or)])?;
    launch(
        op,
        kernel,
        n,
        vec![
            KernelArg::In(xr.0),
            KernelArg::Out(or.0),
            KernelArg::pod(geometry),
        ],
    )
}

/// The backward of [`avg_pool2d_launch`]: every element of `grad_x` (dense `[planes, H, W]`)
/// gets the sum of `grad_out / divisor` over the windows covering it.
pub fn avg_pool2d_backward_launch(
    op: &'static str,
    grad_out: DeviceView,
    grad_x: DeviceView,
    geometry: &PoolGeometry,
) -> Result<Launch> {
    check_average(op, geometry)?;
    let kernel = float_kernel(op, "avg_pool2d_backward", grad_out.dtype)?;
    let n = geometry.input_len(op)?;
    let gr = dense(
        op,
        "output gradient",
        &grad_out,
        grad_out.dtype,
        geometry.output_len(op)?,
    )?;
    let xr = dense(op, "input gradient", &grad_x, grad_out.dtype, n)?;
    disjoint(op, &[("output gradient", gr), ("input gradient", xr)])?;
    launch(
        op,
        kernel,
        n,
        vec![
            KernelArg::In(gr.0),
            KernelArg::Out(xr.0),
            KernelArg::pod(geometry),
        ],
    )
}

fn check_average(op: &'static str, geometry: &PoolGeometry) -> Result<()> {
    if !geometry.is_adaptive() && geometry.divisor == 0 {
        return Err(Error::invalid(
            op,
            "a sliding average needs a positive divisor",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Layout;

    fn sliding(k: usize, s: usize, p: usize) -> PoolWindows {
        PoolWindows::Sliding {
            kernel: (k, k),
            stride: (s, s),
            padding: (p, p),
        }
    }

    #[test]
    fn geometry_checks_output_sizes_and_arguments() {
        assert!(PoolGeometry::new("t", 2, (7, 7), (4, 4), sliding(3, 2, 1), None).is_ok());
        let err = PoolGeometry::new("t", 2, (7, 7), (3, 3), sliding(3, 2, 1), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Some(4)"), "{err}");
        assert!(PoolGeometry::new("t", 2, (7, 7), (4, 4), sliding(2, 2, 2), None).is_err());
        assert!(PoolGeometry::new("t", 2, (0, 7), (1, 4), sliding(2, 2, 1), None).is_err());
        assert!(PoolGeometry::new("t", 2, (7, 7), (3, 3), sliding(3, 2, 0), Some(0)).is_err());
        assert!(PoolGeometry::new("t", 2, (7, 7), (0, 1), PoolWindows::Adaptive, None).is_err());
        let huge = usize::MAX / 2;
        assert!(PoolGeometry::new("t", 1, (huge, 2), (3, 1), PoolWindows::Adaptive, None).is_err());
    }

    #[test]
    fn builders_refuse_mismatched_views_and_large_planes() {
        let g = PoolGeometry::new("t", 3, (4, 4), (2, 2), sliding(2, 2, 0), None).unwrap();
        let x = Layout::contiguous(&[3, 4, 4]);
        let out = Layout::contiguous(&[3, 2, 2]);
        let view = |ptr: u64, dtype: DType, layout| DeviceView { ptr, dtype, layout };
        let ok = max_pool2d_launch(
            "t",
            view(0x1000, DType::F32, &x),
            view(0x2000, DType::F32, &out),
            0x3000,
            &g,
        )
        .unwrap();
        assert_eq!(ok.kernel, "max_pool2d_f32");
        assert_eq!(ok.config.grid[0], 1);
        // Wrong size, wrong dtype, overlapping buffers, integer dtypes.
        let small = Layout::contiguous(&[3, 2, 1]);
        assert!(max_pool2d_launch(
            "t",
            view(0x1000, DType::F32, &x),
            view(0x2000, DType::F32, &small),
            0,
            &g
        )
        .is_err());
        assert!(avg_pool2d_launch(
            "t",
            view(0x1000, DType::F32, &x),
            view(0x2000, DType::F64, &out),
            &PoolGeometry::new("t", 3, (4, 4), (2, 2), sliding(2, 2, 0), Some(4)).unwrap(),
        )
        .is_err());
        let err = max_pool2d_launch(
            "t",
            view(0x1000, DType::F32, &x),
            view(0x1010, DType::F32, &out),
            0,
            &g,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("overlap"), "{err}");
        assert!(max_pool2d_launch(
            "t",
            view(0x1000, DType::I64, &x),
            view(0x2000, DType::I64, &out),
            0,
            &g
        )
        .is_err());
        // A sliding average without a divisor.
        assert!(avg_pool2d_launch(
            "t",
            view(0x1000, DType::F32, &x),
            view(0x2000, DType::F32, &out),
            &g
        )
        .is_err());
        let big = PoolGeometry::new(
            "t",
            1,
            (1 << 16, 1 << 16),
            (1 << 15, 1 << 15),
            sliding(2, 2, 0),
            None,
        )
        .unwrap();
        let err = max_pool2d_launch(
            "t",
            view(
                0x1000,
                DType::F32,
                &Layout::contiguous(&[1, 1 << 16, 1 << 16]),
            ),
            view(
                0x2000,
                DType::F32,
                &Layout::contiguous(&[1, 1 << 15, 1 << 15]),
            ),
            0,
            &big,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("32-bit"), "{err}");
    }
}
