//! Which rank is slow: every rank's forward, backward and last-bucket wait, gathered across the
//! ranks every K synchronised steps, and the slowest rank named.
//!
//! Each rank's [`Telemetry`](crate::Telemetry) records, per synchronised step, its forward time
//! (host time around the wrapped module's forward), its backward computation, and how long it
//! then waited for the last bucket's reduction. Every [`DdpConfig::straggler_every`] training
//! forwards (default 100), [`DistributedDataParallel`] all-reduces those few floats per step and
//! rank (one `world × K × 4` f64 tensor: a few KiB every K steps) and folds them into a
//! [`StragglerSummary`], which [`Telemetry::stragglers`](crate::Telemetry::stragglers) returns
//! on every rank. [`DistributedDataParallel::gather_step_times`] gathers the steps not gathered
//! yet (call it on every rank at the end of a run, before printing the summary).
//!
//! **Attribution.** In a synchronised step every rank ends together, so a slow rank shows up in
//! two ways: its own compute (forward + backward) is longer than the median rank's, while the
//! others wait for its contribution to the last bucket. A step's straggler is therefore the rank
//! whose compute exceeds the median rank's the most, when that excess is at least
//! [`NOTABLE_EXCESS`] of the median and above [`MIN_EXCESS_SECS`] ("slow compute"). When no rank
//! computes notably longer, the rank that waited on the last bucket the most longer than the
//! median is named ("slow link": its compute was normal but its reduction took longer).
//!
//! The periodic gather runs at the start of a training forward (grad mode on) outside
//! [`DistributedDataParallel::join`], where every rank issues the same forwards; forwards under
//! `no_grad` (evaluation, which may be uneven across ranks) do not count. Inside a join the steps
//! are kept and gathered at the next gather after it.
//!
//! [`DdpConfig::straggler_every`]: crate::DdpConfig::straggler_every
//! [`DistributedDataParallel`]: crate::DistributedDataParallel
//! [`DistributedDataParallel::gather_step_times`]: crate::DistributedDataParallel::gather_step_times
//! [`DistributedDataParallel::join`]: crate::DistributedDataParallel::join

use std::fmt;

use tandem_core::{Device, Tensor};

use crate::reducer::telemetry::StepTiming;
use crate::{DistError, ProcessGroup, ReduceOp, Result};

/// Smallest excess over the median rank, as a share of the median, that makes a rank a step's
/// straggler.
pub const NOTABLE_EXCESS: f64 = 0.2;
/// Smallest excess over the median rank, in seconds, that makes a rank a step's straggler (timer
/// noise on tiny steps is not a straggler).
pub const MIN_EXCESS_SECS: f64 = 0.002;

/// One rank's times in one synchronised step, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankStepTimes {
    /// The wrapped module's forward.
    pub forward: f64,
    /// Backward's computation.
    pub backward: f64,
    /// From the end of backward's computation to the end of the last bucket's reduction.
    pub last_bucket_wait: f64,
}

impl RankStepTimes {
    /// The times of one recorded step.
    pub fn of(step: &StepTiming) -> RankStepTimes {
        RankStepTimes {
            forward: step
                .forward_end
                .saturating_duration_since(step.forward_start)
                .as_secs_f64(),
            backward: step.backward_compute().as_secs_f64(),
            last_bucket_wait: step
                .comm_end
                .saturating_duration_since(step.backward_compute_end)
                .as_secs_f64(),
        }
    }

    /// Forward and backward together.
    pub fn compute(&self) -> f64 {
        self.forward + self.backward
    }
}

/// Why a rank was a step's straggler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StragglerKind {
    /// Its forward + backward took longer than the median rank's.
    SlowCompute,
    /// Its compute was normal but it waited longer for the last bucket's reduction.
    SlowLink,
}

impl fmt::Display for StragglerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StragglerKind::SlowCompute => "slow compute",
            StragglerKind::SlowLink => "slow link",
        })
    }
}

/// Per rank, over the gathered steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStragglerStats {
    /// Steps in which this rank was the straggler for slow compute.
    pub slow_compute_steps: usize,
    /// Steps in which this rank was the straggler for a slow link.
    pub slow_link_steps: usize,
    /// Sum over those steps of its excess over the median rank (compute, or wait), in seconds.
    pub excess_secs: f64,
    /// Sum of its compute (forward + backward) over the gathered steps, in seconds.
    pub compute_secs: f64,
    /// Sum of its last-bucket waits over the gathered steps, in seconds.
    pub wait_secs: f64,
}

