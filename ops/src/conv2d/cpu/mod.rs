//! CPU kernels of conv2d. Each pass is planned once per call (`plan.rs`) into one algorithm
//! that then runs to completion:
//!
//! - `winograd.rs`: Winograd F(2×2, 3×3) for f32 on AVX-512 CPUs — forward and weight
//!   gradient of the 3×3, unit-stride, undilated layers with at least 16 channels on both sides;
//! - `implicit.rs`: the implicit GEMM, whose register-blocked kernel (`tile_product.rs`) reads
//!   the rows of the column matrix straight from a padded copy of each sample — forward and
//!   weight gradient (f32, AVX-512);
//! - `pixel_rows.rs`: the weight gradient over pixel-major columns, read in place from a padded
//!   channels-last copy or copied out tile by tile;
//! - `im2col.rs`: columns built explicitly, tile by tile, and multiplied by the tile kernel or
//!   gemm — forward, weight gradient, and the input gradient through col2im (f64, other CPUs,
//!   strided layers).
//!
//! - `nhwc.rs`: the channels-last path — an implicit GEMM over NHWC pixel rows, forward and
//!   both gradients, taken when the input or the weight is channels-last (f32, f64).
//! - `amx.rs`: bf16 on AMX tiles (forward and both gradients, either memory format), where the
//!   CPU has AMX-BF16; `low_precision.rs` routes f16/bf16 there or through the f32 kernels.
//!
//! With unit strides the input gradient is itself a forward convolution of the output
//! gradient with the flipped, transposed weights ([`Geometry::transposed`]), planned and run as
//! a forward.
//!
//! The batch is split into one contiguous chunk per rayon thread ([`Split`]); each chunk owns
//! its scratch buffers (from the caching allocator) and its partial weight/bias gradients,
//! which are summed at the end in chunk order, so no thread writes where another reads and the
//! result does not depend on scheduling. At one rayon thread everything runs on the caller.
//! Where columns are built, each sample's output pixels are processed in tiles small enough
//! that a tile's column matrix stays in cache from the moment it is written to the moment it
//! is read: the columns are the largest data a convolution touches (`C·kh·kw` times the input),
//! and streaming them through memory costs as much as the products themselves.

#[cfg(target_arch = "x86_64")]
mod amx;
mod im2col;
mod implicit;
pub(crate) mod low_precision;
mod nhwc;
mod pixel_rows;
mod plan;
mod tile_product;
mod winograd;

use rayon::prelude::*;
use tandem_core::{alloc, with_float_type, FloatElement, Result, Tensor};

use crate::conv2d::shape::Geometry;
use crate::conv2d::shape::Needs;
use crate::cpu::memory::{self, Scratch};
use im2col::{tile_bounds, Im2col};
use plan::{Forward, InputGrad, Split, WeightGrad};
use tile_product::{Avx512, TileShape};

/// The op named in the errors of the kernels (an allocation that cannot be made).
const OP: &str = "conv2d";

/// Element types of the convolution kernels. f32 has the AVX-512 kernels (the tile product,
/// and the implicit GEMM and Winograd built on it) where the CPU has AVX-512F; f64 always takes
/// the im2col + gemm path. A plan names the AVX-512 kernels only together with a
/// [`ConvElement::Kernels`] value, which exists only for f32 on such a CPU: the type system,
/// not a run-time flag, keeps f64 off them.
pub(crate) trait ConvElement: FloatElement {
    /// Proof that the f32 AVX-512 kernels run for this element type: [`Avx512`] for f32, an
    /// uninhabited type for f64.
    type Kernels: Copy + Send + Sync;

    /// The proof, where this CPU and element type have the kernels.
    fn kernels() -> Option<Self::Kernels>;

    /// The CPU proof inside `k`.
    fn cpu(k: Self::Kernels) -> Avx512;

    /// `x` as f32 values (the identity: only f32 has a proof).
    fn f32s(k: Self::Kernels, x: &[Self]) -> &[f32];

    /// `x` as mutable f32 values.
    fn f32s_mut(k: Self::Kernels, x: &mut [Self]) -> &mut [f32];

    /// A vector of f32 values as a vector of this type.
    fn from_f32s(k: Self::Kernels, x: Vec<f32>) -> Vec<Self>;

