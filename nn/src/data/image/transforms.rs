//! The ImageNet transforms of torchvision's reference recipe, on [`RgbImage`]s: for training
//! `RandomResizedCrop(size)` and a random horizontal flip, for evaluation `Resize(s)` +
//! `CenterCrop(size)`.
//!
//! torchvision applies these to PIL images, so "the same transform" means PIL's pixels:
//! `img.crop(box).resize(size, BILINEAR)`, where PIL's bilinear filter is antialiased (its
//! triangle widens with the downscale factor) and computed in 22-bit fixed point, one
//! horizontal pass rounded to bytes, then one vertical pass. [`resize_box_into`] is that
//! resampling, written once: the crop, the resize, the flip and the HWC → CHW layout happen in
//! one pass over only the source rows the box needs, with the weights computed once per output
//! column and row. The evaluation transform's resize-then-crop runs as the same single pass
//! (only the output pixels the crop keeps are computed), with the pixels of resizing the whole
//! image and cropping.
//!
//! The bytes are Pillow 13's exactly (tested on a real photograph, fixtures made by
//! `nn/tests/fixtures/image_transforms.py`), including its choice of which pass runs first.
//! Older Pillows always ran the horizontal pass first; where 13.0 runs the vertical one first
//! (the height shrinks by more than twice as many pixels as the width), those differ from these
//! bytes by at most 1 in some pixels.
//!
//! Randomness is explicit: [`ImageTransform::apply_into`] takes a per-sample seed (the caller
//! passes [`crate::data::transforms::sample_seed`]`(run_seed, epoch, index)`), so a sample gets
//! the same crop and flip whichever worker builds it, and a new one every epoch. The crop box
//! is drawn by torchvision's algorithm from tandem's [`Generator`], whose stream differs from
//! torch's: the boxes have torchvision's distribution, not its exact sequence.

use tandem_core::Generator;

use super::RgbImage;
use crate::{Error, Result};

/// A rectangle of the source image in pixel coordinates: the pixels `left .. left + width`
/// of rows `top .. top + height`. Fractional values are allowed (pixel `x` covers
/// `[x, x + 1)`), so that a resize followed by a crop can be expressed as one box on the
/// source, as PIL's `Image.resize(size, box=...)` takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CropBox {
    /// Left edge, in source pixels from the left of the image.
    pub left: f64,
    /// Top edge, in source pixels from the top of the image.
    pub top: f64,
    /// Width in source pixels (> 0).
    pub width: f64,
    /// Height in source pixels (> 0).
    pub height: f64,
}

impl CropBox {
    /// Checks the box lies inside a `width × height` image and is not empty.
    fn check(&self, width: usize, height: usize) -> Result<()> {
        let finite = [self.left, self.top, self.width, self.height]
            .iter()
            .all(|v| v.is_finite());
        let inside = self.left >= 0.0
            && self.top >= 0.0
            && self.left + self.width <= width as f64
            && self.top + self.height <= height as f64;
        if finite && self.width > 0.0 && self.height > 0.0 && inside {
            return Ok(());
        }
        Err(Error::input(
            "resize_box_into",
            format!("crop box {self:?} is empty or leaves the {width}×{height} image"),
        ))
    }
}

/// torchvision's `RandomResizedCrop`: a box of a random area fraction (uniform in `scale`) and
/// aspect ratio (log-uniform in `ratio`) of the source, resized to `size`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomResizedCrop {
    size: (usize, usize),
    scale: (f64, f64),
    ratio: (f64, f64),
}

/// An integer crop (what `get_params` returns as `(i, j, h, w)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PixelRect {
    top: usize,
    left: usize,
    height: usize,
    width: usize,
}

impl RandomResizedCrop {
    /// Crops resized to `size` = (height, width), with torchvision's default ranges: area
    /// fraction in (0.08, 1.0), aspect ratio (width / height) in (3/4, 4/3). Errors if a side
    /// is 0.
    pub fn new(size: (usize, usize)) -> Result<Self> {
        if size.0 == 0 || size.1 == 0 {
            return Err(Error::config(
                "RandomResizedCrop",
                format!("output size (height, width) {size:?} has a side of 0"),
            ));
        }
        Ok(RandomResizedCrop {
            size,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        })
    }

