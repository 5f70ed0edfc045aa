//! `--amp`, shared by the benchmarks that time a training step (`train_step`, `ddp_step`):
//! the autocast dtype of tandem's side, and the name its PyTorch peer takes.

use clap::ValueEnum;
use tandem::core::DType;

/// `--amp`: the autocast dtype of both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Amp {
    /// bfloat16 (no gradient scaler).
    Bf16,
    /// IEEE half, with a gradient scaler (PyTorch's defaults).
    F16,
}

impl Amp {
    /// The autocast dtype.
    pub fn dtype(self) -> DType {
        match self {
            Amp::Bf16 => DType::BF16,
            Amp::F16 => DType::F16,
        }
    }

    /// The flag's value, as the peers take it.
    pub fn name(self) -> &'static str {
        match self {
            Amp::Bf16 => "bf16",
            Amp::F16 => "f16",
        }
    }
}
