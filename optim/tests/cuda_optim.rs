//! GPU conformance of the optimizers: SGD, Adam and AdamW stepping CUDA parameters with the
//! fused multi-tensor kernels against the same optimizers stepping CPU parameters with the same
//! gradients, for every option; gradient clipping and `zero_grad` on the device; optimizer state
//! that follows a moved parameter and checkpoints that move between devices; and the number of
//! launches and uploads a step costs.
//!
//! Each test runs on the GPU, or on the CUDA emulator without one (`tandem_test_support::select_cuda`).
//! The kernels compute the CPU's operations in the CPU's order (no fused multiply-adds, IEEE
//! division and square root), so results are expected to agree to the last bit; the checks
//! allow f32 rounding so that a failure message shows how far apart the two are.

use tandem_core::{DType, Device, Generator, Tensor};
use tandem_optim::multi_tensor::{launch_counts, LaunchCounts};
use tandem_optim::{clip_grad_norm, Adam, AdamConfig, AdamW, Optimizer, Sgd, SgdConfig};

const GPU: Device = Device::Cuda(0);

/// Parameter shapes: odd sizes, one element, empty, more than one 8192-element chunk, and a
/// matrix that is also used transposed (a strided parameter).
const SHAPES: [&[usize]; 6] = [&[37], &[0], &[1], &[8193], &[3, 5, 7], &[64, 65]];

/// The index of the parameter that is a transposed view (of shape [65, 64]).
const STRIDED: usize = 6;

/// Host values for every parameter (the last one a [64, 65] matrix viewed transposed).
fn initial_values(dtype: DType, seed: u64) -> Vec<Tensor> {
    let mut gen = Generator::new(seed);
    let mut out: Vec<Tensor> = SHAPES
        .iter()
        .map(|s| Tensor::randn(s, 0.0, 1.0, dtype, Device::Cpu, &mut gen).unwrap())
        .collect();
    out.push(Tensor::randn(&[64, 65], 0.0, 1.0, dtype, Device::Cpu, &mut gen).unwrap());
    out
}

/// Leaf parameters on `device` holding `values` (fresh copies); the last one is a transposed
/// view of its storage.
fn parameters(values: &[Tensor], device: Device) -> Vec<Tensor> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let t = v.copy_detached().unwrap().to_device(device).unwrap();
            let t = if i == STRIDED {
                t.view_detached(t.layout().transpose("test", 0, 1).unwrap())
                    .unwrap()
            } else {
                t
            };
            t.with_requires_grad().unwrap()
        })
        .collect()
}

/// Gives parameter `i` of both lists the same random gradient, or none when `skip(i)`.
fn set_gradients(
    cpu: &[Tensor],
    gpu: &[Tensor],
    gen: &mut Generator,
    skip: impl Fn(usize) -> bool,
) {
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        if skip(i) {
            c.set_grad(None).unwrap();
            g.set_grad(None).unwrap();
            continue;
        }
        let grad = Tensor::randn(c.dims(), 0.0, 1.0, c.dtype(), Device::Cpu, gen).unwrap();
        c.set_grad(Some(grad.copy_detached().unwrap())).unwrap();
        g.set_grad(Some(grad.to_device(GPU).unwrap())).unwrap();
    }
}

/// Asserts two tensors hold the same values within `tol` (relative), naming the first
/// differences.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let bad: Vec<String> = g
        .iter()
        .zip(&w)
        .enumerate()
        .filter(|(_, (a, b))| {
            !((*a - *b).abs() <= tol * (1.0 + b.abs()) || a.is_nan() && b.is_nan())
        })
        .take(5)
        .map(|(i, (a, b))| format!("[{i}] cuda {a} vs cpu {b}"))
        .collect();
    let differing = g
        .iter()
        .zip(&w)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        bad.is_empty(),
        "{what}: {} ({differing} of {} elements not bit-identical)",
        bad.join("; "),
        g.len()
    );
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-12
    } else {
        2e-6
    }
}

/// Compares every parameter and every state entry of the two optimizers.
fn assert_same_optimizers(what: &str, gpu: &dyn Optimizer, cpu: &dyn Optimizer, dtype: DType) {
    for (i, (g, c)) in gpu.parameters().iter().zip(cpu.parameters()).enumerate() {
        assert_eq!(g.device(), GPU, "{what}: parameter {i} stays on the GPU");
        assert_close(&format!("{what}: parameter {i}"), g, c, tolerance(dtype));
    }
    let (gs, cs) = (gpu.state(), cpu.state());
    let names = |s: &[(String, Tensor)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&gs), names(&cs), "{what}: state entries");
    for ((name, g), (_, c)) in gs.iter().zip(&cs) {
        if name.ends_with("step") {
            assert_eq!(g.item().unwrap(), c.item().unwrap(), "{what}: {name}");
        } else {
            assert_eq!(g.device(), GPU, "{what}: {name} lives on the GPU");
            assert_close(&format!("{what}: {name}"), g, c, tolerance(dtype));
        }
    }
}