    /// Draws the area fraction from `scale` = (low, high) instead. Errors unless
    /// `0 < low <= high` and both are finite.
    pub fn with_scale(mut self, scale: (f64, f64)) -> Result<Self> {
        check_range("scale", scale)?;
        self.scale = scale;
        Ok(self)
    }

    /// Draws the aspect ratio (width / height) log-uniformly from `ratio` = (low, high)
    /// instead. Errors unless `0 < low <= high` and both are finite.
    pub fn with_ratio(mut self, ratio: (f64, f64)) -> Result<Self> {
        check_range("ratio", ratio)?;
        self.ratio = ratio;
        Ok(self)
    }

    /// Output size, (height, width).
    pub fn size(&self) -> (usize, usize) {
        self.size
    }

    /// The range of the area fraction.
    pub fn scale(&self) -> (f64, f64) {
        self.scale
    }

    /// The range of the aspect ratio (width / height).
    pub fn ratio(&self) -> (f64, f64) {
        self.ratio
    }

    /// A crop box of a `width × height` image, drawn as torchvision's
    /// `RandomResizedCrop.get_params` draws it: up to 10 tries of an area `scale`-uniform and a
    /// ratio log-uniform, sides rounded half to even, kept if the box fits, placed uniformly;
    /// else the centred box of the whole image clamped to the ratio range. The box has whole
    /// pixel coordinates and sides of at least 1 (for an image of at least 1×1).
    pub fn sample_box(&self, width: usize, height: usize, rng: &mut Generator) -> CropBox {
        let rect = self.sample_rect(width, height, rng);
        CropBox {
            left: rect.left as f64,
            top: rect.top as f64,
            width: rect.width as f64,
            height: rect.height as f64,
        }
    }

    fn sample_rect(&self, width: usize, height: usize, rng: &mut Generator) -> PixelRect {
        let area = width as f64 * height as f64;
        let (log_lo, log_hi) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let target_area = area * (self.scale.0 + (self.scale.1 - self.scale.0) * rng.uniform());
            let aspect = (log_lo + (log_hi - log_lo) * rng.uniform()).exp();
            // Python's round(); the casts saturate, and anything too big fails the test below.
            let w = (target_area * aspect).sqrt().round_ties_even() as usize;
            let h = (target_area / aspect).sqrt().round_ties_even() as usize;
            if 0 < w && w <= width && 0 < h && h <= height {
                let top = rng.below(height - h + 1);
                let left = rng.below(width - w + 1);
                return PixelRect {
                    top,
                    left,
                    height: h,
                    width: w,
                };
            }
        }
        self.fallback_rect(width, height)
    }

    /// torchvision's fallback: the whole image, narrowed to the nearest ratio in range.
    fn fallback_rect(&self, width: usize, height: usize) -> PixelRect {
        let in_ratio = width as f64 / height as f64;
        let (w, h) = if in_ratio < self.ratio.0 {
            let h = (width as f64 / self.ratio.0).round_ties_even() as usize;
            (width, h.clamp(1.min(height), height))
        } else if in_ratio > self.ratio.1 {
            let w = (height as f64 * self.ratio.1).round_ties_even() as usize;
            (w.clamp(1.min(width), width), height)
        } else {
            (width, height)
        };
        PixelRect {
            top: (height - h) / 2,
            left: (width - w) / 2,
            height: h,
            width: w,
        }
    }
}

fn check_range(what: &str, (lo, hi): (f64, f64)) -> Result<()> {
    if lo.is_finite() && hi.is_finite() && 0.0 < lo && lo <= hi {
        return Ok(());
    }
    Err(Error::config(
        "RandomResizedCrop",
        format!("{what} range ({lo}, {hi}) needs finite 0 < low <= high"),
    ))
}

