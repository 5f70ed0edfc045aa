//! The gradient scaler for f16 mixed-precision training, with PyTorch's dynamic loss scaling
//! (`torch.amp.GradScaler`).
//!
//! **When to use it.** Train under f16 autocast with a [`GradScaler`]: f16 has five exponent
//! bits, so small gradients of the low-precision activations underflow to zero. Multiplying the
//! loss by a large scale before `backward` shifts every gradient into f16's range; the scaler
//! divides the f32 gradients of the master parameters by the same scale before the optimizer
//! uses them. **bf16 does not need it**: bf16 has f32's exponent range, nothing underflows that
//! would not in f32, so a bf16 run calls `optimizer.step()` directly (a scaler built with
//! `enabled: false` passes everything through, so one training loop serves both).
//!
//! A step with the scaler:
//!
//! ```text
//! let mut scaler = GradScalerConfig::default().init()?;
//! optimizer.zero_grad()?;
//! let loss = autocast(DType::F16, || loss_of(&model, &batch))??;
//! scaler.scale(&loss)?.backward()?;
//! scaler.unscale(&mut optimizer)?;                    // only when clipping: true gradients
//! clip_grad_norm(optimizer.parameters(), 1.0, 2.0)?;  //   are clipped, not scaled ones
//! let outcome = scaler.step(&mut optimizer)?;         // skipped on an inf/NaN gradient
//! scaler.update()?;                                   // the next step's scale
//! ```
//!
//! **Dynamic scale.** The scale starts at `init_scale` (2^16). A step whose gradients hold an
//! infinity or a NaN (the scale was too large: a gradient overflowed) is *skipped*: the
//! optimizer does not step, and `update` multiplies the scale by `backoff_factor` (0.5). After
//! `growth_interval` (2000) consecutive clean steps the scale is multiplied by `growth_factor`
//! (2.0). The scale is kept in f32 and updated as PyTorch updates it (the f32 scale times the
//! f64 factor, rounded to f32), so the sequence of scales
//! for a given sequence of skips is PyTorch's, value for value.
//!
//! **Skipped steps and the learning-rate schedule.** A skipped step leaves the parameters and
//! the optimizer's state untouched, and the optimizer's step count does not advance (Adam's
//! bias correction counts only applied steps). A [`Scheduler`](crate::Scheduler) stepped once
//! per iteration still advances on a skipped one, as in PyTorch: the schedule runs by
//! iterations, not by applied updates. Skips are rare once the scale has settled (typically a
//! handful in the first iterations, while the scale backs off from 2^16, then about one per
//! `growth_interval` when a growth overshoots), so the difference is negligible; a run that
//! must count only applied updates steps its scheduler only when [`StepOutcome::Applied`]
//! comes back. [`GradScaler::skipped_steps`] counts the skipped ones.
//!
//! **One check per step.** [`GradScaler::unscale`] multiplies every gradient by `1 / scale` and
//! checks it for infinities and NaNs in the same pass over its memory. On the CPU the pass is
//! parallel over chunks of each gradient; on a CUDA device one multi-tensor launch per dtype
//! (`grad_unscale` in `kernels/grads.cu`) covers every gradient and raises a single found-inf
//! flag in device memory. The host reads that one flag once, in [`GradScaler::step`], never
//! once per parameter, so explicit unscaling followed by clipping adds no synchronisation.
//!
//! **Distributed training.** Under DDP the gradients are all-reduced before the scaler sees
//! them, so they are identical on every rank (an infinity on one rank becomes one on all), and
//! every rank skips the same steps and keeps the same scale without talking to the others.
//!
//! **Checkpoints.** [`GradScaler::state`] gives the scale, the growth tracker, the counters and
//! the schedule's factors as named tensors, and [`GradScaler::load_state`] restores them, so a
//! resumed run continues with the same scale (`TrainingState::with_grad_scaler` in
//! `tandem-nn` stores them beside the optimizer's state).

mod cpu;
mod cuda;

use tandem_core::{DType, Device, Tensor, TensorId};

