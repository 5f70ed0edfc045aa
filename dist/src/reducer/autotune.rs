//! Self-tuning bucket cap ([`DdpConfig::auto_buckets`](crate::DdpConfig::auto_buckets)).
//!
//! After `warmup_steps` synchronised steps with the current buckets, rank 0 measures the link
//! from DDP's own bucket all-reduces (a least-squares line through each bucket's size and its
//! fastest reduction in the window: the intercept is the latency, the slope the bandwidth),
//! takes every parameter's median gradient-ready time in the window, and replays one step under
//! each candidate cap with the projection's ring model ([`crate::projection::simulate`]): the
//! parameters are assigned to buckets as DDP assigns them, a bucket is ready with its last
//! gradient, and the buckets queue on one comm stream. The cap with the least predicted exposed
//! communication wins (ties go to fewer buckets). Rank 0 broadcasts its decision, so every rank
//! re-buckets identically, and logs one line. Afterwards each window's measured exposure is
//! compared with the prediction; when they are far apart the cap is chosen again from the new
//! window's measurements, at most `max_retunes` times.
//!
//! Bucketing changes only which gradients travel together, never their values: the reduced
//! gradient of every parameter is the same sum over ranks whatever the cap.

use std::time::Instant;

use tandem_core::DType;

use tandem_core::Tensor;

use super::bucket::{self, BucketSet};
use super::telemetry::StepTiming;
use super::{file_timings, Layout, Reducer, State};
use crate::projection::{median, simulate, LinkModel, RecordedBucket, Recording};
use crate::{CollectiveLabel, DistError, Result};

/// Settings of the automatic bucket cap (see the module documentation of `reducer::autotune`
/// and the README's "what bucket size").
#[derive(Clone, Debug, PartialEq)]
pub struct AutoBuckets {
    /// Synchronised steps measured before each decision (with the buckets of the moment).
    /// Default: 3.
    pub warmup_steps: usize,
    /// The caps tried, in MiB. Default: 0.25, 0.5, 1, 2, 4, 8, 16, 25, 50.
    pub candidates_mb: Vec<f64>,
    /// How many times the cap may be chosen again after the first choice, when the measured
    /// exposure is far from the prediction. Default: 2.
    pub max_retunes: usize,
    /// "Far": the measured exposure exceeds `retune_ratio` × the prediction plus
    /// `retune_slack_ms`, or the prediction exceeds `retune_ratio` × the measurement plus
    /// `retune_slack_ms`. Default: 2.
    pub retune_ratio: f64,
    /// See `retune_ratio`, in ms per step: differences below it are timer noise. Default: 1.
    pub retune_slack_ms: f64,
}

impl Default for AutoBuckets {
    fn default() -> Self {
        AutoBuckets {
            warmup_steps: 3,
            candidates_mb: vec![0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0],
            max_retunes: 2,
            retune_ratio: 2.0,
            retune_slack_ms: 1.0,
        }
    }
}

impl AutoBuckets {
    /// Whether `measured_ms` of exposed communication is far from `predicted_ms`.
    pub fn is_far(&self, measured_ms: f64, predicted_ms: f64) -> bool {
        measured_ms > self.retune_ratio * predicted_ms + self.retune_slack_ms
            || predicted_ms > self.retune_ratio * measured_ms + self.retune_slack_ms
    }
}

/// One decision of the automatic bucket cap (identical on every rank: rank 0's, broadcast).
#[derive(Clone, Debug, PartialEq)]
pub struct BucketChoice {
    /// The synchronised backwards completed when it was taken.
    pub after_backwards: u64,
    /// The chosen cap, MiB.
    pub cap_mb: f64,
    /// Buckets under that cap.
    pub buckets: usize,
    /// Exposed communication per step predicted for that cap, ms.
    pub predicted_exposed_ms: f64,
    /// Exposed communication per step measured in the window before, ms (median).
    pub measured_exposed_ms: f64,
    /// The link fitted from the window's bucket reductions.
    pub link: LinkModel,
}

/// A parameter's gradient in a replay: its size, dtype (dtypes never share a bucket) and when it
/// became ready, ms after forward ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamReady {
    /// Bytes of its gradient.
    pub bytes: usize,
    /// Its dtype.
    pub dtype: DType,
    /// When it became ready, ms after forward ended.
    pub ready_ms: f64,
}

