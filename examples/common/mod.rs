//! What the training examples share: joining or launching the ranks of a data-parallel job,
//! the forward that goes through DDP when there is one, and evaluation.

use std::sync::Arc;

use tandem::autograd::no_grad;
use tandem::core::Tensor;
use tandem::dist::launch::{launch, LaunchOptions};
use tandem::dist::{
    init_process_group, DistributedDataParallel, GroupConfig, LaunchEnv, ProcessGroup,
};
use tandem::nn::data::DataLoader;
use tandem::nn::Module;

/// Errors of the examples' `run`.
pub type AnyError = Box<dyn std::error::Error>;

/// What one epoch produced.
pub struct EpochResult {
    pub train_loss: f64,
    pub test_accuracy: f64,
    pub images_per_sec: f64,
    pub seconds: f64,
}

/// Whether the environment describes a process group this process should join (as
/// `tandem-run`, torchrun, SLURM's srun or mpirun set it).
fn group_in_environment() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some();
    (set("RANK") && set("WORLD_SIZE"))
        || (set("SLURM_PROCID") && set("SLURM_NTASKS"))
        || set("OMPI_COMM_WORLD_RANK")
}

/// What this process does in the job.
pub enum Role {
    /// It started the ranks, which have all finished: nothing left to do.
    Launched,
    /// It trains, alone (`None`) or as one rank of a group.
    Train(Option<Arc<dyn ProcessGroup>>),
}

/// Joins the group the environment describes; otherwise, with `nproc_per_node > 1`, starts
/// that many ranks of this same program (each then joins) and waits for them; otherwise trains
/// alone. Sizes rayon's pool: `threads`, or the cores shared among the local ranks.
pub fn join_or_launch(nproc_per_node: usize, threads: Option<usize>) -> Result<Role, AnyError> {
    let joining = group_in_environment();
    if nproc_per_node > 1 && !joining {
        let program = std::env::current_exe()?;
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        let report = launch(&LaunchOptions::new(nproc_per_node, program, args))?;
        if let Some(failed) = report.failed {
            return Err(format!("rank {} failed: {}", failed.rank, failed.describe()).into());
        }
        return Ok(Role::Launched);
    }
    if !joining {
        if let Some(threads) = threads {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build_global()?;
        }
        return Ok(Role::Train(None));
    }
    let env = LaunchEnv::from_process_env()?;
    let threads = threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / env.local_world_size.max(1)).max(1)
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()?;
    Ok(Role::Train(Some(Arc::new(init_process_group(
        &env,
        GroupConfig::default(),
    )?))))
}

/// The model as the training step sees it: through DDP when training data-parallel.
pub struct Trainer {
    pub model: Arc<dyn Module>,
    pub ddp: Option<DistributedDataParallel>,
}

impl Trainer {
    /// The step's forward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, AnyError> {
        Ok(match &self.ddp {
            Some(ddp) => ddp.forward(x)?,
            None => self.model.forward(x)?,
        })
    }

    /// This process's rank (0 when alone).
    pub fn rank(&self) -> usize {
        self.ddp.as_ref().map_or(0, |d| d.group().rank())
    }

    /// Number of ranks (1 when alone).
    pub fn world_size(&self) -> usize {
        self.ddp.as_ref().map_or(1, |d| d.group().world_size())
    }
}

/// Fraction of the test set classified correctly.
pub fn evaluate(model: &dyn Module, test: &DataLoader) -> Result<f64, AnyError> {
    model.eval();
    let (mut correct, mut total) = (0usize, 0usize);
    for batch in test.epoch(0) {
        let batch = batch?;
        let predicted = no_grad(|| -> Result<Vec<i64>, AnyError> {
            let logits = model.forward(&batch.inputs)?;
            Ok(tandem::ops::argmax(&logits, 1, false)?.to_vec::<i64>()?)
        })?;
        let labels = batch.targets.to_vec::<i64>()?;
        correct += predicted
            .iter()
            .zip(&labels)
            .filter(|(p, l)| p == l)
            .count();
        total += labels.len();
    }
    Ok(correct as f64 / total.max(1) as f64)
}
