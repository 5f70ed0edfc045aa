//! Metrics across ranks: the counts each rank gathered on its own part of a test set, summed
//! over the group, so every rank ends with the metric of the whole set.
//!
//! ```text
//! // Each rank evaluates its shard of the test set (batches i with i % world == rank).
//! let mine = tandem_nn::metrics::evaluate(model.as_ref(), shard)?;
//! let all = all_reduce_accuracy(group.as_ref(), mine)?;   // identical on every rank
//! ```

use tandem_core::Tensor;
use tandem_nn::metrics::Accuracy;

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
