//! Adam and AdamW, with exactly PyTorch's update rules (`torch.optim.Adam` and
//! `torch.optim.AdamW`, single-tensor path, `maximize = False`).
//!
//! For each parameter `p` with gradient `g`, at its `t`-th update (`t` counts from 1 and is
//! kept per parameter, so a parameter that skipped a step is not bias-corrected as if it had
//! taken it), one step computes
//!
//! ```text
//! Adam:   g = g + weight_decay * p                (L2 penalty folded into the gradient)
//! AdamW:  p = p * (1 - lr * weight_decay)         (decoupled weight decay)
//! m = m + (1 - beta1) * (g - m)
//! v = beta2 * v + (1 - beta2) * g * g
//! if amsgrad: v_max = max(v_max, v), and v_max replaces v below
//! p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! The arithmetic runs in the parameter's dtype, in place on its buffer. State is exposed as
//! `"{i}.exp_avg"`, `"{i}.exp_avg_sq"`, `"{i}.max_exp_avg_sq"` (amsgrad only) and `"{i}.step"`
//! (an i64 scalar per parameter, as in PyTorch), plus the optimizer-wide `"step"`.
//!
//! A step gathers every parameter's operands here and dispatches once per device: to the host
//! loops of `cpu.rs`, or on a CUDA device to one fused multi-tensor launch per dtype and step
//! count (`cuda.rs`; in training every parameter has the same count, so one launch), computing
//! the same operations in the same order with the bias corrections computed on the host as
//! the CPU computes them (`UpdateRule`). The moment estimates live on their parameter's
//! device; the per-parameter step counts are host integers, like the learning rate.

mod config;
mod cpu;
mod cuda;

pub(crate) use crate::update_rule::UpdateRule;
pub use config::AdamConfig;

use tandem_core::{DType, Device, Tensor};

use crate::multi_tensor::TableCache;
use crate::optimizer::{
    by_device, check_learning_rate, check_parameters, follow_parameter, state_for_parameter,
    update_operands, write_back, zero_state, UpdateOperands,
};
use crate::{Error, Optimizer, Result};

/// The moment estimates of one parameter.
struct ParamState {
    /// Updates this parameter has received (the `t` of the bias corrections).
    step: u64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// Present exactly when amsgrad is on.
    max_exp_avg_sq: Option<Tensor>,
}

/// The implementation shared by [`Adam`] and [`AdamW`]; they differ in name and in how
/// weight decay is applied.
struct AdamCore {
    name: &'static str,
    decoupled_weight_decay: bool,
    params: Vec<Tensor>,
    config: AdamConfig,
    /// One per parameter; `None` until the parameter's first update.
    states: Vec<Option<ParamState>>,
    steps: u64,
    /// Tables of the fused CUDA step, reused while the tensors stay where they are.
    tables: TableCache,
}

/// One parameter's share of a step: what the kernels read and write.
struct AdamUpdate {
    /// The parameter's index.
    index: usize,
    /// The device of the parameter, its gradient and its state.
    device: Device,
    /// The gradient, dense and not sharing the parameter's memory.
    grad: Tensor,
    /// The parameter, or a dense copy written back after the update.
    target: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// Present exactly when amsgrad is on.
    max_exp_avg_sq: Option<Tensor>,
    /// The number of this update of the parameter (from 1).
    step: u64,
}

/// Cached tables per optimizer: one per dtype and step count in use, and a few more.
const CACHED_TABLES: usize = 4;

impl AdamCore {
    fn new(
        name: &'static str,
        decoupled_weight_decay: bool,
        params: Vec<Tensor>,
        config: AdamConfig,
    ) -> Result<Self> {
        config.validate_for(name)?;
        check_parameters(name, &params)?;
        let states = (0..params.len()).map(|_| None).collect();
        Ok(AdamCore {
            name,
            decoupled_weight_decay,
            params,
            config,
            states,
            steps: 0,
            tables: TableCache::new(CACHED_TABLES),
        })
    }

