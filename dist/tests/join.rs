//! `DistributedDataParallel::join` with ranks as threads: ranks with different numbers of
//! batches (one with none) finish, and the parameters equal a hand-computed SGD run for both
//! divisors, with and without SyncBatchNorm; without `join` the old behaviour (an error naming
//! the missing rank, after the group's timeout) remains. One SyncBatchNorm case also runs with
//! ranks as real processes over TCP on loopback.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tandem_autograd::TensorBackward;
use tandem_core::{DType, Device, Tensor};
use tandem_dist::{
    init_process_group, DdpConfig, DistributedDataParallel, GroupConfig, JoinConfig, JoinDivisor,
    LaunchEnv, ProcessGroup, SyncBatchNorm, ThreadProcessGroup,
};
use tandem_nn::{BatchNormConfig, LinearConfig, Module};
use tandem_optim::{Optimizer, Sgd, SgdConfig};

const LR: f64 = 0.1;
/// Samples per batch.
const PER: usize = 2;

/// Runs `f(rank, group)` on `world` ranks as threads.
fn run_ranks<T: Send>(
    world: usize,
    config: &GroupConfig,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    let groups = ThreadProcessGroup::new_group_with(world, config).unwrap();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| s.spawn(move || f(rank, Arc::new(g) as Arc<dyn ProcessGroup>)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A value of sample `i` of batch `step` of `rank`, feature `k`: small and distinct.
fn value(rank: usize, step: usize, i: usize, k: usize) -> f64 {
    let h = (rank * 131 + step * 31 + i * 7 + k * 3) % 17;
    h as f64 / 8.0 - 1.0
}

/// The linear model's batch: inputs `[PER, 2]` and targets `[PER, 1]`.
fn linear_batch(rank: usize, step: usize) -> (Vec<[f64; 2]>, Vec<f64>) {
    let x = (0..PER)
        .map(|i| [value(rank, step, i, 0), value(rank, step, i, 1)])
        .collect();
    let t = (0..PER).map(|i| value(rank, step, i, 5)).collect();
    (x, t)
}

fn f32_tensor(values: Vec<f64>, shape: &[usize]) -> Tensor {
    let v: Vec<f32> = values.into_iter().map(|v| v as f32).collect();
    Tensor::from_vec(v, shape, Device::Cpu).unwrap()
}

/// The hand-computed run: the loss of a rank is ½·Σ(w·x + b − t)² over its samples, DDP's
/// gradient is the sum of the active ranks' gradients divided by the world size (default) or
/// by the active ranks' count, and plain SGD steps with it.
fn linear_reference(counts: &[usize], divisor: JoinDivisor) -> ([f64; 2], f64) {
    let (mut w, mut b) = ([0.5, -0.25], 0.1);
    let steps = counts.iter().copied().max().unwrap_or(0);
    for step in 0..steps {
        let active: Vec<usize> = (0..counts.len()).filter(|&r| counts[r] > step).collect();
        let d = match divisor {
            JoinDivisor::InitialWorldSize => counts.len(),
            JoinDivisor::ActiveRanks => active.len(),
        } as f64;
        let (mut gw, mut gb) = ([0.0; 2], 0.0);
        for &r in &active {
            let (xs, ts) = linear_batch(r, step);
            for (x, t) in xs.iter().zip(&ts) {
                let e = w[0] * x[0] + w[1] * x[1] + b - t;
                gw[0] += e * x[0];
                gw[1] += e * x[1];
                gb += e;
            }
        }
        w[0] -= LR * gw[0] / d;
        w[1] -= LR * gw[1] / d;
        b -= LR * gb / d;
    }
    (w, b)
}

/// Trains the linear model under DDP inside `join`, rank `rank` with `counts[rank]` batches;
/// returns its final weight and bias.
fn train_linear(
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    counts: &[usize],
    divisor: JoinDivisor,
) -> (Vec<f32>, Vec<f32>) {
    let linear = Arc::new(LinearConfig::new(2, 1).init().unwrap());
    linear
        .weight()
        .copy_(&f32_tensor(vec![0.5, -0.25], &[1, 2]))
        .unwrap();
    let bias = linear.bias().unwrap().clone();
    bias.copy_(&f32_tensor(vec![0.1], &[1])).unwrap();
    let module: Arc<dyn Module> = linear.clone();
    let ddp = DistributedDataParallel::new(module, group, DdpConfig::default()).unwrap();
    let mut opt = Sgd::new(ddp.module().parameters(), SgdConfig::new(LR)).unwrap();
    ddp.join(JoinConfig { divisor }, || {
        for step in 0..counts[rank] {
            let (xs, ts) = linear_batch(rank, step);
            let x = f32_tensor(xs.iter().flatten().copied().collect(), &[PER, 2]);
            let t = f32_tensor(ts, &[PER, 1]);
            opt.zero_grad().unwrap();
            let y = ddp.forward(&x).unwrap();
            let e = tandem_ops::sub(&y, &t).unwrap();
            let loss = tandem_ops::sum_all(&tandem_ops::mul(&e, &e).unwrap()).unwrap();
            tandem_ops::mul_scalar(&loss, 0.5)
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
        }
    })
    .unwrap();
    (
        linear.weight().to_vec::<f32>().unwrap(),
        bias.to_vec::<f32>().unwrap(),
    )
}

fn assert_near(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what} element {k}: {g} vs {w}"
        );
    }
}

