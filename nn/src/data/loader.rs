//! [`DataLoader`]: batches in sampler order, built on a background thread.
//!
//! Each pass over the data ([`DataLoader::iter`] or [`DataLoader::epoch`]) starts one worker
//! thread that asks the sampler for the epoch's order, cuts it into batches and builds them
//! with the dataset, keeping up to `prefetch` finished batches in a bounded channel. The caller
//! receives them in order as `Result<Batch>`; dropping the iterator stops the worker.
//!
//! Memory: besides the batch the caller holds, a pass holds at most `prefetch + 1` batches —
//! `prefetch` finished ones waiting in the channel and the one the worker is building (plus,
//! on a CUDA device, their device copies). [`Batches::wait_time`] says how long the caller
//! waited for them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_core::{Device, Event, MemoryFormat, Stream};

use crate::data::{Batch, Dataset, RandomSampler, Sampler, SequentialSampler};
use crate::{Error, Result};

/// How a [`DataLoader`] batches. Defaults: batch size 64, no shuffling, seed 0, keep the last
/// partial batch, prefetch 2 batches, batches on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataLoaderConfig {
    /// Samples per batch (> 0).
    pub batch_size: usize,
    /// Visit samples in a random order, reshuffled every epoch from `seed + epoch`.
    pub shuffle: bool,
    /// Seed of the shuffle.
    pub seed: u64,
    /// Skip the last batch of an epoch if it has fewer than `batch_size` samples.
    pub drop_last: bool,
    /// Finished batches the worker may hold ahead of the caller (> 0).
    pub prefetch: usize,
    /// Where batches are delivered: on a CUDA device they are copied there in the background.
    pub device: Device,
    /// The memory format of the batches' inputs: [`MemoryFormat::ChannelsLast`] lays the 4-D
    /// image batches out NHWC (an error for inputs of another rank), for a channels-last
    /// model; the default keeps them row-major. CPU batches are re-laid on the loader thread;
    /// CUDA batches, whose upload is row-major, on the compute stream when they are handed out.
    pub memory_format: MemoryFormat,
}

impl Default for DataLoaderConfig {
    fn default() -> Self {
        DataLoaderConfig {
            batch_size: 64,
            shuffle: false,
            seed: 0,
            drop_last: false,
            prefetch: 2,
            device: Device::Cpu,
            memory_format: MemoryFormat::Contiguous,
        }
    }
}

/// Iterates a dataset in batches, building the next batches in the background.
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    sampler: Arc<dyn Sampler>,
    config: DataLoaderConfig,
    next_epoch: AtomicU64,
}

impl DataLoader {
    /// A loader whose sampler follows `config.shuffle` and `config.seed`.
    pub fn new(dataset: Arc<dyn Dataset>, config: DataLoaderConfig) -> Result<Self> {
        let len = dataset.len();
        let sampler: Arc<dyn Sampler> = if config.shuffle {
            Arc::new(RandomSampler::new(len, config.seed))
        } else {
            Arc::new(SequentialSampler::new(len))
        };
        Self::build(dataset, sampler, config)
    }

    /// A loader with an explicit sampler (for example a distributed one). `config.shuffle`
    /// must be false: the sampler decides the order.
    pub fn with_sampler(
        dataset: Arc<dyn Dataset>,
        sampler: Arc<dyn Sampler>,
        config: DataLoaderConfig,
    ) -> Result<Self> {
        if config.shuffle {
            return Err(Error::config(
                "DataLoader",
                "`shuffle` cannot be combined with an explicit sampler; the sampler decides the \
                 order",
            ));
        }
        Self::build(dataset, sampler, config)
    }

    fn build(
        dataset: Arc<dyn Dataset>,
        sampler: Arc<dyn Sampler>,
        config: DataLoaderConfig,
    ) -> Result<Self> {
        if config.batch_size == 0 || config.prefetch == 0 {
            return Err(Error::config(
                "DataLoader",
                format!(
                    "batch_size and prefetch must be > 0, got {} and {}",
                    config.batch_size, config.prefetch
                ),
            ));
        }
        Ok(DataLoader {
            dataset,
            sampler,
            config,
            next_epoch: AtomicU64::new(0),
        })
    }

