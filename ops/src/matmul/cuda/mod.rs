//! The matrix products on a CUDA device, through cuBLAS on the device's compute stream: the
//! batched product that matmul, its backward and linear are built on, and the row sums that
//! reduce a product over a summed batch (and give linear's bias gradient).
//!
//! `launch.rs` turns the operands' layouts into cuBLAS calls; this file prepares the
//! operands (a dense copy only where cuBLAS cannot read one in place), allocates the output
//! from the stream-ordered allocator and issues the calls. f32 products use TF32 only when
//! `tandem_core::cuda::blas::allow_tf32_matmul()` says so (off by default, as in PyTorch). A
//! bias is copied into every output row by one broadcast copy and the product accumulates onto
//! it (`beta = 1`), as the CPU does. Nothing here waits for the device.
//!
//! f16 and bf16 operands (autocast's products) go through `cublasGemmEx` /
//! `cublasGemmStridedBatchedEx` with `CUBLAS_COMPUTE_32F`: inputs and output in the low dtype,
//! products and sums in f32 (reduced-precision split-K reductions forbidden, see
//! `blas::LOW_PRECISION_MATH`), one rounding to the low dtype at the end; tensor cores are
//! cuBLAS's choice. Their row sums (linear's bias gradient) are one `GemmEx` against a column of
//! ones, with the same f32 accumulation.

mod launch;

use std::sync::Arc;

use super::shape::batch_strides;
use cudarc::cublas::result as cublas;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::sys::{cublasComputeType_t, cudaDataType};
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::cuda::{blas, device_pointer, CudaDevice};
use tandem_core::{checked_numel, DType, Error, Result, Tensor};

use crate::device_address::{first_element, first_element_address};
use launch::{plan, GemmCall, Mat, Operand, Plan};

/// Describes `t` (`[own_batch.., r, c]`) as an operand of a product over the full `batch`,
/// transposed when `trans` (the CPU's `operand`, in elements).
fn describe(t: &Tensor, trans: bool, batch: &[usize]) -> Operand {
    let rank = t.rank();
    let (st, dims) = (t.layout().strides(), t.dims());
    let batch_strides = batch_strides(t, batch);
    let (rows, cols, rs, cs) = if trans {
        (dims[rank - 1], dims[rank - 2], st[rank - 1], st[rank - 2])
    } else {
        (dims[rank - 2], dims[rank - 1], st[rank - 2], st[rank - 1])
    };
    Operand {
        mat: Mat {
            rows,
            cols,
            rs,
            cs,
            offset: t.layout().offset(),
        },
        batch_strides,
    }
}

fn check_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// The batched product `op(x)·op(y)` on CUDA, with the CPU's arguments and result (see
/// `cpu::batched_product`): a dense `[out_batch.., m, n]` tensor.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batched_product(
    op: &'static str,
    x: &Tensor,
    tx: bool,
    y: &Tensor,
    ty: bool,
    batch: &[usize],
    out_batch: &[usize],
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    check_device(op, x, y)?;
    let (xd, yd) = (x.dims(), y.dims());
    let (m, n) = (
        if tx {
            xd[xd.len() - 1]
        } else {
            xd[xd.len() - 2]
        },
        if ty {
            yd[yd.len() - 2]
        } else {
            yd[yd.len() - 1]
        },
    );
    let mut shape = out_batch.to_vec();
    shape.extend([m, n]);
    checked_numel(op, &shape)?;
    let out = Tensor::empty(&shape, x.dtype(), x.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let accumulate = match bias {
        Some(b) => {
            check_device(op, x, b)?;
            // One broadcast copy puts the bias in every row; the product accumulates onto it.
            out.copy_(&b.view_detached(b.layout().expand(op, &shape)?)?)?;
            true
        }
        None => false,
    };
    product_into(op, x, tx, y, ty, batch, out_batch, &out, accumulate)?;
    Ok(out)
}

