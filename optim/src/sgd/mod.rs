//! Stochastic gradient descent with momentum, dampening, Nesterov momentum and weight decay,
//! with exactly PyTorch's update rule (`torch.optim.SGD`).
//!
//! For each parameter `p` with gradient `g`, one step computes
//!
//! ```text
//! d = g + weight_decay * p
//! if momentum != 0:
//!     b = d                                       (first step: no dampening)
//!     b = momentum * b + (1 - dampening) * d      (later steps)
//!     d = d + momentum * b   if nesterov   else   b
//! p = p - lr * d
//! ```
//!
//! The arithmetic runs in the parameter's dtype, in place on its buffer. A step gathers every
//! parameter's operands here and dispatches once per device: to the host loops of `cpu.rs`, or
//! to one fused multi-tensor launch per dtype on a CUDA device (`cuda.rs`), which computes the
//! same operations in the same order. Momentum buffers live on their parameter's device.

mod cpu;
mod cuda;

use tandem_core::{DType, Device, Tensor};

use crate::multi_tensor::TableCache;
use crate::optimizer::{
    by_device, check_learning_rate, check_parameters, follow_parameter, state_for_parameter,
    update_operands, write_back, zero_state, UpdateOperands,
};
use crate::{Error, Optimizer, Result};

const NAME: &str = "SGD";

/// Hyper-parameters of [`Sgd`]. Defaults: `lr` 0.01, everything else off (0 / false).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Momentum factor (>= 0); 0 disables momentum buffers.
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer (not applied on the
    /// first step, as in PyTorch). Must be 0 with Nesterov momentum.
    pub dampening: f64,
    /// Nesterov momentum; needs `momentum > 0` and `dampening == 0`.
    pub nesterov: bool,
    /// L2 penalty added to the gradient (`g + weight_decay * p`, >= 0).
    pub weight_decay: f64,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 0.01,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            ..Default::default()
        }
    }

    /// The same config with momentum `momentum`.
    pub fn with_momentum(self, momentum: f64) -> Self {
        SgdConfig { momentum, ..self }
    }

    /// The same config with weight decay `weight_decay`.
    pub fn with_weight_decay(self, weight_decay: f64) -> Self {
        SgdConfig {
            weight_decay,
            ..self
        }
    }

    /// The same config with Nesterov momentum switched on or off.
    pub fn with_nesterov(self, nesterov: bool) -> Self {
        SgdConfig { nesterov, ..self }
    }

    /// The same config with dampening `dampening`.
    pub fn with_dampening(self, dampening: f64) -> Self {
        SgdConfig { dampening, ..self }
    }

    /// Checks the combination, naming what is wrong.
    pub fn validate(&self) -> Result<()> {
        check_learning_rate(NAME, self.lr)?;
        let invalid = |msg: String| {
            Err(Error::InvalidConfig {
                optimizer: NAME,
                msg,
            })
        };
        if !self.momentum.is_finite() || self.momentum < 0.0 {
            return invalid(format!(
                "momentum must be finite and >= 0, got {}",
                self.momentum
            ));
        }
        if !self.dampening.is_finite() {
            return invalid(format!("dampening must be finite, got {}", self.dampening));
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return invalid(format!(
                "weight_decay must be finite and >= 0, got {}",
                self.weight_decay
            ));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return invalid(format!(
                "Nesterov momentum requires momentum > 0 and dampening = 0, got momentum {} and \
                 dampening {}",
                self.momentum, self.dampening
            ));
        }
        Ok(())
    }
}

/// Stochastic gradient descent (see the module documentation for the exact rule).
pub struct Sgd {
    params: Vec<Tensor>,
    config: SgdConfig,
    /// One per parameter; `None` until the parameter's first update with momentum.
    momentum_buffers: Vec<Option<Tensor>>,
    steps: u64,
    /// Tables of the fused CUDA step, reused while the tensors stay where they are.
    tables: TableCache,
}

/// One parameter's share of a step: what the kernels read and write.
struct SgdUpdate {
    /// The parameter's index.
    index: usize,
    /// The device of the parameter, its gradient and its buffer.
    device: Device,
    /// The gradient, dense and not sharing the parameter's memory.
    grad: Tensor,
    /// The parameter, or a dense copy written back after the update.
    target: Tensor,
    /// The momentum buffer, when momentum is on.
    buffer: Option<Tensor>,
    /// Whether the buffer is new (it becomes the gradient, undampened).
    first: bool,
}

