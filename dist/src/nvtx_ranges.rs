//! NVTX ranges for Nsight Systems: what tandem's training loop is doing, by rank, on the CPU
//! thread rows of `nsys profile --trace=cuda,nvtx`.
//!
//! Two kinds of range: *pushed* ranges nest on the calling thread (a phase of a step: forward,
//! backward, optimizer, data — opened by [`Timeline::begin`](crate::Timeline::begin)), and
//! *started* ranges ([`Range`]) may end on another thread or later (a bucket's all-reduce, from
//! its issue inside backward to when the reducer learns it completed). Names carry the rank,
//! `rank 1: all_reduce bucket 3 (1024 KiB)`, so that the ranks of a job, profiled into one
//! report, stay apart.
//!
//! The `nvtx` crate compiles NVTX v3's header-only injection stub into the binary: with no
//! profiler attached every call returns at once, and nothing is loaded, so binaries without
//! CUDA run unchanged.

/// Opens a range named `rank {rank}: {what}` on the calling thread (nesting; close it with
/// [`pop`] on the same thread).
pub fn push(rank: usize, what: &str) {
    // Names are tandem's own (no NUL bytes, which the crate would reject).
    nvtx::range_push!("rank {rank}: {what}");
}

/// Closes the innermost range [`push`] opened on the calling thread.
pub fn pop() {
    nvtx::range_pop!();
}

/// Marks an instant, `rank {rank}: {what}`.
pub fn mark(rank: usize, what: &str) {
    nvtx::mark!("rank {rank}: {what}");
}

/// A range that is not tied to a thread; it ends when dropped.
pub struct Range {
    id: i32,
}

impl Range {
    /// Starts a range named `rank {rank}: {what}`.
    pub fn start(rank: usize, what: &str) -> Range {
        Range {
            id: nvtx::range_start!("rank {rank}: {what}"),
        }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        let id = self.id;
        nvtx::range_end!(id);
    }
}

impl std::fmt::Debug for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nvtx::Range({})", self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_no_ops_without_a_profiler() {
        // No tool is attached under `cargo test`: every call must return without effect.
        push(0, "forward");
        mark(0, "bucket 0 issued");
        let range = Range::start(1, "all_reduce bucket 0 (4 KiB)");
        pop();
        drop(range);
        // Ranges may end on another thread than the one that started them.
        let range = Range::start(0, "all_reduce bucket 1 (4 KiB)");
        std::thread::spawn(move || drop(range)).join().unwrap();
    }
}
