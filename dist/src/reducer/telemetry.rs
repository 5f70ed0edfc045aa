//! Overlap telemetry: when each bucket's all-reduce was issued, started and ended relative to
//! backward, and how much communication was left exposed after backward's compute finished.
//!
//! *Exposed* communication is the time from the end of backward's computation to the end of the
//! last bucket's reduction: what the step waits for. Everything else of the communication ran
//! while backward was still computing. [`Telemetry::write_chrome_trace`] writes the steps as a
//! Chrome trace (open it in Perfetto or `chrome://tracing`) with one track for compute and one
//! for communication.
//!
//! The times come from [`Event`]s, not from the host: the reducer records one on the compute
//! stream when forward returns and when backward's last gradient is issued, one on the comm
//! stream before and after each bucket's collective, and one on the comm stream after the last
//! bucket. On the CPU each event carries the instant it completed. A CUDA event has no host
//! time, only its distance to another event of the device ([`Event::elapsed_until`]); its
//! instant is placed on the host clock as the step's forward-end instant plus the device time
//! from the forward-end event, so the device timeline keeps its own spacing. A step is turned
//! into a [`StepTiming`] once all its events are complete: at once on the CPU, after the device
//! has run the step on CUDA (the reducer never waits for that inside backward).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use tandem_core::Event;

pub use super::overlap::OverlapSummary;
use super::overlap::{self, StepOverlap};

/// Timing of one bucket's reduction.
#[derive(Clone, Debug)]
pub struct BucketTiming {
    /// Index of the bucket.
    pub bucket: usize,
    /// Bytes of the bucket.
    pub bytes: usize,
    /// When the reducer issued the collective (host time, on the thread running backward).
    pub issued: Instant,
    /// When the comm stream started it (`None` when its events could not be timed).
    pub started: Option<Instant>,
    /// When the comm stream finished it.
    pub ended: Option<Instant>,
}

/// A bucket's timing events, recorded on the comm stream around its collective.
pub(crate) struct PendingBucket {
    pub bucket: usize,
    pub bytes: usize,
    pub issued: Instant,
    pub start: Event,
    pub end: Event,
    /// The bucket's NVTX range, from its issue until the step is filed (dropping ends it).
    #[allow(dead_code)] // Held for its `Drop`, which ends the range.
    pub nvtx: crate::nvtx_ranges::Range,
}

/// A step whose events may not all be complete yet.
pub(crate) struct PendingStep {
    /// When the wrapped module's forward was called (host time).
    pub forward_start: Instant,
    /// When forward returned, and the event recorded then on the compute stream: the anchor
    /// that places device events on the host clock.
    pub forward_end: (Instant, Event),
    /// Recorded on the compute stream when backward's last gradient had been issued.
    pub backward_end: Event,
    /// Recorded on the comm stream after the last bucket.
    pub comm_end: Event,
    pub buckets: Vec<PendingBucket>,
}

impl PendingStep {
    fn events(&self) -> impl Iterator<Item = &Event> {
        [&self.backward_end, &self.comm_end]
            .into_iter()
            .chain(self.buckets.iter().flat_map(|b| [&b.start, &b.end]))
    }

    /// Whether every event of the step is complete (never blocks).
    pub fn is_complete(&self) -> bool {
        self.events().all(Event::is_complete)
    }

    /// The step's times; waits for its events.
    pub fn resolve(self) -> StepTiming {
        let (origin, anchor) = &self.forward_end;
        // A host event knows its instant; a device event is placed by its distance from the
        // forward-end event of the same device. An event that can be neither (it failed, or the
        // anchor is of another device) is left untimed.
        let at = |e: &Event| -> Option<Instant> {
            if let Some(t) = e.completed_at() {
                return Some(t);
            }
            e.synchronize().ok()?;
            anchor.elapsed_until(e).ok().map(|d| *origin + d)
        };
        let backward_compute_end = at(&self.backward_end).unwrap_or(*origin);
        let buckets: Vec<BucketTiming> = self
            .buckets
            .iter()
            .map(|b| BucketTiming {
                bucket: b.bucket,
                bytes: b.bytes,
                issued: b.issued,
                started: at(&b.start),
                ended: at(&b.end),
            })
            .collect();
        let last_bucket = buckets.iter().filter_map(|b| b.ended).max();
        let comm_end = at(&self.comm_end)
            .or(last_bucket)
            .unwrap_or(backward_compute_end);
        StepTiming {
            forward_start: self.forward_start.min(*origin),
            forward_end: *origin,
            backward_compute_end,
            comm_end,
            buckets,
        }
    }
}