/// Cached tables per optimizer: a step needs one per dtype (two in the step that creates some
/// momentum buffers), and a few more absorb parameters whose gradients come and go.
const CACHED_TABLES: usize = 4;

impl Sgd {
    /// An optimizer over `params` (usually `model.parameters()`). Errors for an invalid config
    /// or a parameter that is not a distinct floating-point leaf requiring grad.
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<Self> {
        config.validate()?;
        check_parameters(NAME, &params)?;
        let momentum_buffers = vec![None; params.len()];
        Ok(Sgd {
            params,
            config,
            momentum_buffers,
            steps: 0,
            tables: TableCache::new(CACHED_TABLES),
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer of parameter `index`, once it exists.
    pub fn momentum_buffer(&self, index: usize) -> Option<&Tensor> {
        self.momentum_buffers.get(index).and_then(|b| b.as_ref())
    }

    /// The operands of every parameter that has a gradient, creating momentum buffers on first
    /// use and moving existing ones to a parameter that has moved.
    fn gather(&mut self) -> Result<Vec<SgdUpdate>> {
        let momentum = self.config.momentum != 0.0;
        let mut updates = Vec::with_capacity(self.params.len());
        for index in 0..self.params.len() {
            let param = &self.params[index];
            let Some(UpdateOperands {
                grad,
                target,
                device,
            }) = update_operands(NAME, index, param)?
            else {
                continue;
            };
            let slot = &mut self.momentum_buffers[index];
            let first = slot.is_none();
            let buffer = match slot {
                _ if !momentum => None,
                Some(b) => {
                    follow_parameter(NAME, index, param, device, b)?;
                    Some(b.clone())
                }
                None => {
                    let b = zero_state(param, &target, device)?;
                    *slot = Some(b.clone());
                    Some(b)
                }
            };
            updates.push(SgdUpdate {
                index,
                device,
                grad,
                target,
                buffer,
                first,
            });
        }
        Ok(updates)
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        NAME
    }

    fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    fn step(&mut self) -> Result<()> {
        let _profile = tandem_core::profile::scope("sgd.step", tandem_core::profile::Phase::Other);
        let updates = self.gather()?;
        for (device, group) in by_device(&updates, |u| u.device) {
            match device {
                Device::Cpu => cpu::update(&group, &self.config)?,
                Device::Cuda(ordinal) => cuda::update(
                    ordinal,
                    &self.params,
                    &group,
                    &self.config,
                    &mut self.tables,
                )?,
            }
        }
        for u in &updates {
            write_back(&self.params[u.index], &u.target)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn step_count(&self) -> u64 {
        self.steps
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) -> Result<()> {
        check_learning_rate(NAME, lr)?;
        self.config.lr = lr;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .momentum_buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                b.as_ref()
                    .map(|b| (format!("{i}.momentum_buffer"), b.clone()))
            })
            .collect();
        if let Ok(step) = Tensor::scalar(self.steps as i64, tandem_core::Device::Cpu) {
            out.push(("step".to_string(), step));
        }
        out
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        let bad = |msg: String| Error::State {
            optimizer: NAME,
            msg,
        };
        let mut buffers = vec![None; self.params.len()];
        let mut steps = self.steps;
        for (name, tensor) in state {
            if name == "step" {
                if tensor.dtype() != DType::I64 || tensor.numel() != 1 {
                    return Err(bad(format!(
                        "`step` must be one i64, got {:?} {}",
                        tensor.dims(),
                        tensor.dtype()
                    )));
                }
                steps = tensor.item()? as u64;
                continue;
            }
            let index = name
                .strip_suffix(".momentum_buffer")
                .and_then(|i| i.parse::<usize>().ok())
                .ok_or_else(|| bad(format!("unknown entry `{name}`")))?;
            let param = self.params.get(index).ok_or_else(|| {
                bad(format!(
                    "`{name}` refers to parameter {index}, but there are {} parameters",
                    self.params.len()
                ))
            })?;
            if tensor.dims() != param.dims() || tensor.dtype() != param.dtype() {
                return Err(bad(format!(
                    "`{name}` is {:?} {} but parameter {index} is {:?} {}",
                    tensor.dims(),
                    tensor.dtype(),
                    param.dims(),
                    param.dtype()
                )));
            }
            buffers[index] = Some(state_for_parameter(tensor, param)?);
        }
        self.momentum_buffers = buffers;
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Device;

    const INIT: [f64; 4] = [0.5, -1.25, 2.0, 0.125];
    const TARGET: [f64; 4] = [1.0, 0.5, -0.75, 0.0];

    fn param(values: &[f64]) -> Tensor {
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, &[values.len()], Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap()
    }

    /// The gradient of sum((p - target)^2) with a per-step scale, so gradients vary by step.
    fn grad_of(p: &[f64], step: usize) -> Vec<f64> {
        let scale = 1.0 + 0.5 * step as f64;
        p.iter()
            .zip(TARGET)
            .map(|(p, t)| 2.0 * scale * (p - t))
            .collect()
    }

    /// PyTorch's SGD written out in f64, independently of the kernel.
    fn reference(cfg: &SgdConfig, steps: usize) -> Vec<f64> {
        let mut p = INIT.to_vec();
        let mut buf: Option<Vec<f64>> = None;
        for step in 0..steps {
            let g = grad_of(&p, step);
            let d: Vec<f64> = g
                .iter()
                .zip(&p)
                .map(|(g, p)| g + cfg.weight_decay * p)
                .collect();
            let d = if cfg.momentum != 0.0 {
                let b: Vec<f64> = match &buf {
                    None => d.clone(),
                    Some(b) => b
                        .iter()
                        .zip(&d)
                        .map(|(b, d)| cfg.momentum * b + (1.0 - cfg.dampening) * d)
                        .collect(),
                };
                let out = if cfg.nesterov {
                    d.iter()
                        .zip(&b)
                        .map(|(d, b)| d + cfg.momentum * b)
                        .collect()
                } else {
                    b.clone()
                };
                buf = Some(b);
                out
            } else {
                d
            };
            for (p, d) in p.iter_mut().zip(&d) {
                *p -= cfg.lr * d;
            }
        }
        p
    }

    fn run(cfg: SgdConfig, steps: usize) -> Vec<f64> {
        let p = param(&INIT);
        let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
        for step in 0..steps {
            let current = p.to_vec_f64().unwrap();
            let g: Vec<f32> = grad_of(&current, step).iter().map(|&x| x as f32).collect();
            p.set_grad(Some(Tensor::from_vec(g, &[4], Device::Cpu).unwrap()))
                .unwrap();
            opt.step().unwrap();
        }
        assert_eq!(opt.step_count(), steps as u64);
        p.to_vec_f64().unwrap()
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "got {got:?}, want {want:?}"
            );
        }
    }

    #[test]
    fn plain_sgd_matches_hand_computed_updates() {
        let cfg = SgdConfig::new(0.1);
        assert_close(&run(cfg, 4), &reference(&cfg, 4));
        // One step by hand: p - lr * 2 (p - t).
        let one = run(cfg, 1);
        assert!((one[0] - (0.5 - 0.1 * 2.0 * (0.5 - 1.0))).abs() < 1e-6);
    }

    #[test]
    fn momentum_first_step_uses_the_gradient_undampened() {
        let cfg = SgdConfig::new(0.1).with_momentum(0.9).with_dampening(0.5);
        let p = param(&INIT);
        let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
        let g = grad_of(&INIT, 0);
        let gf: Vec<f32> = g.iter().map(|&x| x as f32).collect();
        p.set_grad(Some(Tensor::from_vec(gf, &[4], Device::Cpu).unwrap()))
            .unwrap();
        opt.step().unwrap();
        assert_close(&opt.momentum_buffer(0).unwrap().to_vec_f64().unwrap(), &g);
        let want: Vec<f64> = INIT.iter().zip(&g).map(|(p, g)| p - 0.1 * g).collect();
        assert_close(&p.to_vec_f64().unwrap(), &want);
    }

    #[test]
    fn momentum_with_dampening_matches_reference_over_steps() {
        let cfg = SgdConfig::new(0.05).with_momentum(0.9).with_dampening(0.3);
        assert_close(&run(cfg, 5), &reference(&cfg, 5));
    }

    #[test]
    fn nesterov_matches_reference_over_steps() {
        let cfg = SgdConfig::new(0.05).with_momentum(0.8).with_nesterov(true);
        assert_close(&run(cfg, 5), &reference(&cfg, 5));
    }

    #[test]
    fn weight_decay_matches_reference_over_steps() {
        let cfg = SgdConfig::new(0.1).with_weight_decay(0.01);
        assert_close(&run(cfg, 4), &reference(&cfg, 4));
        let cfg = cfg.with_momentum(0.9).with_nesterov(true);
        assert_close(&run(cfg, 4), &reference(&cfg, 4));
    }

    #[test]
    fn parameters_without_gradient_are_left_alone() {
        let (a, b) = (param(&INIT), param(&INIT));
        let mut opt = Sgd::new(
            vec![a.clone(), b.clone()],
            SgdConfig::new(0.1).with_momentum(0.9),
        )
        .unwrap();
        a.set_grad(Some(Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap()))
            .unwrap();
        opt.step().unwrap();
        assert_close(&b.to_vec_f64().unwrap(), &INIT);
        assert!(opt.momentum_buffer(1).is_none());
        assert_close(
            &a.to_vec_f64().unwrap(),
            &INIT.iter().map(|p| p - 0.1).collect::<Vec<_>>(),
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
        assert!(!t.is_contiguous());
        let mut opt = Sgd::new(vec![t.clone()], SgdConfig::new(0.5)).unwrap();
        t.set_grad(Some(
            Tensor::from_vec(vec![2.0f32, 0.0, 0.0, 4.0], &[2, 2], Device::Cpu).unwrap(),
        ))
        .unwrap();
        opt.step().unwrap();
        // t = [[1, 3], [2, 4]] minus 0.5 * [[2, 0], [0, 4]].
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0, 3.0, 2.0, 2.0]);
        assert_eq!(base.to_vec::<f32>().unwrap(), vec![0.0, 2.0, 3.0, 2.0]);
    }

    #[test]
    fn zero_grad_zeroes_the_same_gradient_tensor_in_place() {
        let p = param(&INIT);
        let g = Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap();
        p.set_grad(Some(g.clone())).unwrap();
        let mut opt = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
        opt.zero_grad().unwrap();
        assert!(p.grad().unwrap().same_tensor(&g));
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![0.0; 4]);
        opt.zero_grad_set_to_none().unwrap();
        assert!(p.grad().is_none());
    }

