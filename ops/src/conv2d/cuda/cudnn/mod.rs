//! conv2d through cuDNN's legacy convolution API: one handle per device and thread, bound to the
//! device's compute stream, and a cache of plans — descriptors plus the algorithm chosen for
//! each pass — keyed by geometry, dtype, TF32 setting, search and the alignment of the buffers
//! (`choice.rs`, which also says what runs when cuDNN refuses a chosen algorithm).
//!
//! **Handles.** A cuDNN handle must not be used by two threads at once (cudarc's `Cudnn` is not
//! `Send` for that reason), so each thread keeps its own per device, in a thread-local, together
//! with its plan cache. Creating a handle is slow (it loads cuDNN's sub-libraries) and a
//! destroyed one cannot be revived, so when a thread ends its handles and plans go to a
//! process-wide pool instead of being destroyed, and the next thread that needs a handle for
//! that device takes one from there (PyTorch keeps its cuDNN handles in the same way). A handle
//! thus moves between threads only whole, between two uses, never shared. Handles are never
//! destroyed: destroying them while the process exits can crash in cuDNN's own teardown.
//!
//! **Plans.** The first call with a geometry creates its descriptors; the first call of each
//! pass chooses its algorithm (`passes.rs`). Every later call looks the plan up and runs: no
//! descriptor is created, no algorithm searched. [`cudnn_cache_stats`] shows this from outside.
//!
//! **Loading.** Before the first cuDNN call tandem checks, once per process, that
//! `libcudnn.so.9` loads ([`libs::ensure`]; cudarc would panic otherwise) and is cuDNN 9 (the
//! bindings are for 9.1's ABI). When it is missing, or no handle can be created, conv2d runs
//! through im2col + cuBLAS and a one-line notice says why.

mod choice;
mod descriptors;
mod passes;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cudnn::{result as cudnn, sys};
use tandem_core::cuda::libs::{self, CudaLibrary};
use tandem_core::cuda::CudaDevice;
use tandem_core::{DType, Device, Error, Result};

use super::{cudnn_algorithm_search, notice_cudnn_unavailable, tf32, Format};
use crate::conv2d::Geometry;
pub(super) use choice::Engine;
use choice::{run_pass as run_choice, Alignments, Event, PlanKey};
use descriptors::{fits, Plan};
use passes::{BackwardData, BackwardFilter, Forward, Operands, Pass};

/// What the calling thread's cuDNN state for one device has done (see
/// [`cudnn_cache_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudnnCacheStats {
    /// Plans (geometry, dtype, TF32 setting, search, buffer alignments) cached now.
    pub plans: usize,
    /// Calls that found their plan in the cache.
    pub plan_hits: u64,
    /// Algorithm choices made (one per plan and pass, on the pass's first call).
    pub searches: u64,
    /// Pass calls that cuDNN declined and im2col + cuBLAS ran instead.
    pub declined_calls: u64,
    /// Runs of a chosen algorithm that cuDNN refused with NOT_SUPPORTED on the buffers at hand
    /// (each followed by a fresh choice, or im2col after the second).
    pub not_supported: u64,
}

/// The cache statistics of the calling thread's cuDNN handle for `device` (None before that
/// thread has run a convolution through cuDNN there). A handle and its plans may have come
/// from a thread that ended, so the counts can include that thread's calls.
pub fn cudnn_cache_stats(device: Device) -> Option<CudnnCacheStats> {
    let Device::Cuda(ordinal) = device else {
        return None;
    };
    STATES
        .try_with(|states| {
            let states = states.borrow();
            states.0.iter().find(|s| s.ordinal == ordinal).map(|s| {
                let mut stats = s.stats;
                stats.plans = s.plans.len();
                stats
            })
        })
        .ok()
        .flatten()
}

/// One cuDNN handle (bound to the compute stream of device `ordinal`) and its plans.
struct State {
    ordinal: usize,
    handle: sys::cudnnHandle_t,
    plans: HashMap<PlanKey, Plan>,
    stats: CudnnCacheStats,
}

/// The states of one thread. On thread exit they go to [`POOL`].
struct ThreadStates(Vec<State>);

impl Drop for ThreadStates {
    fn drop(&mut self) {
        let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
        pool.extend(self.0.drain(..).map(Pooled));
    }
}

/// A state between threads.
struct Pooled(State);

