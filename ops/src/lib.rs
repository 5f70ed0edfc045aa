//! `tandem-ops`: differentiable operations on tensors.
//!
//! Each op (or small family of ops sharing a kernel) has a folder: `mod.rs` holds the public
//! functions with a `# Shapes` section, their validation, their backward and their tests (every
//! op is gradient-checked in f64), and dispatches once on the device of its inputs:
//!
//! ```text
//! match x.device() {
//!     Device::Cpu => cpu::forward(..),
//!     Device::Cuda(_) => cuda::forward(..),
//! }
//! ```
//!
//! Every op folder uses the same file names for the same roles:
//!
//! | file | role |
//! |------|------|
//! | `mod.rs` | the public functions (with `# Shapes`), their checks, their backward, their tests |
//! | `shape.rs` | the device-neutral types both devices take (kinds, splits, dims, argument structs); it imports from neither device |
//! | `cpu.rs` or `cpu/` | the CPU kernels |
//! | `cuda/mod.rs` | the CUDA side: tensors in, device buffers allocated, launches run on the compute stream |
//! | `cuda/launch.rs` | the launch plans: pure functions from device addresses, dtypes and sizes to launches (or cuBLAS/cuDNN calls), which the host harness (`tandem-cuda-harness`) runs on the CPU |
//! | `<op>.cu` | the CUDA C source, compiled by NVRTC at first use; helpers several ops share live in `tandem.cuh` (`core/src/cuda/kernels/`) |
//!
//! A folder has only the files its op needs (`views/` has no kernels; `cat/` and `linear/`
//! reuse other ops' kernels and have no `shape.rs` or launch plans). Imports go from `mod.rs`
//! to the devices and from the devices to `shape.rs`, never between `cpu` and `cuda`; ops reuse
//! other ops (in backward, and the shared row-reduction plans of `reduce`). `cpu/` at the crate
//! root holds the helpers the CPU kernels share, `device_address.rs` the first-element address
//! every CUDA side takes. Only kernel files touch host memory (`tests/seam.rs` checks it). Ops
//! run where their inputs are, return `Result`, and name themselves and the offending shapes
//! in errors.

#![warn(missing_docs)]

pub(crate) mod autocast;
pub mod batch_norm;
pub mod binary;
pub mod cast;
pub mod cat;
pub(crate) mod checks;
pub mod conv2d;
pub(crate) mod cpu;
pub(crate) mod device_address;
pub mod dropout;
pub(crate) mod elementwise_plan;
pub mod linear;
pub mod loss;
pub mod matmul;
pub mod pool;
pub mod reduce;
pub mod softmax;
pub mod tensor_ops;
pub mod threads;
pub mod unary;
pub mod views;

#[cfg(test)]
pub(crate) mod testing;

pub use binary::{add, add_relu, add_scalar, div, mul, mul_scalar, sub};
pub use reduce::{mean, mean_all, sum, sum_all};
pub use views::{
    contiguous, expand, flatten, narrow, permute, reshape, squeeze, transpose, unsqueeze,
};

// --- re-exports: unary, max, softmax, loss, dropout, cat, cast ---
pub use cast::cast;
pub use cat::cat;
pub use dropout::dropout;
pub use loss::{cross_entropy, mse_loss, nll_loss, Reduction};
pub use reduce::{argmax, max};
pub use softmax::{log_softmax, softmax};
pub use tensor_ops::TensorOps;
pub use threads::set_num_threads;
pub use unary::{exp, log, neg, pow_scalar, relu, sigmoid, sqrt, tanh};

// --- re-exports: matmul, linear, conv2d, pool, batch_norm ---
pub use batch_norm::{batch_norm, batch_norm_add_relu, batch_norm_relu};
pub use conv2d::{conv2d, Conv2dParams};
pub use linear::linear;
pub use matmul::matmul;
pub use pool::{adaptive_avg_pool2d, avg_pool2d, max_pool2d};
