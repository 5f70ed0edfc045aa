//! The error type of the tensor layer (`tandem-core`, `tandem-autograd` and `tandem-ops`).
//!
//! Every variant names the operation that failed and what was wrong with its inputs, so the
//! message alone tells a user what to fix.
//!
//! It also holds what every tandem crate uses to make an error's `Debug` read like its
//! `Display` ([`debug_as_display!`](crate::debug_as_display) and [`write_report`]): a program
//! whose `main` returns `Result<(), Box<dyn Error>>` prints the error it ends with through
//! `Debug`, and a derived `Debug` (`UnusedParameters { rank: 0, paths: [..] }`) drops the
//! message's advice.

use std::fmt;

use crate::{DType, Device, Shape};

/// Result alias used across the tensor layer.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong in a tensor operation.
///
/// Its `Debug` is its message and the errors it wraps ([`write_report`]).
#[derive(thiserror::Error)]
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

crate::debug_as_display!(Error);

/// Writes `err` as a user should read it: its message, then the chain of errors it wraps
/// ([`source`](std::error::Error::source)), one a line under `Caused by:`. A wrapped error whose
/// text the lines above already hold (a message that quotes its cause, as most of tandem's do)
/// is not repeated, so an error prints its message alone unless a cause has more to say.
///
/// ```text
/// rank 0: forward of the wrapped module: in module `fc` (Linear): …
///
/// Caused by:
///     connection refused
/// ```
pub fn write_report(
    err: &(dyn std::error::Error + 'static),
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    let mut shown = err.to_string();
    f.write_str(&shown)?;
    let mut heading = false;
    let mut cause = err.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !text.is_empty() && !shown.contains(&text) {
            if !heading {
                f.write_str("\n\nCaused by:")?;
                heading = true;
            }
            write!(f, "\n    {}", text.replace('\n', "\n    "))?;
            shown.push('\n');
            shown.push_str(&text);
        }
        cause = e.source();
    }
    Ok(())
}

/// Implements `Debug` for error types as [`write_report`]: the message and the errors it
/// wraps, as `Display` says them, instead of the derived field dump. Every public error type of
/// tandem uses it, so that `fn main() -> Result<(), Box<dyn Error>>`, `unwrap()` and `{:?}` show
/// the message with its advice.
///
/// ```
/// #[derive(Clone)]
/// struct Refused;
/// impl std::fmt::Display for Refused {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("refused; try again")
///     }
/// }
/// impl std::error::Error for Refused {}
/// tandem_core::debug_as_display!(Refused);
/// assert_eq!(format!("{:?}", Refused), "refused; try again");
/// ```
#[macro_export]
macro_rules! debug_as_display {
    ($($ty:ty),+ $(,)?) => {
        $(
            impl ::std::fmt::Debug for $ty {
                fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                    $crate::error::write_report(self, f)
                }
            }
        )+
    };
}

/// Formats a shape as `[2, 3, 4]` for messages.
pub fn fmt_shape(shape: &Shape) -> String {
    format!("{:?}", shape.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cause whose text the outer message does not repeat.
    #[derive(Debug)]
    struct Root;

    impl fmt::Display for Root {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the root cause\nover two lines")
        }
    }

    impl std::error::Error for Root {}

    #[test]
    fn debug_is_the_message_not_the_fields() {
        let err = Error::DeviceMismatch {
            op: "add",
            lhs: Device::Cpu,
            rhs: Device::Cuda(0),
        };
        assert_eq!(format!("{err:?}"), err.to_string());
        assert!(format!("{err:?}").contains("move the tensors to one device first"));
        assert_eq!(format!("{err:#?}"), err.to_string());
    }

    #[test]
    fn debug_lists_causes_the_message_does_not_already_say() {
        let err = Error::external("in a gradient-ready hook", Root);
        // The message quotes its source: nothing more to say.
        assert_eq!(format!("{err:?}"), err.to_string());

        let err = Error::External {
            context: "hook".into(),
            source: Box::new(Error::external("outer", Root)),
        };
        assert_eq!(format!("{err:?}"), err.to_string());

        struct Terse(Root);
        impl fmt::Display for Terse {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("loading failed")
            }
        }
        impl std::error::Error for Terse {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        crate::debug_as_display!(Terse);
        assert_eq!(
            format!("{:?}", Terse(Root)),
            "loading failed\n\nCaused by:\n    the root cause\n    over two lines"
        );
    }
}
