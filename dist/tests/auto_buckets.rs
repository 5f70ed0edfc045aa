//! The automatic bucket cap (`DdpConfig::auto_buckets`): ranks as threads train to the same
//! parameters as with a fixed cap and agree on every choice, the number of choices is bounded,
//! and the pure selection follows the link model.

mod ddp_common;

use ddp_common::*;
use tandem_autograd::TensorBackward;
use tandem_core::DType;
use tandem_dist::projection::LinkModel;
use tandem_dist::{
    choose_cap, fit_link, AutoBuckets, DdpConfig, DistributedDataParallel, JoinConfig, ParamReady,
};
use tandem_nn::loss::{cross_entropy, Reduction};
use tandem_optim::Optimizer;

const STEPS: usize = 10;

/// Auto buckets that decide after every 2 steps and always find the prediction "far", so that
/// every allowed re-tune happens; candidates that split the small CNN differently.
fn eager_auto() -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: 0.0005,
        first_bucket_mb: 0.0005,
        auto_buckets: Some(AutoBuckets {
            warmup_steps: 2,
            candidates_mb: vec![0.0005, 0.001, 0.002, 1.0],
            max_retunes: 2,
            retune_ratio: 1.0,
            retune_slack_ms: -1.0,
        }),
        ..DdpConfig::default()
    }
}

#[test]
fn auto_buckets_train_like_a_fixed_cap_and_every_rank_makes_the_same_bounded_choices() {
    for world in [2, 3] {
        let fixed = run_ranks(world, |rank, group| {
            train_ddp(Model::Cnn, rank, group, STEPS, DdpConfig::default(), false)
                .0
                .final_params
        });
        let auto = run_ranks(world, |rank, group| {
            let (outcome, ddp) = train_ddp(Model::Cnn, rank, group, STEPS, eager_auto(), false);
            (
                outcome.final_params,
                ddp.bucket_choices(),
                ddp.bucket_layout(),
            )
        });
        let (_, choices0, layout0) = &auto[0];
        // The first choice after the rebuild (1) and 2 warm-up steps, then one re-tune every 2
        // steps until both are spent: 3, 5, 7 — and none after, though 10 steps ran.
        let after: Vec<u64> = choices0.iter().map(|c| c.after_backwards).collect();
        assert_eq!(after, vec![3, 5, 7], "{world} ranks: {choices0:?}");
        let last = choices0.last().unwrap();
        assert_eq!(layout0.len(), last.buckets, "{world} ranks: {layout0:?}");
        for c in choices0 {
            assert!([0.0005, 0.001, 0.002, 1.0].contains(&c.cap_mb), "{c:?}");
            assert!(c.predicted_exposed_ms.is_finite() && c.predicted_exposed_ms >= 0.0);
        }
        for (rank, (params, choices, layout)) in auto.iter().enumerate() {
            assert_eq!(choices, choices0, "{world} ranks: rank {rank}'s choices");
            assert_eq!(layout, layout0, "{world} ranks: rank {rank}'s buckets");
            // Bucketing changes which gradients travel together, not their sums.
            assert_close(
                &format!("{world} ranks, rank {rank}: auto vs fixed cap"),
                params,
                &fixed[rank],
                1e-6,
            );
        }
    }
}

/// Ranks with `counts` batches each train inside `join`; their parameters and choices.
fn train_joined(counts: &[usize], config: fn() -> DdpConfig) -> Vec<(Snapshot, usize)> {
    let world = counts.len();
    run_ranks(world, |rank, group| {
        let ddp = DistributedDataParallel::new(build(Model::Cnn, 7), group, config()).unwrap();
        let mut opt = sgd(ddp.module().parameters());
        ddp.join(JoinConfig::default(), || {
            for step in 0..counts[rank] {
                let (x, y) = batch(Model::Cnn, step);
                opt.zero_grad().unwrap();
                let out = ddp.forward(&shard(&x, rank, world)).unwrap();
                let loss = cross_entropy(&out, &shard(&y, rank, world), Reduction::Mean).unwrap();
                loss.backward().unwrap();
                opt.step().unwrap();
            }
        })
        .unwrap();
        let choices = ddp.bucket_choices().len();
        (snapshot_params(ddp.module().as_ref()), choices)
    })
}

#[test]
fn joined_ranks_shadow_the_decisions_of_the_active_ones() {
    // Rank 1 joins after 2 steps, before the first decision (after 3); rank 2 after 6.
    let counts = [9, 2, 6];
    let fixed = train_joined(&counts, DdpConfig::default);
    let auto = train_joined(&counts, eager_auto);
    for (rank, ((params, choices), (want, _))) in auto.iter().zip(&fixed).enumerate() {
        assert_eq!(*choices, 3, "rank {rank}");
        assert_close(&format!("joined rank {rank}"), params, want, 1e-6);
    }
}

