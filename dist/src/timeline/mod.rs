//! tandem's own timeline of training steps, for when Nsight is not at hand: forward, backward,
//! the optimizer step and data loading on the compute stream, each bucket's all-reduce on the
//! comm stream, written as a Chrome trace (open it in Perfetto or `chrome://tracing`) with one
//! track per stream per rank, and summarised as the share of communication hidden behind
//! backward.
//!
//! ```text
//! let mut timeline = Timeline::new(rank, device)?;
//! for batch in loader {
//!     timeline.begin_step()?;
//!     timeline.begin(Phase::Forward)?;  let logits = ddp.forward(&x)?;  timeline.end(Phase::Forward)?;
//!     timeline.begin(Phase::Backward)?; loss.backward()?;               timeline.end(Phase::Backward)?;
//!     timeline.begin(Phase::Optimizer)?; optimizer.step()?;             timeline.end(Phase::Optimizer)?;
//! }
//! timeline.record_ddp(&ddp.telemetry());
//! println!("{}", timeline.overlap_summary()?);
//! timeline.write_chrome_trace(Path::new("trace.json"))?;
//! ```
//!
//! **Times come from stream events.** Each phase boundary is an [`Event`] recorded on the
//! compute stream. On the CPU, whose compute stream is the calling thread, an event carries the
//! host instant it was recorded. On CUDA an event has no host time, only its distance to another
//! event of the device ([`Event::elapsed_until`]): every step records an *origin* event when it
//! begins, the step's events are placed by their distance from it, and each origin by its
//! distance from the previous step's origin (the first at the host instant it was recorded), so
//! the trace keeps the device's own spacing and the host never waits for the device while
//! training: a step's events are read once the device has passed them (at most
//! `MAX_PENDING_STEPS` steps behind, then the oldest is waited for).
//!
//! **Buckets come from DDP's telemetry** ([`Telemetry`]), whose comm-stream events are anchored
//! at the end of forward; [`Timeline::record_ddp`] places each DDP step in the timeline step
//! whose host interval contains its forward end, aligning its forward end with the end of that
//! step's forward phase on CUDA. With DDP attached, a backward phase ends where backward's
//! computation ended; what follows until `end(Phase::Backward)` is the wait for the last
//! buckets, drawn as its own span.
//!
//! **NVTX.** [`Timeline::begin`] and [`Timeline::end`] also open and close an NVTX range named
//! `rank K: <phase>` on the calling thread ([`crate::nvtx_ranges`]), so that Nsight Systems
//! shows the same phases; without a profiler attached a range costs nothing worth measuring.

mod chrome;
pub use crate::reducer::overlap;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use tandem_core::{Device, Event, Stream};

use crate::reducer::telemetry::{OverlapSummary, StepTiming, Telemetry};
use crate::{DistError, Result};
pub use chrome::merge_chrome_traces;
use overlap::StepOverlap;

/// A phase of a training step, timed on the compute stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Fetching the batch (and copying it to the device).
    Data,
    /// The model's forward (and the loss).
    Forward,
    /// Backward, including DDP's bucket launches.
    Backward,
    /// The optimizer step.
    Optimizer,
}

impl Phase {
    /// The phase's name in traces and NVTX ranges.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Which stream a span ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Track {
    /// The device's compute stream.
    Compute,
    /// The process group's communication stream.
    Comm,
}

impl Track {
    fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute stream",
            Track::Comm => "comm stream",
        }
    }

    fn tid(self) -> u32 {
        match self {
            Track::Compute => 0,
            Track::Comm => 1,
        }
    }
}

/// What a span shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// A phase of the step (a backward phase ends where backward's computation ended).
    Phase(Phase),
    /// The compute stream waiting, after backward's computation, for the last buckets.
    WaitForComm,
    /// One bucket's all-reduce on the comm stream.
    AllReduce {
        /// The bucket's index.
        bucket: usize,
        /// The bucket's size in bytes.
        bytes: usize,
    },
}

impl SpanKind {
    /// The span's name in traces.
    pub fn name(&self) -> String {
        match self {
            SpanKind::Phase(p) => p.name().to_string(),
            SpanKind::WaitForComm => "wait for all-reduce".to_string(),
            SpanKind::AllReduce { bucket, bytes } => {
                format!("all_reduce bucket {bucket} ({} KiB)", bytes.div_ceil(1024))
            }
        }
    }
}

/// One timed interval, in seconds since the timeline was created.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The step it belongs to (0-based, counting [`Timeline::begin_step`] calls).
    pub step: u64,
    /// The stream it ran on.
    pub track: Track,
    /// What it shows.
    pub kind: SpanKind,
    /// Start, in seconds since the timeline was created (negative if before).
    pub start: f64,
    /// End, in the same clock.
    pub end: f64,
}

