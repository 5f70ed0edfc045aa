//! The everyday checkpoint API: one argument per thing.
//!
//! - [`save_model`] / [`load_model`]: a model's parameters and buffers alone, in exactly the
//!   file PyTorch's `safetensors.torch.save_file(model.state_dict(), path)` writes, loaded
//!   strictly (every name on both sides).
//! - [`save_training`] / [`load_training`]: the model *and* what resuming training needs —
//!   optimizer state, counters, a learning rate, string metadata — gathered in a
//!   [`TrainingState`].
//!
//! The file layout and how PyTorch loads the files are described on [`save_training`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use tandem_core::Tensor;

use super::{load_checkpoint, load_state_dict, write_checkpoint, GRAD_SCALER_PREFIX};
use crate::{Error, Module, Result};

/// Metadata key under which both files of a [`save_training`] record the same save id.
const SAVE_ID_METADATA: &str = "tandem.save_id";

/// Saves `model`'s parameters and buffers to `path` as safetensors (atomically), named by
/// module path exactly as PyTorch names the same model's `state_dict()`. PyTorch loads the
/// file with `model.load_state_dict(safetensors.torch.load_file(path))`; tandem with
/// [`load_model`].
pub fn save_model(path: impl AsRef<Path>, model: &dyn Module) -> Result<()> {
    write_checkpoint(path.as_ref(), Some(model), &[], &BTreeMap::new(), &[])
}

/// Loads the model file at `path` (written by [`save_model`], [`save_training`] or PyTorch's
/// `safetensors.torch.save_file(model.state_dict(), path)`) into `model`'s parameters and
/// buffers in place, strictly: a name on one side only, or a shape or dtype that differs, is
/// an error listing them, and then nothing is copied.
pub fn load_model(path: impl AsRef<Path>, model: &dyn Module) -> Result<()> {
    let checkpoint = load_checkpoint(path)?;
    load_state_dict(model, &checkpoint, true)?;
    Ok(())
}

/// Where [`save_training`] puts the training state of the model file `model_path`: the same
/// folder and name with `.training` before the extension (`run/model.safetensors` →
/// `run/model.training.safetensors`; without an extension, `.training` appended).
pub fn training_state_path(model_path: impl AsRef<Path>) -> PathBuf {
    let path = model_path.as_ref();
    let stem = path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.training.{}", ext.to_string_lossy()),
        None => format!("{stem}.training"),
    };
    path.with_file_name(name)
}

/// What resuming training needs besides the model: optimizer states, other tensors (a step
/// counter, a learning rate) and string metadata (an epoch, a run name). Built with the
/// `with_…` methods and saved with [`save_training`]; [`load_training`] gives it back.
///
/// ```
/// # use tandem_nn::checkpoint::TrainingState;
/// # use tandem_core::{Device, Tensor};
/// # fn main() -> tandem_nn::Result<()> {
/// let optimizer_state: Vec<(String, Tensor)> = Vec::new(); // `optimizer.state()`
/// let state = TrainingState::new()
///     .with_optimizer("optimizer", optimizer_state)
///     .with_tensor("trainer.step", Tensor::scalar(3i64, Device::Cpu)?)
///     .with_metadata("epoch", "2");
/// assert_eq!(state.metadata()["epoch"], "2");
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default)]
pub struct TrainingState {
    tensors: Vec<(String, Tensor)>,
    metadata: BTreeMap<String, String>,
}

impl TrainingState {
    /// An empty training state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an optimizer's state (what `Optimizer::state()` returns) under `name`: each entry
    /// is stored as `{name}.{entry}` and [`TrainingState::optimizer`] gives them back for
    /// `Optimizer::load_state`. Use one name per optimizer.
    pub fn with_optimizer(mut self, name: &str, state: Vec<(String, Tensor)>) -> Self {
        self.tensors.extend(
            state
                .into_iter()
                .map(|(entry, t)| (format!("{name}.{entry}"), t)),
        );
        self
    }

    /// Adds a gradient scaler's state (what `GradScaler::state()` returns: its scale, growth
    /// tracker and counters) under [`GRAD_SCALER_PREFIX`], so that a resumed f16 run continues
    /// with the same scale; [`TrainingState::grad_scaler`] gives it back for
    /// `GradScaler::load_state`. A disabled scaler's state is empty and adds nothing.
    pub fn with_grad_scaler(mut self, state: Vec<(String, Tensor)>) -> Self {
        self.tensors.extend(
            state
                .into_iter()
                .map(|(entry, t)| (format!("{GRAD_SCALER_PREFIX}{entry}"), t)),
        );
        self
    }

    /// The gradient scaler's state saved with [`TrainingState::with_grad_scaler`], ready for
    /// `GradScaler::load_state`; empty when there is none.
    pub fn grad_scaler(&self) -> Vec<(String, Tensor)> {
        self.tensors
            .iter()
            .filter_map(|(n, t)| {
                n.strip_prefix(GRAD_SCALER_PREFIX)
                    .map(|e| (e.to_string(), t.clone()))
            })
            .collect()
    }

