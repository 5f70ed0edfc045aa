//! The device-neutral kinds of the binary ops, shared by the CPU and CUDA kernels.

/// Which scalar operation [`add_scalar`](super::add_scalar) or [`mul_scalar`](super::mul_scalar) applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalarKind {
    /// `x + c`.
    Add,
    /// `x * c`.
    Mul,
}

impl ScalarKind {
    /// The op's name.
    pub fn name(self) -> &'static str {
        match self {
            ScalarKind::Add => "add_scalar",
            ScalarKind::Mul => "mul_scalar",
        }
    }
}

/// Which binary operation a kernel applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryKind {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
}
