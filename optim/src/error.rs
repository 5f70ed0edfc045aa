//! The error type of `tandem-optim`.
//!
//! Each variant names the optimizer and, for a parameter, its index in the list the optimizer
//! was built with (the order of `Module::parameters`), so a message points at what to fix.

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong in an optimizer.
///
/// Its `Debug` is its message and the errors it wraps
/// ([`tandem_core::error::write_report`]), so `unwrap()` and `main`'s error show the advice.
#[derive(thiserror::Error)]
pub enum Error {
    /// An error from the tensor layer (a kernel, a dtype, a device).
    #[error(transparent)]
    Tensor(#[from] tandem_core::Error),

    /// A hyper-parameter combination the optimizer does not accept.
    #[error("{optimizer}: invalid configuration: {msg}")]
    InvalidConfig {
        /// The optimizer, e.g. `SGD`.
        optimizer: &'static str,
        /// What is wrong and what is allowed.
        msg: String,
    },

    /// An optimizer built over no parameters at all: almost always a mistake (the parameters
    /// of another model, or of a model before its layers were added), so it is refused as
    /// PyTorch refuses it.
    #[error(
        "{optimizer}: got an empty parameter list; pass the parameters it should update \
         (usually `model.parameters()`)"
    )]
    EmptyParameterList {
        /// The optimizer, e.g. `SGD`.
        optimizer: &'static str,
    },

    /// A parameter (or its gradient) the optimizer cannot update.
    #[error("{optimizer}: parameter {index} ({shape:?} {dtype}): {msg}")]
    Parameter {
        /// The optimizer, e.g. `SGD`.
        optimizer: &'static str,
        /// Index of the parameter in the list the optimizer was built with.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: tandem_core::DType,
        /// What is wrong.
        msg: String,
    },

    /// Saved optimizer state that does not fit this optimizer's parameters.
    #[error("{optimizer}: cannot load state: {msg}")]
    State {
        /// The optimizer, e.g. `SGD`.
        optimizer: &'static str,
        /// What does not match.
        msg: String,
    },

    /// A learning-rate schedule built with parameters it does not accept.
    #[error("{schedule}: invalid schedule: {msg}")]
    Schedule {
        /// The schedule, e.g. `StepLr`.
        schedule: &'static str,
        /// What is wrong and what is allowed.
        msg: String,
    },

    /// A gradient scaler used out of order (unscaling twice in one step, stepping twice, an
    /// update with nothing checked) or on gradients it cannot unscale.
    #[error("GradScaler: {msg}")]
    Scaler {
        /// What is wrong and what to do.
        msg: String,
    },

    /// Gradient clipping that cannot proceed (bad arguments or a non-finite gradient norm).
    #[error("clip_grad_norm: {msg}")]
    Clip {
        /// What is wrong.
        msg: String,
    },
}

tandem_core::debug_as_display!(Error);

impl Error {
    /// A parameter error for `param` at `index`.
    pub fn parameter(
        optimizer: &'static str,
        index: usize,
        param: &tandem_core::Tensor,
        msg: impl Into<String>,
    ) -> Self {
        Error::Parameter {
            optimizer,
            index,
            shape: param.dims().to_vec(),
            dtype: param.dtype(),
            msg: msg.into(),
        }
    }
}
