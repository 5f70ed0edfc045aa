//! The three passes of a convolution in cuDNN — forward, backward-data (the input gradient) and
//! backward-filter (the weight gradient) — behind one trait, so that choosing an algorithm and
//! running it is written once.
//!
//! **Choosing** ([`select`]) runs once per geometry and pass. The pass gets its own convolution
//! descriptor whose math type says what the TF32 setting allows: `CUDNN_FMA_MATH` for f32 with
//! TF32 off (no tensor cores), `CUDNN_DEFAULT_MATH` otherwise (TF32 permitted on Ampere and
//! later, exact FP64 tensor cores for f64). cuDNN then ranks algorithms, by running them
//! ([`CudnnAlgorithmSearch::Measured`], `cudnnFind…AlgorithmEx` with a workspace from tandem's
//! allocator) or by its heuristics ([`CudnnAlgorithmSearch::Heuristic`], `cudnnGet…_v7`). The
//! first result that succeeded, whose math type the setting allows (never the fp16
//! down-conversion mode) and whose workspace stays under the limit wins, and the descriptor
//! takes its math type: cuDNN picks the kernel from the algorithm *and* the descriptor's math
//! type, so running with another would not run what was measured.
//!
//! cuDNN reports each result's algorithm, status and math type as C enums. They are read here as
//! plain integers (`RawPerf`, laid out like `cudnnConvolution*AlgoPerf_t`), so that a value a
//! newer cuDNN adds can never become an invalid Rust enum; unknown values are skipped.

use std::ffi::{c_int, c_void};

use cudarc::cudnn::result::{self as cudnn, CudnnResult};
use cudarc::cudnn::sys;
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::cuda::{CudaDevice, DeviceBuffer};
use tandem_core::{DType, Error, Result};

use super::choice::{is_not_supported, Ran};
use super::descriptors::{Algorithm, ConvDesc, Descriptors, PassChoice, Plan};
use crate::conv2d::cuda::CudnnAlgorithmSearch;
use crate::conv2d::Geometry;

/// A workspace larger than this is never used, so that one layer's trial runs cannot take the
/// memory the model needs (a quarter of it at most, on small devices).
const WORKSPACE_LIMIT: usize = 2 << 30;

/// The workspace limit on `dev`.
pub(super) fn workspace_limit(dev: &CudaDevice) -> usize {
    WORKSPACE_LIMIT.min(dev.total_memory() / 4)
}

/// One entry of cuDNN's ranking, with its enums as integers: the layout of
/// `cudnnConvolutionFwdAlgoPerf_t`, `…BwdDataAlgoPerf_t` and `…BwdFilterAlgoPerf_t` alike.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RawPerf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [c_int; 3],
}

const _: () = {
    assert!(
        std::mem::size_of::<RawPerf>() == std::mem::size_of::<sys::cudnnConvolutionFwdAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<RawPerf>()
            == std::mem::size_of::<sys::cudnnConvolutionBwdDataAlgoPerf_t>()
    );
    assert!(
        std::mem::size_of::<RawPerf>()
            == std::mem::size_of::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>()
    );
};

/// The buffers of one pass: two inputs and the output, as device addresses of element 0.
/// Forward: `(x, w) → y`; backward-data: `(w, dy) → dx`; backward-filter: `(x, dy) → dw`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Operands {
    pub a: u64,
    pub b: u64,
    pub out: u64,
}

fn input(address: u64) -> *const c_void {
    address as *const c_void
}

fn output(address: u64) -> *mut c_void {
    address as *mut c_void
}

/// One pass of a convolution in cuDNN.
pub(super) trait Pass {
    /// cuDNN's algorithm enum for this pass.
    type Algo: Copy + std::fmt::Debug + PartialEq;
    /// The pass in messages.
    const NAME: &'static str;
    /// How many algorithms cuDNN has for this pass (the size of a full ranking).
    const COUNT: u32;

    /// The algorithm numbered `v`, if it is one this build knows.
    fn algo(v: u32) -> Option<Self::Algo>;

    /// The plan's descriptors, and its choice for this pass to read and fill in.
    fn split(plan: &mut Plan) -> (&Descriptors, &mut PassChoice<Self::Algo>);

    /// The workspace `algo` needs.
    ///
    /// # Safety
    /// `handle`, the plan's descriptors and `conv` are live.
    unsafe fn workspace(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
    ) -> CudnnResult<usize>;

