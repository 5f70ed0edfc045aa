//! softmax and log_softmax on a CUDA device: launch plans for `softmax.cu` (pure, run on a
//! device by the ops and on the CPU by the host harness) and the device side of the ops.
//!
//! Inputs are made dense first (`contiguous_detached`, a copy only for a strided input), then
//! read as `[outer, len, inner]` around the softmax dim: rows (`inner == 1`) get one warp or
//! one block each, columns (`inner > 1`) one thread each. Nothing here waits for the device.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};
use tandem_core::cuda::{device_pointer, launch_on_compute};
use tandem_core::{DType, Error, Result, Tensor};

use super::cpu::Split;
use crate::reduce::cuda::{check_dtype, rows_config, THREADS_PER_BLOCK};

/// `softmax.cu`, embedded.
pub static SOFTMAX: KernelSource = KernelSource {
    name: "softmax",
    source: include_str!("softmax.cu"),
    headers: &[],
};

fn checked_numel(op: &'static str, (outer, n, inner): (usize, usize, usize)) -> Result<usize> {
    outer
        .checked_mul(n)
        .and_then(|v| v.checked_mul(inner))
        .ok_or_else(|| Error::invalid(op, format!("[{outer}, {n}, {inner}] is too large")))
}

/// The launch of a softmax kernel (`backward` selects the backward kernel) over dense
/// `[outer, n, inner]` tensors (`split`), normalised along `n`. `inputs` are the tensors the
/// kernel reads (`[x]` forward, `[g, y]` backward) and `output` the one it writes (`y` forward,
/// `dx` backward), each the address of its first element.
pub fn softmax_launch(
    op: &'static str,
    dtype: DType,
    inputs: &[u64],
    output: u64,
    split: (usize, usize, usize),
    log: bool,
    backward: bool,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    checked_numel(op, split)?;
    let split = Split {
        outer: split.0,
        n: split.1,
        inner: split.2,
    };
    let want = if backward { 2 } else { 1 };
    if inputs.len() != want {
        return Err(Error::invalid(
            op,
            format!(
                "{} input pointers for a kernel that reads {want}",
                inputs.len()
            ),
        ));
    }
    let pass = if backward {
        "softmax_backward"
    } else {
        "softmax"
    };
    // The kernels take the inputs, then the output.
    let mut args: Vec<KernelArg> = inputs.iter().map(|&p| KernelArg::In(p)).collect();
    args.push(KernelArg::Out(output));
    let (kernel, config) = if split.inner == 1 {
        let rows = split.outer;
        let (config, warp_per_row) = rows_config(op, rows, split.n)?;
        args.extend([
            KernelArg::U64(rows as u64),
            KernelArg::U64(split.n as u64),
            KernelArg::I32(log as i32),
            KernelArg::I32(warp_per_row as i32),
        ]);
        (format!("{pass}_rows_{dtype}"), config)
    } else {
        let columns = split.outer * split.inner;
        args.extend([
            KernelArg::U64(split.outer as u64),
            KernelArg::U64(split.n as u64),
            KernelArg::U64(split.inner as u64),
            KernelArg::I32(log as i32),
        ]);
        (
            format!("{pass}_columns_{dtype}"),
            LaunchConfig::for_elements(op, columns, THREADS_PER_BLOCK)?,
        )
    };
    Ok(Launch {
        source: &SOFTMAX,
        kernel,
        config,
        args,
    })
}

/// The address of the first element of a CUDA tensor.
pub(crate) fn element_address(op: &'static str, t: &Tensor) -> Result<u64> {
    let (_, base) = device_pointer(op, t)?;
    Ok(base + (t.layout().offset() * t.dtype().size_in_bytes()) as u64)
}

/// softmax (log_softmax when `log`) of `x` along the middle dim of `split`.
pub(crate) fn forward(op: &'static str, x: &Tensor, split: Split, log: bool) -> Result<Tensor> {
    let y = Tensor::empty(x.dims(), x.dtype(), x.device())?;
    if x.numel() == 0 {
        return Ok(y);
    }
    let x = x.contiguous_detached()?;
    let (dev, _) = device_pointer(op, &x)?;
    let launch = softmax_launch(
        op,
        x.dtype(),
        &[element_address(op, &x)?],
        element_address(op, &y)?,
        (split.outer, split.n, split.inner),
        log,
        false,
    )?;
    launch_on_compute(&dev, &launch, x.numel())?;
    Ok(y)
}

/// The input gradient from the output gradient `g` and the saved output `y`.
pub(crate) fn backward(
    op: &'static str,
    g: &Tensor,
    y: &Tensor,
    split: Split,
    log: bool,
) -> Result<Tensor> {
    let dx = Tensor::empty(g.dims(), g.dtype(), g.device())?;
    if g.numel() == 0 {
        return Ok(dx);
    }
    let (g, y) = (g.contiguous_detached()?, y.contiguous_detached()?);
    let (dev, _) = device_pointer(op, &g)?;
    let launch = softmax_launch(
        op,
        g.dtype(),
        &[element_address(op, &g)?, element_address(op, &y)?],
        element_address(op, &dx)?,
        (split.outer, split.n, split.inner),
        log,
        true,
    )?;
    launch_on_compute(&dev, &launch, g.numel())?;
    Ok(dx)
}
