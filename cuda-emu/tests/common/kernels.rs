//! Small kernels for the emulator's own tests, compiled by the emulated NVRTC through tandem's
//! kernel path.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};

pub static FAULTS: KernelSource = KernelSource {
    name: "cuda_emu_faults",
    source: r#"
#include "tandem.cuh"

// Writes one float at p[index] (one thread).
extern "C" __global__ void write_one(float* p, long long index, float value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        p[index] = value;
    }
}
TANDEM_HOST_EXPORT(write_one)
"#,
    headers: &[],
};

/// A launch of `write_one(p, index, value)`.
pub fn write_one(ptr: u64, index: i64, value: f32) -> Launch {
    Launch {
        source: &FAULTS,
        kernel: "write_one".to_string(),
        config: LaunchConfig::new("test", [1, 1, 1], [32, 1, 1], 0).unwrap(),
        args: vec![
            KernelArg::Out(ptr),
            KernelArg::I64(index),
            KernelArg::F32(value),
        ],
    }
}