/// A per-sample image transform producing a fixed-size image.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ImageTransform {
    /// Training: a random resized crop, then (if `flip`) a horizontal mirror with
    /// probability ½. Resampled as torchvision does it on a PIL image, `crop` then `resize`:
    /// the filter reads only pixels inside the crop (unlike [`resize_box_into`], which, as
    /// PIL's `resize(box=...)`, lets pixels just outside the box into the edge pixels).
    Train {
        /// The crop and the output size.
        crop: RandomResizedCrop,
        /// Whether to mirror left–right with probability ½.
        flip: bool,
    },
    /// Evaluation: torchvision's `Resize(resize)` (shorter side to `resize`, longer side
    /// `int(resize · long / short)`) then `CenterCrop(crop)` with `crop` = (height, width); a
    /// crop larger than the resized image is padded with black (zeros), as torchvision pads.
    Eval {
        /// Length of the shorter side after resizing.
        resize: usize,
        /// Output size, (height, width).
        crop: (usize, usize),
    },
}

impl ImageTransform {
    /// The training recipe: `RandomResizedCrop(size)` + `RandomHorizontalFlip()`. Errors if
    /// `size` is 0.
    pub fn imagenet_train(size: usize) -> Result<Self> {
        Ok(ImageTransform::Train {
            crop: RandomResizedCrop::new((size, size))?,
            flip: true,
        })
    }

    /// The evaluation recipe: `Resize(round(size · 256 / 224))` + `CenterCrop(size)` (256 and
    /// 224 for `size` 224). Errors if `size` is 0.
    pub fn imagenet_eval(size: usize) -> Result<Self> {
        if size == 0 {
            return Err(Error::config("ImageTransform", "eval crop size is 0"));
        }
        let resize = (size as f64 * 256.0 / 224.0).round_ties_even() as usize;
        Ok(ImageTransform::Eval {
            resize,
            crop: (size, size),
        })
    }

    /// Size of the output image, (height, width).
    pub fn output_size(&self) -> (usize, usize) {
        match self {
            ImageTransform::Train { crop, .. } => crop.size,
            ImageTransform::Eval { crop, .. } => *crop,
        }
    }

    /// Transforms `image` with the randomness of `seed` and writes the result as CHW bytes
    /// (3 planes of `output_size()` pixels) into `out_chw`. The same image and seed always
    /// give the same bytes. Errors if `out_chw` is not `3 · height · width` long or the
    /// transform's sizes are 0.
    pub fn apply_into(&self, image: &RgbImage, seed: u64, out_chw: &mut [u8]) -> Result<()> {
        let (out_h, out_w) = self.output_size();
        check_output("ImageTransform::apply_into", out_h, out_w, out_chw)?;
        let (rows, columns, flip) = match *self {
            ImageTransform::Train { crop, flip } => {
                let mut rng = Generator::new(seed);
                let rect = crop.sample_rect(image.width(), image.height(), &mut rng);
                // Drawn after the box, as RandomHorizontalFlip runs after RandomResizedCrop.
                let flip = flip && rng.uniform() < 0.5;
                (
                    Axis::cropped(rect.top, rect.height, out_h),
                    Axis::cropped(rect.left, rect.width, out_w),
                    flip,
                )
            }
            ImageTransform::Eval { resize, crop } => {
                if resize == 0 {
                    return Err(Error::config("ImageTransform", "eval resize is 0"));
                }
                let (new_h, new_w) = resized_size(image.width(), image.height(), resize);
                (
                    Axis::resized_then_cropped(image.height(), new_h, crop.0),
                    Axis::resized_then_cropped(image.width(), new_w, crop.1),
                    false,
                )
            }
        };
        resample(image, &rows, &columns, flip, out_chw);
        Ok(())
    }

    /// [`ImageTransform::apply_into`] returning an [`RgbImage`] (interleaved, for tests and
    /// tools).
    pub fn apply(&self, image: &RgbImage, seed: u64) -> Result<RgbImage> {
        let (h, w) = self.output_size();
        let mut chw = vec![0u8; output_bytes("ImageTransform::apply", h, w)?];
        self.apply_into(image, seed, &mut chw)?;
        RgbImage::new(w, h, chw_to_hwc(&chw, h, w))
    }
}

/// torchvision's `Resize(size)` output (height, width) for a `width × height` image.
fn resized_size(width: usize, height: usize, size: usize) -> (usize, usize) {
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    // Python's `int(size * long / short)`: an exact product, a float division, truncated.
    let new_long = ((size as u128 * long as u128) as f64 / short as f64) as usize;
    if width <= height {
        (new_long, size)
    } else {
        (size, new_long)
    }
}

