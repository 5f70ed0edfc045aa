//! Where a tensor lives.

use std::fmt;

use crate::{Error, Result};

/// A compute device. Every op runs where its inputs are; mixing devices is an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; kernels in Rust, parallel with rayon.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Checks that tensors can be created on this device: always for the CPU; for `Cuda(n)`,
    /// that the CUDA driver loads and device `n` exists (opening it on first use). The error
    /// names what is missing.
    pub fn ensure_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => crate::cuda::device(n).map(|_| ()),
        }
    }

    /// Returns an error naming `op` unless both devices are the same.
    pub fn same_as(self, other: Device, op: &'static str) -> Result<()> {
        if self == other {
            Ok(())
        } else {
            Err(Error::DeviceMismatch {
                op,
                lhs: self,
                rhs: other,
            })
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
