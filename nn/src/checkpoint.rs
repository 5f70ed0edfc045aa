//! Checkpoints (being written).