/// Resamples the `crop` box of `image` to `out_h × out_w` pixels, mirrored left–right if
/// `flip`, into `out_chw` as CHW bytes. The pixels are PIL's
/// `image.resize((out_w, out_h), Image.BILINEAR, box=(left, top, left + width, top + height))`
/// (antialiased bilinear in fixed point; source pixels just outside the box contribute to the
/// edge pixels, as they do in PIL). Errors if the box is empty or leaves the image, or
/// `out_chw` is not `3 · out_h · out_w` long.
pub fn resize_box_into(
    image: &RgbImage,
    crop: CropBox,
    out_h: usize,
    out_w: usize,
    flip: bool,
    out_chw: &mut [u8],
) -> Result<()> {
    crop.check(image.width(), image.height())?;
    check_output("resize_box_into", out_h, out_w, out_chw)?;
    let rows = Axis::boxed(image.height(), crop.top, crop.height, out_h);
    let columns = Axis::boxed(image.width(), crop.left, crop.width, out_w);
    resample(image, &rows, &columns, flip, out_chw);
    Ok(())
}

fn check_output(what: &'static str, out_h: usize, out_w: usize, out_chw: &[u8]) -> Result<()> {
    let needed = output_bytes(what, out_h, out_w)?;
    if out_chw.len() != needed {
        return Err(Error::input(
            what,
            format!(
                "a 3×{out_h}×{out_w} output needs {needed} bytes, the buffer has {}",
                out_chw.len()
            ),
        ));
    }
    Ok(())
}

/// Bytes of a 3 × `out_h` × `out_w` output; errors if a side is 0 or the size overflows.
fn output_bytes(what: &'static str, out_h: usize, out_w: usize) -> Result<usize> {
    match out_h.checked_mul(out_w).and_then(|n| n.checked_mul(3)) {
        Some(n) if n > 0 => Ok(n),
        _ => Err(Error::input(
            what,
            format!("a 3×{out_h}×{out_w} output is empty or too large"),
        )),
    }
}

fn chw_to_hwc(chw: &[u8], h: usize, w: usize) -> Vec<u8> {
    let plane = h * w;
    let mut hwc = vec![0u8; 3 * plane];
    for (i, px) in hwc.chunks_exact_mut(3).enumerate() {
        for (c, v) in px.iter_mut().enumerate() {
            *v = chw[c * plane + i];
        }
    }
    hwc
}

/// How one axis (rows or columns) of the output maps onto the source, in PIL's terms: the
/// source pixels `origin .. origin + extent` are the image PIL resizes (the filter never reads
/// outside them), `box_start .. box_end` (relative to `origin`) the box it resizes onto
/// `out_full` pixels, of which the output keeps `out_first .. out_first + out_len` (indices
/// outside `0 .. out_full` are padding, written as 0).
struct Axis {
    origin: usize,
    extent: usize,
    box_start: f64,
    box_len: f64,
    out_full: usize,
    out_first: isize,
    out_len: usize,
}

impl Axis {
    /// `img.crop(...)` to `start .. start + len`, then resize to `out`.
    fn cropped(start: usize, len: usize, out: usize) -> Axis {
        Axis {
            origin: start,
            extent: len,
            box_start: 0.0,
            box_len: len as f64,
            out_full: out,
            out_first: 0,
            out_len: out,
        }
    }

    /// `img.resize(..., box=...)` of the span `start .. start + len` of `size` pixels. PIL
    /// takes the box as C floats and subtracts its edges in single precision; so does this,
    /// else a fractional box can move a filter centre enough to change a byte.
    fn boxed(size: usize, start: f64, len: f64, out: usize) -> Axis {
        let (start, end) = (start as f32, (start + len) as f32);
        Axis {
            origin: 0,
            extent: size,
            box_start: f64::from(start),
            box_len: f64::from(end - start),
            out_full: out,
            out_first: 0,
            out_len: out,
        }
    }

    /// Resize all `size` pixels to `resized`, then torchvision's `CenterCrop` to `crop`
    /// (centred with Python's round, zero-padded if the crop is larger).
    fn resized_then_cropped(size: usize, resized: usize, crop: usize) -> Axis {
        let out_first = if crop > resized {
            -(((crop - resized) / 2) as isize)
        } else {
            ((resized - crop) as f64 / 2.0).round_ties_even() as isize
        };
        Axis {
            origin: 0,
            extent: size,
            box_start: 0.0,
            box_len: size as f64,
            out_full: resized,
            out_first,
            out_len: crop,
        }
    }
}

