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

/// Parses `cpu`, `cuda` (device 0) or `cuda:N`, as PyTorch spells devices.
impl std::str::FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => lower
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::invalid(
                        "Device::from_str",
                        format!("`{s}` is not a device; use cpu, cuda or cuda:N"),
                    )
                }),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_as_pytorch_spells_them() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("CUDA:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1"] {
            let err = bad.parse::<Device>().unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains("cuda:N"), "{err}");
        }
        for d in [Device::Cpu, Device::Cuda(2)] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
    }
}
