//! tandem: a deep-learning framework whose data-parallel training overlaps the gradient
//! all-reduce with backward. (facade being written)

pub use tandem_autograd as autograd;
pub use tandem_core as core;
pub use tandem_nn as nn;
pub use tandem_ops as ops;
pub use tandem_optim as optim;