    /// The tile product of `tile_product.rs` over elements of this type.
    fn tile_product(
        k: Self::Kernels,
        s: TileShape,
        a: &[Self],
        b: &[Self],
        bias: Option<&[Self]>,
        out: &mut [Self],
    ) {
        tile_product::product(
            Self::cpu(k),
            s,
            Self::f32s(k, a),
            Self::f32s(k, b),
            bias.map(|b| Self::f32s(k, b)),
            Self::f32s_mut(k, out),
        );
    }
}

impl ConvElement for f32 {
    type Kernels = Avx512;

    fn kernels() -> Option<Avx512> {
        tile_product::avx512()
    }
    fn cpu(k: Avx512) -> Avx512 {
        k
    }
    fn f32s(_: Avx512, x: &[f32]) -> &[f32] {
        x
    }
    fn f32s_mut(_: Avx512, x: &mut [f32]) -> &mut [f32] {
        x
    }
    fn from_f32s(_: Avx512, x: Vec<f32>) -> Vec<f32> {
        x
    }
}

/// No AVX-512 kernels (f64): no value of this type exists.
#[derive(Clone, Copy)]
pub(crate) enum NoKernels {}

impl ConvElement for f64 {
    type Kernels = NoKernels;

    fn kernels() -> Option<NoKernels> {
        None
    }
    fn cpu(k: NoKernels) -> Avx512 {
        match k {}
    }
    fn f32s(k: NoKernels, _: &[f64]) -> &[f32] {
        match k {}
    }
    fn f32s_mut(k: NoKernels, _: &mut [f64]) -> &mut [f32] {
        match k {}
    }
    fn from_f32s(k: NoKernels, _: Vec<f32>) -> Vec<f64> {
        match k {}
    }
}

/// Gradients produced by [`backward`] (flat, in the layouts of x, weight and bias).
pub(crate) struct Grads<T> {
    pub input: Option<Vec<T>>,
    pub weight: Option<Vec<T>>,
    pub bias: Option<Vec<T>>,
}

/// The forward of conv2d on CPU tensors (any layout): `[N, O, OH, OW]`.
pub(crate) fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    g: &Geometry,
) -> Result<Tensor> {
    if nhwc::wants(x, weight) {
        return with_float_type!(OP, x.dtype(), T => nhwc::conv2d::<T>(x, weight, bias, g));
    }
    with_float_type!(OP, x.dtype(), T => {
        let (xc, wc) = (memory::contiguous(OP, x)?, memory::contiguous(OP, weight)?);
        let b: Option<Vec<T>> = bias.map(|b| memory::gather::<T>(OP, b)).transpose()?;
        let values = forward::<T>(&xc.read_slice::<T>()?, &wc.read_slice::<T>()?, b.as_deref(), g)?;
        Tensor::from_vec(values, &g.out_shape(), x.device())
    })
}

/// The backward of conv2d on CPU tensors: the gradients `needs` asks for, as tensors shaped
/// like the input, the weight and the bias (`[O]`).
pub(crate) fn conv2d_backward(
    x: &Tensor,
    weight: &Tensor,
    grad: &Tensor,
    g: &Geometry,
    needs: Needs,
) -> Result<[Option<Tensor>; 3]> {
    const BACKWARD: &str = "conv2d_backward";
    if nhwc::wants(x, weight) {
        return with_float_type!(BACKWARD, grad.dtype(), T => nhwc::conv2d_backward::<T>(x, weight, grad, g, needs));
    }
    with_float_type!(BACKWARD, grad.dtype(), T => {
        let (xc, wc, gc) = (
            memory::contiguous(BACKWARD, x)?,
            memory::contiguous(BACKWARD, weight)?,
            memory::contiguous(BACKWARD, grad)?,
        );
        let grads = backward::<T>(&xc.read_slice::<T>()?, &wc.read_slice::<T>()?, &gc.read_slice::<T>()?, g, needs)?;
        let device = grad.device();
        let tensor = |v: Option<Vec<T>>, shape: &[usize]| v.map(|v| Tensor::from_vec(v, shape, device)).transpose();
        Ok([
            tensor(grads.input, x.dims())?,
            tensor(grads.weight, weight.dims())?,
            tensor(grads.bias, &[g.out_channels])?,
        ])
    })
}

