//! Launch plans of the unary ops and their backward (`unary.cu`): pure functions from device
//! views to a [`Launch`], public so that the host harness (`tandem-cuda-harness`) runs the very
//! plans the ops run on a GPU.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch};
use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::{DType, Result};

use crate::elementwise_plan::elementwise_launch;
use crate::unary::shape::{integer_exponent, UnaryKind};

/// `unary.cu`, embedded.
pub static UNARY_KERNELS: KernelSource = KernelSource {
    name: "unary",
    source: include_str!("../unary.cu"),
    headers: &[],
};

/// How the pow_scalar kernels compute, chosen as the CPU kernel chooses (`UNARY_POW_*` in
/// unary.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PowMode {
    /// `x · x` forward (p = 2); `(g + g) · x` backward.
    Square = 0,
    /// `√x` (p = ½).
    Sqrt = 1,
    /// `powi` with a small integer exponent.
    Integer = 2,
    /// `powf`.
    General = 3,
    /// Backward for p = 0: zero.
    Zero = 4,
    /// Backward for p = 1: the gradient itself.
    One = 5,
}

/// `value` in the kernel's dtype, converted as the CPU kernels convert it (`T::from_f64`).
fn value_arg(dtype: DType, value: f64) -> KernelArg {
    match dtype {
        DType::F64 => KernelArg::F64(value),
        _ => KernelArg::F32(value as f32),
    }
}

/// The scalar arguments of pow_scalar's forward: mode, integer exponent, exponent.
fn pow_forward_args(dtype: DType, p: f64) -> [KernelArg; 3] {
    let (mode, k) = if p == 2.0 {
        (PowMode::Square, 0)
    } else if p == 0.5 {
        (PowMode::Sqrt, 0)
    } else if let Some(k) = integer_exponent(p) {
        (PowMode::Integer, k)
    } else {
        (PowMode::General, 0)
    };
    [
        KernelArg::I32(mode as i32),
        KernelArg::I32(k),
        value_arg(dtype, p),
    ]
}

/// The scalar arguments of pow_scalar's backward: mode, integer exponent of `x^(p−1)`, `p`,
/// `p − 1`.
fn pow_backward_args(dtype: DType, p: f64) -> [KernelArg; 4] {
    let q = p - 1.0;
    let (mode, k) = if p == 0.0 {
        (PowMode::Zero, 0)
    } else if p == 1.0 {
        (PowMode::One, 0)
    } else if p == 2.0 {
        (PowMode::Square, 0)
    } else if let Some(k) = integer_exponent(q) {
        (PowMode::Integer, k)
    } else {
        (PowMode::General, 0)
    };
    [
        KernelArg::I32(mode as i32),
        KernelArg::I32(k),
        value_arg(dtype, p),
        value_arg(dtype, q),
    ]
}

/// `out = kind(x)`: `x` any layout of `out`'s shape, `out` dense, f32 or f64.
pub fn unary_launch(kind: UnaryKind, out: DeviceView, x: DeviceView) -> Result<Launch> {
    let name = kind.name();
    match kind {
        UnaryKind::Pow(p) => {
            let scalars = pow_forward_args(out.dtype, p);
            elementwise_launch(name, &UNARY_KERNELS, name, out, &[x], &scalars)
        }
        _ => elementwise_launch(name, &UNARY_KERNELS, name, out, &[x], &[]),
    }
}

/// The kernels' name for `kind`'s backward, which is also the op name in its errors.
pub(crate) fn backward_name(kind: UnaryKind) -> &'static str {
    match kind {
        UnaryKind::Neg => "neg",
        UnaryKind::Exp => "exp_backward",
        UnaryKind::Log => "log_backward",
        UnaryKind::Sqrt => "sqrt_backward",
        UnaryKind::Pow(_) => "pow_scalar_backward",
        UnaryKind::Relu => "relu_backward",
        UnaryKind::Sigmoid => "sigmoid_backward",
        UnaryKind::Tanh => "tanh_backward",
    }
}

/// `out` = the gradient of `kind`'s input, from the output gradient `g` and what the forward
/// saved (the output when [`UnaryKind::saves_output`], else the input; not read for neg). `g`
/// and `saved` any layouts of `out`'s shape, `out` dense.
pub fn unary_backward_launch(
    kind: UnaryKind,
    out: DeviceView,
    g: DeviceView,
    saved: DeviceView,
) -> Result<Launch> {
    let name = backward_name(kind);
    match kind {
        UnaryKind::Neg => elementwise_launch(name, &UNARY_KERNELS, name, out, &[g], &[]),
        UnaryKind::Pow(p) => {
            let scalars = pow_backward_args(out.dtype, p);
            elementwise_launch(name, &UNARY_KERNELS, name, out, &[g, saved], &scalars)
        }
        _ => elementwise_launch(name, &UNARY_KERNELS, name, out, &[g, saved], &[]),
    }
}
