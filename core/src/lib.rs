//! `tandem-core`: the tensor, its storage and layout, dtypes, devices, streams and events, and
//! the error type of the tensor layer.
//!
//! Everything above — autograd, ops, layers, optimizers, distributed training — is built on
//! the types here. The autograd *graph data* (nodes, edges, leaf hooks) is defined here because
//! a tensor points at the node that produced it; the engine that runs it is `tandem-autograd`.

#![warn(missing_docs)]

mod access;
pub mod cpu;
mod create;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod graph;
pub mod layout;
pub mod memory_format;
pub mod profile;
pub mod rng;
pub mod storage;
pub mod stream;
mod tensor;

pub use cpu::alloc;
pub use device::Device;
pub use dtype::{DType, Element, FloatElement, HalfElement};
pub use error::{Error, Result};
pub use graph::{BackwardOp, Edge, GradReady, Node};
pub use layout::{broadcast_shapes, checked_numel, normalize_dim, Layout, Shape};
pub use memory_format::MemoryFormat;
pub use rng::Generator;
pub use storage::{CpuStorage, Storage};
pub use stream::{Event, Stream};
pub use tensor::{Tensor, TensorId};

#[doc(hidden)]
pub use half;
