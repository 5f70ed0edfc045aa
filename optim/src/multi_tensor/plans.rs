//! Launch plans for optim's kernels (`kernels/sgd.cu`, `kernels/adam.cu`, `kernels/grads.cu`).
//!
//! Each builder is a pure function from a [`TensorTable`], the device address it was uploaded
//! to and the hyper-parameters, to a [`Launch`]; the CUDA path executes it on a device and the
//! host harness on the CPU. Scalars are converted to the tensors' dtype here exactly as the CPU
//! kernels convert them (`T::from_f64`), and the builders refuse a table in which an entry
//! lacks an address the kernel will dereference.
//!
//! Every kernel has blocks of [`THREADS_PER_BLOCK`] threads, one block per chunk up to
//! [`GRID_STRIDE_MAX_BLOCKS`](tandem_core::cuda::launch::GRID_STRIDE_MAX_BLOCKS) (then blocks
//! loop over chunks).

use tandem_core::cuda::launch::{KernelArg, KernelHeader, KernelSource, Launch, LaunchConfig};
use tandem_core::cuda::runtime_kernels::NormKind;
use tandem_core::{DType, Error as TensorError};

use super::table::{TensorTable, ENTRY_WORDS};
use crate::update_rule::UpdateRule;
use crate::{AdamConfig, Result, SgdConfig};

/// Threads per block of every optim kernel.
pub const THREADS_PER_BLOCK: u32 = 256;

/// Elements per chunk: one block's contiguous run (32 elements per thread). Small enough that
/// a model of a few million parameters still gives every SM several blocks, large enough that
/// the per-chunk search of the table is noise.
pub const CHUNK_ELEMENTS: u64 = 8192;

static MULTI_TENSOR_CUH: KernelHeader = KernelHeader {
    name: "multi_tensor.cuh",
    source: include_str!("../kernels/multi_tensor.cuh"),
};

/// `sgd.cu`, embedded.
pub static SGD_KERNELS: KernelSource = KernelSource {
    name: "sgd",
    source: include_str!("../kernels/sgd.cu"),
    headers: std::slice::from_ref(&MULTI_TENSOR_CUH),
};

/// `adam.cu`, embedded.
pub static ADAM_KERNELS: KernelSource = KernelSource {
    name: "adam",
    source: include_str!("../kernels/adam.cu"),
    headers: std::slice::from_ref(&MULTI_TENSOR_CUH),
};

/// `grads.cu`, embedded.
pub static GRAD_KERNELS: KernelSource = KernelSource {
    name: "grads",
    source: include_str!("../kernels/grads.cu"),
    headers: std::slice::from_ref(&MULTI_TENSOR_CUH),
};

/// The roles of a table entry, as word indices (see `TableEntry`).
const PARAM: (usize, &str) = (0, "parameter");
const GRAD: (usize, &str) = (1, "gradient");
const STATE: [(usize, &str); 3] = [(2, "state 0"), (3, "state 1"), (4, "state 2")];

/// Checks the dtype, the table's address and that every entry has the addresses in `roles`.
fn check(
    op: &'static str,
    table: &TensorTable,
    table_ptr: u64,
    roles: &[(usize, &str)],
) -> Result<()> {
    if !matches!(table.dtype(), DType::F32 | DType::F64) {
        return Err(TensorError::UnsupportedDType {
            op,
            dtype: table.dtype(),
            supported: "f32, f64",
        }
        .into());
    }
    if table_ptr == 0 && !table.is_empty() {
        return Err(TensorError::invalid(op, "null device address for the tensor table").into());
    }
    for (index, entry) in table.words().chunks_exact(ENTRY_WORDS).enumerate() {
        if let Some((_, role)) = roles.iter().find(|(word, _)| entry[*word] == 0) {
            return Err(TensorError::invalid(
                op,
                format!("entry {index} of the tensor table has no {role} address"),
            )
            .into());
        }
    }
    Ok(())
}