/// The cap [`choose_cap`] picked and what it predicts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapPrediction {
    /// The cap, MiB.
    pub cap_mb: f64,
    /// Buckets under it.
    pub buckets: usize,
    /// Predicted exposed communication per step, ms.
    pub exposed_ms: f64,
}

/// Bytes of `mb` MiB (at least 1).
pub(crate) fn mib(mb: f64) -> usize {
    ((mb * (1u64 << 20) as f64) as usize).max(1)
}

/// Replays one step on `world` ranks over `link` for every cap of `candidates_mb` (the first
/// bucket capped at the smaller of `first_bucket_mb` and the candidate, as DDP assigns it under
/// the automatic cap: a small model whose gradients all fit the 1 MiB first bucket could
/// otherwise never start communicating before backward ends) with the parameters in bucket
/// order `params`, and returns the cap with the least predicted exposed communication; among
/// caps within 1 µs of it, the one with the fewest buckets (then the smallest cap). `None` when
/// there are no candidates.
pub fn choose_cap(
    params: &[ParamReady],
    backward_ms: f64,
    link: &LinkModel,
    world: usize,
    candidates_mb: &[f64],
    first_bucket_mb: f64,
) -> Option<CapPrediction> {
    let order: Vec<usize> = (0..params.len()).collect();
    let bytes: Vec<usize> = params.iter().map(|p| p.bytes).collect();
    let dtypes: Vec<DType> = params.iter().map(|p| p.dtype).collect();
    let mut predictions: Vec<CapPrediction> = candidates_mb
        .iter()
        .filter(|c| c.is_finite() && **c > 0.0)
        .map(|&cap_mb| {
            let first = mib(first_bucket_mb).min(mib(cap_mb));
            let groups = bucket::assign(&order, &bytes, &dtypes, first, mib(cap_mb));
            let recording = replay_recording(params, &groups, backward_ms);
            CapPrediction {
                cap_mb,
                buckets: groups.len(),
                exposed_ms: simulate(&recording, world, link).exposed_ms,
            }
        })
        .collect();
    let least = predictions
        .iter()
        .map(|p| p.exposed_ms)
        .fold(f64::INFINITY, f64::min);
    predictions.retain(|p| p.exposed_ms <= least + 1e-3);
    predictions.into_iter().min_by(|a, b| {
        (a.buckets, a.cap_mb)
            .partial_cmp(&(b.buckets, b.cap_mb))
            .unwrap_or(std::cmp::Ordering::Equal)
    })
}

/// The buckets of `groups` as a recording: bytes and the ready time of their last member.
fn replay_recording(params: &[ParamReady], groups: &[Vec<usize>], backward_ms: f64) -> Recording {
    let buckets = groups
        .iter()
        .map(|g| RecordedBucket {
            bytes: g.iter().map(|&p| params[p].bytes as u64).sum(),
            ready_ms: g.iter().map(|&p| params[p].ready_ms).fold(0.0, f64::max),
        })
        .collect();
    Recording {
        model: String::new(),
        device: String::new(),
        batch_size: 0,
        forward_ms: 0.0,
        backward_ms,
        optimizer_ms: 0.0,
        buckets,
        note: String::new(),
    }
}

