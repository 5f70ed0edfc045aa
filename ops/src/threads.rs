//! The compute thread pool.
//!
//! tandem's CPU kernels split large work across rayon's global pool. [`set_num_threads`] sizes
//! that pool once, at start-up, and makes the calling thread (normally the one that runs the
//! training loop) one of its workers: a kernel called from it then runs its share in place
//! instead of handing everything to the pool and sleeping until the pool is done — a handoff
//! that costs two context switches per parallel kernel. With one thread no kernel goes through
//! the pool at all (see `util::parallel`).

use tandem_core::{Error, Result};

/// Sizes rayon's global pool to `threads` compute threads (0: one per core), counting the
/// calling thread as one of them when `threads > 1`. Call it once, before the first op; a
/// second call, or one after something else built the global pool, is an error.
///
/// With one thread the calling thread is not made a worker: background threads (a data
/// loader's prefetch, a communication stream) that use a kernel would otherwise wait for the
/// training thread to enter the pool.
pub fn set_num_threads(threads: usize) -> Result<()> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let mut builder = rayon::ThreadPoolBuilder::new().num_threads(threads);
    if threads > 1 {
        builder = builder.use_current_thread();
    }
    builder.build_global().map_err(|e| {
        Error::invalid(
            "set_num_threads",
            format!("cannot size the thread pool to {threads}: {e} (call it once, before any op)"),
        )
    })
}