/// Forward: `out[n] = W · im2col(x[n]) + b`, `x` `[N, C, H, W]`, `w` `[O, C·kh·kw]`, result
/// `[N, O, OH, OW]` as a flat vector, by the algorithm [`Forward::choose`] picks.
pub(crate) fn forward<T: ConvElement>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
) -> Result<Vec<T>> {
    let mut out = memory::uninit::<T>(OP, g.batch * g.out_per_sample())?;
    if !out.is_empty() {
        run_forward(&Forward::choose(g), x, w, bias, g, &mut out)?;
    }
    Ok(out)
}

/// Runs the forward algorithm `plan` of `g` into `out` (non-empty; every element written).
fn run_forward<T: ConvElement>(
    plan: &Forward<T>,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
    out: &mut [T],
) -> Result<()> {
    let (in_per, out_per, patch) = (g.in_per_sample(), g.out_per_sample(), g.patch());
    let split = Split::new(g);
    match *plan {
        Forward::Winograd(k, ref winograd) => winograd.forward(
            T::f32s(k, x),
            T::f32s(k, w),
            bias.map(|b| T::f32s(k, b)),
            T::f32s_mut(k, out),
        ),
        Forward::Implicit(k, ref implicit) => {
            let wt = transposed_weights(w, g)?;
            let wt32 = T::f32s(k, &wt);
            let result = for_each_chunk(&split, g.batch, out, out_per, |n0, chunk| {
                let mut padded = Scratch::<f32>::new(OP, implicit.padded_len())?;
                let mut tile = Scratch::<f32>::new(OP, implicit.tile_len())?;
                for (s, dst) in chunk.chunks_mut(out_per).enumerate() {
                    let xn = &x[(n0 + s) * in_per..][..in_per];
                    implicit.sample(
                        wt32,
                        bias.map(|b| T::f32s(k, b)),
                        T::f32s(k, xn),
                        &mut padded.buf,
                        &mut tile.buf,
                        T::f32s_mut(k, dst),
                    );
                }
                Ok(())
            });
            alloc::recycle(wt);
            result
        }
        Forward::Im2col(kernels) => {
            let table = Im2col::new(g, split.tile_width);
            // The tile kernel reads the weights transposed, `[C·kh·kw, O]`.
            let wt = match kernels {
                Some(_) => transposed_weights(w, g)?,
                None => Vec::new(),
            };
            let result = for_each_chunk(&split, g.batch, out, out_per, |n0, chunk| {
                let mut cols = Scratch::<T>::new(OP, patch * table.max_tile_width())?;
                for (s, dst) in chunk.chunks_mut(out_per).enumerate() {
                    let xn = &x[(n0 + s) * in_per..][..in_per];
                    table.forward_sample(
                        kernels,
                        g,
                        (w, &wt),
                        bias,
                        xn,
                        &mut cols.buf,
                        dst,
                        split.parallel_gemm,
                    );
                }
                Ok(())
            });
            alloc::recycle(wt);
            result
        }
    }
}

/// Runs `f(first_sample, chunk)` over the chunks of `split.chunk` samples (`per` elements each)
/// of `out`, on the rayon pool where the split says so.
fn for_each_chunk<T: Send>(
    split: &Split,
    batch: usize,
    out: &mut [T],
    per: usize,
    f: impl Fn(usize, &mut [T]) -> Result<()> + Sync,
) -> Result<()> {
    if split.parallel(batch) {
        out.par_chunks_mut(split.chunk * per)
            .enumerate()
            .try_for_each(|(ci, c)| f(ci * split.chunk, c))
    } else {
        out.chunks_mut(split.chunk * per)
            .enumerate()
            .try_for_each(|(ci, c)| f(ci * split.chunk, c))
    }
}

/// The weights `[O, C·kh·kw]` transposed, `[C·kh·kw, O]`.
fn transposed_weights<T: FloatElement>(w: &[T], g: &Geometry) -> Result<Vec<T>> {
    let (o_n, patch) = (g.out_channels, g.patch());
    let mut wt = memory::uninit::<T>(OP, patch * o_n)?;
    for (i, v) in wt.iter_mut().enumerate() {
        *v = w[(i % o_n) * patch + i / o_n];
    }
    Ok(wt)
}

