//! Stragglers named: a rank made slow by an injected forward delay is named by every rank's
//! summary, as slow compute, from step times gathered across ranks every K steps (threads as
//! ranks); a rank that skips the gather is named by the hang diagnosis with the gather's label.

mod ddp_common;

use std::sync::Arc;
use std::time::Duration;

use ddp_common::*;
use tandem_autograd::TensorBackward;
use tandem_dist::{
    DdpConfig, DistributedDataParallel, GroupConfig, ProcessGroup, StragglerKind,
    ThreadProcessGroup,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_optim::Optimizer;

const STEPS: usize = 12;
const EVERY: usize = 5;
const DELAY: Duration = Duration::from_millis(60);

#[test]
fn a_rank_with_an_injected_forward_delay_is_named_slow_compute_on_every_rank() {
    let world = 3;
    let slow = 1;
    let results = run_ranks(world, |rank, group| {
        let config = DdpConfig {
            straggler_every: EVERY,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(build(Model::Mlp, 7), group, config).unwrap();
        if rank == slow {
            ddp.inject_forward_delay(DELAY);
        }
        let mut opt = sgd(ddp.module().parameters());
        for step in 0..STEPS {
            let (x, y) = batch(Model::Mlp, step);
            opt.zero_grad().unwrap();
            let out = ddp.forward(&shard(&x, rank, world)).unwrap();
            let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        // Gathered periodically at forwards 6 and 12: the 11 steps before the last forward.
        let periodic = ddp.telemetry().stragglers().clone();
        let last = ddp.gather_step_times().unwrap();
        (periodic, last, ddp.telemetry().stragglers().clone())
    });
    for (rank, (periodic, last, from_telemetry)) in results.iter().enumerate() {
        assert_eq!(periodic.steps, STEPS - 1, "rank {rank}: {periodic}");
        assert_eq!(last.steps, STEPS, "rank {rank}: {last}");
        assert_eq!(last, from_telemetry, "rank {rank}");
        assert_eq!(last, &results[0].1, "rank {rank} disagrees with rank 0");
        let s = last.slowest().expect("a straggler is named");
        assert_eq!(s.rank, slow, "rank {rank}: {last}");
        assert_eq!(s.kind, StragglerKind::SlowCompute, "rank {rank}: {last}");
        // The delay is attributed in most steps, with most of its size.
        assert!(s.steps * 4 >= STEPS * 3, "rank {rank}: {last}");
        assert!(
            s.mean_excess_secs >= DELAY.as_secs_f64() / 2.0,
            "rank {rank}: {last}"
        );
        let text = last.to_string();
        assert!(text.contains("slowest rank 1: slow compute"), "{text}");
    }
}

#[test]
fn evaluation_forwards_do_not_count_and_a_single_rank_names_no_one() {
    let results = run_ranks(1, |_, group| {
        let config = DdpConfig {
            straggler_every: 1,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(build(Model::Mlp, 7), group, config).unwrap();
        let (x, _) = batch(Model::Mlp, 0);
        tandem_autograd::no_grad(|| {
            for _ in 0..3 {
                ddp.forward(&x).unwrap();
            }
        });
        ddp.gather_step_times().unwrap()
    });
    assert_eq!(results[0].steps, 0);
    assert_eq!(results[0].slowest(), None);
}

#[test]
fn a_rank_that_skips_the_stragglers_gather_is_named_with_its_label() {
    let config = GroupConfig {
        timeout: Duration::from_millis(300),
        ..GroupConfig::default()
    };
    let groups = ThreadProcessGroup::new_group_with(2, &config).unwrap();
    let results: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let group = Arc::new(g) as Arc<dyn ProcessGroup>;
                    let ddp = DistributedDataParallel::new(
                        build(Model::Mlp, 7),
                        group,
                        DdpConfig::default(),
                    )
                    .unwrap();
                    let mut opt = sgd(ddp.module().parameters());
                    let (x, y) = batch(Model::Mlp, 0);
                    opt.zero_grad().unwrap();
                    let out = ddp.forward(&shard(&x, rank, 2)).unwrap();
                    let loss = cross_entropy(&out, &shard(&y, rank, 2), Reduction::Mean).unwrap();
                    loss.backward().unwrap();
                    opt.step().unwrap();
                    if rank == 1 {
                        // Alive, holding its group, but skipping the gather.
                        std::thread::sleep(Duration::from_millis(1500));
                        return None;
                    }
                    Some(ddp.gather_step_times().unwrap_err().to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let err = results[0].as_deref().expect("rank 0's error");
    assert!(
        err.contains("rank 1 is at") && err.contains("(stragglers' step times;"),
        "{err}"
    );
}
