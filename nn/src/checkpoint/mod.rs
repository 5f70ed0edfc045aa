//! Checkpoints: a model's parameters and buffers, optimizer state and string metadata in
//! [safetensors](https://github.com/huggingface/safetensors) files.
//!
//! **The everyday API** ([`save_model`], [`load_model`], [`save_training`], [`load_training`],
//! [`TrainingState`]; all in `tandem::prelude`) takes one argument per thing and keeps the
//! model file loadable by PyTorch's strict `load_state_dict`: the training state goes to a
//! file of its own beside it (see [`training_state_path`] and the layout in
//! [`save_training`]). A model alone:
//!
//! ```text
//! save_model("model.safetensors", &model)?;
//! load_model("model.safetensors", &model)?;   // strict, like PyTorch's load_state_dict
//! ```
//!
//! and a training run that resumes:
//!
//! ```text
//! let state = TrainingState::new()
//!     .with_optimizer("optimizer", optimizer.state())
//!     .with_metadata("epoch", epoch.to_string());
//! save_training("run/latest.safetensors", &model, &state)?;
//! // … later, in a fresh process:
//! let state = load_training("run/latest.safetensors", &model)?;
//! optimizer.load_state(&state.optimizer("optimizer"))?;
//! ```
//!
//! **The one-file API below** ([`save_checkpoint`], [`load_checkpoint`], [`load_state_dict`])
//! is what the everyday one is built on, for when everything must live in one file (the
//! examples' resumable checkpoints, written atomically as one unit).
//!
//! The file is exactly what PyTorch's `safetensors.torch.save_file(model.state_dict(), path)`
//! writes: one tensor per module path (`features.0.weight`, `bn1.running_mean`,
//! `bn1.num_batches_tracked` as a 0-dim I64), row-major, in the tensor's own dtype (F32, F64,
//! F16, BF16, I64 or U8). So a tandem checkpoint loads into the equivalent PyTorch model with
//! `model.load_state_dict(safetensors.torch.load_file(path))`, and a PyTorch-written one loads
//! into tandem with [`load_state_dict`].
//!
//! Anything that is not module state — optimizer state, a step counter — is passed to
//! [`save_checkpoint`] as `extra` tensors. The convention is a dotted prefix per owner:
//! the entries of the optimizer's `state()` go under [`OPTIMIZER_PREFIX`]
//! (`optimizer.3.momentum_buffer`, `optimizer.step`), anything else under a prefix of its
//! own. The names of the extras are recorded in the file's metadata under
//! [`EXTRA_KEYS_METADATA`], so [`load_state_dict`] knows they are not module state.
//! [`Checkpoint::extra`] gives them back with the prefix removed, ready for
//! `optimizer.load_state(...)`. String metadata (`epoch`, a run name) lands in the
//! safetensors `__metadata__` header. PyTorch's strict `load_state_dict` reports a file's
//! extras as unexpected keys; leave them out by the names the file lists:
//!
//! ```text
//! import json
//! from safetensors import safe_open
//! with safe_open(path, "pt") as f:
//!     extras = set(json.loads((f.metadata() or {}).get("tandem.extra_keys", "[]")))
//!     model.load_state_dict({k: f.get_tensor(k) for k in f.keys() if k not in extras})
//! ```
//!
//! Saving is atomic: the bytes go to a temporary file in the target's directory, which is
//! flushed to disk and then renamed over the target, and the directory itself is flushed. A
//! crash mid-save leaves the previous checkpoint intact, never a half-written one; the
//! temporary file it leaves is removed by the next save or load of that checkpoint (see
//! [`remove_stale_temporary_files`] for what counts as stale).
//!
//! [`rng_state`] and [`load_rng_state`] carry the random-number state (this thread's default
//! generator and every [`Dropout`](crate::Dropout) layer's) as extras, so a run resumed from
//! a checkpoint draws the same random numbers as one that never stopped.

mod atomic;
mod rng;
mod training;

pub use atomic::{remove_stale_temporary_files, STALE_AFTER};
pub use rng::{load_rng_state, rng_state};
pub use training::{
    load_model, load_training, save_model, save_training, training_state_path, TrainingState,
};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};
use tandem_core::half::{bf16, f16};
use tandem_core::{with_element_type, DType, Device, Tensor};

