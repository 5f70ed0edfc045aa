//! The host runtime: host memory ([`CpuStorage`]) and its caching allocator, and the few
//! in-place kernels the runtime itself needs on the CPU (fill, copy, cast, scale, accumulate).
//!
//! Nothing outside this folder and the ops' `cpu.rs` kernel files touches host slices of a
//! tensor; code above the tensor layer uses the device-neutral operations on
//! [`Tensor`](crate::Tensor) (`fill_`, `copy_`, `scale_`, `add_scaled_`, `to_dtype`,
//! `to_device`, `to_vec`), which dispatch here or to the CUDA runtime.

pub mod alloc;
pub mod convert;
pub(crate) mod runtime;
mod storage;

pub use storage::CpuStorage;
