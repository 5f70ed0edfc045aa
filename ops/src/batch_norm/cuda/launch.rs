//! Launch plans of batch norm's CUDA kernels (`batch_norm.cu`): pure functions from device
//! addresses, dtypes, dims and scalars to [`Launch`]es, which the CUDA path (`cuda.rs`) runs on
//! the device and the host harness (`cuda-harness/tests/batch_norm.rs`) runs on the CPU.
//!
//! Every builder checks what its kernel relies on: the dtype, non-null addresses where
//! elements are read or written, sizes that fit the kernel's arguments and the grid, and the
//! alignment that vector loads need (it picks 16-byte vectors only when every tensor's first
//! element is 16-byte aligned and a run of `L` elements is a whole number of vectors).
//!
//! The input is `[N, C, L]`, contiguous. Per-channel reductions split each channel's `N·L`
//! elements into [`Split::splits`] ranges of [`Split::chunk`] elements, one block each; the split
//! depends on the dims only, so results are deterministic for a shape.

use tandem_core::cuda::deferred::DeferredSlot;
use tandem_core::cuda::launch::{
    KernelArg, KernelPod, KernelSource, Launch, LaunchConfig, Reach, WARP_SIZE,
};
use tandem_core::{DType, Error, Result};

use crate::batch_norm::shape::Dims;

/// `batch_norm.cu`, embedded.
pub static BATCH_NORM: KernelSource = KernelSource {
    name: "batch_norm",
    source: include_str!("../batch_norm.cu"),
    headers: &[],
};

/// Threads per block of every batch-norm kernel.
pub const THREADS_PER_BLOCK: u32 = 256;

/// Elements a block of a per-channel reduction takes at least (16 per thread): fewer would
/// make the blocks' fixed costs (the block reduction, the partials) dominate.
const MIN_SPLIT_ELEMENTS: usize = 16 * THREADS_PER_BLOCK as usize;

/// Blocks a per-channel reduction aims for: about eight per SM of the largest GPUs, so that
/// a few channels of many elements still fill the device.
const TARGET_BLOCKS: usize = 1024;

/// The most splits of one channel (bounds the partials and the finishing warp's loop).
const MAX_SPLITS: usize = 1024;

/// Bytes of a vector load.
const VECTOR_BYTES: usize = 16;

/// A per-channel vector as the kernels take it (`bn_channel` in `batch_norm.cu`): element `c`
/// at `address + c·stride` elements, f32 or f64; or no vector at all.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelArg {
    address: u64,
    stride: u64,
    is_f64: u32,
    present: u32,
}

// SAFETY: repr(C), all fields integers with no padding (8 + 8 + 4 + 4 bytes); matches
// `bn_channel` in batch_norm.cu. The address is a device address, never dereferenced on the
// host by tandem itself.
unsafe impl KernelPod for ChannelArg {}

impl ChannelArg {
    /// The argument for a kernel that only reads the vector (declared to the stream sanitizer).
    pub fn read(&self) -> KernelArg {
        KernelArg::pod_reaching(self, &[Reach::In(self.address)])
    }

    /// The argument for a kernel that writes the vector (`batch_norm_update_running`'s running
    /// statistics).
    pub fn written(&self) -> KernelArg {
        KernelArg::pod_reaching(self, &[Reach::Out(self.address)])
    }

    /// No vector: the kernel uses its default (1 for a weight, 0 for a bias).
    pub fn absent() -> ChannelArg {
        ChannelArg {
            address: 0,
            stride: 0,
            is_f64: 0,
            present: 0,
        }
    }

    /// The vector whose element 0 is at `address`, `stride` elements apart, of `dtype`
    /// (f32 or f64). `name` and `op` are for errors.
    pub fn new(
        op: &'static str,
        name: &str,
        address: u64,
        stride: usize,
        dtype: DType,
    ) -> Result<ChannelArg> {
        let is_f64 = match dtype {
            DType::F32 => 0,
            DType::F64 => 1,
            other => {
                return Err(Error::invalid(
                    op,
                    format!("{name} is {other}; batch norm's per-channel vectors are f32 or f64"),
                ))
            }
        };
        if address == 0 {
            return Err(Error::invalid(
                op,
                format!("null device pointer for {name}"),
            ));
        }
        Ok(ChannelArg {
            address,
            stride: stride as u64,
            is_f64,
            present: 1,
        })
    }

    /// Whether a vector is given.
    pub fn is_present(&self) -> bool {
        self.present != 0
    }

