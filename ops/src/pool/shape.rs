//! The device-neutral description of a 2-D pool's windows ([`Windows`] for the kernels of
//! both devices, [`PoolWindows`] for the CUDA launch plans). The windows: for each output row and column, the range of input rows and
//! columns it covers, clipped to the input. They describe every pool (sliding max and average,
//! adaptive average) to the kernels, and their lengths are the output's spatial size.

use tandem_core::{Device, Error, Result};

/// The input ranges that each output row and column of a pool covers, clipped to the input.
#[derive(Clone, Debug)]
pub(crate) struct Windows {
    /// Input rows `[start, end)` of each output row.
    pub rows: Vec<(usize, usize)>,
    /// Input columns `[start, end)` of each output column.
    pub cols: Vec<(usize, usize)>,
    /// What an average divides by: `Some(k)` for a fixed count (padding included), `None` for
    /// the number of elements in the window.
    pub divisor: Option<usize>,
}

impl Windows {
    /// Output pixels of one plane.
    pub(crate) fn out_pixels(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// Whether these are the windows of `MaxPool2d(2)`: 2×2, stride 2, no padding.
    pub(crate) fn is_two_by_two(&self) -> bool {
        let tiles = |ranges: &[(usize, usize)]| {
            ranges
                .iter()
                .enumerate()
                .all(|(i, &(a, b))| a == 2 * i && b == 2 * i + 2)
        };
        tiles(&self.rows) && tiles(&self.cols)
    }

    /// The divisor of the window covering `rows` × `cols`.
    pub(crate) fn divisor_of(&self, rows: (usize, usize), cols: (usize, usize)) -> usize {
        self.divisor
            .unwrap_or((rows.1 - rows.0) * (cols.1 - cols.0))
    }
}

/// `count` windows from `window(i)`, in a vector whose allocation failing is an error naming
/// `op` (the count comes from the caller's sizes).
fn collect(
    op: &'static str,
    count: usize,
    window: impl Fn(usize) -> (usize, usize),
) -> Result<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    out.try_reserve_exact(count)
        .map_err(|_| Error::OutOfMemory {
            op,
            device: Device::Cpu,
            bytes: count.saturating_mul(std::mem::size_of::<(usize, usize)>()),
        })?;
    out.extend((0..count).map(window));
    Ok(out)
}

/// Windows of a sliding pool along one dim of `len` elements: output `o` covers
/// `[o·stride − pad, +kernel)`, clipped to the input. The caller has checked that
/// `len + 2·pad` fits in `usize` and is at least `kernel`, and that `stride > 0`.
pub(crate) fn sliding(
    op: &'static str,
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
) -> Result<Vec<(usize, usize)>> {
    let out = (len + 2 * pad - kernel) / stride + 1;
    collect(op, out, |o| {
        let start = (o * stride).saturating_sub(pad);
        let end = (o * stride + kernel).saturating_sub(pad).min(len);
        (start, end)
    })
}

/// Windows of an adaptive pool of `len` elements to `out` outputs: output `i` covers
/// `floor(i·len/out) .. ceil((i+1)·len/out)`, as in PyTorch (`len`, `out` > 0).
pub(crate) fn adaptive(op: &'static str, len: usize, out: usize) -> Result<Vec<(usize, usize)>> {
    let (l, n) = (len as u128, out as u128);
    collect(op, out, |i| {
        let i = i as u128;
        ((i * l / n) as usize, ((i + 1) * l).div_ceil(n) as usize)
    })
}

/// How windows are laid over the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolWindows {
    /// `kernel`-sized windows moved by `stride` over the input padded by `padding` on each side
    /// (rows, columns), clipped to the input.
    Sliding {
        /// Window size.
        kernel: (usize, usize),
        /// Step between windows.
        stride: (usize, usize),
        /// Implicit padding on each side (at most half the kernel).
        padding: (usize, usize),
    },
    /// PyTorch's adaptive windows: output `i` of `out` covers `floor(i·in/out) ..
    /// ceil((i+1)·in/out)`.
    Adaptive,
}
