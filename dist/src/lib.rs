//! tandem-dist (being written)