    /// Whether distinct channels (of `channels`) are distinct elements, so the vector may be
    /// written by one thread per channel.
    fn writable(&self, channels: usize) -> bool {
        channels <= 1 || self.stride != 0
    }
}

/// Division by a fixed divisor as the kernels do it (`bn_divider` in `batch_norm.cu`): a
/// multiply and a shift for dividends and divisors below 2³² (the round-up method of
/// Granlund and Montgomery), a plain division otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divider {
    divisor: u64,
    multiplier: u32,
    shift: u32,
}

// SAFETY: repr(C), integer fields without padding (8 + 4 + 4 bytes); matches `bn_divider`.
unsafe impl KernelPod for Divider {}

impl Divider {
    /// The divider by `divisor` (at least 1).
    pub fn new(op: &'static str, divisor: u64) -> Result<Divider> {
        if divisor == 0 {
            return Err(Error::invalid(op, "internal: a kernel divider of 0"));
        }
        if divisor > u64::from(u32::MAX) {
            // shift 64 tells the kernel to divide.
            return Ok(Divider {
                divisor,
                multiplier: 0,
                shift: 64,
            });
        }
        // shift = ceil(log2 divisor); multiplier = floor(2^32·(2^shift − d)/d) + 1 < 2^32.
        let shift = 64 - (divisor - 1).leading_zeros();
        let d = u128::from(divisor);
        let multiplier = (((1u128 << 32) * ((1u128 << shift) - d)) / d + 1) as u32;
        Ok(Divider {
            divisor,
            multiplier,
            shift,
        })
    }

    /// `n / divisor`, computed as the kernels compute it.
    pub fn divide(&self, n: u64) -> u64 {
        if n >> 32 == 0 && self.shift < 64 {
            let t = (n * u64::from(self.multiplier)) >> 32;
            (t + n) >> self.shift
        } else {
            n / self.divisor
        }
    }
}

/// How a per-channel reduction splits each channel's `n·l` elements over blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Blocks per channel (at least 1; with 1 the reduction kernel finishes the channel
    /// itself, with more a finishing kernel adds the blocks' partial sums).
    pub splits: usize,
    /// Elements per block: a multiple of 4, so a whole number of vectors of either dtype.
    pub chunk: usize,
}

impl Split {
    /// The split tandem uses for `dims`: blocks of at least 4096 elements, about 1024 blocks
    /// in all where the channels are large enough, at most 1024 per channel.
    pub fn for_dims(dims: Dims) -> Split {
        let per_channel = dims.per_channel();
        let by_size = per_channel.div_ceil(MIN_SPLIT_ELEMENTS);
        let by_grid = TARGET_BLOCKS.div_ceil(dims.c.max(1));
        Split::with_splits(dims, by_size.min(by_grid).clamp(1, MAX_SPLITS))
    }

    /// About `splits` blocks per channel (fewer where the chunk rounding leaves some empty; at
    /// least 1).
    pub fn with_splits(dims: Dims, splits: usize) -> Split {
        let per_channel = dims.per_channel();
        let chunk = per_channel
            .div_ceil(splits.max(1))
            .next_multiple_of(4)
            .max(4);
        Split {
            splits: per_channel.div_ceil(chunk).max(1),
            chunk,
        }
    }

    /// f64 values of the partial sums a reduction with this split needs: `2·c·splits` with
    /// more than one split, else none.
    pub fn partials_len(&self, dims: Dims) -> usize {
        if self.splits > 1 {
            2 * dims.c * self.splits
        } else {
            0
        }
    }
}

fn check_dtype(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64",
        }),
    }
}

/// Errors when `address` is null though the kernel reads or writes through it.
/// The count a kernel divides by (`count_host` and `count_at` in `batch_norm.cu`): a value the
/// host knows, or an f64 at a device address that the host has not read — the first element
/// of statistic sums all-reduced across processes, so that SyncBatchNorm never waits for the
/// reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountArg {
    /// The count, known on the host.
    Host(usize),
    /// The device address of the count, an f64.
    Device(u64),
}

impl CountArg {
    /// The kernel's two arguments: the host value (0 when on the device) and the device
    /// location (absent when on the host).
    fn kernel_args(self, op: &'static str) -> Result<[KernelArg; 2]> {
        Ok(match self {
            CountArg::Host(n) => [
                KernelArg::F64(n as f64),
                KernelArg::pod(&ChannelArg::absent()),
            ],
            CountArg::Device(at) => [
                KernelArg::F64(0.0),
                ChannelArg::new(op, "the count", at, 0, DType::F64)?.read(),
            ],
        })
    }
}

