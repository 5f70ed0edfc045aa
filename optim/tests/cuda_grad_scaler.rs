//! GPU conformance of the gradient scaler: the fused unscale-and-check (`grad_unscale`, one
//! multi-tensor launch per dtype raising one found-inf flag on the device) against the CPU's
//! pass on the same gradients, with infinities and NaNs injected at chosen steps; the steps
//! skipped, the scales, the unscaled gradients and the updated parameters agree to the bit,
//! and a step reads one value back to the host (the flag), whether or not `unscale` is called
//! before `step`.
//!
//! Runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).

use tandem_core::{DType, Device, Generator, Tensor};
use tandem_optim::multi_tensor::{launch_counts, LaunchCounts};
use tandem_optim::{GradScaler, GradScalerConfig, Sgd, SgdConfig, StepOutcome};

const GPU: Device = Device::Cuda(0);

/// f32 parameter shapes (odd, one element, empty, more than one chunk) and one f64 parameter.
const SHAPES: [&[usize]; 5] = [&[37], &[1], &[0], &[8193], &[3, 5, 7]];

fn parameters(device: Device) -> Vec<Tensor> {
    let mut gen = Generator::new(5);
    let mut out: Vec<Tensor> = SHAPES
        .iter()
        .map(|s| Tensor::randn(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap())
        .collect();
    out.push(Tensor::randn(&[300], 0.0, 1.0, DType::F64, Device::Cpu, &mut gen).unwrap());
    out.into_iter()
        .map(|t| t.to_device(device).unwrap().with_requires_grad().unwrap())
        .collect()
}

/// Gradients of step `step` (scaled by `scale`), with a non-finite value at the bad steps:
/// an infinity at the end of the two-chunk f32 tensor, a NaN in the f64 one.
fn gradients(step: usize, scale: f64) -> Vec<Tensor> {
    let mut gen = Generator::new(100 + step as u64);
    let mut out = Vec::new();
    for (i, p) in parameters(Device::Cpu).iter().enumerate() {
        let g = Tensor::randn(p.dims(), 0.0, 1.0, p.dtype(), Device::Cpu, &mut gen).unwrap();
        g.scale_(scale).unwrap();
        let n = g.numel();
        if step == 1 && i == 3 {
            let mut values = g.to_vec::<f32>().unwrap();
            values[n - 1] = f32::INFINITY;
            out.push(Tensor::from_vec(values, p.dims(), Device::Cpu).unwrap());
            continue;
        }
        if step == 3 && i == 5 {
            let mut values = g.to_vec::<f64>().unwrap();
            values[17] = f64::NAN;
            out.push(Tensor::from_vec(values, p.dims(), Device::Cpu).unwrap());
            continue;
        }
        out.push(g);
    }
    out
}

fn counted<T>(f: impl FnOnce() -> T) -> (T, LaunchCounts) {
    let before = launch_counts();
    let out = f();
    let after = launch_counts();
    let counts = LaunchCounts {
        kernels: after.kernels - before.kernels,
        table_uploads: after.table_uploads - before.table_uploads,
        host_reads: after.host_reads - before.host_reads,
    };
    (out, counts)
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_vec_f64()
        .unwrap()
        .iter()
        .map(|x| if x.is_nan() { u64::MAX } else { x.to_bits() })
        .collect()
}

#[test]
fn unscale_on_the_device_matches_the_cpu_and_reads_one_flag_per_step() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let config = GradScalerConfig::default()
        .with_init_scale(1024.0)
        .with_growth_interval(2);
    let run = |device: Device, explicit_unscale: bool| {
        let params = parameters(device);
        let mut sgd = Sgd::new(params.clone(), SgdConfig::new(0.1).with_momentum(0.9)).unwrap();
        let mut scaler: GradScaler = config.init().unwrap();
        let mut record = Vec::new();
        for step in 0..5 {
            for (p, g) in params.iter().zip(gradients(step, scaler.scale_value())) {
                p.set_grad(Some(g.to_device(device).unwrap())).unwrap();
            }
            let (outcome, counts) = counted(|| {
                if explicit_unscale {
                    scaler.unscale(&mut sgd).unwrap();
                }
                scaler.step(&mut sgd).unwrap()
            });
            if device != Device::Cpu {
                // Unscale: one launch per dtype (f32, f64) and one read of the flag; an
                // applied SGD step adds one launch per dtype and reads nothing.
                let steps = if outcome.is_skipped() { 0 } else { 2 };
                assert_eq!(counts.kernels, 2 + steps, "step {step}: {counts:?}");
                assert_eq!(counts.host_reads, 1, "step {step}: {counts:?}");
            }
            scaler.update().unwrap();
            let grads: Vec<Vec<u64>> = params.iter().map(|p| bits(&p.grad().unwrap())).collect();
            let values: Vec<Vec<u64>> = params.iter().map(bits).collect();
            record.push((outcome, scaler.scale_value(), grads, values));
        }
        (record, scaler.skipped_steps())
    };
    let (want, want_skipped) = run(Device::Cpu, false);
    let outcomes: Vec<StepOutcome> = want.iter().map(|r| r.0).collect();
    use StepOutcome::{Applied, Skipped};
    assert_eq!(outcomes, [Applied, Skipped, Applied, Skipped, Applied]);
    assert_eq!(want_skipped, 2);
    for explicit in [false, true] {
        let (got, skipped) = run(GPU, explicit);
        assert_eq!(skipped, want_skipped);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("step {step}, explicit unscale {explicit}");
            assert_eq!(g.0, w.0, "{what}: outcome");
            assert_eq!(g.1, w.1, "{what}: scale");
            assert!(
                g.2 == w.2,
                "{what}: unscaled gradients differ from the CPU's"
            );
            assert!(g.3 == w.3, "{what}: parameters differ from the CPU's");
        }
    }
}
