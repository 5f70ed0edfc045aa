//! CPU kernel of cat and of its backward.
//!
//! Seen as `[outer, size_along_dim · inner]`, every input contributes one contiguous run per
//! outer index, so both directions are a sequence of `copy_from_slice` calls (memcpy), split
//! across threads by outer index when the tensor is large.

use rayon::prelude::*;
use tandem_core::{Element, Result, Tensor};

use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// The output (of `shape`) holding the inputs one after the other along `dim`.
pub(crate) fn cat<T: Element>(inputs: &[&Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let inner: usize = shape[dim + 1..].iter().product();
    let numel: usize = shape.iter().product();
    // The inputs cover the output, every element is written.
    let mut out = memory::uninit::<T>("cat", numel)?;
    if numel == 0 {
        return Tensor::from_vec(out, shape, inputs[0].device());
    }
    // Zero-size inputs contribute nothing (and a zero-size layout may not read as contiguous).
    let contiguous: Vec<Tensor> = inputs
        .iter()
        .map(|t| memory::contiguous("cat", t))
        .collect::<Result<_>>()?;
    let guards = contiguous
        .iter()
        .filter(|t| t.numel() > 0)
        .map(|t| t.read_slice::<T>())
        .collect::<Result<Vec<_>>>()?;
    // (source, offset of its run within an output row, run length)
    let mut runs: Vec<(&[T], usize, usize)> = Vec::with_capacity(inputs.len());
    let mut offset = 0;
    let mut guard_iter = guards.iter();
    for t in inputs {
        let width = t.dims()[dim] * inner;
        if t.numel() > 0 {
            if let Some(g) = guard_iter.next() {
                runs.push((&**g, offset, width));
            }
        }
        offset += width;
    }
    let row = offset;
    let fill = |(o, dst): (usize, &mut [T])| {
        for &(src, at, width) in &runs {
            dst[at..at + width].copy_from_slice(&src[o * width..(o + 1) * width]);
        }
    };
    if parallel(numel) {
        out.par_chunks_mut(row).enumerate().for_each(fill);
    } else {
        out.chunks_mut(row).enumerate().for_each(fill);
    }
    drop(runs);
    drop(guards);
    Tensor::from_vec(out, shape, inputs[0].device())
}

/// The part of `g` (shaped like cat's output) that came from the input at `start..start+len`
/// along `dim`, as a contiguous tensor of `input_shape`.
pub(crate) fn slice_back<T: Element>(
    g: &Tensor,
    dim: usize,
    start: usize,
    input_shape: &[usize],
) -> Result<Tensor> {
    let inner: usize = g.dims()[dim + 1..].iter().product();
    let row = g.dims()[dim] * inner;
    let (at, width) = (start * inner, input_shape[dim] * inner);
    let numel: usize = input_shape.iter().product();
    let mut out = memory::uninit::<T>("cat backward", numel)?;
    if numel > 0 {
        let gc = memory::contiguous("cat backward", g)?;
        let src = gc.read_slice::<T>()?;
        let take = |(o, dst): (usize, &mut [T])| {
            dst.copy_from_slice(&src[o * row + at..o * row + at + width]);
        };
        if parallel(numel) {
            out.par_chunks_mut(width).enumerate().for_each(take);
        } else {
            out.chunks_mut(width).enumerate().for_each(take);
        }
    }
    Tensor::from_vec(out, input_shape, g.device())
}