    /// The operands of every parameter that has a gradient, creating state on first use and
    /// moving existing state to a parameter that has moved.
    fn gather(&mut self) -> Result<Vec<AdamUpdate>> {
        let name = self.name;
        let mut updates = Vec::with_capacity(self.params.len());
        for index in 0..self.params.len() {
            let param = &self.params[index];
            let Some(UpdateOperands {
                grad,
                target,
                device,
            }) = update_operands(name, index, param)?
            else {
                continue;
            };
            let state = match &mut self.states[index] {
                Some(state) => {
                    follow_parameter(name, index, param, device, &state.exp_avg)?;
                    follow_parameter(name, index, param, device, &state.exp_avg_sq)?;
                    if let Some(m) = &state.max_exp_avg_sq {
                        follow_parameter(name, index, param, device, m)?;
                    }
                    state
                }
                slot @ None => {
                    let zeros = || zero_state(param, &target, device);
                    slot.insert(ParamState {
                        step: 0,
                        exp_avg: zeros()?,
                        exp_avg_sq: zeros()?,
                        max_exp_avg_sq: if self.config.amsgrad {
                            Some(zeros()?)
                        } else {
                            None
                        },
                    })
                }
            };
            updates.push(AdamUpdate {
                index,
                device,
                grad,
                target,
                exp_avg: state.exp_avg.clone(),
                exp_avg_sq: state.exp_avg_sq.clone(),
                max_exp_avg_sq: state.max_exp_avg_sq.clone(),
                step: state.step + 1,
            });
        }
        Ok(updates)
    }

    fn step(&mut self) -> Result<()> {
        let _profile = tandem_core::profile::scope("adam.step", tandem_core::profile::Phase::Other);
        let updates = self.gather()?;
        let (name, decoupled) = (self.name, self.decoupled_weight_decay);
        for (device, group) in by_device(&updates, |u| u.device) {
            match device {
                Device::Cpu => cpu::update(name, &group, &self.config, decoupled)?,
                Device::Cuda(ordinal) => cuda::update(
                    ordinal,
                    self.name,
                    &self.params,
                    &group,
                    &self.config,
                    decoupled,
                    &mut self.tables,
                )?,
            }
        }
        for u in &updates {
            if let Some(state) = self.states[u.index].as_mut() {
                state.step = u.step;
            }
            write_back(&self.params[u.index], &u.target)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        check_learning_rate(self.name, lr)?;
        self.config.lr = lr;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, s) in self.states.iter().enumerate() {
            let Some(s) = s else { continue };
            out.push((format!("{i}.exp_avg"), s.exp_avg.clone()));
            out.push((format!("{i}.exp_avg_sq"), s.exp_avg_sq.clone()));
            if let Some(m) = &s.max_exp_avg_sq {
                out.push((format!("{i}.max_exp_avg_sq"), m.clone()));
            }
            if let Ok(step) = Tensor::scalar(s.step as i64, Device::Cpu) {
                out.push((format!("{i}.step"), step));
            }
        }
        if let Ok(step) = Tensor::scalar(self.steps as i64, Device::Cpu) {
            out.push(("step".to_string(), step));
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let mut found: Vec<FoundState> = (0..self.params.len())
            .map(|_| FoundState::default())
            .collect();
        let mut steps = self.steps;
        for (entry, tensor) in state {
            if entry == "step" {
                steps = read_step(self.name, entry, tensor)?;
                continue;
            }
            self.load_entry(&mut found, entry, tensor)?;
        }
        // Validate everything before assigning: a rejected state leaves the optimizer as it was.
        self.states = self.assemble_states(found)?;
        self.steps = steps;
        Ok(())
    }

    fn exp_avg(&self, index: usize) -> Option<&Tensor> {
        self.states.get(index)?.as_ref().map(|s| &s.exp_avg)
    }

    fn exp_avg_sq(&self, index: usize) -> Option<&Tensor> {
        self.states.get(index)?.as_ref().map(|s| &s.exp_avg_sq)
    }
}

/// The entries of a loaded state found for one parameter, checked for completeness once all
/// entries are read.
#[derive(Default)]
struct FoundState {
    step: Option<u64>,
    exp_avg: Option<Tensor>,
    exp_avg_sq: Option<Tensor>,
    max_exp_avg_sq: Option<Tensor>,
}

/// The error for a state `optimizer` cannot load.
fn state_error(optimizer: &'static str, msg: String) -> Error {
    Error::State { optimizer, msg }
}

/// Reads a step count entry: one non-negative i64.
fn read_step(optimizer: &'static str, entry: &str, tensor: &Tensor) -> Result<u64> {
    if tensor.dtype() != DType::I64 || tensor.numel() != 1 {
        return Err(state_error(
            optimizer,
            format!(
                "`{entry}` must be one i64, got {:?} {}",
                tensor.dims(),
                tensor.dtype()
            ),
        ));
    }
    let value = tensor.item()?;
    if value < 0.0 {
        return Err(state_error(
            optimizer,
            format!("`{entry}` must be >= 0, got {value}"),
        ));
    }
    Ok(value as u64)
}

/// The halves of [`Optimizer::load_state`]: reading one entry, then checking each parameter's
/// entries form a whole state.
impl AdamCore {
    /// Records one per-parameter entry (`<index>.<what>`) in `found`, checked against its
    /// parameter.
    fn load_entry(&self, found: &mut [FoundState], entry: &str, tensor: &Tensor) -> Result<()> {
        let bad = |msg: String| state_error(self.name, msg);
        let (index, what) = entry
            .split_once('.')
            .and_then(|(i, what)| Some((i.parse::<usize>().ok()?, what)))
            .ok_or_else(|| bad(format!("unknown entry `{entry}`")))?;
        let param = self.params.get(index).ok_or_else(|| {
            bad(format!(
                "`{entry}` refers to parameter {index}, but there are {} parameters",
                self.params.len()
            ))
        })?;
        let slot = &mut found[index];
        if what == "step" {
            slot.step = Some(read_step(self.name, entry, tensor)?);
            return Ok(());
        }
        let target = match what {
            "exp_avg" => &mut slot.exp_avg,
            "exp_avg_sq" => &mut slot.exp_avg_sq,
            "max_exp_avg_sq" if self.config.amsgrad => &mut slot.max_exp_avg_sq,
            "max_exp_avg_sq" => {
                return Err(bad(format!(
                    "`{entry}` is AMSGrad state, but this optimizer has amsgrad off"
                )))
            }
            _ => return Err(bad(format!("unknown entry `{entry}`"))),
        };
        if tensor.dims() != param.dims() || tensor.dtype() != param.dtype() {
            return Err(bad(format!(
                "`{entry}` is {:?} {} but parameter {index} is {:?} {}",
                tensor.dims(),
                tensor.dtype(),
                param.dims(),
                param.dtype()
            )));
        }
        *target = Some(state_for_parameter(tensor, param)?);
        Ok(())
    }

