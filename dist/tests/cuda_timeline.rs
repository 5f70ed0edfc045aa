//! The timeline on a CUDA device: phases are timed by CUDA events on the compute stream, so
//! their lengths are the device's, not the host's (the host only issues the kernels). Runs on the
//! CUDA emulator without a GPU.
//!
//! On the emulator every launch costs about half a millisecond of the host per block of 256
//! threads (each block's 256 threads are OS threads that meet at the block's end), so the 256
//! MiB of the GPU run (16384 blocks per launch, 132 launches) would take about twenty minutes
//! there, and even 4 MiB (4096 blocks per launch) about five: the emulated run scales the
//! tensor down to 64 blocks per launch, which still makes each phase tens of launches of device
//! time long against a host that returns from each launch at once.

use tandem_core::{DType, Device, Tensor};
use tandem_dist::{Phase, SpanKind, Timeline};

/// 256 MiB of f32: one in-place scale reads and writes 512 MiB (≈0.2 ms on an H100).
const ELEMENTS: usize = 1 << 26;

/// 64 KiB of f32 on the emulator: 64 blocks of 256 threads per launch (≈30 ms each there, so a
/// backward phase of 4 launches is ≈0.1 s and one scheduling stall of the host cannot pass for
/// a phase's length).
const EMULATED_ELEMENTS: usize = 1 << 14;

#[test]
fn cuda_phase_lengths_are_device_time_and_steps_follow_each_other() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let elements = if tandem_test_support::on_emulator() {
        EMULATED_ELEMENTS
    } else {
        ELEMENTS
    };
    let device = Device::Cuda(0);
    let x = Tensor::zeros(&[elements], DType::F32, device)
        .unwrap_or_else(|e| panic!("{elements} f32 on cuda:0: {e}"));
    let mut timeline = Timeline::new(0, device).expect("a timeline on cuda:0");
    const STEPS: u64 = 3;
    for _ in 0..STEPS {
        timeline.begin_step().unwrap();
        // "Forward": 40 kernels; "backward": 4. The host returns from each launch at once.
        timeline.begin(Phase::Forward).unwrap();
        for _ in 0..40 {
            x.scale_(1.0).unwrap();
        }
        timeline.end(Phase::Forward).unwrap();
        timeline.begin(Phase::Backward).unwrap();
        for _ in 0..4 {
            x.scale_(1.0).unwrap();
        }
        timeline.end(Phase::Backward).unwrap();
    }
    let spans = timeline.spans().expect("the device ran every step");
    assert_eq!(spans.len(), 2 * STEPS as usize, "{spans:?}");
    let eps = 50e-6; // event timing resolution (~0.5 µs) and host-placement slack
    for step in 0..STEPS {
        let of = |p: Phase| {
            spans
                .iter()
                .find(|s| s.step == step && s.kind == SpanKind::Phase(p))
                .unwrap_or_else(|| panic!("step {step} has no {p:?} span: {spans:?}"))
        };
        let (f, b) = (of(Phase::Forward), of(Phase::Backward));
        let (fd, bd) = (f.end - f.start, b.end - b.start);
        assert!(
            bd > 0.0 && fd > 4.0 * bd,
            "step {step}: forward ran 10× the kernels of backward but took {:.3} ms against {:.3} ms: \
             the phases are not timed by the device",
            fd * 1e3,
            bd * 1e3
        );
        assert!(
            f.end <= b.start + eps,
            "step {step}: backward before forward ended: {spans:?}"
        );
    }
    for w in spans.windows(2) {
        assert!(
            w[0].end <= w[1].start + eps,
            "spans overlap on the compute stream: {:?} then {:?}",
            w[0],
            w[1]
        );
    }
}
