//! The reference convolution of the emulated cuDNN: direct loops over the descriptors' dims and
//! strides, written for the emulator (not tandem's CPU convolution, no im2col), accumulating in
//! the compute type (f32 for f16, bf16 and f32 data, f64 for f64).
//!
//! One [`Problem`] describes the three tensors of a 2-D convolution as cuDNN's descriptors give
//! them — the input `x` `[N, C, H, W]`, the filter `w` `[K, C/groups, R, S]`, the output `y`
//! `[N, K, P, Q]`, each with element strides — and the convolution's padding, stride, dilation,
//! groups and mode (cross-correlation, or convolution with the filter flipped). The three passes
//! compute, with `alpha` and `beta` as cuDNN applies them (`out = alpha·result + beta·out`, and
//! `out` is not read when `beta` is 0):
//!
//! - [`forward`]: `y[n,k,p,q] = Σ_{c,r,s} x[n, c, p·u + r·dh − ph, q·v + s·dw − pw] · w[k,c,r,s]`
//!   over the input channels `c` of `k`'s group, out-of-range input pixels being zero padding;
//! - [`backward_data`]: `dx`, the adjoint of the forward in `x`;
//! - [`backward_filter`]: `dw`, the adjoint of the forward in `w`.
//!
//! Loops run per output (or input) row over the range of pixels whose taps fall inside the
//! input, computed once per filter tap, so the inner loop has no bounds test; accumulators are
//! one buffer per call, never an allocation per element.

use std::ops::Range;
use std::ops::{Add, AddAssign, Mul};

use half::{bf16, f16};

/// A data type of the emulated convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// IEEE half (`CUDNN_DATA_HALF`), accumulated in f32.
    F16,
    /// bfloat16 (`CUDNN_DATA_BFLOAT16`), accumulated in f32.
    BF16,
    /// f32 (`CUDNN_DATA_FLOAT`).
    F32,
    /// f64 (`CUDNN_DATA_DOUBLE`), accumulated in f64.
    F64,
}

impl Elem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elem::F16 | Elem::BF16 => 2,
            Elem::F32 => 4,
            Elem::F64 => 8,
        }
    }
}

/// A 4-d tensor as a descriptor gives it: dims and element strides, in `[N, C, H, W]` order (the
/// filter's `[K, C, R, S]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensor4 {
    /// Sizes, `[N, C, H, W]` (a filter's `[K, C, R, S]`).
    pub dims: [usize; 4],
    /// Element strides, in the order of `dims`.
    pub strides: [usize; 4],
}

impl Tensor4 {
    /// A dense NCHW tensor of `dims`.
    pub fn nchw(dims: [usize; 4]) -> Self {
        let [_, c, h, w] = dims;
        Tensor4 {
            dims,
            strides: [c * h * w, h * w, w, 1],
        }
    }

    /// A dense NHWC tensor of `dims` (given in NCHW order).
    pub fn nhwc(dims: [usize; 4]) -> Self {
        let [_, c, h, w] = dims;
        Tensor4 {
            dims,
            strides: [h * w * c, 1, w * c, c],
        }
    }

    /// The offset, in elements, one past the last element (0 for an empty tensor).
    pub fn span(&self) -> usize {
        if self.dims.contains(&0) {
            return 0;
        }
        1 + self
            .dims
            .iter()
            .zip(&self.strides)
            .map(|(d, s)| (d - 1) * s)
            .sum::<usize>()
    }

    #[inline(always)]
    fn at(&self, a: usize, b: usize, c: usize, d: usize) -> usize {
        a * self.strides[0] + b * self.strides[1] + c * self.strides[2] + d * self.strides[3]
    }
}

/// The convolution descriptor's geometry, in (height, width) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv {
    /// Zero padding on each side.
    pub pad: [usize; 2],
    /// Filter stride (cuDNN's `u`, `v`).
    pub stride: [usize; 2],
    /// Filter dilation.
    pub dilation: [usize; 2],
    /// Number of groups (`C` and `K` are split into this many).
    pub groups: usize,
    /// `CUDNN_CONVOLUTION`: the filter is flipped in both spatial dimensions.
    pub flip: bool,
}

