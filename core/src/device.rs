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
    /// Checks that tensors can be created on this device in this build.
    ///
    /// The CUDA backend is not built yet, so `Cuda(n)` is refused with an error saying so.
    pub fn ensure_available(self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(_) => Err(Error::DeviceUnavailable {
                device: self,
                reason:
                    "the CUDA backend is not built yet in this version of tandem; use Device::Cpu"
                        .into(),
            }),
        }
    }

    /// The error for a device this build or machine cannot use for `what`.
    pub(crate) fn unavailable(self, what: &str) -> Error {
        Error::DeviceUnavailable {
            device: self,
            reason: format!(
                "{what}: the CUDA backend is not built yet in this version of tandem; use Device::Cpu"
            ),
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