/// Fixed-point bits of the weights, PIL's `PRECISION_BITS` for 8-bit images (32 − 8 − 2).
const PRECISION_BITS: u32 = 22;

/// The filter taps of every output pixel along one axis: output `i` is
/// `Σ_t source[first[i] + t] · weights[i · stride + t]` for `t < count[i]`.
struct Taps {
    first: Vec<usize>,
    count: Vec<usize>,
    stride: usize,
    weights: Vec<i32>,
}

/// PIL's `precompute_coeffs` (bilinear: the triangle of half-width 1, widened by the downscale
/// factor) plus `normalize_coeffs_8bpc`, computed in the same order and precision so the
/// fixed-point weights are PIL's exactly. `first` is absolute (includes `origin`).
///
/// With `full_windows`, every output that has taps gets the same number of them, the most any
/// output has (PIL's taps placed inside a window of that many source pixels, moved left at the
/// right edge, the rest weight 0), so the horizontal pass can run a loop of fixed length; the
/// sums are unchanged.
fn taps(axis: &Axis, full_windows: bool) -> Taps {
    let scale = axis.box_len / axis.out_full as f64;
    let filter_scale = scale.max(1.0);
    let support = filter_scale;
    let stride = support.ceil() as usize * 2 + 1;
    let inv = 1.0 / filter_scale;
    let mut taps = Taps {
        first: vec![0; axis.out_len],
        count: vec![0; axis.out_len],
        stride,
        weights: vec![0; axis.out_len * stride],
    };
    let mut w = vec![0f64; stride];
    for i in 0..axis.out_len {
        let xx = axis.out_first + i as isize;
        if xx < 0 || xx >= axis.out_full as isize {
            continue; // padding: no taps, so the pixel is 0
        }
        let center = axis.box_start + (xx as f64 + 0.5) * scale;
        // C's (int) truncates toward zero; the clamp to 0 makes that the same as floor.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64)
            .min(axis.extent as i64)
            .max(0) as usize;
        let n = xmax.saturating_sub(xmin).min(stride);
        let mut total = 0.0;
        for (x, wx) in w[..n].iter_mut().enumerate() {
            let d = ((x + xmin) as f64 - center + 0.5) * inv;
            *wx = (1.0 - d.abs()).max(0.0);
            total += *wx;
        }
        let row = &mut taps.weights[i * stride..i * stride + n];
        for (k, &wx) in row.iter_mut().zip(&w[..n]) {
            let wx = if total != 0.0 { wx / total } else { wx };
            // Weights are never negative for the triangle, so PIL's +0.5 branch is the one.
            *k = (0.5 + wx * f64::from(1u32 << PRECISION_BITS)) as i32;
        }
        taps.first[i] = axis.origin + xmin;
        taps.count[i] = n;
    }
    if full_windows {
        widen_to_full_windows(&mut taps, axis.origin + axis.extent);
    }
    taps
}

/// Gives every output with taps a window of the longest output's length (see [`taps`]): a
/// window starts at the output's first tap, or ends at `end` (one past the last source pixel)
/// where that would run past it, and its weights are PIL's moved to their pixels, zeros
/// elsewhere.
fn widen_to_full_windows(taps: &mut Taps, end: usize) {
    let window = taps.count.iter().copied().max().unwrap_or(0);
    for i in 0..taps.count.len() {
        let (first, n) = (taps.first[i], taps.count[i]);
        if n == 0 {
            continue; // padding stays without taps
        }
        let start = first.min(end - window);
        let shift = first - start;
        let row = &mut taps.weights[i * taps.stride..i * taps.stride + window];
        row.copy_within(0..n, shift);
        row[..shift].fill(0);
        taps.first[i] = start;
        taps.count[i] = window;
    }
}