use crate::{Error, Module, Result};

/// Prefix under which a training loop stores its optimizer's state in `extra`
/// (`optimizer.` + each name of `Optimizer::state()`, e.g. `optimizer.step`).
pub const OPTIMIZER_PREFIX: &str = "optimizer.";

/// Prefix under which a training loop stores its gradient scaler's state in `extra`
/// (`grad_scaler.` + each name of `GradScaler::state()` in `tandem-optim`, e.g.
/// `grad_scaler.scale`); [`TrainingState::with_grad_scaler`] uses it too.
pub const GRAD_SCALER_PREFIX: &str = "grad_scaler.";

/// Metadata key under which [`save_checkpoint`] records the names of the `extra` tensors, as a
/// JSON array. Metadata keys starting with `tandem.` are reserved.
pub const EXTRA_KEYS_METADATA: &str = "tandem.extra_keys";

const RESERVED_METADATA_PREFIX: &str = "tandem.";

/// A checkpoint read back from disk: its tensors by name (on the CPU) and its metadata.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    path: PathBuf,
    module_state: BTreeMap<String, Tensor>,
    extra: BTreeMap<String, Tensor>,
    metadata: BTreeMap<String, String>,
    /// tandem's own metadata (keys under `tandem.`, other than the extras' names).
    reserved: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The module's parameters and buffers by dotted path (everything that is not an extra).
    pub fn module_state(&self) -> &BTreeMap<String, Tensor> {
        &self.module_state
    }

    /// The `extra` tensors given to [`save_checkpoint`], by full name.
    pub fn extras(&self) -> &BTreeMap<String, Tensor> {
        &self.extra
    }

    /// The tensor named `name`, module state or extra.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.module_state.get(name).or_else(|| self.extra.get(name))
    }

    /// The extras whose names start with `prefix`, with the prefix removed, in name order:
    /// `extra(OPTIMIZER_PREFIX)` is what `Optimizer::load_state` takes.
    pub fn extra(&self, prefix: &str) -> Vec<(String, Tensor)> {
        self.extra
            .iter()
            .filter_map(|(name, t)| {
                name.strip_prefix(prefix)
                    .map(|rest| (rest.to_string(), t.clone()))
            })
            .collect()
    }

    /// The string metadata saved with the checkpoint (without tandem's reserved keys).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

/// What [`load_state_dict`] did not match, as PyTorch's `load_state_dict` reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Module tensors the checkpoint has no value for (left unchanged).
    pub missing_keys: Vec<String>,
    /// Checkpoint entries the module has no tensor for (ignored).
    pub unexpected_keys: Vec<String>,
}

/// Saves `module`'s parameters and buffers, the `extra` tensors and the string `metadata` to
/// `path` as safetensors, atomically (see the module documentation). Stale temporary files
/// that killed saves of `path` left are removed first.
///
/// Errors if an extra's name collides with a module tensor or another extra, if a metadata key
/// starts with the reserved `tandem.`, or if writing fails (naming the file).
pub fn save_checkpoint(
    path: impl AsRef<Path>,
    module: &dyn Module,
    extra: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    write_checkpoint(path.as_ref(), Some(module), extra, metadata, &[])
}

/// What [`save_checkpoint`] does, plus tandem's own `reserved` metadata (keys under
/// `tandem.`), for a file of module state and extras or (without a module) of extras only.
pub(crate) fn write_checkpoint(
    path: &Path,
    module: Option<&dyn Module>,
    extra: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
    reserved: &[(&str, String)],
) -> Result<()> {
    let mut names = BTreeSet::new();
    let mut encoded = Vec::new();
    for (name, _, tensor) in module.map(|m| m.named_tensors()).unwrap_or_default() {
        if !names.insert(name.clone()) {
            return Err(save_error(
                path,
                format!("the module has two tensors named `{name}`"),
            ));
        }
        encoded.push((name, Encoded::new(&tensor)?));
    }
    for (name, tensor) in extra {
        if !names.insert(name.clone()) {
            return Err(save_error(
                path,
                format!(
                    "extra tensor `{name}` has the name of a module tensor or another extra; \
                     put extras under a prefix such as `{OPTIMIZER_PREFIX}`"
                ),
            ));
        }
        encoded.push((name.clone(), Encoded::new(tensor)?));
    }
    let header = header(path, extra, metadata, reserved)?;
    let bytes = safetensors::serialize(encoded, header)
        .map_err(|e| save_error(path, format!("cannot encode the checkpoint: {e}")))?;
    atomic::write_atomically(path, &bytes)
}