/// The deferred-error record a kernel reports a bad value in (see
/// [`tandem_core::cuda::deferred`]): its three kernel arguments.
fn deferred_args(slot: DeferredSlot) -> [KernelArg; 3] {
    [
        KernelArg::Out(slot.claim),
        KernelArg::Out(slot.record),
        KernelArg::U32(slot.code),
    ]
}

fn check_address(op: &'static str, name: &str, address: u64, used: bool) -> Result<()> {
    if used && address == 0 {
        return Err(Error::invalid(
            op,
            format!("null device pointer for {name}"),
        ));
    }
    Ok(())
}

/// The vector width (in elements) for tensors of `dtype` with runs of `l` elements whose first
/// elements are at `addresses`: 16 bytes when all are 16-byte aligned and `l` is a whole
/// number of vectors, else 1.
pub fn vector_width(dtype: DType, l: usize, addresses: &[u64]) -> usize {
    let width = VECTOR_BYTES / dtype.size_in_bytes();
    let aligned = addresses.iter().all(|a| a % VECTOR_BYTES as u64 == 0);
    if l.is_multiple_of(width) && aligned {
        width
    } else {
        1
    }
}

/// The run length in vectors as a divider (1 for an empty input, which the kernels never
/// divide).
fn run_divider(op: &'static str, dims: Dims, vector: usize) -> Result<Divider> {
    Divider::new(op, (dims.l / vector).max(1) as u64)
}

/// The splits as the kernels take them (32-bit), checked against the grid.
fn split_args(op: &'static str, dims: Dims, split: Split) -> Result<(u32, LaunchConfig)> {
    let valid = split.splits >= 1
        && split.chunk >= 4
        && split.chunk.is_multiple_of(4)
        && split.splits <= MAX_SPLITS
        && split
            .chunk
            .checked_mul(split.splits)
            .is_some_and(|covered| {
                covered >= dims.per_channel() && covered - split.chunk < dims.per_channel().max(1)
            });
    if !valid {
        return Err(Error::invalid(
            op,
            format!(
                "internal: split {split:?} does not cover {} elements per channel",
                dims.per_channel()
            ),
        ));
    }
    let blocks = dims.c.checked_mul(split.splits).ok_or_else(|| {
        Error::invalid(
            op,
            format!("{} channels × {} splits overflow", dims.c, split.splits),
        )
    })?;
    let config = LaunchConfig::for_rows(op, blocks, THREADS_PER_BLOCK, 0)?;
    Ok((split.splits as u32, config))
}

/// One warp per channel: the finishing kernels' grid.
fn per_channel_warps(op: &'static str, channels: usize) -> Result<LaunchConfig> {
    let warps_per_block = (THREADS_PER_BLOCK / WARP_SIZE) as usize;
    LaunchConfig::for_rows(op, channels.div_ceil(warps_per_block), THREADS_PER_BLOCK, 0)
}

fn launch(kernel: String, config: LaunchConfig, args: Vec<KernelArg>) -> Launch {
    Launch {
        source: &BATCH_NORM,
        kernel,
        config,
        args,
    }
}

/// The per-channel mean and biased variance of the contiguous `[n, c, l]` input at `x` into
/// the f64 `[c]` vectors at `mean` and `var`: one reduction launch, and a finishing launch when
/// `split` has more than one split (then `partials` holds [`Split::partials_len`] f64). Run
/// them in order; they write every channel, also when the input has no elements (NaN, as on the
/// CPU).
#[allow(clippy::too_many_arguments)]
pub fn statistics_launches(
    op: &'static str,
    x: u64,
    dtype: DType,
    dims: Dims,
    split: Split,
    partials: u64,
    mean: u64,
    var: u64,
) -> Result<Vec<Launch>> {
    check_dtype(op, dtype)?;
    let reads = dims.per_channel() > 0 && dims.c > 0;
    check_address(op, "the input", x, reads)?;
    check_address(op, "the mean", mean, dims.c > 0)?;
    check_address(op, "the variance", var, dims.c > 0)?;
    check_address(op, "the partial sums", partials, split.splits > 1)?;
    let (splits, config) = split_args(op, dims, split)?;
    let vector = vector_width(dtype, dims.l, &[x]);
    let vectors = (dims.per_channel() / vector) as u64;
    let mut launches = vec![launch(
        format!("batch_norm_statistics_{dtype}"),
        config,
        vec![
            KernelArg::In(x),
            KernelArg::U64(dims.c as u64),
            KernelArg::U64(vectors),
            KernelArg::pod(&run_divider(op, dims, vector)?),
            KernelArg::I32(vector as i32),
            KernelArg::U32(splits),
            KernelArg::U64((split.chunk / vector) as u64),
            KernelArg::Out(partials),
            KernelArg::Out(mean),
            KernelArg::Out(var),
        ],
    )];
    if split.splits > 1 {
        launches.push(launch(
            format!("batch_norm_statistics_finish_{dtype}"),
            per_channel_warps(op, dims.c)?,
            vec![
                KernelArg::In(x),
                KernelArg::U64(dims.c as u64),
                KernelArg::U64(vectors),
                KernelArg::U64(dims.l as u64),
                KernelArg::U32(splits),
                KernelArg::In(partials),
                KernelArg::F64(dims.per_channel() as f64),
                KernelArg::Out(mean),
                KernelArg::Out(var),
            ],
        ));
    }
    Ok(launches)
}