impl Conv {
    /// The output size along one dimension for an input of `input` and a filter of `filter`
    /// (dimension `d`: 0 height, 1 width), `None` when the dilated filter exceeds the padded
    /// input.
    pub fn out_dim(&self, d: usize, input: usize, filter: usize) -> Option<usize> {
        let span = self.dilation[d] * (filter.max(1) - 1) + 1;
        let padded = input + 2 * self.pad[d];
        (padded >= span).then(|| (padded - span) / self.stride[d] + 1)
    }
}

/// One convolution: its three tensors and its geometry, checked consistent by the caller
/// (`y`'s dims are what [`Conv::out_dim`] gives, `C = w.C · groups`, `K` a multiple of groups).
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    /// The input, `[N, C, H, W]`.
    pub x: Tensor4,
    /// The filter, `[K, C/groups, R, S]`.
    pub w: Tensor4,
    /// The output, `[N, K, P, Q]`.
    pub y: Tensor4,
    /// The geometry.
    pub conv: Conv,
    /// The data type of all three tensors.
    pub elem: Elem,
}

/// The accumulation type: f32 or f64.
pub trait Acc: Copy + Add<Output = Self> + Mul<Output = Self> + AddAssign + PartialEq {
    /// Zero.
    const ZERO: Self;
    /// Converts a scale factor (`alpha`, `beta`) to this type.
    fn from_f64(v: f64) -> Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Acc for f64 {
    const ZERO: Self = 0.0;
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// A data type and the compute type cuDNN accumulates it in.
pub trait Data: Copy {
    /// The accumulation type.
    type A: Acc;
    /// Widens an element to the accumulation type.
    fn load(self) -> Self::A;
    /// Rounds an accumulated value to the data type.
    fn store(a: Self::A) -> Self;
}

/// [`Data`] for each type: its accumulation type and the conversions to and from it.
macro_rules! data {
    ($($t:ty => $acc:ty, $load:expr, $store:expr;)*) => {$(
        impl Data for $t {
            type A = $acc;
            #[inline(always)]
            fn load(self) -> $acc {
                $load(self)
            }
            #[inline(always)]
            fn store(a: $acc) -> Self {
                $store(a)
            }
        }
    )*};
}

data! {
    f32 => f32, |v| v, |a| a;
    f64 => f64, |v| v, |a| a;
    f16 => f32, f16::to_f32, f16::from_f32;
    bf16 => f32, bf16::to_f32, bf16::from_f32;
}

/// The output positions `o` (of `outputs`) whose tap at filter offset `tap` (already dilated)
/// lands inside an input of `input`: `0 ≤ o·stride + tap − pad < input`.
#[inline]
fn valid(outputs: usize, input: usize, stride: usize, pad: usize, tap: usize) -> Range<usize> {
    let (stride, pad, tap, input) = (stride as i64, pad as i64, tap as i64, input as i64);
    // o ≥ ceil((pad − tap) / stride), o ≤ floor((input − 1 + pad − tap) / stride).
    let lo = if pad > tap {
        (pad - tap + stride - 1) / stride
    } else {
        0
    };
    let top = input - 1 + pad - tap;
    if top < 0 {
        return 0..0;
    }
    let hi = (top / stride + 1).min(outputs as i64);
    if hi <= lo {
        return 0..0;
    }
    lo as usize..hi as usize
}

/// The filter index of tap `r` of `taps` (flipped for `CUDNN_CONVOLUTION`).
#[inline(always)]
fn tap_index(flip: bool, taps: usize, r: usize) -> usize {
    if flip {
        taps - 1 - r
    } else {
        r
    }
}

/// One filter tap `(r, s)` of a problem: the output rows and columns whose input it reaches
/// ([`valid`]), and where the tap is in the stored filter (`fr`, `fs`, flipped for
/// `CUDNN_CONVOLUTION`).
struct Tap {
    r: usize,
    s: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    fr: usize,
    fs: usize,
}

impl Tap {
    /// Every tap of `p`'s filter, row-major.
    fn all(p: &Problem) -> impl Iterator<Item = Tap> + '_ {
        let [_, _, h_, w_] = p.x.dims;
        let [_, _, r_, s_] = p.w.dims;
        let [_, _, p_, q_] = p.y.dims;
        let c = &p.conv;
        (0..r_).flat_map(move |r| {
            let rows = valid(p_, h_, c.stride[0], c.pad[0], r * c.dilation[0]);
            (0..s_).map(move |s| Tap {
                r,
                s,
                rows: rows.clone(),
                cols: valid(q_, w_, c.stride[1], c.pad[1], s * c.dilation[1]),
                fr: tap_index(c.flip, r_, r),
                fs: tap_index(c.flip, s_, s),
            })
        })
    }

    /// Whether the tap reaches no input at all.
    fn is_empty(&self) -> bool {
        self.rows.is_empty() || self.cols.is_empty()
    }

    /// The input row output row `oh` reads through this tap (`oh` in `rows`).
    #[inline(always)]
    fn ih(&self, c: &Conv, oh: usize) -> usize {
        oh * c.stride[0] + self.r * c.dilation[0] - c.pad[0]
    }

    /// The input column output column `ow` reads through this tap (`ow` in `cols`).
    #[inline(always)]
    fn iw(&self, c: &Conv, ow: usize) -> usize {
        ow * c.stride[1] + self.s * c.dilation[1] - c.pad[1]
    }
}

/// Which tensor a pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// `y` from `x` and `w`.
    Forward,
    /// `x` (the input gradient) from `w` and `y` (the output gradient).
    BackwardData,
    /// `w` (the filter gradient) from `x` and `y` (the output gradient).
    BackwardFilter,
}

