//! The device seam of the ops. Every op validates its inputs and records its backward in its
//! `mod.rs`, then dispatches once on the device of its inputs:
//!
//! ```text
//! match x.device() {
//!     Device::Cpu => cpu::forward(..),
//!     Device::Cuda(_) => Err(no_kernel(OP, x.device())),
//! }
//! ```
//!
//! The CUDA arm is the one place where a CUDA kernel (`cuda.rs` of the op folder) plugs in;
//! until it does, the op fails with [`no_kernel`]'s error rather than reading device memory as
//! if it were host memory.

use tandem_core::{Device, Error};

/// The error of an op that has no kernel for `device` in this build: "device cuda:0 is not
/// available: conv2d has no CUDA kernel in this build".
pub(crate) fn no_kernel(op: &'static str, device: Device) -> Error {
    let kind = match device {
        Device::Cpu => "CPU",
        Device::Cuda(_) => "CUDA",
    };
    Error::DeviceUnavailable {
        device,
        reason: format!("{op} has no {kind} kernel in this build"),
    }
}
