//! Whether ops record the graph on this thread (`no_grad` turns recording off).
//!
//! The flag is per thread: ranks that run as threads of one process, and the backward pass of
//! one rank, never change another thread's mode.

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops on this thread record the autograd graph.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Turns recording off until dropped, then restores the previous mode.
#[must_use = "recording resumes when the guard is dropped"]
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Disables recording on this thread.
    pub fn new() -> Self {
        NoGradGuard {
            previous: GRAD_ENABLED.with(|g| g.replace(false)),
        }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        GRAD_ENABLED.with(|g| g.set(previous));
    }
}

/// Runs `f` without recording the graph (evaluation, parameter updates).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard::new();
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_grad_nests_and_restores() {
        assert!(is_grad_enabled());
        no_grad(|| {
            assert!(!is_grad_enabled());
            no_grad(|| assert!(!is_grad_enabled()));
            assert!(!is_grad_enabled());
        });
        assert!(is_grad_enabled());
    }
}
