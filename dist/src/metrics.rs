//! Metrics across ranks: the counts each rank gathered on its own part of a test set, summed
//! over the group, so every rank ends with the metric of the whole set.
//!
//! For an exact metric each sample must be counted once: split the test set with
//! [`crate::DistributedEvalSampler`] (no padding, unlike the training `DistributedSampler`), not
//! with a sampler that repeats samples to even out the ranks.
//!
//! ```text
//! let sampler = DistributedEvalSampler::new(test_set.len(), world, rank)?;
//! let shard = DataLoader::with_sampler(test_set, Arc::new(sampler), config)?;
//! let all = evaluate_across_ranks(Some(group.as_ref()), model.as_ref(), shard.epoch(0))?;
//! // `all` is identical on every rank, and equal to one process evaluating the whole set.
//! ```

use tandem_core::Tensor;
use tandem_nn::data::Batch;
use tandem_nn::metrics::{evaluate, Accuracy};
use tandem_nn::Module;

use crate::{DistError, ProcessGroup, ReduceOp, Result};

/// Sums `local` (this rank's correct and total counts) over every rank of `group` with one
/// all-reduce; every rank gets the same total. Every rank must call it, like any collective.
///
/// The counts travel as f64 on the group's device, exact up to 2^53 samples.
pub fn all_reduce_accuracy(group: &dyn ProcessGroup, local: Accuracy) -> Result<Accuracy> {
    let rank = group.rank();
    let context = "all_reduce_accuracy";
    let device = group.comm_stream().device();
    let counts = Tensor::from_vec(vec![local.correct as f64, local.total as f64], &[2], device)
        .map_err(|e| DistError::tensor(rank, context, e))?;
    group.all_reduce(&counts, ReduceOp::Sum)?.wait()?;
    let summed = counts
        .to_vec::<f64>()
        .map_err(|e| DistError::tensor(rank, context, e))?;
    Ok(Accuracy::new(summed[0] as u64, summed[1] as u64))
}

/// Evaluates `model` over this rank's `batches` (`tandem_nn::metrics::evaluate`: eval mode,
/// `no_grad`, the mode restored) and sums the counts over `group`'s ranks; without a group,
/// the local counts. Every rank of the group must call it, including a rank whose part of
/// the test set is empty. Ranks may have different numbers of batches: evaluation issues no
/// collective before the one all-reduce of the counts (no DDP gradient reduction, and
/// `SyncBatchNorm` uses its running statistics in eval mode).
///
/// Errors with this rank's evaluation error (the other ranks then fail at the all-reduce, at
/// the group's timeout), or the all-reduce's.
pub fn evaluate_across_ranks<I>(
    group: Option<&dyn ProcessGroup>,
    model: &dyn Module,
    batches: I,
) -> Result<Accuracy>
where
    I: IntoIterator<Item = tandem_nn::Result<Batch>>,
{
    let rank = group.map_or(0, |g| g.rank());
    let local = evaluate(model, batches).map_err(|e| {
        DistError::model(
            rank,
            "evaluate_across_ranks: evaluating this rank's part of the test set",
            e,
        )
    })?;
    match group {
        Some(group) => all_reduce_accuracy(group, local),
        None => Ok(local),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tandem_core::Device;
    use tandem_nn::data::Batch;
    use tandem_nn::metrics::evaluate;
    use tandem_nn::{LinearConfig, Module};

    use super::*;
    use crate::ThreadProcessGroup;

    /// 10 samples of 2 features in batches of 2; the labels make some predictions wrong.
    fn test_set() -> Vec<(Vec<f32>, Vec<i64>)> {
        (0..5)
            .map(|b| {
                let x: Vec<f32> = (0..4).map(|i| ((b * 4 + i) as f32 * 0.7).sin()).collect();
                (x, vec![(b % 2) as i64, 1])
            })
            .collect()
    }

    fn batches(
        set: &[(Vec<f32>, Vec<i64>)],
        keep: impl Fn(usize) -> bool,
    ) -> Vec<tandem_nn::Result<Batch>> {
        set.iter()
            .enumerate()
            .filter(|(i, _)| keep(*i))
            .map(|(_, (x, y))| {
                Ok(Batch {
                    inputs: Tensor::from_vec(x.clone(), &[2, 2], Device::Cpu)?,
                    targets: Tensor::from_vec(y.clone(), &[2], Device::Cpu)?,
                })
            })
            .collect()
    }

    #[test]
    fn two_ranks_evaluating_halves_agree_with_one_process_evaluating_all() {
        let model = LinearConfig::new(2, 2).init().unwrap();
        let whole = evaluate(&model, batches(&test_set(), |_| true)).unwrap();
        assert_eq!(whole.total, 10);
        assert!(whole.correct > 0 && whole.correct < 10, "{whole}");
        let model = Arc::new(model);
        let world = 2;
        let handles: Vec<_> = ThreadProcessGroup::new_group(world)
            .unwrap()
            .into_iter()
            .map(|group| {
                let model = model.clone();
                std::thread::spawn(move || {
                    let rank = group.rank();
                    let mine = batches(&test_set(), |i| i % world == rank);
                    let local = evaluate(model.as_ref() as &dyn Module, mine).unwrap();
                    (local, all_reduce_accuracy(&group, local).unwrap())
                })
            })
            .collect();
        let results: Vec<(Accuracy, Accuracy)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(results[0].0.total, 6, "rank 0 has batches 0, 2, 4");
        assert_eq!(results[1].0.total, 4, "rank 1 has batches 1, 3");
        assert_ne!(results[0].0, whole, "each rank alone saw only its part");
        for (_, all) in &results {
            assert_eq!(*all, whole);
        }
    }
}
