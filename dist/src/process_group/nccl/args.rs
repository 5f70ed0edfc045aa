//! Checking the tensors handed to an NCCL collective and turning them into what NCCL takes:
//! device addresses, element counts, `ncclDataType_t` and `ncclRedOp_t` values.
//!
//! NCCL works on raw device pointers and trusts them, so every tensor is checked first: the
//! checks every backend shares (contiguous, of one dtype, a reducible dtype for reductions, the
//! right element counts; `describe_*` in `process_group`), then, here, that it is on this
//! rank's CUDA device. A failed check is a [`DistError::InvalidArgument`](crate::DistError)
//! naming the rank, the collective and the tensor, raised before anything is issued.

use std::ffi::c_int;

use tandem_core::{DType, Device, Tensor};

use super::ffi::{data_type, red_op};
use crate::process_group::{invalid, ReduceOp};
use crate::Result;

/// A checked tensor: where its elements start on the device and how many bytes they span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Buffer {
    /// Device address of the first element.
    pub ptr: u64,
    /// Bytes of the elements.
    pub bytes: u64,
}

impl Buffer {
    /// Whether the two byte ranges share a byte.
    pub(crate) fn overlaps(&self, other: &Buffer) -> bool {
        self.bytes > 0
            && other.bytes > 0
            && self.ptr < other.ptr + other.bytes
            && other.ptr < self.ptr + self.bytes
    }
}

/// `dtype` as an `ncclDataType_t`.
pub(crate) fn nccl_type(dtype: DType) -> c_int {
    match dtype {
        DType::F32 => data_type::FLOAT32,
        DType::F64 => data_type::FLOAT64,
        DType::F16 => data_type::FLOAT16,
        DType::BF16 => data_type::BFLOAT16,
        DType::I64 => data_type::INT64,
        DType::U8 => data_type::UINT8,
    }
}

/// `op` as an `ncclRedOp_t`.
///
/// Over one rank the average is the sum: NCCL 2.28.9's one-rank average left the last element
/// of an odd-length f64 reduce_scatter unwritten on an H100 (seen in `cuda_nccl`), so a world
/// of 1 never asks NCCL for it.
pub(crate) fn nccl_op(op: ReduceOp, world: usize) -> c_int {
    match op {
        ReduceOp::Avg if world == 1 => red_op::SUM,
        ReduceOp::Sum => red_op::SUM,
        ReduceOp::Avg => red_op::AVG,
        ReduceOp::Max => red_op::MAX,
        ReduceOp::Min => red_op::MIN,
    }
}

/// Where `t` lies on this rank's device, for an NCCL collective of the group on `device`.
///
/// The arguments themselves (contiguity, dtypes, element counts, the root) are checked first by
/// the checks every backend shares (`describe_*` in `process_group`); this adds what only NCCL
/// needs: the tensor is on the group's device, and its device address.
pub(crate) fn buffer(
    rank: usize,
    device: Device,
    collective: &'static str,
    what: &str,
    t: &Tensor,
) -> Result<Buffer> {
    if t.device() != device {
        return Err(invalid(
            rank,
            collective,
            format!(
                "{what} is on {}; this NCCL group works on tensors of {device} (this rank's \
                 device)",
                t.device()
            ),
        ));
    }
    let size = t.dtype().size_in_bytes() as u64;
    let (_, base) = tandem_core::cuda::device_pointer(collective, t)
        .map_err(|e| invalid(rank, collective, format!("{what}: {e}")))?;
    Ok(Buffer {
        ptr: base + t.layout().offset() as u64 * size,
        bytes: t.numel() as u64 * size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_off_the_group_device_are_refused_before_anything_is_issued() {
        let cpu = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
        let err = buffer(1, Device::Cuda(0), "all_reduce", "tensor", &cpu)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 1") && err.contains("is on cpu") && err.contains("cuda:0"),
            "{err}"
        );
    }

    #[test]
    fn buffers_overlap_only_when_they_share_a_byte() {
        let a = Buffer {
            ptr: 100,
            bytes: 10,
        };
        assert!(a.overlaps(&Buffer { ptr: 109, bytes: 1 }));
        assert!(!a.overlaps(&Buffer { ptr: 110, bytes: 5 }));
        assert!(!a.overlaps(&Buffer { ptr: 105, bytes: 0 }));
        assert!(Buffer { ptr: 90, bytes: 11 }.overlaps(&a));
    }

    #[test]
    fn dtypes_and_ops_map_to_nccl_h_values() {
        assert_eq!(nccl_type(DType::F32), 7);
        assert_eq!(nccl_type(DType::BF16), 9);
        assert_eq!(nccl_type(DType::F16), 6);
        assert_eq!(nccl_op(ReduceOp::Avg, 2), 4);
        assert_eq!(nccl_op(ReduceOp::Min, 2), 3);
        // Over one rank the average is asked of NCCL as a sum.
        assert_eq!(nccl_op(ReduceOp::Avg, 1), 0);
    }
}