/// A phase whose boundary events may not be complete yet.
struct PendingPhase {
    phase: Phase,
    start: Event,
    end: Event,
}

/// A step whose events may not be complete yet.
struct PendingStep {
    index: u64,
    host_begin: Instant,
    host_end: Instant,
    origin: Event,
    phases: Vec<PendingPhase>,
    open: Vec<(Phase, Event)>,
}

/// A step with its times known.
struct ResolvedStep {
    index: u64,
    host_begin: Instant,
    host_end: Instant,
    /// (phase, start, end) in seconds since the timeline's creation.
    phases: Vec<(Phase, f64, f64)>,
}

/// How many steps may wait for the device before the oldest is waited for.
const MAX_PENDING_STEPS: usize = 16;

/// How many resolved steps (and DDP steps) a timeline keeps; older ones are dropped.
const MAX_STEPS: usize = 10_000;

/// A per-rank timeline of training steps (see the module documentation).
pub struct Timeline {
    rank: usize,
    device: Device,
    compute: Stream,
    /// The host instant and the wall-clock time the timeline was created: the zero of its
    /// clock, and what places it on the wall clock when traces of several ranks are merged.
    created: (Instant, SystemTime),
    current: Option<PendingStep>,
    pending: VecDeque<PendingStep>,
    /// The last resolved step's origin: its time and its event (CUDA origins chain from it).
    last_origin: Option<(f64, Event)>,
    steps: VecDeque<ResolvedStep>,
    ddp: VecDeque<StepTiming>,
    next_index: u64,
}

impl Timeline {
    /// A timeline for `rank` whose phases are timed on the compute stream of `device`.
    pub fn new(rank: usize, device: Device) -> Result<Timeline> {
        let compute = Stream::compute(device).map_err(|e| {
            DistError::tensor(rank, format!("Timeline: the compute stream of {device}"), e)
        })?;
        Ok(Timeline {
            rank,
            device,
            compute,
            created: (Instant::now(), SystemTime::now()),
            current: None,
            pending: VecDeque::new(),
            last_origin: None,
            steps: VecDeque::new(),
            ddp: VecDeque::new(),
            next_index: 0,
        })
    }

    /// The rank the timeline belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The device whose compute stream it times.
    pub fn device(&self) -> Device {
        self.device
    }

    fn record(&self, what: &str) -> Result<Event> {
        self.compute.record_event().map_err(|e| {
            let context = format!(
                "Timeline: recording {what} on the compute stream of {}",
                self.device
            );
            DistError::tensor(self.rank, context, e)
        })
    }

    /// Seconds from the timeline's creation to `t` (negative if before).
    fn secs(&self, t: Instant) -> f64 {
        let zero = self.created.0;
        match t.checked_duration_since(zero) {
            Some(d) => d.as_secs_f64(),
            None => -zero.duration_since(t).as_secs_f64(),
        }
    }

    /// Starts a step (ending the current one, if any): records the step's origin event.
    pub fn begin_step(&mut self) -> Result<()> {
        self.end_step()?;
        let origin = self.record("the step's origin")?;
        self.current = Some(PendingStep {
            index: self.next_index,
            host_begin: Instant::now(),
            host_end: Instant::now(),
            origin,
            phases: Vec::new(),
            open: Vec::new(),
        });
        self.next_index += 1;
        Ok(())
    }

    /// Ends the current step (phases still open end now). Files the steps whose events the
    /// device has passed, without waiting for the others.
    pub fn end_step(&mut self) -> Result<()> {
        let Some(mut step) = self.current.take() else {
            return Ok(());
        };
        while let Some((phase, _)) = step.open.last() {
            let phase = *phase;
            self.current = Some(step);
            self.end(phase)?;
            step = match self.current.take() {
                Some(step) => step,
                None => return Ok(()),
            };
        }
        step.host_end = Instant::now();
        self.pending.push_back(step);
        self.file(false);
        Ok(())
    }

    /// Opens `phase` (starting a step if none is open): records its start on the compute
    /// stream and opens the NVTX range `rank K: <phase>` on this thread.
    pub fn begin(&mut self, phase: Phase) -> Result<()> {
        if self.current.is_none() {
            self.begin_step()?;
        }
        let start = self.record(phase.name())?;
        crate::nvtx_ranges::push(self.rank, phase.name());
        if let Some(step) = self.current.as_mut() {
            step.open.push((phase, start));
        }
        Ok(())
    }