/// The link through `samples` (bytes, seconds of one all-reduce on `world` ranks): the
/// least-squares line `t = a + b · bytes` gives `α = a / 2(p-1)` and the bus bandwidth
/// `2(p-1)/p / b` ([`LinkModel::all_reduce_s`] inverted). With one distinct size the latency is
/// taken as 0; when the times do not grow with size, the link is taken as latency-bound (the
/// mean time per all-reduce, bytes free). `None` without samples or with one rank.
pub fn fit_link(samples: &[(u64, f64)], world: usize) -> Option<LinkModel> {
    if samples.is_empty() || world < 2 {
        return None;
    }
    let n = samples.len() as f64;
    let mean_x = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n;
    let mean_y = samples.iter().map(|s| s.1).sum::<f64>() / n;
    let sxx: f64 = samples.iter().map(|s| (s.0 as f64 - mean_x).powi(2)).sum();
    let sxy: f64 = samples
        .iter()
        .map(|s| (s.0 as f64 - mean_x) * (s.1 - mean_y))
        .sum();
    let (mut a, mut b) = if sxx > 0.0 {
        let b = sxy / sxx;
        (mean_y - b * mean_x, b)
    } else {
        (0.0, mean_y / mean_x.max(1.0))
    };
    if a < 0.0 {
        // A negative latency is noise: refit through the origin.
        let sx2: f64 = samples.iter().map(|s| (s.0 as f64).powi(2)).sum();
        let sxy0: f64 = samples.iter().map(|s| s.0 as f64 * s.1).sum();
        a = 0.0;
        b = if sx2 > 0.0 { sxy0 / sx2 } else { 0.0 };
    }
    if !(b > 0.0 && b.is_finite()) {
        // Times that do not grow with size (ranks waiting for each other dominate them): a
        // latency-bound link, every all-reduce costing the mean time.
        a = mean_y.max(0.0);
        b = 1e-18;
    }
    if !a.is_finite() {
        return None;
    }
    let steps = 2.0 * (world as f64 - 1.0);
    Some(LinkModel {
        alpha_s: a / steps,
        busbw_bytes_per_s: steps / world as f64 / b,
    })
}

/// What a window of synchronised steps measured, as rank 0 needs it for a decision.
pub(crate) struct WindowMeasurement {
    /// The parameters in bucket order with their median ready times (scaled to the device's
    /// backward where the host ran ahead of it).
    pub params: Vec<ParamReady>,
    /// Median backward computation, ms.
    pub backward_ms: f64,
    /// Median exposed communication, ms.
    pub exposed_ms: f64,
    /// Per bucket: its bytes and its fastest reduction in the window, seconds.
    pub link_samples: Vec<(u64, f64)>,
}