/// `out = op(x)·op(y)` (`+ out` when `accumulate`), `out` dense `[out_batch.., m, n]`.
#[allow(clippy::too_many_arguments)]
fn product_into(
    op: &'static str,
    x: &Tensor,
    tx: bool,
    y: &Tensor,
    ty: bool,
    batch: &[usize],
    out_batch: &[usize],
    out: &Tensor,
    accumulate: bool,
) -> Result<()> {
    let k = if tx {
        x.dims()[x.rank() - 2]
    } else {
        x.dims()[x.rank() - 1]
    };
    if k == 0 || batch.contains(&0) {
        // Nothing to multiply: the product is zero.
        if !accumulate {
            out.zero_()?;
        }
        return Ok(());
    }
    let (mut x, mut y) = (x.detach(), y.detach());
    // A dense copy always plans without copies, so the second round issues the calls.
    for _ in 0..2 {
        let (xo, yo) = (describe(&x, tx, batch), describe(&y, ty, batch));
        match plan(op, &xo, &yo, batch, out_batch, accumulate)? {
            Plan::Copy(copy_x, copy_y) => {
                if copy_x {
                    x = x.copy_detached()?;
                }
                if copy_y {
                    y = y.copy_detached()?;
                }
            }
            Plan::Gemms { calls, zero_first } => {
                if zero_first && !accumulate {
                    out.zero_()?;
                }
                return gemms(op, &x, &y, out, &calls);
            }
            Plan::SumThroughTemporary => {
                let (m, n) = (xo.mat.rows, yo.mat.cols);
                let mut shape = batch.to_vec();
                shape.extend([m, n]);
                let temp = Tensor::empty(&shape, x.dtype(), x.device())?;
                product_into(op, &x, tx, &y, ty, batch, batch, &temp, false)?;
                let count = batch.iter().product();
                return sum_rows_into(op, &temp, count, m * n, out, accumulate);
            }
        }
    }
    Err(Error::invalid(
        op,
        format!(
            "no cuBLAS plan for {:?}·{:?} after dense copies (strides {:?}, {:?})",
            x.dims(),
            y.dims(),
            x.layout().strides().as_slice(),
            y.layout().strides().as_slice()
        ),
    ))
}

/// Runs `calls` (cuBLAS's `A` from `y`, `B` from `x`, `C` = `out`) on the compute stream.
fn gemms(op: &'static str, x: &Tensor, y: &Tensor, out: &Tensor, calls: &[GemmCall]) -> Result<()> {
    let (dev, xp) = device_pointer(op, x)?;
    let (_, yp) = device_pointer(op, y)?;
    let (_, cp) = device_pointer(op, out)?;
    if sanitizer::enabled() {
        let call = match (out.dtype(), calls.iter().any(|c| c.batch > 1)) {
            (DType::F64, false) => "cublasDgemm",
            (DType::F64, true) => "cublasDgemmStridedBatched",
            (DType::F16 | DType::BF16, false) => "cublasGemmEx",
            (DType::F16 | DType::BF16, true) => "cublasGemmStridedBatchedEx",
            (_, false) => "cublasSgemm",
            (_, true) => "cublasSgemmStridedBatched",
        };
        // A and B are read; C is written (and read too when a call accumulates, beta = 1,
        // which a write's check covers).
        sanitizer::access(
            dev.device(),
            dev.compute_stream(),
            call,
            &[(yp, Use::Read), (xp, Use::Read), (cp, Use::Write)],
        )?;
    }
    let size = out.dtype().size_in_bytes() as u64;
    let at = |base: u64, offset: usize| base + offset as u64 * size;
    let matrices = |c: &GemmCall| (at(yp, c.a_offset), at(xp, c.b_offset), at(cp, c.c_offset));
    let stream = dev.compute_stream();
    match out.dtype() {
        DType::F32 => blas::with_blas(op, &dev, stream, blas::allow_tf32_matmul(), |h| {
            // SAFETY: the plan keeps every matrix of every call inside its tensor's storage
            // (offsets, leading dimensions and batch strides come from the tensors' layouts,
            // checked in launch.rs), and the tensors live until the stream-ordered allocator
            // sees them freed after this work.
            calls
                .iter()
                .try_for_each(|c| unsafe { sgemm(h, c, matrices(c)) })
        }),
        DType::F64 => blas::with_blas(op, &dev, stream, false, |h| {
            // SAFETY: as for f32.
            calls
                .iter()
                .try_for_each(|c| unsafe { dgemm(h, c, matrices(c)) })
        }),
        DType::F16 | DType::BF16 => {
            let ty = low_type(out.dtype());
            blas::with_blas_math(op, &dev, stream, blas::LOW_PRECISION_MATH, |h| {
                // SAFETY: as for f32; every matrix holds elements of `ty`.
                calls
                    .iter()
                    .try_for_each(|c| unsafe { gemm_low(h, c, matrices(c), ty) })
            })
        }
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: SUPPORTED,
        }),
    }
}

/// The dtypes of the CUDA products.
const SUPPORTED: &str = "f32, f64, f16, bf16";

/// cuBLAS's data type of a 16-bit float dtype (f16, else bf16).
fn low_type(dtype: DType) -> cudaDataType {
    if dtype == DType::F16 {
        cudaDataType::CUDA_R_16F
    } else {
        cudaDataType::CUDA_R_16BF
    }
}