/// Per-channel grid of the small kernels: one thread per channel.
fn per_channel(op: &'static str, channels: usize) -> Result<LaunchConfig> {
    LaunchConfig::for_elements(op, channels, THREADS_PER_BLOCK)
}

/// [`Statistics::to_sums`](crate::batch_norm::phases::Statistics::to_sums): the `[1 + 2c]` f64 sums at
/// `sums` from the mean and variance vectors and the count. Covers `c + 1` items (run it
/// even for no channels: it writes the count).
pub fn to_sums_launch(
    op: &'static str,
    mean: ChannelArg,
    var: ChannelArg,
    channels: usize,
    count: CountArg,
    sums: u64,
) -> Result<Launch> {
    let [count_host, count_at] = count.kernel_args(op)?;
    check_address(op, "the sums", sums, true)?;
    if channels > 0 && !(mean.is_present() && var.is_present()) {
        return Err(Error::invalid(op, "the mean and variance are needed"));
    }
    Ok(launch(
        "batch_norm_to_sums".to_string(),
        per_channel(op, channels + 1)?,
        vec![
            mean.read(),
            var.read(),
            KernelArg::U64(channels as u64),
            count_host,
            count_at,
            KernelArg::Out(sums),
        ],
    ))
}

/// [`Statistics::from_sums`](crate::batch_norm::phases::Statistics::from_sums): the f64 `[c]` mean and
/// biased variance at `mean`, `var` from the `[1 + 2c]` f64 sums, whose count (element 0) is
/// checked on the device: one that is not a whole number above 1 is recorded in `check`'s
/// deferred-error record (position 0, value the count's f64 bits, bound 2). Covers `c + 1`
/// items (run it even for no channels: it checks the count).
pub fn from_sums_launch(
    op: &'static str,
    sums: ChannelArg,
    channels: usize,
    mean: u64,
    var: u64,
    check: DeferredSlot,
) -> Result<Launch> {
    check_address(op, "the mean", mean, channels > 0)?;
    check_address(op, "the variance", var, channels > 0)?;
    check_address(op, "the deferred-error claim", check.claim, true)?;
    check_address(op, "the deferred-error record", check.record, true)?;
    if !sums.is_present() || sums.is_f64 == 0 {
        return Err(Error::invalid(op, "the sums must be an f64 vector"));
    }
    let [claim, record, code] = deferred_args(check);
    Ok(launch(
        "batch_norm_from_sums".to_string(),
        per_channel(op, channels + 1)?,
        vec![
            sums.read(),
            KernelArg::U64(channels as u64),
            KernelArg::Out(mean),
            KernelArg::Out(var),
            claim,
            record,
            code,
        ],
    ))
}

/// The running-statistics update, in place: `running = (1 − momentum)·running +
/// momentum·factor·stat` with factor 1 for the mean and count/(count − 1) for the variance
/// (computed on the host for a host count, by the kernel with the same formula for a count in
/// device memory), in f64, rounded to each running vector's dtype.
#[allow(clippy::too_many_arguments)]
pub fn update_running_launch(
    op: &'static str,
    running_mean: ChannelArg,
    running_var: ChannelArg,
    mean: ChannelArg,
    var: ChannelArg,
    channels: usize,
    momentum: f64,
    count: CountArg,
) -> Result<Launch> {
    let (factor, count_at) = match count {
        CountArg::Host(n) => (n as f64 / (n as f64 - 1.0), ChannelArg::absent()),
        CountArg::Device(at) => (0.0, ChannelArg::new(op, "the count", at, 0, DType::F64)?),
    };
    for (name, running, stat) in [
        ("running_mean", running_mean, mean),
        ("running_var", running_var, var),
    ] {
        if running.is_present() && !stat.is_present() {
            return Err(Error::invalid(
                op,
                format!("{name} needs its batch statistic"),
            ));
        }
        if running.is_present() && !running.writable(channels) {
            return Err(Error::invalid(
                op,
                format!(
                    "{name} is updated in place but its {channels} channels share one element \
                     (stride 0)"
                ),
            ));
        }
    }
    Ok(launch(
        "batch_norm_update_running".to_string(),
        per_channel(op, channels)?,
        vec![
            running_mean.written(),
            running_var.written(),
            mean.read(),
            var.read(),
            KernelArg::U64(channels as u64),
            KernelArg::F64(momentum),
            KernelArg::F64(factor),
            count_at.read(),
        ],
    ))
}