/// Measures a window: `steps` are its step timings (the buckets of the current layout),
/// `ready_ms` per step and per parameter (in bucket `order`) the ready times recorded by the
/// hooks; `bytes` and `dtypes` per parameter. `None` when the window is empty.
pub(crate) fn measure_window(
    steps: &[StepTiming],
    ready_ms: &[Vec<f64>],
    order: &[usize],
    bytes: &[usize],
    dtypes: &[DType],
) -> Option<WindowMeasurement> {
    if steps.is_empty() || ready_ms.is_empty() {
        return None;
    }
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let backward_ms = median(
        &mut steps
            .iter()
            .map(|s| ms(s.backward_compute()))
            .collect::<Vec<_>>(),
    );
    let exposed_ms = median(
        &mut steps
            .iter()
            .map(|s| ms(s.exposed_comm()))
            .collect::<Vec<_>>(),
    );
    let mut fastest: Vec<Option<(u64, f64)>> = Vec::new();
    for s in steps {
        for (i, b) in s.buckets.iter().enumerate() {
            let (Some(st), Some(en)) = (b.started, b.ended) else {
                continue;
            };
            let t = en.saturating_duration_since(st).as_secs_f64();
            if fastest.len() <= i {
                fastest.resize(i + 1, None);
            }
            fastest[i] = match fastest[i] {
                Some((_, f)) if f <= t => fastest[i],
                _ => Some((b.bytes as u64, t)),
            };
        }
    }
    let mut ready: Vec<f64> = order
        .iter()
        .map(|&p| {
            median(
                &mut ready_ms
                    .iter()
                    .filter_map(|r| r.get(p).copied())
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    // On a GPU the hooks run when the host issues a gradient's kernels, ahead of the device:
    // stretch the host's ready times over the device's backward.
    let last = ready.iter().copied().fold(0.0, f64::max);
    if last > 0.0 && backward_ms > last {
        ready.iter_mut().for_each(|r| *r *= backward_ms / last);
    }
    let params = order
        .iter()
        .zip(ready)
        .map(|(&p, ready_ms)| ParamReady {
            bytes: bytes[p],
            dtype: dtypes[p],
            ready_ms,
        })
        .collect();
    Some(WindowMeasurement {
        params,
        backward_ms,
        exposed_ms,
        link_samples: fastest.into_iter().flatten().collect(),
    })
}

/// The tuner's state inside the reducer.
pub(crate) struct Tuner {
    pub config: AutoBuckets,
    /// The synchronised backward count at which the next decision is taken (`u64::MAX`: none).
    pub next_decision: u64,
    /// Decisions left (the first choice plus the re-tunes).
    pub decisions_left: usize,
    /// The prediction of the last choice (ms), once a choice was made.
    pub predicted_ms: Option<f64>,
    /// The current cap, bytes.
    pub cap_bytes: usize,
    /// Per parameter: when its gradient became ready in the current synchronised backward.
    pub ready_at: Vec<Option<Instant>>,
    /// Per synchronised step of the window (the last `warmup_steps`): per parameter, ready
    /// ms after forward ended.
    pub window: Vec<Vec<f64>>,
    /// Synchronised steps between decisions: `warmup_steps`, doubled after each decision
    /// that kept the cap (the measurement goes on at a shrinking cost).
    pub interval: u64,
    /// Every choice so far.
    pub choices: Vec<BucketChoice>,
}

impl Tuner {
    /// A tuner for `params` parameters starting at `cap_bytes`, deciding first after
    /// `first_decision` synchronised backwards.
    pub fn new(config: AutoBuckets, params: usize, cap_bytes: usize, first_decision: u64) -> Tuner {
        let decisions_left = config.max_retunes + 1;
        let interval = config.warmup_steps.max(1) as u64;
        Tuner {
            interval,
            config,
            next_decision: first_decision,
            decisions_left,
            predicted_ms: None,
            cap_bytes,
            ready_at: vec![None; params],
            window: Vec::new(),
            choices: Vec::new(),
        }
    }

    /// Files the ready times of the synchronised backward that just finished (relative to
    /// `forward_end`); a parameter without one counts as ready at the end of backward.
    pub fn end_backward(&mut self, forward_end: Instant, backward_end: Instant) {
        if self.next_decision == u64::MAX {
            return;
        }
        let ms = |t: Instant| t.saturating_duration_since(forward_end).as_secs_f64() * 1e3;
        let step = self
            .ready_at
            .iter_mut()
            .map(|r| r.take().map_or(ms(backward_end), ms))
            .collect();
        self.window.push(step);
        let keep = self.config.warmup_steps.max(1);
        if self.window.len() > keep {
            self.window.remove(0);
        }
    }

    /// Starts a new window of `warmup_steps` after the buckets changed at `backwards`.
    pub fn restart(&mut self, backwards: u64) {
        self.window.clear();
        self.interval = self.config.warmup_steps.max(1) as u64;
        if self.next_decision != u64::MAX {
            self.next_decision = backwards + self.interval;
        }
    }
}

/// Rank 0's decision as broadcast: action (1: a choice), cap MiB, buckets, predicted ms,
/// measured ms, α s, bus bandwidth bytes/s.
const DECISION_LEN: usize = 7;

impl Reducer {
    /// Takes the automatic bucket cap's decision when one is due: rank 0 measures and decides,
    /// every rank receives the decision and re-buckets alike. Outside backward (from
    /// `prepare_forward`), so the host may wait.
    pub(super) fn auto_tune(&self, state: &mut State) -> Result<()> {
        let backwards = state.sync_backwards;
        match &state.tune {
            Some(t) if backwards >= t.next_decision => {}
            _ => return Ok(()),
        }
        let rank = self.group.rank();
        let decision = if rank == 0 {
            self.decide(state)
        } else {
            [0.0; DECISION_LEN]
        };
        let err = |e| DistError::tensor(rank, "agreeing on the automatic bucket cap", e);
        let t = Tensor::from_vec(decision.to_vec(), &[DECISION_LEN], self.device).map_err(err)?;
        crate::with_collective_label(CollectiveLabel::Named("automatic bucket cap"), || {
            self.group.broadcast(&t, 0)
        })?
        .wait()?;
        let d = t.to_vec::<f64>().map_err(err)?;
        let Some(tuner) = state.tune.as_mut() else {
            return Ok(());
        };
        if d[0] != 1.0 {
            // The prediction held (or nothing could be measured): look again later.
            tuner.window.clear();
            tuner.interval = tuner.interval.saturating_mul(2).min(1 << 20);
            tuner.next_decision = backwards + tuner.interval;
            return Ok(());
        }
        let choice = BucketChoice {
            after_backwards: backwards,
            cap_mb: d[1],
            buckets: d[2] as usize,
            predicted_exposed_ms: d[3],
            measured_exposed_ms: d[4],
            link: LinkModel {
                alpha_s: d[5],
                busbw_bytes_per_s: d[6],
            },
        };
        if rank == 0 {
            eprintln!("{}", describe(&choice, tuner));
        }
        tuner.decisions_left = tuner.decisions_left.saturating_sub(1);
        tuner.predicted_ms = Some(choice.predicted_exposed_ms);
        let cap_bytes = mib(choice.cap_mb);
        let changed = cap_bytes != tuner.cap_bytes;
        tuner.cap_bytes = cap_bytes;
        tuner.choices.push(choice);
        if tuner.decisions_left == 0 {
            tuner.next_decision = u64::MAX;
        }
        tuner.restart(backwards);
        if changed {
            let order = state.rebuild.order.clone();
            let BucketSet { buckets, slots } =
                Self::layout(rank, &self.params, &order, &self.caps(state))?;
            state.layout = Layout { buckets, slots };
        }
        Ok(())
    }

    /// Rank 0's decision from the window just measured (see `DECISION_LEN`).
    fn decide(&self, state: &mut State) -> [f64; DECISION_LEN] {
        let none = [0.0; DECISION_LEN];
        file_timings(&mut state.timing, true);
        let Some(tuner) = state.tune.as_ref() else {
            return none;
        };
        let steps = state.timing.telemetry.steps();
        let n = tuner.window.len().min(steps.len());
        let bytes: Vec<usize> = self
            .params
            .iter()
            .map(|(_, t)| t.numel() * t.dtype().size_in_bytes())
            .collect();
        let dtypes: Vec<DType> = self.params.iter().map(|(_, t)| t.dtype()).collect();
        let Some(m) = measure_window(
            &steps[steps.len() - n..],
            &tuner.window,
            &state.rebuild.order,
            &bytes,
            &dtypes,
        ) else {
            return none;
        };
        if let Some(predicted) = tuner.predicted_ms {
            if !tuner.config.is_far(m.exposed_ms, predicted) {
                return none;
            }
        }
        let world = self.group.world_size();
        let Some(link) = fit_link(&m.link_samples, world) else {
            return none;
        };
        let first_mb = self.config.first_bucket_bytes as f64 / (1u64 << 20) as f64;
        let candidates = &tuner.config.candidates_mb;
        match choose_cap(&m.params, m.backward_ms, &link, world, candidates, first_mb) {
            Some(c) => [
                1.0,
                c.cap_mb,
                c.buckets as f64,
                c.exposed_ms,
                m.exposed_ms,
                link.alpha_s,
                link.busbw_bytes_per_s,
            ],
            None => none,
        }
    }
}

/// The line rank 0 logs for `choice`.
fn describe(choice: &BucketChoice, tuner: &Tuner) -> String {
    let kind = match tuner.choices.len() {
        0 => "bucket cap".to_string(),
        k => format!("re-tune {k} of {}: bucket cap", tuner.config.max_retunes),
    };
    format!(
        "DDP auto buckets after {} synchronised steps: {kind} {} MiB ({} buckets), predicted \
         exposed communication {:.3} ms/step (measured {:.3} ms/step with a cap of {:.4} MiB); \
         link {}",
        choice.after_backwards,
        choice.cap_mb,
        choice.buckets,
        choice.predicted_exposed_ms,
        choice.measured_exposed_ms,
        tuner.cap_bytes as f64 / (1u64 << 20) as f64,
        choice.link
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fitted_link_recovers_latency_and_bandwidth() {
        let link = LinkModel::new(0.5, 200.0);
        let samples: Vec<(u64, f64)> = [1u64 << 16, 1 << 20, 4 << 20]
            .iter()
            .map(|&b| (b, link.all_reduce_s(b, 3)))
            .collect();
        let fit = fit_link(&samples, 3).unwrap();
        assert!((fit.alpha_s - link.alpha_s).abs() < 1e-9, "{fit}");
        assert!((fit.busbw_bytes_per_s / link.busbw_bytes_per_s - 1.0).abs() < 1e-6);
        assert!(fit_link(&samples, 1).is_none());
        assert!(fit_link(&[], 2).is_none());
    }
}