/// The slowest rank of a run, as [`StragglerSummary::slowest`] names it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Straggler {
    /// The rank.
    pub rank: usize,
    /// Its main cause (the kind of most of its straggler steps).
    pub kind: StragglerKind,
    /// Steps in which it was the straggler.
    pub steps: usize,
    /// Mean excess over the median rank in those steps, in seconds.
    pub mean_excess_secs: f64,
}

/// The stragglers of the gathered steps, identical on every rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StragglerSummary {
    /// Steps gathered from every rank.
    pub steps: usize,
    /// Per rank (empty before the first gather).
    pub ranks: Vec<RankStragglerStats>,
}

impl StragglerSummary {
    /// Folds in one step: `times[r]` is rank r's.
    pub fn add_step(&mut self, times: &[RankStepTimes]) {
        if times.is_empty() {
            return;
        }
        if self.ranks.len() < times.len() {
            self.ranks
                .resize(times.len(), RankStragglerStats::default());
        }
        self.steps += 1;
        for (stats, t) in self.ranks.iter_mut().zip(times) {
            stats.compute_secs += t.compute();
            stats.wait_secs += t.last_bucket_wait;
        }
        if let Some((rank, kind, excess)) = straggler_of(times) {
            let stats = &mut self.ranks[rank];
            match kind {
                StragglerKind::SlowCompute => stats.slow_compute_steps += 1,
                StragglerKind::SlowLink => stats.slow_link_steps += 1,
            }
            stats.excess_secs += excess;
        }
    }

    /// The rank that was a straggler in the most steps (ties: the larger total excess), or
    /// `None` when no step had one.
    pub fn slowest(&self) -> Option<Straggler> {
        let (rank, stats) = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, s)| s.slow_compute_steps + s.slow_link_steps > 0)
            .max_by(|(_, a), (_, b)| {
                let n = |s: &RankStragglerStats| s.slow_compute_steps + s.slow_link_steps;
                n(a).cmp(&n(b))
                    .then(a.excess_secs.total_cmp(&b.excess_secs))
            })?;
        let steps = stats.slow_compute_steps + stats.slow_link_steps;
        Some(Straggler {
            rank,
            kind: if stats.slow_compute_steps >= stats.slow_link_steps {
                StragglerKind::SlowCompute
            } else {
                StragglerKind::SlowLink
            },
            steps,
            mean_excess_secs: stats.excess_secs / steps as f64,
        })
    }
}

impl fmt::Display for StragglerSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.slowest() {
            None if self.steps == 0 => write!(f, "no steps gathered across ranks"),
            None => write!(f, "no straggler in {} steps", self.steps),
            Some(s) => {
                let stats = &self.ranks[s.rank];
                write!(
                    f,
                    "slowest rank {}: {} ({:.1} ms/step over the median rank) in {} of {} steps \
                     ({} slow compute, {} slow link)",
                    s.rank,
                    s.kind,
                    s.mean_excess_secs * 1e3,
                    s.steps,
                    self.steps,
                    stats.slow_compute_steps,
                    stats.slow_link_steps
                )
            }
        }
    }
}

/// The median of `values` (the lower middle for an even count, so that with two ranks the
/// faster one is the reference).
fn lower_median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[(values.len() - 1) / 2]
}

/// A step's straggler: the rank, why, and its excess over the median rank in seconds.
pub fn straggler_of(times: &[RankStepTimes]) -> Option<(usize, StragglerKind, f64)> {
    if times.len() < 2 {
        return None;
    }
    let notable = |excess: f64, median: f64| {
        excess >= MIN_EXCESS_SECS && excess >= NOTABLE_EXCESS * median.max(0.0)
    };
    let by_excess = |value: &dyn Fn(&RankStepTimes) -> f64| -> (usize, f64, f64) {
        let med = lower_median(times.iter().map(value).collect());
        let (rank, top) = times
            .iter()
            .map(value)
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, med));
        (rank, top - med, med)
    };
    let (rank, excess, med) = by_excess(&RankStepTimes::compute);
    if notable(excess, med) {
        return Some((rank, StragglerKind::SlowCompute, excess));
    }
    let (rank, excess, med) = by_excess(&|t| t.last_bucket_wait);
    // A wait is judged against the step's compute too: waits are short when all is well.
    let reference = med.max(lower_median(times.iter().map(|t| t.compute()).collect()) * 0.1);
    notable(excess, reference).then_some((rank, StragglerKind::SlowLink, excess))
}

