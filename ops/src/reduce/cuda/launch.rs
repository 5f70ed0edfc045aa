//! Launch plans of the reductions (`reduce.cu`): pure functions of addresses, layouts and
//! sizes to [`Launch`]es, run on a device by the ops and on the CPU by the host harness. The
//! row configuration and dtype checks here are shared with softmax's and the losses' plans.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig, StridedLayout};
use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::{DType, Error, Layout, Result, Shape};

/// `reduce.cu`, embedded.
pub static REDUCE: KernelSource = KernelSource {
    name: "reduce",
    source: include_str!("../reduce.cu"),
    headers: &[],
};

/// Threads per block of the warp-per-row, elementwise and partial-sum kernels.
pub const THREADS_PER_BLOCK: u32 = 256;
/// Threads per block when one block reduces one row.
pub const ROW_BLOCK_THREADS: u32 = 512;
/// Rows at most this long get one warp each; longer rows one block each.
pub const WARP_ROW_MAX: usize = 1024;
/// A single row longer than this is summed by [`sum_partial_launch`] over many blocks first.
pub const PARTIAL_MIN_LEN: usize = 1 << 16;
/// The most blocks (and so partial sums) of a partial-sum launch.
pub const PARTIAL_MAX_BLOCKS: usize = 1024;

/// Checks that the kernels exist for `dtype` (f32 and f64, the CPU op's dtypes).
pub fn check_dtype(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        other => Err(Error::UnsupportedDType {
            op,
            dtype: other,
            supported: "f32, f64",
        }),
    }
}

/// A scalar in the compute type of `dtype` (float for f32, double for f64).
pub fn compute_arg(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F64 => KernelArg::F64(value),
        _ => KernelArg::F32(value as f32),
    }
}

fn layout_arg(op: &'static str, layout: &Layout) -> Result<KernelArg> {
    Ok(KernelArg::pod(&StridedLayout::new(op, layout)?))
}

fn usize_arg(value: usize) -> KernelArg {
    KernelArg::U64(value as u64)
}

/// The configuration of a row kernel: one warp per row for short rows (`true`), one block per
/// row otherwise.
pub fn rows_config(op: &'static str, rows: usize, len: usize) -> Result<(LaunchConfig, bool)> {
    if len <= WARP_ROW_MAX {
        let threads = rows.checked_mul(32).ok_or_else(|| {
            Error::invalid(op, format!("{rows} rows are too many for one launch"))
        })?;
        Ok((
            LaunchConfig::for_elements(op, threads, THREADS_PER_BLOCK)?,
            true,
        ))
    } else {
        Ok((
            LaunchConfig::for_rows(op, rows, ROW_BLOCK_THREADS, 0)?,
            false,
        ))
    }
}

/// `out[r] = scale · Σ_k x[layout(r·len + k)]` for `r < rows` (`out` dense). `layout` is the
/// input viewed as `rows × len` elements in row-major order (kept dims first).
#[allow(clippy::too_many_arguments)]
pub fn sum_rows_launch(
    op: &'static str,
    dtype: DType,
    x: u64,
    layout: &Layout,
    out: u64,
    rows: usize,
    len: usize,
    scale: f64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    check_count(op, layout, rows, len)?;
    let (config, warp_per_row) = rows_config(op, rows, len)?;
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("sum_rows_{dtype}"),
        config,
        args: vec![
            KernelArg::In(x),
            layout_arg(op, layout)?,
            KernelArg::Out(out),
            usize_arg(rows),
            usize_arg(len),
            KernelArg::I32(warp_per_row as i32),
            compute_arg(dtype, scale),
        ],
    })
}

fn check_count(op: &'static str, layout: &Layout, rows: usize, len: usize) -> Result<()> {
    if rows.checked_mul(len) != Some(layout.numel()) {
        return Err(Error::shape(
            op,
            format!(
                "{rows} rows of {len} elements do not match a layout of shape {:?}",
                layout.shape().as_slice()
            ),
        ));
    }
    Ok(())
}

/// The dense `[outer, len, inner]` tensor at `x` (the address of its first element) summed
/// over `len`: `out[o·inner + i] = scale · Σ_k x[(o·len + k)·inner + i]`.
pub fn sum_columns_launch(
    op: &'static str,
    dtype: DType,
    x: u64,
    out: u64,
    (outer, len, inner): (usize, usize, usize),
    scale: f64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let tiles = outer
        .checked_mul(inner.div_ceil(32))
        .filter(|_| {
            outer
                .checked_mul(len)
                .and_then(|v| v.checked_mul(inner))
                .is_some()
        })
        .ok_or_else(|| Error::invalid(op, format!("[{outer}, {len}, {inner}] is too large")))?;
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("sum_columns_{dtype}"),
        config: LaunchConfig::for_rows(op, tiles, THREADS_PER_BLOCK, 0)?,
        args: vec![
            KernelArg::In(x),
            KernelArg::Out(out),
            usize_arg(outer),
            usize_arg(len),
            usize_arg(inner),
            compute_arg(dtype, scale),
        ],
    })
}

