//! tandem
