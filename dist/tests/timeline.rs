//! tandem's own timeline: phases on the compute stream, DDP's buckets on the comm stream, the
//! Chrome trace (one track per stream per rank), and the overlap summary.

mod ddp_common;

use std::path::PathBuf;
use std::sync::Arc;

use ddp_common::{batch, build, run_ranks, sgd, shard, Model};
use serde_json::Value;
use tandem_autograd::TensorBackward;
use tandem_core::Device;
use tandem_dist::timeline::summarize_spans;
use tandem_dist::{
    merge_chrome_traces, DdpConfig, DistributedDataParallel, Phase, ProcessGroup, Span, SpanKind,
    Timeline, Track,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_optim::Optimizer;

fn span(step: u64, track: Track, kind: SpanKind, start: f64, end: f64) -> Span {
    Span {
        step,
        track,
        kind,
        start,
        end,
    }
}

fn bucket(b: usize) -> SpanKind {
    SpanKind::AllReduce {
        bucket: b,
        bytes: 4096,
    }
}

#[test]
fn overlap_of_a_constructed_timeline_counts_what_ran_after_backward_as_exposed() {
    let backward = SpanKind::Phase(Phase::Backward);
    let spans = vec![
        // Step 0: backward 1.0..5.0 s; buckets 2..3, 3..4.5, 4.5..6: 1 s exposed of 4.
        span(0, Track::Compute, SpanKind::Phase(Phase::Forward), 0.0, 1.0),
        span(0, Track::Compute, backward.clone(), 1.0, 5.0),
        span(0, Track::Compute, SpanKind::WaitForComm, 5.0, 6.0),
        span(0, Track::Comm, bucket(0), 2.0, 3.0),
        span(0, Track::Comm, bucket(1), 3.0, 4.5),
        span(0, Track::Comm, bucket(2), 4.5, 6.0),
        // Step 1: backward 10..14; one bucket 11..13, entirely hidden.
        span(1, Track::Compute, backward.clone(), 10.0, 14.0),
        span(1, Track::Comm, bucket(0), 11.0, 13.0),
        // Step 2: no communication (e.g. under no_sync): not counted.
        span(2, Track::Compute, backward, 20.0, 24.0),
    ];
    let s = summarize_spans(&spans);
    assert_eq!(s.steps, 2);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(s.backward_compute.as_secs_f64(), 8.0), "{s}");
    assert!(close(s.comm.as_secs_f64(), 6.0), "{s}");
    assert!(close(s.exposed.as_secs_f64(), 1.0), "{s}");
    assert!(close(s.hidden_fraction, 5.0 / 6.0), "{s}");
}

#[test]
fn ending_a_phase_that_is_not_the_innermost_open_one_is_an_error_naming_both() {
    let mut t = Timeline::new(3, Device::Cpu).unwrap();
    t.begin(Phase::Forward).unwrap();
    let err = t.end(Phase::Backward).unwrap_err().to_string();
    assert!(
        err.contains("rank 3") && err.contains("end(backward)") && err.contains("forward"),
        "{err}"
    );
    t.end(Phase::Forward).unwrap();
    let err = t.end(Phase::Forward).unwrap_err().to_string();
    assert!(err.contains("none"), "{err}");
}

#[test]
fn a_step_starts_with_its_first_phase_and_open_phases_close_with_the_step() {
    let mut t = Timeline::new(0, Device::Cpu).unwrap();
    t.begin(Phase::Data).unwrap();
    t.end(Phase::Data).unwrap();
    t.begin(Phase::Forward).unwrap();
    t.begin_step().unwrap(); // closes step 0 and its open forward
    t.begin(Phase::Optimizer).unwrap();
    let spans = t.spans().unwrap();
    let names: Vec<(u64, String)> = spans.iter().map(|s| (s.step, s.kind.name())).collect();
    assert_eq!(
        names,
        vec![
            (0, "data".to_string()),
            (0, "forward".to_string()),
            (1, "optimizer".to_string())
        ]
    );
    for w in spans.windows(2) {
        assert!(
            w[0].start <= w[0].end && w[0].end <= w[1].start,
            "{spans:?}"
        );
    }
}

#[test]
fn rank_trace_paths_keep_one_file_for_one_rank_and_name_the_rank_otherwise() {
    let p = PathBuf::from("/tmp/run/trace.json");
    assert_eq!(Timeline::rank_trace_path(&p, 0, 1), p);
    assert_eq!(
        Timeline::rank_trace_path(&p, 3, 4),
        PathBuf::from("/tmp/run/trace.rank3.json")
    );
    assert_eq!(
        Timeline::rank_trace_path(&PathBuf::from("out"), 1, 2),
        PathBuf::from("out.rank1")
    );
}

