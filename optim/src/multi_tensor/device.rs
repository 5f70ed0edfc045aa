//! Running multi-tensor kernels on a CUDA device: tensors' element addresses, tables uploaded
//! once and reused while the same addresses come back, launches on the compute stream, and
//! counters of what a thread issued (for tests that bound the launches of a step).
//!
//! A table is keyed by its content (device, dtype, chunk size and every word), not by the
//! tensors that produced it: a table whose words equal the current ones points at exactly the
//! current tensors, whatever happened in between. In a steady training loop the parameters,
//! their states and (with `zero_grad` keeping gradients in place) the gradients stay where they
//! are, so after the first step every step finds its table and uploads nothing.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};

use tandem_core::cuda::device::CudaDevice;
use tandem_core::cuda::launch::Launch;
use tandem_core::cuda::sanitizer::{self, Use};
use tandem_core::{Device, Error as TensorError, Tensor};

use super::cache::{TableCache, TableLease};
use super::table::TensorTable;
use crate::Result;

/// What the calling thread has issued through optim's multi-tensor path since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// Kernel launches (optim's kernels and the runtime's `norm_finish` that clipping uses).
    pub kernels: u64,
    /// Tables copied to a device (a step whose tables were cached copies none).
    pub table_uploads: u64,
    /// Values read back to the host (clipping reads its norm once).
    pub host_reads: u64,
}

thread_local! {
    static COUNTS: Cell<LaunchCounts> = const { Cell::new(LaunchCounts { kernels: 0, table_uploads: 0, host_reads: 0 }) };
}

fn count(update: impl FnOnce(&mut LaunchCounts)) {
    COUNTS.with(|c| {
        let mut counts = c.get();
        update(&mut counts);
        c.set(counts);
    });
}

/// The counts of the calling thread (subtract two readings to count one step).
pub fn launch_counts() -> LaunchCounts {
    COUNTS.with(Cell::get)
}

/// Notes a value read back to the host.
pub(crate) fn count_host_read() {
    count(|c| c.host_reads += 1);
}

/// What a multi-tensor kernel does with each role of its table's entries (`None`: unused).
/// The table reaches the tensors through addresses the launch's arguments do not show, so the
/// stream sanitizer learns of these accesses from here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Roles {
    pub param: Option<Use>,
    pub grad: Option<Use>,
    pub state: Option<Use>,
}

impl Roles {
    /// An optimizer update: the parameter and its state written, the gradient read.
    pub const UPDATE: Roles = Roles {
        param: Some(Use::Write),
        grad: Some(Use::Read),
        state: Some(Use::Write),
    };
}

/// [`run`] for a kernel walking `table`, declaring to the stream sanitizer the tensors the
/// table points at (by `roles`) before the launch is issued.
pub(crate) fn run_on_table(
    dev: &CudaDevice,
    launch: &Launch,
    table: &TensorTable,
    roles: Roles,
) -> Result<()> {
    if sanitizer::enabled() {
        let per_entry = [
            roles.param,
            roles.grad,
            roles.state,
            roles.state,
            roles.state,
        ];
        let uses: Vec<(u64, Use)> = table
            .entry_addresses()
            .flat_map(|addresses| addresses.into_iter().zip(per_entry))
            .filter_map(|(address, role)| Some((address, role?)).filter(|(a, _)| *a != 0))
            .collect();
        sanitizer::access(dev.device(), dev.compute_stream(), &launch.kernel, &uses)?;
    }
    run(dev, launch)
}

/// Runs `launch` on `dev`'s compute stream, in order with every op.
pub(crate) fn run(dev: &CudaDevice, launch: &Launch) -> Result<()> {
    dev.launch(launch, dev.compute_stream())?;
    count(|c| c.kernels += 1);
    Ok(())
}

/// The device and the address of element 0 of a dense CUDA tensor.
pub(crate) fn element_address(
    op: &'static str,
    t: &Tensor,
) -> Result<(std::sync::Arc<CudaDevice>, u64)> {
    if !t.is_contiguous() {
        return Err(TensorError::invalid(
            op,
            format!(
                "multi-tensor kernels take dense tensors; got shape {:?} with strides {:?}",
                t.dims(),
                t.layout().strides().as_slice()
            ),
        )
        .into());
    }
    let (dev, base) = tandem_core::cuda::device_pointer(op, t)?;
    let offset = (t.layout().offset() as u64)
        .checked_mul(t.dtype().size_in_bytes() as u64)
        .and_then(|bytes| base.checked_add(bytes))
        .ok_or_else(|| TensorError::invalid(op, "tensor address overflows"))?;
    Ok((dev, offset))
}

impl TableCache<Tensor> {
    /// A lease on `table` on `cuda:ordinal` (see [`TableCache::lease_with`]): the cached copy
    /// when one with the same words exists, otherwise a new upload after `validate` accepts the
    /// table. The upload is ordered on the compute stream before any later kernel. Keep the
    /// lease until the launch that reads the table is queued.
    pub(crate) fn lease(
        &mut self,
        ordinal: usize,
        table: &TensorTable,
        validate: impl FnOnce(&TensorTable) -> Result<()>,
    ) -> Result<TableLease<Tensor>> {
        self.lease_with(ordinal, table, validate, |table| {
            let words: Vec<i64> = table.words().iter().map(|&w| w as i64).collect();
            let len = words.len();
            let uploaded = Tensor::from_vec(words, &[len], Device::Cuda(ordinal))?;
            let (_, address) = element_address("multi-tensor table", &uploaded)?;
            count(|c| c.table_uploads += 1);
            Ok((uploaded, address))
        })
    }
}

/// Tables of the functions without an owner to keep them (`clip_grad_norm`, the default
/// `zero_grad`), shared by every thread. Large enough for several models or ranks per process.
static SHARED: Mutex<TableCache<Tensor>> = Mutex::new(TableCache::new(32));

/// The shared cache, locked. Take a lease and let the guard go before launching: the lease, not
/// the lock, keeps the table alive until the launch is queued.
pub(crate) fn shared_cache() -> MutexGuard<'static, TableCache<Tensor>> {
    // A panic while holding the lock leaves the cache consistent (entries are whole).
    SHARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