/// The number of partial sums [`sum_partial_launch`] writes for `n` elements.
pub fn partial_blocks(n: usize) -> usize {
    n.div_ceil(THREADS_PER_BLOCK as usize * 16)
        .clamp(1, PARTIAL_MAX_BLOCKS)
}

/// The first pass of a long sum: `partials[b]` = block `b`'s share of the dense `x[0..n)`, for
/// `b < partial_blocks(n)`. [`sum_rows_launch`] over the partials (one row) finishes it.
pub fn sum_partial_launch(
    op: &'static str,
    dtype: DType,
    x: u64,
    n: usize,
    partials: u64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let blocks = partial_blocks(n);
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("sum_partial_{dtype}"),
        config: LaunchConfig::new(op, [blocks as u32, 1, 1], [THREADS_PER_BLOCK, 1, 1], 0)?,
        args: vec![KernelArg::In(x), usize_arg(n), KernelArg::Out(partials)],
    })
}

/// `values[r]`, `positions[r]` = the first maximum of row `r` (a NaN beats every number) and
/// its position in the row, for rows read as in [`sum_rows_launch`]. Rows must not be empty.
#[allow(clippy::too_many_arguments)]
pub fn max_rows_launch(
    op: &'static str,
    dtype: DType,
    x: u64,
    layout: &Layout,
    values: u64,
    positions: u64,
    rows: usize,
    len: usize,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    check_count(op, layout, rows, len)?;
    if len == 0 && rows > 0 {
        return Err(Error::shape(op, "the maximum of an empty group"));
    }
    let (config, warp_per_row) = rows_config(op, rows, len)?;
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("max_rows_{dtype}"),
        config,
        args: vec![
            KernelArg::In(x),
            layout_arg(op, layout)?,
            KernelArg::Out(values),
            KernelArg::Out(positions),
            usize_arg(rows),
            usize_arg(len),
            KernelArg::I32(warp_per_row as i32),
        ],
    })
}

/// `out[i] = scale · g[g_layout(i)]` for the dense `out` of `g_layout`'s shape: `g_layout` is
/// the output gradient expanded over the reduced dims (stride 0 there).
pub fn broadcast_scaled_launch(
    op: &'static str,
    dtype: DType,
    out: u64,
    g: u64,
    g_layout: &Layout,
    scale: f64,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let n = g_layout.numel();
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("broadcast_scaled_{dtype}"),
        config: LaunchConfig::for_elements(op, n, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out),
            usize_arg(n),
            KernelArg::In(g),
            layout_arg(op, g_layout)?,
            compute_arg(dtype, scale),
        ],
    })
}

/// The backward of `max`: `grad` (dense, of the input's shape, zeroed beforehand) gets
/// `g[g_layout(r)]` at `kept(r) + reduced(positions[r])` for every row `r`; `kept` and `reduced`
/// are the kept and the reduced dims of the dense input with its strides (offset 0).
#[allow(clippy::too_many_arguments)]
pub fn max_scatter_launch(
    op: &'static str,
    dtype: DType,
    grad: u64,
    g: u64,
    g_layout: &Layout,
    positions: u64,
    kept: &Layout,
    reduced: &Layout,
) -> Result<Launch> {
    check_dtype(op, dtype)?;
    let (rows, len) = (kept.numel(), reduced.numel());
    if g_layout.numel() != rows {
        return Err(Error::shape(
            op,
            format!(
                "output gradient of shape {:?} for {rows} groups",
                g_layout.shape().as_slice()
            ),
        ));
    }
    Ok(Launch {
        source: &REDUCE,
        kernel: format!("max_scatter_{dtype}"),
        config: LaunchConfig::for_elements(op, rows, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(grad),
            KernelArg::In(g),
            layout_arg(op, g_layout)?,
            KernelArg::In(positions),
            layout_arg(op, kept)?,
            layout_arg(op, reduced)?,
            usize_arg(rows),
            usize_arg(len),
        ],
    })
}

// ---- plans: which kernels reduce a given layout --------------------------------------------

/// `layout` with the dims in `dims` moved last: row-major order over it is rows of the reduced
/// elements.
pub fn grouped_layout(op: &'static str, layout: &Layout, dims: &[usize]) -> Result<Layout> {
    let perm: Vec<usize> = (0..layout.rank())
        .filter(|d| !dims.contains(d))
        .chain(dims.iter().copied())
        .collect();
    layout.permute(op, &perm)
}

/// How a sum over dims runs.
#[derive(Clone, Debug, PartialEq)]
pub enum SumPlan {
    /// A contiguous input reduced over a middle block of dims: dense `[outer, len, inner]`
    /// with `inner > 1`, summed column-wise ([`sum_columns_launch`]).
    Columns {
        /// Product of the dims before the reduced ones.
        outer: usize,
        /// Product of the reduced dims.
        len: usize,
        /// Product of the dims after them.
        inner: usize,
    },
    /// `rows` rows of `len` elements read through `layout` (the input with the reduced dims
    /// last, see [`grouped_layout`]), one warp or block per row ([`sum_rows_launch`]).
    Rows {
        /// The grouped layout.
        layout: Layout,
        /// Kept elements.
        rows: usize,
        /// Reduced elements per row.
        len: usize,
    },
    /// One long dense row of `len` elements: `blocks` partial sums ([`sum_partial_launch`]),
    /// then one row of them.
    Partial {
        /// Elements.
        len: usize,
        /// Partial sums (see [`partial_blocks`]).
        blocks: usize,
    },
    /// More than eight dims remain after merging: reduce a dense copy instead.
    Copy,
}