/// The `[4, c]` f64 normalization table at `table` (rows mean, 1/σ, scale = w/σ,
/// shift = b − mean·scale), from the statistics, the optional affine parameters and `eps`.
#[allow(clippy::too_many_arguments)]
pub fn normalization_launch(
    op: &'static str,
    mean: ChannelArg,
    var: ChannelArg,
    weight: ChannelArg,
    bias: ChannelArg,
    channels: usize,
    eps: f64,
    table: u64,
) -> Result<Launch> {
    check_address(op, "the table", table, channels > 0)?;
    if channels > 0 && !(mean.is_present() && var.is_present()) {
        return Err(Error::invalid(op, "the mean and variance are needed"));
    }
    Ok(launch(
        "batch_norm_normalization".to_string(),
        per_channel(op, channels)?,
        vec![
            mean.read(),
            var.read(),
            weight.read(),
            bias.read(),
            KernelArg::U64(channels as u64),
            KernelArg::F64(eps),
            KernelArg::Out(table),
        ],
    ))
}

/// What [`apply_launch`] fuses onto the normalised output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyEpilogue {
    /// `y = x·scale + shift`.
    Plain,
    /// `y = max(0, x·scale + shift)`.
    Relu,
    /// `y = max(0, x·scale + shift + residual)`, the residual contiguous at this address.
    AddRelu(u64),
}

/// The row and channel dividers of an elementwise pass over vectors.
fn elementwise_dividers(op: &'static str, dims: Dims, vector: usize) -> Result<[KernelArg; 2]> {
    Ok([
        KernelArg::pod(&run_divider(op, dims, vector)?),
        KernelArg::pod(&Divider::new(op, dims.c.max(1) as u64)?),
    ])
}

/// The forward's output pass: `y = x·scale[c] + shift[c]` (the table's rows rounded to the
/// dtype) and the epilogue, over the contiguous `[n, c, l]` input at `x` into `out`.
pub fn apply_launch(
    op: &'static str,
    x: u64,
    epilogue: ApplyEpilogue,
    out: u64,
    dtype: DType,
    dims: Dims,
    table: u64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let any = dims.numel() > 0;
    check_address(op, "the input", x, any)?;
    check_address(op, "the output", out, any)?;
    check_address(op, "the table", table, any)?;
    let (residual, code) = match epilogue {
        ApplyEpilogue::Plain => (0, 0),
        ApplyEpilogue::Relu => (0, 1),
        ApplyEpilogue::AddRelu(r) => {
            check_address(op, "the residual", r, any)?;
            (r, 2)
        }
    };
    let vector = vector_width(dtype, dims.l, &[x, out, residual]);
    let vectors = dims.numel() / vector;
    let [rows, channels] = elementwise_dividers(op, dims, vector)?;
    Ok(launch(
        format!("batch_norm_apply_{dtype}"),
        LaunchConfig::for_elements(op, vectors, THREADS_PER_BLOCK)?,
        vec![
            KernelArg::In(x),
            KernelArg::In(residual),
            KernelArg::Out(out),
            KernelArg::In(table),
            KernelArg::U64(vectors as u64),
            rows,
            channels,
            KernelArg::I32(vector as i32),
            KernelArg::I32(code),
        ],
    ))
}

/// How [`backward_reduce_launches`] masks the output gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceMask {
    /// No mask.
    None,
    /// Where `x·scale + shift > 0` (the forward's ReLU, recomputed).
    Relu,
    /// Where the saved output at `output` is positive; the masked gradient is written to
    /// `masked` (both contiguous like the input).
    Output {
        /// The forward's output.
        output: u64,
        /// Where the masked gradient goes.
        masked: u64,
    },
}