/// The device addresses of one call's three tensors, and its scaling factors.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Which tensor is computed.
    pub pass: Pass,
    /// The tensors' shapes and the geometry.
    pub problem: Problem,
    /// Device address of `x` (or `dx`).
    pub x: u64,
    /// Device address of `w` (or `dw`).
    pub w: u64,
    /// Device address of `y` (or `dy`).
    pub y: u64,
    /// Scale of the result.
    pub alpha: f64,
    /// Scale of the written tensor's old value (0: it is not read).
    pub beta: f64,
}

/// Runs `call` on the host.
///
/// # Safety
/// The three addresses hold their tensors (each element the descriptors reach lies in memory
/// the caller may read, and the written tensor's in memory it may write); the written tensor
/// does not overlap the others.
pub unsafe fn run(call: &Call) {
    // SAFETY: forwarded from the caller, with the element type of the problem.
    unsafe {
        match call.problem.elem {
            Elem::F32 => run_as::<f32>(call),
            Elem::F64 => run_as::<f64>(call),
            Elem::F16 => run_as::<f16>(call),
            Elem::BF16 => run_as::<bf16>(call),
        }
    }
}

unsafe fn run_as<D: Data>(call: &Call) {
    let (alpha, beta) = (D::A::from_f64(call.alpha), D::A::from_f64(call.beta));
    let p = &call.problem;
    // SAFETY: forwarded from the caller.
    unsafe {
        match call.pass {
            Pass::Forward => forward::<D>(p, call.x as _, call.w as _, call.y as _, alpha, beta),
            Pass::BackwardData => {
                backward_data::<D>(p, call.x as _, call.w as _, call.y as _, alpha, beta)
            }
            Pass::BackwardFilter => {
                backward_filter::<D>(p, call.x as _, call.w as _, call.y as _, alpha, beta)
            }
        }
    }
}

