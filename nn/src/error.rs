//! The error type of `tandem-nn`.
//!
//! Errors from the tensor layer pass through unchanged ([`Error::Tensor`]). A failure inside a
//! layer of a container is wrapped in [`Error::InModule`] naming the layer's path
//! (`features.3`) and type, so a shape error in a deep model says where it happened. File
//! errors name the file and what is wrong with it.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong in a layer, a dataset or a data loader.
///
/// Its `Debug` is its message and the errors it wraps
/// ([`tandem_core::error::write_report`]), so `unwrap()` and `main`'s error show the advice.
#[derive(thiserror::Error)]
pub enum Error {
    /// An error from the tensor layer (an op, a dtype, a device).
    #[error(transparent)]
    Tensor(#[from] tandem_core::Error),

    /// An input a layer cannot take (wrong rank, wrong number of features or channels).
    #[error("{layer}: {msg}")]
    Input {
        /// The layer type, e.g. `Linear`.
        layer: &'static str,
        /// What is wrong with the input and what the layer expects.
        msg: String,
    },

    /// A layer, dataset or loader built with arguments it cannot work with.
    #[error("{what}: invalid configuration: {msg}")]
    Config {
        /// What was being built, e.g. `Dropout` or `DataLoader`.
        what: &'static str,
        /// What is wrong.
        msg: String,
    },

    /// A failure inside a child module, with the child's dotted path from the module whose
    /// method was called.
    #[error("in module `{path}` ({layer}): {source}")]
    InModule {
        /// Dotted path of the innermost failing module, e.g. `features.3`.
        path: String,
        /// Its type, e.g. `Conv2d`.
        layer: &'static str,
        /// The failure itself.
        source: Box<Error>,
    },

    /// A failure on one tensor of a module (moving it to a device), with the tensor's dotted
    /// path from the module whose method was called.
    #[error("tensor `{path}` of the {module}: {source}")]
    InTensor {
        /// Dotted path of the tensor, e.g. `features.0.weight`.
        path: String,
        /// The type of the module whose method was called, e.g. `Sequential`.
        module: &'static str,
        /// The failure itself.
        source: Box<Error>,
    },

    /// Reading a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },

    /// A file whose contents are not what its format requires (a wrong magic number, sizes that
    /// disagree, a truncated file).
    #[error("{}: {msg}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },

    /// A checkpoint's tensors do not fit the module they are loaded into: missing or
    /// unexpected names, or a shape or dtype that differs from the parameter's.
    #[error("{origin}: state does not fit the model: {msg}")]
    StateDict {
        /// Where the state came from (the checkpoint file).
        origin: String,
        /// Which names, shapes or dtypes disagree.
        msg: String,
    },

    /// A dataset or loader asked for something it cannot give (an index out of range, a
    /// batch of inconsistent samples), or its worker thread died.
    #[error("{what}: {msg}")]
    Data {
        /// The dataset or loader, e.g. `MnistDataset`.
        what: &'static str,
        /// What went wrong.
        msg: String,
    },
}

tandem_core::debug_as_display!(Error);

impl Error {
    /// An input error for `layer`.
    pub fn input(layer: &'static str, msg: impl Into<String>) -> Self {
        Error::Input {
            layer,
            msg: msg.into(),
        }
    }

    /// A configuration error for `what`.
    pub fn config(what: &'static str, msg: impl Into<String>) -> Self {
        Error::Config {
            what,
            msg: msg.into(),
        }
    }

    /// A data error for `what`.
    pub fn data(what: &'static str, msg: impl Into<String>) -> Self {
        Error::Data {
            what,
            msg: msg.into(),
        }
    }

    /// Wraps this error as having happened in the child `name` (of type `layer`) of a
    /// container. An error already wrapped by a deeper container gets `name` prepended to its
    /// path, so the final message carries the full dotted path of the innermost module.
    pub fn in_module(self, name: &str, layer: &'static str) -> Self {
        match self {
            Error::InModule {
                path,
                layer: inner,
                source,
            } => Error::InModule {
                path: format!("{name}.{path}"),
                layer: inner,
                source,
            },
            other => Error::InModule {
                path: name.to_string(),
                layer,
                source: Box::new(other),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_module_errors_carry_the_full_path_and_innermost_layer() {
        let err = Error::input("Linear", "expected 4 input features, got [2, 3]")
            .in_module("2", "Linear")
            .in_module("classifier", "Sequential");
        let msg = err.to_string();
        assert_eq!(
            msg,
            "in module `classifier.2` (Linear): Linear: expected 4 input features, got [2, 3]"
        );
    }

    #[test]
    fn debug_prints_the_message_as_display_does() {
        let err = Error::input("Linear", "expected 4 input features, got [2, 3]")
            .in_module("2", "Linear")
            .in_module("classifier", "Sequential");
        // The sources are quoted by the message already: nothing is printed twice.
        assert_eq!(format!("{err:?}"), err.to_string());
        let err = Error::from(tandem_core::Error::invalid(
            "dropout",
            "p must be in [0, 1)",
        ));
        assert_eq!(format!("{err:?}"), "dropout: p must be in [0, 1)");
        let err = Error::Io {
            path: PathBuf::from("/data/mnist/t10k-images-idx3-ubyte"),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(format!("{err:?}"), err.to_string());
        assert!(format!("{err:?}").contains("/data/mnist/t10k-images-idx3-ubyte"));
    }
}