/// The backward's per-channel sums `[Σg', Σg'·(x − mean)]` into the f64 `[2, c]` tensor at
/// `sums`, of the gradient at `grad` masked by `mask`, with the input at `x` and the `[4, c]`
/// table at `table` (all contiguous): one reduction launch and, with more than one split, a
/// finishing launch (then `partials` holds [`Split::partials_len`] f64). They write every
/// channel, also for an empty input (zeros).
#[allow(clippy::too_many_arguments)]
pub fn backward_reduce_launches(
    op: &'static str,
    grad: u64,
    x: u64,
    mask: ReduceMask,
    dtype: DType,
    dims: Dims,
    split: Split,
    table: u64,
    partials: u64,
    sums: u64,
) -> Result<Vec<Launch>> {
    check_dtype(op, dtype)?;
    let reads = dims.numel() > 0;
    check_address(op, "the gradient", grad, reads)?;
    check_address(op, "the input", x, reads)?;
    check_address(op, "the table", table, reads)?;
    check_address(op, "the sums", sums, dims.c > 0)?;
    check_address(op, "the partial sums", partials, split.splits > 1)?;
    let (output, masked, code) = match mask {
        ReduceMask::None => (0, 0, 0),
        ReduceMask::Relu => (0, 0, 1),
        ReduceMask::Output { output, masked } => {
            check_address(op, "the saved output", output, reads)?;
            check_address(op, "the masked gradient", masked, reads)?;
            (output, masked, 2)
        }
    };
    let (splits, config) = split_args(op, dims, split)?;
    let vector = vector_width(dtype, dims.l, &[grad, x, output, masked]);
    let mut launches = vec![launch(
        format!("batch_norm_backward_reduce_{dtype}"),
        config,
        vec![
            KernelArg::In(grad),
            KernelArg::In(x),
            KernelArg::In(output),
            KernelArg::Out(masked),
            KernelArg::I32(code),
            KernelArg::In(table),
            KernelArg::U64(dims.c as u64),
            KernelArg::U64((dims.per_channel() / vector) as u64),
            KernelArg::pod(&run_divider(op, dims, vector)?),
            KernelArg::I32(vector as i32),
            KernelArg::U32(splits),
            KernelArg::U64((split.chunk / vector) as u64),
            KernelArg::Out(partials),
            KernelArg::Out(sums),
        ],
    )];
    if split.splits > 1 {
        launches.push(launch(
            "batch_norm_backward_reduce_finish".to_string(),
            per_channel_warps(op, dims.c)?,
            vec![
                KernelArg::U64(dims.c as u64),
                KernelArg::U32(splits),
                KernelArg::In(partials),
                KernelArg::Out(sums),
            ],
        ));
    }
    Ok(launches)
}

/// The gradient sums `[Σg', Σg'·(x − mean)]` as the kernels take them: two per-channel f64
/// vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumsArg {
    /// Row 0, `Σg'`.
    pub sum_g: ChannelArg,
    /// Row 1, `Σg'·(x − mean)`.
    pub sum_centered: ChannelArg,
}

/// The input gradient: a per-channel launch computing the coefficients (`[4, c]` of `dtype`
/// at `coefficients`: w/σ; in training the slope and offset of the closed form from the sums
/// and `count`, in evaluation zeros; the forward's shift), then the elementwise pass
/// `grad_x = a·g' + offset + slope·x` over the contiguous gradient at `grad` and input at `x`
/// into `out`, `g'` masked by the recomputed ReLU under `relu_mask`.
#[allow(clippy::too_many_arguments)]
pub fn backward_apply_launches(
    op: &'static str,
    grad: u64,
    x: u64,
    out: u64,
    dtype: DType,
    dims: Dims,
    table: u64,
    sums: SumsArg,
    count: CountArg,
    training: bool,
    relu_mask: bool,
    coefficients: u64,
) -> Result<[Launch; 2]> {
    let [count_host, count_at] = count.kernel_args(op)?;
    check_dtype(op, dtype)?;
    let any = dims.numel() > 0;
    check_address(op, "the gradient", grad, any)?;
    check_address(op, "the input", x, any)?;
    check_address(op, "the output", out, any)?;
    check_address(op, "the table", table, dims.c > 0)?;
    check_address(op, "the coefficients", coefficients, dims.c > 0)?;
    let sums_needed = training && dims.c > 0;
    if sums_needed && !(sums.sum_g.is_present() && sums.sum_centered.is_present()) {
        return Err(Error::invalid(op, "training needs the gradient sums"));
    }
    let coefs = launch(
        format!("batch_norm_backward_coefficients_{dtype}"),
        per_channel(op, dims.c)?,
        vec![
            KernelArg::In(table),
            sums.sum_g.read(),
            sums.sum_centered.read(),
            KernelArg::U64(dims.c as u64),
            count_host,
            count_at,
            KernelArg::I32(i32::from(training)),
            KernelArg::Out(coefficients),
        ],
    );
    let vector = vector_width(dtype, dims.l, &[grad, x, out]);
    let vectors = dims.numel() / vector;
    let [rows, channels] = elementwise_dividers(op, dims, vector)?;
    let apply = launch(
        format!("batch_norm_backward_apply_{dtype}"),
        LaunchConfig::for_elements(op, vectors, THREADS_PER_BLOCK)?,
        vec![
            KernelArg::In(grad),
            KernelArg::In(x),
            KernelArg::Out(out),
            KernelArg::In(coefficients),
            KernelArg::U64(vectors as u64),
            rows,
            channels,
            KernelArg::I32(vector as i32),
            KernelArg::I32(i32::from(relu_mask)),
        ],
    );
    Ok([coefs, apply])
}