use crate::multi_tensor::count_host_read;
use crate::{Error, Optimizer, Result};

const NAME: &str = "GradScaler";

/// Hyper-parameters of a [`GradScaler`]. Defaults are PyTorch's: `init_scale` 2^16,
/// `growth_factor` 2.0, `backoff_factor` 0.5, `growth_interval` 2000, enabled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The scale of the first step (finite, > 0).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` clean steps (finite, > 1).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with an inf/NaN gradient (in (0, 1)).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows (> 0).
    pub growth_interval: u64,
    /// When false, every method passes through: `scale` returns the loss, `unscale` and
    /// `update` do nothing, `step` steps the optimizer (for bf16 or f32 runs of the same loop).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

impl GradScalerConfig {
    /// The same config with the first step's scale `init_scale`.
    pub fn with_init_scale(self, init_scale: f64) -> Self {
        GradScalerConfig { init_scale, ..self }
    }

    /// The same config with growth factor `growth_factor`.
    pub fn with_growth_factor(self, growth_factor: f64) -> Self {
        GradScalerConfig {
            growth_factor,
            ..self
        }
    }

    /// The same config with back-off factor `backoff_factor`.
    pub fn with_backoff_factor(self, backoff_factor: f64) -> Self {
        GradScalerConfig {
            backoff_factor,
            ..self
        }
    }

    /// The same config with growth interval `growth_interval`.
    pub fn with_growth_interval(self, growth_interval: u64) -> Self {
        GradScalerConfig {
            growth_interval,
            ..self
        }
    }

    /// The same config, enabled or not.
    pub fn with_enabled(self, enabled: bool) -> Self {
        GradScalerConfig { enabled, ..self }
    }

    /// Checks the values, naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        let invalid = |msg: String| {
            Err(Error::InvalidConfig {
                optimizer: NAME,
                msg,
            })
        };
        let f32_max = f32::MAX as f64;
        if !(self.init_scale > 0.0 && self.init_scale <= f32_max) {
            return invalid(format!(
                "init_scale must be > 0 and finite in f32, got {}",
                self.init_scale
            ));
        }
        if !(self.growth_factor > 1.0 && self.growth_factor <= f32_max) {
            return invalid(format!(
                "growth_factor must be > 1 and finite, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return invalid(format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return invalid("growth_interval must be > 0, got 0".to_string());
        }
        Ok(())
    }

    /// The scaler, after [`GradScalerConfig::validate`].
    pub fn init(self) -> Result<GradScaler> {
        self.validate()?;
        Ok(GradScaler {
            config: self,
            scale: self.init_scale as f32,
            growth_tracker: 0,
            steps: 0,
            skipped_steps: 0,
            this_step: Vec::new(),
        })
    }
}

/// What [`GradScaler::step`] did with the optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The gradients were finite: the optimizer stepped.
    Applied,
    /// A gradient held an infinity or a NaN: the optimizer did not step.
    Skipped,
}

impl StepOutcome {
    /// Whether the optimizer's step was skipped.
    pub fn is_skipped(self) -> bool {
        self == StepOutcome::Skipped
    }
}

/// Whether any gradient of one optimizer was non-finite: known on the host, or one flag per
/// device in device memory, read only when the step needs the answer.
enum FoundInf {
    Host(bool),
    /// A one-element I64 tensor on a device (0 or 1).
    Device(Tensor),
}

impl FoundInf {
    /// The answer; a device flag is read here, once.
    fn resolve(&mut self) -> Result<bool> {
        if let FoundInf::Device(flag) = self {
            let found = flag.item()? != 0.0;
            count_host_read();
            *self = FoundInf::Host(found);
        }
        match self {
            FoundInf::Host(found) => Ok(*found),
            FoundInf::Device(_) => unreachable!("resolved above"),
        }
    }
}

/// Where one optimizer is in the current step (PyTorch's `OptState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// One optimizer's record in the current step, keyed by its first parameter.
struct OptimizerRecord {
    key: TensorId,
    stage: Stage,
    found: Vec<FoundInf>,
}

