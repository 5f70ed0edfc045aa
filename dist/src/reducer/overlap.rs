//! How much of a step's communication was hidden behind backward: interval arithmetic over the
//! spans of one step.
//!
//! The comm stream runs one collective at a time, but bucket spans taken from events may touch
//! or (by timer granularity) overlap, so communication is measured as the length of the *union*
//! of the bucket spans. The communication the step waited for — *exposed* — is the stretch from
//! the end of backward's computation to the end of the last bucket, capped by the communication
//! itself (an idle gap on the comm stream is not communication); the rest was *hidden* behind
//! backward. This is the definition [`Telemetry::summary`](crate::Telemetry::summary) uses too,
//! so the two agree on the same step.
//!
//! It lives in `reducer` (next to the telemetry that measures it) and the timeline reaches it
//! as `timeline::overlap`, so that `timeline` depends on `reducer` and not the other way.

use std::time::Duration;

/// Overlap of one step, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepOverlap {
    /// Backward's computation: from its start to the end of its last kernel.
    pub backward: f64,
    /// Length of the union of the bucket spans.
    pub comm: f64,
    /// Communication after backward's computation ended.
    pub exposed: f64,
}

impl StepOverlap {
    /// The overlap of a step whose backward computed over `backward` (start, end) and whose
    /// buckets were reduced over `comm`; times in seconds on one clock.
    pub fn of(backward: (f64, f64), comm: &[(f64, f64)]) -> StepOverlap {
        let busy = union_length(comm);
        let last_end = comm
            .iter()
            .map(|&(_, e)| e)
            .fold(f64::NEG_INFINITY, f64::max);
        let exposed = if comm.is_empty() {
            0.0
        } else {
            (last_end - backward.1).clamp(0.0, busy)
        };
        StepOverlap {
            backward: (backward.1 - backward.0).max(0.0),
            comm: busy,
            exposed,
        }
    }

    /// Communication that ran while backward was still computing.
    pub fn hidden(&self) -> f64 {
        self.comm - self.exposed
    }
}

/// Total length covered by `spans` (start, end); empty or reversed spans count nothing.
pub fn union_length(spans: &[(f64, f64)]) -> f64 {
    let mut sorted: Vec<(f64, f64)> = spans.iter().copied().filter(|(s, e)| e > s).collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut current: Option<(f64, f64)> = None;
    for (s, e) in sorted {
        current = match current {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    if let Some((cs, ce)) = current {
        total += ce - cs;
    }
    total
}

/// Totals over the recorded steps.
#[derive(Clone, Debug)]
pub struct OverlapSummary {
    /// Number of steps.
    pub steps: usize,
    /// Total backward computation.
    pub backward_compute: Duration,
    /// Total communication (buckets' busy time on the comm stream).
    pub comm: Duration,
    /// Total communication the steps waited for after backward's computation.
    pub exposed: Duration,
    /// Share of communication hidden behind backward, in [0, 1].
    pub hidden_fraction: f64,
}

impl std::fmt::Display for OverlapSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} steps: backward compute {:.1} ms/step, communication {:.1} ms/step, exposed {:.1} ms/step, {:.0}% of communication hidden behind backward",
            self.steps,
            per_step(self.backward_compute, self.steps),
            per_step(self.comm, self.steps),
            per_step(self.exposed, self.steps),
            100.0 * self.hidden_fraction.clamp(0.0, 1.0)
        )
    }
}

fn per_step(d: Duration, steps: usize) -> f64 {
    if steps == 0 {
        0.0
    } else {
        d.as_secs_f64() * 1e3 / steps as f64
    }
}

/// Sums the overlap of several steps into the summary the examples print.
pub fn summarize(steps: &[StepOverlap]) -> OverlapSummary {
    let secs = |f: &dyn Fn(&StepOverlap) -> f64| {
        Duration::from_secs_f64(steps.iter().map(f).sum::<f64>().max(0.0))
    };
    let comm = secs(&|s| s.comm);
    let exposed = secs(&|s| s.exposed);
    OverlapSummary {
        steps: steps.len(),
        backward_compute: secs(&|s| s.backward),
        comm,
        exposed,
        hidden_fraction: if comm.is_zero() {
            0.0
        } else {
            1.0 - exposed.as_secs_f64() / comm.as_secs_f64()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn union_merges_overlapping_and_touching_spans_and_ignores_empty_ones() {
        let spans = [
            (5.0, 6.0),
            (0.0, 2.0),
            (1.0, 3.0),
            (3.0, 4.0),
            (7.0, 7.0),
            (9.0, 8.0),
        ];
        // [0, 4] and [5, 6].
        assert!(close(union_length(&spans), 5.0));
        assert_eq!(union_length(&[]), 0.0);
    }

    #[test]
    fn communication_inside_backward_is_hidden_and_the_tail_after_it_is_exposed() {
        // Backward 0..10; buckets 2..4, 6..9 and 9.5..12: 2 ms of the last bucket are exposed.
        let s = StepOverlap::of((0.0, 10.0), &[(2.0, 4.0), (6.0, 9.0), (9.5, 12.0)]);
        assert!(close(s.backward, 10.0));
        assert!(close(s.comm, 7.5));
        assert!(close(s.exposed, 2.0));
        assert!(close(s.hidden(), 5.5));
    }

    #[test]
    fn exposed_never_exceeds_the_communication_itself() {
        // A single 1-unit bucket that starts long after backward: all of it exposed, not the gap.
        let s = StepOverlap::of((0.0, 1.0), &[(5.0, 6.0)]);
        assert!(close(s.exposed, 1.0));
        assert!(close(s.hidden(), 0.0));
        let none = StepOverlap::of((0.0, 1.0), &[]);
        assert_eq!((none.comm, none.exposed), (0.0, 0.0));
    }

    #[test]
    fn summary_adds_steps_and_gives_the_hidden_share() {
        let steps = [
            StepOverlap::of((0.0, 0.010), &[(0.002, 0.006), (0.008, 0.012)]), // 8 ms, 2 exposed
            StepOverlap::of((0.0, 0.010), &[(0.001, 0.003)]),                 // 2 ms, 0 exposed
        ];
        let s = summarize(&steps);
        assert_eq!(s.steps, 2);
        assert!(close(s.comm.as_secs_f64(), 0.010));
        assert!(close(s.exposed.as_secs_f64(), 0.002));
        assert!(close(s.backward_compute.as_secs_f64(), 0.020));
        assert!(close(s.hidden_fraction, 0.8));
    }
}