/// PIL's `clip8`: a fixed-point sum back to a byte.
#[inline]
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// The resampling shared by every transform, in two separable passes rounded to bytes in
/// between, as PIL does. Pillow 13.0 runs the vertical pass first when the height shrinks
/// by more than twice as many pixels as the width, else the horizontal pass first; the order
/// changes a few bytes by 1, so it is followed here. Either way only the source rows and
/// columns some tap reads are touched. The mirror (`flip`) is applied when the horizontal
/// pass writes: the filter is symmetric, so mirroring the output is mirroring the input.
fn resample(image: &RgbImage, rows: &Axis, columns: &Axis, flip: bool, out_chw: &mut [u8]) {
    let (row_taps, col_taps) = (taps(rows, false), taps(columns, true));
    let shrink_y = rows.extent as i64 - rows.out_full as i64;
    let shrink_x = columns.extent as i64 - columns.out_full as i64;
    if shrink_y > 0 && shrink_y > 2 * shrink_x {
        resample_vertical_first(image, &row_taps, &col_taps, flip, out_chw);
    } else {
        resample_horizontal_first(image, &row_taps, &col_taps, flip, out_chw);
    }
}

/// The source span `first .. end` that the taps read (empty if every output is padding).
fn used_span(taps: &Taps) -> (usize, usize) {
    let used = (0..taps.count.len()).filter(|&i| taps.count[i] > 0);
    let first = used.clone().map(|i| taps.first[i]).min().unwrap_or(0);
    let end = used.map(|i| taps.first[i] + taps.count[i]).max();
    (first, end.unwrap_or(first))
}

/// One horizontal pass over `R` interleaved rows (`rows[r]`, pixel 0 of each is source column
/// `offset`): writes `taps.count.len()` interleaved pixels to each `dst[r]`, mirrored if
/// `flip`. The common window lengths run as loops of constant length (unrolled by the
/// compiler); rows go `R` at a time so each output column's weights are loaded once for them.
fn horizontal_rows<const R: usize>(
    rows: [&[u8]; R],
    offset: usize,
    taps: &Taps,
    flip: bool,
    dst: [&mut [u8]; R],
) {
    let window = taps.count[0];
    let full = taps.count.iter().all(|&n| n == window);
    match window {
        2 if full => horizontal_rows_with::<2, R>(rows, offset, taps, flip, dst),
        3 if full => horizontal_rows_with::<3, R>(rows, offset, taps, flip, dst),
        4 if full => horizontal_rows_with::<4, R>(rows, offset, taps, flip, dst),
        5 if full => horizontal_rows_with::<5, R>(rows, offset, taps, flip, dst),
        6 if full => horizontal_rows_with::<6, R>(rows, offset, taps, flip, dst),
        _ => horizontal_rows_with::<0, R>(rows, offset, taps, flip, dst),
    }
}

/// [`horizontal_rows`] with `N` taps per output pixel, or each pixel's own count if `N` is 0.
#[inline(always)]
fn horizontal_rows_with<const N: usize, const R: usize>(
    rows: [&[u8]; R],
    offset: usize,
    taps: &Taps,
    flip: bool,
    mut dst: [&mut [u8]; R],
) {
    let out_w = taps.count.len();
    let half = 1u64 << (PRECISION_BITS - 1);
    for x in 0..out_w {
        let xo = if flip { out_w - 1 - x } else { x };
        let n = if N == 0 { taps.count[x] } else { N };
        let first = taps.first[x].saturating_sub(offset);
        let weights = &taps.weights[x * taps.stride..x * taps.stride + n];
        for (row, dst) in rows.iter().zip(dst.iter_mut()) {
            // Red and blue share one u64 (bits 0–31 and 32–63): the weights are ≥ 0 and sum
            // to about 2^22, so a channel's sum stays below 2^31, never carrying into the other.
            let (mut red_blue, mut green) = (half | half << 32, half);
            for (px, &k) in row[first * 3..(first + n) * 3].chunks_exact(3).zip(weights) {
                let k = k as u64;
                red_blue += (u64::from(px[0]) | u64::from(px[2]) << 32) * k;
                green += u64::from(px[1]) * k;
            }
            dst[xo * 3] = clip8(red_blue as u32 as i32);
            dst[xo * 3 + 1] = clip8(green as i32);
            dst[xo * 3 + 2] = clip8((red_blue >> 32) as i32);
        }
    }
}