/// Two ranks train a small CNN under DDP with 1 KiB buckets, each timing its steps.
fn train_with_timeline(rank: usize, group: Arc<dyn ProcessGroup>, steps: usize) -> Timeline {
    let world = group.world_size();
    let config = DdpConfig {
        bucket_cap_mb: 0.001,
        first_bucket_mb: 0.001,
        ..DdpConfig::default()
    };
    let ddp = DistributedDataParallel::new(build(Model::Cnn, 7), group, config).unwrap();
    let mut opt = sgd(ddp.module().parameters());
    let mut timeline = Timeline::new(rank, Device::Cpu).unwrap();
    for step in 0..steps {
        timeline.begin_step().unwrap();
        timeline.begin(Phase::Data).unwrap();
        let (x, y) = batch(Model::Cnn, step);
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        timeline.end(Phase::Data).unwrap();
        opt.zero_grad().unwrap();
        timeline.begin(Phase::Forward).unwrap();
        let out = ddp.forward(&x).unwrap();
        let loss = cross_entropy(&out, &y, Reduction::Mean).unwrap();
        timeline.end(Phase::Forward).unwrap();
        timeline.begin(Phase::Backward).unwrap();
        loss.backward().unwrap();
        timeline.end(Phase::Backward).unwrap();
        timeline.begin(Phase::Optimizer).unwrap();
        opt.step().unwrap();
        timeline.end(Phase::Optimizer).unwrap();
    }
    timeline.record_ddp(&ddp.telemetry());
    // The overlap of the timeline and DDP's own summary measure the same steps.
    let from_timeline = timeline.overlap_summary().unwrap();
    let from_ddp = ddp.telemetry().summary();
    assert_eq!(from_timeline.steps, steps);
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    assert!(
        (ms(from_timeline.comm) - ms(from_ddp.comm)).abs() < 0.5,
        "timeline {from_timeline} vs DDP {from_ddp}"
    );
    assert!(
        (ms(from_timeline.exposed) - ms(from_ddp.exposed)).abs() < 0.5,
        "timeline {from_timeline} vs DDP {from_ddp}"
    );
    timeline
}

#[test]
fn a_two_rank_ddp_run_gives_one_track_per_stream_per_rank_in_one_merged_trace() {
    const STEPS: usize = 3;
    let dir = std::env::temp_dir().join(format!("tandem-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let merged = dir.join("trace.json");
    let parts = run_ranks(2, |rank, group| {
        let mut timeline = train_with_timeline(rank, group, STEPS);
        let path = Timeline::rank_trace_path(&merged, rank, 2);
        timeline.write_chrome_trace(&path).unwrap();
        (path, timeline.spans().unwrap())
    });
    let paths: Vec<PathBuf> = parts.iter().map(|(p, _)| p.clone()).collect();
    merge_chrome_traces(&paths, &merged).unwrap();

    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&merged).unwrap()).unwrap();
    let events = trace.as_array().expect("a JSON array of events");
    for rank in 0..2u64 {
        let of_rank = |e: &&Value| e["pid"].as_u64() == Some(rank);
        // Named process and threads: one per stream.
        let threads: Vec<(u64, &str)> = events
            .iter()
            .filter(of_rank)
            .filter(|e| e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(threads, vec![(0, "compute stream"), (1, "comm stream")]);
        assert!(events
            .iter()
            .filter(of_rank)
            .any(|e| e["name"] == "process_name"
                && e["args"]["name"] == format!("rank {rank} (cpu)")));
        let complete: Vec<&Value> = events
            .iter()
            .filter(of_rank)
            .filter(|e| e["ph"] == "X")
            .collect();
        for e in &complete {
            assert!(e["ts"].as_f64().unwrap() > 1.0e15, "wall-clock µs: {e}");
            assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}");
        }
        let on = |tid: u64, name: &str| {
            complete
                .iter()
                .filter(|e| e["tid"].as_u64() == Some(tid))
                .filter(|e| e["name"].as_str().unwrap().starts_with(name))
                .count()
        };
        for phase in ["data", "forward", "backward", "optimizer"] {
            assert_eq!(on(0, phase), STEPS, "rank {rank} {phase}");
        }
        assert_eq!(on(1, "forward"), 0);
        // 1 KiB buckets: several all-reduces per step, the same in every step, all on the comm
        // track.
        let buckets = on(1, "all_reduce bucket");
        assert!(
            buckets >= 2 * STEPS && buckets % STEPS == 0,
            "rank {rank}: {buckets}"
        );
        assert_eq!(on(0, "all_reduce"), 0);
    }
    // The spans a rank wrote are the ones it reports, in step order; buckets within backward's
    // step, after its forward.
    for (_, spans) in &parts {
        for step in 0..STEPS as u64 {
            let of = |k: &dyn Fn(&SpanKind) -> bool| -> Vec<&Span> {
                spans
                    .iter()
                    .filter(|s| s.step == step && k(&s.kind))
                    .collect()
            };
            let forward = of(&|k| *k == SpanKind::Phase(Phase::Forward))[0];
            for b in of(&|k| matches!(k, SpanKind::AllReduce { .. })) {
                assert!(b.start >= forward.end - 1e-4, "{b:?} before {forward:?}");
                assert_eq!(b.track, Track::Comm);
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merging_refuses_a_file_that_is_not_a_trace() {
    let dir = std::env::temp_dir().join(format!("tandem-timeline-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"not\": \"an array\"}").unwrap();
    let err = merge_chrome_traces(std::slice::from_ref(&bad), &dir.join("out.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("bad.json") && err.contains("array"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
