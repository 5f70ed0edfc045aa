//! `Tensor`: a cheap-to-clone handle to shared storage, a layout, a dtype, and autograd
//! metadata (whether it requires grad, the node that produced it, and — for a leaf — its
//! accumulated gradient and hooks).
//!
//! Differentiable operations live in `tandem-ops`; this file holds what every layer needs:
//! identity, accessors, non-differentiable views and the autograd fields.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::graph::{LeafHooks, Node};
use crate::{DType, Device, Error, Layout, Result, Shape, Storage};

/// A process-unique tensor identity; a parameter keeps its id for its whole life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The raw number (for traces and messages).
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// A tensor's layout, which [`Tensor::to_memory_format_`] may replace once per re-layout.
///
/// Readers get `&Layout` for as long as they hold the tensor, so a replaced layout can never be
/// freed while the tensor lives: each re-layout appends a cell to a chain, and the current
/// layout is at its end. A tensor that was never re-laid out (nearly all of them, and every op
/// output) pays one atomic load per read and no allocation; a converted parameter one hop. The
/// old layouts cost a few dozen bytes each until the tensor drops.
struct LayoutCell {
    layout: Layout,
    next: OnceLock<Box<LayoutCell>>,
}

impl LayoutCell {
    fn new(layout: Layout) -> Self {
        LayoutCell {
            layout,
            next: OnceLock::new(),
        }
    }

    fn last(&self) -> &LayoutCell {
        let mut cell = self;
        while let Some(next) = cell.next.get() {
            cell = next;
        }
        cell
    }

    /// The current layout.
    #[inline]
    fn current(&self) -> &Layout {
        &self.last().layout
    }

    /// Makes `layout` the current one. The caller serializes replacements
    /// ([`Tensor::to_memory_format_`] holds the gradient slot's lock), so the tail found here
    /// is still the tail when it is set.
    fn replace(&self, layout: Layout) {
        let mut pending = Box::new(LayoutCell::new(layout));
        // With replacements serialized the first `set` succeeds; should another have won the
        // race, the new layout goes after the one it set.
        while let Err(back) = self.last().next.set(pending) {
            pending = back;
        }
    }
}

pub(crate) struct TensorImpl {
    id: TensorId,
    storage: Storage,
    layout: LayoutCell,
    dtype: DType,
    requires_grad: AtomicBool,
    grad_fn: Option<Arc<Node>>,
    grad: Mutex<Option<Tensor>>,
    hooks: Mutex<LeafHooks>,
}

/// An n-dimensional array on a device, with autograd metadata.
///
/// Cloning is cheap and yields the *same* tensor (same id, same gradient). Views share storage
/// with the tensor they were taken from.
#[derive(Clone)]
pub struct Tensor(Arc<TensorImpl>);

impl Tensor {
    /// A tensor over `storage` with `layout`. The layout must fit inside the storage.
    pub fn from_storage(storage: Storage, layout: Layout) -> Result<Self> {
        let (len, dtype) = (storage.len(), storage.dtype());
        if layout.storage_extent() > len {
            return Err(Error::shape(
                "Tensor::from_storage",
                format!(
                    "layout {:?} reaches past a storage of {len} elements",
                    layout
                ),
            ));
        }
        Ok(Self::assemble(storage, layout, dtype, None, false))
    }

    pub(crate) fn assemble(
        storage: Storage,
        layout: Layout,
        dtype: DType,
        grad_fn: Option<Arc<Node>>,
        requires_grad: bool,
    ) -> Self {
        Tensor(Arc::new(TensorImpl {
            id: TensorId::fresh(),
            storage,
            layout: LayoutCell::new(layout),
            dtype,
            requires_grad: AtomicBool::new(requires_grad || grad_fn.is_some()),
            grad_fn,
            grad: Mutex::new(None),
            hooks: Mutex::new(LeafHooks::default()),
        }))
    }

    /// This tensor's identity.
    pub fn id(&self) -> TensorId {
        self.0.id
    }

    /// The dimensions.
    pub fn shape(&self) -> &Shape {
        // A re-layout keeps the shape: the first layout's is always current.
        self.0.layout.layout.shape()
    }

    /// The dimensions as a slice.
    pub fn dims(&self) -> &[usize] {
        self.shape()
    }