    /// Turns the entries found into per-parameter states: a parameter with no entries has no
    /// state yet; one with some must have all of them.
    fn assemble_states(&self, found: Vec<FoundState>) -> Result<Vec<Option<ParamState>>> {
        let mut states = Vec::with_capacity(found.len());
        for (index, f) in found.into_iter().enumerate() {
            let any = f.step.is_some()
                || f.exp_avg.is_some()
                || f.exp_avg_sq.is_some()
                || f.max_exp_avg_sq.is_some();
            if !any {
                states.push(None);
                continue;
            }
            let missing = |what: &str| {
                state_error(
                    self.name,
                    format!("parameter {index} has state but no `{index}.{what}`"),
                )
            };
            let max_exp_avg_sq = match (self.config.amsgrad, f.max_exp_avg_sq) {
                (true, None) => return Err(missing("max_exp_avg_sq")),
                (_, m) => m,
            };
            states.push(Some(ParamState {
                step: f.step.ok_or_else(|| missing("step"))?,
                exp_avg: f.exp_avg.ok_or_else(|| missing("exp_avg"))?,
                exp_avg_sq: f.exp_avg_sq.ok_or_else(|| missing("exp_avg_sq"))?,
                max_exp_avg_sq,
            }));
        }
        Ok(states)
    }
}

/// Generates the public wrapper type around [`AdamCore`] and its `Optimizer` impl.
macro_rules! adam_variant {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $decoupled:expr) => {
        $(#[$doc])*
        pub struct $ty(AdamCore);

        impl $ty {
            /// An optimizer over `params` (usually `model.parameters()`). Errors for an
            /// invalid config or a parameter that is not a distinct floating-point leaf
            /// requiring grad.
            pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<Self> {
                AdamCore::new($name, $decoupled, params, config).map($ty)
            }

            /// The hyper-parameters.
            pub fn config(&self) -> &AdamConfig {
                &self.0.config
            }

            /// The first-moment estimate of parameter `index`, once it exists.
            pub fn exp_avg(&self, index: usize) -> Option<&Tensor> {
                self.0.exp_avg(index)
            }

            /// The second-moment estimate of parameter `index`, once it exists.
            pub fn exp_avg_sq(&self, index: usize) -> Option<&Tensor> {
                self.0.exp_avg_sq(index)
            }
        }

        impl Optimizer for $ty {
            fn name(&self) -> &'static str {
                $name
            }

            fn parameters(&self) -> &[Tensor] {
                &self.0.params
            }

            fn step(&mut self) -> Result<()> {
                self.0.step()
            }

            fn step_count(&self) -> u64 {
                self.0.steps
            }

            fn learning_rate(&self) -> f64 {
                self.0.config.lr
            }

            fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
                self.0.set_learning_rate(lr)
            }

            fn state(&self) -> Vec<(String, Tensor)> {
                self.0.state()
            }

            fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
                self.0.load_state(state)
            }
        }
    };
}