    /// Adds one tensor under `name` (a step counter, a learning rate). Names must differ from
    /// every other tensor of the state, optimizer entries included ([`save_training`] refuses
    /// duplicates).
    pub fn with_tensor(mut self, name: impl Into<String>, tensor: Tensor) -> Self {
        self.tensors.push((name.into(), tensor));
        self
    }

    /// Adds a string of metadata. Keys starting with `tandem.` are reserved.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// The state of the optimizer saved as `name`, ready for `Optimizer::load_state`; empty
    /// when there is none.
    pub fn optimizer(&self, name: &str) -> Vec<(String, Tensor)> {
        let prefix = format!("{name}.");
        self.tensors
            .iter()
            .filter_map(|(n, t)| n.strip_prefix(&prefix).map(|e| (e.to_string(), t.clone())))
            .collect()
    }

    /// The tensor stored under its full name (`trainer.step`, `optimizer.step`).
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Every tensor of the state by full name.
    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.tensors
    }

    /// The string metadata.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

/// Saves `model` to the model file `path` (exactly what [`save_model`] writes, so PyTorch
/// loads it strictly) and `state` to [`training_state_path`]`(path)`.
///
/// **Layout.** [`save_training`] writes two files: the model file at `path`, which is only the
/// model's state dict (so PyTorch's strict `model.load_state_dict(load_file(path))` loads it
/// as it loads a [`save_model`] file), and the training state beside it at
/// [`training_state_path`]`(path)` (`model.safetensors` → `model.training.safetensors`): each
/// optimizer's entries under `{name}.` (`optimizer.0.momentum_buffer`, `optimizer.step`), the
/// other tensors under their own names, the metadata in the safetensors header. In PyTorch the
/// model loads with
///
/// ```text
/// from safetensors.torch import load_file
/// model.load_state_dict(load_file("model.safetensors"))           # strict, as always
/// training = load_file("model.training.safetensors")               # plain tensors by name
/// ```
///
/// and the training file's tensors are there to be picked out by name (tandem's optimizer
/// state is not PyTorch's `optimizer.state_dict()` layout, so it does not load into a PyTorch
/// optimizer as it is).
///
/// **Consistency.** Each file is written atomically (see the [checkpoint module](super));
/// the pair is not one write, so both record the same save id: the training file is written
/// first and the model file last, and [`load_training`] refuses a pair whose ids differ (a save
/// interrupted between the two files), naming both files.
///
/// Errors if two tensors of `state` share a name, a metadata key starts with `tandem.`, or a
/// write fails (naming the file).
pub fn save_training(
    path: impl AsRef<Path>,
    model: &dyn Module,
    state: &TrainingState,
) -> Result<()> {
    let path = path.as_ref();
    let save_id = [(SAVE_ID_METADATA, new_save_id())];
    write_checkpoint(
        &training_state_path(path),
        None,
        &state.tensors,
        &state.metadata,
        &save_id,
    )?;
    write_checkpoint(path, Some(model), &[], &BTreeMap::new(), &save_id)
}

/// Loads the model file `path` into `model` strictly (as [`load_model`] does) and returns the
/// training state saved beside it by [`save_training`]. Tensors come back on the CPU
/// (`Optimizer::load_state` moves them to the parameters' device).
///
/// Errors, before anything is copied into `model`, if the training file is missing or
/// unreadable or was written by another save than the model file.
pub fn load_training(path: impl AsRef<Path>, model: &dyn Module) -> Result<TrainingState> {
    let path = path.as_ref();
    let training_path = training_state_path(path);
    let checkpoint = load_checkpoint(path)?;
    let training = load_checkpoint(&training_path)?;
    let ids = (
        checkpoint.reserved.get(SAVE_ID_METADATA),
        training.reserved.get(SAVE_ID_METADATA),
    );
    if ids.0.is_none() || ids.0 != ids.1 {
        return Err(Error::Format {
            path: training_path.clone(),
            msg: format!(
                "this training state was not saved together with the model file {} (a save \
                 interrupted between the two files, or a model file written by something other \
                 than save_training); load the model alone with load_model",
                path.display()
            ),
        });
    }
    if let Some(name) = training.module_state.keys().next() {
        return Err(Error::Format {
            path: training_path.clone(),
            msg: format!("`{name}` is not listed as a training-state tensor"),
        });
    }
    load_state_dict(model, &checkpoint, true)?;
    Ok(TrainingState {
        tensors: training.extra.into_iter().collect(),
        metadata: training.metadata,
    })
}

