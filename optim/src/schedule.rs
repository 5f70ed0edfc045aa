//! Learning-rate schedules: closed-form rules that give the learning rate at each step, and the
//! [`Scheduler`] that applies one to an optimizer.
//!
//! A schedule is a pure function `lr_at(step, base_lr)`, so resuming a run is as simple as
//! asking for the step it stopped at. The values are PyTorch's closed forms
//! (`torch.optim.lr_scheduler`): [`StepLr`], [`MultiStepLr`], [`CosineAnnealingLr`] and
//! [`LinearWarmup`] (PyTorch's `LinearLR` ending at factor 1). Two schedules compose as
//! [`SequentialLr`] (one after the other, PyTorch's `SequentialLR`: `warmup.then(cosine)`)
//! or as [`Chained`] (both at once, like `ChainedScheduler` for multiplicative schedules).
//!
//! ```text
//! let mut scheduler = Scheduler::new(warmup.then(cosine)?, &mut optimizer)?;
//! for _ in 0..steps { …; optimizer.step()?; scheduler.step(&mut optimizer)?; }
//! ```

use std::f64::consts::PI;

use crate::{Error, Optimizer, Result};

/// A rule giving the learning rate at each step from the optimizer's base learning rate.
pub trait LrSchedule: Send {
    /// The schedule's name for messages (`"StepLr"`).
    fn name(&self) -> &'static str;

    /// The learning rate after `step` scheduler steps (step 0 is the start of training).
    fn lr_at(&self, step: u64, base_lr: f64) -> f64;

    /// How many steps the schedule lasts when it has a natural end (a warm-up's length, a
    /// cosine's half period), used by [`LrSchedule::then`]; `None` for open-ended ones.
    fn duration(&self) -> Option<u64> {
        None
    }

    /// This schedule for its [`LrSchedule::duration`], then `next`, whose steps count from
    /// the end of this one. Errors if this schedule has no natural end; use
    /// [`LrSchedule::then_at`] to give the switching step explicitly.
    fn then<S: LrSchedule>(self, next: S) -> Result<SequentialLr<Self, S>>
    where
        Self: Sized,
    {
        match self.duration() {
            Some(milestone) => Ok(self.then_at(milestone, next)),
            None => Err(Error::Schedule {
                schedule: self.name(),
                msg: "has no natural end to switch to the next schedule at; use then_at(step, \
                      next) instead"
                    .to_string(),
            }),
        }
    }

    /// This schedule for steps `0..milestone`, then `next` from its own step 0.
    fn then_at<S: LrSchedule>(self, milestone: u64, next: S) -> SequentialLr<Self, S>
    where
        Self: Sized,
    {
        SequentialLr {
            first: self,
            second: next,
            milestone,
        }
    }

    /// Both schedules at every step: `other` is applied to the learning rate this schedule
    /// gives (for multiplicative schedules, the product of their factors).
    fn chain<S: LrSchedule>(self, other: S) -> Chained<Self, S>
    where
        Self: Sized,
    {
        Chained {
            first: self,
            second: other,
        }
    }
}

impl LrSchedule for Box<dyn LrSchedule> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        (**self).lr_at(step, base_lr)
    }

    fn duration(&self) -> Option<u64> {
        (**self).duration()
    }
}

fn invalid(schedule: &'static str, msg: String) -> Error {
    Error::Schedule { schedule, msg }
}

fn check_gamma(schedule: &'static str, gamma: f64) -> Result<()> {
    if !gamma.is_finite() || gamma < 0.0 {
        return Err(invalid(
            schedule,
            format!("gamma must be finite and >= 0, got {gamma}"),
        ));
    }
    Ok(())
}

/// `base_lr * gamma^floor(step / step_size)`: decay by `gamma` every `step_size` steps
/// (PyTorch's `StepLR`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLr {
    step_size: u64,
    gamma: f64,
}

impl StepLr {
    /// Decays by `gamma` (finite, >= 0; PyTorch's default is 0.1) every `step_size` (> 0)
    /// steps.
    pub fn new(step_size: u64, gamma: f64) -> Result<Self> {
        if step_size == 0 {
            return Err(invalid(
                "StepLr",
                "step_size must be > 0, got 0".to_string(),
            ));
        }
        check_gamma("StepLr", gamma)?;
        Ok(StepLr { step_size, gamma })
    }
}

