//! Evaluation metrics: classification accuracy counted over batches, and [`evaluate`], which
//! runs a model over a test set the way evaluation must run — in eval mode (dropout off, batch
//! norm on its running statistics) and without recording the autograd graph — and puts the
//! model back in the mode it was in.
//!
//! [`Accuracy`] keeps the counts, not the fraction, so the accuracies of several shards add up
//! exactly: under data-parallel training each rank can evaluate its own part of the test set
//! and `tandem_dist::metrics::all_reduce_accuracy` sums the counts over the ranks.
//!
//! ```text
//! let accuracy = evaluate(&model, test_loader.epoch(0))?;
//! println!("test accuracy {:.2}%", 100.0 * accuracy.fraction());
//! ```

use std::ops::{Add, AddAssign};

use tandem_autograd::no_grad;
use tandem_core::Tensor;

use crate::data::Batch;
use crate::{Error, Module, Result};

/// Correct predictions out of a number of samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// Samples whose predicted class is the label.
    pub correct: u64,
    /// Samples counted.
    pub total: u64,
}

impl Accuracy {
    /// `correct` out of `total`.
    pub fn new(correct: u64, total: u64) -> Self {
        Accuracy { correct, total }
    }

    /// The counts of one batch: `logits` `[N, C]` (the predicted class is the largest score's
    /// index, the first on ties) against integer `labels` `[N]`.
    ///
    /// Errors if `logits` is not 2-D, or `labels` is not 1-D with N entries.
    pub fn of_logits(logits: &Tensor, labels: &Tensor) -> Result<Self> {
        let n = match (logits.dims(), labels.dims()) {
            (&[n, _], &[m]) if n == m => n,
            (l, t) => {
                return Err(Error::input(
                    "Accuracy::of_logits",
                    format!(
                        "logits must be [N, C] and labels [N], got logits {l:?} and labels {t:?}"
                    ),
                ))
            }
        };
        let predicted = tandem_ops::argmax(logits, 1, false)?.to_vec::<i64>()?;
        let labels = labels.to_dtype(tandem_core::DType::I64)?.to_vec::<i64>()?;
        let correct = predicted
            .iter()
            .zip(&labels)
            .filter(|(p, l)| p == l)
            .count();
        Ok(Accuracy::new(correct as u64, n as u64))
    }

    /// The fraction correct, `correct / total` (0 when nothing was counted).
    pub fn fraction(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }
}

impl Add for Accuracy {
    type Output = Accuracy;

    fn add(self, other: Accuracy) -> Accuracy {
        Accuracy::new(self.correct + other.correct, self.total + other.total)
    }
}

impl AddAssign for Accuracy {
    fn add_assign(&mut self, other: Accuracy) {
        *self = *self + other;
    }
}

impl std::fmt::Display for Accuracy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2}% ({} of {})",
            100.0 * self.fraction(),
            self.correct,
            self.total
        )
    }
}

/// The classification accuracy of `model` over `batches` (a `DataLoader` epoch, or any
/// batches: inputs to the model, integer class labels as targets), computed in eval mode and
/// under `no_grad`. The model is back in the mode it was in (training or eval) when this
/// returns, error or not.
pub fn evaluate<I>(model: &dyn Module, batches: I) -> Result<Accuracy>
where
    I: IntoIterator<Item = Result<Batch>>,
{
    let was_training = model.is_training();
    model.eval();
    let counted = no_grad(|| {
        let mut accuracy = Accuracy::default();
        for batch in batches {
            let batch = batch?;
            let logits = model.forward(&batch.inputs)?;
            accuracy += Accuracy::of_logits(&logits, &batch.targets)?;
        }
        Ok(accuracy)
    });
    model.set_training(was_training);
    counted
}

#[cfg(test)]
mod tests {
    use tandem_autograd::is_grad_enabled;
    use tandem_core::Device;

    use super::*;
    use crate::{DropoutConfig, Forward, LinearConfig, Sequential, TrainingFlag};

    fn batch(inputs: Vec<f32>, labels: Vec<i64>) -> Result<Batch> {
        let n = labels.len();
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, &[n, 2], Device::Cpu)?,
            targets: Tensor::from_vec(labels, &[n], Device::Cpu)?,
        })
    }

    /// Passes its input through, and records the mode and grad mode of every forward.
    #[derive(Module)]
    struct Spy {
        flag: TrainingFlag,
        seen: parking_lot::Mutex<Vec<(bool, bool)>>,
    }

    impl Forward for Spy {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.seen
                .lock()
                .push((self.is_training(), is_grad_enabled()));
            Ok(x.clone())
        }
    }

    #[test]
    fn counts_argmax_hits_and_adds_exactly() {
        let logits =
            Tensor::from_vec(vec![0.1f32, 0.9, 2.0, -1.0, 3.0, 3.0], &[3, 2], Device::Cpu).unwrap();
        let labels = Tensor::from_vec(vec![1i64, 1, 0], &[3], Device::Cpu).unwrap();
        let a = Accuracy::of_logits(&logits, &labels).unwrap();
        assert_eq!(a, Accuracy::new(2, 3), "ties go to the first class");
        assert_eq!((a + Accuracy::new(1, 1)).fraction(), 0.75);
        assert_eq!(Accuracy::default().fraction(), 0.0);
        assert_eq!(a.to_string(), "66.67% (2 of 3)");
        let wrong = Tensor::from_vec(vec![1i64, 1], &[2], Device::Cpu).unwrap();
        let msg = Accuracy::of_logits(&logits, &wrong)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("[3, 2]") && msg.contains("[2]"), "{msg}");
    }

    #[test]
    fn evaluate_runs_in_eval_mode_without_grad_and_restores_the_mode() {
        let spy = Spy {
            flag: TrainingFlag::new(),
            seen: parking_lot::Mutex::new(Vec::new()),
        };
        let batches = vec![
            batch(vec![1.0, 0.0, 0.0, 1.0], vec![0, 0]),
            batch(vec![0.0, 5.0], vec![1]),
        ];
        spy.train();
        let accuracy = evaluate(&spy, batches).unwrap();
        assert_eq!(accuracy, Accuracy::new(2, 3));
        assert_eq!(*spy.seen.lock(), [(false, false), (false, false)]);
        assert!(spy.is_training(), "back in training mode");

        spy.eval();
        let failing = vec![
            batch(vec![1.0, 0.0], vec![0]),
            Err(Error::data("test", "boom")),
        ];
        assert!(evaluate(&spy, failing).is_err());
        assert!(!spy.is_training(), "back in eval mode after an error");
    }

    #[test]
    fn evaluate_turns_dropout_off() {
        let model = Sequential::new()
            .add(DropoutConfig::new(0.99).init().unwrap())
            .add(LinearConfig::new(2, 2).with_bias(false).init().unwrap());
        model.train();
        // With dropout on nearly every input would be zeroed; in eval mode the result is the
        // same on every call.
        let batches = || vec![batch(vec![1.0, 2.0, 3.0, -4.0], vec![0, 1])];
        let first = evaluate(&model, batches()).unwrap();
        for _ in 0..5 {
            assert_eq!(evaluate(&model, batches()).unwrap(), first);
        }
        assert!(model.is_training());
    }
}