/// [`sgemm`] for f16/bf16 matrices of type `ty` (`GemmEx`, `GemmStridedBatchedEx`): f32
/// compute, so alpha and beta are f32.
///
/// # Safety
/// As for [`sgemm`], with every matrix holding elements of `ty`.
unsafe fn gemm_low(
    h: cudarc::cublas::sys::cublasHandle_t,
    c: &GemmCall,
    (a, b, cc): (u64, u64, u64),
    ty: cudaDataType,
) -> std::result::Result<(), cublas::CublasError> {
    let (one, beta) = (1.0f32, if c.accumulate { 1.0f32 } else { 0.0 });
    let (alpha, beta) = (
        (&one as *const f32).cast(),
        (&beta as *const f32).cast::<std::ffi::c_void>(),
    );
    let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let algo = cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
    // SAFETY: the caller's contract; alpha and beta are f32, as CUBLAS_COMPUTE_32F reads them,
    // and live across the call (cuBLAS reads host scalars before returning).
    unsafe {
        if c.batch == 1 {
            cublas::gemm_ex(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                alpha,
                a as *const _,
                ty,
                c.lda,
                b as *const _,
                ty,
                c.ldb,
                beta,
                cc as *mut _,
                ty,
                c.ldc,
                compute,
                algo,
            )
        } else {
            cublas::gemm_strided_batched_ex(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                alpha,
                a as *const _,
                ty,
                c.lda,
                c.stride_a,
                b as *const _,
                ty,
                c.ldb,
                c.stride_b,
                beta,
                cc as *mut _,
                ty,
                c.ldc,
                c.stride_c,
                c.batch,
                compute,
                algo,
            )
        }
    }
}

/// cuBLAS's operation flag for a transposed operand or not.
fn trans(t: bool) -> cudarc::cublas::sys::cublasOperation_t {
    if t {
        CUBLAS_OP_T
    } else {
        CUBLAS_OP_N
    }
}

/// Enqueues one f32 call (`gemm`, or `gemmStridedBatched` for a batch) on `h`'s stream, with
/// `(a, b, cc)` the device addresses of its matrices; alpha and beta are host scalars (the
/// handle's default pointer mode).
///
/// # Safety
/// Every matrix the call reads or writes (sizes, leading dimensions, batch strides) lies in
/// live device memory of `h`'s device, until the call has run in stream order.
unsafe fn sgemm(
    h: cudarc::cublas::sys::cublasHandle_t,
    c: &GemmCall,
    (a, b, cc): (u64, u64, u64),
) -> std::result::Result<(), cublas::CublasError> {
    let beta = if c.accumulate { 1.0f32 } else { 0.0 };
    // SAFETY: the caller's contract.
    unsafe {
        if c.batch == 1 {
            cublas::sgemm(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                &1.0,
                a as *const f32,
                c.lda,
                b as *const f32,
                c.ldb,
                &beta,
                cc as *mut f32,
                c.ldc,
            )?;
        } else {
            cublas::sgemm_strided_batched(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                &1.0,
                a as *const f32,
                c.lda,
                c.stride_a,
                b as *const f32,
                c.ldb,
                c.stride_b,
                &beta,
                cc as *mut f32,
                c.ldc,
                c.stride_c,
                c.batch,
            )?;
        }
    }
    Ok(())
}

/// [`sgemm`] for f64.
///
/// # Safety
/// As for [`sgemm`].
unsafe fn dgemm(
    h: cudarc::cublas::sys::cublasHandle_t,
    c: &GemmCall,
    (a, b, cc): (u64, u64, u64),
) -> std::result::Result<(), cublas::CublasError> {
    let beta = if c.accumulate { 1.0f64 } else { 0.0 };
    // SAFETY: the caller's contract.
    unsafe {
        if c.batch == 1 {
            cublas::dgemm(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                &1.0,
                a as *const f64,
                c.lda,
                b as *const f64,
                c.ldb,
                &beta,
                cc as *mut f64,
                c.ldc,
            )?;
        } else {
            cublas::dgemm_strided_batched(
                h,
                trans(c.trans_a),
                trans(c.trans_b),
                c.m,
                c.n,
                c.k,
                &1.0,
                a as *const f64,
                c.lda,
                c.stride_a,
                b as *const f64,
                c.ldb,
                c.stride_b,
                &beta,
                cc as *mut f64,
                c.ldc,
                c.stride_c,
                c.batch,
            )?;
        }
    }
    Ok(())
}

fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::invalid(op, format!("{what} {v} exceeds cuBLAS's 32-bit sizes")))
}