impl LrSchedule for StepLr {
    fn name(&self) -> &'static str {
        "StepLr"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        base_lr * powu(self.gamma, step / self.step_size)
    }
}

/// `gamma^k` for a step count; saturates the exponent (the result is 0, 1 or inf long
/// before `i32::MAX` anyway).
fn powu(gamma: f64, k: u64) -> f64 {
    gamma.powi(k.min(i32::MAX as u64) as i32)
}

/// `base_lr * gamma^(number of milestones <= step)` (PyTorch's `MultiStepLR`; a milestone
/// listed twice decays twice, as there).
#[derive(Clone, Debug, PartialEq)]
pub struct MultiStepLr {
    /// Sorted ascending.
    milestones: Vec<u64>,
    gamma: f64,
}

impl MultiStepLr {
    /// Decays by `gamma` (finite, >= 0) at each of `milestones` (in any order).
    pub fn new(mut milestones: Vec<u64>, gamma: f64) -> Result<Self> {
        check_gamma("MultiStepLr", gamma)?;
        milestones.sort_unstable();
        Ok(MultiStepLr { milestones, gamma })
    }
}

impl LrSchedule for MultiStepLr {
    fn name(&self) -> &'static str {
        "MultiStepLr"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        let passed = self.milestones.partition_point(|&m| m <= step);
        base_lr * powu(self.gamma, passed as u64)
    }
}

/// `eta_min + (base_lr - eta_min) * (1 + cos(pi * step / t_max)) / 2` (PyTorch's
/// `CosineAnnealingLR` in closed form). It reaches `eta_min` at `t_max` and, like PyTorch's
/// closed form, rises again after it; follow it with another schedule to hold it down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineAnnealingLr {
    t_max: u64,
    eta_min: f64,
}

impl CosineAnnealingLr {
    /// Anneals from the base learning rate to `eta_min` (finite, >= 0) over `t_max` (> 0)
    /// steps.
    pub fn new(t_max: u64, eta_min: f64) -> Result<Self> {
        if t_max == 0 {
            return Err(invalid(
                "CosineAnnealingLr",
                "t_max must be > 0, got 0".to_string(),
            ));
        }
        if !eta_min.is_finite() || eta_min < 0.0 {
            return Err(invalid(
                "CosineAnnealingLr",
                format!("eta_min must be finite and >= 0, got {eta_min}"),
            ));
        }
        Ok(CosineAnnealingLr { t_max, eta_min })
    }
}

impl LrSchedule for CosineAnnealingLr {
    fn name(&self) -> &'static str {
        "CosineAnnealingLr"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        let phase = PI * step as f64 / self.t_max as f64;
        self.eta_min + (base_lr - self.eta_min) * (1.0 + phase.cos()) / 2.0
    }

    fn duration(&self) -> Option<u64> {
        Some(self.t_max)
    }
}

/// `base_lr * (start_factor + (1 - start_factor) * min(step, warmup_steps) / warmup_steps)`:
/// a linear ramp from `start_factor * base_lr` to `base_lr`, then constant (PyTorch's
/// `LinearLR` with `end_factor = 1`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmup {
    warmup_steps: u64,
    start_factor: f64,
}

impl LinearWarmup {
    /// Ramps over `warmup_steps` (> 0) steps starting from `start_factor` in `(0, 1]`
    /// (PyTorch's default is 1/3).
    pub fn new(warmup_steps: u64, start_factor: f64) -> Result<Self> {
        if warmup_steps == 0 {
            return Err(invalid(
                "LinearWarmup",
                "warmup_steps must be > 0, got 0".to_string(),
            ));
        }
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(invalid(
                "LinearWarmup",
                format!("start_factor must be in (0, 1], got {start_factor}"),
            ));
        }
        Ok(LinearWarmup {
            warmup_steps,
            start_factor,
        })
    }
}

impl LrSchedule for LinearWarmup {
    fn name(&self) -> &'static str {
        "LinearWarmup"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        let done = step.min(self.warmup_steps) as f64 / self.warmup_steps as f64;
        base_lr * (self.start_factor + (1.0 - self.start_factor) * done)
    }

    fn duration(&self) -> Option<u64> {
        Some(self.warmup_steps)
    }
}

/// `first` for steps `0..milestone`, then `second` counted from the milestone (PyTorch's
/// `SequentialLR` with one milestone). Built by [`LrSchedule::then`] or
/// [`LrSchedule::then_at`].
#[derive(Clone, Debug, PartialEq)]
pub struct SequentialLr<A, B> {
    first: A,
    second: B,
    milestone: u64,
}

