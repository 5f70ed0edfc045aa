//! Where and after what a device buffer's memory is freed: the ordering decision of
//! [`DeviceBuffer`](super::DeviceBuffer)'s drop, as a pure function so that it is tested
//! without a GPU.
//!
//! The memory is freed with `cuMemFreeAsync` on one stream, which must be ordered after every
//! use of the memory on every stream. The stream that frees is the last one noted as a user
//! (the allocating stream when nobody else used it): its own uses are before the free by stream
//! order. Every other stream is waited for through an event: an event recorded right after its
//! last use when one is known — the allocating stream of a data loader's copy, whose use ends
//! with that copy — and otherwise an event recorded on it at the free, after everything issued
//! there so far.
//!
//! The difference matters for a copy stream that runs ahead: a batch dropped on the compute
//! stream must not make the compute stream wait for the copies of later batches issued on the
//! copy stream since (issue 19, defect 5).

/// What the freeing stream waits for, for one other stream that used the memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Wait<S, E> {
    /// Everything issued on stream `S` so far: its use of the memory may still be in flight.
    Tail(S),
    /// An event recorded on a stream right after its last use of the memory.
    Event(E),
}

/// Where to free and what to wait for first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FreePlan<S, E> {
    /// The stream whose `cuMemFreeAsync` frees the memory.
    pub free_on: S,
    /// What `free_on` waits for before the free, in this order.
    pub waits: Vec<Wait<S, E>>,
}

/// The plan for memory allocated on `allocated_on`, whose allocating stream is done with it at
/// `allocation_done` when that is known, and that `users` (other streams, in the order they
/// were noted; none equal to `allocated_on`) used as well.
pub(crate) fn plan_free<S: Clone, E: Clone>(
    allocated_on: &S,
    allocation_done: Option<&E>,
    users: &[S],
) -> FreePlan<S, E> {
    let Some((last, others)) = users.split_last() else {
        // Only the allocating stream used it: stream order alone suffices.
        return FreePlan {
            free_on: allocated_on.clone(),
            waits: Vec::new(),
        };
    };
    let mut waits: Vec<Wait<S, E>> = others.iter().cloned().map(Wait::Tail).collect();
    waits.push(match allocation_done {
        Some(done) => Wait::Event(done.clone()),
        None => Wait::Tail(allocated_on.clone()),
    });
    FreePlan {
        free_on: last.clone(),
        waits,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_only_the_allocating_stream_used_is_freed_there_without_waits() {
        let plan = plan_free::<&str, u32>(&"compute", None, &[]);
        assert_eq!(plan.free_on, "compute");
        assert!(plan.waits.is_empty());
        // A known end of use changes nothing when nobody else used the memory.
        assert_eq!(plan_free(&"copy", Some(&7u32), &[]).waits, vec![]);
    }

    #[test]
    fn a_loaded_batch_is_freed_on_compute_after_its_own_copy_not_the_copy_streams_tail() {
        // The loader: allocated and filled on the copy stream (its copy ends at event 1), used
        // on the compute stream, dropped while later batches are being copied.
        let plan = plan_free(&"copy", Some(&1u32), &["compute"]);
        assert_eq!(plan.free_on, "compute");
        assert_eq!(plan.waits, vec![Wait::Event(1)]);
    }

    #[test]
    fn streams_with_no_known_end_of_use_are_waited_for_at_their_tail() {
        // A gradient bucket: allocated on compute, read by the comm stream (recordStream).
        let plan = plan_free::<&str, u32>(&"compute", None, &["comm"]);
        assert_eq!(plan.free_on, "comm");
        assert_eq!(plan.waits, vec![Wait::Tail("compute")]);
        // Several users: the last frees, the others and the allocating stream are waited for.
        let plan = plan_free(&"copy", Some(&4u32), &["comm", "compute"]);
        assert_eq!(plan.free_on, "compute");
        assert_eq!(plan.waits, vec![Wait::Tail("comm"), Wait::Event(4)]);
    }
}