    /// Runs every algorithm on `ops` and ranks them by time into `results`.
    ///
    /// # Safety
    /// As for [`Pass::workspace`]; `ops` are live device buffers of the plan's shapes (the
    /// output is overwritten), `workspace` holds `bytes` bytes (or is 0 with `bytes` 0).
    #[allow(clippy::too_many_arguments)] // cuDNN's own call takes thirteen
    unsafe fn find(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        ops: Operands,
        results: &mut [RawPerf],
        returned: &mut c_int,
        workspace: u64,
        bytes: usize,
    ) -> CudnnResult<()>;

    /// cuDNN's heuristic ranking into `results`.
    ///
    /// # Safety
    /// As for [`Pass::workspace`].
    unsafe fn heuristic(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        results: &mut [RawPerf],
        returned: &mut c_int,
    ) -> CudnnResult<()>;

    /// Runs the pass: `out = op(a, b)`, with `one` and `zero` the scaling factors in the
    /// compute type.
    ///
    /// # Safety
    /// As for [`Pass::find`]; `one` and `zero` point at values of the compute type.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
        ops: Operands,
        workspace: u64,
        bytes: usize,
        one: *const c_void,
        zero: *const c_void,
    ) -> CudnnResult<()>;
}

/// The forward pass: `y = conv(x, w)`.
pub(super) struct Forward;

impl Pass for Forward {
    type Algo = sys::cudnnConvolutionFwdAlgo_t;
    const NAME: &'static str = "forward";
    const COUNT: u32 = 8;

    fn algo(v: u32) -> Option<Self::Algo> {
        use sys::cudnnConvolutionFwdAlgo_t::*;
        Some(match v {
            0 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
            1 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
            2 => CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
            3 => CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
            4 => CUDNN_CONVOLUTION_FWD_ALGO_FFT,
            5 => CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
            6 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
            7 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
            _ => return None,
        })
    }

    fn split(plan: &mut Plan) -> (&Descriptors, &mut PassChoice<Self::Algo>) {
        (&plan.descriptors, &mut plan.forward)
    }

    unsafe fn workspace(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
    ) -> CudnnResult<usize> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::get_convolution_forward_workspace_size(
                handle, plan.x.0, plan.w.0, conv.0, plan.y.0, algo,
            )
        }
    }

    unsafe fn find(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        ops: Operands,
        results: &mut [RawPerf],
        returned: &mut c_int,
        workspace: u64,
        bytes: usize,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            sys::cudnnFindConvolutionForwardAlgorithmEx(
                handle,
                plan.x.0,
                input(ops.a),
                plan.w.0,
                input(ops.b),
                conv.0,
                plan.y.0,
                output(ops.out),
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
                output(workspace),
                bytes,
            )
        }
        .result()
    }

    unsafe fn heuristic(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        results: &mut [RawPerf],
        returned: &mut c_int,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            cudnn::get_convolution_forward_algorithm(
                handle,
                plan.x.0,
                plan.w.0,
                conv.0,
                plan.y.0,
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
            )
        }
    }

    unsafe fn run(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
        ops: Operands,
        workspace: u64,
        bytes: usize,
        one: *const c_void,
        zero: *const c_void,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::convolution_forward(
                handle,
                one,
                plan.x.0,
                input(ops.a),
                plan.w.0,
                input(ops.b),
                conv.0,
                algo,
                output(workspace),
                bytes,
                zero,
                plan.y.0,
                output(ops.out),
            )
        }
    }
}

/// The input gradient: `dx = conv_backward_data(w, dy)`.
pub(super) struct BackwardData;

impl Pass for BackwardData {
    type Algo = sys::cudnnConvolutionBwdDataAlgo_t;
    const NAME: &'static str = "backward-data";
    const COUNT: u32 = 6;

    fn algo(v: u32) -> Option<Self::Algo> {
        use sys::cudnnConvolutionBwdDataAlgo_t::*;
        Some(match v {
            0 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
            1 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
            2 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
            3 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
            4 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
            5 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
            _ => return None,
        })
    }

    fn split(plan: &mut Plan) -> (&Descriptors, &mut PassChoice<Self::Algo>) {
        (&plan.descriptors, &mut plan.data)
    }

