//! A per-op profiler: where a training step's time goes, by op and by forward or backward.
//!
//! ```text
//! tandem::core::profile::start();
//! for _ in 0..steps { /* forward, backward, optimizer step */ }
//! println!("{}", tandem::core::profile::stop());
//! ```
//!
//! Ops open a [`scope`] around their forward computation and the autograd engine opens one
//! around every node's backward, named after the op that recorded it. Only the outermost scope
//! on a thread is timed: an op's backward that calls other ops counts as that op's backward,
//! not as their forward. When the profiler is off a scope costs one atomic load.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

static ENABLED: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<Vec<ProfileRow>> = Mutex::new(Vec::new());
static STARTED: Mutex<Option<Instant>> = Mutex::new(None);

thread_local! {
    /// Scopes open on this thread (only the outermost one is timed).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Which pass a scope belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The op's forward computation.
    Forward,
    /// The op's backward (one autograd node), or other work during backward.
    Backward,
    /// Work outside forward and backward (optimizer steps, data handling).
    Other,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Other => "other",
        })
    }
}

/// Time spent in one op and phase.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    /// The op (as ops and autograd nodes name themselves: `conv2d`, `relu`, …).
    pub op: &'static str,
    /// Forward, backward or other.
    pub phase: Phase,
    /// How many scopes were timed.
    pub calls: u64,
    /// Their total wall-clock time.
    pub total: Duration,
}

/// What [`stop`] returns: every op and phase seen, most expensive first, and the wall-clock
/// time the profiler ran.
#[derive(Clone, Debug, Default)]
pub struct ProfileReport {
    /// One row per (op, phase), sorted by total time, largest first.
    pub rows: Vec<ProfileRow>,
    /// Time from [`start`] to [`stop`].
    pub wall: Duration,
}

impl ProfileReport {
    /// Total time per phase, summed over ops.
    pub fn phase_total(&self, phase: Phase) -> Duration {
        self.rows
            .iter()
            .filter(|r| r.phase == phase)
            .map(|r| r.total)
            .sum()
    }
}

impl fmt::Display for ProfileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wall = self.wall.as_secs_f64().max(f64::MIN_POSITIVE);
        writeln!(
            f,
            "{:<22} {:<9} {:>8} {:>11} {:>9}",
            "op", "phase", "calls", "total ms", "% of wall"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<22} {:<9} {:>8} {:>11.2} {:>8.1}%",
                r.op,
                r.phase.to_string(),
                r.calls,
                r.total.as_secs_f64() * 1e3,
                100.0 * r.total.as_secs_f64() / wall
            )?;
        }
        let timed: f64 = self.rows.iter().map(|r| r.total.as_secs_f64()).sum();
        write!(
            f,
            "timed {:.2} ms of {:.2} ms wall ({:.1}%; the rest is outside any op: framework \
             overhead, hooks, the caller's own code)",
            timed * 1e3,
            wall * 1e3,
            100.0 * timed / wall
        )
    }
}

/// Clears earlier results and starts timing scopes.
pub fn start() {
    TABLE.lock().clear();
    *STARTED.lock() = Some(Instant::now());
    ENABLED.store(true, Ordering::Release);
}

/// Stops timing and returns what was measured since [`start`].
pub fn stop() -> ProfileReport {
    ENABLED.store(false, Ordering::Release);
    let wall = STARTED
        .lock()
        .take()
        .map(|s| s.elapsed())
        .unwrap_or_default();
    let mut rows = std::mem::take(&mut *TABLE.lock());
    rows.sort_by_key(|r| std::cmp::Reverse(r.total));
    ProfileReport { rows, wall }
}

/// Whether the profiler is running.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A timed region; dropping it records the time (see [`scope`]).
#[must_use = "the scope is timed until it is dropped"]
pub struct Scope {
    /// Whether this scope incremented the thread's depth.
    nested: bool,
    /// Set for the outermost scope of the thread, which is the one timed.
    timed: Option<(Instant, &'static str, Phase)>,
}

/// Opens a timed scope for `op` in `phase`; the time is recorded when the scope is dropped.
/// Costs one atomic load while the profiler is off.
#[inline]
pub fn scope(op: &'static str, phase: Phase) -> Scope {
    if !ENABLED.load(Ordering::Relaxed) {
        return Scope {
            nested: false,
            timed: None,
        };
    }
    let outermost = DEPTH.with(|d| {
        let depth = d.get();
        d.set(depth + 1);
        depth == 0
    });
    Scope {
        nested: true,
        timed: outermost.then(|| (Instant::now(), op, phase)),
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.nested {
            DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        }
        if let Some((started, op, phase)) = self.timed.take() {
            let elapsed = started.elapsed();
            let mut table = TABLE.lock();
            match table.iter_mut().find(|r| r.op == op && r.phase == phase) {
                Some(row) => {
                    row.calls += 1;
                    row.total += elapsed;
                }
                None => table.push(ProfileRow {
                    op,
                    phase,
                    calls: 1,
                    total: elapsed,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the profiler is process-wide and tests run concurrently.
    #[test]
    fn only_outermost_scopes_are_timed_and_nothing_while_off() {
        {
            let _off = scope("ignored", Phase::Forward);
        }
        start();
        for _ in 0..3 {
            let _outer = scope("outer_op", Phase::Backward);
            let _inner = scope("inner_op", Phase::Forward);
            std::thread::sleep(Duration::from_millis(2));
        }
        let report = stop();
        {
            let _after = scope("after_stop", Phase::Forward);
        }
        let names: Vec<_> = report
            .rows
            .iter()
            .map(|r| (r.op, r.phase, r.calls))
            .collect();
        assert_eq!(names, vec![("outer_op", Phase::Backward, 3)]);
        assert!(report.rows[0].total >= Duration::from_millis(6));
        assert!(report.wall >= report.rows[0].total);
        assert_eq!(report.phase_total(Phase::Backward), report.rows[0].total);
        assert!(report.to_string().contains("outer_op"));
        assert!(!is_enabled());
    }
}