impl<A: LrSchedule, B: LrSchedule> LrSchedule for SequentialLr<A, B> {
    fn name(&self) -> &'static str {
        "SequentialLr"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        if step < self.milestone {
            self.first.lr_at(step, base_lr)
        } else {
            self.second.lr_at(step - self.milestone, base_lr)
        }
    }

    fn duration(&self) -> Option<u64> {
        self.second
            .duration()
            .map(|d| self.milestone.saturating_add(d))
    }
}

/// Two schedules at once: `second` applied to the learning rate `first` gives. For
/// multiplicative schedules ([`StepLr`], [`MultiStepLr`], [`LinearWarmup`]) this is the product
/// of their factors, as PyTorch's `ChainedScheduler` computes. Built by [`LrSchedule::chain`].
#[derive(Clone, Debug, PartialEq)]
pub struct Chained<A, B> {
    first: A,
    second: B,
}

impl<A: LrSchedule, B: LrSchedule> LrSchedule for Chained<A, B> {
    fn name(&self) -> &'static str {
        "Chained"
    }

    fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        self.second.lr_at(step, self.first.lr_at(step, base_lr))
    }

    fn duration(&self) -> Option<u64> {
        match (self.first.duration(), self.second.duration()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        }
    }
}

/// Owns a schedule and a base learning rate and sets an optimizer's learning rate from them:
/// call [`Scheduler::step`] once per optimizer step (or epoch, as you schedule).
pub struct Scheduler<S> {
    schedule: S,
    base_lr: f64,
    steps: u64,
}

impl<S: LrSchedule> Scheduler<S> {
    /// A scheduler whose base learning rate is `optimizer`'s current one; sets the optimizer
    /// to the schedule's step-0 value, as PyTorch's schedulers do on construction.
    pub fn new<O: Optimizer + ?Sized>(schedule: S, optimizer: &mut O) -> Result<Self> {
        let scheduler = Self::with_base_lr(schedule, optimizer.learning_rate())?;
        scheduler.apply(optimizer)?;
        Ok(scheduler)
    }

    /// A scheduler with an explicit base learning rate (finite, >= 0), at step 0; it changes
    /// no optimizer until [`Scheduler::apply`] or [`Scheduler::step`].
    pub fn with_base_lr(schedule: S, base_lr: f64) -> Result<Self> {
        if !base_lr.is_finite() || base_lr < 0.0 {
            return Err(invalid(
                schedule.name(),
                format!("base learning rate must be finite and >= 0, got {base_lr}"),
            ));
        }
        Ok(Scheduler {
            schedule,
            base_lr,
            steps: 0,
        })
    }

    /// The schedule.
    pub fn schedule(&self) -> &S {
        &self.schedule
    }

    /// The base learning rate the schedule scales.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// Number of [`Scheduler::step`] calls so far (the step the current rate belongs to).
    pub fn step_count(&self) -> u64 {
        self.steps
    }

    /// The learning rate for the current step.
    pub fn current_lr(&self) -> f64 {
        self.schedule.lr_at(self.steps, self.base_lr)
    }

    /// Sets `optimizer`'s learning rate to [`Scheduler::current_lr`]. Errors, naming the
    /// schedule and step, if the schedule produced a negative or non-finite rate.
    pub fn apply<O: Optimizer + ?Sized>(&self, optimizer: &mut O) -> Result<()> {
        let lr = self.current_lr();
        if !lr.is_finite() || lr < 0.0 {
            return Err(invalid(
                self.schedule.name(),
                format!(
                    "gave learning rate {lr} at step {} (base {})",
                    self.steps, self.base_lr
                ),
            ));
        }
        optimizer.set_learning_rate(lr)
    }