/// The safetensors `__metadata__` of a checkpoint: the user's `metadata` (refusing tandem's
/// reserved keys), the names of the extras and tandem's `reserved` entries; `None` when empty.
fn header(
    path: &Path,
    extra: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
    reserved: &[(&str, String)],
) -> Result<Option<HashMap<String, String>>> {
    let mut header: HashMap<String, String> = HashMap::new();
    for (key, value) in metadata {
        if key.starts_with(RESERVED_METADATA_PREFIX) {
            return Err(save_error(
                path,
                format!(
                    "metadata key `{key}` uses the reserved prefix `{RESERVED_METADATA_PREFIX}`"
                ),
            ));
        }
        header.insert(key.clone(), value.clone());
    }
    if !extra.is_empty() {
        let keys: Vec<&str> = extra.iter().map(|(n, _)| n.as_str()).collect();
        let json = serde_json::to_string(&keys)
            .map_err(|e| save_error(path, format!("cannot encode the extra names: {e}")))?;
        header.insert(EXTRA_KEYS_METADATA.to_string(), json);
    }
    for (key, value) in reserved {
        header.insert(key.to_string(), value.clone());
    }
    Ok(if header.is_empty() {
        None
    } else {
        Some(header)
    })
}

/// Reads a checkpoint written by [`save_checkpoint`] or by PyTorch's
/// `safetensors.torch.save_file`. Tensors come back on the CPU.
///
/// A missing, truncated or corrupt file, or a tensor of a dtype tandem does not have, is an
/// error naming the file. Stale temporary files of the checkpoint are removed first.
pub fn load_checkpoint(path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    // Best effort: a read-only directory still loads.
    let _ = remove_stale_temporary_files(path);
    let bytes = fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let corrupt = |e: safetensors::SafeTensorError| Error::Format {
        path: path.to_path_buf(),
        msg: format!("not a valid safetensors checkpoint (truncated or corrupt?): {e}"),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(corrupt)?;
    let file = SafeTensors::deserialize(&bytes).map_err(corrupt)?;

    let mut metadata: BTreeMap<String, String> = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let extra_names: BTreeSet<String> = match metadata.remove(EXTRA_KEYS_METADATA) {
        Some(json) => serde_json::from_str(&json).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            msg: format!("metadata `{EXTRA_KEYS_METADATA}` is not a JSON list of names: {e}"),
        })?,
        None => BTreeSet::new(),
    };
    let (reserved, metadata): (BTreeMap<_, _>, BTreeMap<_, _>) = metadata
        .into_iter()
        .partition(|(key, _)| key.starts_with(RESERVED_METADATA_PREFIX));

    let mut module_state = BTreeMap::new();
    let mut extra = BTreeMap::new();
    for (name, view) in file.iter() {
        let tensor = decode(path, name, view.dtype(), view.shape(), view.data())?;
        if extra_names.contains(name) {
            extra.insert(name.to_string(), tensor);
        } else {
            module_state.insert(name.to_string(), tensor);
        }
    }
    if let Some(absent) = extra_names.iter().find(|n| !extra.contains_key(*n)) {
        return Err(Error::Format {
            path: path.to_path_buf(),
            msg: format!("extra tensor `{absent}` is listed in the metadata but not stored"),
        });
    }
    Ok(Checkpoint {
        path: path.to_path_buf(),
        module_state,
        extra,
        metadata,
        reserved,
    })
}

