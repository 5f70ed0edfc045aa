//! The fused SGD kernel (`optim/src/kernels/sgd.cu`), run on the CPU by the host harness
//! through the launch plan the CUDA path uses, against tandem's CPU optimizer (`Sgd` on CPU
//! tensors): three steps over one table of tensors of odd sizes (and an empty one), for every
//! valid combination of momentum, dampening, Nesterov and weight decay, in f32 and f64, with
//! several chunkings and grids. Parameters and momentum buffers must equal the CPU's bit for
//! bit after every step; gradients stay untouched, nothing is written outside a tensor, a
//! momentum buffer is not read on its first step (it starts poisoned), and without momentum
//! no buffer is touched.

mod common;
mod optim_common;

use common::poison;
use optim_common::*;
use rand::SeedableRng;
use tandem_core::{Element, Tensor};
use tandem_optim::multi_tensor::{sgd_launch, TableEntry, TensorTable};
use tandem_optim::{Optimizer, Sgd, SgdConfig};

const STEPS: usize = 3;

fn configs() -> Vec<SgdConfig> {
    let mut out = Vec::new();
    for momentum in [0.0, 0.9] {
        for dampening in [0.0, 0.3] {
            for nesterov in [false, true] {
                for weight_decay in [0.0, 0.01] {
                    let cfg = SgdConfig::new(0.1)
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
    out.push(SgdConfig::new(0.0).with_momentum(0.5));
    out
}

fn check<T: Element>(cfg: SgdConfig, cut: Cut, seed: u64) {
    let what = format!("SGD {} {cfg:?} {cut:?}", T::DTYPE);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let init: Vec<Vec<T>> = SIZES.iter().map(|&n| random(&mut rng, n)).collect();
    let cpu_params: Vec<Tensor> = init.iter().map(|v| cpu_param(v)).collect();
    let mut cpu = Sgd::new(cpu_params.clone(), cfg).unwrap();
    let mut params: Vec<Dense<T>> = init.iter().map(|v| Dense::new(v)).collect();
    let mut buffers: Vec<Dense<T>> = SIZES
        .iter()
        .map(|&n| Dense::new(&vec![poison::<T>(); n]))
        .collect();
    let momentum = cfg.momentum != 0.0;
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
                state: [if momentum { buffers[i].address() } else { 0 }, 0, 0],
                numel: SIZES[i] as u64,
            })
            .collect();
        let table = TensorTable::new("test", T::DTYPE, &entries, cut.chunk).unwrap();
        let launch = sgd_launch(&table, table.words().as_ptr() as u64, &cfg, step == 0).unwrap();
        let what = format!("{what} step {step}");
        run_cut(&launch, cut, &what);

        for i in 0..SIZES.len() {
            let at = |role: &str| format!("{what}: tensor {i} ({} elements) {role}", SIZES[i]);
            params[i].assert_equals(&cpu_params[i].to_vec::<T>().unwrap(), &at("parameter"));
            grad_buffers[i].assert_equals(&grads[i], &at("gradient changed"));
            let want = match cpu.momentum_buffer(i) {
                Some(b) => b.to_vec::<T>().unwrap(),
                None => vec![poison::<T>(); SIZES[i]],
            };
            buffers[i].assert_equals(&want, &at("momentum buffer"));
        }
    }
}

#[test]
fn sgd_matches_the_cpu_optimizer_bit_for_bit_for_every_option() {
    for (seed, cfg) in configs().into_iter().enumerate() {
        for cut in cuts() {
            check::<f32>(cfg, cut, seed as u64);
            check::<f64>(cfg, cut, 100 + seed as u64);
        }
    }
}

#[test]
fn the_chunk_search_skips_empty_entries_of_a_hand_made_table() {
    // The table builder leaves empty tensors out; a table that has them anyway must still be
    // walked correctly (an empty entry owns no chunk).
    let cfg = SgdConfig::new(0.5);
    let mut a = Dense::new(&[1.0f32; 5]);
    let mut b = Dense::new(&[2.0f32; 3]);
    let mut ga = Dense::new(&[1.0f32; 5]);
    let mut gb = Dense::new(&[4.0f32; 3]);
    let entries = [
        TableEntry {
            param: a.address(),
            grad: ga.address(),
            numel: 5,
            ..Default::default()
        },
        TableEntry {
            param: b.address(),
            grad: gb.address(),
            numel: 3,
            ..Default::default()
        },
    ];
    let table = TensorTable::new("test", tandem_core::DType::F32, &entries, 2).unwrap();
    // The same entries with empty ones before, between and after: first chunks 0, 0, 3, 3, 5.
    let words = table.words();
    let empty = |first_chunk: u64| [0x10, 0x20, 0, 0, 0, 0, first_chunk, 0];
    let mut hand_made = Vec::new();
    hand_made.extend(empty(0));
    hand_made.extend(&words[..8]);
    hand_made.extend(empty(3));
    hand_made.extend(&words[8..]);
    hand_made.extend(empty(5));
    let mut launch = sgd_launch(&table, hand_made.as_ptr() as u64, &cfg, true).unwrap();
    launch.args[1] = tandem_core::cuda::launch::KernelArg::U32(5);
    for small_grid in [false, true] {
        run_cut(
            &launch,
            Cut {
                chunk: 2,
                small_grid,
            },
            "hand-made table",
        );
    }
    // Two plain SGD steps (the launch ran twice): p - 2 * 0.5 * g.
    a.assert_equals(&[0.0; 5], "first tensor");
    b.assert_equals(&[-2.0; 3], "second tensor");
}