adam_variant!(
    /// Adam with its weight decay as an L2 penalty folded into the gradient (PyTorch's
    /// `torch.optim.Adam`; see the module documentation for the exact rule).
    Adam,
    "Adam",
    false
);

adam_variant!(
    /// Adam with decoupled weight decay (PyTorch's `torch.optim.AdamW`): the parameter is
    /// multiplied by `1 - lr * weight_decay` before the Adam update. Build its config with
    /// [`AdamConfig::adamw`] for PyTorch's defaults (weight decay 1e-2).
    AdamW,
    "AdamW",
    true
);

#[cfg(test)]
mod tests {
    use super::*;

    const INIT: [f64; 4] = [0.5, -1.25, 2.0, 0.125];
    const TARGET: [f64; 4] = [1.0, 0.5, -0.75, 0.0];
    /// Per-step gradient scales; large then small, so AMSGrad's maximum differs from `v`.
    const SCALES: [f64; 5] = [3.0, 0.5, 1.0, 0.2, 2.0];

    fn param(values: &[f64]) -> Tensor {
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, &[values.len()], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap()
    }

    /// The gradient of `scale * sum((p - target)^2)`, so gradients vary by step.
    fn grad_of(p: &[f64], step: usize) -> Vec<f64> {
        let scale = SCALES[step % SCALES.len()];
        p.iter()
            .zip(TARGET)
            .map(|(p, t)| 2.0 * scale * (p - t))
            .collect()
    }

    /// PyTorch's Adam / AdamW written out in f64 from the published algorithm, independently
    /// of the kernel.
    fn reference(cfg: &AdamConfig, decoupled: bool, steps: usize) -> Vec<f64> {
        let (b1, b2) = cfg.betas;
        let n = INIT.len();
        let mut p = INIT.to_vec();
        let (mut m, mut v, mut v_max) = (vec![0.0f64; n], vec![0.0f64; n], vec![0.0f64; n]);
        for step in 0..steps {
            let t = (step + 1) as i32;
            let g = grad_of(&p, step);
            for i in 0..n {
                let mut gi = g[i];
                if decoupled {
                    p[i] *= 1.0 - cfg.lr * cfg.weight_decay;
                } else {
                    gi += cfg.weight_decay * p[i];
                }
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                v_max[i] = v_max[i].max(v[i]);
                let second = if cfg.amsgrad { v_max[i] } else { v[i] };
                let m_hat = m[i] / (1.0 - b1.powi(t));
                let v_hat_sqrt = second.sqrt() / (1.0 - b2.powi(t)).sqrt();
                p[i] -= cfg.lr * m_hat / (v_hat_sqrt + cfg.eps);
            }
        }
        p
    }

    fn set_grad(p: &Tensor, step: usize) {
        let current = p.to_vec_f64().unwrap();
        let g: Vec<f32> = grad_of(&current, step).iter().map(|&x| x as f32).collect();
        p.set_grad(Some(Tensor::from_vec(g, &[4], Device::Cpu).unwrap()))
            .unwrap();
    }

    fn run(opt: &mut dyn Optimizer, p: &Tensor, steps: usize) -> Vec<f64> {
        for step in 0..steps {
            set_grad(p, step);
            opt.step().unwrap();
        }
        assert_eq!(opt.step_count(), steps as u64);
        p.to_vec_f64().unwrap()
    }

    fn run_adam(cfg: AdamConfig, steps: usize) -> Vec<f64> {
        let p = param(&INIT);
        run(&mut Adam::new(vec![p.clone()], cfg).unwrap(), &p, steps)
    }

