//! The examples' checkpoints: written every `--checkpoint-every` steps and after every epoch,
//! and resumed from — the newest complete one in `--checkpoint-dir` — so a job that a launcher
//! restarts after a failure ends exactly where an uninterrupted one would.
//!
//! A checkpoint holds everything the next step depends on: the model's parameters and buffers,
//! the optimizer's state (momentum buffers, step count), the learning rate, where training is
//! (epoch, steps done in it, global step, the epoch's running loss and the finished epochs'
//! results) and every rank's random-number state (gathered to rank 0, which writes the file).
//! Data order and augmentation are seeded by `(seed, epoch, sample)`, so restoring the
//! position restores them. Files are `{name}-epoch{E}.safetensors` after epoch E (kept) and
//! `{name}-step{G}.safetensors` after global step G inside an epoch (each removed once a newer
//! checkpoint is complete). Writes are atomic; a file that does not load (torn, corrupt) is
//! skipped with a warning in favour of the next newest. A checkpoint records the run's
//! settings, and resuming it with different ones is an error naming the setting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::json;
use tandem::core::{DType, Device, Tensor};
use tandem::nn::checkpoint::{
    load_checkpoint, load_rng_state, load_state_dict, rng_state, save_checkpoint, Checkpoint,
    GRAD_SCALER_PREFIX, OPTIMIZER_PREFIX,
};
use tandem::nn::Module;
use tandem::optim::Optimizer;

use super::output::complain;
use super::{AnyError, EpochResult, Trainer};

/// Extra holding the learning rate (an f64 of one element).
const LEARNING_RATE: &str = "schedule.learning_rate";
/// Prefix of the settings in a checkpoint's metadata.
const SETTING: &str = "setting.";

/// Where training stands.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// The epoch in progress, from 1.
    pub epoch: usize,
    /// Steps of that epoch already taken.
    pub epoch_step: usize,
    /// Steps taken in all.
    pub global_step: usize,
    /// Sum of the epoch's step losses so far (its reported loss is the mean).
    pub loss_sum: f64,
    /// The finished epochs.
    pub history: Vec<EpochResult>,
}

impl Progress {
    /// The start of training.
    pub fn start() -> Self {
        Progress {
            epoch: 1,
            epoch_step: 0,
            global_step: 0,
            loss_sum: 0.0,
            history: Vec::new(),
        }
    }

    /// Records the finished epoch and moves to the start of the next.
    pub fn finish_epoch(&mut self, result: EpochResult) {
        self.history.push(result);
        self.epoch += 1;
        self.epoch_step = 0;
        self.loss_sum = 0.0;
    }
}

/// Where and how often checkpoints are written, and what a resumed run must agree with.
pub struct Checkpoints {
    dir: Option<PathBuf>,
    every: Option<usize>,
    name: String,
    settings: BTreeMap<String, String>,
    steps_per_epoch: usize,
}

/// A run restored from a checkpoint.
pub struct Resumed {
    /// The checkpoint it was restored from.
    pub path: PathBuf,
    /// Where training stands in it.
    pub progress: Progress,
    /// The gradient scaler's state (`--amp f16`; empty otherwise), for
    /// [`Trainer::load_scaler`].
    pub grad_scaler: Vec<(String, Tensor)>,
}

impl Checkpoints {
    /// Checkpoints named `name-…` in `dir` (none without a directory), one every `every`
    /// steps inside epochs (`None`: only at epoch ends), for a run with `settings` and
    /// `steps_per_epoch` steps per epoch.
    pub fn new(
        dir: Option<PathBuf>,
        every: Option<usize>,
        name: &str,
        settings: BTreeMap<String, String>,
        steps_per_epoch: usize,
    ) -> Result<Self, AnyError> {
        if every == Some(0) {
            return Err("--checkpoint-every must be at least 1".into());
        }
        Ok(Checkpoints {
            dir,
            every,
            name: name.to_string(),
            settings,
            steps_per_epoch,
        })
    }

    /// Whether a checkpoint is due after `progress`'s last step (inside an epoch; the epoch's
    /// end has its own).
    pub fn due(&self, progress: &Progress) -> bool {
        self.dir.is_some()
            && progress.epoch_step < self.steps_per_epoch
            && self
                .every
                .is_some_and(|n| progress.global_step.is_multiple_of(n))
    }

