//! The collectives of an NCCL group: each one checks its arguments with the checks every
//! backend shares, finds its tensors' device addresses, and issues one NCCL call.

use tandem_core::cuda::sanitizer::Use;
use tandem_core::{Stream, Tensor};

use super::args::{self, Buffer};
use super::{ffi, NcclProcessGroup};
use crate::process_group::{
    describe_all_gather, describe_all_reduce, describe_barrier, describe_broadcast,
    describe_reduce_scatter, tensor_error, ProcessGroup, ReduceOp, Work,
};
use crate::Result;

impl NcclProcessGroup {
    /// Where `t` lies on the group's device (after the shared argument checks).
    fn buffer(&self, collective: &'static str, what: &str, t: &Tensor) -> Result<Buffer> {
        args::buffer(self.shared.rank, self.shared.device, collective, what, t)
    }
}

impl ProcessGroup for NcclProcessGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn comm_stream(&self) -> &Stream {
        &self.shared.comm_stream
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        const NAME: &str = "all_reduce";
        let desc = describe_all_reduce(self.shared.rank, tensor, op)?;
        let buf = self.buffer(NAME, "tensor", tensor)?;
        let (count, dtype, op) = (
            tensor.numel(),
            args::nccl_type(tensor.dtype()),
            args::nccl_op(op, self.shared.world),
        );
        self.issue(
            desc,
            vec![tensor.clone()],
            &[(buf.ptr, Use::Write)],
            false,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: `ptr` addresses `count` elements of `dtype` on this group's device (checked
                // above), kept alive by the work until the collective is done; in place is allowed.
                unsafe { (api.all_reduce)(ptr, ptr, count, dtype, op, comm, stream) }
            },
        )
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        const NAME: &str = "broadcast";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let desc = describe_broadcast(rank, world, tensor, root)?;
        let buf = self.buffer(NAME, "tensor", tensor)?;
        let (count, dtype) = (tensor.numel(), args::nccl_type(tensor.dtype()));
        // The root sends its tensor, every other rank receives into its own.
        let use_ = if rank == root { Use::Read } else { Use::Write };
        self.issue(
            desc,
            vec![tensor.clone()],
            &[(buf.ptr, use_)],
            false,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: as in all_reduce; `root` is a rank of the communicator.
                unsafe {
                    (api.broadcast)(
                        ptr,
                        ptr,
                        count,
                        dtype,
                        root as std::ffi::c_int,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<Work> {
        const NAME: &str = "all_gather";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let desc = describe_all_gather(rank, world, input, output)?;
        let mut inp = self.buffer(NAME, "input", input)?;
        let out = self.buffer(NAME, "output", output)?;
        let mut held = vec![input.clone(), output.clone()];
        // NCCL allows the input to be this rank's block of the output (in place); any other
        // overlap would have NCCL read what it is writing, so such an input is copied first.
        let in_place = inp.ptr == out.ptr + rank as u64 * inp.bytes;
        if inp.overlaps(&out) && !in_place {
            let copy = staged(input).map_err(|e| tensor_error(rank, &desc, e))?;
            inp = self.buffer(NAME, "input", &copy)?;
            held.push(copy);
        }
        let (count, dtype) = (input.numel(), args::nccl_type(input.dtype()));
        let uses = [(inp.ptr, Use::Read), (out.ptr, Use::Write)];
        self.issue(desc, held, &uses, false, move |api, comm, stream| {
            // SAFETY: `inp` holds `count` elements and `out` `world × count`, of `dtype`, on this
            // group's device, alive until the collective is done, and disjoint or in place.
            unsafe {
                (api.all_gather)(
                    inp.ptr as *const std::ffi::c_void,
                    out.ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    comm,
                    stream,
                )
            }
        })
    }

    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<Work> {
        const NAME: &str = "reduce_scatter";
        let (rank, world) = (self.shared.rank, self.shared.world);
        let desc = describe_reduce_scatter(rank, world, input, output, op)?;
        let mut inp = self.buffer(NAME, "input", input)?;
        let out = self.buffer(NAME, "output", output)?;
        let mut held = vec![input.clone(), output.clone()];
        // The input must survive unchanged, so an output that shares its memory (NCCL's in-place
        // form writes into the input) gets a copy of the input to read from.
        if inp.overlaps(&out) {
            let copy = staged(input).map_err(|e| tensor_error(rank, &desc, e))?;
            inp = self.buffer(NAME, "input", &copy)?;
            held.push(copy);
        }
        let (count, dtype, op) = (
            output.numel(),
            args::nccl_type(output.dtype()),
            args::nccl_op(op, world),
        );
        let uses = [(inp.ptr, Use::Read), (out.ptr, Use::Write)];
        self.issue(desc, held, &uses, false, move |api, comm, stream| {
            // SAFETY: `inp` holds `world × count` elements and `out` `count`, of `dtype`, on this
            // group's device, alive until the collective is done, and disjoint.
            unsafe {
                (api.reduce_scatter)(
                    inp.ptr as *const std::ffi::c_void,
                    out.ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    op,
                    comm,
                    stream,
                )
            }
        })
    }

    fn barrier(&self) -> Result<Work> {
        let desc = describe_barrier();
        let buf = self.buffer("barrier", "barrier buffer", &self.barrier)?;
        self.issue(
            desc,
            vec![self.barrier.clone()],
            &[(buf.ptr, Use::Write)],
            true,
            move |api, comm, stream| {
                let ptr = buf.ptr as *mut std::ffi::c_void;
                // SAFETY: the group's own one-element f32 buffer on its device, alive with the group.
                unsafe {
                    (api.all_reduce)(
                        ptr,
                        ptr,
                        1,
                        ffi::data_type::FLOAT32,
                        ffi::red_op::SUM,
                        comm,
                        stream,
                    )
                }
            },
        )
    }
}

/// A fresh copy of `t` on its device (made on the compute stream, before the collective).
fn staged(t: &Tensor) -> tandem_core::Result<Tensor> {
    let copy = Tensor::empty(t.dims(), t.dtype(), t.device())?;
    copy.copy_(t)?;
    Ok(copy)
}
