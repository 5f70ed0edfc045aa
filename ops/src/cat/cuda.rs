//! cat and its backward on a CUDA device, built on the runtime's strided copy kernel: the
//! output is allocated once and each input is copied into its window along the cat dim (one
//! launch per non-empty input, any dtype, any input layout); the backward copies each window of
//! the output gradient out into a dense tensor. Every copy runs on the device's compute stream,
//! with no host synchronisation.

use tandem_core::{Result, Tensor};

/// The output (of `shape`, already checked) holding `inputs` one after the other along `dim`.
pub(crate) fn cat(inputs: &[&Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let first = inputs[0];
    let out = Tensor::empty(shape, first.dtype(), first.device())?;
    let mut start = 0;
    for t in inputs {
        let len = t.dims()[dim];
        if t.numel() > 0 {
            let window = out.view_detached(out.layout().narrow("cat", dim, start, len)?)?;
            window.copy_(t)?;
        }
        start += len;
    }
    Ok(out)
}

/// The part of `g` (shaped like cat's output) that came from the input at `start..` along
/// `dim`, as a dense tensor of `input_shape`.
pub(crate) fn slice_back(
    g: &Tensor,
    dim: usize,
    start: usize,
    input_shape: &[usize],
) -> Result<Tensor> {
    // An empty window may start past the end of an empty gradient's storage (a zero-row batch
    // narrowed at a column offset), which no view may do: it is a fresh empty tensor instead.
    if input_shape.contains(&0) {
        return Tensor::empty(input_shape, g.dtype(), g.device());
    }
    let window =
        g.view_detached(
            g.layout()
                .narrow("cat backward", dim, start, input_shape[dim])?,
        )?;
    window.copy_detached()
}
