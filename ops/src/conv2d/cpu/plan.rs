//! Which CPU algorithm runs each pass of a convolution, chosen once per call.
//!
//! A pass — the forward, the input gradient, the weight gradient — is planned into an enum
//! naming its algorithm, after which the algorithm runs to completion: nothing is tried and
//! abandoned. The choice depends only on the geometry, the element type and the CPU (the f32
//! AVX-512 kernels, proved present by [`ConvElement::kernels`]):
//!
//! - forward: Winograd F(2×2, 3×3) for 3×3, unit-stride, undilated layers with ≥ 16 channels on
//!   both sides; otherwise the implicit GEMM; otherwise (f64, or no AVX-512) im2col tiles with
//!   gemm.
//! - input gradient: with unit strides (and enough channels, see [`Geometry::transposed`]) a
//!   forward convolution of the output gradient with the flipped weights, planned as a forward;
//!   otherwise `Wᵀ·g` per column tile and col2im.
//! - weight gradient: Winograd where the forward would use it; else the pixel-major columns read
//!   in place from a padded channels-last copy (unit strides, dense kernel rows); else the
//!   implicit GEMM where the output channels fill a vector and the output is not small; else
//!   pixel-major column tiles where their runs are long; else im2col tiles.
//!
//! [`Split`] is how every pass shares out its samples among threads.

use super::implicit::Implicit;
use super::pixel_rows::PixelRows;
use super::winograd::Winograd;
use super::ConvElement;
use crate::conv2d::shape::Geometry;

/// Aim for a tile's column matrix of about this many elements (32 KiB of f32: L1-sized).
const TILE_ELEMENTS: usize = 8192;

/// Tiles are at least this many pixels wide: narrower products lose gemm efficiency.
const MIN_TILE_PIXELS: usize = 64;

/// The implicit-gemm weight gradient needs this many output channels (its register blocks
/// hold a vector of them).
const IMPLICIT_WEIGHT_MIN_CHANNELS: usize = 16;

/// Over fewer output columns than this the implicit weight gradient's register blocks are
/// loaded and stored too often for their work; pixel-major columns, where they suit, are
/// faster there.
const IMPLICIT_WEIGHT_MIN_COLUMNS: usize = 128;

/// The input gradient's `Wᵀ·g` goes to the register-blocked tile kernel only up to this many
/// output channels (its depth); gemm measured as fast from 32 up.
const TILE_KERNEL_MAX_DEPTH: usize = 16;

/// How a call splits its work: `chunk` samples per parallel task and tiles of `tile_width`
/// output pixels per sample; gemm itself only goes parallel when the batch is too small to
/// split.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Split {
    pub chunk: usize,
    pub tile_width: usize,
    pub parallel_gemm: bool,
}

impl Split {
    pub(crate) fn new(g: &Geometry) -> Self {
        let threads = rayon::current_num_threads().max(1);
        let n = g.batch.max(1);
        let (chunk, parallel_gemm) = if threads > 1 && n >= threads {
            (n.div_ceil(threads), false)
        } else {
            (n, true)
        };
        let width = (TILE_ELEMENTS / g.patch().max(1)).max(MIN_TILE_PIXELS);
        // Near-equal tiles (aligning them to the tile kernel's register blocks measured slower:
        // the wider tiles fall out of L1).
        let tiles = (g.out_pixels() / width).max(1);
        Split {
            chunk,
            tile_width: g.out_pixels().div_ceil(tiles),
            parallel_gemm,
        }
    }

    /// Whether the chunks run on the rayon pool.
    pub(crate) fn parallel(&self, batch: usize) -> bool {
        rayon::current_num_threads() > 1 && self.chunk < batch
    }
}

/// The algorithm of a forward convolution (of the input, or of the output gradient for the
/// input gradient).
pub(crate) enum Forward<T: ConvElement> {
    /// Winograd F(2×2, 3×3) over the whole batch.
    Winograd(T::Kernels, Winograd),
    /// The implicit GEMM, sample by sample.
    Implicit(T::Kernels, Implicit),
    /// im2col tiles multiplied by the tile kernel where it runs, else by gemm.
    Im2col(Option<T::Kernels>),
}

impl<T: ConvElement> Forward<T> {
    /// The forward algorithm of `g` (a non-empty output).
    pub(crate) fn choose(g: &Geometry) -> Self {
        let Some(k) = T::kernels() else {
            return Forward::Im2col(None);
        };
        if let Some(plan) = Winograd::new(g) {
            Forward::Winograd(k, plan)
        } else if let Some(plan) = Implicit::new(g) {
            Forward::Implicit(k, plan)
        } else {
            Forward::Im2col(Some(k))
        }
    }
}

/// The algorithm of the input gradient.
pub(crate) enum InputGrad<T: ConvElement> {
    /// A forward convolution of the output gradient with the flipped weights, over
    /// `geometry` (see [`Geometry::transposed`]).
    Transposed {
        geometry: Geometry,
        forward: Box<Forward<T>>,
    },
    /// `Wᵀ·g` per column tile (by the tile kernel where given, else gemm), added back by
    /// col2im.
    Col2im(Option<T::Kernels>),
}

impl<T: ConvElement> InputGrad<T> {
    pub(crate) fn choose(g: &Geometry) -> Self {
        match g.transposed() {
            Some(geometry) => InputGrad::Transposed {
                geometry,
                forward: Box::new(Forward::choose(&geometry)),
            },
            None => {
                InputGrad::Col2im(T::kernels().filter(|_| g.out_channels <= TILE_KERNEL_MAX_DEPTH))
            }
        }
    }
}

/// The algorithm of the weight gradient.
pub(crate) enum WeightGrad<T: ConvElement> {
    /// Winograd F(2×2, 3×3) over the whole batch.
    Winograd(T::Kernels, Winograd),
    /// Pixel-major columns read in place from the padded channels-last sample.
    RowsInPlace(T::Kernels, PixelRows),
    /// The implicit GEMM, sample by sample.
    Implicit(T::Kernels, Implicit),
    /// Pixel-major column tiles, multiplied by the tile kernel where given, else gemm.
    Rows(Option<T::Kernels>, PixelRows),
    /// im2col tiles multiplied by gemm.
    Im2col,
}

impl<T: ConvElement> WeightGrad<T> {
    pub(crate) fn choose(g: &Geometry) -> Self {
        let kernels = T::kernels();
        if let Some((k, plan)) = kernels.and_then(|k| Some((k, Winograd::new(g)?))) {
            return WeightGrad::Winograd(k, plan);
        }
        let rows = PixelRows::suits(g).then(|| PixelRows::new(g));
        match (kernels, rows) {
            (Some(k), Some(rows)) if rows.in_place() => WeightGrad::RowsInPlace(k, rows),
            (kernels, rows) => {
                let implicit = kernels
                    .filter(|_| g.out_channels >= IMPLICIT_WEIGHT_MIN_CHANNELS)
                    .and_then(|k| Some((k, Implicit::new(g)?)))
                    .filter(|(_, p)| rows.is_none() || p.columns() >= IMPLICIT_WEIGHT_MIN_COLUMNS);
                match (implicit, rows) {
                    (Some((k, plan)), _) => WeightGrad::Implicit(k, plan),
                    (None, Some(rows)) => WeightGrad::Rows(kernels, rows),
                    (None, None) => WeightGrad::Im2col,
                }
            }
        }
    }
}
