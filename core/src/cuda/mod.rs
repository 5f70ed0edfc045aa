//! The CUDA runtime: finding the CUDA libraries, compiling kernels with NVRTC, launches as plain
//! data, the runtime's own kernels (fill, copy, cast, scale, add_scaled, norms), and the device
//! side of tensors: devices with their context and compute stream, stream-ordered device
//! memory, pinned host staging for copies, cuBLAS handles, and errors kernels record on the
//! device for the host to report later ([`deferred`]).
//!
//! Everything here is compiled on every machine; nothing is linked. Libraries are opened at
//! first use, and a missing one is a [`DeviceUnavailable`](crate::Error::DeviceUnavailable)
//! error naming it and the places searched ([`libs`]).

pub mod blas;
pub mod deferred;
pub mod device;
mod free_order;
pub mod host_reads;
pub mod kernel_cache;
pub mod launch;
pub mod libs;
pub mod memory;
pub mod nvrtc;
mod pinned_cache;
pub(crate) mod runtime;
pub mod runtime_kernels;
pub mod sanitizer;
mod storage;
mod transfer;

pub use device::{device, device_count, is_available, CudaDevice};
pub use host_reads::device_to_host_copies;
pub use memory::{empty_cache, memory_stats, reset_peak_memory, DeviceBuffer, MemoryStats};
pub use runtime::{device_pointer, device_view, launch_on_compute};
pub use storage::CudaStorage;