type MakeOptimizer<'a> = &'a dyn Fn(Vec<Tensor>) -> Box<dyn Optimizer>;

/// Steps a CPU and a CUDA copy of the same parameters `steps` times with the same gradients
/// (parameter `i` has none at step `s` when `skip(s, i)`), comparing after every step.
fn run_both(
    what: &str,
    make: MakeOptimizer,
    dtype: DType,
    steps: usize,
    skip: &dyn Fn(usize, usize) -> bool,
) {
    let values = initial_values(dtype, 11);
    let (cpu_params, gpu_params) = (parameters(&values, Device::Cpu), parameters(&values, GPU));
    let (mut cpu, mut gpu) = (make(cpu_params.clone()), make(gpu_params.clone()));
    let mut gen = Generator::new(5);
    for step in 0..steps {
        set_gradients(&cpu_params, &gpu_params, &mut gen, |i| skip(step, i));
        cpu.step().unwrap();
        gpu.step().unwrap();
        assert_same_optimizers(
            &format!("{what} {dtype} step {step}"),
            gpu.as_ref(),
            cpu.as_ref(),
            dtype,
        );
    }
}

fn sgd_configs() -> Vec<SgdConfig> {
    let mut out = Vec::new();
    for momentum in [0.0, 0.9] {
        for dampening in [0.0, 0.3] {
            for nesterov in [false, true] {
                for weight_decay in [0.0, 0.01] {
                    let cfg = SgdConfig::new(0.05)
                        .with_momentum(momentum)
                        .with_dampening(dampening)
                        .with_nesterov(nesterov)
                        .with_weight_decay(weight_decay);
                    if cfg.validate().is_ok() {
                        out.push(cfg);
                    }
                }
            }
        }
    }
    out
}

fn adam_configs() -> Vec<AdamConfig> {
    let mut out = Vec::new();
    for weight_decay in [0.0, 0.1] {
        for amsgrad in [false, true] {
            for (beta1, beta2, eps) in [(0.9, 0.999, 1e-8), (0.8, 0.5, 1e-3)] {
                out.push(
                    AdamConfig::new(0.01)
                        .with_betas(beta1, beta2)
                        .with_eps(eps)
                        .with_weight_decay(weight_decay)
                        .with_amsgrad(amsgrad),
                );
            }
        }
    }
    out.push(AdamConfig::new(0.0).with_weight_decay(0.1));
    out
}

const STEPS: usize = 5;

/// Parameter 2 has no gradient at step 1 and parameter 4 none before step 2, so momentum
/// buffers are born late and Adam's step counts differ between parameters.
fn some_skipped(step: usize, i: usize) -> bool {
    (i == 2 && step == 1) || (i == 4 && step < 2)
}

#[test]
fn sgd_on_cuda_matches_the_cpu_for_every_option() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in [DType::F32, DType::F64] {
        for cfg in sgd_configs() {
            let make =
                move |p: Vec<Tensor>| -> Box<dyn Optimizer> { Box::new(Sgd::new(p, cfg).unwrap()) };
            run_both(&format!("SGD {cfg:?}"), &make, dtype, STEPS, &|_, _| false);
            run_both(
                &format!("SGD {cfg:?} with skipped gradients"),
                &make,
                dtype,
                STEPS,
                &some_skipped,
            );
        }
    }
}

#[test]
fn adam_and_adamw_on_cuda_match_the_cpu_for_every_option() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for dtype in [DType::F32, DType::F64] {
        for cfg in adam_configs() {
            let adam = move |p: Vec<Tensor>| -> Box<dyn Optimizer> {
                Box::new(Adam::new(p, cfg).unwrap())
            };
            let adamw = move |p: Vec<Tensor>| -> Box<dyn Optimizer> {
                Box::new(AdamW::new(p, cfg).unwrap())
            };
            for (name, make) in [("Adam", &adam as MakeOptimizer), ("AdamW", &adamw)] {
                run_both(&format!("{name} {cfg:?}"), make, dtype, STEPS, &|_, _| {
                    false
                });
                run_both(
                    &format!("{name} {cfg:?} with per-parameter step counts"),
                    make,
                    dtype,
                    STEPS,
                    &some_skipped,
                );
            }
        }
    }
}