/// Copies the checkpoint's module state into `module`'s parameters and buffers in place.
///
/// Every name present in both must agree in shape and dtype, otherwise nothing is copied and
/// the error names the tensor and both shapes or dtypes. With `strict`, names present on only
/// one side are an error too, listing them; without it they are returned in the
/// [`LoadReport`]. Extras (see [`Checkpoint::extra`]) are never module state.
pub fn load_state_dict(
    module: &dyn Module,
    checkpoint: &Checkpoint,
    strict: bool,
) -> Result<LoadReport> {
    let origin = checkpoint.path.display().to_string();
    let mismatch = |msg: String| Error::StateDict {
        origin: origin.clone(),
        msg,
    };
    let targets = module.named_tensors();
    let mut report = LoadReport::default();
    let mut pairs = Vec::new();
    for (name, _, target) in &targets {
        let Some(source) = checkpoint.module_state.get(name) else {
            report.missing_keys.push(name.clone());
            continue;
        };
        if source.dims() != target.dims() {
            return Err(mismatch(format!(
                "`{name}` has shape {:?} in the checkpoint but {:?} in the model",
                source.dims(),
                target.dims()
            )));
        }
        if source.dtype() != target.dtype() {
            return Err(mismatch(format!(
                "`{name}` has dtype {} in the checkpoint but {} in the model",
                source.dtype(),
                target.dtype()
            )));
        }
        pairs.push((source, target));
    }
    let known: BTreeSet<&str> = targets.iter().map(|(n, _, _)| n.as_str()).collect();
    report.unexpected_keys = checkpoint
        .module_state
        .keys()
        .filter(|n| !known.contains(n.as_str()))
        .cloned()
        .collect();
    if strict && (!report.missing_keys.is_empty() || !report.unexpected_keys.is_empty()) {
        let mut parts = Vec::new();
        if !report.missing_keys.is_empty() {
            parts.push(format!(
                "missing keys (in the model, not in the checkpoint): {}",
                report.missing_keys.join(", ")
            ));
        }
        if !report.unexpected_keys.is_empty() {
            parts.push(format!(
                "unexpected keys (in the checkpoint, not in the model): {}",
                report.unexpected_keys.join(", ")
            ));
        }
        return Err(mismatch(parts.join("; ")));
    }
    for (source, target) in pairs {
        let source = if source.device() == target.device() {
            source.clone()
        } else {
            source.to_device(target.device())?
        };
        target.copy_(&source)?;
    }
    Ok(report)
}

/// Reads the checkpoint at `path`, loads its module state into `module` (see
/// [`load_state_dict`]) and returns it, so its extras and metadata can be used next.
pub fn load_module(
    path: impl AsRef<Path>,
    module: &dyn Module,
    strict: bool,
) -> Result<Checkpoint> {
    let checkpoint = load_checkpoint(path)?;
    load_state_dict(module, &checkpoint, strict)?;
    Ok(checkpoint)
}

fn save_error(path: &Path, msg: String) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        msg: format!("cannot save checkpoint: {msg}"),
    }
}

/// One tensor's bytes as safetensors stores them.
struct Encoded {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Encoded {
    fn new(tensor: &Tensor) -> Result<Self> {
        let bytes = with_element_type!(tensor.dtype(), T => {
            let values = tensor.to_vec::<T>()?;
            let mut out = Vec::with_capacity(values.len() * std::mem::size_of::<T>());
            values.into_iter().for_each(|v| v.put(&mut out));
            out
        });
        Ok(Encoded {
            dtype: file_dtype(tensor.dtype()),
            shape: tensor.dims().to_vec(),
            bytes,
        })
    }
}

impl View for Encoded {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn file_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

fn tensor_dtype(path: &Path, name: &str, dtype: Dtype) -> Result<DType> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        other => {
            return Err(Error::Format {
                path: path.to_path_buf(),
                msg: format!(
                    "tensor `{name}` has dtype {other:?}, which tandem does not support \
                     (F32, F64, F16, BF16, I64, U8)"
                ),
            })
        }
    })
}