    /// Number of batches in one epoch.
    pub fn len(&self) -> usize {
        let (n, b) = (self.sampler.len(), self.config.batch_size);
        if self.config.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The configuration.
    pub fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// The sampler.
    pub fn sampler(&self) -> &Arc<dyn Sampler> {
        &self.sampler
    }

    /// The batches of the next epoch: the first call gives epoch 0, the next epoch 1, and so
    /// on, so a shuffling loader reshuffles on every pass (use [`DataLoader::epoch`] to choose).
    pub fn iter(&self) -> Batches {
        self.epoch(self.next_epoch.fetch_add(1, Ordering::Relaxed))
    }

    /// The batches of epoch `epoch`. The following [`DataLoader::iter`] continues with
    /// `epoch + 1`.
    pub fn epoch(&self, epoch: u64) -> Batches {
        self.epoch_from(epoch, 0)
    }

    /// The batches of epoch `epoch` from batch `first` on (the first `first` batches are
    /// skipped without being built): for resuming an epoch that a checkpoint interrupted.
    /// The batches are exactly those [`DataLoader::epoch`] yields after its first `first`.
    pub fn epoch_from(&self, epoch: u64, first: usize) -> Batches {
        self.next_epoch.store(epoch + 1, Ordering::Relaxed);
        let batches = self.len().saturating_sub(first);
        let failed = |e: Error| Batches {
            receiver: None,
            worker: None,
            remaining: 0,
            failure: Some(e),
            compute: None,
            waited: Duration::ZERO,
            memory_format: MemoryFormat::Contiguous,
        };
        let device = self.config.device;
        // On a CUDA device: a copy stream for the worker, the compute stream for the caller.
        let streams = match device {
            Device::Cpu => None,
            Device::Cuda(_) => {
                let streams = Stream::new_on(device, "tandem-dataloader-copy")
                    .and_then(|copy| Ok((copy, Stream::compute(device)?)));
                match streams {
                    Ok(s) => Some(s),
                    Err(e) => return failed(e.into()),
                }
            }
        };
        let (copy, compute) = streams.unzip();
        let (tx, rx) = sync_channel::<Result<Loaded>>(self.config.prefetch);
        let (dataset, sampler) = (self.dataset.clone(), self.sampler.clone());
        let (batch_size, drop_last) = (self.config.batch_size, self.config.drop_last);
        let memory_format = self.config.memory_format;
        let spawned = std::thread::Builder::new()
            .name(format!("tandem-dataloader-epoch-{epoch}"))
            .spawn(move || {
                let indices = sampler.indices(epoch);
                for chunk in indices.chunks(batch_size).skip(first) {
                    if drop_last && chunk.len() < batch_size {
                        break;
                    }
                    let loaded = dataset
                        .get_batch(chunk)
                        // A CPU copy is uploaded row-major, so a device batch is laid out on
                        // the device (in `next`): converting here too would be thrown away.
                        .and_then(|batch| match device {
                            Device::Cpu => in_format(batch, memory_format),
                            Device::Cuda(_) => Ok(batch),
                        })
                        .and_then(|batch| deliver(batch, device, copy.as_ref()));
                    let failed = loaded.is_err();
                    // A send fails when the caller dropped the iterator: stop quietly.
                    if tx.send(loaded).is_err() || failed {
                        return;
                    }
                }
            });
        match spawned {
            Ok(handle) => Batches {
                receiver: Some(rx),
                worker: Some(handle),
                remaining: batches,
                failure: None,
                compute,
                waited: Duration::ZERO,
                memory_format,
            },
            Err(e) => failed(Error::data(
                "DataLoader",
                format!("could not start the loader thread: {e}"),
            )),
        }
    }
}

/// A batch on its way to the caller, with the event its device copy completes at.
struct Loaded {
    batch: Batch,
    ready: Option<Event>,
}

/// The batch with its inputs in `format` (a copy on the loader thread when they are not).
fn in_format(batch: Batch, format: MemoryFormat) -> Result<Batch> {
    if format == MemoryFormat::Contiguous {
        return Ok(batch);
    }
    Ok(Batch {
        inputs: batch.inputs.contiguous_in(format)?,
        targets: batch.targets,
    })
}

/// Copies a CPU batch to `device` on the `copy` stream (nothing to do for the CPU).
///
/// Each copy's memory remembers the event right after that copy: when the caller drops the
/// batch, it is freed on the compute stream after the caller's uses and after that event only,
/// so a dropped batch never makes the compute stream wait for the copies of the batches
/// prefetched behind it (`Tensor::to_device_on`).
fn deliver(batch: Batch, device: Device, copy: Option<&Stream>) -> Result<Loaded> {
    let Some(copy) = copy else {
        return Ok(Loaded { batch, ready: None });
    };
    let (inputs, _) = batch.inputs.to_device_on(device, copy)?;
    // The targets are copied after the inputs on the same stream: their event covers both.
    let (targets, ready) = batch.targets.to_device_on(device, copy)?;
    Ok(Loaded {
        batch: Batch { inputs, targets },
        ready: Some(ready),
    })
}

impl IntoIterator for &DataLoader {
    type Item = Result<Batch>;
    type IntoIter = Batches;