/// An id no other save shares: this process, the time and a counter.
fn new_save_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use std::fs;

    use tandem_core::{DType, Device};

    use super::*;
    use crate::{BatchNormConfig, LinearConfig, Sequential};

    fn scratch_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-train-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn model() -> Sequential {
        Sequential::new()
            .add(LinearConfig::new(3, 2).init().unwrap())
            .add(BatchNormConfig::new(2).init().unwrap())
    }

    fn values(m: &dyn Module) -> Vec<Vec<f64>> {
        m.named_tensors()
            .iter()
            .map(|(_, _, t)| t.to_vec_f64().unwrap())
            .collect()
    }

    #[test]
    fn training_state_path_puts_training_before_the_extension() {
        assert_eq!(
            training_state_path("run/model.safetensors"),
            Path::new("run/model.training.safetensors")
        );
        assert_eq!(
            training_state_path("run/model"),
            Path::new("run/model.training")
        );
    }

    #[test]
    fn save_model_writes_module_state_only_and_load_model_is_strict() {
        let dir = scratch_dir("model");
        let path = dir.join("model.safetensors");
        let saved = model();
        save_model(&path, &saved).unwrap();
        let checkpoint = load_checkpoint(&path).unwrap();
        assert!(checkpoint.extras().is_empty() && checkpoint.metadata().is_empty());

        let restored = model();
        restored.parameters()[0].fill_(0.25).unwrap();
        load_model(&path, &restored).unwrap();
        assert_eq!(values(&restored), values(&saved));

        let without_norm = Sequential::new().add(LinearConfig::new(3, 2).init().unwrap());
        let msg = load_model(&path, &without_norm).unwrap_err().to_string();
        assert!(
            msg.contains("unexpected keys") && msg.contains("1.weight"),
            "{msg}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn training_state_round_trips_beside_a_model_only_file() {
        let dir = scratch_dir("round-trip");
        let path = dir.join("model.safetensors");
        let saved = model();
        let momentum = Tensor::from_vec(vec![0.5f32, -1.0], &[2], Device::Cpu).unwrap();
        let state = TrainingState::new()
            .with_optimizer(
                "optimizer",
                vec![
                    ("0.momentum_buffer".to_string(), momentum),
                    (
                        "step".to_string(),
                        Tensor::scalar(4i64, Device::Cpu).unwrap(),
                    ),
                ],
            )
            .with_tensor("trainer.step", Tensor::scalar(9i64, Device::Cpu).unwrap())
            .with_grad_scaler(vec![(
                "scale".to_string(),
                Tensor::scalar(1024.0f32, Device::Cpu).unwrap(),
            )])
            .with_metadata("epoch", "3");
        save_training(&path, &saved, &state).unwrap();

        // The model file is the model's state dict alone, as PyTorch's strict load needs.
        let model_file = load_checkpoint(&path).unwrap();
        assert!(model_file.extras().is_empty() && model_file.metadata().is_empty());
        let names: Vec<&String> = model_file.module_state().keys().collect();
        let expected: Vec<String> = saved.named_tensors().into_iter().map(|t| t.0).collect();
        assert_eq!(names.len(), expected.len());

        let restored = model();
        restored.parameters()[0].fill_(0.0).unwrap();
        let loaded = load_training(&path, &restored).unwrap();
        assert_eq!(values(&restored), values(&saved));
        assert_eq!(loaded.metadata()["epoch"], "3");
        let optimizer = loaded.optimizer("optimizer");
        assert_eq!(optimizer.len(), 2);
        assert_eq!(optimizer[0].0, "0.momentum_buffer");
        assert_eq!(optimizer[0].1.to_vec::<f32>().unwrap(), [0.5, -1.0]);
        assert_eq!(optimizer[1].0, "step");
        let scaler = loaded.grad_scaler();
        assert_eq!(scaler.len(), 1);
        assert_eq!(scaler[0].0, "scale");
        assert_eq!(scaler[0].1.to_vec::<f32>().unwrap(), [1024.0]);
        assert!(loaded.tensor("grad_scaler.scale").is_some());
        let step = loaded.tensor("trainer.step").unwrap();
        assert_eq!(step.dtype(), DType::I64);
        assert_eq!(step.to_vec::<i64>().unwrap(), [9]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_training_file_of_another_save_or_a_duplicate_name_is_refused() {
        let dir = scratch_dir("mismatch");
        let path = dir.join("model.safetensors");
        let m = model();
        let state =
            TrainingState::new().with_tensor("step", Tensor::scalar(1i64, Device::Cpu).unwrap());
        save_training(&path, &m, &state).unwrap();
        // A later save interrupted after its training file: the pair no longer matches.
        let older_model = fs::read(&path).unwrap();
        save_training(&path, &m, &state).unwrap();
        fs::write(&path, older_model).unwrap();
        let before = values(&m);
        m.parameters()[0].fill_(7.0).unwrap();
        let msg = load_training(&path, &m).unwrap_err().to_string();
        assert!(
            msg.contains("model.training.safetensors") && msg.contains("not saved together"),
            "{msg}"
        );
        assert_ne!(values(&m), before, "nothing copied");

        // A model file without its training file.
        save_model(&path, &m).unwrap();
        assert!(load_training(&path, &m).is_err());

        let twice = state.with_tensor("step", Tensor::scalar(2i64, Device::Cpu).unwrap());
        let msg = save_training(&path, &m, &twice).unwrap_err().to_string();
        assert!(msg.contains("`step`"), "{msg}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