/// Floats per step and rank in the gathered tensor: present, forward, backward, wait.
const FIELDS: usize = 4;

/// The label of the stragglers' gather in hang diagnoses (`all_reduce #42 (stragglers' step
/// times; f64 × 24)`).
pub(crate) const GATHER_LABEL: &str = "stragglers' step times";

/// All-reduces this rank's `local` step times (at most `window` of them, the most recent) with
/// every rank's; returns, per step index of the window, every rank's times, keeping only steps
/// that every rank recorded. Every rank must call it with the same `window`.
pub(crate) fn gather(
    group: &dyn ProcessGroup,
    device: Device,
    local: &[RankStepTimes],
    window: usize,
) -> Result<Vec<Vec<RankStepTimes>>> {
    let rank = group.rank();
    let world = group.world_size();
    let err = |e| DistError::tensor(rank, "gathering the step times of the ranks", e);
    let mut values = vec![0.0f64; world * window * FIELDS];
    // The most recent steps, aligned at the end of the window on every rank.
    let recent = &local[local.len().saturating_sub(window)..];
    let offset = window - recent.len();
    for (i, t) in recent.iter().enumerate() {
        let at = (rank * window + offset + i) * FIELDS;
        values[at..at + FIELDS].copy_from_slice(&[1.0, t.forward, t.backward, t.last_bucket_wait]);
    }
    let tensor = Tensor::from_vec(values, &[world, window, FIELDS], device).map_err(err)?;
    group.all_reduce(&tensor, ReduceOp::Sum)?.wait()?;
    let values = tensor.to_vec::<f64>().map_err(err)?;
    let steps = (0..window)
        .filter_map(|i| {
            let step: Vec<&[f64]> = (0..world)
                .map(|r| &values[(r * window + i) * FIELDS..(r * window + i + 1) * FIELDS])
                .collect();
            step.iter().all(|v| v[0] == 1.0).then(|| {
                step.iter()
                    .map(|v| RankStepTimes {
                        forward: v[1],
                        backward: v[2],
                        last_bucket_wait: v[3],
                    })
                    .collect()
            })
        })
        .collect();
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(forward: f64, backward: f64, wait: f64) -> RankStepTimes {
        RankStepTimes {
            forward,
            backward,
            last_bucket_wait: wait,
        }
    }

    #[test]
    fn a_rank_computing_longer_is_slow_compute_and_the_others_waiting_do_not_count() {
        // Rank 2 computes 60 ms longer; the others wait for it on the last bucket.
        let step = [
            t(0.01, 0.02, 0.061),
            t(0.01, 0.02, 0.06),
            t(0.07, 0.02, 0.001),
        ];
        let (rank, kind, excess) = straggler_of(&step).unwrap();
        assert_eq!((rank, kind), (2, StragglerKind::SlowCompute));
        assert!((excess - 0.06).abs() < 1e-9);
    }

    #[test]
    fn a_rank_with_normal_compute_waiting_longer_is_a_slow_link() {
        let step = [
            t(0.01, 0.02, 0.001),
            t(0.01, 0.021, 0.04),
            t(0.01, 0.02, 0.002),
        ];
        let (rank, kind, _) = straggler_of(&step).unwrap();
        assert_eq!((rank, kind), (1, StragglerKind::SlowLink));
    }

    #[test]
    fn even_ranks_and_timer_noise_name_no_straggler() {
        let step = [t(0.01, 0.02, 0.001), t(0.0101, 0.0201, 0.0015)];
        assert_eq!(straggler_of(&step), None);
        assert_eq!(straggler_of(&[t(1.0, 1.0, 1.0)]), None);
    }

    #[test]
    fn the_summary_names_the_most_frequent_straggler_by_how_much_and_how_often() {
        let mut summary = StragglerSummary::default();
        for i in 0..10 {
            let mut step = vec![t(0.01, 0.02, 0.001); 4];
            if i % 5 == 0 {
                step[0].forward += 0.05; // rank 0 twice
            } else {
                step[3].forward += 0.08; // rank 3 eight times
            }
            summary.add_step(&step);
        }
        let s = summary.slowest().unwrap();
        assert_eq!(
            (s.rank, s.kind, s.steps),
            (3, StragglerKind::SlowCompute, 8)
        );
        assert!((s.mean_excess_secs - 0.08).abs() < 1e-9);
        let text = summary.to_string();
        assert!(text.contains("slowest rank 3: slow compute"), "{text}");
        assert!(text.contains("8 of 10 steps"), "{text}");
    }
}
