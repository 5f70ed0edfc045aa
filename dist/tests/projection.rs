//! Recording per-bucket timings from DDP's telemetry, reading them back, and projecting them.

use std::time::{Duration, Instant};

use tandem_dist::projection::{
    project, simulate, LinkModel, LinkPreset, ReadyClock, RecordedBucket, Recording,
};
use tandem_dist::{BucketTiming, StepTiming};

fn ms(x: f64) -> Duration {
    Duration::from_secs_f64(x / 1e3)
}

/// A step whose forward ends at `t0`, with buckets (index, bytes, issued ms, started ms) and
/// backward computing for `backward` ms.
fn step(t0: Instant, backward: f64, buckets: &[(usize, usize, f64, f64)]) -> StepTiming {
    StepTiming {
        forward_start: t0,
        forward_end: t0,
        backward_compute_end: t0 + ms(backward),
        comm_end: t0 + ms(backward + 1.0),
        buckets: buckets
            .iter()
            .map(|&(bucket, bytes, issued, started)| BucketTiming {
                bucket,
                bytes,
                issued: t0 + ms(issued),
                started: Some(t0 + ms(started)),
                ended: Some(t0 + ms(started + 0.5)),
            })
            .collect(),
    }
}

#[test]
fn a_recording_takes_per_bucket_medians_of_the_steps_with_the_final_layout() {
    let t = Instant::now();
    let steps = vec![
        // Before DDP rebuilt its buckets: another layout, skipped.
        step(t, 99.0, &[(0, 10, 1.0, 1.0)]),
        step(
            t + ms(100.0),
            20.0,
            &[(0, 400, 2.0, 3.0), (1, 800, 10.0, 12.0)],
        ),
        step(
            t + ms(200.0),
            24.0,
            &[(0, 400, 4.0, 5.0), (1, 800, 14.0, 15.0)],
        ),
        step(
            t + ms(300.0),
            22.0,
            &[(0, 400, 3.0, 3.5), (1, 800, 11.0, 11.0)],
        ),
    ];
    let issued = Recording::from_steps(&steps, ReadyClock::Issued, 7.0, 2.0).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    assert!(close(issued.backward_ms, 22.0), "{issued:?}");
    assert_eq!((issued.forward_ms, issued.optimizer_ms), (7.0, 2.0));
    let got: Vec<(u64, f64)> = issued
        .buckets
        .iter()
        .map(|b| (b.bytes, b.ready_ms))
        .collect();
    assert_eq!(got.len(), 2);
    assert_eq!((got[0].0, got[1].0), (400, 800));
    assert!(close(got[0].1, 3.0) && close(got[1].1, 11.0), "{got:?}");
    let started = Recording::from_steps(&steps, ReadyClock::Started, 7.0, 2.0).unwrap();
    assert!(close(started.buckets[0].ready_ms, 3.5), "{started:?}");
    assert!(close(started.buckets[1].ready_ms, 12.0), "{started:?}");
    assert!(Recording::from_steps(&[], ReadyClock::Issued, 0.0, 0.0).is_none());
}

#[test]
fn a_recording_survives_json_and_bad_numbers_are_named() {
    let r = Recording {
        model: "m".into(),
        device: "cpu".into(),
        batch_size: 8,
        forward_ms: 1.0,
        backward_ms: 2.0,
        optimizer_ms: 0.5,
        buckets: vec![RecordedBucket {
            bytes: 1 << 20,
            ready_ms: 1.5,
        }],
        note: "n".into(),
    };
    let back: Recording = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(back, r);
    assert!(r.validate().is_ok());
    let mut bad = r.clone();
    bad.buckets[0].ready_ms = f64::NAN;
    assert!(bad.validate().unwrap_err().contains("bucket 0"));
    let mut bad = r;
    bad.backward_ms = -1.0;
    assert!(bad.validate().unwrap_err().contains("backward_ms"));
}

#[test]
fn more_devices_cost_more_ring_steps_and_nodes_switch_to_the_slower_network() {
    // 100 MB of gradients in 4 buckets ready during a 100 ms backward.
    let r = Recording {
        model: "m".into(),
        device: "gpu".into(),
        batch_size: 1,
        forward_ms: 50.0,
        backward_ms: 100.0,
        optimizer_ms: 10.0,
        buckets: (0..4)
            .map(|i| RecordedBucket {
                bytes: 25_000_000,
                ready_ms: 25.0 * (i + 1) as f64,
            })
            .collect(),
        note: String::new(),
    };
    let preset = LinkPreset::DgxA100;
    let proj = project(
        &r,
        &[2, 8, 16, 64],
        &|p| preset.link_for(p),
        &[1.0, 25.0, 100.0],
        1.0,
    );
    let rows = &proj.rows;
    assert_eq!(rows[1].link, LinkModel::new(230.0, 1.5));
    assert_eq!(rows[2].link, LinkModel::new(185.0, 5.0));
    // The last bucket (25 MB) is ready when backward ends: at least its own ring time is
    // exposed, growing with p.
    for w in rows.windows(2) {
        assert!(w[0].step.exposed_ms <= w[1].step.exposed_ms, "{rows:?}");
    }
    let last_alone = preset.link_for(8).all_reduce_s(25_000_000, 8) * 1e3;
    assert!(rows[1].step.exposed_ms >= last_alone - 1e-9, "{rows:?}");
    // Independent check of the 8-GPU row: 2·7/8 · 25 MB / 230 GB/s + 14 · 1.5 µs per bucket.
    let per_bucket = 14.0 / 8.0 * 25e6 / 230e9 * 1e3 + 14.0 * 1.5e-3;
    assert!(
        (rows[1].step.exposed_ms - per_bucket).abs() < 1e-9,
        "{} vs {per_bucket}",
        rows[1].step.exposed_ms
    );
    assert!((rows[1].step.speedup - 8.0 * 160.0 / (160.0 + per_bucket)).abs() < 1e-9);
    // The best cap is never worse than the recorded buckets.
    for row in rows {
        assert!(row.best.step_ms <= row.step.step_ms + 1e-9);
    }
    assert_eq!(simulate(&r, 1, &LinkModel::new(1.0, 1.0)).step_ms, 160.0);
}