    /// Writes a checkpoint of `progress` (every rank calls this; rank 0 writes). At an
    /// epoch's start (`epoch_step` 0) it is the previous epoch's end-of-epoch checkpoint.
    pub fn save(
        &self,
        trainer: &Trainer,
        optimizer: &dyn Optimizer,
        progress: &Progress,
    ) -> Result<(), AnyError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let model = trainer.model.as_ref();
        let rng = gather_rng_states(trainer, model)?;
        if trainer.rank() != 0 {
            return Ok(());
        }
        let mut extras: Vec<(String, Tensor)> = optimizer
            .state()
            .into_iter()
            .map(|(name, t)| (format!("{OPTIMIZER_PREFIX}{name}"), t))
            .collect();
        extras.extend(rng);
        extras.extend(trainer.scaler_state());
        extras.push((
            LEARNING_RATE.to_string(),
            Tensor::from_vec(vec![optimizer.learning_rate()], &[1], Device::Cpu)?,
        ));
        let epoch_end = progress.epoch_step == 0 && progress.epoch > 1;
        let (epoch, epoch_step, file) = if epoch_end {
            let e = progress.epoch - 1;
            (
                e,
                self.steps_per_epoch,
                format!("{}-epoch{e}.safetensors", self.name),
            )
        } else {
            let g = progress.global_step;
            (
                progress.epoch,
                progress.epoch_step,
                format!("{}-step{g}.safetensors", self.name),
            )
        };
        let history: Vec<serde_json::Value> = progress
            .history
            .iter()
            .map(|r| {
                json!({
                    "train_loss": r.train_loss,
                    "test_accuracy": r.test_accuracy,
                    "test_correct": r.test_correct,
                    "images_per_sec": r.images_per_sec,
                    "seconds": r.seconds,
                    "train_samples": r.train_samples,
                })
            })
            .collect();
        let mut metadata = BTreeMap::from([
            ("model".to_string(), self.name.clone()),
            ("epoch".to_string(), epoch.to_string()),
            ("epoch_step".to_string(), epoch_step.to_string()),
            ("global_step".to_string(), progress.global_step.to_string()),
            (
                "steps_per_epoch".to_string(),
                self.steps_per_epoch.to_string(),
            ),
            // Rust prints the shortest text that parses back to the same f64.
            ("loss_sum".to_string(), progress.loss_sum.to_string()),
            ("history".to_string(), serde_json::to_string(&history)?),
        ]);
        for (key, value) in &self.settings {
            metadata.insert(format!("{SETTING}{key}"), value.clone());
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(file);
        save_checkpoint(&path, model, &extras, &metadata)?;
        self.remove_superseded(dir, progress.global_step);
        Ok(())
    }

    /// Restores the newest complete checkpoint of `dir` (or `explicit`) into `model` and
    /// `optimizer` and this rank's random-number state; `None` when there is none.
    pub fn resume(
        &self,
        explicit: Option<&Path>,
        model: &dyn Module,
        optimizer: &mut dyn Optimizer,
        rank: usize,
    ) -> Result<Option<Resumed>, AnyError> {
        let checkpoint = match explicit {
            Some(path) => load_checkpoint(path)?,
            None => match self.newest() {
                Some(c) => c,
                None => return Ok(None),
            },
        };
        let path = checkpoint.path().to_path_buf();
        let at = |e: String| -> AnyError { format!("{}: {e}", path.display()).into() };
        self.check_settings(&checkpoint).map_err(at)?;
        load_state_dict(model, &checkpoint, true)?;
        optimizer.load_state(&checkpoint.extra(OPTIMIZER_PREFIX))?;
        if let Some(lr) = checkpoint.tensor(LEARNING_RATE) {
            optimizer.set_learning_rate(lr.to_vec::<f64>()?[0])?;
        }
        let rng = checkpoint.extra(&format!("rng.rank{rank}."));
        if !rng.is_empty() {
            load_rng_state(model, &rng)?;
        }
        let progress = self.progress_of(&checkpoint).map_err(at)?;
        let grad_scaler = checkpoint.extra(GRAD_SCALER_PREFIX);
        Ok(Some(Resumed {
            path,
            progress,
            grad_scaler,
        }))
    }