/// Backward of [`forward`] for the output gradient `gy` (`[N, O, OH, OW]`, contiguous):
/// `grad_x[n] = col2im(Wᵀ·gy[n])`, `grad_W = Σₙ gy[n]·im2col(x[n])ᵀ`, `grad_b = Σ gy`, each by
/// the algorithm its plan picks.
///
/// The algorithms that go sample by sample (every weight-gradient algorithm but Winograd, the
/// bias gradient, and the input gradient through col2im) run in one loop over the samples,
/// so that each sample's output gradient is read from memory once; Winograd's weight
/// gradient and the input gradient as a transposed convolution take the whole batch.
pub(crate) fn backward<T: ConvElement>(
    x: &[T],
    w: &[T],
    gy: &[T],
    g: &Geometry,
    needs: Needs,
) -> Result<Grads<T>> {
    let split = Split::new(g);
    let weight_plan = needs.weight.then(|| WeightGrad::<T>::choose(g));
    let input_plan = needs.input.then(|| InputGrad::<T>::choose(g));
    let (o_n, patch) = (g.out_channels, g.patch());
    // Winograd's weight gradient over the whole batch; any other goes sample by sample.
    let (winograd, per_sample) = match weight_plan {
        Some(WeightGrad::Winograd(k, ref winograd)) => {
            let gw = winograd.weight_gradient(T::f32s(k, x), T::f32s(k, gy))?;
            (Some(T::from_f32s(k, gw)), None)
        }
        ref other => (None, other.as_ref()),
    };
    let col2im = match input_plan {
        Some(InputGrad::Col2im(kernels)) => Some(kernels),
        _ => None,
    };
    let mut grad_x = match col2im {
        Some(_) => Some(memory::zeroed::<T>(OP, g.batch * g.in_per_sample())?),
        None => None,
    };
    let pass = SamplePass {
        weight: per_sample,
        bias: needs.bias,
        col2im,
    };
    let partials = match pass.is_empty() {
        true => Vec::new(),
        false => sample_pass(&pass, x, w, gy, g, &split, grad_x.as_deref_mut())?,
    };
    let weight = match per_sample {
        None => winograd,
        Some(plan) => {
            let summed = sum_vectors(partials.iter().map(|p| &p.0), o_n * patch)?;
            let gw = match plan {
                WeightGrad::RowsInPlace(_, rows) | WeightGrad::Rows(_, rows) => {
                    rows.to_weight_order(&summed)?
                }
                // From [C·kh·kw, O] to [O, C·kh·kw].
                _ => {
                    let mut gw = memory::uninit(OP, o_n * patch)?;
                    for (r, row) in summed.chunks(o_n.max(1)).enumerate() {
                        row.iter()
                            .enumerate()
                            .for_each(|(o, &v)| gw[o * patch + r] = v);
                    }
                    gw
                }
            };
            alloc::recycle(summed);
            Some(gw)
        }
    };
    let bias = match needs.bias {
        true => Some(sum_vectors(partials.iter().map(|p| &p.1), o_n)?),
        false => None,
    };
    for (gw, gb) in partials {
        alloc::recycle(gw);
        alloc::recycle(gb);
    }
    let input = match input_plan {
        Some(InputGrad::Transposed {
            ref geometry,
            ref forward,
        }) => Some(transposed_input_gradient(forward, geometry, w, gy, g)?),
        Some(InputGrad::Col2im(_)) => grad_x,
        None => None,
    };
    Ok(Grads {
        input,
        weight,
        bias,
    })
}

/// The input gradient as a forward convolution of `gy` with the flipped weights, over
/// `geometry` (`g`'s [`Geometry::transposed`]) by the algorithm `forward`.
fn transposed_input_gradient<T: ConvElement>(
    forward: &Forward<T>,
    geometry: &Geometry,
    w: &[T],
    gy: &[T],
    g: &Geometry,
) -> Result<Vec<T>> {
    let flipped = flipped_weights(w, g)?;
    let mut grad_x = memory::uninit::<T>(OP, g.batch * g.in_per_sample())?;
    let result = match grad_x.is_empty() {
        true => Ok(()),
        false => run_forward(forward, gy, &flipped, None, geometry, &mut grad_x),
    };
    alloc::recycle(flipped);
    result.map(|()| grad_x)
}