/// What a closure issued through optim's multi-tensor path.
fn counted(f: impl FnOnce()) -> LaunchCounts {
    let before = launch_counts();
    f();
    let after = launch_counts();
    LaunchCounts {
        kernels: after.kernels - before.kernels,
        table_uploads: after.table_uploads - before.table_uploads,
        host_reads: after.host_reads - before.host_reads,
    }
}

/// Dense f32 parameters on the GPU, `n` of them, with gradients.
fn many_parameters(n: usize) -> Vec<Tensor> {
    let mut gen = Generator::new(3);
    (0..n)
        .map(|i| {
            let shape = [1 + (i * 37) % 300];
            let p = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
                .unwrap()
                .to_device(GPU)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let g = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
            p.set_grad(Some(g.to_device(GPU).unwrap())).unwrap();
            p
        })
        .collect()
}

#[test]
fn a_steady_step_is_one_launch_per_dtype_and_uploads_nothing() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let params = many_parameters(60);
    let optimizers: Vec<(&str, Box<dyn Optimizer>)> = vec![
        (
            "SGD",
            Box::new(Sgd::new(params.clone(), SgdConfig::new(0.01).with_momentum(0.9)).unwrap()),
        ),
        (
            "Adam",
            Box::new(Adam::new(params.clone(), AdamConfig::new(1e-3).with_amsgrad(true)).unwrap()),
        ),
        (
            "AdamW",
            Box::new(AdamW::new(params.clone(), AdamConfig::adamw(1e-3)).unwrap()),
        ),
    ];
    for (name, mut opt) in optimizers {
        // The first step creates the state (fills by the runtime) and uploads the table.
        let first = counted(|| opt.step().unwrap());
        assert_eq!(first.kernels, 1, "{name}: first step {first:?}");
        assert_eq!(first.table_uploads, 1, "{name}: first step {first:?}");
        for step in 1..4 {
            let c = counted(|| opt.step().unwrap());
            assert_eq!(
                c,
                LaunchCounts {
                    kernels: 1,
                    table_uploads: 0,
                    host_reads: 0
                },
                "{name}: step {step} over 60 parameters"
            );
        }
        let zero = counted(|| opt.zero_grad().unwrap());
        assert_eq!(zero.kernels, 1, "{name}: zero_grad {zero:?}");
        let zero = counted(|| opt.zero_grad().unwrap());
        assert_eq!(
            zero,
            LaunchCounts {
                kernels: 1,
                table_uploads: 0,
                host_reads: 0
            },
            "{name}: a second zero_grad finds its table"
        );
        for p in &params {
            assert!(p
                .grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|&x| x == 0.0));
            p.grad().unwrap().fill_(0.5).unwrap();
        }
    }
}

#[test]
fn zero_grad_on_cuda_zeroes_every_gradient_in_place() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let values = initial_values(DType::F32, 4);
    let params = parameters(&values, GPU);
    // The strided parameter's gradient is strided too: the runtime fills it, one launch zeroes
    // all the others.
    let mut gen = Generator::new(8);
    let grads: Vec<Tensor> = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let g = if i == STRIDED {
                let dense = Tensor::randn(&[64, 65], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
                    .unwrap()
                    .to_device(GPU)
                    .unwrap();
                dense
                    .view_detached(dense.layout().transpose("test", 0, 1).unwrap())
                    .unwrap()
            } else {
                Tensor::randn(p.dims(), 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
                    .unwrap()
                    .to_device(GPU)
                    .unwrap()
            };
            p.set_grad(Some(g.clone())).unwrap();
            g
        })
        .collect();
    assert!(!grads[STRIDED].is_contiguous());
    let mut opt = Sgd::new(params.clone(), SgdConfig::new(0.1)).unwrap();
    let c = counted(|| opt.zero_grad().unwrap());
    assert_eq!(
        c.kernels, 1,
        "one multi-tensor launch for the dense gradients: {c:?}"
    );
    for (i, (p, g)) in params.iter().zip(&grads).enumerate() {
        assert!(
            p.grad().unwrap().same_tensor(g),
            "gradient {i} is the same tensor"
        );
        assert!(
            g.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0),
            "gradient {i} is zero"
        );
    }
}

