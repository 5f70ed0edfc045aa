//! Helpers shared by the ops' CPU kernels: fallible host buffers (`memory`), elementwise loops
//! (`elementwise`), lane-wise reductions (`lanes`), the vectorisable exponential (`exp`), the
//! strided walk of broadcasting kernels (`strided`), the gemm wrapper (`gemm`), the bf16
//! products with f32 accumulation (`gemm_bf16`), the rule for going parallel (`parallel`) and
//! run-time selection of vector instructions (`simd`).
//!
//! Like the `cpu.rs` (or `cpu/`) kernel files of each op folder, these touch host memory; the
//! ops' `mod.rs` files never do (see `tests/seam.rs`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub(crate) mod elementwise;
pub(crate) mod exp;
pub(crate) mod gemm;
pub(crate) mod gemm_bf16;
pub(crate) mod half;
pub(crate) mod lanes;
pub(crate) mod memory;
pub(crate) mod parallel;
pub(crate) mod simd;
pub(crate) mod strided;
#[cfg(target_arch = "x86_64")]
pub(crate) mod transpose16;
