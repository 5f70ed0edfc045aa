//! Launch plans of softmax and log_softmax (`softmax.cu`): pure functions from device
//! addresses to a [`Launch`], run on a device by the ops and on the CPU by the host harness.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};
use tandem_core::{DType, Error, Result};

use crate::reduce::cuda::launch::{check_dtype, rows_config, THREADS_PER_BLOCK};
use crate::softmax::shape::Split;

/// `softmax.cu`, embedded.
pub static SOFTMAX: KernelSource = KernelSource {
    name: "softmax",
    source: include_str!("../softmax.cu"),
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
