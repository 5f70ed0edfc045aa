//! Batch normalisation over the channels of `[N, C, H, W]` inputs.

use tandem_core::{DType, Device, Tensor};
use tandem_ops::batch_norm::{BatchNormArgs, Epilogue};
use tandem_ops::TensorOps;

use crate::module::parameter;
use crate::{Error, Result};
use crate::{Forward, Fused, Module, TrainingFlag};

/// How to build a [`BatchNorm2d`]: the channel count in [`BatchNormConfig::new`], the rest with
/// `with_*` (PyTorch's defaults: eps 1e-5, momentum 0.1, affine, tracking running statistics, on
/// the CPU), then [`BatchNormConfig::init`].
///
/// ```
/// # use tandem_nn::BatchNormConfig;
/// let bn = BatchNormConfig::new(64).with_momentum(0.01).init()?;
/// assert_eq!(bn.num_features(), 64);
/// # Ok::<(), tandem_nn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormConfig {
    /// Number of channels (`C` of `[N, C, H, W]`).
    pub num_features: usize,
    /// Added to the variance before the square root.
    pub eps: f64,
    /// Weight of the current batch in the running statistics:
    /// `running = (1 − momentum) · running + momentum · batch`.
    pub momentum: f64,
    /// Learn a per-channel scale (`weight`, initialised to 1) and shift (`bias`, 0).
    pub affine: bool,
    /// Keep running statistics (buffers `running_mean`, `running_var`,
    /// `num_batches_tracked`) for evaluation mode; without them batch statistics are always
    /// used.
    pub track_running_stats: bool,
    /// Where the parameters and buffers live.
    pub device: Device,
}

impl BatchNormConfig {
    /// Batch normalisation of `num_features` channels with PyTorch's defaults.
    pub fn new(num_features: usize) -> Self {
        BatchNormConfig {
            num_features,
            eps: 1e-5,
            momentum: 0.1,
            affine: true,
            track_running_stats: true,
            device: Device::Cpu,
        }
    }

    /// The same config with `eps` added to the variance.
    pub fn with_eps(self, eps: f64) -> Self {
        BatchNormConfig { eps, ..self }
    }

    /// The same config with running-statistics momentum `momentum`.
    pub fn with_momentum(self, momentum: f64) -> Self {
        BatchNormConfig { momentum, ..self }
    }

    /// The same config with (`true`) or without a learned scale and shift.
    pub fn with_affine(self, affine: bool) -> Self {
        BatchNormConfig { affine, ..self }
    }

    /// The same config with (`true`) or without running statistics.
    pub fn with_track_running_stats(self, track_running_stats: bool) -> Self {
        BatchNormConfig {
            track_running_stats,
            ..self
        }
    }

    /// The same config with parameters and buffers on `device`.
    pub fn with_device(self, device: Device) -> Self {
        BatchNormConfig { device, ..self }
    }

    /// The layer. Errors (naming `BatchNorm2d` and the values) if `num_features` is 0, `eps`
    /// is not a positive number or `momentum` is outside `[0, 1]`.
    pub fn init(&self) -> Result<BatchNorm2d> {
        let config = *self;
        let num_features = config.num_features;
        if num_features == 0 {
            return Err(Error::config(
                "BatchNorm2d",
                "num_features must be > 0, got 0",
            ));
        }
        let eps_ok = config.eps.is_finite() && config.eps > 0.0;
        let momentum_ok = config.momentum.is_finite() && (0.0..=1.0).contains(&config.momentum);
        if !eps_ok || !momentum_ok {
            return Err(Error::config(
                "BatchNorm2d",
                format!(
                    "need eps > 0 and momentum in [0, 1], got eps {} and momentum {}",
                    config.eps, config.momentum
                ),
            ));
        }
        let c = [num_features];
        let filled = |v: f64| Tensor::full(&c, v, DType::F32, config.device);
        let (weight, bias) = if config.affine {
            (
                Some(parameter(filled(1.0)?)?),
                Some(parameter(filled(0.0)?)?),
            )
        } else {
            (None, None)
        };
        let (running_mean, running_var, num_batches_tracked) = if config.track_running_stats {
            (
                Some(filled(0.0)?),
                Some(filled(1.0)?),
                Some(Tensor::scalar(0i64, config.device)?),
            )
        } else {
            (None, None, None)
        };
        Ok(BatchNorm2d {
            num_features,
            config,
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            training: TrainingFlag::new(),
        })
    }
}