    /// The newest checkpoint of this run's name that loads; unreadable ones are skipped.
    fn newest(&self) -> Option<Checkpoint> {
        let dir = self.dir.as_ref()?;
        let mut candidates: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let rest = name
                    .strip_prefix(&format!("{}-", self.name))?
                    .strip_suffix(".safetensors")?;
                let step = if let Some(e) = rest.strip_prefix("epoch") {
                    e.parse::<usize>().ok()?.checked_mul(self.steps_per_epoch)?
                } else {
                    rest.strip_prefix("step")?.parse().ok()?
                };
                Some((step, entry.path()))
            })
            .collect();
        candidates.sort_by_key(|c| std::cmp::Reverse(c.0));
        for (_, path) in candidates {
            match load_checkpoint(&path) {
                Ok(c) => return Some(c),
                Err(e) => complain(format_args!(
                    "warning: skipping checkpoint {} (incomplete or unreadable): {e}",
                    path.display()
                )),
            }
        }
        None
    }

    fn check_settings(&self, checkpoint: &Checkpoint) -> Result<(), String> {
        let meta = checkpoint.metadata();
        for (key, value) in &self.settings {
            if let Some(theirs) = meta.get(&format!("{SETTING}{key}")) {
                if theirs != value {
                    return Err(format!(
                        "written by a run with {key} {theirs}, but this run has {key} {value}; \
                         pass the same settings to resume it, or another --checkpoint-dir to \
                         start over"
                    ));
                }
            }
        }
        if let Some(steps) = meta.get("steps_per_epoch") {
            if steps != &self.steps_per_epoch.to_string() {
                return Err(format!(
                    "written by a run with {steps} steps per epoch, this run has {}",
                    self.steps_per_epoch
                ));
            }
        }
        Ok(())
    }

    fn progress_of(&self, checkpoint: &Checkpoint) -> Result<Progress, String> {
        let meta = checkpoint.metadata();
        let number = |key: &str| -> Result<usize, String> {
            meta.get(key)
                .ok_or_else(|| format!("no `{key}` in the metadata"))?
                .parse()
                .map_err(|e| format!("metadata `{key}`: {e}"))
        };
        let epoch = number("epoch")?;
        // Checkpoints of earlier versions were written after whole epochs only.
        let epoch_step = number("epoch_step").unwrap_or(self.steps_per_epoch);
        let global_step = number("global_step").unwrap_or(epoch * self.steps_per_epoch);
        let history = match meta.get("history") {
            Some(text) => parse_history(text)?,
            None => Vec::new(),
        };
        let loss_sum: f64 = match meta.get("loss_sum") {
            Some(v) => v.parse().map_err(|e| format!("metadata `loss_sum`: {e}"))?,
            None => 0.0,
        };
        Ok(if epoch_step >= self.steps_per_epoch {
            Progress {
                epoch: epoch + 1,
                epoch_step: 0,
                global_step,
                loss_sum: 0.0,
                history,
            }
        } else {
            Progress {
                epoch,
                epoch_step,
                global_step,
                loss_sum,
                history,
            }
        })
    }

    /// Removes the inside-epoch checkpoints older than `global_step` (epoch ends are kept).
    fn remove_superseded(&self, dir: &Path, global_step: usize) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let step = name
                .strip_prefix(&format!("{}-step", self.name))
                .and_then(|r| r.strip_suffix(".safetensors"))
                .and_then(|s| s.parse::<usize>().ok());
            if step.is_some_and(|s| s < global_step) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Loads the model's parameters and buffers (nothing else) from the checkpoint `path`, for
/// evaluation: unlike [`Checkpoints::resume`] it does not compare the run's settings, so a
/// checkpoint written by any number of ranks may be evaluated by any other.
#[allow(dead_code)] // Not every example offers --eval-only.
pub fn load_model(path: &Path, model: &dyn Module) -> Result<(), AnyError> {
    let checkpoint = load_checkpoint(path)?;
    load_state_dict(model, &checkpoint, true)?;
    Ok(())
}

/// Every rank's random-number state, as extras `rng.rank{K}.{generator}` (complete on rank 0).
fn gather_rng_states(
    trainer: &Trainer,
    model: &dyn Module,
) -> Result<Vec<(String, Tensor)>, AnyError> {
    let mine = rng_state(model)?;
    let names: Vec<String> = mine.iter().map(|(n, _)| n.clone()).collect();
    let sizes: Vec<usize> = mine.iter().map(|(_, t)| t.numel()).collect();
    let mut bytes = Vec::new();
    for (_, t) in &mine {
        bytes.extend(t.to_vec::<u8>()?);
    }
    let n = bytes.len();
    let world = trainer.world_size();
    let all = match &trainer.ddp {
        Some(ddp) => {
            // On the group's device (NCCL: this rank's GPU).
            let device = model.device();
            let input = Tensor::from_vec(bytes, &[n], Device::Cpu)?.to_device(device)?;
            let output = Tensor::zeros(&[world * n], DType::U8, device)?;
            ddp.group().all_gather(&input, &output)?.wait()?;
            output.to_vec::<u8>()?
        }
        None => bytes,
    };
    let mut out = Vec::with_capacity(world * names.len());
    for rank in 0..world {
        let mut at = rank * n;
        for (name, &size) in names.iter().zip(&sizes) {
            let slice = all[at..at + size].to_vec();
            out.push((
                format!("rng.rank{rank}.{name}"),
                Tensor::from_vec(slice, &[size], Device::Cpu)?,
            ));
            at += size;
        }
    }
    Ok(out)
}

fn parse_history(text: &str) -> Result<Vec<EpochResult>, String> {
    let values: Vec<serde_json::Value> =
        serde_json::from_str(text).map_err(|e| format!("metadata `history`: {e}"))?;
    values
        .iter()
        .map(|v| {
            let field = |k: &str| {
                v.get(k)
                    .and_then(serde_json::Value::as_f64)
                    .ok_or_else(|| format!("metadata `history`: an epoch without `{k}`"))
            };
            Ok(EpochResult {
                train_loss: field("train_loss")?,
                test_accuracy: field("test_accuracy")?,
                // Checkpoints of earlier versions did not record it.
                test_correct: v
                    .get("test_correct")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0),
                images_per_sec: field("images_per_sec")?,
                seconds: field("seconds")?,
                // Checkpoints of earlier versions did not record it.
                train_samples: v
                    .get("train_samples")
                    .and_then(serde_json::Value::as_array)
                    .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
                    .unwrap_or_default(),
            })
        })
        .collect()
}
