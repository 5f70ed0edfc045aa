//! The emulated cuDNN's tests use the driver's test helper (`cuda-emu/tests/common/mod.rs`):
//! `tandem-test-support`'s `use_emulator` sets up all the emulated libraries.

#![allow(dead_code)]

#[path = "../../../tests/common/mod.rs"]
mod emulator;

#[allow(unused_imports)] // each test binary uses its own part of the helper
pub use emulator::{counters, last_fault, use_emulator};