/// Output row `y` of a vertical pass over `src`, rows of `line` bytes of which row 0 is source
/// row `offset`: the fixed-point sums of output row `y`, one per byte of a row, in `sums`.
fn vertical_row(src: &[u8], line: usize, offset: usize, taps: &Taps, y: usize, sums: &mut [i32]) {
    let (first, n) = (taps.first[y], taps.count[y]);
    let weights = &taps.weights[y * taps.stride..y * taps.stride + n];
    sums.fill(1 << (PRECISION_BITS - 1));
    for (t, &k) in weights.iter().enumerate() {
        let start = (first + t - offset) * line;
        for (s, &v) in sums.iter_mut().zip(&src[start..start + line]) {
            *s += i32::from(v) * k;
        }
    }
}

/// Writes interleaved pixels (as bytes or as fixed-point sums) as row `y` of a CHW output.
fn scatter_row<T: Copy>(
    px: &[T],
    y: usize,
    out_w: usize,
    out_chw: &mut [u8],
    to_byte: impl Fn(T) -> u8,
) {
    let plane = out_chw.len() / 3;
    for (x, p) in px.chunks_exact(3).enumerate() {
        for (c, &v) in p.iter().enumerate() {
            out_chw[c * plane + y * out_w + x] = to_byte(v);
        }
    }
}

fn resample_horizontal_first(
    image: &RgbImage,
    row_taps: &Taps,
    col_taps: &Taps,
    flip: bool,
    out_chw: &mut [u8],
) {
    let (out_h, out_w) = (row_taps.count.len(), col_taps.count.len());
    let (first_row, end_row) = used_span(row_taps);
    let line = out_w * 3;
    let src_line = image.width() * 3;
    let mut temp = vec![0u8; (end_row - first_row) * line];
    let source = &image.pixels()[first_row * src_line..end_row * src_line];
    let mut pairs = temp.chunks_exact_mut(2 * line);
    let mut source_pairs = source.chunks_exact(2 * src_line);
    for (dst, src) in (&mut pairs).zip(&mut source_pairs) {
        let (dst_a, dst_b) = dst.split_at_mut(line);
        let (src_a, src_b) = src.split_at(src_line);
        horizontal_rows([src_a, src_b], 0, col_taps, flip, [dst_a, dst_b]);
    }
    let (last_dst, last_src) = (pairs.into_remainder(), source_pairs.remainder());
    if !last_dst.is_empty() {
        horizontal_rows([last_src], 0, col_taps, flip, [last_dst]);
    }
    let mut sums = vec![0i32; line];
    for y in 0..out_h {
        vertical_row(&temp, line, first_row, row_taps, y, &mut sums);
        scatter_row(&sums, y, out_w, out_chw, clip8);
    }
}

fn resample_vertical_first(
    image: &RgbImage,
    row_taps: &Taps,
    col_taps: &Taps,
    flip: bool,
    out_chw: &mut [u8],
) {
    let (out_h, out_w) = (row_taps.count.len(), col_taps.count.len());
    let (first_col, end_col) = used_span(col_taps);
    let src_line = image.width() * 3;
    // The vertical pass reads only the used columns: view each source row from `first_col`.
    let src = &image.pixels()[first_col * 3..];
    let used = (end_col - first_col) * 3;
    let mut sums = vec![0i32; used];
    let mut temp = vec![0u8; used];
    let mut out_row = vec![0u8; out_w * 3];
    for y in 0..out_h {
        let (first, n) = (row_taps.first[y], row_taps.count[y]);
        let weights = &row_taps.weights[y * row_taps.stride..y * row_taps.stride + n];
        sums.fill(1 << (PRECISION_BITS - 1));
        for (t, &k) in weights.iter().enumerate() {
            let start = (first + t) * src_line;
            for (s, &v) in sums.iter_mut().zip(&src[start..start + used]) {
                *s += i32::from(v) * k;
            }
        }
        for (b, &s) in temp.iter_mut().zip(&sums) {
            *b = clip8(s);
        }
        horizontal_rows([&temp], first_col, col_taps, flip, [&mut out_row]);
        scatter_row(&out_row, y, out_w, out_chw, |v| v);
    }
}

#[cfg(test)]
mod tests;
