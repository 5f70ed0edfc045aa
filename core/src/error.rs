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
    Shape {
        /// The operation that failed.
        op: &'static str,
        /// The shapes involved and why they do not fit.
        msg: String,
    },

    /// Two inputs of different dtypes where the operation needs one.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The dtype of the first input.
        lhs: DType,
        /// The dtype of the other input.
        rhs: DType,
    },

    /// A dtype the operation does not support.
    #[error("{op}: unsupported dtype {dtype} (supported: {supported})")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The dtype it was given.
        dtype: DType,
        /// The dtypes it supports, as text for the message.
        supported: &'static str,
    },

    /// Inputs living on different devices; tandem never copies between devices silently.
    #[error("{op}: device mismatch: {lhs} vs {rhs}; move the tensors to one device first")]
    DeviceMismatch {
        /// The operation that failed.
        op: &'static str,
        /// The device of the first input.
        lhs: Device,
        /// The device of the other input.
        rhs: Device,
    },

    /// A device that this build or this machine cannot use.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: Device,
        /// Why it cannot be used.
        reason: String,
    },

    /// Memory that could not be had: the request was larger than the address space or the
    /// device's free memory.
    #[error("{op}: out of memory on {device}: could not allocate {bytes} bytes")]
    OutOfMemory {
        /// The operation that failed.
        op: &'static str,
        /// Where the memory was asked for.
        device: Device,
        /// The size of the request.
        bytes: usize,
    },

    /// A CUDA call that failed (the driver, cuBLAS, cuDNN or a kernel launch), with the
    /// library's own name for the error.
    #[error("{op}: CUDA error on {device}: {detail}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// The device the call ran on.
        device: Device,
        /// What failed, with the library's name for the error.
        detail: String,
    },

    /// Device memory used by two CUDA streams with nothing ordering the uses, or freed while
    /// another stream may still use it, as the stream sanitizer found it
    /// (`TANDEM_CUDA_SANITIZER=1`; see `cuda::sanitizer`).
    #[error("stream sanitizer on {device}: {detail}")]
    StreamRace {
        /// The device whose memory is raced on.
        device: Device,
        /// The sanitizer's report: the two uses, their streams and the memory.
        detail: String,
    },

    /// An argument outside what the operation accepts (a dim, a size, a label, a probability).
    #[error("{op}: {msg}")]
    InvalidArgument {
        /// The operation that failed.
        op: &'static str,
        /// Which argument and what is wrong with it.
        msg: String,
    },

    /// A misuse of automatic differentiation (backward twice through a freed graph, …).
    #[error("autograd: {msg}")]
    Autograd {
        /// What was misused.
        msg: String,
    },

    /// An error raised by a hook or a layer above the tensor layer, with its context.
    #[error("{context}: {source}")]
    External {
        /// Where the error was raised (the hook or layer and what it was doing).
        context: String,
        /// The error itself.
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