    fn into_iter(self) -> Batches {
        self.iter()
    }
}

/// The batches of one epoch, in order. Stops after the first error.
pub struct Batches {
    receiver: Option<Receiver<Result<Loaded>>>,
    worker: Option<JoinHandle<()>>,
    remaining: usize,
    failure: Option<Error>,
    /// The device's compute stream, made to wait for each batch's copy.
    compute: Option<Stream>,
    /// Time `next` spent waiting for the loader thread.
    waited: Duration,
    /// The inputs' memory format (see [`DataLoaderConfig::memory_format`]).
    memory_format: MemoryFormat,
}

impl Batches {
    /// How long the caller has waited for batches so far in this epoch: the time
    /// [`next`](Iterator::next) spent blocked until the loader thread had the next batch ready.
    /// Near zero when loading keeps up with training; when it grows with every batch, the
    /// input pipeline is the bottleneck (add decoding workers or prefetch).
    pub fn wait_time(&self) -> Duration {
        self.waited
    }
}

impl Iterator for Batches {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if let Some(e) = self.failure.take() {
            return Some(Err(e));
        }
        let receiver = self.receiver.as_ref()?;
        let started = Instant::now();
        let received = receiver.recv();
        self.waited += started.elapsed();
        match received {
            Ok(loaded) => {
                self.remaining = self.remaining.saturating_sub(1);
                let batch = loaded.and_then(|Loaded { batch, ready }| {
                    if let (Some(compute), Some(ready)) = (&self.compute, ready) {
                        compute.wait_event(&ready)?;
                    }
                    // A device batch arrives row-major: re-lay it on the compute stream.
                    match batch.inputs.device() {
                        Device::Cuda(_) => in_format(batch, self.memory_format),
                        Device::Cpu => Ok(batch),
                    }
                });
                if batch.is_err() {
                    self.receiver = None;
                }
                Some(batch)
            }
            Err(_) => {
                // The worker is gone. That is the normal end, unless it panicked.
                self.receiver = None;
                let panicked = self.worker.take().map(|h| h.join().is_err()) == Some(true);
                panicked.then(|| {
                    Err(Error::data(
                        "DataLoader",
                        "the loader thread panicked while building a batch",
                    ))
                })
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining + self.failure.is_some() as usize))
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        // Closing the channel first makes a worker blocked on a full channel return.
        self.receiver = None;
        if let Some(handle) = self.worker.take() {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TensorDataset;
    use tandem_core::{Device, Tensor};

    fn numbers(n: usize) -> Arc<dyn Dataset> {
        let x = Tensor::from_vec((0..n).map(|v| v as f32).collect(), &[n, 1], Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..n as i64).collect(), &[n], Device::Cpu).unwrap();
        Arc::new(TensorDataset::new(x, y).unwrap())
    }

    fn targets(loader: &DataLoader, epoch: u64) -> Vec<Vec<i64>> {
        loader
            .epoch(epoch)
            .map(|b| b.unwrap().targets.to_vec::<i64>().unwrap())
            .collect()
    }

    #[test]
    fn an_epoch_resumed_at_batch_k_yields_the_rest_of_that_epoch() {
        let cfg = DataLoaderConfig {
            batch_size: 3,
            shuffle: true,
            seed: 4,
            ..Default::default()
        };
        let loader = DataLoader::new(numbers(11), cfg).unwrap();
        let whole = targets(&loader, 2);
        for k in 0..=whole.len() + 1 {
            let rest: Vec<Vec<i64>> = loader
                .epoch_from(2, k)
                .map(|b| b.unwrap().targets.to_vec::<i64>().unwrap())
                .collect();
            assert_eq!(rest, whole[k.min(whole.len())..], "from batch {k}");
        }
    }

    #[test]
    fn sequential_loader_yields_batches_in_order_with_a_partial_last_one() {
        let cfg = DataLoaderConfig {
            batch_size: 4,
            ..Default::default()
        };
        let loader = DataLoader::new(numbers(10), cfg).unwrap();
        assert_eq!(loader.len(), 3);
        assert_eq!(
            targets(&loader, 0),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
        );
        let loader = DataLoader::new(
            numbers(10),
            DataLoaderConfig {
                drop_last: true,
                ..cfg
            },
        )
        .unwrap();
        assert_eq!(loader.len(), 2);
        assert_eq!(targets(&loader, 0).len(), 2);
    }