    /// Size of dimension `dim` (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        let d = crate::layout::normalize_dim("Tensor::dim", dim, self.rank())?;
        Ok(self.dims().get(d).copied().unwrap_or(1))
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.layout.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }

    /// Shape, strides and offset.
    pub fn layout(&self) -> &Layout {
        self.0.layout.current()
    }

    /// The underlying buffer (shared with every view of it).
    pub fn storage(&self) -> &Storage {
        &self.0.storage
    }

    /// Whether the elements are dense and row-major.
    pub fn is_contiguous(&self) -> bool {
        self.layout().is_contiguous()
    }

    /// Whether this handle is the only reference to the tensor and to its storage, so its
    /// buffer may be updated in place without anyone else seeing it.
    pub fn is_exclusive(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && self.0.storage.is_unique()
    }

    /// Whether two tensors are the same tensor (same id).
    pub fn same_tensor(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// A tensor over the same storage with another layout, outside the autograd graph.
    /// Differentiable views are in `tandem-ops`.
    pub fn view_detached(&self, layout: Layout) -> Result<Tensor> {
        let len = self.0.storage.len();
        if layout.storage_extent() > len {
            return Err(Error::shape(
                "view",
                format!(
                    "layout {:?} reaches past a storage of {len} elements",
                    layout
                ),
            ));
        }
        Ok(Self::assemble(
            self.0.storage.clone(),
            layout,
            self.0.dtype,
            None,
            false,
        ))
    }

    // ---- autograd metadata -------------------------------------------------------------

    /// Whether gradients flow to (or through) this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Marks a leaf as requiring grad (a parameter). Only leaves of a float dtype qualify.
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        if self.0.grad_fn.is_some() {
            return Err(Error::autograd(
                "set_requires_grad on a non-leaf tensor; call detach() first to make a leaf",
            ));
        }
        if requires_grad && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "set_requires_grad",
                dtype: self.dtype(),
                supported: "floating-point dtypes",
            });
        }
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
        Ok(())
    }

    /// Builder form of [`Tensor::set_requires_grad`].
    pub fn with_requires_grad(self) -> Result<Self> {
        self.set_requires_grad(true)?;
        Ok(self)
    }

    /// The node that produced this tensor, if it was computed by a recorded op.
    pub fn grad_fn(&self) -> Option<&Arc<Node>> {
        self.0.grad_fn.as_ref()
    }

    /// Whether this tensor was not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }

    /// A new tensor sharing this one's storage and layout, produced by `node`. Used by ops to
    /// return their output with its place in the graph.
    pub fn with_grad_fn(&self, node: Arc<Node>) -> Tensor {
        Self::assemble(
            self.0.storage.clone(),
            self.layout().clone(),
            self.0.dtype,
            Some(node),
            true,
        )
    }

    /// The same data, cut from the graph: a leaf that does not require grad.
    pub fn detach(&self) -> Tensor {
        Self::assemble(
            self.0.storage.clone(),
            self.layout().clone(),
            self.0.dtype,
            None,
            false,
        )
    }

    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.lock().clone()
    }

    /// Replaces the accumulated gradient (for example with a view into a communication bucket,
    /// or `None` to release it). The gradient must have this tensor's shape and dtype.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.dims() != self.dims() || g.dtype() != self.dtype() || g.device() != self.device() {
                return Err(Error::shape(
                    "set_grad",
                    format!(
                        "gradient {:?} {} on {} does not match tensor {:?} {} on {}",
                        g.dims(),
                        g.dtype(),
                        g.device(),
                        self.dims(),
                        self.dtype(),
                        self.device()
                    ),
                ));
            }
        }
        *self.0.grad.lock() = grad;
        Ok(())
    }

    /// The gradient slot, locked. [`Tensor::to_memory_format_`] holds it for the whole
    /// re-layout, which serializes re-layouts of one tensor and keeps its gradient in place.
    pub(crate) fn lock_grad(&self) -> parking_lot::MutexGuard<'_, Option<Tensor>> {
        self.0.grad.lock()
    }

    /// Makes `layout` this tensor's layout (same shape, and the same storage extent: checked by
    /// the caller). Call with [`Tensor::lock_grad`] held.
    pub(crate) fn replace_layout(&self, layout: Layout) {
        debug_assert_eq!(layout.shape(), self.shape());
        self.0.layout.replace(layout);
    }

    /// The hooks registered on this leaf. Use `tandem_autograd::hooks` to register them.
    pub fn hooks(&self) -> &Mutex<LeafHooks> {
        &self.0.hooks
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}",
            self.dims(),
            self.dtype(),
            self.device()
        )?;
        if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        if let Some(node) = self.grad_fn() {
            write!(f, ", grad_fn={}", node.name())?;
        }
        if self.numel() <= 16 {
            if let Ok(v) = self.to_vec_f64() {
                write!(f, ", data={v:?}")?;
            }
        }
        write!(f, ")")
    }
}