// SAFETY: a pooled state is owned by the pool alone and is used by one thread at a time: it
// leaves a thread only when that thread ends (its thread-local drops) and is taken by exactly
// one other thread. cuDNN allows a handle, and the descriptors made with it, to be used from
// another thread as long as no two threads use it at once, which this ownership ensures.
unsafe impl Send for Pooled {}

static POOL: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());

thread_local! {
    static STATES: RefCell<ThreadStates> = const { RefCell::new(ThreadStates(Vec::new())) };
}

/// Why the cuDNN library cannot be used in this process, once checked (None: it can).
static UNUSABLE: OnceLock<Option<String>> = OnceLock::new();

/// Why no cuDNN handle could be created, once that happened: cuDNN is then given up for the
/// process.
static NO_HANDLE: OnceLock<String> = OnceLock::new();

/// Whether cuDNN loads (checked once per process; prints the notice when it does not).
pub(super) fn loads(dev: &CudaDevice) -> bool {
    if let Some(reason) = NO_HANDLE.get() {
        notice_cudnn_unavailable(reason);
        return false;
    }
    let reason = UNUSABLE.get_or_init(|| {
        if let Err(e) = libs::ensure(CudaLibrary::Cudnn, dev.device()) {
            return Some(e.to_string());
        }
        let version = cudnn::get_version();
        if !(90000..100000).contains(&version) {
            return Some(format!(
                "cuDNN {} was found; tandem's bindings are for cuDNN 9",
                version / 10000
            ));
        }
        None
    });
    match reason {
        None => true,
        Some(reason) => {
            notice_cudnn_unavailable(reason);
            false
        }
    }
}

/// A new handle on `dev`, bound to its compute stream.
fn new_state(dev: &CudaDevice) -> std::result::Result<State, String> {
    dev.bind("conv2d (cuDNN handle)")
        .map_err(|e| e.to_string())?;
    let handle = cudnn::create_handle().map_err(|e| format!("cudnnCreate failed: {:?}", e.0))?;
    // SAFETY: a live handle; the compute stream belongs to this device's context, which is
    // current, and lives as long as the device (for the whole process). cuDNN's stream type is
    // the runtime alias of the driver's.
    if let Err(e) = unsafe { cudnn::set_stream(handle, dev.compute_stream().cu_stream().cast()) } {
        return Err(format!("cudnnSetStream failed: {:?}", e.0));
    }
    Ok(State {
        ordinal: dev.ordinal(),
        handle,
        plans: HashMap::new(),
        stats: CudnnCacheStats::default(),
    })
}

/// Runs `f` with the calling thread's state for `dev`, taking one from the pool or creating it
/// first. `Ok(None)` when no handle can be created (cuDNN is then given up for the process,
/// with the notice).
fn with_state<R>(dev: &CudaDevice, f: impl FnOnce(&mut State) -> Result<R>) -> Result<Option<R>> {
    let ordinal = dev.ordinal();
    let run = |states: &RefCell<ThreadStates>| -> Result<Option<R>> {
        let mut states = states.borrow_mut();
        let index = match states.0.iter().position(|s| s.ordinal == ordinal) {
            Some(i) => i,
            None => {
                let pooled = {
                    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
                    pool.iter()
                        .position(|p| p.0.ordinal == ordinal)
                        .map(|i| pool.swap_remove(i).0)
                };
                let state = match pooled {
                    Some(state) => state,
                    None => match new_state(dev) {
                        Ok(state) => state,
                        Err(reason) => {
                            notice_cudnn_unavailable(NO_HANDLE.get_or_init(|| reason));
                            return Ok(None);
                        }
                    },
                };
                states.0.push(state);
                states.0.len() - 1
            }
        };
        f(&mut states.0[index]).map(Some)
    };
    STATES
        .try_with(run)
        .map_err(|_| Error::invalid("conv2d", "called while the thread is exiting"))?
}