    fn run_adamw(cfg: AdamConfig, steps: usize) -> Vec<f64> {
        let p = param(&INIT);
        run(&mut AdamW::new(vec![p.clone()], cfg).unwrap(), &p, steps)
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                "got {got:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn adam_first_step_moves_each_weight_by_about_lr() {
        // At t = 1, m_hat = g and sqrt(v_hat) = |g|, so the step is lr * sign(g) (up to eps).
        let got = run_adam(AdamConfig::new(0.1), 1);
        let want: Vec<f64> = INIT
            .iter()
            .zip(TARGET)
            .map(|(p, t)| p - 0.1 * (p - t).signum())
            .collect();
        assert_close(&got, &want);
    }

    #[test]
    fn adam_matches_reference_over_steps() {
        let cfg = AdamConfig::new(0.05).with_betas(0.8, 0.95);
        assert_close(&run_adam(cfg, 5), &reference(&cfg, false, 5));
        let cfg = AdamConfig::default();
        assert_close(&run_adam(cfg, 4), &reference(&cfg, false, 4));
    }

    #[test]
    fn adam_weight_decay_is_added_to_the_gradient() {
        let cfg = AdamConfig::new(0.05).with_weight_decay(0.1).with_eps(1e-6);
        assert_close(&run_adam(cfg, 5), &reference(&cfg, false, 5));
        // It must differ from the decoupled rule, or the test would not tell them apart.
        let decoupled = reference(&cfg, true, 5);
        assert!((decoupled[1] - reference(&cfg, false, 5)[1]).abs() > 1e-4);
    }

    #[test]
    fn adamw_decays_weights_before_the_update() {
        let cfg = AdamConfig::adamw(0.05);
        assert_eq!(cfg.weight_decay, 1e-2);
        assert_close(&run_adamw(cfg, 5), &reference(&cfg, true, 5));
        let cfg = AdamConfig::new(0.1).with_weight_decay(0.5);
        assert_close(&run_adamw(cfg, 4), &reference(&cfg, true, 4));
    }

    #[test]
    fn amsgrad_uses_the_running_maximum_of_second_moments() {
        let cfg = AdamConfig::new(0.05)
            .with_betas(0.9, 0.5)
            .with_amsgrad(true);
        assert_close(&run_adam(cfg, 5), &reference(&cfg, false, 5));
        let plain = reference(&cfg.with_amsgrad(false), false, 5);
        assert!((plain[0] - reference(&cfg, false, 5)[0]).abs() > 1e-4);
        let cfg = cfg.with_weight_decay(0.1);
        assert_close(&run_adamw(cfg, 5), &reference(&cfg, true, 5));
    }

    #[test]
    fn f64_parameters_match_reference_closely() {
        let p = Tensor::from_vec(INIT.to_vec(), &[4], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        let cfg = AdamConfig::new(0.05)
            .with_weight_decay(0.1)
            .with_amsgrad(true);
        let mut opt = AdamW::new(vec![p.clone()], cfg).unwrap();
        for step in 0..4 {
            let g = grad_of(&p.to_vec_f64().unwrap(), step);
            p.set_grad(Some(Tensor::from_vec(g, &[4], Device::Cpu).unwrap()))
                .unwrap();
            opt.step().unwrap();
        }
        let (got, want) = (p.to_vec_f64().unwrap(), reference(&cfg, true, 4));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-12, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn parameters_without_gradient_are_skipped_and_keep_their_own_step() {
        let (a, b) = (param(&INIT), param(&INIT));
        let cfg = AdamConfig::new(0.05);
        let mut opt = Adam::new(vec![a.clone(), b.clone()], cfg).unwrap();
        set_grad(&a, 0);
        opt.step().unwrap();
        assert_close(&b.to_vec_f64().unwrap(), &INIT);
        assert!(opt.exp_avg(1).is_none());
        // b's first update is bias-corrected as step 1, as in PyTorch, though the optimizer
        // has taken two steps.
        a.set_grad(None).unwrap();
        set_grad(&b, 0);
        opt.step().unwrap();
        assert_close(&b.to_vec_f64().unwrap(), &reference(&cfg, false, 1));
        let names: Vec<String> = opt.state().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "0.exp_avg",
                "0.exp_avg_sq",
                "0.step",
                "1.exp_avg",
                "1.exp_avg_sq",
                "1.step",
                "step"
            ]
        );
    }