#[test]
fn gradients_that_are_views_into_one_bucket_are_updated_and_zeroed_in_place() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // As DDP does: every gradient is a slice of one flat bucket.
    let shapes: [&[usize]; 3] = [&[10], &[3, 7], &[5]];
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let mut gen = Generator::new(21);
    let bucket_host = Tensor::randn(&[total], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let bucket = bucket_host.to_device(GPU).unwrap();
    let mut offset = 0;
    let mut gpu_params = Vec::new();
    let mut cpu_params = Vec::new();
    for s in shapes {
        let n: usize = s.iter().product();
        let init = Tensor::randn(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let view = |b: &Tensor| {
            let l = b
                .layout()
                .narrow("test", 0, offset, n)
                .unwrap()
                .reshape(s)
                .unwrap();
            b.view_detached(l).unwrap()
        };
        let g = parameters(std::slice::from_ref(&init), GPU).remove(0);
        g.set_grad(Some(view(&bucket))).unwrap();
        let c = parameters(std::slice::from_ref(&init), Device::Cpu).remove(0);
        c.set_grad(Some(view(&bucket_host).copy_detached().unwrap()))
            .unwrap();
        gpu_params.push(g);
        cpu_params.push(c);
        offset += n;
    }
    let cfg = SgdConfig::new(0.1)
        .with_momentum(0.9)
        .with_weight_decay(0.01);
    let mut gpu = Sgd::new(gpu_params.clone(), cfg).unwrap();
    let mut cpu = Sgd::new(cpu_params.clone(), cfg).unwrap();
    gpu.step().unwrap();
    cpu.step().unwrap();
    assert_same_optimizers("SGD with bucket-view gradients", &gpu, &cpu, DType::F32);
    let c = counted(|| gpu.zero_grad().unwrap());
    assert_eq!(
        c.kernels, 1,
        "one zero launch for the bucket's views: {c:?}"
    );
    assert!(
        bucket.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0),
        "the bucket is zero"
    );
}

/// Parameters with gradients on `device`: f32 ones of odd sizes (one empty, one of more than
/// a chunk, one whose gradient is a transposed view) and an f64 one.
fn clip_parameters(device: Device, seed: u64, scale: f64) -> Vec<Tensor> {
    let mut gen = Generator::new(seed);
    let shapes: [(&[usize], DType); 5] = [
        (&[37], DType::F32),
        (&[0], DType::F32),
        (&[8193], DType::F32),
        (&[4, 9], DType::F64),
        (&[64, 65], DType::F32),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (shape, dtype))| {
            let g = Tensor::randn(shape, 0.0, scale, dtype, Device::Cpu, &mut gen)
                .unwrap()
                .to_device(device)
                .unwrap();
            let g = if i == 4 {
                g.view_detached(g.layout().transpose("test", 0, 1).unwrap())
                    .unwrap()
            } else {
                g
            };
            let p = Tensor::zeros(g.dims(), dtype, device)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            p.set_grad(Some(g)).unwrap();
            p
        })
        .collect()
}

#[test]
fn clipping_on_cuda_matches_the_cpu_with_three_launches_and_one_read() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for p in [2.0, 1.0, f64::INFINITY, 3.0] {
        for max_norm in [0.5, 1e6] {
            let what = format!("clip_grad_norm p={p} max_norm={max_norm}");
            let cpu = clip_parameters(Device::Cpu, 13, 1.0);
            let gpu = clip_parameters(GPU, 13, 1.0);
            let want = clip_grad_norm(&cpu, max_norm, p).unwrap();
            let mut got = 0.0;
            let c = counted(|| got = clip_grad_norm(&gpu, max_norm, p).unwrap());
            assert!(
                (got - want).abs() <= 1e-10 * want,
                "{what}: cuda {got} vs cpu {want}"
            );
            // f32 and f64 gradients: partial norms and scaling per dtype, one finish.
            assert_eq!(c.kernels, 5, "{what}: {c:?}");
            assert_eq!(c.host_reads, 1, "{what}: {c:?}");
            for (i, (g, w)) in gpu.iter().zip(&cpu).enumerate() {
                assert_close(
                    &format!("{what}: gradient {i}"),
                    &g.grad().unwrap(),
                    &w.grad().unwrap(),
                    2e-6,
                );
            }
        }
    }
}

