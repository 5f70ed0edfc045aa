//! The im2col + cuBLAS engine of conv2d on CUDA: what runs where cuDNN does not.
//!
//! With `K = C·kh·kw` rows and `P = OH·OW` output pixels per sample, and the batch taken in
//! chunks whose column matrices fit [`COLUMN_BUDGET`] bytes (usually the whole batch):
//!
//! - forward: im2col of the chunk, one `K×P` matrix per sample, then one strided batched GEMM
//!   `y[n] = W·cols[n]` (`W` shared across the batch, stride 0);
//! - input gradient: one strided batched GEMM `cols[n] = Wᵀ·dy[n]`, then col2im (a gather, one
//!   thread per input element);
//! - weight gradient: im2col of the chunk as one `K×(S·P)` matrix and the chunk's output
//!   gradient as one `O×(S·P)` matrix (a strided copy, skipped when it is already laid out so),
//!   then a single GEMM `dW (+)= dy·colsᵀ` whose inner dimension runs over every sample and
//!   pixel of the chunk — one large product instead of one per sample.
//!
//! cuBLAS is column-major and tandem's matrices are row-major: a row-major `R×C` matrix is the
//! column-major `C×R` one, so each product is issued transposed (`Cᵀ = Bᵀ·Aᵀ`). TF32 follows the
//! convolution setting ([`allow_tf32_conv`](tandem_core::cuda::blas::allow_tf32_conv)), as with
//! cuDNN.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use tandem_core::cuda::blas::with_blas;
use tandem_core::cuda::launch::index_u32;
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::cuda::{launch_on_compute, CudaDevice, DeviceBuffer};
use tandem_core::{DType, Error, Layout, Result, Shape, Tensor};

use super::launch::{col2im_launch, column_len, im2col_launch, ColumnLayout};
use super::tf32;
use crate::conv2d::Geometry;
use crate::device_address::first_element as address;

/// The op named in this engine's errors.
const OP: &str = "conv2d (im2col)";

/// Bytes of column matrices per chunk of samples: large enough that most layers take the
/// whole batch in one chunk, small enough to be a modest share of device memory.
const COLUMN_BUDGET: usize = 256 << 20;

/// Samples per chunk for `g` in `dtype` (at least 1).
fn chunk_samples(g: &Geometry, dtype: DType) -> usize {
    let per_sample = g.patch() * g.out_pixels() * dtype.size_in_bytes();
    (COLUMN_BUDGET / per_sample.max(1)).clamp(1, g.batch.max(1))
}

/// A device buffer for the column matrices of `samples` samples.
fn columns(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    samples: usize,
) -> Result<DeviceBuffer> {
    let bytes = column_len(g, samples)
        .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
        .ok_or_else(|| Error::OutOfMemory {
            op: OP,
            device: dev.device(),
            bytes: usize::MAX,
        })?;
    DeviceBuffer::alloc(OP, dev, bytes, dev.compute_stream())
}

/// `address + elements · size` as a device address.
fn at(address: u64, elements: usize, dtype: DType) -> u64 {
    address + (elements * dtype.size_in_bytes()) as u64
}

/// One strided batched GEMM in cuBLAS's column-major terms: `C[i] = op(A[i])·op(B[i]) +
/// beta·C[i]` for `i < batch`, `op(A)` being `m×k` and `op(B)` `k×n`.
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    a: u64,
    lda: usize,
    stride_a: usize,
    b: u64,
    ldb: usize,
    stride_b: usize,
    c: u64,
    ldc: usize,
    stride_c: usize,
    batch: usize,
    beta: f64,
}

/// Runs `p` on the compute stream, in f32 (TF32 where allowed) or f64.
fn gemm(dev: &CudaDevice, dtype: DType, p: &Gemm) -> Result<()> {
    let int = |what: &str, v: usize| -> Result<c_int> {
        index_u32(OP, &format!("GEMM {what}"), v).map(|v| v as c_int)
    };
    let (m, n, k) = (int("m", p.m)?, int("n", p.n)?, int("k", p.k)?);
    let (lda, ldb, ldc) = (int("lda", p.lda)?, int("ldb", p.ldb)?, int("ldc", p.ldc)?);
    let batch = int("batch", p.batch)?;
    let (sa, sb, sc) = (p.stride_a as i64, p.stride_b as i64, p.stride_c as i64);
    let op = |t: bool| match t {
        true => cublas_sys::cublasOperation_t::CUBLAS_OP_T,
        false => cublas_sys::cublasOperation_t::CUBLAS_OP_N,
    };
    let (ta, tb) = (op(p.trans_a), op(p.trans_b));
    let call = match dtype {
        DType::F64 => "cublasDgemmStridedBatched",
        _ => "cublasSgemmStridedBatched",
    };
    // A and B are read; C is written (read too when beta is not 0, which a write's check
    // covers).
    sanitizer::access(
        dev.device(),
        dev.compute_stream(),
        call,
        &[(p.a, Use::Read), (p.b, Use::Read), (p.c, Use::Write)],
    )?;
    with_blas(OP, dev, dev.compute_stream(), tf32(dtype), |handle| {
        // SAFETY: the handle is bound to the compute stream; A, B and C are live device
        // buffers (the caller's tensors and column buffers, freed in stream order after this
        // product) holding the `batch` matrices their strides and leading dimensions describe;
        // alpha and beta are host values read before the call returns.
        unsafe {
            match dtype {
                DType::F64 => cublas::dgemm_strided_batched(
                    handle,
                    ta,
                    tb,
                    m,
                    n,
                    k,
                    &1.0f64,
                    p.a as *const f64,
                    lda,
                    sa,
                    p.b as *const f64,
                    ldb,
                    sb,
                    &p.beta,
                    p.c as *mut f64,
                    ldc,
                    sc,
                    batch,
                ),
                _ => cublas::sgemm_strided_batched(
                    handle,
                    ta,
                    tb,
                    m,
                    n,
                    k,
                    &1.0f32,
                    p.a as *const f32,
                    lda,
                    sa,
                    p.b as *const f32,
                    ldb,
                    sb,
                    &(p.beta as f32),
                    p.c as *mut f32,
                    ldc,
                    sc,
                    batch,
                ),
            }
        }
    })
}

