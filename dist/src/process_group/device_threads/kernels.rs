//! Launch plans for the device group's kernels (`device_group.cu`): the rank-order reduction of
//! `all_reduce` and `reduce_scatter`, and the gather of `all_gather`.
//!
//! Each builder is a pure function from device addresses, a dtype, sizes and the reduce op to a
//! [`Launch`]; the CUDA runtime executes it on a rank's comm stream and the host harness on the
//! CPU (`cuda-harness/tests/device_group.rs`). The builders check what the kernels rely on: a rank
//! count the pointer table holds, a dtype the kernel exists for, non-null addresses for non-empty
//! work, byte ranges that do not overflow, and a destination that overlaps no source.

use tandem_core::cuda::launch::{KernelArg, KernelPod, KernelSource, Launch, LaunchConfig};
use tandem_core::{DType, Error, Result};

use crate::ReduceOp;

/// `device_group.cu`, embedded.
pub static DEVICE_GROUP: KernelSource = KernelSource {
    name: "device_group",
    source: include_str!("device_group.cu"),
    headers: &[],
};

/// The most ranks a device group may have (`TANDEM_MAX_GROUP_RANKS` in the kernels): the size
/// of the pointer table passed to every launch.
pub const MAX_GROUP_RANKS: usize = 64;

/// Threads per block of the group's kernels.
const THREADS_PER_BLOCK: u32 = 256;

/// The ranks' snapshot addresses, by rank (`tandem_rank_pointers` in `device_group.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankPointers {
    /// Address of each rank's first element; 0 past the rank count.
    pub ptr: [u64; MAX_GROUP_RANKS],
}

// SAFETY: repr(C), an array of u64 without padding, matching `tandem_rank_pointers`; the values
// are device addresses (or host addresses in the harness), never read as host pointers here.
unsafe impl KernelPod for RankPointers {}

/// A contiguous run of elements in device memory.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// Address of the first element.
    pub ptr: u64,
    /// Elements in the run.
    pub len: usize,
}

fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

/// The byte range of `len` elements of `dtype` at `ptr`, checked.
fn byte_range(
    op: &'static str,
    what: &str,
    ptr: u64,
    len: usize,
    dtype: DType,
) -> Result<(u64, u64)> {
    if len == 0 {
        return Ok((ptr, ptr));
    }
    if ptr == 0 {
        return Err(Error::invalid(
            op,
            format!("null device pointer for {what} ({len} elements)"),
        ));
    }
    let end = (len as u64)
        .checked_mul(dtype.size_in_bytes() as u64)
        .and_then(|bytes| ptr.checked_add(bytes))
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!("{what}: {len} elements of {dtype} at {ptr:#x} pass the address space"),
            )
        })?;
    Ok((ptr, end))
}

/// Checks the sources (every one `need` elements long) against `out`, and packs their
/// addresses.
fn rank_pointers(
    op: &'static str,
    dtype: DType,
    out: Span,
    sources: &[Span],
    need: usize,
) -> Result<(RankPointers, u32)> {
    if sources.is_empty() || sources.len() > MAX_GROUP_RANKS {
        return Err(Error::invalid(
            op,
            format!(
                "{} ranks; a device group has 1 to {MAX_GROUP_RANKS}",
                sources.len()
            ),
        ));
    }
    let (o0, o1) = byte_range(op, "the output", out.ptr, out.len, dtype)?;
    let mut table = RankPointers {
        ptr: [0; MAX_GROUP_RANKS],
    };
    for (k, src) in sources.iter().enumerate() {
        if src.len != need {
            return Err(Error::shape(
                op,
                format!(
                    "rank {k}'s snapshot has {} elements, expected {need}",
                    src.len
                ),
            ));
        }
        let (s0, s1) = byte_range(op, &format!("rank {k}'s snapshot"), src.ptr, src.len, dtype)?;
        if o0 < s1 && s0 < o1 {
            return Err(Error::invalid(
                op,
                format!(
                    "the output ({:#x}..{:#x}) overlaps rank {k}'s snapshot ({:#x}..{:#x})",
                    o0, o1, s0, s1
                ),
            ));
        }
        table.ptr[k] = src.ptr;
    }
    Ok((table, sources.len() as u32))
}

/// `out[i] = src_0[offset + i] ⊕ … ⊕ src_{W-1}[offset + i]` for `i < out.len`, combined in rank
/// order with `op` (f32, f64, f16, bf16; half types accumulate in f32). Every source holds
/// `source_len` elements; `offset + out.len` must fit in it.
pub fn reduce_ranks_launch(
    dtype: DType,
    out: Span,
    sources: &[Span],
    source_len: usize,
    offset: usize,
    op: ReduceOp,
) -> Result<Launch> {
    const OP: &str = "device group reduction";
    if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            supported: "f32, f64, f16, bf16",
        });
    }
    if offset
        .checked_add(out.len)
        .is_none_or(|end| end > source_len)
    {
        return Err(Error::shape(
            OP,
            format!(
                "elements {offset}..{offset}+{} of snapshots of {source_len} elements",
                out.len
            ),
        ));
    }
    let (table, count) = rank_pointers(OP, dtype, out, sources, source_len)?;
    Ok(Launch {
        source: &DEVICE_GROUP,
        kernel: format!("reduce_ranks_{dtype}"),
        config: LaunchConfig::for_elements(OP, out.len, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out.ptr),
            // The sources, read by the kernel, travel as addresses inside this struct.
            KernelArg::pod(&table),
            KernelArg::U32(count),
            KernelArg::U64(offset as u64),
            KernelArg::U64(out.len as u64),
            KernelArg::I32(op_code(op)),
        ],
    })
}