/// Normalises each channel of `[N, C, H, W]` to zero mean and unit variance, then scales and
/// shifts it.
///
/// In training mode it uses the statistics of the batch (the biased variance) and updates the
/// running statistics (with the unbiased variance) and `num_batches_tracked`; in evaluation
/// mode it uses the running statistics. Parameters `weight`, `bias` `[C]`; buffers
/// `running_mean` (0), `running_var` (1) `[C]` f32 and `num_batches_tracked` (a 0-dim i64).
///
/// Built with [`BatchNormConfig`].
///
/// # Shapes
/// `x` `[N, C, H, W]` → the same shape.
#[derive(Debug, Module)]
#[module(fused)]
pub struct BatchNorm2d {
    num_features: usize,
    config: BatchNormConfig,
    #[param]
    weight: Option<Tensor>,
    #[param]
    bias: Option<Tensor>,
    #[buffer]
    running_mean: Option<Tensor>,
    #[buffer]
    running_var: Option<Tensor>,
    #[buffer]
    num_batches_tracked: Option<Tensor>,
    training: TrainingFlag,
}

impl BatchNorm2d {
    /// Number of channels.
    pub fn num_features(&self) -> usize {
        self.num_features
    }

    /// The options.
    pub fn config(&self) -> &BatchNormConfig {
        &self.config
    }

    /// The per-channel scale, if affine.
    pub fn weight(&self) -> Option<&Tensor> {
        self.weight.as_ref()
    }

    /// The per-channel shift, if affine.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The running mean, if tracked.
    pub fn running_mean(&self) -> Option<&Tensor> {
        self.running_mean.as_ref()
    }

    /// The running (unbiased) variance, if tracked.
    pub fn running_var(&self) -> Option<&Tensor> {
        self.running_var.as_ref()
    }

    /// How many training batches updated the running statistics, if tracked.
    pub fn num_batches_tracked(&self) -> Option<&Tensor> {
        self.num_batches_tracked.as_ref()
    }
}

impl BatchNorm2d {
    /// The forward, with the [`Epilogue`] fused onto the output.
    fn run(&self, x: &Tensor, epilogue: Epilogue<'_>) -> Result<Tensor> {
        if x.rank() != 4 || x.dims()[1] != self.num_features {
            return Err(Error::input(
                "BatchNorm2d",
                format!(
                    "expected input [N, {}, H, W] (num_features = {}), got shape {:?}",
                    self.num_features,
                    self.num_features,
                    x.dims()
                ),
            ));
        }
        let training = self.is_training();
        let use_batch_stats = training || !self.config.track_running_stats;
        if x.dims()[0] == 0 {
            return self.empty_batch(x, epilogue);
        }
        if use_batch_stats && x.numel() / self.num_features <= 1 {
            return Err(Error::input(
                "BatchNorm2d",
                format!(
                    "batch statistics need more than one value per channel, got input shape {:?}",
                    x.dims()
                ),
            ));
        }
        let args = BatchNormArgs {
            running_mean: self.running_mean.as_ref(),
            running_var: self.running_var.as_ref(),
            weight: self.weight.as_ref(),
            bias: self.bias.as_ref(),
            training: use_batch_stats,
            momentum: self.config.momentum,
            eps: self.config.eps,
        };
        let out = tandem_ops::batch_norm::batch_norm_fused(x, epilogue, &args)?;
        if training {
            self.count_training_batch()?;
        }
        Ok(out)
    }

