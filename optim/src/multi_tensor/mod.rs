//! Multi-tensor kernels: one launch updates, measures, scales or zeroes every tensor of a dtype
//! on a CUDA device, in the manner of PyTorch's `multi_tensor_apply`.
//!
//! **Table.** The host describes the tensors in a table ([`TensorTable`]): one 64-byte entry
//! per non-empty tensor with the addresses of element 0 of the parameter, its gradient and up
//! to three state tensors, its element count, and the number of chunks of all tensors before
//! it. The table is uploaded to device memory once and reused while the same addresses come
//! back (cached by content), so a steady-state step uploads nothing. A launch holds a lease on
//! its table until it is queued, so no other thread can evict and free it first (`cache`).
//!
//! **Chunks.** Every tensor is cut into chunks of [`CHUNK_ELEMENTS`] elements (the last one
//! shorter), numbered across all tensors. A launch has one block of [`THREADS_PER_BLOCK`]
//! threads per chunk (capped; blocks then loop over chunks); a block finds its chunk's tensor by
//! a binary search of the entries and its threads walk the chunk with consecutive addresses.
//!
//! **Launches per step** (tensors of one dtype on one device, all dense): SGD and Adam/AdamW 1
//! (a second when some tensors take a different step: a new momentum buffer, or Adam tensors
//! with a different step count); `zero_grad` 1; `clip_grad_norm` 3 (partial norms, the
//! runtime's `norm_finish`, scaling) and one read of the norm back to the host; the gradient
//! scaler's unscale 1 (after zeroing its found-inf flag) and one read of that flag per step. Each further
//! dtype adds one launch per kernel. f32 and f64 are supported (as on the CPU).
//!
//! [`plans`] builds the launches (pure, run by the host harness too); `device` runs them.

mod cache;
mod device;
pub mod plans;
mod table;

pub(crate) use cache::TableCache;
pub(crate) use device::{count_host_read, element_address, run, run_on_table, shared_cache, Roles};
pub use device::{launch_counts, LaunchCounts};
pub use plans::{
    adam_launch, grad_clip_scale_launch, grad_norm_partial_launch, grad_unscale_launch,
    grad_zero_launch, sgd_launch, ADAM_KERNELS, CHUNK_ELEMENTS, GRAD_KERNELS, SGD_KERNELS,
    THREADS_PER_BLOCK,
};
pub use table::{TableEntry, TensorTable, ENTRY_WORDS};
