//! Communication hooks: what the reducer does with a full bucket.
//!
//! The default all-reduces the bucket in place. A hook may replace that — the shipped ones
//! compress the bucket to bf16 or f16, all-reduce the compressed copy and write it back,
//! halving the bytes on the wire. Hooks receive the bucket already scaled by `1/world_size`
//! under `GradReduction::Mean`, so the sum they compute is the mean, and f16 cannot overflow
//! where the mean itself fits.
//!
//! Hooks run on the group's comm stream: the reducer has made it wait for the bucket's
//! gradients before calling the hook, and the hook's own work (the casts of the compression
//! hooks, device kernels on CUDA) is issued there in order with the collective, so it overlaps
//! backward like the collective does.

use tandem_core::{DType, Event, Tensor};

use crate::stream_ops::{cast_on, empty_on};
use crate::{DistError, ProcessGroup, ReduceOp, Result, Work};

/// A bucket reduction in flight: the collectives issued and an event that completes when the
/// bucket holds the reduced values.
pub struct BucketReduction {
    /// The collectives the hook issued (their errors are reported when the reducer waits).
    pub works: Vec<Work>,
    /// Completes when the bucket's buffer holds the result.
    pub done: Event,
}

/// Replaces the all-reduce of one bucket.
pub trait CommHook: Send + Sync {
    /// The hook's name, for telemetry and messages.
    fn name(&self) -> &'static str;

    /// Issues the reduction of `bucket` (a flat, contiguous gradient buffer on the group's
    /// device) over `group` and returns at once, without waiting for the device. Work that must
    /// follow the collective is issued on `group.comm_stream()` so it runs in order; `done` is
    /// typically an event recorded there after it.
    fn reduce(&self, group: &dyn ProcessGroup, bucket: &Tensor) -> Result<BucketReduction>;
}

/// The default: sum the (pre-scaled) bucket in place over all ranks.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceHook;

impl CommHook for AllReduceHook {
    fn name(&self) -> &'static str {
        "all_reduce"
    }

    fn reduce(&self, group: &dyn ProcessGroup, bucket: &Tensor) -> Result<BucketReduction> {
        let work = group.all_reduce(bucket, ReduceOp::Sum)?;
        let done = group
            .comm_stream()
            .record_event()
            .map_err(|e| DistError::tensor(group.rank(), self.name(), e))?;
        Ok(BucketReduction {
            works: vec![work],
            done,
        })
    }
}

/// Compresses the bucket to a 16-bit float type for the all-reduce, then decompresses into the
/// bucket. Gradients keep about 3 (bf16) or 3.3 (f16) significant decimal digits.
#[derive(Clone, Copy, Debug)]
pub struct CompressionHook {
    dtype: DType,
}

impl CompressionHook {
    /// Compression to bf16: the range of f32, 8 bits of mantissa.
    pub fn bf16() -> Self {
        CompressionHook { dtype: DType::BF16 }
    }

    /// Compression to f16: 11 bits of mantissa, values up to 65504.
    pub fn f16() -> Self {
        CompressionHook { dtype: DType::F16 }
    }
}

impl CommHook for CompressionHook {
    fn name(&self) -> &'static str {
        match self.dtype {
            DType::F16 => "f16_compress",
            _ => "bf16_compress",
        }
    }

    fn reduce(&self, group: &dyn ProcessGroup, bucket: &Tensor) -> Result<BucketReduction> {
        let rank = group.rank();
        let comm = group.comm_stream();
        let err = |e| DistError::tensor(rank, self.name(), e);
        let work = if comm.cuda_stream().is_some() {
            // Compress, reduce and decompress on the comm stream, in its order.
            let compressed = empty_on(self.name(), comm, bucket.dims(), self.dtype).map_err(err)?;
            cast_on(comm, &compressed, bucket).map_err(err)?;
            let work = group.all_reduce(&compressed, ReduceOp::Sum)?;
            cast_on(comm, bucket, &compressed).map_err(err)?;
            work
        } else {
            // A host comm stream is a thread: the bucket is final (the CPU compute stream is
            // this thread), so compress here; decompress in a job after the collective.
            let compressed = bucket.to_dtype(self.dtype).map_err(err)?;
            let work = group.all_reduce(&compressed, ReduceOp::Sum)?;
            let (target, source) = (bucket.clone(), compressed);
            comm.enqueue(move || {
                // Runs after the all-reduce on the same stream. A failed all-reduce is reported
                // through its Work; then the values here do not matter.
                if let Ok(values) = source.to_dtype(target.dtype()) {
                    let _ = target.copy_(&values);
                }
            })
            .map_err(err)?;
            work
        };
        let done = comm.record_event().map_err(err)?;
        Ok(BucketReduction {
            works: vec![work],
            done,
        })
    }
}
