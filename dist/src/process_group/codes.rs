//! The one-byte codes that name a collective, a dtype and a reduce op on the wire: in the TCP
//! backend's frame headers and in the descriptors NCCL ranks publish in the store. One table
//! each way, so that the two encodings cannot drift apart.
//!
//! Code 0 means "none" for a dtype (a barrier) and a reduce op (a collective that does not
//! reduce); collectives start at 1. Decoding refuses an unknown code with a description, as
//! the bytes come from a peer.

use tandem_core::DType;

use super::{CollectiveKind, ReduceOp};

/// The code of a collective (1 to 5).
pub(crate) fn kind_code(kind: CollectiveKind) -> u8 {
    match kind {
        CollectiveKind::AllReduce => 1,
        CollectiveKind::Broadcast => 2,
        CollectiveKind::AllGather => 3,
        CollectiveKind::ReduceScatter => 4,
        CollectiveKind::Barrier => 5,
    }
}

/// The collective of `code`.
pub(crate) fn kind_of(code: u8) -> Result<CollectiveKind, String> {
    Ok(match code {
        1 => CollectiveKind::AllReduce,
        2 => CollectiveKind::Broadcast,
        3 => CollectiveKind::AllGather,
        4 => CollectiveKind::ReduceScatter,
        5 => CollectiveKind::Barrier,
        other => return Err(format!("unknown collective code {other}")),
    })
}

/// The code of a dtype (0 for none).
pub(crate) fn dtype_code(dtype: Option<DType>) -> u8 {
    match dtype {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F64) => 2,
        Some(DType::F16) => 3,
        Some(DType::BF16) => 4,
        Some(DType::I64) => 5,
        Some(DType::U8) => 6,
    }
}

/// The dtype of `code` (`None` for 0).
pub(crate) fn dtype_of(code: u8) -> Result<Option<DType>, String> {
    Ok(match code {
        0 => None,
        1 => Some(DType::F32),
        2 => Some(DType::F64),
        3 => Some(DType::F16),
        4 => Some(DType::BF16),
        5 => Some(DType::I64),
        6 => Some(DType::U8),
        other => return Err(format!("unknown dtype code {other}")),
    })
}

/// The code of a reduce op (0 for none).
pub(crate) fn op_code(op: Option<ReduceOp>) -> u8 {
    match op {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Avg) => 2,
        Some(ReduceOp::Max) => 3,
        Some(ReduceOp::Min) => 4,
    }
}

/// The reduce op of `code` (`None` for 0).
pub(crate) fn op_of(code: u8) -> Result<Option<ReduceOp>, String> {
    Ok(match code {
        0 => None,
        1 => Some(ReduceOp::Sum),
        2 => Some(ReduceOp::Avg),
        3 => Some(ReduceOp::Max),
        4 => Some(ReduceOp::Min),
        other => return Err(format!("unknown reduce-op code {other}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_to_what_encoded_it_and_unknown_codes_are_refused() {
        use CollectiveKind::*;
        for kind in [AllReduce, Broadcast, AllGather, ReduceScatter, Barrier] {
            assert_eq!(kind_of(kind_code(kind)), Ok(kind));
        }
        let dtypes = [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::U8,
        ];
        for dtype in dtypes.map(Some).into_iter().chain([None]) {
            assert_eq!(dtype_of(dtype_code(dtype)), Ok(dtype));
        }
        let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
        for op in ops.map(Some).into_iter().chain([None]) {
            assert_eq!(op_of(op_code(op)), Ok(op));
        }
        assert_eq!(kind_of(0), Err("unknown collective code 0".to_string()));
        assert_eq!(dtype_of(7), Err("unknown dtype code 7".to_string()));
        assert_eq!(op_of(5), Err("unknown reduce-op code 5".to_string()));
    }
}