impl State {
    /// Runs pass `P` of `g` on `ops`, creating the plan and choosing the algorithm on first
    /// use, choosing again when cuDNN refuses the choice on these buffers (`choice.rs`).
    /// [`Engine::Im2col`] when cuDNN declines the pass (the caller runs it by im2col).
    fn pass<P: Pass>(
        &mut self,
        dev: &Arc<CudaDevice>,
        g: &Geometry,
        dtype: DType,
        format: Format,
        ops: Operands,
    ) -> Result<Engine> {
        let key = PlanKey {
            geometry: *g,
            dtype,
            format,
            tf32: tf32(dtype),
            search: cudnn_algorithm_search(),
            alignments: Alignments::of(ops.a, ops.b, ops.out),
        };
        let handle = self.handle;
        let plan = match self.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => {
                self.stats.plan_hits += 1;
                e.into_mut()
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                let plan = Plan::new(g, dtype, format).map_err(|e| Error::Cuda {
                    op: "conv2d",
                    device: dev.device(),
                    detail: format!(
                        "cuDNN descriptors for {g:?} ({dtype}, {format:?}): {:?}",
                        e.0
                    ),
                })?;
                e.insert(plan)
            }
        };
        let (descriptors, slot) = P::split(plan);
        let stats = &mut self.stats;
        let engine = run_choice(
            slot,
            |refused| {
                let refused = refused.map(|r| r.algo);
                let chosen = passes::select::<P>(
                    dev,
                    handle,
                    descriptors,
                    dtype,
                    key.tf32,
                    key.search,
                    g,
                    ops,
                    refused,
                )?;
                Ok(chosen
                    .map_err(|why| notice_declined(P::NAME, g, dtype, &why))
                    .ok())
            },
            |chosen| passes::run::<P>(dev, handle, descriptors, chosen, dtype, g, ops),
            |event| match event {
                Event::Chose => stats.searches += 1,
                Event::NotSupported => {
                    stats.not_supported += 1;
                    notice_not_supported(P::NAME, g, dtype, key.alignments);
                }
                Event::Declined => stats.declined_calls += 1,
            },
        )?;
        Ok(engine)
    }
}

/// Prints, once per process, that cuDNN declined a pass (later ones count in
/// [`CudnnCacheStats::declined_calls`] only).
fn notice_declined(pass: &str, g: &Geometry, dtype: DType, why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "tandem: cuDNN declined the conv2d {pass} pass of {g:?} ({dtype}: {why}); it runs \
             through im2col + cuBLAS (later such cases are not reported)"
        )
    });
}

/// Prints, once per process, that cuDNN refused a chosen algorithm on the buffers at hand
/// (later ones count in [`CudnnCacheStats::not_supported`] only).
fn notice_not_supported(pass: &str, g: &Geometry, dtype: DType, alignments: Alignments) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "tandem: cuDNN answered NOT_SUPPORTED for the algorithm chosen for the conv2d {pass} \
             pass of {g:?} ({dtype}, buffers aligned to {alignments:?} bytes); choosing again, \
             then im2col + cuBLAS (later such cases are not reported)"
        )
    });
}

/// Runs pass `P` through cuDNN if it can take `g`; [`Engine::Im2col`] otherwise.
fn run_pass<P: Pass>(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    format: Format,
    ops: Operands,
) -> Result<Engine> {
    if !fits(g) {
        return Ok(Engine::Im2col);
    }
    Ok(
        with_state(dev, |state| state.pass::<P>(dev, g, dtype, format, ops))?
            .unwrap_or(Engine::Im2col),
    )
}

/// `y = conv(x, w)` (dense buffers of `g`'s shapes, all three in memory order `format`).
/// [`Engine::Im2col`] when cuDNN cannot take it and im2col must.
pub(super) fn forward(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    format: Format,
    x: u64,
    w: u64,
    y: u64,
) -> Result<Engine> {
    run_pass::<Forward>(dev, g, dtype, format, Operands { a: x, b: w, out: y })
}

/// The input gradient `dx` from the weights and the output gradient `dy` (all in `format`).
pub(super) fn input_grad(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    format: Format,
    w: u64,
    dy: u64,
    dx: u64,
) -> Result<Engine> {
    run_pass::<BackwardData>(
        dev,
        g,
        dtype,
        format,
        Operands {
            a: w,
            b: dy,
            out: dx,
        },
    )
}

/// The weight gradient `dw` from the input and the output gradient `dy` (all in `format`).
pub(super) fn weight_grad(
    dev: &Arc<CudaDevice>,
    g: &Geometry,
    dtype: DType,
    format: Format,
    x: u64,
    dy: u64,
    dw: u64,
) -> Result<Engine> {
    run_pass::<BackwardFilter>(
        dev,
        g,
        dtype,
        format,
        Operands {
            a: x,
            b: dy,
            out: dw,
        },
    )
}
