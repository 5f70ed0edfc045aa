//! The fused Adam/AdamW kernel (`optim/src/kernels/adam.cu`), run on the CPU by the host
//! harness through the launch plan the CUDA path uses, against tandem's CPU optimizers (`Adam`
//! and `AdamW` on CPU tensors): four steps over one table of tensors of odd sizes (and an empty
//! one), for every combination of coupled/decoupled weight decay, AMSGrad, betas, eps and a
//! zero learning rate, in f32 and f64, with several chunkings and grids. Parameters and every
//! moment estimate must equal the CPU's bit for bit after every step (the bias corrections are
//! the CPU's, from the step count); gradients stay untouched, nothing is written outside a
//! tensor, and without AMSGrad its buffer is not touched.

mod common;
mod optim_common;

use common::poison;
use optim_common::*;
use rand::SeedableRng;
use tandem_core::{Element, Tensor};
use tandem_optim::multi_tensor::{adam_launch, TableEntry, TensorTable};
use tandem_optim::{Adam, AdamConfig, AdamW, Optimizer};

const STEPS: usize = 4;

fn configs() -> Vec<AdamConfig> {
    let mut out = Vec::new();
    for weight_decay in [0.0, 0.1] {
        for amsgrad in [false, true] {
            for (beta1, beta2, eps) in [(0.9, 0.999, 1e-8), (0.8, 0.5, 1e-3)] {
                out.push(
                    AdamConfig::new(0.05)
                        .with_betas(beta1, beta2)
                        .with_eps(eps)
                        .with_weight_decay(weight_decay)
                        .with_amsgrad(amsgrad),
                );
            }
        }
    }
    // A zero learning rate leaves AdamW's parameters unshrunk (and unchanged).
    out.push(
        AdamConfig::new(0.0)
            .with_weight_decay(0.1)
            .with_amsgrad(true),
    );
    out
}

/// The CPU optimizer's state entry `name` of parameter `i`, or `None`.
fn cpu_state<T: Element>(opt: &dyn Optimizer, i: usize, name: &str) -> Option<Vec<T>> {
    let key = format!("{i}.{name}");
    opt.state()
        .into_iter()
        .find(|(n, _)| *n == key)
        .map(|(_, t)| t.to_vec::<T>().unwrap())
}

