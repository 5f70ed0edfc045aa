//! The CUDA runtime: finding the CUDA libraries, compiling kernels with NVRTC, launches as plain
//! data, and the runtime's own kernels (fill, copy, cast, scale, add_scaled, norms).

pub mod kernel_cache;
pub mod launch;
pub mod libs;
pub mod nvrtc;
pub mod runtime_kernels;
