//! The sizes of one convolution, worked out once from the shapes of its input and weight and
//! its parameters: what every kernel (and every device) of conv2d reads, and the key under which
//! the CUDA path caches its cuDNN descriptors and algorithms; with the parameters it is built
//! from ([`Conv2dParams`]) and which gradients a backward produces (`Needs`), the device-neutral
//! types both devices take.

use tandem_core::{checked_numel, Error, Result};

/// Sizes of one convolution. Built by [`Geometry::of`] (or `Geometry::new` inside the crate),
/// which checks that they are consistent (the dilated kernel fits the padded input, strides and
/// dilations are positive) and that no size overflows, so kernels can compute with them freely.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Samples `N`.
    pub batch: usize,
    /// Input channels `C`.
    pub in_channels: usize,
    /// Input height `H`.
    pub in_h: usize,
    /// Input width `W`.
    pub in_w: usize,
    /// Output channels `O`.
    pub out_channels: usize,
    /// Kernel `(kh, kw)`.
    pub kernel: (usize, usize),
    /// Stride `(sh, sw)`.
    pub stride: (usize, usize),
    /// Zero padding `(ph, pw)` on each side.
    pub padding: (usize, usize),
    /// Dilation `(dh, dw)`.
    pub dilation: (usize, usize),
    /// Output height `OH`.
    pub out_h: usize,
    /// Output width `OW`.
    pub out_w: usize,
}

impl Geometry {
    /// The geometry of input shape `x` (`[N, C, H, W]`) and weight shape `w` (`[O, C, kh, kw]`)
    /// under `p`, checking the ranks and the channel count as well; errors name `op` and the
    /// shapes.
    pub fn of(op: &'static str, x: &[usize], w: &[usize], p: &Conv2dParams) -> Result<Self> {
        if x.len() != 4 || w.len() != 4 {
            return Err(Error::shape(
                op,
                format!(
                    "need input [N, C, H, W] and weight [O, C, kh, kw], got input {x:?} and \
                     weight {w:?}"
                ),
            ));
        }
        if x[1] != w[1] {
            return Err(Error::shape(
                op,
                format!(
                    "input {x:?} has {} channels but weight {w:?} expects {}",
                    x[1], w[1]
                ),
            ));
        }
        Geometry::new(op, x, w, p)
    }