    #[test]
    fn channels_last_loader_gives_nhwc_batches_with_the_same_values() {
        let images: Vec<f32> = (0..6 * 2 * 3 * 3).map(|v| v as f32).collect();
        let inputs = Tensor::from_vec(images, &[6, 2, 3, 3], Device::Cpu).unwrap();
        let targets = Tensor::from_vec((0..6i64).collect(), &[6], Device::Cpu).unwrap();
        let dataset: Arc<dyn Dataset> =
            Arc::new(crate::data::TensorDataset::new(inputs, targets).unwrap());
        let cfg = DataLoaderConfig {
            batch_size: 4,
            ..Default::default()
        };
        let row = DataLoader::new(dataset.clone(), cfg).unwrap();
        let cl = DataLoaderConfig {
            memory_format: MemoryFormat::ChannelsLast,
            ..cfg
        };
        let nhwc = DataLoader::new(dataset, cl).unwrap();
        for (a, b) in row.iter().zip(nhwc.iter()) {
            let (a, b) = (a.unwrap(), b.unwrap());
            assert_eq!(a.inputs.memory_format(), MemoryFormat::Contiguous);
            assert_eq!(b.inputs.memory_format(), MemoryFormat::ChannelsLast);
            assert_eq!(
                a.inputs.to_vec::<f32>().unwrap(),
                b.inputs.to_vec::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn shuffled_loader_covers_every_sample_and_reshuffles_per_epoch() {
        let cfg = DataLoaderConfig {
            batch_size: 8,
            shuffle: true,
            seed: 3,
            ..Default::default()
        };
        let loader = DataLoader::new(numbers(50), cfg).unwrap();
        let first: Vec<i64> = loader
            .iter()
            .flat_map(|b| b.unwrap().targets.to_vec::<i64>().unwrap())
            .collect();
        let second: Vec<i64> = loader
            .iter()
            .flat_map(|b| b.unwrap().targets.to_vec::<i64>().unwrap())
            .collect();
        let mut sorted = first.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(first, second);
        assert_eq!(targets(&loader, 1).concat(), second);
    }

    struct EveryOther(usize);

    impl Sampler for EveryOther {
        fn len(&self) -> usize {
            self.0.div_ceil(2)
        }
        fn indices(&self, _epoch: u64) -> Vec<usize> {
            (0..self.0).step_by(2).collect()
        }
    }

    #[test]
    fn custom_sampler_decides_the_samples() {
        let cfg = DataLoaderConfig {
            batch_size: 2,
            ..Default::default()
        };
        let loader = DataLoader::with_sampler(numbers(7), Arc::new(EveryOther(7)), cfg).unwrap();
        assert_eq!(loader.len(), 2);
        assert_eq!(targets(&loader, 0), vec![vec![0, 2], vec![4, 6]]);
        let shuffled = DataLoaderConfig {
            shuffle: true,
            ..cfg
        };
        assert!(DataLoader::with_sampler(numbers(7), Arc::new(EveryOther(7)), shuffled).is_err());
    }

    #[test]
    fn dataset_errors_reach_the_caller_and_end_the_epoch() {
        let cfg = DataLoaderConfig {
            batch_size: 2,
            ..Default::default()
        };
        // The sampler asks for more samples than the dataset has.
        let loader =
            DataLoader::with_sampler(numbers(3), Arc::new(SequentialSampler::new(6)), cfg).unwrap();
        let results: Vec<Result<Batch>> = loader.iter().collect();
        assert_eq!(results.len(), 2);
        assert!(results[0].is_ok());
        let err = results[1].as_ref().unwrap_err().to_string();
        assert!(err.contains("index 3"), "{err}");
    }

    /// A dataset that takes a while per batch, so the caller has to wait for it.
    struct Slow(Arc<dyn Dataset>);

    impl Dataset for Slow {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
            std::thread::sleep(Duration::from_millis(5));
            self.0.get_batch(indices)
        }
    }

    #[test]
    fn wait_time_adds_up_the_time_spent_waiting_for_batches() {
        let cfg = DataLoaderConfig {
            batch_size: 2,
            ..Default::default()
        };
        let loader = DataLoader::new(Arc::new(Slow(numbers(6))), cfg).unwrap();
        let mut batches = loader.iter();
        assert_eq!(batches.wait_time(), Duration::ZERO);
        let mut last = Duration::ZERO;
        for _ in 0..3 {
            batches.next().unwrap().unwrap();
            assert!(batches.wait_time() >= last);
            last = batches.wait_time();
        }
        assert!(batches.next().is_none());
        assert!(
            last > Duration::ZERO,
            "waited {last:?} for batches 5 ms each"
        );
    }

    #[test]
    fn dropping_the_iterator_early_stops_the_worker() {
        let cfg = DataLoaderConfig {
            batch_size: 1,
            prefetch: 1,
            ..Default::default()
        };
        let loader = DataLoader::new(numbers(100), cfg).unwrap();
        let mut it = loader.iter();
        assert!(it.next().unwrap().is_ok());
        drop(it); // joins the worker; the test would hang if it did not stop
    }

    #[test]
    fn zero_batch_size_is_rejected() {
        let cfg = DataLoaderConfig {
            batch_size: 0,
            ..Default::default()
        };
        assert!(DataLoader::new(numbers(3), cfg).is_err());
    }
}
