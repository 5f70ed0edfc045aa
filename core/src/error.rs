//! The error type of the tensor layer (`tandem-core`, `tandem-autograd` and `tandem-ops`).
//!
//! Every variant names the operation that failed and what was wrong with its inputs, so the
//! message alone tells a user what to fix.

use crate::{DType, Device, Shape};

/// Result alias used across the tensor layer.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong in a tensor operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Input shapes that the operation cannot combine.
    #[error("{op}: shape mismatch: {msg}")]
    Shape { op: &'static str, msg: String },

    /// Two inputs of different dtypes where the operation needs one.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },

    /// A dtype the operation does not support.
    #[error("{op}: unsupported dtype {dtype} (supported: {supported})")]
    UnsupportedDType {
        op: &'static str,
        dtype: DType,
        supported: &'static str,
    },

    /// Inputs living on different devices; tandem never copies between devices silently.
    #[error("{op}: device mismatch: {lhs} vs {rhs}; move the tensors to one device first")]
    DeviceMismatch {
        op: &'static str,
        lhs: Device,
        rhs: Device,
    },

    /// A device that this build or this machine cannot use.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable { device: Device, reason: String },

    /// Memory that could not be had: the request was larger than the address space or the
    /// device's free memory.
    #[error("{op}: out of memory on {device}: could not allocate {bytes} bytes")]
    OutOfMemory {
        op: &'static str,
        device: Device,
        bytes: usize,
    },

    /// A CUDA call that failed (the driver, cuBLAS, cuDNN or a kernel launch), with the
    /// library's own name for the error.
    #[error("{op}: CUDA error on {device}: {detail}")]
    Cuda {
        op: &'static str,
        device: Device,
        detail: String,
    },

    /// Device memory used by two CUDA streams with nothing ordering the uses, or freed while
    /// another stream may still use it, as the stream sanitizer found it
    /// (`TANDEM_CUDA_SANITIZER=1`; see `cuda::sanitizer`).
    #[error("stream sanitizer on {device}: {detail}")]
    StreamRace { device: Device, detail: String },

    /// An argument outside what the operation accepts (a dim, a size, a label, a probability).
    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A misuse of automatic differentiation (backward twice through a freed graph, …).
    #[error("autograd: {msg}")]
    Autograd { msg: String },

    /// An error raised by a hook or a layer above the tensor layer, with its context.
    #[error("{context}: {source}")]
    External {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// Shape error helper.
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }

    /// Invalid-argument helper.
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            msg: msg.into(),
        }
    }

    /// Autograd misuse helper.
    pub fn autograd(msg: impl Into<String>) -> Self {
        Error::Autograd { msg: msg.into() }
    }

    /// Wraps an error from above the tensor layer (for example a collective failing inside a
    /// gradient-ready hook).
    pub fn external(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::External {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// Formats a shape as `[2, 3, 4]` for messages.
pub fn fmt_shape(shape: &Shape) -> String {
    format!("{:?}", shape.as_slice())
}