#[test]
fn clipping_on_cuda_reports_a_non_finite_norm_and_leaves_gradients_alone() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    for bad in [f32::NAN, f32::INFINITY] {
        for p in [2.0, f64::INFINITY] {
            let params = clip_parameters(GPU, 14, 1.0);
            let g0 = params[0].grad().unwrap();
            let mut values = g0.to_vec::<f32>().unwrap();
            values[3] = bad;
            g0.copy_(
                &Tensor::from_vec(values.clone(), &[37], Device::Cpu)
                    .unwrap()
                    .to_device(GPU)
                    .unwrap(),
            )
            .unwrap();
            let before: Vec<Vec<f64>> = params
                .iter()
                .map(|p| p.grad().unwrap().to_vec_f64().unwrap())
                .collect();
            let err = clip_grad_norm(&params, 0.1, p).unwrap_err().to_string();
            assert!(err.contains("non-finite"), "{bad} p={p}: {err}");
            for (i, (param, b)) in params.iter().zip(&before).enumerate() {
                let after = param.grad().unwrap().to_vec_f64().unwrap();
                let same = after.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{bad} p={p}: gradient {i} was changed");
            }
        }
    }
}

#[test]
fn clipping_gradients_on_two_devices_is_an_error() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let mut params = clip_parameters(GPU, 15, 1.0);
    params.extend(clip_parameters(Device::Cpu, 15, 1.0));
    let err = clip_grad_norm(&params, 1.0, 2.0).unwrap_err().to_string();
    assert!(err.contains("cuda:0") && err.contains("cpu"), "{err}");
}

/// The state entries as host copies, as a checkpoint saves them.
fn saved(opt: &dyn Optimizer) -> Vec<(String, Tensor)> {
    opt.state()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                t.to_device(Device::Cpu).unwrap().copy_detached().unwrap(),
            )
        })
        .collect()
}

/// Trains `from_device` 3 steps, saves, loads into a fresh optimizer over a copy of the
/// parameters on `to_device`, and trains both 3 more steps: the resumed run must match the
/// straight one.
fn resume_across_devices(name: &str, make: MakeOptimizer, from_device: Device, to_device: Device) {
    let what = format!("{name} checkpoint from {from_device} to {to_device}");
    let values = initial_values(DType::F32, 31);
    let straight_params = parameters(&values, from_device);
    let mut straight = make(straight_params.clone());
    let mut gen = Generator::new(17);
    let grads: Vec<Vec<Tensor>> = (0..6)
        .map(|_| {
            straight_params
                .iter()
                .map(|p| {
                    Tensor::randn(p.dims(), 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap()
                })
                .collect()
        })
        .collect();
    let apply = |params: &[Tensor], step: usize| {
        for (p, g) in params.iter().zip(&grads[step]) {
            p.set_grad(Some(g.to_device(p.device()).unwrap())).unwrap();
        }
    };
    for step in 0..3 {
        apply(&straight_params, step);
        straight.step().unwrap();
    }
    let checkpoint = saved(straight.as_ref());
    assert!(checkpoint.iter().all(|(_, t)| t.device() == Device::Cpu));
    // The resumed run's parameters: the saved values, on the other device.
    let now: Vec<Tensor> = straight_params
        .iter()
        .map(|p| p.to_device(Device::Cpu).unwrap())
        .collect();
    let resumed_params: Vec<Tensor> = now
        .iter()
        .map(|v| {
            v.copy_detached()
                .unwrap()
                .to_device(to_device)
                .unwrap()
                .with_requires_grad()
                .unwrap()
        })
        .collect();
    let mut resumed = make(resumed_params.clone());
    resumed.load_state(&checkpoint).unwrap();
    for (name, t) in resumed.state() {
        if !name.ends_with("step") {
            assert_eq!(
                t.device(),
                to_device,
                "{what}: loaded {name} lives beside its parameter"
            );
        }
    }
    for step in 3..6 {
        apply(&straight_params, step);
        apply(&resumed_params, step);
        straight.step().unwrap();
        resumed.step().unwrap();
    }
    for (i, (r, s)) in resumed_params.iter().zip(&straight_params).enumerate() {
        let s = s.to_device(Device::Cpu).unwrap();
        let r = r.to_device(Device::Cpu).unwrap();
        // The strided parameter was saved dense; compare values.
        assert_close(&format!("{what}: parameter {i}"), &r, &s, 2e-6);
    }
}

#[test]
fn a_checkpoint_written_on_the_gpu_resumes_on_the_cpu_and_back() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let sgd = |p: Vec<Tensor>| -> Box<dyn Optimizer> {
        Box::new(
            Sgd::new(
                p,
                SgdConfig::new(0.05).with_momentum(0.9).with_nesterov(true),
            )
            .unwrap(),
        )
    };
    let adamw = |p: Vec<Tensor>| -> Box<dyn Optimizer> {
        Box::new(AdamW::new(p, AdamConfig::adamw(0.01).with_amsgrad(true)).unwrap())
    };
    for (name, make) in [("SGD", &sgd as MakeOptimizer), ("AdamW", &adamw)] {
        resume_across_devices(name, make, GPU, Device::Cpu);
        resume_across_devices(name, make, Device::Cpu, GPU);
        resume_across_devices(name, make, GPU, GPU);
    }
}