fn check_linear(counts: &[usize], divisor: JoinDivisor) {
    let (w, b) = linear_reference(counts, divisor);
    let outcomes = run_ranks(counts.len(), &GroupConfig::default(), |rank, group| {
        train_linear(rank, group, counts, divisor)
    });
    for (rank, (gw, gb)) in outcomes.iter().enumerate() {
        let what = format!("counts {counts:?}, {divisor:?}, rank {rank}");
        assert_near(&format!("{what}: weight"), gw, &w);
        assert_near(&format!("{what}: bias"), gb, &[b]);
    }
}

#[test]
fn uneven_batches_with_a_rank_without_any_match_hand_computed_sgd_for_both_divisors() {
    for divisor in [JoinDivisor::InitialWorldSize, JoinDivisor::ActiveRanks] {
        check_linear(&[3, 1, 0], divisor);
        check_linear(&[0, 2], divisor);
        check_linear(&[2, 4, 1, 3], divisor);
    }
}

#[test]
fn even_batches_inside_join_match_plain_ddp() {
    check_linear(&[2, 2], JoinDivisor::InitialWorldSize);
}

/// Channels and per-sample positions of the SyncBatchNorm case.
const C: usize = 2;
const L: usize = 3;

/// Batch `step` of `rank` for SyncBatchNorm: inputs and loss coefficients, `[PER, C, 1, L]`.
fn bn_batch(rank: usize, step: usize) -> (Vec<f64>, Vec<f64>) {
    let n = PER * C * L;
    let x = (0..n)
        .map(|j| value(rank, step, j, 1) * 2.0 + j as f64 * 0.1)
        .collect();
    let c = (0..n).map(|j| value(rank, step, j, 4)).collect();
    (x, c)
}

fn batch_norm() -> Arc<tandem_nn::BatchNorm2d> {
    let bn = BatchNormConfig::new(C).init().unwrap();
    bn.weight()
        .unwrap()
        .copy_(&f32_tensor(vec![1.5, 0.5], &[C]))
        .unwrap();
    bn.bias()
        .unwrap()
        .copy_(&f32_tensor(vec![0.2, -0.3], &[C]))
        .unwrap();
    Arc::new(bn)
}

/// Weight, bias, running mean and running variance of a batch norm.
fn bn_state(bn: &tandem_nn::BatchNorm2d) -> Vec<Vec<f32>> {
    [bn.weight(), bn.bias(), bn.running_mean(), bn.running_var()]
        .iter()
        .map(|t| t.unwrap().to_vec::<f32>().unwrap())
        .collect()
}

/// The loss `Σ y·c` of one batch norm forward.
fn bn_loss(layer: &dyn Module, x: Vec<f64>, c: Vec<f64>, n: usize) -> Tensor {
    let x = f32_tensor(x, &[n, C, 1, L]);
    let c = f32_tensor(c, &[n, C, 1, L]);
    let y = layer.forward(&x).unwrap();
    tandem_ops::sum_all(&tandem_ops::mul(&y, &c).unwrap()).unwrap()
}