    unsafe fn workspace(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
    ) -> CudnnResult<usize> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::get_convolution_backward_data_workspace_size(
                handle, plan.w.0, plan.y.0, conv.0, plan.x.0, algo,
            )
        }
    }

    unsafe fn find(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        ops: Operands,
        results: &mut [RawPerf],
        returned: &mut c_int,
        workspace: u64,
        bytes: usize,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                handle,
                plan.w.0,
                input(ops.a),
                plan.y.0,
                input(ops.b),
                conv.0,
                plan.x.0,
                output(ops.out),
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
                output(workspace),
                bytes,
            )
        }
        .result()
    }

    unsafe fn heuristic(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        results: &mut [RawPerf],
        returned: &mut c_int,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            cudnn::get_convolution_backward_data_algorithm(
                handle,
                plan.w.0,
                plan.y.0,
                conv.0,
                plan.x.0,
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
            )
        }
    }

    unsafe fn run(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
        ops: Operands,
        workspace: u64,
        bytes: usize,
        one: *const c_void,
        zero: *const c_void,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::convolution_backward_data(
                handle,
                one,
                plan.w.0,
                input(ops.a),
                plan.y.0,
                input(ops.b),
                conv.0,
                algo,
                output(workspace),
                bytes,
                zero,
                plan.x.0,
                output(ops.out),
            )
        }
    }
}

/// The weight gradient: `dw = conv_backward_filter(x, dy)`.
pub(super) struct BackwardFilter;

impl Pass for BackwardFilter {
    type Algo = sys::cudnnConvolutionBwdFilterAlgo_t;
    const NAME: &'static str = "backward-filter";
    const COUNT: u32 = 7;

    fn algo(v: u32) -> Option<Self::Algo> {
        use sys::cudnnConvolutionBwdFilterAlgo_t::*;
        Some(match v {
            0 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
            1 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
            2 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
            3 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
            4 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
            5 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
            6 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
            _ => return None,
        })
    }

    fn split(plan: &mut Plan) -> (&Descriptors, &mut PassChoice<Self::Algo>) {
        (&plan.descriptors, &mut plan.filter)
    }

    unsafe fn workspace(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
    ) -> CudnnResult<usize> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::get_convolution_backward_filter_workspace_size(
                handle, plan.x.0, plan.y.0, conv.0, plan.w.0, algo,
            )
        }
    }

    unsafe fn find(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        ops: Operands,
        results: &mut [RawPerf],
        returned: &mut c_int,
        workspace: u64,
        bytes: usize,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                handle,
                plan.x.0,
                input(ops.a),
                plan.y.0,
                input(ops.b),
                conv.0,
                plan.w.0,
                output(ops.out),
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
                output(workspace),
                bytes,
            )
        }
        .result()
    }

    unsafe fn heuristic(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        results: &mut [RawPerf],
        returned: &mut c_int,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller; `results` is laid out like the perf structs.
        unsafe {
            cudnn::get_convolution_backward_filter_algorithm(
                handle,
                plan.x.0,
                plan.y.0,
                conv.0,
                plan.w.0,
                results.len() as c_int,
                returned,
                results.as_mut_ptr().cast(),
            )
        }
    }

    unsafe fn run(
        handle: sys::cudnnHandle_t,
        plan: &Descriptors,
        conv: &ConvDesc,
        algo: Self::Algo,
        ops: Operands,
        workspace: u64,
        bytes: usize,
        one: *const c_void,
        zero: *const c_void,
    ) -> CudnnResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            cudnn::convolution_backward_filter(
                handle,
                one,
                plan.x.0,
                input(ops.a),
                plan.y.0,
                input(ops.b),
                conv.0,
                algo,
                output(workspace),
                bytes,
                zero,
                plan.w.0,
                output(ops.out),
            )
        }
    }
}

/// The math type a pass's descriptor starts with, before cuDNN ranks the algorithms: what the
/// dtype and the TF32 setting allow. f16 and bf16 start with `CUDNN_TENSOR_OP_MATH` (tensor
/// cores, f32 accumulation: the compute type is float).
fn search_math(dtype: DType, tf32: bool) -> sys::cudnnMathType_t {
    match dtype {
        DType::F32 if !tf32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        DType::F16 | DType::BF16 => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        _ => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
    }
}

/// A ranked result's math type, if the dtype and the TF32 setting allow it. Never the fp16
/// down-conversion mode; for f32 without TF32 only FMA math (the default math type permits
/// TF32 on Ampere and later); f16, bf16 and f64 take any of the other three.
fn allowed_math(v: u32, dtype: DType, tf32: bool) -> Option<sys::cudnnMathType_t> {
    use sys::cudnnMathType_t::*;
    let math = match v {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        3 => CUDNN_FMA_MATH,
        _ => return None,
    };
    let ok = dtype != DType::F32 || tf32 || math == CUDNN_FMA_MATH;
    ok.then_some(math)
}

/// Why cuDNN could not choose, for the notice: the call and cuDNN's status.
pub(super) type Declined = String;

