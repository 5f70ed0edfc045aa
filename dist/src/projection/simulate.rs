//! Replaying a recorded step on `p` devices: bucket all-reduces queued on one comm stream
//! behind backward, and the bucket cap that minimises the step.

use super::{LinkModel, RecordedBucket, Recording};

/// One simulated step on `p` devices, in ms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimulatedStep {
    /// Devices.
    pub devices: usize,
    /// The whole step: forward + backward + exposed communication + optimizer.
    pub step_ms: f64,
    /// Communication after backward's computation (what the step waited for).
    pub exposed_ms: f64,
    /// All-reduce time, summed over the buckets.
    pub comm_ms: f64,
    /// Throughput relative to one device with the same per-device batch:
    /// `p · compute / step`.
    pub speedup: f64,
}

/// Replays `recording` on `p` devices over `link`: bucket `i` starts when it is ready and the
/// comm stream has finished bucket `i-1`, and takes `link`'s ring time.
pub fn simulate(recording: &Recording, p: usize, link: &LinkModel) -> SimulatedStep {
    let mut comm_free = 0.0f64; // ms after backward began
    let mut comm = 0.0;
    for b in &recording.buckets {
        let t = link.all_reduce_s(b.bytes, p) * 1e3;
        comm_free = comm_free.max(b.ready_ms) + t;
        comm += t;
    }
    let exposed = if recording.buckets.is_empty() {
        0.0
    } else {
        (comm_free - recording.backward_ms).max(0.0)
    };
    let step = recording.compute_ms() + exposed;
    SimulatedStep {
        devices: p,
        step_ms: step,
        exposed_ms: exposed,
        comm_ms: comm,
        speedup: if step > 0.0 {
            p as f64 * recording.compute_ms() / step
        } else {
            p as f64
        },
    }
}

/// Merges the recorded buckets (in launch order) into buckets of at most `cap_bytes` (the first
/// at most `first_cap_bytes`), as DDP assigns parameters: a bucket closes when the next
/// recorded bucket would push it past its cap. A merged bucket is ready when its last member
/// is. Record with small buckets (e.g. `--bucket-cap-mb 0.01`) so that caps can be explored.
pub fn rebucket(recording: &Recording, first_cap_bytes: u64, cap_bytes: u64) -> Recording {
    let mut merged: Vec<RecordedBucket> = Vec::new();
    let mut current: Option<RecordedBucket> = None;
    for b in &recording.buckets {
        let cap = if merged.is_empty() {
            first_cap_bytes
        } else {
            cap_bytes
        };
        current = match current.take() {
            Some(c) if c.bytes + b.bytes <= cap => Some(RecordedBucket {
                bytes: c.bytes + b.bytes,
                ready_ms: c.ready_ms.max(b.ready_ms),
            }),
            Some(c) => {
                merged.push(c);
                Some(b.clone())
            }
            None => Some(b.clone()),
        };
    }
    merged.extend(current);
    Recording {
        buckets: merged,
        ..recording.clone()
    }
}

/// One row of a projection: a device count, its step with the recorded buckets, and the best
/// bucket cap found.
#[derive(Clone, Debug, PartialEq)]
pub struct ProjectionRow {
    /// The link the ring runs at.
    pub link: LinkModel,
    /// The step with the buckets as recorded (or as `--bucket-cap-mb` merged them).
    pub step: SimulatedStep,
    /// The cap (MiB) of the best step among the caps tried, and that step.
    pub best_cap_mib: f64,
    /// The step at the best cap.
    pub best: SimulatedStep,
}

/// A projection over several device counts.
#[derive(Clone, Debug, PartialEq)]
pub struct Projection {
    /// One row per device count, in the order asked.
    pub rows: Vec<ProjectionRow>,
}