/// One process, one plain batch norm: each step normalises the active ranks' samples together
/// (what SyncBatchNorm over the active ranks computes) and steps with the summed gradient
/// divided as the divisor says.
fn bn_reference(counts: &[usize], divisor: JoinDivisor) -> Vec<Vec<f32>> {
    let bn = batch_norm();
    let steps = counts.iter().copied().max().unwrap_or(0);
    for step in 0..steps {
        let active: Vec<usize> = (0..counts.len()).filter(|&r| counts[r] > step).collect();
        let d = match divisor {
            JoinDivisor::InitialWorldSize => counts.len(),
            JoinDivisor::ActiveRanks => active.len(),
        } as f64;
        let (mut x, mut c) = (Vec::new(), Vec::new());
        for &r in &active {
            let (xr, cr) = bn_batch(r, step);
            x.extend(xr);
            c.extend(cr);
        }
        for p in bn.parameters() {
            p.set_grad(None).unwrap();
        }
        bn_loss(bn.as_ref(), x, c, PER * active.len())
            .backward()
            .unwrap();
        for p in bn.parameters() {
            let g = p.grad().unwrap();
            let update = tandem_ops::mul_scalar(&g, LR / d).unwrap();
            p.copy_(&tandem_ops::sub(&p.detach(), &update).unwrap())
                .unwrap();
        }
    }
    bn_state(&bn)
}

fn train_sync_bn(
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    counts: &[usize],
    divisor: JoinDivisor,
) -> Vec<Vec<f32>> {
    let bn = batch_norm();
    let sync: Arc<dyn Module> = Arc::new(SyncBatchNorm::new(bn.clone(), group.clone()));
    let ddp = DistributedDataParallel::new(sync, group, DdpConfig::default()).unwrap();
    let mut opt = Sgd::new(ddp.module().parameters(), SgdConfig::new(LR)).unwrap();
    ddp.join(JoinConfig { divisor }, || {
        for step in 0..counts[rank] {
            let (x, c) = bn_batch(rank, step);
            opt.zero_grad().unwrap();
            let y = ddp.forward(&f32_tensor(x, &[PER, C, 1, L])).unwrap();
            let c = f32_tensor(c, &[PER, C, 1, L]);
            tandem_ops::sum_all(&tandem_ops::mul(&y, &c).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
        }
    })
    .unwrap();
    bn_state(&bn)
}

#[test]
fn sync_batch_norm_statistics_cover_only_the_active_ranks_samples() {
    for (counts, divisor) in [
        (&[2usize, 0, 3, 1][..], JoinDivisor::InitialWorldSize),
        (&[1, 3][..], JoinDivisor::ActiveRanks),
    ] {
        let want = bn_reference(counts, divisor);
        let outcomes = run_ranks(counts.len(), &GroupConfig::default(), |rank, group| {
            train_sync_bn(rank, group, counts, divisor)
        });
        for (rank, got) in outcomes.iter().enumerate() {
            for (k, name) in ["weight", "bias", "running_mean", "running_var"]
                .iter()
                .enumerate()
            {
                let want: Vec<f64> = want[k].iter().map(|&v| v as f64).collect();
                assert_near(
                    &format!("counts {counts:?}, {divisor:?}, rank {rank}: {name}"),
                    &got[k],
                    &want,
                );
            }
        }
    }
}

#[test]
fn without_join_a_rank_that_runs_out_is_named_after_the_timeout() {
    let config = GroupConfig {
        timeout: Duration::from_millis(500),
        ..GroupConfig::default()
    };
    let counts = [2usize, 1];
    let outcomes = run_ranks(2, &config, |rank, group| {
        let linear = Arc::new(LinearConfig::new(2, 1).init().unwrap());
        let module: Arc<dyn Module> = linear;
        let ddp = DistributedDataParallel::new(module, group, DdpConfig::default()).unwrap();
        let mut failure = None;
        for _ in 0..counts[rank] {
            let x = Tensor::ones(&[PER, 2], DType::F32, Device::Cpu).unwrap();
            let step = ddp.forward(&x).map_err(|e| e.to_string()).and_then(|y| {
                let loss = tandem_ops::sum_all(&y).unwrap();
                loss.backward().map_err(|e| e.to_string())
            });
            if let Err(e) = step {
                failure = Some(e);
                break;
            }
        }
        // Rank 1 stays in the group until rank 0 has given up, so rank 0 times out.
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        failure
    });
    let err = outcomes[0].clone().expect("rank 0 must fail, not hang");
    assert!(err.contains("rank 1"), "{err}");
    assert!(outcomes[1].is_none(), "{:?}", outcomes[1]);
}

/// The per-rank batch counts of the process case.
const PROCESS_COUNTS: [usize; 3] = [2, 0, 3];

/// In a re-executed worker process: trains the SyncBatchNorm case inside `join` and prints its
/// final state.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(common::WORKER_VAR) else {
        return;
    };
    let code = match join_worker(&mode) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn join_worker(mode: &str) -> Result<(), String> {
    if mode != "join-syncbn" {
        return Err(format!("unknown worker mode {mode}"));
    }
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let config = GroupConfig {
        timeout: Duration::from_secs(60),
        ..GroupConfig::default()
    };
    let group: Arc<dyn ProcessGroup> =
        Arc::new(init_process_group(&env, config).map_err(|e| e.to_string())?);
    let rank = group.rank();
    let state = train_sync_bn(rank, group, &PROCESS_COUNTS, JoinDivisor::InitialWorldSize);
    for (k, values) in state.iter().enumerate() {
        let text: Vec<String> = values.iter().map(|v| format!("{v:e}")).collect();
        println!("state {k} {}", text.join(" "));
    }
    Ok(())
}