    /// Closes `phase`, which must be open in the current step (phases nest: the innermost
    /// closes first).
    pub fn end(&mut self, phase: Phase) -> Result<()> {
        let rank = self.rank;
        let open = self
            .current
            .as_ref()
            .and_then(|s| s.open.last())
            .map(|(p, _)| *p);
        if open != Some(phase) {
            return Err(DistError::config(
                rank,
                format!(
                    "Timeline::end({}): the innermost open phase is {}",
                    phase.name(),
                    open.map_or("none", Phase::name)
                ),
            ));
        }
        let end = self.record(phase.name())?;
        crate::nvtx_ranges::pop();
        if let Some(step) = self.current.as_mut() {
            if let Some((phase, start)) = step.open.pop() {
                step.phases.push(PendingPhase { phase, start, end });
            }
        }
        Ok(())
    }

    /// Takes DDP's per-bucket timings for the steps not taken yet (call it at the end of the
    /// run, or now and then: DDP keeps its last 10 000 steps).
    pub fn record_ddp(&mut self, telemetry: &Telemetry) {
        let newest = self.ddp.back().map(|s| s.forward_end);
        for step in telemetry.steps() {
            if newest.is_none_or(|t| step.forward_end > t) {
                if self.ddp.len() == MAX_STEPS {
                    self.ddp.pop_front();
                }
                self.ddp.push_back(step.clone());
            }
        }
    }

    /// Resolves pending steps: all of them (waiting for the device) with `wait`, otherwise
    /// those the device has passed and the oldest beyond the bound.
    fn file(&mut self, wait: bool) {
        while let Some(step) = self.pending.front() {
            let complete = step.origin.is_complete()
                && step
                    .phases
                    .iter()
                    .all(|p| p.start.is_complete() && p.end.is_complete());
            if !(wait || complete || self.pending.len() > MAX_PENDING_STEPS) {
                break;
            }
            if let Some(step) = self.pending.pop_front() {
                let resolved = self.resolve(step);
                if self.steps.len() == MAX_STEPS {
                    self.steps.pop_front();
                }
                self.steps.push_back(resolved);
            }
        }
    }

    fn resolve(&mut self, step: PendingStep) -> ResolvedStep {
        // A host event knows its instant. A device event is placed by its distance from the
        // step's origin, and the origin by its distance from the previous origin; the first
        // origin (or one that cannot be timed) sits at the host instant the step began.
        let origin = match step.origin.completed_at() {
            Some(t) => self.secs(t),
            None => {
                let chained = self.last_origin.as_ref().and_then(|(t, prev)| {
                    step.origin.synchronize().ok()?;
                    prev.elapsed_until(&step.origin)
                        .ok()
                        .map(|d| t + d.as_secs_f64())
                });
                chained.unwrap_or_else(|| self.secs(step.host_begin))
            }
        };
        let at = |e: &Event| -> f64 {
            if let Some(t) = e.completed_at() {
                return self.secs(t);
            }
            let from_origin = e
                .synchronize()
                .ok()
                .and_then(|()| step.origin.elapsed_until(e).ok());
            from_origin.map_or(origin, |d| origin + d.as_secs_f64())
        };
        let phases = step
            .phases
            .iter()
            .map(|p| (p.phase, at(&p.start), at(&p.end)))
            .collect();
        self.last_origin = Some((origin, step.origin.clone()));
        ResolvedStep {
            index: step.index,
            host_begin: step.host_begin,
            host_end: step.host_end,
            phases,
        }
    }

    /// Ends the current step and waits for the device to pass every recorded event.
    pub fn finish(&mut self) -> Result<()> {
        self.end_step()?;
        self.file(true);
        Ok(())
    }

    /// Every span so far, steps in order (finishes the timeline first: see
    /// [`Timeline::finish`]).
    pub fn spans(&mut self) -> Result<Vec<Span>> {
        self.finish()?;
        let mut spans = Vec::new();
        let mut ddp = self.ddp.iter().peekable();
        for step in &self.steps {
            // DDP steps whose forward ended inside this step's host interval belong to it
            // (the last one, should several: DDP files one per synchronised backward).
            let mut mine = None;
            while let Some(d) = ddp.peek() {
                if d.forward_end < step.host_begin {
                    ddp.next();
                } else if d.forward_end <= step.host_end {
                    mine = ddp.next();
                } else {
                    break;
                }
            }
            self.step_spans(step, mine, &mut spans);
        }
        Ok(spans)
    }