    #[test]
    fn non_contiguous_parameter_is_updated_through_its_view() {
        let base = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap();
        let t = base
            .view_detached(base.layout().transpose("t", 0, 1).unwrap())
            .unwrap()
            .with_requires_grad()
            .unwrap();
        let mut opt = Adam::new(vec![t.clone()], AdamConfig::new(0.5)).unwrap();
        t.set_grad(Some(
            Tensor::from_vec(vec![2.0f32, 0.0, 0.0, -4.0], &[2, 2], Device::Cpu).unwrap(),
        ))
        .unwrap();
        opt.step().unwrap();
        // First step: lr * sign(g) where g != 0 (up to eps); t = [[1, 3], [2, 4]].
        assert_close(&t.to_vec_f64().unwrap(), &[0.5, 3.0, 2.0, 4.5]);
        assert_close(&base.to_vec_f64().unwrap(), &[0.5, 2.0, 3.0, 4.5]);
    }

    #[test]
    fn invalid_configs_are_rejected_with_a_reason() {
        let p = || vec![param(&INIT)];
        let cases = [
            (AdamConfig::new(-0.1), "learning rate"),
            (AdamConfig::new(f64::NAN), "learning rate"),
            (AdamConfig::default().with_betas(-0.1, 0.999), "betas.0"),
            (AdamConfig::default().with_betas(1.0, 0.999), "betas.0"),
            (AdamConfig::default().with_betas(0.9, 1.0), "betas.1"),
            (AdamConfig::default().with_betas(0.9, f64::NAN), "betas.1"),
            (AdamConfig::default().with_eps(0.0), "eps"),
            (AdamConfig::default().with_eps(-1e-8), "eps"),
            (
                AdamConfig::default().with_weight_decay(-0.1),
                "weight_decay",
            ),
        ];
        for (cfg, needle) in cases {
            let err = Adam::new(p(), cfg).err().expect("config must be rejected");
            let msg = err.to_string();
            assert!(msg.contains("Adam:") && msg.contains(needle), "{msg}");
            let err = AdamW::new(p(), cfg).err().expect("config must be rejected");
            let msg = err.to_string();
            assert!(msg.contains("AdamW") && msg.contains(needle), "{msg}");
        }
        let mut opt = AdamW::new(p(), AdamConfig::adamw(0.1)).unwrap();
        assert!(opt.set_learning_rate(-1.0).is_err());
        opt.set_learning_rate(0.2).unwrap();
        assert_eq!(opt.learning_rate(), 0.2);
        let a = param(&INIT);
        let err = Adam::new(vec![a.clone(), a], AdamConfig::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("parameter 1") && err.contains("more than once"),
            "{err}"
        );
        for (name, err) in [
            ("Adam", Adam::new(vec![], AdamConfig::default()).err()),
            ("AdamW", AdamW::new(vec![], AdamConfig::adamw(0.1)).err()),
        ] {
            let msg = err
                .expect("an empty parameter list must be refused")
                .to_string();
            assert!(
                msg.starts_with(&format!("{name}: got an empty parameter list")),
                "{msg}"
            );
        }
    }

    fn copied_state(opt: &dyn Optimizer) -> Vec<(String, Tensor)> {
        opt.state()
            .into_iter()
            .map(|(n, t)| (n, t.copy_detached().unwrap()))
            .collect()
    }

