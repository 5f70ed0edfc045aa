//! How the examples split the training set over the ranks, and what an uneven split needs.
//!
//! When the world size divides the training set, every rank gets the same number of samples
//! (a `DistributedSampler`, as PyTorch's). When it does not, PyTorch pads the epoch by repeating
//! samples; the examples instead give every rank its exact share (a
//! `DistributedUnpaddedSampler`: each sample of the epoch on exactly one rank, the ranks' counts
//! differing by one) and run each epoch inside `ddp.join`, so the ranks with one batch fewer
//! finish without hanging the others. `--no-join` restores the padded split.
//!
//! What the uneven split changes for the rest of the training loop:
//! - *Steps per epoch* (for checkpoints, learning-rate schedules and the progress bar) are the
//!   longest rank's ([`TrainLoader::len`]), the same on every rank; a rank with fewer batches
//!   counts the steps it shadowed, so every rank's global step agrees after each epoch.
//! - *Mid-epoch checkpoints* gather every rank's random-number state, a collective that `join`
//!   does not shadow: they are written only in the part of the epoch every rank trains in
//!   (before [`TrainSplit::common_steps`]), where every rank is at the same step; the end of
//!   the epoch has its own checkpoint. Resuming one restarts every rank at that step of its own
//!   shard.
//! - *Optimizer state*: a rank that shadows the last step(s) does not run its optimizer, so its
//!   momentum would miss that step; after each joined epoch every rank takes rank 0's state
//!   (rank 0 always has the most samples) by [`sync_optimizer_state`].

use std::sync::Arc;

use tandem::core::MemoryFormat;
use tandem::core::{DType, Device, Tensor};
use tandem::dist::{DistributedSampler, DistributedUnpaddedSampler, ProcessGroup};
use tandem::nn::data::{DataLoader, DataLoaderConfig, Dataset};
use tandem::optim::Optimizer;

use super::output::say;
use super::{rank_and_world, AnyError, RunArgs, Trainer};

/// The training set's split over the ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainSplit {
    /// Whether each rank has its exact share and trains each epoch inside `ddp.join`.
    pub join: bool,
    /// Every rank's samples per epoch (with padding, when padded).
    pub counts: Vec<usize>,
    /// Samples per batch on each rank.
    pub batch: usize,
    /// Steps per epoch: the longest rank's batch count (the same number on every rank).
    pub steps: usize,
    /// Steps every rank trains in (the shortest rank's batch count); equal to `steps` unless
    /// the ranks' batch counts differ.
    pub common_steps: usize,
}

impl TrainSplit {
    /// The split of `dataset_len` samples over `world` ranks in batches of `batch` per rank:
    /// exact shares inside join when `world` does not divide `dataset_len` and `no_join` is
    /// not set, otherwise equal (padded) shares.
    pub fn new(dataset_len: usize, world: usize, batch: usize, no_join: bool) -> Self {
        let join = world > 1 && !no_join && !dataset_len.is_multiple_of(world);
        let counts: Vec<usize> = (0..world)
            .map(|r| {
                if join {
                    DistributedUnpaddedSampler::shard_len(dataset_len, world, r)
                } else {
                    dataset_len.div_ceil(world)
                }
            })
            .collect();
        let batches = |n: usize| n.div_ceil(batch.max(1));
        TrainSplit {
            join,
            steps: counts.iter().map(|&n| batches(n)).max().unwrap_or(0),
            common_steps: counts.iter().map(|&n| batches(n)).min().unwrap_or(0),
            counts,
            batch,
        }
    }

    /// Rank 0's line about the split: the mode and the per-rank counts.
    fn describe(&self, dataset_len: usize) -> String {
        let world = self.counts.len();
        if self.join {
            format!(
                "training data: {dataset_len} samples do not divide over {world} ranks: each \
                 rank its exact share, samples per rank {:?}, epochs inside join \
                 (--no-join pads them)",
                self.counts
            )
        } else if dataset_len.is_multiple_of(world) {
            format!(
                "training data: {dataset_len} samples over {world} ranks, {} per rank",
                self.counts[0]
            )
        } else {
            format!(
                "training data: {dataset_len} samples over {world} ranks, padded to {} per rank \
                 by repeating {} (--no-join)",
                self.counts[0],
                self.counts[0] * world - dataset_len
            )
        }
    }
}

/// The training loader with the split it was built for.
pub struct TrainLoader {
    /// This rank's loader.
    pub loader: DataLoader,
    /// How the set is split over the ranks (one rank alone: everything, no join).
    pub split: TrainSplit,
}

impl TrainLoader {
    /// Steps per epoch, the same on every rank: the longest rank's batch count.
    pub fn len(&self) -> usize {
        self.split.steps
    }
}