/// Chooses the algorithm of pass `P` for `plan` (see the module comment), never `refused` (an
/// algorithm cuDNN just declined to run on these buffers). `Ok(Err(why))` when cuDNN fails or
/// has no acceptable algorithm, so the caller runs the pass by im2col; `Err` for tandem's own
/// failures (binding the device, allocating), which propagate.
#[allow(clippy::too_many_arguments)]
pub(super) fn select<P: Pass>(
    dev: &std::sync::Arc<CudaDevice>,
    handle: sys::cudnnHandle_t,
    plan: &Descriptors,
    dtype: DType,
    tf32: bool,
    search: CudnnAlgorithmSearch,
    g: &Geometry,
    ops: Operands,
    refused: Option<P::Algo>,
) -> Result<std::result::Result<Algorithm<P::Algo>, Declined>> {
    const OP: &str = "conv2d (cuDNN algorithm search)";
    let declined = |call: &str, e: cudnn::CudnnError| format!("{call}: {:?}", e.0);
    let conv = match ConvDesc::new(g, dtype, search_math(dtype, tf32)) {
        Ok(conv) => conv,
        Err(e) => return Ok(Err(declined("convolution descriptor", e))),
    };
    let limit = workspace_limit(dev);
    let mut results = vec![RawPerf::default(); P::COUNT as usize];
    let mut returned: c_int = 0;
    dev.bind(OP)?;
    let ranked = match search {
        CudnnAlgorithmSearch::Heuristic => {
            // SAFETY: live handle and descriptors; `results` holds COUNT entries.
            unsafe { P::heuristic(handle, plan, &conv, &mut results, &mut returned) }
        }
        CudnnAlgorithmSearch::Measured => measured_ranking::<P>(
            dev,
            handle,
            plan,
            &conv,
            ops,
            limit,
            &mut results,
            &mut returned,
        )?,
    };
    if let Err(e) = ranked {
        let call = match search {
            CudnnAlgorithmSearch::Measured => "algorithm search",
            CudnnAlgorithmSearch::Heuristic => "algorithm heuristics",
        };
        return Ok(Err(declined(call, e)));
    }
    let returned = (returned.max(0) as usize).min(results.len());
    // In ranked order, the first algorithm that succeeded with an allowed math type and whose
    // workspace, asked for again with the descriptor set to that math type (the ranking's
    // figure is only an estimate for the heuristics), stays under the limit.
    for r in &results[..returned] {
        let (Some(algo), Some(math)) = (P::algo(r.algo), allowed_math(r.math_type, dtype, tf32))
        else {
            continue;
        };
        if r.status != 0
            || r.memory > limit
            || refused == Some(algo)
            || conv.set_math(math).is_err()
        {
            continue;
        }
        // SAFETY: live handle and descriptors; `algo` came from cuDNN's ranking for them.
        match unsafe { P::workspace(handle, plan, &conv, algo) } {
            Ok(bytes) if bytes <= limit => {
                return Ok(Ok(Algorithm {
                    conv,
                    algo,
                    workspace: bytes.max(r.memory),
                }))
            }
            _ => continue,
        }
    }
    Ok(Err(format!(
        "none of the {returned} ranked algorithms{} ran with the math allowed for {dtype} (TF32 \
         {}) within the workspace limit of {limit} bytes",
        match refused {
            Some(a) => format!(" other than {a:?}, which these buffers do not support,"),
            None => String::new(),
        },
        if tf32 { "allowed" } else { "off" }
    )))
}

/// Ranks pass `P`'s algorithms by running them (cuDNN's Find) with the largest workspace any of
/// them wants within `limit` (none when that cannot be allocated), into `results` and
/// `returned`. The outer `Err` is tandem's own failure (binding, allocating); the inner one
/// cuDNN's.
#[allow(clippy::too_many_arguments)]
fn measured_ranking<P: Pass>(
    dev: &std::sync::Arc<CudaDevice>,
    handle: sys::cudnnHandle_t,
    plan: &Descriptors,
    conv: &ConvDesc,
    ops: Operands,
    limit: usize,
    results: &mut [RawPerf],
    returned: &mut c_int,
) -> Result<CudnnResult<()>> {
    const OP: &str = "conv2d (cuDNN algorithm search)";
    // The largest workspace any algorithm wants, within the limit: the search then
    // tries every algorithm that fits.
    let mut bytes = (0..P::COUNT)
        .filter_map(P::algo)
        // SAFETY: live handle and descriptors.
        .filter_map(|a| unsafe { P::workspace(handle, plan, conv, a) }.ok())
        .filter(|&b| b <= limit)
        .max()
        .unwrap_or(0);
    let workspace = match DeviceBuffer::alloc(OP, dev, bytes, dev.compute_stream()) {
        Ok(w) => w,
        Err(Error::OutOfMemory { .. }) => {
            // Search among the algorithms that need no workspace.
            bytes = 0;
            DeviceBuffer::alloc(OP, dev, 0, dev.compute_stream())?
        }
        Err(e) => return Err(e),
    };
    declare::<P>("Find", dev, ops, &workspace)?;
    dev.bind(OP)?;
    // SAFETY: live handle and descriptors; `ops` are the caller's live buffers of the
    // plan's shapes; the workspace holds `bytes` bytes and outlives the call (its free
    // is ordered after the search's kernels on the compute stream, where cuDNN runs).
    Ok(unsafe {
        P::find(
            handle,
            plan,
            conv,
            ops,
            results,
            returned,
            workspace.ptr(),
            bytes,
        )
    })
}