/// The launch of `kernel` (suffixed with the dtype) over `table`, after the table arguments.
fn launch(
    op: &'static str,
    source: &'static KernelSource,
    kernel: &str,
    table: &TensorTable,
    table_ptr: u64,
    scalars: Vec<KernelArg>,
) -> Result<Launch> {
    let chunks = usize::try_from(table.chunks())
        .map_err(|_| TensorError::invalid(op, "more chunks than this machine can count"))?;
    let mut args = vec![
        // The kernels only read the table. The tensors its entries point at (parameters,
        // gradients, optimizer state) are read and written through it, out of sight of this
        // declaration.
        KernelArg::In(table_ptr),
        KernelArg::U32(table.tensors()),
        KernelArg::U64(table.chunks()),
        KernelArg::U64(table.chunk_size()),
    ];
    args.extend(scalars);
    Ok(Launch {
        source,
        kernel: format!("{kernel}_{}", table.dtype()),
        config: LaunchConfig::for_rows(op, chunks, THREADS_PER_BLOCK, 0)?,
        args,
    })
}

/// A scalar in the table's dtype, converted as `T::from_f64` converts it.
fn scalar(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F64 => KernelArg::F64(value),
        _ => KernelArg::F32(value as f32),
    }
}

fn flag(on: bool) -> KernelArg {
    KernelArg::I32(on as i32)
}

/// One SGD step (`sgd_step_<dtype>`) over every tensor of `table`: the parameter, its gradient
/// and, with momentum, its buffer in `state[0]`. `first` marks tensors whose momentum buffer is
/// new (it becomes the gradient, undampened). See `Sgd` for the rule.
pub fn sgd_launch(
    table: &TensorTable,
    table_ptr: u64,
    config: &SgdConfig,
    first: bool,
) -> Result<Launch> {
    let op = "SGD";
    config.validate()?;
    let has_momentum = config.momentum != 0.0;
    let roles = if has_momentum {
        vec![PARAM, GRAD, STATE[0]]
    } else {
        vec![PARAM, GRAD]
    };
    check(op, table, table_ptr, &roles)?;
    let c = |v: f64| scalar(table.dtype(), v);
    launch(
        op,
        &SGD_KERNELS,
        "sgd_step",
        table,
        table_ptr,
        vec![
            c(config.lr),
            c(config.momentum),
            c(1.0 - config.dampening),
            c(config.weight_decay),
            flag(config.weight_decay != 0.0),
            flag(has_momentum),
            flag(first),
            flag(config.nesterov),
        ],
    )
}

/// One Adam (`decoupled` false) or AdamW (`decoupled` true) step (`adam_step_<dtype>`) over
/// every tensor of `table`, each taking its `step`-th update (counting from 1): the parameter,
/// its gradient, `exp_avg` in `state[0]`, `exp_avg_sq` in `state[1]` and, with AMSGrad,
/// `max_exp_avg_sq` in `state[2]`. The bias corrections are computed here in f64, as the CPU
/// computes them.
pub fn adam_launch(
    table: &TensorTable,
    table_ptr: u64,
    config: &AdamConfig,
    decoupled: bool,
    step: u64,
) -> Result<Launch> {
    let op = if decoupled { "AdamW" } else { "Adam" };
    config.validate_for(op)?;
    if step == 0 {
        return Err(TensorError::invalid(op, "the step count of an update starts at 1").into());
    }
    let mut roles = vec![PARAM, GRAD, STATE[0], STATE[1]];
    if config.amsgrad {
        roles.push(STATE[2]);
    }
    check(op, table, table_ptr, &roles)?;
    let rule = UpdateRule::new(config, decoupled, step);
    let c = |v: f64| scalar(table.dtype(), v);
    launch(
        op,
        &ADAM_KERNELS,
        "adam_step",
        table,
        table_ptr,
        vec![
            c(1.0 - rule.beta1),
            c(rule.beta2),
            c(1.0 - rule.beta2),
            c(rule.l2),
            c(rule.shrink),
            c(rule.eps),
            c(rule.step_size),
            c(rule.bias_correction2_sqrt),
            flag(rule.decays()),
            flag(rule.shrinks()),
            flag(rule.amsgrad),
        ],
    )
}

/// `kind` and `p` as the kernels take them (`OPTIM_NORM_*` in grads.cu, the numbering of
/// runtime.cu's norm kernels).
fn norm_args(op: &'static str, kind: NormKind) -> Result<[KernelArg; 2]> {
    let (kind, p) = match kind {
        NormKind::SumSquares => (0, 2.0),
        NormKind::SumAbs => (1, 1.0),
        NormKind::MaxAbs => (2, f64::INFINITY),
        NormKind::SumPow(p) if p.is_finite() && p > 0.0 => (3, p),
        NormKind::SumPow(p) => {
            return Err(TensorError::invalid(
                op,
                format!("norm order p must be finite and > 0, got {p}"),
            )
            .into())
        }
    };
    Ok([KernelArg::I32(kind), KernelArg::F64(p)])
}

