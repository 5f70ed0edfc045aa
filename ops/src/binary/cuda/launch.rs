//! Launch plans of the binary ops (`binary.cu`): pure functions from device views to a
//! [`Launch`], public so that the host harness (`tandem-cuda-harness`) runs the very plans the
//! ops run on a GPU.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch};
use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::Result;

use crate::binary::shape::{BinaryKind, ScalarKind};
use crate::elementwise_plan::elementwise_launch;

/// `binary.cu`, embedded.
pub static BINARY_KERNELS: KernelSource = KernelSource {
    name: "binary",
    source: include_str!("../binary.cu"),
    headers: &[],
};

/// The op's name, which is also its kernels' name.
fn name(kind: BinaryKind) -> &'static str {
    match kind {
        BinaryKind::Add => "add",
        BinaryKind::Sub => "sub",
        BinaryKind::Mul => "mul",
        BinaryKind::Div => "div",
    }
}

/// `out = a ∘ b` for `kind`'s operation. `a` and `b` are viewed with `out`'s shape (a broadcast
/// input expanded to it, stride 0 along the stretched dims); `out` is dense; f32 or f64.
pub fn binary_launch(
    kind: BinaryKind,
    out: DeviceView,
    a: DeviceView,
    b: DeviceView,
) -> Result<Launch> {
    let name = name(kind);
    elementwise_launch(name, &BINARY_KERNELS, name, out, &[a, b], &[])
}

/// `out = max(0, a + b)` (NaN stays NaN), with the shapes and layouts of [`binary_launch`].
pub fn add_relu_launch(out: DeviceView, a: DeviceView, b: DeviceView) -> Result<Launch> {
    elementwise_launch("add_relu", &BINARY_KERNELS, "add_relu", out, &[a, b], &[])
}

/// `out = x ∘ c` for a scalar `c`, computed in f64 and rounded once to the dtype, as the CPU
/// does; `x` any layout of `out`'s shape.
pub fn scalar_launch(kind: ScalarKind, out: DeviceView, x: DeviceView, c: f64) -> Result<Launch> {
    let name = kind.name();
    elementwise_launch(name, &BINARY_KERNELS, name, out, &[x], &[KernelArg::F64(c)])
}
