//! Scale-out projection: what a data-parallel step would cost on more devices, from per-bucket
//! timings measured on one device and a model of the link.
//!
//! A [`Recording`] holds what one device measured (DDP's telemetry over several steps): the
//! forward, backward and optimizer times of a step, and for every gradient bucket, in launch
//! order, its size and when it became ready (ms after backward began). [`simulate`] replays
//! one step on `p` devices: each bucket's all-reduce is queued on the comm stream behind
//! the previous one and starts once it is ready, taking the [`LinkModel`]'s ring time; the step
//! waits for the last bucket after backward (the *exposed* communication) and then runs the
//! optimizer. [`project`] does this for several device counts and finds the bucket cap that
//! minimises the step ([`rebucket`] merges the recorded buckets as DDP would assign them).
//!
//! What it leaves out, on purpose: the compute slowdown that communication kernels cause on a
//! GPU (NCCL uses some SMs), stragglers, and NCCL's choice of tree over ring for small
//! messages across nodes. The `tandem-project` command prints the projection; BENCHMARKS.md
//! compares it with measured steps on shaped CPU links.

mod link;
mod simulate;

pub use link::{LinkModel, LinkPreset};
pub use simulate::{project, rebucket, simulate, Projection, ProjectionRow, SimulatedStep};

use serde::{Deserialize, Serialize};

use crate::reducer::telemetry::StepTiming;

/// One bucket as recorded: size and readiness.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedBucket {
    /// Bytes of the bucket (all its gradients).
    pub bytes: u64,
    /// When its last gradient was ready, in ms after backward began (median over steps).
    pub ready_ms: f64,
}

/// Per-bucket timings and step phases measured on one device (the input of the projection).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    /// The model (free text, e.g. `resnet50`).
    pub model: String,
    /// Where it was measured (free text, e.g. `cpu, 2 cores` or `cuda:0, H100`).
    pub device: String,
    /// Samples per step on the device.
    pub batch_size: usize,
    /// Forward (and loss) per step, ms.
    pub forward_ms: f64,
    /// Backward's computation per step, ms.
    pub backward_ms: f64,
    /// Optimizer step (and anything else after backward), ms.
    pub optimizer_ms: f64,
    /// The buckets in launch order.
    pub buckets: Vec<RecordedBucket>,
    /// Anything a reader should know (how it was measured, caveats).
    #[serde(default)]
    pub note: String,
}

/// Which clock gives a bucket's readiness in [`Recording::from_steps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadyClock {
    /// When the reducer issued the bucket (host time): exact on the CPU, where the hook runs
    /// when the gradient is computed; on a GPU the host runs ahead of the device.
    Issued,
    /// When the comm stream started the bucket: the device's time on a GPU (in a world of one,
    /// or with little communication, the comm stream starts a bucket as soon as it is ready).
    Started,
}

impl Recording {
    /// A recording from DDP's step timings (e.g. [`Telemetry::steps`](crate::Telemetry::steps)
    /// of the timed steps): per bucket the median readiness after the end of forward, the
    /// median backward. Forward and optimizer times come from the caller, who timed the whole
    /// step. Steps whose bucket layout differs from the last step's are skipped (the first
    /// step, before DDP rebuilt its buckets).
    pub fn from_steps(
        steps: &[StepTiming],
        clock: ReadyClock,
        forward_ms: f64,
        optimizer_ms: f64,
    ) -> Option<Recording> {
        let last = steps.last()?;
        let layout: Vec<(usize, usize)> =
            last.buckets.iter().map(|b| (b.bucket, b.bytes)).collect();
        let same: Vec<&StepTiming> = steps
            .iter()
            .filter(|s| {
                s.buckets
                    .iter()
                    .map(|b| (b.bucket, b.bytes))
                    .eq(layout.iter().copied())
            })
            .collect();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let mut backward: Vec<f64> = same.iter().map(|s| ms(s.backward_compute())).collect();
        let buckets = layout
            .iter()
            .enumerate()
            .map(|(i, &(_, bytes))| {
                let mut ready: Vec<f64> = same
                    .iter()
                    .filter_map(|s| {
                        let b = &s.buckets[i];
                        let at = match clock {
                            ReadyClock::Issued => Some(b.issued),
                            ReadyClock::Started => b.started,
                        }?;
                        Some(ms(at.saturating_duration_since(s.forward_end)))
                    })
                    .collect();
                RecordedBucket {
                    bytes: bytes as u64,
                    ready_ms: median(&mut ready),
                }
            })
            .collect();
        Some(Recording {
            model: String::new(),
            device: String::new(),
            batch_size: 0,
            forward_ms,
            backward_ms: median(&mut backward),
            optimizer_ms,
            buckets,
            note: String::new(),
        })
    }

    /// Checks that the numbers can be simulated (finite, non-negative), naming the first that
    /// cannot.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let phases = [
            ("forward_ms", self.forward_ms),
            ("backward_ms", self.backward_ms),
            ("optimizer_ms", self.optimizer_ms),
        ];
        for (name, v) in phases {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} = {v} must be a finite number ≥ 0"));
            }
        }
        for (i, b) in self.buckets.iter().enumerate() {
            if !(b.ready_ms.is_finite() && b.ready_ms >= 0.0) {
                return Err(format!(
                    "bucket {i}: ready_ms = {} must be finite and ≥ 0",
                    b.ready_ms
                ));
            }
        }
        Ok(())
    }

    /// Total gradient bytes.
    pub fn total_bytes(&self) -> u64 {
        self.buckets.iter().map(|b| b.bytes).sum()
    }

    /// Forward + backward + optimizer: one device's step without communication.
    pub fn compute_ms(&self) -> f64 {
        self.forward_ms + self.backward_ms + self.optimizer_ms
    }

    /// The same recording with every time multiplied by `factor` (to stand in for a faster or
    /// slower device with the same proportions).
    pub fn scaled(&self, factor: f64) -> Recording {
        let mut r = self.clone();
        r.forward_ms *= factor;
        r.backward_ms *= factor;
        r.optimizer_ms *= factor;
        for b in &mut r.buckets {
            b.ready_ms *= factor;
        }
        r
    }
}

/// Median of `v` (0 when empty); sorts `v`.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}