    #[test]
    fn invalid_configs_are_rejected_with_a_reason() {
        let p = || vec![param(&INIT)];
        let cases = [
            (SgdConfig::new(0.1).with_nesterov(true), "Nesterov"),
            (
                SgdConfig::new(0.1)
                    .with_momentum(0.9)
                    .with_dampening(0.1)
                    .with_nesterov(true),
                "dampening = 0",
            ),
            (SgdConfig::new(-0.1), "learning rate"),
            (SgdConfig::new(f64::NAN), "learning rate"),
            (SgdConfig::new(0.1).with_momentum(-0.5), "momentum"),
            (SgdConfig::new(0.1).with_weight_decay(-1.0), "weight_decay"),
        ];
        for (cfg, needle) in cases {
            let err = Sgd::new(p(), cfg).err().expect("config must be rejected");
            let msg = err.to_string();
            assert!(msg.contains("SGD") && msg.contains(needle), "{msg}");
        }
        let mut opt = Sgd::new(p(), SgdConfig::new(0.1)).unwrap();
        assert!(opt.set_learning_rate(f64::INFINITY).is_err());
        opt.set_learning_rate(0.2).unwrap();
        assert_eq!(opt.learning_rate(), 0.2);
    }

    #[test]
    fn invalid_parameter_lists_are_rejected() {
        let a = param(&INIT);
        let err = Sgd::new(vec![a.clone(), a.clone()], SgdConfig::new(0.1))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("parameter 1") && err.contains("more than once"),
            "{err}"
        );
        let frozen = Tensor::zeros(&[3], DType::F32, Device::Cpu).unwrap();
        let err = Sgd::new(vec![frozen], SgdConfig::new(0.1))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("parameter 0") && err.contains("require grad"),
            "{err}"
        );
    }

    #[test]
    fn an_empty_parameter_list_is_refused_naming_the_optimizer() {
        let err = Sgd::new(vec![], SgdConfig::new(0.1))
            .err()
            .expect("an empty parameter list must be refused");
        assert!(
            matches!(err, Error::EmptyParameterList { optimizer: "SGD" }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.starts_with("SGD: got an empty parameter list"), "{msg}");
        assert!(msg.contains("model.parameters()"), "{msg}");
        // `unwrap()` and `main`'s error print the message, not the variant's fields.
        assert_eq!(format!("{err:?}"), msg);
    }

    #[test]
    fn state_round_trips_into_a_fresh_optimizer() {
        let cfg = SgdConfig::new(0.05).with_momentum(0.9);
        let p = param(&INIT);
        let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
        p.set_grad(Some(Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap()))
            .unwrap();
        opt.step().unwrap();
        let state: Vec<(String, Tensor)> = opt
            .state()
            .into_iter()
            .map(|(n, t)| (n, t.copy_detached().unwrap()))
            .collect();
        let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["0.momentum_buffer", "step"]);

        let q = param(&p.to_vec_f64().unwrap());
        let mut fresh = Sgd::new(vec![q.clone()], cfg).unwrap();
        fresh.load_state(&state).unwrap();
        assert_eq!(fresh.step_count(), 1);
        for t in [&p, &q] {
            t.set_grad(Some(
                Tensor::full(&[4], 2.0, DType::F32, Device::Cpu).unwrap(),
            ))
            .unwrap();
        }
        opt.step().unwrap();
        fresh.step().unwrap();
        assert_eq!(p.to_vec::<f32>().unwrap(), q.to_vec::<f32>().unwrap());

        let wrong = vec![(
            "0.momentum_buffer".to_string(),
            Tensor::zeros(&[5], DType::F32, Device::Cpu).unwrap(),
        )];
        let err = fresh.load_state(&wrong).unwrap_err().to_string();
        assert!(err.contains("[5]") && err.contains("[4]"), "{err}");
    }
    /// A channels-last parameter is updated in place in storage order, its momentum buffer
    /// channels-last beside it, with the values of the same update of a row-major parameter,
    /// also when its gradient arrives row-major or its buffer was loaded row-major.
    #[test]
    fn channels_last_parameters_update_in_storage_order_with_row_major_values() {
        use tandem_core::{Generator, MemoryFormat};
        let shape = [2, 3, 2, 4];
        let mut gen = Generator::new(11);
        let mut randn =
            || Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
        let init = randn();
        let grads: Vec<Tensor> = (0..4).map(|_| randn()).collect();
        let cfg = SgdConfig::new(0.1)
            .with_momentum(0.9)
            .with_weight_decay(0.01)
            .with_nesterov(true);
        let cl = MemoryFormat::ChannelsLast;
        // (parameter format, gradient format, reload the state after two steps)
        for (param_format, grad_format, reload) in [
            (MemoryFormat::Contiguous, MemoryFormat::Contiguous, false),
            (cl, cl, false),
            (cl, MemoryFormat::Contiguous, false),
            (cl, cl, true),
        ] {
            let p = init
                .contiguous_in(param_format)
                .unwrap()
                .copy_detached()
                .unwrap()
                .contiguous_in(param_format)
                .unwrap()
                .with_requires_grad()
                .unwrap();
            let storage = p.storage().clone();
            let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
            for (step, g) in grads.iter().enumerate() {
                if reload && step == 2 {
                    // A checkpoint's buffers come back row-major.
                    let state: Vec<(String, Tensor)> = opt
                        .state()
                        .into_iter()
                        .map(|(n, t)| {
                            (
                                n,
                                t.contiguous_in(MemoryFormat::Contiguous)
                                    .unwrap()
                                    .copy_detached()
                                    .unwrap(),
                            )
                        })
                        .collect();
                    opt = Sgd::new(vec![p.clone()], cfg).unwrap();
                    opt.load_state(&state).unwrap();
                }
                p.set_grad(Some(g.contiguous_in(grad_format).unwrap()))
                    .unwrap();
                opt.step().unwrap();
            }
            assert!(
                p.storage().same_buffer(&storage),
                "{param_format:?}: updated in place"
            );
            assert_eq!(p.memory_format(), param_format);
            if param_format == cl {
                assert!(opt.momentum_buffer(0).unwrap().is_contiguous_in(cl));
            }
            // The row-major run written out in f64 (f32 rounding: a loose bound).
            let mut want = init.to_vec_f64().unwrap();
            let mut buf: Option<Vec<f64>> = None;
            for g in &grads {
                let d: Vec<f64> = g
                    .to_vec_f64()
                    .unwrap()
                    .iter()
                    .zip(&want)
                    .map(|(g, p)| g + 0.01 * p)
                    .collect();
                let b: Vec<f64> = match &buf {
                    None => d.clone(),
                    Some(b) => b.iter().zip(&d).map(|(b, d)| 0.9 * b + d).collect(),
                };
                for ((p, d), b) in want.iter_mut().zip(&d).zip(&b) {
                    *p -= 0.1 * (d + 0.9 * b);
                }
                buf = Some(b);
            }
            assert_close(&p.to_vec_f64().unwrap(), &want);
        }
    }
}