    #[test]
    fn state_round_trips_into_a_fresh_optimizer() {
        let cfg = AdamConfig::new(0.05)
            .with_amsgrad(true)
            .with_weight_decay(0.1);
        let p = param(&INIT);
        let mut opt = AdamW::new(vec![p.clone()], cfg).unwrap();
        run(&mut opt, &p, 3);
        let state = copied_state(&opt);
        let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "0.exp_avg",
                "0.exp_avg_sq",
                "0.max_exp_avg_sq",
                "0.step",
                "step"
            ]
        );

        let q = param(&p.to_vec_f64().unwrap());
        let mut fresh = AdamW::new(vec![q.clone()], cfg).unwrap();
        fresh.load_state(&state).unwrap();
        assert_eq!(fresh.step_count(), 3);
        for step in 3..6 {
            set_grad(&p, step);
            set_grad(&q, step);
            opt.step().unwrap();
            fresh.step().unwrap();
        }
        assert_eq!(p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());
        assert_close(&q.to_vec_f64().unwrap(), &reference(&cfg, true, 6));
    }

    #[test]
    fn mismatched_state_is_rejected_with_a_reason() {
        let p = param(&INIT);
        let mut adam = Adam::new(vec![p.clone()], AdamConfig::new(0.1).with_amsgrad(true)).unwrap();
        run(&mut adam, &p, 1);
        let state = copied_state(&adam);

        let mut plain = Adam::new(vec![param(&INIT)], AdamConfig::new(0.1)).unwrap();
        let err = plain.load_state(&state).unwrap_err().to_string();
        assert!(
            err.contains("0.max_exp_avg_sq") && err.contains("amsgrad off"),
            "{err}"
        );

        let mut ams =
            Adam::new(vec![param(&INIT)], AdamConfig::new(0.1).with_amsgrad(true)).unwrap();
        let without_step: Vec<_> = state
            .iter()
            .filter(|(n, _)| n != "0.step")
            .cloned()
            .collect();
        let err = ams.load_state(&without_step).unwrap_err().to_string();
        assert!(err.contains("`0.step`"), "{err}");

        let wrong = vec![(
            "0.exp_avg".to_string(),
            Tensor::zeros(&[5], DType::F32, Device::Cpu).unwrap(),
        )];
        let err = ams.load_state(&wrong).unwrap_err().to_string();
        assert!(err.contains("[5]") && err.contains("[4]"), "{err}");

        let wrong = vec![(
            "3.exp_avg".to_string(),
            Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap(),
        )];
        let err = ams.load_state(&wrong).unwrap_err().to_string();
        assert!(err.contains("parameter 3"), "{err}");
        let err = ams.load_state(&[("0.momentum_buffer".to_string(), state[0].1.clone())]);
        assert!(err.unwrap_err().to_string().contains("unknown entry"));
    }
    /// Channels-last parameters update in place in storage order, their moments channels-last
    /// beside them, to the bits of the same updates of row-major parameters: Adam with L2
    /// decay and amsgrad, AdamW, a row-major gradient, and moments reloaded row-major.
    #[test]
    fn channels_last_parameters_update_in_storage_order_to_the_row_major_bits() {
        use tandem_core::{Generator, MemoryFormat};
        let shape = [2, 3, 2, 4];
        let mut gen = Generator::new(13);
        let mut randn =
            || Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let init = randn();
        let grads: Vec<Tensor> = (0..4).map(|_| randn()).collect();
        let (cl, rm) = (MemoryFormat::ChannelsLast, MemoryFormat::Contiguous);
        let fresh = |format: MemoryFormat| {
            init.copy_detached()
                .unwrap()
                .contiguous_in(format)
                .unwrap()
                .copy_detached()
                .unwrap()
                .contiguous_in(format)
                .unwrap()
                .with_requires_grad()
                .unwrap()
        };
        // Runs 4 steps of `make`'s optimizer on a parameter in `format`, gradients in
        // `grad_format`, the state reloaded row-major after two steps when `reload`.
        let run = |adamw: bool, format, grad_format, reload: bool| {
            let p = fresh(format);
            let cfg = if adamw {
                AdamConfig::adamw(0.05)
            } else {
                AdamConfig::new(0.05)
                    .with_weight_decay(0.01)
                    .with_amsgrad(true)
            };
            let make = |p: &Tensor| -> Box<dyn Optimizer> {
                if adamw {
                    Box::new(AdamW::new(vec![p.clone()], cfg).unwrap())
                } else {
                    Box::new(Adam::new(vec![p.clone()], cfg).unwrap())
                }
            };
            let mut opt = make(&p);
            for (step, g) in grads.iter().enumerate() {
                if reload && step == 2 {
                    let state: Vec<(String, Tensor)> = opt
                        .state()
                        .into_iter()
                        .map(|(n, t)| (n, t.contiguous_in(rm).unwrap().copy_detached().unwrap()))
                        .collect();
                    opt = make(&p);
                    opt.load_state(&state).unwrap();
                }
                p.set_grad(Some(g.contiguous_in(grad_format).unwrap()))
                    .unwrap();
                opt.step().unwrap();
            }
            assert_eq!(p.memory_format(), format);
            p.to_vec::<f32>().unwrap()
        };
        for adamw in [false, true] {
            let want = run(adamw, rm, rm, false);
            for (grad_format, reload) in [(cl, false), (rm, false), (cl, true)] {
                assert_eq!(
                    run(adamw, cl, grad_format, reload),
                    want,
                    "adamw {adamw}, gradient {grad_format:?}, reload {reload}"
                );
            }
        }
    }
}