/// `out[k·n + i] = src_k[i]` for every rank `k` and `i < n`, where `n` is each source's length
/// and `out.len` must be `ranks × n` (any dtype).
pub fn gather_ranks_launch(dtype: DType, out: Span, sources: &[Span]) -> Result<Launch> {
    const OP: &str = "device group gather";
    let n = sources.first().map_or(0, |s| s.len);
    if sources.len().checked_mul(n) != Some(out.len) {
        return Err(Error::shape(
            OP,
            format!(
                "an output of {} elements for {} ranks of {n}",
                out.len,
                sources.len()
            ),
        ));
    }
    let (table, count) = rank_pointers(OP, dtype, out, sources, n)?;
    Ok(Launch {
        source: &DEVICE_GROUP,
        kernel: format!("gather_ranks_{dtype}"),
        config: LaunchConfig::for_elements(OP, out.len, THREADS_PER_BLOCK)?,
        args: vec![
            KernelArg::Out(out.ptr),
            // The sources, read by the kernel, travel as addresses inside this struct.
            KernelArg::pod(&table),
            KernelArg::U32(count),
            KernelArg::U64(n as u64),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(ptr: u64, len: usize) -> Span {
        Span { ptr, len }
    }

    #[test]
    fn kernels_are_named_by_dtype_and_take_the_rank_table_by_value() {
        let srcs = [span(0x10_000, 8), span(0x20_000, 8)];
        let l =
            reduce_ranks_launch(DType::BF16, span(0x1000, 4), &srcs, 8, 4, ReduceOp::Avg).unwrap();
        assert_eq!(l.kernel, "reduce_ranks_bf16");
        let KernelArg::Pod(_) = &l.args[1] else {
            panic!("the table is a struct argument")
        };
        assert_eq!(l.args[1].size_in_bytes(), 8 * MAX_GROUP_RANKS);
        assert_eq!(l.args[2], KernelArg::U32(2));
        assert_eq!(l.args[3], KernelArg::U64(4));
        assert_eq!(l.args[5], KernelArg::I32(1));
        let g = gather_ranks_launch(DType::U8, span(0x1000, 16), &srcs).unwrap();
        assert_eq!(g.kernel, "gather_ranks_u8");
    }

    #[test]
    fn bad_plans_are_refused_with_a_reason() {
        let srcs = [span(0x10_000, 8), span(0x20_000, 8)];
        let err = |r: Result<Launch>| r.unwrap_err().to_string();
        // Integers do not reduce.
        let e = err(reduce_ranks_launch(
            DType::I64,
            span(0x1000, 8),
            &srcs,
            8,
            0,
            ReduceOp::Sum,
        ));
        assert!(e.contains("i64"), "{e}");
        // The window passes the snapshots' end.
        let e = err(reduce_ranks_launch(
            DType::F32,
            span(0x1000, 4),
            &srcs,
            8,
            5,
            ReduceOp::Sum,
        ));
        assert!(e.contains("5..5+4"), "{e}");
        // A snapshot of the wrong length.
        let uneven = [span(0x10_000, 8), span(0x20_000, 7)];
        let e = err(reduce_ranks_launch(
            DType::F32,
            span(0x1000, 8),
            &uneven,
            8,
            0,
            ReduceOp::Sum,
        ));
        assert!(e.contains("rank 1's snapshot has 7"), "{e}");
        // The output overlapping a snapshot.
        let e = err(reduce_ranks_launch(
            DType::F32,
            span(0x10_010, 8),
            &srcs,
            8,
            0,
            ReduceOp::Sum,
        ));
        assert!(e.contains("overlaps rank 0"), "{e}");
        // Null pointers for real work, and too many ranks.
        let nulls = [span(0, 8), span(0x20_000, 8)];
        let e = err(reduce_ranks_launch(
            DType::F32,
            span(0x1000, 8),
            &nulls,
            8,
            0,
            ReduceOp::Sum,
        ));
        assert!(e.contains("null"), "{e}");
        let many = vec![span(0x10_000, 0); MAX_GROUP_RANKS + 1];
        let e = err(gather_ranks_launch(DType::F32, span(0x1000, 0), &many));
        assert!(e.contains("65 ranks"), "{e}");
        // A gather output of the wrong size; an address range past 2^64.
        let e = err(gather_ranks_launch(DType::F32, span(0x1000, 15), &srcs));
        assert!(e.contains("15 elements for 2 ranks of 8"), "{e}");
        let e = err(gather_ranks_launch(
            DType::F64,
            span(u64::MAX - 8, 16),
            &srcs,
        ));
        assert!(e.contains("address space"), "{e}");
        // Empty work with null pointers is fine.
        let empty = [span(0, 0), span(0, 0)];
        assert!(reduce_ranks_launch(DType::F16, span(0, 0), &empty, 0, 0, ReduceOp::Max).is_ok());
        assert!(gather_ranks_launch(DType::I64, span(0, 0), &empty).is_ok());
    }
}