/// The plan for the sum over `dims` (sorted, unique) of a tensor of `layout`.
pub fn plan_sum(op: &'static str, layout: &Layout, dims: &[usize]) -> Result<SumPlan> {
    let shape = layout.shape();
    let len: usize = dims.iter().map(|&d| shape[d]).product();
    let rows = layout.numel().checked_div(len).unwrap_or_else(|| {
        (0..layout.rank())
            .filter(|d| !dims.contains(d))
            .map(|d| shape[d])
            .product()
    });
    if let (Some(&first), Some(&last)) = (dims.first(), dims.last()) {
        let inner: usize = shape[last + 1..].iter().product();
        if layout.is_contiguous() && last - first + 1 == dims.len() && inner > 1 {
            return Ok(SumPlan::Columns {
                outer: shape[..first].iter().product(),
                len,
                inner,
            });
        }
    }
    let grouped = grouped_layout(op, layout, dims)?;
    let Ok(strided) = StridedLayout::new(op, &grouped) else {
        return Ok(SumPlan::Copy);
    };
    if rows == 1 && len >= PARTIAL_MIN_LEN && strided.is_contiguous() {
        return Ok(SumPlan::Partial {
            len,
            blocks: partial_blocks(len),
        });
    }
    Ok(SumPlan::Rows {
        layout: grouped,
        rows,
        len,
    })
}

/// The launches of `plan` (made by [`plan_sum`] from `input`'s layout) for `input`, into the
/// dense `out`; `partials` (for [`SumPlan::Partial`], `blocks` elements of the dtype) is scratch
/// memory.
pub fn sum_launches(
    op: &'static str,
    plan: &SumPlan,
    input: DeviceView,
    out: u64,
    partials: u64,
    scale: f64,
) -> Result<Vec<Launch>> {
    let (dtype, base) = (input.dtype, input.ptr);
    let first = input.first_element(op)?;
    Ok(match plan {
        SumPlan::Columns { outer, len, inner } => vec![sum_columns_launch(
            op,
            dtype,
            first,
            out,
            (*outer, *len, *inner),
            scale,
        )?],
        SumPlan::Rows { layout, rows, len } => vec![sum_rows_launch(
            op, dtype, base, layout, out, *rows, *len, scale,
        )?],
        SumPlan::Partial { len, blocks } => vec![
            sum_partial_launch(op, dtype, first, *len, partials)?,
            sum_rows_launch(
                op,
                dtype,
                partials,
                &Layout::contiguous(&[*blocks]),
                out,
                1,
                *blocks,
                scale,
            )?,
        ],
        SumPlan::Copy => {
            return Err(Error::invalid(
                op,
                "a sum over more than 8 separate dims runs on a dense copy",
            ))
        }
    })
}

/// The output gradient's layout `g_layout` (of the kept shape, with or without the reduced
/// dims) expanded to `in_shape`: stride 0 along the reduced dims.
pub fn expanded_gradient(g_layout: &Layout, in_shape: &[usize], dims: &[usize]) -> Layout {
    let keepdim = g_layout.rank() == in_shape.len();
    let mut kept_strides = g_layout.strides().iter().copied();
    let strides = (0..in_shape.len())
        .map(|d| {
            let reduced = dims.contains(&d);
            if keepdim {
                if reduced {
                    0
                } else {
                    g_layout.strides()[d]
                }
            } else if reduced {
                0
            } else {
                kept_strides.next().unwrap_or(0)
            }
        })
        .collect();
    Layout::from_parts(Shape::from_slice(in_shape), strides, g_layout.offset())
}

/// The layouts `max`'s backward scatters through, for an input of `in_shape` reduced over
/// `dims` and the output gradient's layout: the gradient over the kept dims, and the kept and
/// the reduced dims of the dense input with its strides (offset 0).
pub fn max_scatter_layouts(
    g_layout: &Layout,
    in_shape: &[usize],
    dims: &[usize],
) -> (Layout, Layout, Layout) {
    let strides = Layout::contiguous(in_shape).strides().clone();
    let part = |select: bool| {
        let axes: Vec<usize> = (0..in_shape.len())
            .filter(|d| dims.contains(d) == select)
            .collect();
        Layout::from_parts(
            axes.iter().map(|&d| in_shape[d]).collect(),
            axes.iter().map(|&d| strides[d]).collect(),
            0,
        )
    };
    let (kept, reduced) = (part(false), part(true));
    let g_kept = Layout::from_parts(
        kept.shape().clone(),
        expanded_gradient(g_layout, in_shape, dims)
            .strides()
            .iter()
            .enumerate()
            .filter(|(d, _)| !dims.contains(d))
            .map(|(_, &s)| s)
            .collect(),
        g_layout.offset(),
    );
    (g_kept, kept, reduced)
}