/// Checks the operands of [`sum_rows_into`]: one device, a dense `[rows, cols]` input and a
/// dense `[cols]` output.
fn check_row_sums(
    op: &'static str,
    t: &Tensor,
    rows: usize,
    cols: usize,
    out: &Tensor,
) -> Result<()> {
    check_device(op, t, out)?;
    if !t.is_contiguous() || t.numel() != rows * cols || out.numel() != cols || !out.is_contiguous()
    {
        return Err(Error::invalid(
            op,
            format!(
                "row sums need a dense [{rows}, {cols}] input and a dense [{cols}] output, got \
                 {:?} and {:?}",
                t.dims(),
                out.dims()
            ),
        ));
    }
    Ok(())
}

/// `out[j] (+)= Σ_i t[i, j]` over a dense `t` viewed as `[rows, cols]`, into the dense `out`
/// of `cols` elements: one `gemv` with a vector of ones (column-major, `t` is `cols × rows`).
pub(crate) fn sum_rows_into(
    op: &'static str,
    t: &Tensor,
    rows: usize,
    cols: usize,
    out: &Tensor,
    accumulate: bool,
) -> Result<()> {
    check_row_sums(op, t, rows, cols, out)?;
    if cols == 0 {
        return Ok(());
    }
    if rows == 0 {
        if !accumulate {
            out.zero_()?;
        }
        return Ok(());
    }
    let (m, n) = (
        int(op, "a row length", cols)?,
        int(op, "a row count", rows)?,
    );
    let ones = Tensor::full(&[rows], 1.0, t.dtype(), t.device())?;
    let (dev, tp) = first_element(op, t)?;
    let (_, onesp) = device_pointer(op, &ones)?;
    let yp = first_element_address(op, out)?;
    let call = match t.dtype() {
        DType::F64 => "cublasDgemv",
        DType::F16 | DType::BF16 => "cublasGemmEx",
        _ => "cublasSgemv",
    };
    sanitizer::access(
        dev.device(),
        dev.compute_stream(),
        call,
        &[(tp, Use::Read), (onesp, Use::Read), (yp, Use::Write)],
    )?;
    match t.dtype() {
        DType::F32 => blas::with_blas(op, &dev, dev.compute_stream(), false, |h| {
            let beta = if accumulate { 1.0f32 } else { 0.0 };
            // SAFETY: `t` holds cols·rows dense elements (lda = cols), `ones` rows and `out`
            // cols, all on this device and alive until after the call in stream order.
            unsafe {
                cublas::sgemv(
                    h,
                    CUBLAS_OP_N,
                    m,
                    n,
                    &1.0,
                    tp as *const f32,
                    m,
                    onesp as *const f32,
                    1,
                    &beta,
                    yp as *mut f32,
                    1,
                )
            }
        }),
        DType::F64 => blas::with_blas(op, &dev, dev.compute_stream(), false, |h| {
            let beta = if accumulate { 1.0f64 } else { 0.0 };
            // SAFETY: as for f32.
            unsafe {
                cublas::dgemv(
                    h,
                    CUBLAS_OP_N,
                    m,
                    n,
                    &1.0,
                    tp as *const f64,
                    m,
                    onesp as *const f64,
                    1,
                    &beta,
                    yp as *mut f64,
                    1,
                )
            }
        }),
        DType::F16 | DType::BF16 => {
            sum_rows_low(op, &dev, (m, n), (tp, onesp, yp), t.dtype(), accumulate)
        }
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: SUPPORTED,
        }),
    }
}

/// [`sum_rows_into`] for f16/bf16: cuBLAS has no 16-bit `gemv`, so the `[m × n] · [n × 1]`
/// product (`t` column-major with lda = m, a column of `n` ones, `out` of `m`) through GemmEx
/// with f32 accumulation.
fn sum_rows_low(
    op: &'static str,
    dev: &Arc<CudaDevice>,
    (m, n): (i32, i32),
    (tp, onesp, yp): (u64, u64, u64),
    dtype: DType,
    accumulate: bool,
) -> Result<()> {
    let call = GemmCall {
        trans_a: false,
        trans_b: false,
        m,
        n: 1,
        k: n,
        lda: m,
        ldb: n,
        ldc: m,
        a_offset: 0,
        b_offset: 0,
        c_offset: 0,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        batch: 1,
        accumulate,
    };
    let ty = low_type(dtype);
    blas::with_blas_math(
        op,
        dev,
        dev.compute_stream(),
        blas::LOW_PRECISION_MATH,
        |h| {
            // SAFETY: the caller's `t` is [m × n] column-major (lda = m), `ones` an [n × 1] column
            // and `out` [m × 1], all of `dtype`, on this device and alive until after the call in
            // stream order.
            unsafe { gemm_low(h, &call, (tp, onesp, yp), ty) }
        },
    )
}