/// Dynamic loss scaling for f16 training (see the [module documentation](self)).
pub struct GradScaler {
    config: GradScalerConfig,
    /// f32, as PyTorch keeps it, so that its sequence of values is PyTorch's.
    scale: f32,
    growth_tracker: u64,
    steps: u64,
    skipped_steps: u64,
    /// The optimizers unscaled or stepped since the last `update`.
    this_step: Vec<OptimizerRecord>,
}

impl GradScaler {
    /// A scaler with PyTorch's defaults.
    pub fn new() -> Self {
        GradScalerConfig::default()
            .init()
            .expect("the default config is valid")
    }

    /// The configuration (after [`GradScaler::load_state`], with the loaded factors).
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// Whether the scaler is enabled.
    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// The current scale (1.0 when disabled).
    pub fn scale_value(&self) -> f64 {
        if self.config.enabled {
            self.scale as f64
        } else {
            1.0
        }
    }

    /// Consecutive clean steps since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// Optimizer steps skipped because of a non-finite gradient, over the scaler's life
    /// (restored from checkpoints).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Completed [`GradScaler::update`] calls, skipped steps included.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// `loss * scale`, recorded by autograd (so `backward` of the result gives scaled
    /// gradients); the loss itself when disabled.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.config.enabled {
            return Ok(loss.clone());
        }
        Ok(tandem_ops::mul_scalar(loss, self.scale as f64)?)
    }

    fn record_index(&self, key: TensorId) -> Option<usize> {
        self.this_step.iter().position(|r| r.key == key)
    }

    /// Divides `optimizer`'s gradients by the scale in place and checks them for infinities and
    /// NaNs, in one pass. Call it explicitly before anything that must see the true gradients
    /// (clipping); otherwise [`GradScaler::step`] calls it. Nothing when disabled.
    ///
    /// Errors when called twice for the same optimizer before [`GradScaler::update`] (the
    /// gradients would be divided twice), after [`GradScaler::step`], or when a gradient is not
    /// f32 or f64 (master parameters are f32; autocast makes their low-precision copies).
    pub fn unscale<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        let key = optimizer_key(&*optimizer)?;
        if let Some(i) = self.record_index(key) {
            let msg = match self.this_step[i].stage {
                Stage::Unscaled => format!(
                    "unscale() has already been called on this {} optimizer since the last \
                     update(); its gradients would be divided by the scale twice",
                    optimizer.name()
                ),
                Stage::Stepped => format!(
                    "unscale() is being called after step() for this {} optimizer; call \
                     update() first",
                    optimizer.name()
                ),
            };
            return Err(Error::Scaler { msg });
        }
        let inv_scale = (1.0 / self.scale as f64) as f32 as f64;
        let found = unscale_grads(optimizer.name(), optimizer.parameters(), inv_scale)?;
        self.this_step.push(OptimizerRecord {
            key,
            stage: Stage::Unscaled,
            found,
        });
        Ok(())
    }

    /// Unscales `optimizer`'s gradients if [`GradScaler::unscale`] has not, then steps it
    /// unless a gradient is infinite or NaN, which makes the step [`StepOutcome::Skipped`] and
    /// counts it in [`GradScaler::skipped_steps`]. This is where the host reads the found-inf
    /// flag, once. When disabled, steps the optimizer.
    ///
    /// Errors when called twice for the same optimizer before [`GradScaler::update`].
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<StepOutcome> {
        if !self.config.enabled {
            optimizer.step()?;
            return Ok(StepOutcome::Applied);
        }
        let key = optimizer_key(&*optimizer)?;
        let index = match self.record_index(key) {
            Some(i) if self.this_step[i].stage == Stage::Stepped => {
                return Err(Error::Scaler {
                    msg: format!(
                        "step() has already been called on this {} optimizer since the last \
                         update()",
                        optimizer.name()
                    ),
                })
            }
            Some(i) => i,
            None => {
                self.unscale(optimizer)?;
                self.this_step.len() - 1
            }
        };
        let record = &mut self.this_step[index];
        let mut found = false;
        for flag in &mut record.found {
            found |= flag.resolve()?;
        }
        record.stage = Stage::Stepped;
        if found {
            self.skipped_steps += 1;
            return Ok(StepOutcome::Skipped);
        }
        optimizer.step()?;
        Ok(StepOutcome::Applied)
    }

    /// Sets the scale for the next step, as PyTorch does: after a step in which any optimizer
    /// found a non-finite gradient the scale is multiplied by `backoff_factor` and the growth
    /// tracker restarts; otherwise the tracker counts the clean step and, on reaching
    /// `growth_interval`, the scale is multiplied by `growth_factor` (unless that overflows
    /// f32) and the tracker restarts. Nothing when disabled.
    ///
    /// Errors when no optimizer was unscaled or stepped since the last update.
    pub fn update(&mut self) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        if self.this_step.is_empty() {
            return Err(Error::Scaler {
                msg: "update() without unscale() or step() since the last update(): no \
                      gradients were checked"
                    .to_string(),
            });
        }
        let mut found = false;
        for record in &mut self.this_step {
            for flag in &mut record.found {
                found |= flag.resolve()?;
            }
        }
        self.this_step.clear();
        self.advance(found);
        Ok(())
    }

    /// PyTorch's `_amp_update_scale_`: the f32 scale times the f64 factor, rounded to f32.
    fn advance(&mut self, found_inf: bool) {
        self.steps += 1;
        if found_inf {
            self.scale = (self.scale as f64 * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
            return;
        }
        let successful = self.growth_tracker + 1;
        if successful == self.config.growth_interval {
            let grown = (self.scale as f64 * self.config.growth_factor) as f32;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        } else {
            self.growth_tracker = successful;
        }
    }

    /// The scaler's state as named tensors on the CPU, for checkpoints: `scale` (f32 scalar),
    /// `growth_tracker`, `steps`, `skipped_steps`, `growth_interval` (i64 scalars),
    /// `growth_factor` and `backoff_factor` (f64 scalars). Empty when disabled (as PyTorch's
    /// `state_dict`).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        if !self.config.enabled {
            return Vec::new();
        }
        let cpu = Device::Cpu;
        let int = |v: u64| Tensor::scalar(v as i64, cpu);
        let entries = [
            ("scale", Tensor::scalar(self.scale, cpu)),
            (
                "growth_factor",
                Tensor::scalar(self.config.growth_factor, cpu),
            ),
            (
                "backoff_factor",
                Tensor::scalar(self.config.backoff_factor, cpu),
            ),
            ("growth_interval", int(self.config.growth_interval)),
            ("growth_tracker", int(self.growth_tracker)),
            ("steps", int(self.steps)),
            ("skipped_steps", int(self.skipped_steps)),
        ];
        entries
            .into_iter()
            .map(|(name, t)| {
                let t = t.expect("a CPU scalar of a supported dtype");
                (name.to_string(), t)
            })
            .collect()
    }

    /// Restores what [`GradScaler::state`] saved (the scale, the tracker, the counters and the
    /// factors) and forgets the current step's checks. Nothing when disabled.
    ///
    /// Errors, changing nothing, when the state is empty (saved by a disabled scaler), lacks an
    /// entry, has an unknown one, or holds an invalid value.
    pub fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        let bad = |msg: String| Error::State {
            optimizer: NAME,
            msg,
        };
        if state.is_empty() {
            return Err(bad(
                "the state is empty; it was probably saved by a disabled GradScaler".to_string(),
            ));
        }
        const NAMES: [&str; 7] = [
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "growth_tracker",
            "steps",
            "skipped_steps",
        ];
        if let Some((name, _)) = state.iter().find(|(n, _)| !NAMES.contains(&n.as_str())) {
            return Err(bad(format!(
                "unknown entry `{name}` (expected {})",
                NAMES.join(", ")
            )));
        }
        let value = |name: &str| -> Result<f64> {
            let (_, t) = state
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| bad(format!("missing entry `{name}`")))?;
            if t.numel() != 1 {
                return Err(bad(format!(
                    "entry `{name}` has shape {:?}; expected a scalar",
                    t.dims()
                )));
            }
            Ok(t.item()?)
        };
        let count = |name: &str| -> Result<u64> {
            let v = value(name)?;
            if v < 0.0 || v.fract() != 0.0 || !v.is_finite() {
                return Err(bad(format!(
                    "entry `{name}` is {v}; expected a whole number >= 0"
                )));
            }
            Ok(v as u64)
        };
        let config = GradScalerConfig {
            init_scale: value("scale")?,
            growth_factor: value("growth_factor")?,
            backoff_factor: value("backoff_factor")?,
            growth_interval: count("growth_interval")?,
            enabled: true,
        };
        config
            .validate()
            .map_err(|e| bad(format!("the saved values are invalid: {e}")))?;
        let growth_tracker = count("growth_tracker")?;
        let steps = count("steps")?;
        let skipped_steps = count("skipped_steps")?;
        self.config = GradScalerConfig {
            init_scale: self.config.init_scale,
            ..config
        };
        self.scale = config.init_scale as f32;
        self.growth_tracker = growth_tracker;
        self.steps = steps;
        self.skipped_steps = skipped_steps;
        self.this_step.clear();
        Ok(())
    }
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

