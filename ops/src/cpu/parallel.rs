//! The one rule for when a CPU kernel forks onto the rayon pool.

/// Below this many elements a kernel runs on one thread: rayon's fork-join costs more.
pub(crate) const PARALLEL_THRESHOLD: usize = 1 << 15;

/// Whether a kernel touching `work` elements should split it across the rayon pool: only when
/// the work is large and the pool has more than one thread (with one thread, going through
/// rayon costs two context switches and gains nothing, since the calling thread is usually not
/// a pool worker).
pub(crate) fn parallel(work: usize) -> bool {
    work >= PARALLEL_THRESHOLD && rayon::current_num_threads() > 1
}

#[cfg(test)]
mod tests {
    #[test]
    fn small_work_never_goes_parallel() {
        assert!(!super::parallel(10));
    }
}
