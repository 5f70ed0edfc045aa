//! CPU kernels of dropout: drawing the keep-mask and applying it.
//!
//! The mask is drawn in fixed-size chunks, each from its own generator seeded from one draw of
//! the caller's generator, so chunks fill in parallel and the mask depends only on the seed,
//! never on the thread count. One 64-bit draw decides two elements (each half compared with
//! `p · 2³²`). The mask is kept as bytes — a quarter of an f32 mask's memory — and applied with
//! a branch-free select that vectorises.

use rayon::prelude::*;
use tandem_core::{with_float_type, FloatElement, Generator, Result, Tensor};

use crate::cpu::elementwise::empty_like;
use crate::cpu::memory;
use crate::cpu::parallel::parallel;

/// Elements per independently seeded mask chunk. Part of the mask's definition: changing it
/// changes which elements a given seed drops.
const MASK_CHUNK: usize = 1 << 14;

/// Elements per rayon task when applying the mask.
const APPLY_CHUNK: usize = 1 << 13;

/// Inverted dropout of `x`: the output (`x · scale` where kept, 0 where dropped) and the
/// keep-mask drawn from `generator`, a u8 tensor of `x`'s shape (1 = keep).
pub(crate) fn forward(
    x: &Tensor,
    p: f64,
    scale: f64,
    generator: &mut Generator,
) -> Result<(Tensor, Tensor)> {
    let mask = Tensor::from_vec(draw_mask(x.numel(), p, generator)?, x.dims(), x.device())?;
    let out = apply_mask(x, &mask, scale)?;
    Ok((out, mask))
}

/// A keep-mask of `n` elements (1 = keep), each dropped with probability `p` (in `[0, 1)`).
fn draw_mask(n: usize, p: f64, generator: &mut Generator) -> Result<Vec<u8>> {
    // keep iff a uniform 32-bit draw is >= threshold: P(keep) = 1 − threshold / 2³²
    let threshold = ((p * 4_294_967_296.0).round() as u64).min(u32::MAX as u64) as u32;
    let base = generator.next_u64();
    let fill = |(i, chunk): (usize, &mut [u8])| {
        let seed = base.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut g = Generator::new(seed);
        for pair in chunk.chunks_mut(2) {
            let r = g.next_u64();
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
    let c = memory::contiguous("dropout", x)?;
    let src = c.read_slice::<T>()?;
    let mask = mask.read_slice::<u8>()?;
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
    Tensor::from_vec(out, x.dims(), x.device())
}