    /// Advances one step and applies the new learning rate to `optimizer`, returning it. On
    /// error the scheduler stays at its previous step.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<f64> {
        self.steps += 1;
        if let Err(e) = self.apply(optimizer) {
            self.steps -= 1;
            return Err(e);
        }
        Ok(self.current_lr())
    }

    /// Moves to `step` (to resume a run) and applies that step's learning rate.
    pub fn resume_at<O: Optimizer + ?Sized>(&mut self, step: u64, optimizer: &mut O) -> Result<()> {
        let previous = std::mem::replace(&mut self.steps, step);
        if let Err(e) = self.apply(optimizer) {
            self.steps = previous;
            return Err(e);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Sgd, SgdConfig};
    use tandem_core::{DType, Device, Tensor};

    fn assert_close(got: f64, want: f64, what: &str) {
        assert!(
            (got - want).abs() <= 1e-12 * (1.0 + want.abs()),
            "{what}: got {got}, want {want}"
        );
    }

    #[test]
    fn step_lr_decays_every_step_size_steps() {
        let s = StepLr::new(3, 0.5).unwrap();
        for t in 0..12u64 {
            let want = 0.1 * 0.5f64.powi((t / 3) as i32);
            assert_close(s.lr_at(t, 0.1), want, &format!("step {t}"));
        }
        assert_close(s.lr_at(2, 0.1), 0.1, "before the first decay");
        assert_close(s.lr_at(3, 0.1), 0.05, "at the first decay");
    }

    #[test]
    fn multi_step_lr_decays_at_each_milestone() {
        let s = MultiStepLr::new(vec![6, 2, 6, 9], 0.1).unwrap();
        let want = |t: u64| {
            let k = [2u64, 6, 6, 9].iter().filter(|&&m| m <= t).count();
            0.3 * 0.1f64.powi(k as i32)
        };
        for t in 0..12 {
            assert_close(s.lr_at(t, 0.3), want(t), &format!("step {t}"));
        }
        assert_close(s.lr_at(6, 0.3), 0.3 * 1e-3, "double milestone decays twice");
    }

    #[test]
    fn cosine_annealing_follows_the_closed_form() {
        let (t_max, eta_min, base) = (10u64, 0.001, 0.1);
        let s = CosineAnnealingLr::new(t_max, eta_min).unwrap();
        for t in 0..=2 * t_max {
            let want =
                eta_min + (base - eta_min) * (1.0 + (PI * t as f64 / t_max as f64).cos()) / 2.0;
            assert_close(s.lr_at(t, base), want, &format!("step {t}"));
        }
        assert_close(s.lr_at(0, base), base, "start");
        assert_close(s.lr_at(5, base), (base + eta_min) / 2.0, "half way");
        assert_close(s.lr_at(10, base), eta_min, "end");
    }

    #[test]
    fn linear_warmup_ramps_to_the_base_rate_and_holds() {
        let s = LinearWarmup::new(4, 0.25).unwrap();
        for t in 0..8u64 {
            let want = 0.2 * (0.25 + 0.75 * (t.min(4) as f64) / 4.0);
            assert_close(s.lr_at(t, 0.2), want, &format!("step {t}"));
        }
        assert_close(s.lr_at(0, 0.2), 0.05, "start");
        assert_close(s.lr_at(4, 0.2), 0.2, "end of warm-up");
    }

    #[test]
    fn warmup_then_cosine_counts_cosine_steps_from_the_end_of_warmup() {
        let (w, t_max, base, eta_min) = (5u64, 20u64, 0.1, 0.0);
        let s = LinearWarmup::new(w, 0.1)
            .unwrap()
            .then(CosineAnnealingLr::new(t_max, eta_min).unwrap())
            .unwrap();
        assert_eq!(s.duration(), Some(w + t_max));
        for t in 0..w + t_max + 1 {
            let want = if t < w {
                base * (0.1 + 0.9 * t as f64 / w as f64)
            } else {
                let c = (t - w) as f64;
                eta_min + (base - eta_min) * (1.0 + (PI * c / t_max as f64).cos()) / 2.0
            };
            assert_close(s.lr_at(t, base), want, &format!("step {t}"));
        }
        assert_close(s.lr_at(w, base), base, "cosine starts at the base rate");
    }

    #[test]
    fn then_at_switches_at_an_explicit_milestone() {
        let s = StepLr::new(2, 0.5)
            .unwrap()
            .then_at(4, LinearWarmup::new(2, 0.5).unwrap());
        let want = [1.0, 1.0, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0];
        for (t, w) in want.iter().enumerate() {
            assert_close(s.lr_at(t as u64, 1.0), *w, &format!("step {t}"));
        }
        let err = StepLr::new(2, 0.5)
            .unwrap()
            .then(LinearWarmup::new(2, 0.5).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("StepLr") && err.contains("then_at"), "{err}");
    }

    #[test]
    fn chained_multiplies_the_factors_of_multiplicative_schedules() {
        let s = LinearWarmup::new(3, 0.4)
            .unwrap()
            .chain(StepLr::new(2, 0.1).unwrap());
        for t in 0..7u64 {
            let warm = 0.4 + 0.6 * (t.min(3) as f64) / 3.0;
            let want = 0.5 * warm * 0.1f64.powi((t / 2) as i32);
            assert_close(s.lr_at(t, 0.5), want, &format!("step {t}"));
        }
    }

    #[test]
    fn invalid_schedules_are_rejected_with_a_reason() {
        let errors = [
            StepLr::new(0, 0.1).unwrap_err(),
            StepLr::new(1, f64::NAN).unwrap_err(),
            MultiStepLr::new(vec![1], -0.5).unwrap_err(),
            CosineAnnealingLr::new(0, 0.0).unwrap_err(),
            CosineAnnealingLr::new(10, -1.0).unwrap_err(),
            LinearWarmup::new(0, 0.5).unwrap_err(),
            LinearWarmup::new(5, 0.0).unwrap_err(),
            LinearWarmup::new(5, 1.5).unwrap_err(),
        ];
        let needles = [
            "StepLr: invalid schedule: step_size",
            "StepLr: invalid schedule: gamma",
            "MultiStepLr: invalid schedule: gamma",
            "CosineAnnealingLr: invalid schedule: t_max",
            "CosineAnnealingLr: invalid schedule: eta_min",
            "LinearWarmup: invalid schedule: warmup_steps",
            "LinearWarmup: invalid schedule: start_factor",
            "LinearWarmup: invalid schedule: start_factor",
        ];
        for (e, needle) in errors.iter().zip(needles) {
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    fn sgd(lr: f64) -> Sgd {
        let p = Tensor::zeros(&[2], DType::F32, Device::Cpu)
            .unwrap()
            .with_requires_grad()
            .unwrap();
        Sgd::new(vec![p], SgdConfig::new(lr)).unwrap()
    }

    #[test]
    fn scheduler_sets_the_optimizer_rate_at_each_step() {
        let mut opt = sgd(0.1);
        let schedule = LinearWarmup::new(2, 0.5)
            .unwrap()
            .then(StepLr::new(2, 0.1).unwrap())
            .unwrap();
        let mut scheduler = Scheduler::new(schedule, &mut opt).unwrap();
        assert_close(
            opt.learning_rate(),
            0.05,
            "step 0 is applied on construction",
        );
        assert_eq!(scheduler.base_lr(), 0.1);
        let want = [0.075, 0.1, 0.1, 0.01, 0.01, 0.001];
        for (i, w) in want.iter().enumerate() {
            let lr = scheduler.step(&mut opt).unwrap();
            assert_close(lr, *w, &format!("step {}", i + 1));
            assert_close(
                opt.learning_rate(),
                *w,
                &format!("optimizer at step {}", i + 1),
            );
        }
        assert_eq!(scheduler.step_count(), 6);

        // Resuming elsewhere, or through a boxed schedule, gives the same rates.
        let boxed: Box<dyn LrSchedule> = Box::new(scheduler.schedule().clone());
        let mut other = sgd(0.3);
        let mut resumed = Scheduler::with_base_lr(boxed, 0.1).unwrap();
        resumed.resume_at(3, &mut other).unwrap();
        assert_close(other.learning_rate(), 0.1, "resumed at step 3");
        resumed.step(&mut other).unwrap();
        assert_close(other.learning_rate(), 0.01, "step 4 after resuming");
    }

    /// A schedule that goes negative, to check the scheduler refuses it.
    struct Broken;

    impl LrSchedule for Broken {
        fn name(&self) -> &'static str {
            "Broken"
        }

        fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
            base_lr - step as f64
        }
    }

    #[test]
    fn scheduler_rejects_bad_rates_without_advancing() {
        assert!(Scheduler::with_base_lr(Broken, f64::NAN).is_err());
        let mut opt = sgd(0.5);
        let mut scheduler = Scheduler::new(Broken, &mut opt).unwrap();
        let err = scheduler.step(&mut opt).unwrap_err().to_string();
        assert!(err.contains("Broken") && err.contains("step 1"), "{err}");
        assert_eq!(scheduler.step_count(), 0);
        assert_eq!(opt.learning_rate(), 0.5);
    }
}