fn decode(path: &Path, name: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<Tensor> {
    let dtype = tensor_dtype(path, name, dtype)?;
    with_element_type!(dtype, T => {
        // The safetensors crate has checked that `data` holds exactly shape × width bytes.
        let values: Vec<T> = data.chunks_exact(std::mem::size_of::<T>()).map(T::take).collect();
        Ok(Tensor::from_vec(values, shape, Device::Cpu)?)
    })
}

/// Little-endian encoding of the element types, as safetensors requires.
trait LittleEndian: Sized {
    fn put(self, out: &mut Vec<u8>);
    /// Decodes one element from exactly `size_of::<Self>()` bytes.
    fn take(bytes: &[u8]) -> Self;
}

macro_rules! little_endian {
    ($($t:ty),*) => {$(
        impl LittleEndian for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn take(bytes: &[u8]) -> Self {
                let mut raw = [0u8; std::mem::size_of::<$t>()];
                raw.copy_from_slice(bytes);
                <$t>::from_le_bytes(raw)
            }
        }
    )*};
}

little_endian!(f32, f64, f16, bf16, i64, u8);

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{BatchNormConfig, LinearConfig, ParamKind, TrainingFlag};

    /// A module owning one tensor of every dtype, plus a BatchNorm child for buffers.
    // Written by hand, not derived: its tensors are a table (name, kind, dtype) that the tests
    // walk, not fixed fields.
    struct EveryDtype {
        tensors: Vec<(&'static str, ParamKind, Tensor)>,
        norm: Arc<dyn Module>,
        flag: TrainingFlag,
    }

    impl EveryDtype {
        /// Values depend on `seed`, so two instances differ everywhere.
        fn new(seed: f64) -> Self {
            let cpu = Device::Cpu;
            let f = |k: f64| seed + k * 0.25;
            let tensors = vec![
                (
                    "w32",
                    ParamKind::Parameter,
                    Tensor::from_vec(vec![f(1.0) as f32, f(2.0) as f32, -3.5], &[3], cpu),
                ),
                (
                    "w64",
                    ParamKind::Parameter,
                    Tensor::from_vec(vec![f(0.1), f(0.2), f(0.3), f(0.4)], &[2, 2], cpu),
                ),
                (
                    "half",
                    ParamKind::Buffer,
                    Tensor::from_vec(vec![f16::from_f64(f(1.0)), f16::from_f64(-2.0)], &[2], cpu),
                ),
                (
                    "brain",
                    ParamKind::Buffer,
                    Tensor::from_vec(vec![bf16::from_f64(f(3.0)); 3], &[3, 1], cpu),
                ),
                (
                    "count",
                    ParamKind::Buffer,
                    Tensor::scalar(seed as i64 * 1_000_000_007, cpu),
                ),
                (
                    "mask",
                    ParamKind::Buffer,
                    Tensor::from_vec(vec![seed as u8, 255, 0, 7], &[2, 1, 2], cpu),
                ),
            ]
            .into_iter()
            .map(|(n, k, t)| (n, k, t.unwrap()))
            .collect();
            let norm = BatchNormConfig::new(2).init().unwrap();
            for (_, _, t) in norm.named_tensors() {
                t.map_inplace_f64("test", |x| x + seed).ok();
            }
            EveryDtype {
                tensors,
                norm: Arc::new(norm),
                flag: TrainingFlag::new(),
            }
        }
    }

    impl Module for EveryDtype {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            Ok(x.clone())
        }
        fn training_flag(&self) -> &TrainingFlag {
            &self.flag
        }
        fn visit_own(&self, visitor: &mut dyn FnMut(&str, ParamKind, &Tensor)) {
            for (name, kind, t) in &self.tensors {
                visitor(name, *kind, t);
            }
        }
        fn children(&self) -> Vec<(String, Arc<dyn Module>)> {
            vec![("bn".to_string(), self.norm.clone())]
        }
    }

    /// A fresh directory under the system temp dir, removed by the test at the end.
    fn scratch_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-ckpt-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn bytes(t: &Tensor) -> (DType, Vec<usize>, Vec<u8>) {
        (t.dtype(), t.dims().to_vec(), Encoded::new(t).unwrap().bytes)
    }

    fn metadata(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn round_trip_keeps_every_dtype_buffers_extras_and_metadata_bit_for_bit() {
        let dir = scratch_dir("round-trip");
        let path = dir.join("model.safetensors");
        let saved = EveryDtype::new(3.0);
        let extra = vec![
            (
                "optimizer.0.momentum_buffer".to_string(),
                Tensor::from_vec(vec![0.5f32, -0.25, 1e-30], &[3], Device::Cpu).unwrap(),
            ),
            (
                "optimizer.step".to_string(),
                Tensor::scalar(3i64, Device::Cpu).unwrap(),
            ),
        ];
        let meta = metadata(&[("epoch", "2"), ("run", "test")]);
        save_checkpoint(&path, &saved, &extra, &meta).unwrap();

        let checkpoint = load_checkpoint(&path).unwrap();
        assert_eq!(checkpoint.metadata(), &meta);
        let names: Vec<&String> = checkpoint.module_state().keys().collect();
        assert_eq!(
            names,
            [
                "bn.bias",
                "bn.num_batches_tracked",
                "bn.running_mean",
                "bn.running_var",
                "bn.weight",
                "brain",
                "count",
                "half",
                "mask",
                "w32",
                "w64"
            ]
        );
        let count = checkpoint.tensor("bn.num_batches_tracked").unwrap();
        assert_eq!((count.dtype(), count.dims()), (DType::I64, &[][..]));
        let optimizer = checkpoint.extra(OPTIMIZER_PREFIX);
        assert_eq!(optimizer.len(), 2);
        assert_eq!(optimizer[0].0, "0.momentum_buffer");
        assert_eq!(bytes(&optimizer[0].1), bytes(&extra[0].1));
        assert_eq!(optimizer[1].0, "step");
        assert_eq!(bytes(&optimizer[1].1), bytes(&extra[1].1));

        let restored = EveryDtype::new(9.0);
        let report = load_state_dict(&restored, &checkpoint, true).unwrap();
        assert_eq!(report, LoadReport::default());
        let before = saved.named_tensors();
        let after = restored.named_tensors();
        assert_eq!(before.len(), after.len());
        for ((name, _, a), (_, _, b)) in before.iter().zip(&after) {
            assert_eq!(bytes(a), bytes(b), "{name}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_or_garbage_file_is_rejected_naming_the_file() {
        let dir = scratch_dir("truncated");
        let path = dir.join("model.safetensors");
        save_checkpoint(&path, &EveryDtype::new(1.0), &[], &BTreeMap::new()).unwrap();
        let full = fs::read(&path).unwrap();
        for cut in [full.len() - 1, full.len() / 2, 5] {
            fs::write(&path, &full[..cut]).unwrap();
            let err = load_checkpoint(&path).unwrap_err();
            assert!(matches!(err, Error::Format { .. }), "{err:?}");
            let msg = err.to_string();
            assert!(
                msg.contains("model.safetensors") && msg.contains("corrupt"),
                "{msg}"
            );
        }
        fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fnot json at all").unwrap();
        assert!(matches!(load_checkpoint(&path), Err(Error::Format { .. })));
        let missing = load_checkpoint(dir.join("absent.safetensors")).unwrap_err();
        assert!(
            matches!(missing, Error::Io { .. }) && missing.to_string().contains("absent"),
            "{missing}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shape_or_dtype_mismatch_names_the_parameter_and_both_sides() {
        let dir = scratch_dir("mismatch");
        let path = dir.join("linear.safetensors");
        save_checkpoint(
            &path,
            &LinearConfig::new(3, 2).init().unwrap(),
            &[],
            &BTreeMap::new(),
        )
        .unwrap();
        let checkpoint = load_checkpoint(&path).unwrap();
        let wider = LinearConfig::new(4, 2).init().unwrap();
        let before = wider.weight().to_vec::<f32>().unwrap();
        let msg = load_state_dict(&wider, &checkpoint, false)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`weight`") && msg.contains("[2, 3]") && msg.contains("[2, 4]"),
            "{msg}"
        );
        assert!(msg.contains("linear.safetensors"), "{msg}");
        assert_eq!(
            wider.weight().to_vec::<f32>().unwrap(),
            before,
            "nothing copied"
        );

        let mut tensors = checkpoint.module_state.clone();
        let weight = tensors["weight"].to_dtype(DType::F64).unwrap();
        tensors.insert("weight".to_string(), weight);
        let as_f64 = Checkpoint {
            module_state: tensors,
            ..checkpoint
        };
        let msg = load_state_dict(&LinearConfig::new(3, 2).init().unwrap(), &as_f64, false)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`weight`") && msg.contains("f64") && msg.contains("f32"),
            "{msg}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn strict_load_lists_missing_and_unexpected_keys_by_name() {
        let dir = scratch_dir("strict");
        let path = dir.join("linear.safetensors");
        let with_bias = LinearConfig::new(3, 2).init().unwrap();
        save_checkpoint(&path, &with_bias, &[], &BTreeMap::new()).unwrap();
        let checkpoint = load_checkpoint(&path).unwrap();

        let no_bias = LinearConfig::new(3, 2).with_bias(false).init().unwrap();
        let msg = load_state_dict(&no_bias, &checkpoint, true)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("unexpected keys") && msg.contains("bias"),
            "{msg}"
        );
        let report = load_state_dict(&no_bias, &checkpoint, false).unwrap();
        assert_eq!(report.unexpected_keys, ["bias"]);
        assert!(report.missing_keys.is_empty());
        assert_eq!(
            no_bias.weight().to_vec::<f32>().unwrap(),
            with_bias.weight().to_vec::<f32>().unwrap()
        );

        let no_bias_path = dir.join("no_bias.safetensors");
        save_checkpoint(&no_bias_path, &no_bias, &[], &BTreeMap::new()).unwrap();
        let msg = load_module(&no_bias_path, &with_bias, true)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("missing keys") && msg.contains("bias"),
            "{msg}"
        );
        let report =
            load_state_dict(&with_bias, &load_checkpoint(&no_bias_path).unwrap(), false).unwrap();
        assert_eq!(report.missing_keys, ["bias"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn extras_are_not_module_state_and_cannot_shadow_it() {
        let dir = scratch_dir("extras");
        let path = dir.join("model.safetensors");
        let model = LinearConfig::new(2, 2).init().unwrap();
        let step = Tensor::scalar(7i64, Device::Cpu).unwrap();
        save_checkpoint(
            &path,
            &model,
            &[("optimizer.step".to_string(), step.clone())],
            &BTreeMap::new(),
        )
        .unwrap();
        let checkpoint = load_module(&path, &model, true).unwrap();
        assert_eq!(checkpoint.extra(OPTIMIZER_PREFIX)[0].0, "step");
        assert!(!checkpoint.module_state().contains_key("optimizer.step"));

        let msg = save_checkpoint(
            &path,
            &model,
            &[("bias".to_string(), step)],
            &BTreeMap::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("`bias`"), "{msg}");
        let msg = save_checkpoint(&path, &model, &[], &metadata(&[(EXTRA_KEYS_METADATA, "x")]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("reserved"), "{msg}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn atomic_save_overwrites_and_leaves_no_temporary_file() {
        let dir = scratch_dir("atomic");
        let path = dir.join("latest.safetensors");
        let model = LinearConfig::new(2, 3).init().unwrap();
        save_checkpoint(&path, &model, &[], &metadata(&[("epoch", "1")])).unwrap();
        model.weight().fill_(0.5).unwrap();
        save_checkpoint(&path, &model, &[], &metadata(&[("epoch", "2")])).unwrap();

        let entries: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(entries, ["latest.safetensors"]);
        let checkpoint = load_checkpoint(&path).unwrap();
        assert_eq!(checkpoint.metadata()["epoch"], "2");
        assert_eq!(
            checkpoint.module_state()["weight"].to_vec::<f32>().unwrap(),
            [0.5; 6]
        );

        // A failed save (the target is a directory) leaves nothing behind either.
        let blocked = dir.join("blocked");
        fs::create_dir(&blocked).unwrap();
        assert!(save_checkpoint(&blocked, &model, &[], &BTreeMap::new()).is_err());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 2);
        fs::remove_dir_all(&dir).unwrap();
    }
}