/// `out[i] = alpha·acc + beta·out[i]`, without reading `out` when `beta` is 0.
#[inline(always)]
unsafe fn write<D: Data>(out: *mut D, acc: D::A, alpha: D::A, beta: D::A) {
    // SAFETY: the caller's element.
    unsafe {
        let v = if beta == D::A::ZERO {
            alpha * acc
        } else {
            alpha * acc + beta * out.read().load()
        };
        out.write(D::store(v));
    }
}

/// `y = alpha · conv(x, w) + beta · y`.
///
/// # Safety
/// As for [`run`].
pub unsafe fn forward<D: Data>(
    p: &Problem,
    x: *const D,
    w: *const D,
    y: *mut D,
    alpha: D::A,
    beta: D::A,
) {
    let n_ = p.x.dims[0];
    let [k_, cg, _, _] = p.w.dims;
    let [_, _, p_, q_] = p.y.dims;
    let c = &p.conv;
    let kg = k_ / c.groups;
    let mut acc = vec![D::A::ZERO; p_ * q_];
    for n in 0..n_ {
        for k in 0..k_ {
            let group = k / kg;
            acc.fill(D::A::ZERO);
            for cl in 0..cg {
                let ch = group * cg + cl;
                for t in Tap::all(p).filter(|t| !t.is_empty()) {
                    // SAFETY: an element of the filter (the caller's contract).
                    let wv = unsafe { w.add(p.w.at(k, cl, t.fr, t.fs)).read() }.load();
                    for oh in t.rows.clone() {
                        let row = p.x.at(n, ch, t.ih(c, oh), 0);
                        let out = &mut acc[oh * q_..(oh + 1) * q_];
                        for ow in t.cols.clone() {
                            let iw = t.iw(c, ow);
                            // SAFETY: (n, ch, ih, iw) is inside the input (`valid`).
                            let xv = unsafe { x.add(row + iw * p.x.strides[3]).read() };
                            out[ow] += xv.load() * wv;
                        }
                    }
                }
            }
            for oh in 0..p_ {
                for ow in 0..q_ {
                    // SAFETY: an element of the output.
                    unsafe { write(y.add(p.y.at(n, k, oh, ow)), acc[oh * q_ + ow], alpha, beta) };
                }
            }
        }
    }
}

/// `dx = alpha · conv_backward_data(w, dy) + beta · dx` (`dx` at `x`, `dy` at `y`).
///
/// # Safety
/// As for [`run`].
pub unsafe fn backward_data<D: Data>(
    p: &Problem,
    dx: *mut D,
    w: *const D,
    dy: *const D,
    alpha: D::A,
    beta: D::A,
) {
    let [n_, c_, h_, w_] = p.x.dims;
    let [k_, cg, _, _] = p.w.dims;
    let c = &p.conv;
    let kg = k_ / c.groups;
    let mut acc = vec![D::A::ZERO; c_ * h_ * w_];
    for n in 0..n_ {
        acc.fill(D::A::ZERO);
        for k in 0..k_ {
            let group = k / kg;
            for cl in 0..cg {
                let ch = group * cg + cl;
                let plane = &mut acc[ch * h_ * w_..(ch + 1) * h_ * w_];
                for t in Tap::all(p).filter(|t| !t.is_empty()) {
                    // SAFETY: an element of the filter.
                    let wv = unsafe { w.add(p.w.at(k, cl, t.fr, t.fs)).read() }.load();
                    for oh in t.rows.clone() {
                        let ih = t.ih(c, oh);
                        let row = p.y.at(n, k, oh, 0);
                        for ow in t.cols.clone() {
                            let iw = t.iw(c, ow);
                            // SAFETY: (n, k, oh, ow) is inside the output gradient.
                            let g = unsafe { dy.add(row + ow * p.y.strides[3]).read() };
                            plane[ih * w_ + iw] += g.load() * wv;
                        }
                    }
                }
            }
        }
        for ch in 0..c_ {
            for ih in 0..h_ {
                for iw in 0..w_ {
                    let v = acc[(ch * h_ + ih) * w_ + iw];
                    // SAFETY: an element of the input gradient.
                    unsafe { write(dx.add(p.x.at(n, ch, ih, iw)), v, alpha, beta) };
                }
            }
        }
    }
}