/// Declares pass `P`'s accesses on the compute stream to the stream sanitizer: the two operands
/// read, the output and the workspace written (tandem's passes run with beta = 0). `search` is
/// `"Find"` for the measured algorithm search (which runs the pass), empty for the pass itself.
fn declare<P: Pass>(
    search: &str,
    dev: &CudaDevice,
    ops: Operands,
    workspace: &DeviceBuffer,
) -> Result<()> {
    if !sanitizer::enabled() {
        return Ok(());
    }
    let pass = match P::NAME {
        "forward" => "Forward",
        "backward-data" => "BackwardData",
        _ => "BackwardFilter",
    };
    let call = format!("cudnn{search}Convolution{pass}");
    sanitizer::access(
        dev.device(),
        dev.compute_stream(),
        &call,
        &[
            (ops.a, Use::Read),
            (ops.b, Use::Read),
            (ops.out, Use::Write),
            (workspace.ptr(), Use::Write),
        ],
    )
}

/// Runs pass `P` with the chosen algorithm on the compute stream (the handle's stream), with a
/// workspace from tandem's allocator. [`Ran::NotSupported`] when cuDNN refuses to run it on
/// these buffers (it then queues nothing, and the caller chooses again or runs im2col).
#[allow(clippy::too_many_arguments)]
pub(super) fn run<P: Pass>(
    dev: &std::sync::Arc<CudaDevice>,
    handle: sys::cudnnHandle_t,
    plan: &Descriptors,
    chosen: &Algorithm<P::Algo>,
    dtype: DType,
    g: &Geometry,
    ops: Operands,
) -> Result<Ran> {
    let Algorithm {
        conv,
        algo,
        workspace: bytes,
    } = chosen;
    let (algo, bytes) = (*algo, *bytes);
    const OP: &str = "conv2d (cuDNN)";
    let workspace = DeviceBuffer::alloc(OP, dev, bytes, dev.compute_stream())?;
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (one, zero): (*const c_void, *const c_void) = match dtype {
        DType::F64 => (
            (&one64 as *const f64).cast(),
            (&zero64 as *const f64).cast(),
        ),
        _ => (
            (&one32 as *const f32).cast(),
            (&zero32 as *const f32).cast(),
        ),
    };
    declare::<P>("", dev, ops, &workspace)?;
    dev.bind(OP)?;
    // SAFETY: live handle, descriptors and chosen algorithm; `ops` are the caller's live
    // buffers of the plan's shapes, kept alive until the compute stream has run the kernels
    // (stream-ordered frees); the workspace holds `bytes` bytes; `one` and `zero` point at
    // values of the type cuDNN reads the scaling factors in (double for f64 data, float for
    // f32, f16 and bf16), which cuDNN reads before returning.
    let ran = unsafe {
        P::run(
            handle,
            plan,
            conv,
            algo,
            ops,
            workspace.ptr(),
            bytes,
            one,
            zero,
        )
    };
    let e = match ran {
        Ok(()) => return Ok(Ran::Done),
        Err(e) if is_not_supported(e.0 as u32) => return Ok(Ran::NotSupported),
        Err(e) => e,
    };
    Err(Error::Cuda {
        op: "conv2d",
        device: dev.device(),
        detail: format!(
            "cuDNN {} (algorithm {algo:?}) failed with {:?} for input [{}, {}, {}, {}], weight \
             [{}, {}, {}, {}], stride {:?}, padding {:?}, dilation {:?}, {dtype}",
            P::NAME,
            e.0,
            g.batch,
            g.in_channels,
            g.in_h,
            g.in_w,
            g.out_channels,
            g.in_channels,
            g.kernel.0,
            g.kernel.1,
            g.stride,
            g.padding,
            g.dilation
        ),
    })
}