#[test]
fn one_rank_has_nothing_to_tune() {
    let choices = run_ranks(1, |rank, group| {
        train_ddp(Model::Mlp, rank, group, 5, DdpConfig::auto(), false)
            .1
            .bucket_choices()
    });
    assert!(choices[0].is_empty());
}

/// 40 gradients of 1 MiB, ready 1 ms apart during a 40 ms backward.
fn ladder() -> Vec<ParamReady> {
    (0..40)
        .map(|i| ParamReady {
            bytes: 1 << 20,
            dtype: DType::F32,
            ready_ms: (i + 1) as f64,
        })
        .collect()
}

#[test]
fn the_choice_follows_the_link_model() {
    let caps = AutoBuckets::default().candidates_mb;
    let pick = |link: LinkModel| choose_cap(&ladder(), 40.0, &link, 2, &caps, 1.0).unwrap();
    // Bandwidth-bound (≈1 ms per MiB, no latency): small buckets keep pace with backward and
    // leave ~one bucket exposed; one 40 MiB bucket would leave ~42 ms exposed.
    let slow = pick(LinkModel::new(1.0, 0.0));
    assert!(slow.cap_mb <= 4.0, "{slow:?}");
    assert!(slow.exposed_ms < 5.0, "{slow:?}");
    // Latency-bound (10 ms per all-reduce on two ranks, bytes nearly free): the fewer
    // buckets the better; the 1 MiB first bucket stays, then one bucket of the rest.
    let laggy = pick(LinkModel::new(1e6, 5000.0));
    assert_eq!(laggy.cap_mb, 50.0, "{laggy:?}");
    assert_eq!(laggy.buckets, 2, "{laggy:?}");
    assert!(laggy.exposed_ms < 10.5, "{laggy:?}");
    // A free link: every cap hides everything, and the tie goes to the fewest buckets.
    let free = pick(LinkModel::new(1e9, 0.0));
    assert_eq!((free.cap_mb, free.buckets), (50.0, 2), "{free:?}");
    // No candidates, no choice.
    assert!(choose_cap(&ladder(), 40.0, &LinkModel::new(1.0, 0.0), 2, &[], 1.0).is_none());
}

/// A small model whose 1.25 MiB of gradients (40 × 32 KiB, ready 1 ms apart) nearly all fit
/// DDP's 1 MiB first bucket, on a bandwidth-bound link (50 MB/s: ≈0.66 ms per 32 KiB, 26 ms
/// in all): only a cap that also splits the first bucket lets communication start well before
/// backward ends.
#[test]
fn a_small_model_on_a_slow_link_gets_small_buckets_from_the_first_one_on() {
    let params: Vec<ParamReady> = (0..40)
        .map(|i| ParamReady {
            bytes: 32 << 10,
            dtype: DType::F32,
            ready_ms: (i + 1) as f64,
        })
        .collect();
    let caps = AutoBuckets::default().candidates_mb;
    let link = LinkModel::new(0.05, 0.0);
    let choice = choose_cap(&params, 40.0, &link, 2, &caps, 1.0).unwrap();
    assert!(choice.cap_mb <= 0.25, "{choice:?}");
    assert!(choice.buckets >= 5, "{choice:?}");
    // 0.25 MiB buckets: one of 5.2 ms every 8 ms, ≈5 ms exposed. With the first bucket left
    // at 1 MiB, 32 gradients would wait for the 32nd (32 ms) and take 21 ms: ≈18 ms exposed.
    assert!(choice.exposed_ms < 10.0, "{choice:?}");
}

#[test]
fn the_link_is_fitted_from_bucket_sizes_and_times_and_far_predictions_are_recognised() {
    let link = LinkModel::new(0.1, 50.0);
    let samples: Vec<(u64, f64)> = [4096u64, 1 << 18, 1 << 20]
        .iter()
        .map(|&b| (b, link.all_reduce_s(b, 2)))
        .collect();
    let fit = fit_link(&samples, 2).unwrap();
    assert!((fit.alpha_s - link.alpha_s).abs() < 1e-9, "{fit}");
    assert!(
        (fit.busbw_bytes_per_s / link.busbw_bytes_per_s - 1.0).abs() < 1e-6,
        "{fit}"
    );
    let auto = AutoBuckets::default();
    assert!(auto.is_far(10.0, 2.0));
    assert!(auto.is_far(2.0, 10.0));
    assert!(!auto.is_far(3.0, 2.0));
    assert!(!auto.is_far(0.5, 0.0), "timer noise under the slack");
}