/// The chunks of the batch: `(first sample, samples)`.
fn chunks(batch: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..batch)
        .step_by(chunk)
        .map(move |n0| (n0, chunk.min(batch - n0)))
}

/// `y = conv(x, w)` for contiguous buffers of `g`'s shapes (no empty dimension).
pub(super) fn forward(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    x: u64,
    w: u64,
    y: u64,
) -> Result<()> {
    let (k, p, o) = (g.patch(), g.out_pixels(), g.out_channels);
    let chunk = chunk_samples(g, dtype);
    let cols = columns(dev, g, dtype, chunk)?;
    for (n0, len) in chunks(g.batch, chunk) {
        let xs = at(x, n0 * g.in_per_sample(), dtype);
        let fill = im2col_launch(dtype, g, xs, cols.ptr(), len, ColumnLayout::PerSample)?;
        launch_on_compute(dev, &fill, len * k * p)?;
        // y[n] (O×P, row-major) = W (O×K) · cols[n] (K×P): column-major P×O = cols[n]ᵀ·Wᵀ.
        gemm(
            dev,
            dtype,
            &Gemm {
                trans_a: false,
                trans_b: false,
                m: p,
                n: o,
                k,
                a: cols.ptr(),
                lda: p,
                stride_a: k * p,
                b: w,
                ldb: k,
                stride_b: 0,
                c: at(y, n0 * o * p, dtype),
                ldc: p,
                stride_c: o * p,
                batch: len,
                beta: 0.0,
            },
        )?;
    }
    Ok(())
}

/// The input gradient `dx` (contiguous, written entirely) from the weights `w` and the output
/// gradient `dy`.
pub(super) fn input_grad(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    w: u64,
    dy: u64,
    dx: u64,
) -> Result<()> {
    let (k, p, o) = (g.patch(), g.out_pixels(), g.out_channels);
    let chunk = chunk_samples(g, dtype);
    let cols = columns(dev, g, dtype, chunk)?;
    for (n0, len) in chunks(g.batch, chunk) {
        // cols[n] (K×P) = Wᵀ (K×O) · dy[n] (O×P): column-major P×K = dy[n]ᵀ·W.
        gemm(
            dev,
            dtype,
            &Gemm {
                trans_a: false,
                trans_b: true,
                m: p,
                n: k,
                k: o,
                a: at(dy, n0 * o * p, dtype),
                lda: p,
                stride_a: o * p,
                b: w,
                ldb: k,
                stride_b: 0,
                c: cols.ptr(),
                ldc: p,
                stride_c: k * p,
                batch: len,
                beta: 0.0,
            },
        )?;
        let dxs = at(dx, n0 * g.in_per_sample(), dtype);
        let scatter = col2im_launch(dtype, g, cols.ptr(), dxs, len)?;
        launch_on_compute(dev, &scatter, len * g.in_per_sample())?;
    }
    Ok(())
}

/// The weight gradient `dw` (contiguous, written entirely) from the input `x` and the
/// contiguous output gradient `dy`.
pub(super) fn weight_grad(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    x: u64,
    dy: &Tensor,
    dw: u64,
) -> Result<()> {
    let (k, p, o) = (g.patch(), g.out_pixels(), g.out_channels);
    let chunk = chunk_samples(g, dtype);
    let cols = columns(dev, g, dtype, chunk)?;
    let (_, dya) = address(OP, dy)?;
    for (i, (n0, len)) in chunks(g.batch, chunk).enumerate() {
        let xs = at(x, n0 * g.in_per_sample(), dtype);
        let fill = im2col_launch(dtype, g, xs, cols.ptr(), len, ColumnLayout::Joined)?;
        launch_on_compute(dev, &fill, len * k * p)?;
        // The chunk's output gradient as one O×(S·P) matrix: [S, O, P] → [O, S, P]. With one
        // sample or one channel the two orders coincide.
        let gathered;
        let dy_rows = if len == 1 || o == 1 {
            at(dya, n0 * o * p, dtype)
        } else {
            let view = dy.view_detached(Layout::from_parts(
                Shape::from_slice(&[o, len, p]),
                Shape::from_slice(&[p, o * p, 1]),
                dy.layout().offset() + n0 * o * p,
            ))?;
            gathered = Tensor::empty(&[o, len, p], dtype, dy.device())?;
            gathered.copy_(&view)?;
            address(OP, &gathered)?.1
        };
        // dW (O×K) (+)= dy (O×SP) · colsᵀ (SP×K): column-major K×O = cols·dyᵀ.
        gemm(
            dev,
            dtype,
            &Gemm {
                trans_a: true,
                trans_b: false,
                m: k,
                n: o,
                k: len * p,
                a: cols.ptr(),
                lda: len * p,
                stride_a: 0,
                b: dy_rows,
                ldb: len * p,
                stride_b: 0,
                c: dw,
                ldc: k,
                stride_c: 0,
                batch: 1,
                beta: if i == 0 { 0.0 } else { 1.0 },
            },
        )?;
    }
    Ok(())
}