/// The first pass of clipping's norm (`grad_norm_partial_<dtype>`): one f64 partial per chunk
/// of `table`'s gradients, written to `partials[0..table.chunks())`. Tables of several dtypes
/// write to one array at different offsets; the runtime's `norm_finish_launch` reduces them.
pub fn grad_norm_partial_launch(
    table: &TensorTable,
    table_ptr: u64,
    kind: NormKind,
    partials: u64,
) -> Result<Launch> {
    let op = "clip_grad_norm";
    check(op, table, table_ptr, &[GRAD])?;
    if partials == 0 {
        return Err(TensorError::invalid(op, "null device address for the partial norms").into());
    }
    let [kind, p] = norm_args(op, kind)?;
    launch(
        op,
        &GRAD_KERNELS,
        "grad_norm_partial",
        table,
        table_ptr,
        vec![kind, p, KernelArg::Out(partials)],
    )
}

/// Clipping's last pass (`grad_clip_scale_<dtype>`): reads the reduced value at `reduced`,
/// finishes the norm of kind `kind`, stores it at `norm_out` (unless 0), and when it is finite
/// and `max_norm / (norm + 1e-6) < 1` multiplies every gradient of `table` by that coefficient.
/// No host round trip: the coefficient never leaves the device.
pub fn grad_clip_scale_launch(
    table: &TensorTable,
    table_ptr: u64,
    reduced: u64,
    kind: NormKind,
    max_norm: f64,
    norm_out: u64,
) -> Result<Launch> {
    let op = "clip_grad_norm";
    check(op, table, table_ptr, &[GRAD])?;
    if reduced == 0 {
        return Err(TensorError::invalid(op, "null device address for the reduced norm").into());
    }
    if !max_norm.is_finite() || max_norm < 0.0 {
        return Err(TensorError::invalid(
            op,
            format!("max_norm must be finite and >= 0, got {max_norm}"),
        )
        .into());
    }
    let [kind, p] = norm_args(op, kind)?;
    launch(
        op,
        &GRAD_KERNELS,
        "grad_clip_scale",
        table,
        table_ptr,
        vec![
            KernelArg::In(reduced),
            kind,
            p,
            KernelArg::F64(max_norm),
            KernelArg::Out(norm_out),
        ],
    )
}

/// The gradient scaler's fused unscale and check (`grad_unscale_<dtype>`): every gradient of
/// `table` multiplied by `inv_scale` (converted to the dtype as the CPU converts it), and the
/// i64 at `found_inf` raised to 1 when any gradient element (before the multiplication) is
/// infinite or NaN. The flag is only raised, never cleared: the caller zeroes it first, and
/// tables of several dtypes share one flag.
pub fn grad_unscale_launch(
    table: &TensorTable,
    table_ptr: u64,
    inv_scale: f64,
    found_inf: u64,
) -> Result<Launch> {
    let op = "GradScaler.unscale";
    check(op, table, table_ptr, &[GRAD])?;
    if found_inf == 0 {
        return Err(TensorError::invalid(op, "null device address for the found-inf flag").into());
    }
    if !inv_scale.is_finite() || inv_scale <= 0.0 {
        return Err(TensorError::invalid(
            op,
            format!("the inverse scale must be finite and > 0, got {inv_scale}"),
        )
        .into());
    }
    launch(
        op,
        &GRAD_KERNELS,
        "grad_unscale",
        table,
        table_ptr,
        vec![scalar(table.dtype(), inv_scale), KernelArg::Out(found_inf)],
    )
}