/// Timing of one synchronised step.
#[derive(Clone, Debug)]
pub struct StepTiming {
    /// When the wrapped module's forward was called (host time, after the buffer broadcast).
    pub forward_start: Instant,
    /// When forward returned (backward starts soon after, once the loss is computed).
    pub forward_end: Instant,
    /// When backward's computation finished: on the CPU when the backward-finished hook ran, on
    /// CUDA when the device finished the kernels issued before it.
    pub backward_compute_end: Instant,
    /// When the last bucket was reduced (the comm stream passed the event recorded after it).
    pub comm_end: Instant,
    /// Every bucket, in launch order.
    pub buckets: Vec<BucketTiming>,
}

impl StepTiming {
    /// Backward computation time (from the end of forward).
    pub fn backward_compute(&self) -> Duration {
        self.backward_compute_end
            .saturating_duration_since(self.forward_end)
    }

    /// Communication the step waited for after backward's computation, as
    /// [`StepOverlap::exposed`] defines it: from the end of backward's computation to the end of
    /// the last bucket, capped by [`comm_busy`](Self::comm_busy).
    pub fn exposed_comm(&self) -> Duration {
        Duration::from_secs_f64(self.overlap().exposed)
    }

    /// The buckets' reduction time on the comm stream: the length of the union of their spans
    /// ([`StepOverlap::comm`]).
    pub fn comm_busy(&self) -> Duration {
        Duration::from_secs_f64(self.overlap().comm)
    }

    /// The step's overlap, in seconds from the end of forward: backward's computation and the
    /// spans of the buckets whose events could be timed. [`Telemetry::summary`] and the
    /// [`Timeline`](crate::Timeline)'s `summarize_spans` both measure a step
    /// this way, so they agree on the same run.
    pub fn overlap(&self) -> StepOverlap {
        let secs = |t: Instant| t.saturating_duration_since(self.forward_end).as_secs_f64();
        let comm: Vec<(f64, f64)> = self
            .buckets
            .iter()
            .filter_map(|b| Some((secs(b.started?), secs(b.ended?))))
            .collect();
        StepOverlap::of((0.0, secs(self.backward_compute_end)), &comm)
    }
}

/// Per-step records of a DDP model, most recent last (bounded).
#[derive(Clone, Debug, Default)]
pub struct Telemetry {
    steps: Vec<StepTiming>,
    dropped: usize,
    /// The stragglers of the steps gathered across ranks so far (`stragglers.rs`).
    pub(crate) stragglers: crate::stragglers::StragglerSummary,
}

const MAX_STEPS: usize = 10_000;

impl Telemetry {
    pub(crate) fn push(&mut self, step: StepTiming) {
        if self.steps.len() == MAX_STEPS {
            self.steps.remove(0);
            self.dropped += 1;
        }
        self.steps.push(step);
    }

    /// The recorded steps.
    pub fn steps(&self) -> &[StepTiming] {
        &self.steps
    }

    /// Steps recorded since the start, including those no longer kept.
    pub(crate) fn total_steps(&self) -> usize {
        self.dropped + self.steps.len()
    }

    /// Which rank was slowest, by how much and how often, over the steps gathered across the
    /// ranks so far (see [`crate::stragglers`]); the same on every rank.
    pub fn stragglers(&self) -> &crate::stragglers::StragglerSummary {
        &self.stragglers
    }

    /// Summary over the recorded steps ([`overlap::summarize`] of each step's
    /// [`StepTiming::overlap`]).
    pub fn summary(&self) -> OverlapSummary {
        let steps: Vec<StepOverlap> = self.steps.iter().map(StepTiming::overlap).collect();
        overlap::summarize(&steps)
    }