/// The key of an optimizer in the current step's records: the id of its first parameter.
fn optimizer_key<O: Optimizer + ?Sized>(optimizer: &O) -> Result<TensorId> {
    optimizer
        .parameters()
        .first()
        .map(Tensor::id)
        .ok_or(Error::EmptyParameterList {
            optimizer: optimizer.name(),
        })
}

/// Unscales and checks the gradients of `params` (those that have one), one pass per device:
/// the CPU's answer, or a flag on each CUDA device.
fn unscale_grads(
    optimizer: &'static str,
    params: &[Tensor],
    inv_scale: f64,
) -> Result<Vec<FoundInf>> {
    let mut by_device: Vec<(Device, Vec<Tensor>)> = Vec::new();
    for (index, p) in params.iter().enumerate() {
        let Some(grad) = p.grad() else {
            continue;
        };
        if !matches!(grad.dtype(), DType::F32 | DType::F64) {
            return Err(Error::parameter(
                optimizer,
                index,
                p,
                format!(
                    "GradScaler: its gradient is {}; the scaler unscales f32 and f64 gradients \
                     (keep the master parameters in f32: autocast makes their low-precision \
                     copies, and their gradients come back in f32)",
                    grad.dtype()
                ),
            ));
        }
        let device = grad.device();
        match by_device.iter_mut().find(|(d, _)| *d == device) {
            Some((_, grads)) => grads.push(grad),
            None => by_device.push((device, vec![grad])),
        }
    }
    by_device
        .into_iter()
        .map(|(device, grads)| match device {
            Device::Cpu => Ok(FoundInf::Host(cpu::unscale(&grads, inv_scale)?)),
            Device::Cuda(ordinal) => {
                Ok(FoundInf::Device(cuda::unscale(ordinal, &grads, inv_scale)?))
            }
        })
        .collect()
}

/// Dense stand-ins for `grads` (the gradients themselves when dense); [`copy_back`] writes
/// results into the strided ones.
fn dense_gradients(grads: &[Tensor]) -> Result<Vec<Tensor>> {
    let dense: std::result::Result<Vec<Tensor>, tandem_core::Error> =
        grads.iter().map(|g| g.contiguous_detached()).collect();
    Ok(dense?)
}

/// Copies each dense stand-in back into its strided gradient.
fn copy_back(grads: &[Tensor], dense: &[Tensor]) -> Result<()> {
    for (g, d) in grads.iter().zip(dense) {
        if !d.same_tensor(g) && !d.storage().same_buffer(g.storage()) {
            g.copy_(d)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