/// What the loop over the samples of the backward computes.
struct SamplePass<'a, T: ConvElement> {
    /// The weight gradient by this per-sample algorithm.
    weight: Option<&'a WeightGrad<T>>,
    /// The bias gradient.
    bias: bool,
    /// The input gradient by col2im, `Wᵀ·g` by the tile kernel where given, else gemm.
    col2im: Option<Option<T::Kernels>>,
}

impl<T: ConvElement> SamplePass<'_, T> {
    fn is_empty(&self) -> bool {
        self.weight.is_none() && !self.bias && self.col2im.is_none()
    }
}

/// The scratch buffers of one task of a sample pass.
struct SampleScratch<'a, T: tandem_core::Element> {
    padded: &'a mut Scratch<T>,
    spread: &'a mut Scratch<T>,
    cols: &'a mut Scratch<T>,
}

/// Adds the weight gradient of one sample (input `xn`, output gradient `gn`) to `gw` by
/// `weight`'s per-sample algorithm (nothing for Winograd, which runs over the whole batch).
#[allow(clippy::too_many_arguments)]
fn weight_sample<T: ConvElement>(
    weight: Option<&WeightGrad<T>>,
    table: Option<&Im2col>,
    g: &Geometry,
    bounds: &[usize],
    (xn, gn): (&[T], &[T]),
    scratch: SampleScratch<'_, T>,
    gw: &mut [T],
    parallel_gemm: bool,
) {
    match weight {
        Some(&WeightGrad::RowsInPlace(k, ref rows)) => rows.weight_sample_in_place(
            k,
            xn,
            gn,
            &mut scratch.padded.buf,
            &mut scratch.spread.buf,
            gw,
        ),
        Some(&WeightGrad::Implicit(k, ref implicit)) => implicit.weight_sample(
            T::f32s(k, xn),
            T::f32s(k, gn),
            T::f32s_mut(k, &mut scratch.padded.buf),
            T::f32s_mut(k, &mut scratch.spread.buf),
            T::f32s_mut(k, gw),
        ),
        Some(&WeightGrad::Rows(kernels, ref rows)) => rows.weight_sample(
            kernels,
            xn,
            gn,
            bounds,
            &mut scratch.padded.buf,
            &mut scratch.cols.buf,
            gw,
            parallel_gemm,
        ),
        Some(WeightGrad::Im2col) => {
            if let Some(table) = table {
                table.weight_sample(g, xn, gn, &mut scratch.cols.buf, gw, parallel_gemm);
            }
        }
        Some(WeightGrad::Winograd(..)) | None => {}
    }
}