/// The weight and bias gradients `(Σg'·(x − mean)/σ, Σg')` per channel, as `dtype` `[c]`
/// vectors at `grad_weight` and `grad_bias`.
pub fn parameter_gradients_launch(
    op: &'static str,
    sums: SumsArg,
    table: u64,
    channels: usize,
    dtype: DType,
    grad_weight: u64,
    grad_bias: u64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let any = channels > 0;
    check_address(op, "the table", table, any)?;
    check_address(op, "the weight gradient", grad_weight, any)?;
    check_address(op, "the bias gradient", grad_bias, any)?;
    if any && !(sums.sum_g.is_present() && sums.sum_centered.is_present()) {
        return Err(Error::invalid(op, "the gradient sums are needed"));
    }
    Ok(launch(
        format!("batch_norm_parameter_gradients_{dtype}"),
        per_channel(op, channels)?,
        vec![
            sums.sum_g.read(),
            sums.sum_centered.read(),
            KernelArg::In(table),
            KernelArg::U64(channels as u64),
            KernelArg::Out(grad_weight),
            KernelArg::Out(grad_bias),
        ],
    ))
}

/// `num_batches_tracked += 1` for the i64 counter at `counter`.
pub fn count_batch_launch(op: &'static str, counter: u64) -> Result<Launch> {
    check_address(op, "the counter", counter, true)?;
    Ok(launch(
        "batch_norm_count_batch".to_string(),
        LaunchConfig::for_elements(op, 1, WARP_SIZE)?,
        vec![KernelArg::Out(counter)],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_multiply_shift_divider_matches_integer_division() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let mut divisors: Vec<u64> = (1..=300).collect();
        divisors.extend([
            641,
            1 << 31,
            (1 << 31) + 1,
            (1 << 32) - 1,
            1 << 32,
            (1 << 40) + 7,
            u64::MAX,
        ]);
        divisors.extend((0..200).map(|_| next() >> (next() % 64)).filter(|&d| d > 0));
        for d in divisors {
            let div = Divider::new("t", d).unwrap();
            let mut dividends = vec![
                0u64,
                1,
                d - 1,
                d,
                d.saturating_add(1),
                u32::MAX as u64,
                1 << 32,
                u64::MAX,
            ];
            dividends.extend((0..200).map(|_| next() >> 32));
            dividends.extend((0..50).map(|_| next()));
            for n in dividends {
                assert_eq!(div.divide(n), n / d, "{n} / {d} with {div:?}");
            }
        }
        assert!(Divider::new("t", 0).is_err());
    }

    #[test]
    fn splits_cover_each_channel_in_whole_vectors() {
        for (n, c, l) in [
            (1, 1, 1),
            (2, 3, 5),
            (128, 16, 1024),
            (128, 64, 64),
            (7, 1, 100_003),
            (0, 4, 9),
            (3, 2, 0),
            (1, 100_000, 1),
        ] {
            let dims = Dims { n, c, l };
            for split in [
                Split::for_dims(dims),
                Split::with_splits(dims, 3),
                Split::with_splits(dims, 1000),
            ] {
                assert!(split_args("t", dims, split).is_ok(), "{dims:?} {split:?}");
                assert!(split.chunk.is_multiple_of(4) && split.splits >= 1);
                assert!(split.splits * split.chunk >= dims.per_channel());
            }
        }
        // A large channel is split, a small one is not.
        let big = Split::for_dims(Dims {
            n: 128,
            c: 16,
            l: 1024,
        });
        assert!(big.splits > 1 && big.chunk >= MIN_SPLIT_ELEMENTS, "{big:?}");
        let small = Split::for_dims(Dims { n: 4, c: 8, l: 64 });
        assert_eq!(small.splits, 1);
    }

    #[test]
    fn vectors_need_alignment_and_whole_runs() {
        assert_eq!(vector_width(DType::F32, 64, &[0x1000, 0x2000]), 4);
        assert_eq!(vector_width(DType::F64, 64, &[0x1000]), 2);
        assert_eq!(vector_width(DType::F32, 6, &[0x1000]), 1);
        assert_eq!(vector_width(DType::F32, 64, &[0x1000, 0x2004]), 1);
        assert_eq!(vector_width(DType::F64, 3, &[0x1000]), 1);
    }

    #[test]
    fn builders_name_the_op_and_refuse_bad_arguments() {
        let dims = Dims { n: 2, c: 3, l: 4 };
        let split = Split::for_dims(dims);
        let err = statistics_launches(
            "batch_norm_statistics",
            0x100,
            DType::I64,
            dims,
            split,
            0,
            8,
            8,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("batch_norm_statistics") && err.contains("i64"),
            "{err}"
        );
        let err = apply_launch(
            "batch_norm_apply",
            0,
            ApplyEpilogue::Plain,
            0x10,
            DType::F32,
            dims,
            0x10,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("null") && err.contains("input"), "{err}");
        let shared = ChannelArg::new("t", "running_mean", 0x100, 0, DType::F32).unwrap();
        let stat = ChannelArg::new("t", "mean", 0x200, 1, DType::F64).unwrap();
        let err = update_running_launch(
            "batch_norm_update_running",
            shared,
            ChannelArg::absent(),
            stat,
            stat,
            3,
            0.1,
            CountArg::Host(3),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("running_mean") && err.contains("stride 0"),
            "{err}"
        );
        assert!(ChannelArg::new("t", "weight", 0x100, 1, DType::I64).is_err());
    }

    #[test]
    fn a_count_reaches_the_kernels_from_the_host_or_from_device_memory() {
        let [host, absent] = CountArg::Host(6).kernel_args("t").unwrap();
        assert_eq!(format!("{host:?}"), format!("{:?}", KernelArg::F64(6.0)));
        assert_eq!(
            format!("{absent:?}"),
            format!("{:?}", KernelArg::pod(&ChannelArg::absent()))
        );
        let [zero, at] = CountArg::Device(0x40).kernel_args("t").unwrap();
        assert_eq!(format!("{zero:?}"), format!("{:?}", KernelArg::F64(0.0)));
        let want = ChannelArg::new("t", "the count", 0x40, 0, DType::F64).unwrap();
        assert_eq!(format!("{at:?}"), format!("{:?}", want.read()));
        assert!(CountArg::Device(0).kernel_args("t").is_err());
    }

    #[test]
    fn from_sums_checks_its_count_on_the_device_so_it_needs_the_deferred_record() {
        let sums = ChannelArg::new("t", "sums", 0x100, 1, DType::F64).unwrap();
        let slot = DeferredSlot {
            claim: 0x200,
            record: 0x300,
            code: 1,
        };
        // Also for no channels: thread 0 checks the count.
        let launch = from_sums_launch("t", sums, 0, 0, 0, slot).unwrap();
        assert!(launch.config.grid[0] >= 1);
        assert_eq!(launch.args.len(), 7);
        let err = from_sums_launch(
            "t",
            sums,
            2,
            0x400,
            0x500,
            DeferredSlot { claim: 0, ..slot },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("claim"), "{err}");
    }

    #[test]
    fn one_split_needs_one_launch_and_more_need_a_finish() {
        let dims = Dims { n: 4, c: 3, l: 20 };
        let one = statistics_launches(
            "t",
            0x100,
            DType::F32,
            dims,
            Split::with_splits(dims, 1),
            0,
            8,
            16,
        )
        .unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].kernel, "batch_norm_statistics_f32");
        let split = Split::with_splits(dims, 3);
        assert!(statistics_launches("t", 0x100, DType::F64, dims, split, 0, 8, 16).is_err());
        let two = statistics_launches("t", 0x100, DType::F64, dims, split, 0x400, 8, 16).unwrap();
        assert_eq!(
            (two.len(), two[1].kernel.as_str()),
            (2, "batch_norm_statistics_finish_f64")
        );
        assert_eq!(two[0].config.grid[0] as usize, 3 * split.splits);
    }
}
