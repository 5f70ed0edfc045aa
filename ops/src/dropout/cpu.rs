//! CPU kernels of dropout: drawing the keep-mask and applying it.
//!
//! The mask comes from a counter-based generator (see [`mask_hash`]): element `i`'s decision
//! depends only on the seed and `i`, so chunks fill in parallel, the mask never depends on the
//! thread count, and the CUDA kernel (`dropout.cu`) draws the very same mask for the same seed.
//! One 64-bit hash decides two elements (each half compared with `p · 2³²`). The mask is kept
//! as bytes — a quarter of an f32 mask's memory — and applied with a branch-free select that
//! vectorises.

use rayon::prelude::*;
use tandem_core::{with_float_type, FloatElement, MemoryFormat, Result, Tensor};

use crate::cpu::elementwise::empty_like;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// Elements per rayon task when drawing the mask (even, so a task starts on a pair).
const MASK_CHUNK: usize = 1 << 14;

/// Elements per rayon task when applying the mask.
const APPLY_CHUNK: usize = 1 << 13;

/// The counter-based generator of the mask, shared by both devices (`dropout_hash` in
/// `dropout.cu` is the same function): SplitMix64's output function applied to the seed plus
/// `counter + 1` times the golden-ratio increment, i.e. the `counter`-th output of a SplitMix64
/// stream started at `seed`. Elements `2k` and `2k + 1` take the low and high halves of
/// `mask_hash(seed, k)`.
pub(crate) fn mask_hash(seed: u64, counter: u64) -> u64 {
    let mut z = seed.wrapping_add(counter.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Inverted dropout of `x`: the output (`x · scale` where kept, 0 where dropped) and the
/// keep-mask of `seed`, a u8 tensor of `x`'s shape (1 = keep; an element is kept when its
/// 32-bit draw is at least `threshold`).
pub(crate) fn forward(
    x: &Tensor,
    seed: u64,
    threshold: u32,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let mask = Tensor::from_vec(draw_mask(x.numel(), seed, threshold)?, x.dims(), x.device())?;
    // The draws follow the logical (row-major) index, so a channels-last input drops the same
    // elements as its contiguous twin; the mask is then laid out like `x` for a storage-order
    // pass.
    let mask = match x.dense_format() {
        Some(MemoryFormat::ChannelsLast) => mask.contiguous_in(MemoryFormat::ChannelsLast)?,
        _ => mask,
    };
    let out = apply_mask(x, &mask, scale)?;
    Ok((out, mask))
}

/// A keep-mask of `n` elements (1 = keep) from `seed`.
fn draw_mask(n: usize, seed: u64, threshold: u32) -> Result<Vec<u8>> {
    let fill = |(i, chunk): (usize, &mut [u8])| {
        let first_pair = (i * MASK_CHUNK / 2) as u64;
        for (k, pair) in chunk.chunks_mut(2).enumerate() {
            let r = mask_hash(seed, first_pair + k as u64);
            pair[0] = (r as u32 >= threshold) as u8;
            if let Some(second) = pair.get_mut(1) {
                *second = ((r >> 32) as u32 >= threshold) as u8;
            }
        }
    };
    let mut mask = memory::uninit::<u8>("dropout", n)?;
    if parallel(n) {
        mask.par_chunks_mut(MASK_CHUNK).enumerate().for_each(fill);
    } else {
        mask.chunks_mut(MASK_CHUNK).enumerate().for_each(fill);
    }
    Ok(mask)
}

/// `x · scale` where the mask (a contiguous u8 tensor of `x`'s shape) keeps an element, 0 where
/// it drops it (any layout in, contiguous out).
pub(crate) fn apply_mask(x: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    with_float_type!("dropout", x.dtype(), T => apply_mask_typed::<T>(x, mask, scale))
}

fn apply_mask_typed<T: FloatElement>(x: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    if x.numel() == 0 {
        return empty_like::<T>(x);
    }
    // The mask is dense (row-major or channels-last, as the forward's input was): run in its
    // storage order, the output in its format.
    let format = mask.dense_format().unwrap_or(MemoryFormat::Contiguous);
    let c = memory::dense_in(x, format)?;
    let src = c.read_dense_slice::<T>()?;
    let mask = mask.read_dense_slice::<u8>()?;
    let mask = &mask[..];
    let scale = T::from_f64(scale);
    let mut out = memory::uninit::<T>("dropout", src.len())?;
    let body = |((o, s), m): ((&mut [T], &[T]), &[u8])| {
        for ((o, &s), &m) in o.iter_mut().zip(s).zip(m) {
            *o = if m != 0 { s * scale } else { T::ZERO };
        }
    };
    if parallel(out.len()) {
        out.par_chunks_mut(APPLY_CHUNK)
            .zip(src.par_chunks(APPLY_CHUNK))
            .zip(mask.par_chunks(APPLY_CHUNK))
            .for_each(body);
    } else {
        body(((&mut out, &src), mask));
    }
    drop(src);
    Tensor::from_vec_in(out, x.dims(), x.device(), format)
}