    fn step_spans(&self, step: &ResolvedStep, ddp: Option<&StepTiming>, spans: &mut Vec<Span>) {
        let span = |track, kind, start: f64, end: f64| Span {
            step: step.index,
            track,
            kind,
            start,
            end: end.max(start),
        };
        // DDP's times are on the host clock anchored at its forward end; on a device the
        // forward end of this step's forward phase is where that anchor belongs.
        let forward_end = step
            .phases
            .iter()
            .find(|(p, _, _)| *p == Phase::Forward)
            .map(|&(_, _, end)| end);
        let shift = match (ddp, forward_end, self.device) {
            (Some(d), Some(end), Device::Cuda(_)) => end - self.secs(d.forward_end),
            _ => 0.0,
        };
        let ddp_time = |t: Instant| self.secs(t) + shift;
        for &(phase, start, end) in &step.phases {
            match (phase, ddp) {
                (Phase::Backward, Some(d)) => {
                    let computed = ddp_time(d.backward_compute_end).clamp(start, end.max(start));
                    spans.push(span(
                        Track::Compute,
                        SpanKind::Phase(phase),
                        start,
                        computed,
                    ));
                    if end > computed {
                        spans.push(span(Track::Compute, SpanKind::WaitForComm, computed, end));
                    }
                }
                _ => spans.push(span(Track::Compute, SpanKind::Phase(phase), start, end)),
            }
        }
        if let Some(d) = ddp {
            if !step.phases.iter().any(|(p, _, _)| *p == Phase::Backward) {
                // Backward was not timed as a phase: DDP's own events bound it.
                let (start, end) = (ddp_time(d.forward_end), ddp_time(d.backward_compute_end));
                spans.push(span(
                    Track::Compute,
                    SpanKind::Phase(Phase::Backward),
                    start,
                    end,
                ));
            }
            for b in &d.buckets {
                if let (Some(s), Some(e)) = (b.started, b.ended) {
                    let kind = SpanKind::AllReduce {
                        bucket: b.bucket,
                        bytes: b.bytes,
                    };
                    spans.push(span(Track::Comm, kind, ddp_time(s), ddp_time(e)));
                }
            }
        }
    }

    /// Communication hidden behind backward over the steps that reduced buckets (finishes the
    /// timeline first).
    pub fn overlap_summary(&mut self) -> Result<OverlapSummary> {
        Ok(summarize_spans(&self.spans()?))
    }

    /// Writes this rank's timeline as a Chrome trace to `path`: process `rank K (device)`,
    /// one thread per stream, times in microseconds since the Unix epoch so that the traces of
    /// several ranks can be merged ([`merge_chrome_traces`]).
    pub fn write_chrome_trace(&mut self, path: &Path) -> Result<()> {
        let spans = self.spans()?;
        let epoch_us = self
            .created
            .1
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6);
        let label = format!("rank {} ({})", self.rank, self.device);
        chrome::write(path, self.rank, &label, epoch_us, &spans)
            .map_err(|e| DistError::io(format!("writing the Chrome trace {}", path.display()), e))
    }

    /// Where rank `rank` of a world of `world` writes its part of the trace `path`: `path`
    /// itself in a world of one, otherwise `path` with `.rankK` before its extension
    /// (`trace.json` → `trace.rank1.json`).
    pub fn rank_trace_path(path: &Path, rank: usize, world: usize) -> PathBuf {
        if world <= 1 {
            return path.to_path_buf();
        }
        let stem = path
            .file_stem()
            .map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
        let name = match path.extension() {
            Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
            None => format!("{stem}.rank{rank}"),
        };
        path.with_file_name(name)
    }
}

/// The overlap summary of `spans` (as [`Timeline::spans`] gives them): per step, backward is
/// the span of its backward phase and communication the union of its all-reduce spans; steps
/// without a backward span or without all-reduce spans do not count.
pub fn summarize_spans(spans: &[Span]) -> OverlapSummary {
    let mut steps: Vec<u64> = spans.iter().map(|s| s.step).collect();
    steps.sort_unstable();
    steps.dedup();
    let per_step: Vec<StepOverlap> = steps
        .into_iter()
        .filter_map(|step| {
            let of_step = || spans.iter().filter(move |s| s.step == step);
            let comm: Vec<(f64, f64)> = of_step()
                .filter(|s| matches!(s.kind, SpanKind::AllReduce { .. }))
                .map(|s| (s.start, s.end))
                .collect();
            if comm.is_empty() {
                return None;
            }
            let backward = of_step()
                .find(|s| s.kind == SpanKind::Phase(Phase::Backward))
                .map(|s| (s.start, s.end))?;
            Some(StepOverlap::of(backward, &comm))
        })
        .collect();
    overlap::summarize(&per_step)
}