    /// Writes the steps as a Chrome trace (JSON) to `path`.
    pub fn write_chrome_trace(&self, path: &Path) -> std::io::Result<()> {
        let Some(origin) = self.steps.first().map(|s| s.forward_end) else {
            return std::fs::write(path, "[]");
        };
        let us = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e6;
        let mut out = String::from("[\n");
        let mut first = true;
        let mut event = |name: &str, tid: u32, start: f64, end: f64, out: &mut String| {
            if !first {
                out.push_str(",\n");
            }
            first = false;
            let _ = write!(
                out,
                r#"{{"name":"{name}","ph":"X","pid":0,"tid":{tid},"ts":{start:.1},"dur":{:.1}}}"#,
                (end - start).max(0.0)
            );
        };
        for (i, s) in self.steps.iter().enumerate() {
            event(
                &format!("backward (step {i})"),
                0,
                us(s.forward_end),
                us(s.backward_compute_end),
                &mut out,
            );
            for b in &s.buckets {
                if let (Some(st), Some(en)) = (b.started, b.ended) {
                    event(
                        &format!("all_reduce bucket {} ({} KiB)", b.bucket, b.bytes >> 10),
                        1,
                        us(st),
                        us(en),
                        &mut out,
                    );
                }
            }
            event(
                &format!("exposed comm (step {i})"),
                0,
                us(s.backward_compute_end),
                us(s.comm_end),
                &mut out,
            );
        }
        out.push_str("\n]\n");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, out)?;
        std::fs::rename(tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::{summarize_spans, Phase, Span, SpanKind, Track};

    /// A step whose backward computed for 10 ms after forward; `buckets` are (start, end) in ms
    /// after forward; the comm-end event lands 1 ms after the last bucket, as it may on a busy
    /// comm stream.
    fn step(forward_end: Instant, buckets: &[(u64, u64)]) -> StepTiming {
        let at = |ms: u64| forward_end + Duration::from_millis(ms);
        let last = buckets.iter().map(|b| b.1).max().unwrap_or(10);
        StepTiming {
            forward_start: forward_end,
            forward_end,
            backward_compute_end: at(10),
            comm_end: at(last + 1),
            buckets: buckets
                .iter()
                .enumerate()
                .map(|(i, &(s, e))| BucketTiming {
                    bucket: i,
                    bytes: 1024,
                    issued: at(s),
                    started: Some(at(s)),
                    ended: Some(at(e)),
                })
                .collect(),
        }
    }

    /// The spans a timeline shows for `steps`: backward from forward's end to the end of its
    /// computation, and one all-reduce span per bucket, in seconds from the first step.
    fn spans_of(steps: &[StepTiming]) -> Vec<Span> {
        let origin = steps[0].forward_end;
        let secs = |t: Instant| t.saturating_duration_since(origin).as_secs_f64();
        let mut spans = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            let step = i as u64;
            spans.push(Span {
                step,
                track: Track::Compute,
                kind: SpanKind::Phase(Phase::Backward),
                start: secs(s.forward_end),
                end: secs(s.backward_compute_end),
            });
            for b in &s.buckets {
                spans.push(Span {
                    step,
                    track: Track::Comm,
                    kind: SpanKind::AllReduce {
                        bucket: b.bucket,
                        bytes: b.bytes,
                    },
                    start: secs(b.started.unwrap()),
                    end: secs(b.ended.unwrap()),
                });
            }
        }
        spans
    }

    #[test]
    fn ddp_summary_and_timeline_summary_give_the_same_hidden_fraction_for_one_recording() {
        let t0 = Instant::now();
        let steps = [
            // Bucket spans that overlap by timer granularity (2..6 and 5..9), and a tail after
            // backward (9..12).
            step(t0, &[(2, 6), (5, 9), (9, 12)]),
            step(t0 + Duration::from_millis(50), &[(1, 3), (8, 11)]),
        ];
        let mut telemetry = Telemetry::default();
        for s in &steps {
            telemetry.push(s.clone());
        }
        let from_ddp = telemetry.summary();
        let from_timeline = summarize_spans(&spans_of(&steps));
        assert_eq!(from_ddp.steps, from_timeline.steps);
        // Communication is the union of the bucket spans: 10 + 5 ms; exposed 2 + 1 ms.
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        assert!((ms(from_ddp.comm) - 15.0).abs() < 1e-6, "{from_ddp}");
        assert!((ms(from_ddp.exposed) - 3.0).abs() < 1e-6, "{from_ddp}");
        assert!(
            (from_ddp.hidden_fraction - from_timeline.hidden_fraction).abs() < 1e-9,
            "DDP {from_ddp} vs timeline {from_timeline}"
        );
        assert_eq!(from_ddp.to_string(), from_timeline.to_string());
    }
}