    /// The geometry of input `[N, C, H, W]` (`x`) and weight `[O, C, kh, kw]` (`w`) under `p`;
    /// errors name `op` and the shapes. The caller has checked the ranks and the channel count.
    pub(crate) fn new(
        op: &'static str,
        x: &[usize],
        w: &[usize],
        p: &Conv2dParams,
    ) -> Result<Self> {
        if p.stride.0 == 0 || p.stride.1 == 0 || p.dilation.0 == 0 || p.dilation.1 == 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "stride {:?} and dilation {:?} must be at least 1",
                    p.stride, p.dilation
                ),
            ));
        }
        if w[2] == 0 || w[3] == 0 {
            return Err(Error::shape(
                op,
                format!("weight {w:?} has an empty kernel"),
            ));
        }
        let too_large = || {
            Error::shape(
                op,
                format!(
                    "input {x:?} with weight {w:?}, padding {:?} and dilation {:?} has sizes \
                     that overflow",
                    p.padding, p.dilation
                ),
            )
        };
        let span = |k: usize, d: usize| (k - 1).checked_mul(d).and_then(|s| s.checked_add(1));
        let padded = |len: usize, pad: usize| pad.checked_mul(2).and_then(|p| p.checked_add(len));
        let (Some(span_h), Some(span_w), Some(padded_h), Some(padded_w)) = (
            span(w[2], p.dilation.0),
            span(w[3], p.dilation.1),
            padded(x[2], p.padding.0),
            padded(x[3], p.padding.1),
        ) else {
            return Err(too_large());
        };
        if span_h > padded_h || span_w > padded_w {
            return Err(Error::shape(
                op,
                format!(
                    "kernel of weight {w:?} (spanning {span_h}×{span_w} with dilation {:?}) is \
                     larger than input {x:?} padded by {:?} ({padded_h}×{padded_w})",
                    p.dilation, p.padding
                ),
            ));
        }
        let g = Geometry {
            batch: x[0],
            in_channels: x[1],
            in_h: x[2],
            in_w: x[3],
            out_channels: w[0],
            kernel: (w[2], w[3]),
            stride: p.stride,
            padding: p.padding,
            dilation: p.dilation,
            out_h: (padded_h - span_h) / p.stride.0 + 1,
            out_w: (padded_w - span_w) / p.stride.1 + 1,
        };
        // The output, and the padded sample and column row the kernels build, must be sizes
        // that can exist.
        checked_numel(op, &g.out_shape())?;
        checked_numel(op, &[g.in_channels, padded_h, padded_w])?;
        checked_numel(op, &[g.in_channels, g.kernel.0, g.kernel.1, g.out_channels])?;
        Ok(g)
    }

    /// The output shape `[N, O, OH, OW]`.
    pub fn out_shape(&self) -> [usize; 4] {
        [self.batch, self.out_channels, self.out_h, self.out_w]
    }

    /// Rows of the column matrix: `C·kh·kw`.
    pub fn patch(&self) -> usize {
        self.in_channels * self.kernel.0 * self.kernel.1
    }

    /// Output pixels of one sample and channel.
    pub fn out_pixels(&self) -> usize {
        self.out_h * self.out_w
    }

    /// Input elements of one sample.
    pub fn in_per_sample(&self) -> usize {
        self.in_channels * self.in_h * self.in_w
    }

    /// Output elements of one sample.
    pub fn out_per_sample(&self) -> usize {
        self.out_channels * self.out_pixels()
    }

    /// The geometry of the input gradient as a convolution, where that is cheap: for unit
    /// strides, `grad_x = conv(g, W')` with `W'[c, o, a, b] = W[o, c, kh−1−a, kw−1−b]` (the
    /// flipped, transposed weights), the same dilation and padding `dilation·(k − 1) − padding`
    /// (which gives back the input size). None when a stride is not 1, the padding is larger
    /// than the dilated kernel (the new padding would be negative), there are fewer than 8
    /// input channels (the transposed product would be too narrow to be efficient), or the
    /// convolution would do much more work than the product it replaces (its output is the
    /// input, larger than the output by the kernel's overhang where the padding is small).
    pub(crate) fn transposed(&self) -> Option<Geometry> {
        let small_overhang =
            4u128 * (self.in_h * self.in_w) as u128 <= 5 * self.out_pixels() as u128;
        if self.in_channels < 8 || !small_overhang {
            return None;
        }
        self.input_gradient_as_forward()
    }

    /// The geometry of the input gradient as a forward convolution of the output gradient
    /// (unit strides; padding `span − p`), whenever the padding allows one — without
    /// [`Geometry::transposed`]'s tests of whether it pays for the f32 kernels.
    pub(crate) fn input_gradient_as_forward(&self) -> Option<Geometry> {
        let span = |k: usize, d: usize| (k - 1) * d;
        let (sh, sw) = (
            span(self.kernel.0, self.dilation.0),
            span(self.kernel.1, self.dilation.1),
        );
        if self.stride != (1, 1) || self.padding.0 > sh || self.padding.1 > sw {
            return None;
        }
        Some(Geometry {
            batch: self.batch,
            in_channels: self.out_channels,
            in_h: self.out_h,
            in_w: self.out_w,
            out_channels: self.in_channels,
            kernel: self.kernel,
            stride: (1, 1),
            padding: (sh - self.padding.0, sw - self.padding.1),
            dilation: self.dilation,
            out_h: self.in_h,
            out_w: self.in_w,
        })
    }
}

/// Stride, padding and dilation of a 2-D convolution, each as `(height, width)`.
///
/// Defaults: stride `(1, 1)`, padding `(0, 0)`, dilation `(1, 1)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Step between neighbouring output positions, in input pixels (at least 1).
    pub stride: (usize, usize),
    /// Zeros added on each side of the input.
    pub padding: (usize, usize),
    /// Spacing between kernel taps (1 = a dense kernel).
    pub dilation: (usize, usize),
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
        }
    }
}

/// Which gradients the backward must produce.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Needs {
    /// The input's.
    pub input: bool,
    /// The weight's.
    pub weight: bool,
    /// The bias's.
    pub bias: bool,
}