fn check<T: Element>(cfg: AdamConfig, decoupled: bool, cut: Cut, seed: u64) {
    let what = format!(
        "{} {} {cfg:?} {cut:?}",
        if decoupled { "AdamW" } else { "Adam" },
        T::DTYPE
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let init: Vec<Vec<T>> = SIZES.iter().map(|&n| random(&mut rng, n)).collect();
    let cpu_params: Vec<Tensor> = init.iter().map(|v| cpu_param(v)).collect();
    let mut cpu: Box<dyn Optimizer> = if decoupled {
        Box::new(AdamW::new(cpu_params.clone(), cfg).unwrap())
    } else {
        Box::new(Adam::new(cpu_params.clone(), cfg).unwrap())
    };
    let zeros = |n: usize| Dense::new(&vec![T::from_f64(0.0); n]);
    let mut params: Vec<Dense<T>> = init.iter().map(|v| Dense::new(v)).collect();
    let mut exp_avg: Vec<Dense<T>> = SIZES.iter().map(|&n| zeros(n)).collect();
    let mut exp_avg_sq: Vec<Dense<T>> = SIZES.iter().map(|&n| zeros(n)).collect();
    let mut max_exp_avg_sq: Vec<Dense<T>> = SIZES
        .iter()
        .map(|&n| {
            if cfg.amsgrad {
                zeros(n)
            } else {
                Dense::new(&vec![poison::<T>(); n])
            }
        })
        .collect();
    for step in 0..STEPS {
        let grads: Vec<Vec<T>> = SIZES.iter().map(|&n| random(&mut rng, n)).collect();
        for (p, g) in cpu_params.iter().zip(&grads) {
            set_cpu_grad(p, g);
        }
        cpu.step().unwrap();

        let mut grad_buffers: Vec<Dense<T>> = grads.iter().map(|g| Dense::new(g)).collect();
        let entries: Vec<TableEntry> = (0..SIZES.len())
            .map(|i| TableEntry {
                param: params[i].address(),
                grad: grad_buffers[i].address(),
                state: [
                    exp_avg[i].address(),
                    exp_avg_sq[i].address(),
                    if cfg.amsgrad {
                        max_exp_avg_sq[i].address()
                    } else {
                        0
                    },
                ],
                numel: SIZES[i] as u64,
            })
            .collect();
        let table = TensorTable::new("test", T::DTYPE, &entries, cut.chunk).unwrap();
        let launch = adam_launch(
            &table,
            table.words().as_ptr() as u64,
            &cfg,
            decoupled,
            step as u64 + 1,
        )
        .unwrap();
        let what = format!("{what} step {step}");
        run_cut(&launch, cut, &what);

        for i in 0..SIZES.len() {
            let at = |role: &str| format!("{what}: tensor {i} ({} elements) {role}", SIZES[i]);
            params[i].assert_equals(&cpu_params[i].to_vec::<T>().unwrap(), &at("parameter"));
            grad_buffers[i].assert_equals(&grads[i], &at("gradient changed"));
            let state = |name| cpu_state::<T>(cpu.as_ref(), i, name).unwrap();
            exp_avg[i].assert_equals(&state("exp_avg"), &at("exp_avg"));
            exp_avg_sq[i].assert_equals(&state("exp_avg_sq"), &at("exp_avg_sq"));
            let want_max = cpu_state::<T>(cpu.as_ref(), i, "max_exp_avg_sq")
                .unwrap_or_else(|| vec![poison::<T>(); SIZES[i]]);
            max_exp_avg_sq[i].assert_equals(&want_max, &at("max_exp_avg_sq"));
        }
    }
}

#[test]
fn adam_matches_the_cpu_optimizer_bit_for_bit_for_every_option() {
    for (seed, cfg) in configs().into_iter().enumerate() {
        for cut in cuts() {
            check::<f32>(cfg, false, cut, seed as u64);
            check::<f64>(cfg, false, cut, 100 + seed as u64);
        }
    }
}

#[test]
fn adamw_matches_the_cpu_optimizer_bit_for_bit_for_every_option() {
    for (seed, cfg) in configs().into_iter().enumerate() {
        for cut in cuts() {
            check::<f32>(cfg, true, cut, 200 + seed as u64);
            check::<f64>(cfg, true, cut, 300 + seed as u64);
        }
    }
}

#[test]
fn a_later_step_count_uses_that_steps_bias_corrections() {
    // A tensor whose first update comes at optimizer step 3 is bias-corrected as step 1 on the
    // CPU; the CUDA path launches it with its own count. Here: one launch at count 1 after the
    // CPU optimizer skipped the tensor twice.
    let cfg = AdamConfig::new(0.05);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (a, b) = (random::<f32>(&mut rng, 50), random::<f32>(&mut rng, 70));
    let (pa, pb) = (cpu_param(&a), cpu_param(&b));
    let mut cpu = Adam::new(vec![pa.clone(), pb.clone()], cfg).unwrap();
    for _ in 0..2 {
        set_cpu_grad(&pa, &random::<f32>(&mut rng, 50));
        cpu.step().unwrap();
    }
    pa.set_grad(None).unwrap();
    let g = random::<f32>(&mut rng, 70);
    set_cpu_grad(&pb, &g);
    cpu.step().unwrap();

    let mut p = Dense::new(&b);
    let mut grad = Dense::new(&g);
    let (mut m, mut v) = (Dense::new(&[0.0f32; 70]), Dense::new(&[0.0f32; 70]));
    let entries = [TableEntry {
        param: p.address(),
        grad: grad.address(),
        state: [m.address(), v.address(), 0],
        numel: 70,
    }];
    let table = TensorTable::new("test", tandem_core::DType::F32, &entries, 32).unwrap();
    let launch = adam_launch(&table, table.words().as_ptr() as u64, &cfg, false, 1).unwrap();
    run_cut(
        &launch,
        Cut {
            chunk: 32,
            small_grid: false,
        },
        "late tensor",
    );
    p.assert_equals(&pb.to_vec::<f32>().unwrap(), "late tensor's parameter");
    m.assert_equals(&cpu.exp_avg(1).unwrap().to_vec::<f32>().unwrap(), "exp_avg");
}
