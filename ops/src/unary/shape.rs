//! The device-neutral description of the unary ops, shared by the CPU and CUDA kernels.

/// Which unary operation a kernel applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryKind {
    /// `−x`.
    Neg,
    /// `eˣ`.
    Exp,
    /// `ln x`.
    Log,
    /// `√x`.
    Sqrt,
    /// `xᵖ` for a finite scalar `p`.
    Pow(f64),
    /// `max(x, 0)`.
    Relu,
    /// `1 / (1 + e⁻ˣ)`.
    Sigmoid,
    /// `tanh x`.
    Tanh,
}

impl UnaryKind {
    /// The op name used in errors and in the graph.
    pub fn name(self) -> &'static str {
        match self {
            UnaryKind::Neg => "neg",
            UnaryKind::Exp => "exp",
            UnaryKind::Log => "log",
            UnaryKind::Sqrt => "sqrt",
            UnaryKind::Pow(_) => "pow_scalar",
            UnaryKind::Relu => "relu",
            UnaryKind::Sigmoid => "sigmoid",
            UnaryKind::Tanh => "tanh",
        }
    }

    /// Whether the backward is cheaper from the output than from the input (then the output
    /// is what the op saves, and the input can be freed).
    pub fn saves_output(self) -> bool {
        matches!(
            self,
            UnaryKind::Exp
                | UnaryKind::Sqrt
                | UnaryKind::Relu
                | UnaryKind::Sigmoid
                | UnaryKind::Tanh
        )
    }
}

/// `p` as a small integer exponent when it is one (then `powi` is exact and faster); both
/// devices' kernels pick their method for `pow_scalar` by it.
pub(crate) fn integer_exponent(p: f64) -> Option<i32> {
    (p.fract() == 0.0 && p.abs() <= 64.0).then_some(p as i32)
}