/// Projects `recording` onto each of `devices`, with `link_for(p)` the link of a `p`-device
/// ring; tries every cap of `caps_mib` (DDP's first bucket stays at `first_cap_mib`, or the
/// cap if smaller) to find the one that minimises the step.
pub fn project(
    recording: &Recording,
    devices: &[usize],
    link_for: &dyn Fn(usize) -> LinkModel,
    caps_mib: &[f64],
    first_cap_mib: f64,
) -> Projection {
    let mib = |m: f64| (m * 1024.0 * 1024.0).max(0.0) as u64;
    let rows = devices
        .iter()
        .map(|&p| {
            let link = link_for(p);
            let step = simulate(recording, p, &link);
            let mut best = (f64::NAN, step);
            for &cap in caps_mib {
                let merged = rebucket(recording, mib(first_cap_mib.min(cap)), mib(cap));
                let s = simulate(&merged, p, &link);
                if best.0.is_nan() || s.step_ms < best.1.step_ms - 1e-9 {
                    best = (cap, s);
                }
            }
            ProjectionRow {
                link,
                step,
                best_cap_mib: best.0,
                best: best.1,
            }
        })
        .collect();
    Projection { rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recording(buckets: &[(u64, f64)]) -> Recording {
        Recording {
            model: "test".into(),
            device: "cpu".into(),
            batch_size: 1,
            forward_ms: 10.0,
            backward_ms: 20.0,
            optimizer_ms: 5.0,
            buckets: buckets
                .iter()
                .map(|&(bytes, ready_ms)| RecordedBucket { bytes, ready_ms })
                .collect(),
            note: String::new(),
        }
    }

    /// 1 ms per MB on two devices, no latency.
    fn link() -> LinkModel {
        LinkModel::new(1.0, 0.0)
    }

    #[test]
    fn buckets_queue_behind_each_other_and_what_ends_after_backward_is_exposed() {
        // Ready at 5, 6 and 18 ms; 4, 4 and 5 ms each: 5→9, 9→13, 18→23: 3 ms exposed.
        let r = recording(&[(4_000_000, 5.0), (4_000_000, 6.0), (5_000_000, 18.0)]);
        let s = simulate(&r, 2, &link());
        assert!((s.comm_ms - 13.0).abs() < 1e-9, "{s:?}");
        assert!((s.exposed_ms - 3.0).abs() < 1e-9, "{s:?}");
        assert!((s.step_ms - 38.0).abs() < 1e-9, "{s:?}");
        assert!((s.speedup - 2.0 * 35.0 / 38.0).abs() < 1e-9, "{s:?}");
        // One device: no communication, the step is the compute.
        let one = simulate(&r, 1, &link());
        assert_eq!((one.step_ms, one.exposed_ms, one.speedup), (35.0, 0.0, 1.0));
    }

    #[test]
    fn rebucketing_merges_in_order_under_the_caps_and_a_merged_bucket_waits_for_its_last_member() {
        let r = recording(&[(3, 1.0), (3, 2.0), (3, 3.0), (3, 4.0), (10, 5.0)]);
        // First cap 3: [3]; then cap 7: [3, 3], [3], [10].
        let m = rebucket(&r, 3, 7);
        let got: Vec<(u64, f64)> = m.buckets.iter().map(|b| (b.bytes, b.ready_ms)).collect();
        assert_eq!(got, vec![(3, 1.0), (6, 3.0), (3, 4.0), (10, 5.0)]);
        assert_eq!(m.total_bytes(), r.total_bytes());
    }

    #[test]
    fn the_best_cap_trades_latency_against_waiting_for_the_last_bucket() {
        // 20 buckets of 1 MB ready 1 ms apart during a 20 ms backward; 1 ms latency per bucket
        // (α = 0.5 ms, 2 steps on two devices), 1 ms per MB.
        let buckets: Vec<(u64, f64)> = (0..20).map(|i| (1_000_000, i as f64 + 1.0)).collect();
        let r = recording(&buckets);
        let link = |_p: usize| LinkModel::new(1.0, 500.0);
        let caps = [0.5, 2.0, 100.0];
        let proj = project(&r, &[2], &link, &caps, 100.0);
        let row = &proj.rows[0];
        // Each 1 MB bucket alone (cap 0.5 MiB): 2 ms each, bucket k ends at 1 + 2k: 41 ms, 21
        // exposed. One 20 MB bucket (cap 100 MiB): ready at 20, 21 ms: ends at 41, 21 exposed.
        // Pairs (cap 2 MiB): 3 ms each, ready at 2, 4, …: bucket k ends at 2 + 3k = 32, 12
        // exposed — the best.
        let exposed = |cap: f64| {
            let bytes = (cap * 1048576.0) as u64;
            simulate(&rebucket(&r, bytes, bytes), 2, &link(2)).exposed_ms
        };
        assert!((exposed(0.5) - 21.0).abs() < 1e-9);
        assert!((exposed(100.0) - 21.0).abs() < 1e-9);
        assert!((exposed(2.0) - 12.0).abs() < 1e-9);
        assert_eq!(row.best_cap_mib, 2.0);
        assert!((row.best.exposed_ms - 12.0).abs() < 1e-9, "{row:?}");
    }
}