/// Runs `pass` over the samples, a chunk of them per task: the input gradient straight into
/// `grad_x` (`[N, C, H, W]`, zeroed; each chunk owns its samples), and per chunk the partial
/// weight gradient (in the algorithm's own order, see [`backward`]) and bias gradient.
fn sample_pass<T: ConvElement>(
    pass: &SamplePass<'_, T>,
    x: &[T],
    w: &[T],
    gy: &[T],
    g: &Geometry,
    split: &Split,
    grad_x: Option<&mut [T]>,
) -> Result<Vec<(Vec<T>, Vec<T>)>> {
    let (o_n, pixels, patch) = (g.out_channels, g.out_pixels(), g.patch());
    let (in_per, out_per) = (g.in_per_sample(), g.out_per_sample());
    let needs_table = pass.col2im.is_some() || matches!(pass.weight, Some(WeightGrad::Im2col));
    let table = needs_table.then(|| Im2col::new(g, split.tile_width));
    let bounds = tile_bounds(pixels, split.tile_width);
    let widest = bounds.windows(2).map(|b| b[1] - b[0]).max().unwrap_or(0);
    // Scratch of the weight algorithm: a padded sample, a spread gradient, a column tile
    // (which col2im also takes).
    let (padded_len, spread_len, weight_cols) = match pass.weight {
        Some(WeightGrad::RowsInPlace(_, rows)) => (rows.padded_len(), rows.spread_len(), false),
        Some(WeightGrad::Implicit(_, p)) => (p.padded_len(), p.spread_len(), false),
        Some(WeightGrad::Rows(_, rows)) => (rows.padded_len(), 0, true),
        Some(WeightGrad::Im2col) => (0, 0, true),
        Some(WeightGrad::Winograd(..)) | None => (0, 0, false),
    };
    let cols_len = if weight_cols || pass.col2im.is_some() {
        patch * widest
    } else {
        0
    };
    let run_chunk = |ci: usize, mut gx_chunk: Option<&mut [T]>| -> Result<(Vec<T>, Vec<T>)> {
        let n0 = ci * split.chunk;
        let count = split.chunk.min(g.batch - n0);
        let weight_len = if pass.weight.is_some() {
            o_n * patch
        } else {
            0
        };
        let mut gw = memory::zeroed::<T>(OP, weight_len)?;
        let mut gb = memory::zeroed::<T>(OP, if pass.bias { o_n } else { 0 })?;
        let mut padded = Scratch::<T>::new(OP, padded_len)?;
        let mut spread = Scratch::<T>::new(OP, spread_len)?;
        let mut cols = Scratch::<T>::new(OP, cols_len)?;
        for s in 0..count {
            let xn = &x[(n0 + s) * in_per..][..in_per];
            let gn = &gy[(n0 + s) * out_per..][..out_per];
            if pass.bias {
                for (acc, plane) in gb.iter_mut().zip(gn.chunks(pixels)) {
                    *acc += plane_sum(plane);
                }
            }
            let scratch = SampleScratch {
                padded: &mut padded,
                spread: &mut spread,
                cols: &mut cols,
            };
            weight_sample(
                pass.weight,
                table.as_ref(),
                g,
                &bounds,
                (xn, gn),
                scratch,
                &mut gw,
                split.parallel_gemm,
            );
            if let (Some(kernels), Some(table), Some(gx)) =
                (pass.col2im, &table, gx_chunk.as_deref_mut())
            {
                let gx = &mut gx[s * in_per..(s + 1) * in_per];
                table.input_sample(kernels, g, w, gn, &mut cols.buf, gx, split.parallel_gemm);
            }
        }
        Ok((gw, gb))
    };
    let chunks = g.batch.div_ceil(split.chunk);
    let gx_chunks: Vec<Option<&mut [T]>> = match grad_x {
        Some(gx) if in_per > 0 => gx.chunks_mut(split.chunk * in_per).map(Some).collect(),
        _ => (0..chunks).map(|_| None).collect(),
    };
    // At one thread the calling thread does the work: a parallel iterator would hand it to the
    // pool and wait.
    if rayon::current_num_threads() > 1 && chunks > 1 {
        gx_chunks
            .into_par_iter()
            .enumerate()
            .map(|(ci, gx)| run_chunk(ci, gx))
            .collect()
    } else {
        gx_chunks
            .into_iter()
            .enumerate()
            .map(|(ci, gx)| run_chunk(ci, gx))
            .collect()
    }
}

/// `W'[c, o, a, b] = W[o, c, kh−1−a, kw−1−b]`: the weights of [`Geometry::transposed`].
pub(crate) fn flipped_weights<T: FloatElement>(w: &[T], g: &Geometry) -> Result<Vec<T>> {
    let (kh, kw) = g.kernel;
    let (c_n, o_n) = (g.in_channels, g.out_channels);
    let mut out = memory::uninit(OP, w.len())?;
    let mut at = 0;
    for c in 0..c_n {
        for o in 0..o_n {
            for a in 0..kh {
                for b in 0..kw {
                    out[at] = w[((o * c_n + c) * kh + kh - 1 - a) * kw + kw - 1 - b];
                    at += 1;
                }
            }
        }
    }
    Ok(out)
}

/// The sum of `values` over 16 independent partial sums: a single running sum would wait
/// for each addition to finish before the next (four cycles an element), and would not
/// vectorise.
fn plane_sum<T: FloatElement>(values: &[T]) -> T {
    let mut lanes = [T::ZERO; 16];
    let chunks = values.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &v)| *l += v);
    }
    tail.iter().zip(&mut lanes).for_each(|(&v, l)| *l += v);
    lanes.iter().fold(T::ZERO, |a, &l| a + l)
}

/// The elementwise sum of per-thread partial results, in order.
fn sum_vectors<'a, T: FloatElement>(
    parts: impl Iterator<Item = &'a Vec<T>>,
    len: usize,
) -> Result<Vec<T>> {
    let mut total = memory::zeroed(OP, len)?;
    for part in parts {
        total.iter_mut().zip(part).for_each(|(t, &v)| *t += v);
    }
    Ok(total)
}