#[test]
fn sync_batch_norm_inside_join_over_tcp_processes_matches_the_reference() {
    let want = bn_reference(&PROCESS_COUNTS, JoinDivisor::InitialWorldSize);
    let results =
        common::Job::start(PROCESS_COUNTS.len(), "join-syncbn").wait(Duration::from_secs(120));
    for (rank, (status, output)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {rank} failed with {status}:\n{output}"
        );
        for (k, want) in want.iter().enumerate() {
            let line = output
                .lines()
                // The first line follows libtest's `test worker ... ` on the same line.
                .find_map(|l| l.split_once(&format!("state {k} ")).map(|(_, rest)| rest))
                .unwrap_or_else(|| panic!("rank {rank}: no state {k} in:\n{output}"));
            let got: Vec<f32> = line.split(' ').map(|v| v.parse().unwrap()).collect();
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            assert_near(&format!("process rank {rank}, state {k}"), &got, &want);
        }
    }
}

/// `used(x)`, plus `extra(x)` unless some row's first feature is negative: the active ranks'
/// batches never use `extra`, but a joined rank's empty batch (no negative row) does.
#[derive(tandem_nn::Module)]
struct SkipsExtra {
    used: tandem_nn::Child,
    extra: tandem_nn::Child,
    training: tandem_nn::TrainingFlag,
}

impl tandem_nn::Forward for SkipsExtra {
    fn forward(&self, x: &Tensor) -> tandem_nn::Result<Tensor> {
        let h = self.used.forward(x)?;
        let values = x.to_vec::<f32>()?;
        if (0..x.dims()[0]).any(|r| values[r * 2] < 0.0) {
            return Ok(h);
        }
        Ok(tandem_ops::add(&h, &self.extra.forward(x)?)?)
    }
}

#[test]
fn a_parameter_only_a_joined_ranks_shadow_reaches_stays_without_gradient() {
    let counts = [2usize, 0];
    let outcomes = run_ranks(2, &GroupConfig::default(), |rank, group| {
        let model = Arc::new(SkipsExtra {
            used: LinearConfig::new(2, 1).init().unwrap().into(),
            extra: LinearConfig::new(2, 1).init().unwrap().into(),
            training: tandem_nn::TrainingFlag::new(),
        });
        let config = DdpConfig {
            find_unused_parameters: true,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(model.clone(), group, config).unwrap();
        let mut extra_grads = Vec::new();
        ddp.join(JoinConfig::default(), || {
            for _ in 0..counts[rank] {
                let x = f32_tensor(vec![-1.0, 0.5, 2.0, 1.0], &[PER, 2]);
                let y = ddp.forward(&x).unwrap();
                tandem_ops::sum_all(&y).unwrap().backward().unwrap();
                let extra: Vec<bool> = model
                    .named_parameters()
                    .into_iter()
                    .filter(|(path, _)| path.starts_with("extra."))
                    .map(|(_, p)| p.grad().is_some())
                    .collect();
                extra_grads.push(extra);
            }
        })
        .unwrap();
        extra_grads
    });
    assert_eq!(
        outcomes[0],
        vec![vec![false, false]; 2],
        "rank 0: `extra` got a gradient"
    );
}