    /// The forward of a batch of no samples (what a rank that has joined runs inside
    /// `DistributedDataParallel::join`, shadowing the others): an empty output, the running
    /// statistics untouched (no sample to count), and the output still a function of the weight
    /// and the bias, so their gradients are (zero) sums over no samples and their gradient-ready
    /// events fire as on the ranks with samples.
    fn empty_batch(&self, x: &Tensor, epilogue: Epilogue<'_>) -> Result<Tensor> {
        let per_channel = [1, self.num_features as isize, 1, 1];
        let mut out = x.clone();
        if let Some(weight) = &self.weight {
            out = out.mul(&weight.reshape(&per_channel)?)?;
        }
        if let Some(bias) = &self.bias {
            out = out.add(&bias.reshape(&per_channel)?)?;
        }
        Ok(match epilogue {
            Epilogue::Plain => out,
            Epilogue::Relu => out.relu()?,
            Epilogue::AddRelu(residual) => out.add(residual)?.relu()?,
        })
    }

    /// Adds one to `num_batches_tracked` (when tracked), as every training forward does; a
    /// layer that runs this one's statistics itself (`SyncBatchNorm`) calls it for its own.
    pub fn count_training_batch(&self) -> Result<()> {
        if let Some(count) = &self.num_batches_tracked {
            // On the counter's device: no host access to a CUDA buffer.
            tandem_ops::batch_norm::phases::count_batch(count)?;
        }
        Ok(())
    }
}

impl Forward for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, Epilogue::Plain)
    }
}