/// `zero_grad` (`grad_zero_<dtype>`): every gradient of `table` set to zero.
pub fn grad_zero_launch(table: &TensorTable, table_ptr: u64) -> Result<Launch> {
    let op = "zero_grad";
    check(op, table, table_ptr, &[GRAD])?;
    launch(op, &GRAD_KERNELS, "grad_zero", table, table_ptr, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::multi_tensor::TableEntry;

    fn table(entries: &[TableEntry]) -> TensorTable {
        TensorTable::new("t", DType::F32, entries, CHUNK_ELEMENTS).unwrap()
    }

    fn full(numel: u64) -> TableEntry {
        TableEntry {
            param: 0x1000,
            grad: 0x2000,
            state: [0x3000, 0x4000, 0x5000],
            numel,
        }
    }

    #[test]
    fn kernels_are_named_by_dtype_and_scalars_converted_like_the_cpu() {
        let t = table(&[full(100)]);
        let cfg = SgdConfig::new(0.1).with_momentum(0.9).with_dampening(0.25);
        let launch = sgd_launch(&t, 0x9000, &cfg, true).unwrap();
        assert_eq!(launch.kernel, "sgd_step_f32");
        assert_eq!(launch.args[4], KernelArg::F32(0.1f64 as f32));
        assert_eq!(launch.args[6], KernelArg::F32(0.75));
        assert_eq!(launch.args[10], KernelArg::I32(1), "first");
        let t64 = TensorTable::new("t", DType::F64, &[full(3)], 4).unwrap();
        let launch = adam_launch(&t64, 0x9000, &AdamConfig::adamw(0.1), true, 1).unwrap();
        assert_eq!(launch.kernel, "adam_step_f64");
        // step_size = lr / (1 - beta1^1).
        assert_eq!(launch.args[10], KernelArg::F64(0.1 / (1.0 - 0.9)));
    }

    #[test]
    fn grids_cover_every_chunk_with_whole_warp_blocks() {
        let t = TensorTable::new("t", DType::F32, &[full(1000), full(1)], 64).unwrap();
        assert_eq!(t.chunks(), 16 + 1);
        let launch = grad_zero_launch(&t, 0x9000).unwrap();
        assert_eq!(launch.config.grid, [17, 1, 1]);
        assert_eq!(launch.config.block, [THREADS_PER_BLOCK, 1, 1]);
        // An empty table still gives a valid launch (one block that finds no chunk).
        let empty = table(&[]);
        assert_eq!(grad_zero_launch(&empty, 0).unwrap().config.grid, [1, 1, 1]);
    }

    #[test]
    fn missing_addresses_and_unsupported_dtypes_are_refused() {
        let no_state = TableEntry {
            state: [0; 3],
            ..full(10)
        };
        let t = table(&[no_state]);
        assert!(sgd_launch(&t, 0x9000, &SgdConfig::new(0.1), false).is_ok());
        let err = sgd_launch(&t, 0x9000, &SgdConfig::new(0.1).with_momentum(0.9), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("SGD") && err.contains("state 0"), "{err}");
        let amsgrad = AdamConfig::new(0.1).with_amsgrad(true);
        let t = table(&[TableEntry {
            state: [0x3000, 0x4000, 0],
            ..full(10)
        }]);
        assert!(adam_launch(&t, 0x9000, &amsgrad, false, 1).is_err());
        assert!(adam_launch(&t, 0x9000, &AdamConfig::new(0.1), false, 1).is_ok());
        assert!(adam_launch(&t, 0x9000, &AdamConfig::new(0.1), false, 0).is_err());
        let half = TensorTable::new("t", DType::F16, &[full(4)], 4).unwrap();
        let err = grad_zero_launch(&half, 0x9000).unwrap_err().to_string();
        assert!(err.contains("f16"), "{err}");
        assert!(grad_zero_launch(&table(&[full(4)]), 0).is_err());
        assert!(grad_norm_partial_launch(&t, 0x9000, NormKind::SumPow(-1.0), 0x8000).is_err());
        assert!(grad_clip_scale_launch(&t, 0x9000, 0x8000, NormKind::MaxAbs, -1.0, 0).is_err());
        assert!(grad_unscale_launch(&t, 0x9000, 0.5, 0).is_err());
        assert!(grad_unscale_launch(&t, 0x9000, f64::INFINITY, 0x8000).is_err());
        let launch = grad_unscale_launch(&t, 0x9000, 2f64.powi(-16), 0x8000).unwrap();
        assert_eq!(launch.kernel, "grad_unscale_f32");
        assert_eq!(launch.args[4], KernelArg::F32(2f32.powi(-16)));
        assert_eq!(launch.args[5], KernelArg::Out(0x8000));
    }
}