/// The training loader for the global batch `batch_size`: alone, the whole set reshuffled
/// every epoch from `run.seed`; in a group, each rank its own disjoint shard (reshuffled every
/// epoch from the shared seed) in batches of `batch_size / world`: a `DistributedSampler` when
/// the world size divides the set or with `run.no_join`, otherwise a
/// `DistributedUnpaddedSampler` (train it with [`super::train_epoch`], which then joins).
/// Rank 0 prints the split.
pub fn train_loader(
    set: Arc<dyn Dataset>,
    group: Option<&Arc<dyn ProcessGroup>>,
    batch_size: usize,
    run: &RunArgs,
    device: Device,
) -> Result<TrainLoader, AnyError> {
    let (rank, world) = rank_and_world(group);
    let (len, seed) = (set.len(), run.seed);
    let config = DataLoaderConfig {
        device,
        batch_size: batch_size / world,
        memory_format: if run.channels_last {
            MemoryFormat::ChannelsLast
        } else {
            MemoryFormat::Contiguous
        },
        ..Default::default()
    };
    let split = TrainSplit::new(len, world, config.batch_size, run.no_join);
    let loader = match group {
        Some(_) if split.join => {
            let sampler = DistributedUnpaddedSampler::new(len, world, rank, true, seed)?;
            DataLoader::with_sampler(set, Arc::new(sampler), config)?
        }
        Some(_) => {
            let sampler = DistributedSampler::new(len, world, rank, true, seed)?;
            DataLoader::with_sampler(set, Arc::new(sampler), config)?
        }
        None => DataLoader::new(
            set,
            DataLoaderConfig {
                shuffle: true,
                seed,
                ..config
            },
        )?,
    };
    if group.is_some() && rank == 0 {
        say(format_args!("{}", split.describe(len)));
    }
    Ok(TrainLoader { loader, split })
}

/// Every rank takes rank 0's optimizer state (momentum buffers, step count) and gradient
/// scaler state, after an epoch in which some ranks shadowed steps without running their
/// optimizer. Rank 0 trains every step (it has the most samples), so its state is the one of
/// an uninterrupted run. Every rank must call it.
pub fn sync_optimizer_state(
    trainer: &Trainer,
    optimizer: &mut dyn Optimizer,
) -> Result<(), AnyError> {
    let Some(ddp) = &trainer.ddp else {
        return Ok(());
    };
    let group = ddp.group().as_ref();
    // Collectives take tensors on the group's device (NCCL: this rank's GPU).
    let device = trainer.model.device();
    let synced = broadcast_state(group, device, optimizer.state())?;
    if group.rank() != 0 {
        optimizer.load_state(&synced)?;
    }
    // The gradient scaler (`--amp f16`) too: the shadowing ranks did not update their scale
    // for that step, and every rank must scale its loss alike.
    let mut scaler = trainer.scaler.borrow_mut();
    if let Some(scaler) = scaler.as_mut() {
        let synced = broadcast_state(group, device, scaler.state())?;
        if group.rank() != 0 {
            scaler.load_state(&synced)?;
        }
    }
    Ok(())
}

/// Rank 0's named state tensors on every rank (on `device`, the group's): rank 0's names,
/// shapes and dtypes first, since a rank that never stepped may have no state yet.
fn broadcast_state(
    group: &dyn ProcessGroup,
    device: Device,
    state: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, AnyError> {
    let header = if group.rank() == 0 {
        let described: Vec<(String, Vec<usize>, String)> = state
            .iter()
            .map(|(name, t)| (name.clone(), t.dims().to_vec(), format!("{:?}", t.dtype())))
            .collect();
        serde_json::to_vec(&described)?
    } else {
        Vec::new()
    };
    let header = broadcast_bytes(group, device, header)?;
    let described: Vec<(String, Vec<usize>, String)> = serde_json::from_slice(&header)?;
    let mut synced = Vec::with_capacity(described.len());
    for (name, dims, dtype) in described {
        let tensor = match state.iter().find(|(n, _)| *n == name) {
            Some((_, t)) if group.rank() == 0 => t.to_device(device)?,
            _ => Tensor::zeros(&dims, dtype_named(&dtype)?, device)?,
        };
        group.broadcast(&tensor, 0)?.wait()?;
        synced.push((name, tensor));
    }
    Ok(synced)
}

/// Broadcasts `bytes` (significant on rank 0) to every rank, through tensors on `device` (the
/// group's): the length, then the bytes.
fn broadcast_bytes(
    group: &dyn ProcessGroup,
    device: Device,
    bytes: Vec<u8>,
) -> Result<Vec<u8>, AnyError> {
    let len = Tensor::from_vec(vec![bytes.len() as f64], &[1], Device::Cpu)?.to_device(device)?;
    group.broadcast(&len, 0)?.wait()?;
    let len = len.to_vec::<f64>()?[0] as usize;
    let data = if group.rank() == 0 {
        Tensor::from_vec(bytes, &[len], Device::Cpu)?.to_device(device)?
    } else {
        Tensor::zeros(&[len], DType::U8, device)?
    };
    group.broadcast(&data, 0)?.wait()?;
    Ok(data.to_vec::<u8>()?)
}

/// The dtype whose `Debug` text is `name`.
fn dtype_named(name: &str) -> Result<DType, AnyError> {
    [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::U8,
    ]
    .into_iter()
    .find(|d| format!("{d:?}") == name)
    .ok_or_else(|| format!("optimizer state of an unknown dtype {name}").into())
}

/// Every rank's count of training samples this epoch (in rank order; `[mine]` alone). Every
/// rank must call it.
pub fn gather_sample_counts(trainer: &Trainer, mine: usize) -> Result<Vec<u64>, AnyError> {
    let Some(ddp) = &trainer.ddp else {
        return Ok(vec![mine as u64]);
    };
    let group = ddp.group().as_ref();
    // On the group's device (NCCL: this rank's GPU).
    let device = trainer.model.device();
    let input = Tensor::from_vec(vec![mine as f64], &[1], Device::Cpu)?.to_device(device)?;
    let output = Tensor::zeros(&[group.world_size()], DType::F64, device)?;
    group.all_gather(&input, &output)?.wait()?;
    Ok(output
        .to_vec::<f64>()?
        .into_iter()
        .map(|n| n as u64)
        .collect())
}