#[test]
fn optimizer_state_follows_parameters_moved_to_the_gpu_and_back() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    let values = initial_values(DType::F32, 41);
    let moved = parameters(&values, Device::Cpu);
    let stayed = parameters(&values, Device::Cpu);
    let cfg = AdamConfig::adamw(0.01).with_amsgrad(true);
    let mut moved_opt = AdamW::new(moved.clone(), cfg).unwrap();
    let mut stayed_opt = AdamW::new(stayed.clone(), cfg).unwrap();
    let mut gen = Generator::new(2);
    let mut step_both = |moved_opt: &mut AdamW, stayed_opt: &mut AdamW| {
        for (m, s) in moved.iter().zip(&stayed) {
            let g = Tensor::randn(m.dims(), 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
            m.set_grad(Some(g.to_device(m.device()).unwrap())).unwrap();
            s.set_grad(Some(g)).unwrap();
        }
        moved_opt.step().unwrap();
        stayed_opt.step().unwrap();
    };
    step_both(&mut moved_opt, &mut stayed_opt);
    let ids: Vec<_> = (0..moved.len())
        .map(|i| moved_opt.exp_avg(i).unwrap().id())
        .collect();

    for device in [GPU, Device::Cpu] {
        for p in &moved {
            p.move_to_device(device).unwrap();
        }
        step_both(&mut moved_opt, &mut stayed_opt);
        for i in 0..moved.len() {
            let m = moved_opt.exp_avg(i).unwrap();
            assert_eq!(
                m.device(),
                device,
                "exp_avg {i} followed its parameter to {device}"
            );
            assert_eq!(m.id(), ids[i], "exp_avg {i} kept its identity");
            assert_eq!(moved_opt.exp_avg_sq(i).unwrap().device(), device);
            assert_close(
                &format!("parameter {i} after a step on {device}"),
                &moved[i].to_device(Device::Cpu).unwrap(),
                &stayed[i],
                2e-6,
            );
        }
    }
}

#[test]
fn bad_cuda_parameters_are_reported_by_index() {
    if tandem_test_support::select_cuda().is_none() {
        return;
    }
    // A gradient moved to another device than its parameter.
    let p = Tensor::zeros(&[4], DType::F32, GPU)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    p.set_grad(Some(Tensor::zeros(&[4], DType::F32, GPU).unwrap()))
        .unwrap();
    p.grad().unwrap().move_to_device(Device::Cpu).unwrap();
    let mut opt = Sgd::new(vec![p], SgdConfig::new(0.1)).unwrap();
    let err = opt.step().unwrap_err().to_string();
    assert!(
        err.contains("parameter 0") && err.contains("cpu") && err.contains("cuda:0"),
        "{err}"
    );

    // Two parameters that overlap in memory cannot be updated at once.
    let base = Tensor::zeros(&[10], DType::F32, GPU).unwrap();
    let view = |start: usize| {
        base.view_detached(base.layout().narrow("test", 0, start, 6).unwrap())
            .unwrap()
            .with_requires_grad()
            .unwrap()
    };
    let (a, b) = (view(0), view(4));
    for t in [&a, &b] {
        t.set_grad(Some(Tensor::ones(&[6], DType::F32, GPU).unwrap()))
            .unwrap();
    }
    let mut opt = Sgd::new(vec![a, b], SgdConfig::new(0.1)).unwrap();
    let err = opt.step().unwrap_err().to_string();
    assert!(
        err.contains("parameter 1") && err.contains("parameter 0"),
        "{err}"
    );

    // Half-precision parameters are not supported by the optimizers (as on the CPU).
    let h = Tensor::zeros(&[4], DType::F16, GPU)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    h.set_grad(Some(Tensor::zeros(&[4], DType::F16, GPU).unwrap()))
        .unwrap();
    let mut opt = Adam::new(vec![h], AdamConfig::default()).unwrap();
    let err = opt.step().unwrap_err().to_string();
    assert!(err.contains("f16"), "{err}");
}