impl Fused for BatchNorm2d {
    /// `relu(forward(x))` in batch norm's own passes (`tandem_ops::batch_norm_relu`).
    fn forward_relu(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, Epilogue::Relu)
    }

    /// `relu(forward(x) + residual)` in batch norm's own passes
    /// (`tandem_ops::batch_norm_add_relu`).
    fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.run(x, Epilogue::AddRelu(residual))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ParamKind;
    use tandem_core::Generator;

    fn bn(num_features: usize) -> Result<BatchNorm2d> {
        BatchNormConfig::new(num_features).init()
    }

    fn input() -> Tensor {
        let mut g = Generator::new(5);
        Tensor::randn(&[4, 2, 3, 3], 2.0, 3.0, DType::F32, Device::Cpu, &mut g).unwrap()
    }

    /// Per-channel mean and biased variance of an `[N, C, H, W]` tensor, in f64.
    fn channel_stats(t: &Tensor) -> Vec<(f64, f64)> {
        let (n, c, hw) = (t.dims()[0], t.dims()[1], t.dims()[2] * t.dims()[3]);
        let v = t.to_vec_f64().unwrap();
        (0..c)
            .map(|ch| {
                let xs: Vec<f64> = (0..n)
                    .flat_map(|i| v[(i * c + ch) * hw..(i * c + ch + 1) * hw].to_vec())
                    .collect();
                let mean = xs.iter().sum::<f64>() / xs.len() as f64;
                let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
                (mean, var)
            })
            .collect()
    }

    #[test]
    fn batch_norm_registers_pytorch_parameters_and_buffers() {
        let bn = bn(3).unwrap();
        let names: Vec<(String, ParamKind)> = bn
            .named_tensors()
            .into_iter()
            .map(|(n, k, _)| (n, k))
            .collect();
        let want = [
            ("weight", ParamKind::Parameter),
            ("bias", ParamKind::Parameter),
            ("running_mean", ParamKind::Buffer),
            ("running_var", ParamKind::Buffer),
            ("num_batches_tracked", ParamKind::Buffer),
        ];
        assert_eq!(names.len(), want.len());
        for ((n, k), (wn, wk)) in names.iter().zip(want) {
            assert_eq!((n.as_str(), *k), (wn, wk));
        }
        assert_eq!(bn.weight().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 3]);
        assert_eq!(
            bn.running_var().unwrap().to_vec::<f32>().unwrap(),
            vec![1.0; 3]
        );
        let bare = BatchNormConfig::new(3)
            .with_affine(false)
            .with_track_running_stats(false)
            .init()
            .unwrap();
        assert!(bare.named_tensors().is_empty());
    }

    #[test]
    fn training_mode_normalises_with_batch_statistics_and_updates_running_ones() {
        let bn = bn(2).unwrap();
        let x = input();
        let y = bn.forward(&x).unwrap();
        for (mean, var) in channel_stats(&y) {
            assert!(
                mean.abs() < 1e-4 && (var - 1.0).abs() < 1e-3,
                "{mean} {var}"
            );
        }
        let stats = channel_stats(&x);
        let count = 4.0 * 9.0;
        let rm = bn.running_mean().unwrap().to_vec_f64().unwrap();
        let rv = bn.running_var().unwrap().to_vec_f64().unwrap();
        for (c, (mean, var)) in stats.iter().enumerate() {
            assert!((rm[c] - 0.1 * mean).abs() < 1e-4);
            let unbiased = var * count / (count - 1.0);
            assert!((rv[c] - (0.9 + 0.1 * unbiased)).abs() < 1e-3);
        }
        assert_eq!(bn.num_batches_tracked().unwrap().item().unwrap(), 1.0);
    }

    #[test]
    fn an_empty_training_batch_gives_an_empty_output_and_zero_gradients() {
        // A joined rank's shadow step (`DistributedDataParallel::join`) runs a batch of no
        // samples: no statistics to take, but the weight and bias must still get (zero)
        // gradients, as on the ranks with samples.
        let bn = bn(2).unwrap();
        let x = Tensor::zeros(&[0, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
        let residual = Tensor::zeros(&[0, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
        let outputs = [
            bn.forward(&x).unwrap(),
            bn.forward_relu(&x).unwrap(),
            bn.forward_add_relu(&x, &residual).unwrap(),
        ];
        for y in outputs {
            assert_eq!(y.dims(), &[0, 2, 3, 3]);
            let (weight, bias) = (bn.weight().unwrap(), bn.bias().unwrap());
            weight.set_grad(None).unwrap();
            bias.set_grad(None).unwrap();
            let seed = y.zeros_like().unwrap();
            tandem_autograd::backward(&y, Some(&seed), &Default::default()).unwrap();
            for p in [weight, bias] {
                let grad = p.grad().expect("a gradient for the weight and the bias");
                assert_eq!(grad.to_vec::<f32>().unwrap(), vec![0.0; 2]);
            }
        }
        assert_eq!(
            bn.running_mean().unwrap().to_vec::<f32>().unwrap(),
            vec![0.0; 2]
        );
        assert_eq!(
            bn.running_var().unwrap().to_vec::<f32>().unwrap(),
            vec![1.0; 2]
        );
        assert_eq!(bn.num_batches_tracked().unwrap().item().unwrap(), 0.0);
    }

    #[test]
    fn eval_mode_uses_running_statistics_and_leaves_them_alone() {
        let bn = bn(2).unwrap();
        bn.eval();
        let x = input();
        let y = bn.forward(&x).unwrap().to_vec_f64().unwrap();
        // Fresh running stats are mean 0, var 1: y = x / sqrt(1 + eps).
        let scale = 1.0 / (1.0f64 + 1e-5).sqrt();
        for (a, b) in y.iter().zip(x.to_vec_f64().unwrap()) {
            assert!((a - b * scale).abs() < 1e-5);
        }
        assert_eq!(
            bn.running_mean().unwrap().to_vec::<f32>().unwrap(),
            vec![0.0; 2]
        );
        assert_eq!(bn.num_batches_tracked().unwrap().item().unwrap(), 0.0);
    }

    /// The running statistics and the batch count of `fused` moved as those of `plain` (one
    /// training forward each).
    fn assert_moved_alike(fused: &BatchNorm2d, plain: &BatchNorm2d) {
        for (a, b) in fused.named_tensors().iter().zip(plain.named_tensors()) {
            assert_eq!(
                a.2.to_vec_f64().unwrap(),
                b.2.to_vec_f64().unwrap(),
                "{}",
                a.0
            );
        }
        assert_eq!(fused.num_batches_tracked().unwrap().item().unwrap(), 1.0);
    }

    #[test]
    fn fused_relu_forward_clamps_the_normalised_output_in_both_modes() {
        let (fused, plain) = (bn(2).unwrap(), bn(2).unwrap());
        let x = input();
        for training in [true, false] {
            fused.set_training(training);
            let y = fused.forward_relu(&x).unwrap().to_vec_f64().unwrap();
            // the plain layer in training mode gives the batch-normalised values (mean 0, var 1)
            plain.set_training(training);
            let z = plain.forward(&x).unwrap().to_vec_f64().unwrap();
            assert!(z.iter().any(|&v| v < 0.0));
            for (a, b) in y.iter().zip(&z) {
                assert_eq!(*a, b.max(0.0));
            }
        }
        assert_moved_alike(&fused, &plain);
        let bad = Tensor::zeros(&[2, 3, 4, 4], DType::F32, Device::Cpu).unwrap();
        assert!(fused.forward_relu(&bad).is_err());
    }

    #[test]
    fn fused_add_relu_forward_clamps_normalised_plus_residual_in_both_modes() {
        let (fused, plain) = (bn(2).unwrap(), bn(2).unwrap());
        let x = input();
        let mut g = Generator::new(6);
        let r = Tensor::randn(x.dims(), 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
        let rv = r.to_vec::<f32>().unwrap();
        for training in [true, false] {
            fused.set_training(training);
            let y = fused
                .forward_add_relu(&x, &r)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            plain.set_training(training);
            let z = plain.forward(&x).unwrap().to_vec::<f32>().unwrap();
            let sums: Vec<f32> = z.iter().zip(&rv).map(|(a, b)| a + b).collect();
            assert!(sums.iter().any(|&v| v < 0.0) && sums.iter().any(|&v| v > 0.0));
            for (a, s) in y.iter().zip(&sums) {
                assert_eq!(*a, s.max(0.0));
            }
        }
        assert_moved_alike(&fused, &plain);
        let bad = Tensor::zeros(&[4, 2, 3, 1], DType::F32, Device::Cpu).unwrap();
        let err = fused.forward_add_relu(&x, &bad).unwrap_err().to_string();
        assert!(
            err.contains("batch_norm_add_relu") && err.contains("[4, 2, 3, 1]"),
            "{err}"
        );
    }

    #[test]
    fn batch_norm_rejects_wrong_channels_and_single_values() {
        let bn = bn(3).unwrap();
        let x = Tensor::zeros(&[2, 2, 4, 4], DType::F32, Device::Cpu).unwrap();
        let err = bn.forward(&x).unwrap_err().to_string();
        assert!(
            err.contains("BatchNorm2d") && err.contains("[2, 2, 4, 4]"),
            "{err}"
        );
        let one = Tensor::zeros(&[1, 3, 1, 1], DType::F32, Device::Cpu).unwrap();
        assert!(bn.forward(&one).is_err());
        bn.eval();
        assert!(bn.forward(&one).is_ok());
    }

    #[test]
    fn batch_norm_config_rejects_bad_values_naming_them() {
        let err = bn(0).unwrap_err().to_string();
        assert!(
            err.contains("BatchNorm2d") && err.contains("got 0"),
            "{err}"
        );
        let err = BatchNormConfig::new(2).with_eps(0.0).init().unwrap_err();
        assert!(err.to_string().contains("eps 0"), "{err}");
        let err = BatchNormConfig::new(2)
            .with_momentum(1.5)
            .init()
            .unwrap_err();
        assert!(err.to_string().contains("momentum 1.5"), "{err}");
        let custom = BatchNormConfig::new(2).with_eps(1e-3).with_momentum(0.01);
        assert_eq!(custom.init().unwrap().config(), &custom);
    }
}