/// `dw = alpha · conv_backward_filter(x, dy) + beta · dw` (`dw` at `w`, `dy` at `y`).
///
/// # Safety
/// As for [`run`].
pub unsafe fn backward_filter<D: Data>(
    p: &Problem,
    x: *const D,
    dw: *mut D,
    dy: *const D,
    alpha: D::A,
    beta: D::A,
) {
    let n_ = p.x.dims[0];
    let [k_, cg, _, _] = p.w.dims;
    let c = &p.conv;
    let kg = k_ / c.groups;
    for k in 0..k_ {
        let group = k / kg;
        for cl in 0..cg {
            let ch = group * cg + cl;
            // Every tap, reached or not: an unreached one is written as alpha · 0.
            for t in Tap::all(p) {
                let mut acc = D::A::ZERO;
                for n in 0..n_ {
                    for oh in t.rows.clone() {
                        let xrow = p.x.at(n, ch, t.ih(c, oh), 0);
                        let grow = p.y.at(n, k, oh, 0);
                        for ow in t.cols.clone() {
                            let iw = t.iw(c, ow);
                            // SAFETY: both elements are inside their tensors (`valid`).
                            let (xv, g) = unsafe {
                                (
                                    x.add(xrow + iw * p.x.strides[3]).read(),
                                    dy.add(grow + ow * p.y.strides[3]).read(),
                                )
                            };
                            acc += xv.load() * g.load();
                        }
                    }
                }
                // SAFETY: an element of the filter gradient.
                unsafe { write(dw.add(p.w.at(k, cl, t.fr, t.fs)), acc, alpha, beta) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_ranges_keep_taps_inside_the_input() {
        for (outputs, input, stride, pad, tap) in [
            (5, 5, 1, 1, 0),
            (5, 5, 1, 1, 2),
            (3, 7, 2, 1, 1),
            (4, 3, 1, 3, 0),
            (2, 8, 4, 0, 5),
            (1, 1, 1, 0, 3),
        ] {
            let r = valid(outputs, input, stride, pad, tap);
            for o in 0..outputs {
                let i = (o * stride + tap) as i64 - pad as i64;
                assert_eq!(
                    r.contains(&o),
                    (0..input as i64).contains(&i),
                    "{outputs} {input} {stride} {pad} {tap}: {r:?} at {o}"
                );
            }
        }
    }

    #[test]
    fn a_hand_computed_cross_correlation() {
        // x = 1..=9 as a 3×3 image, w = [[1, 0], [0, -1]]: y[i][j] = x[i][j] - x[i+1][j+1].
        let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let w = [1.0f32, 0.0, 0.0, -1.0];
        let mut y = [7.0f32; 4];
        let p = Problem {
            x: Tensor4::nchw([1, 1, 3, 3]),
            w: Tensor4::nchw([1, 1, 2, 2]),
            y: Tensor4::nchw([1, 1, 2, 2]),
            conv: Conv {
                pad: [0, 0],
                stride: [1, 1],
                dilation: [1, 1],
                groups: 1,
                flip: false,
            },
            elem: Elem::F32,
        };
        // SAFETY: host buffers of the problem's shapes.
        unsafe { forward::<f32>(&p, x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), 1.0, 0.0) };
        assert_eq!(y, [-4.0; 4]);
        // As a convolution the filter is flipped: y[i][j] = -x[i][j] + x[i+1][j+1].
        let flipped = Problem {
            conv: Conv {
                flip: true,
                ..p.conv
            },
            ..p
        };
        // SAFETY: as above.
        unsafe { forward::<f32>(&flipped, x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), 2.0, 1.0) };
        assert_eq!(y, [4.0; 4], "2·4 + 1·(−4)");
    }
}
