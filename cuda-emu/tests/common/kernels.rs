//! Small kernels for the emulator's own tests, compiled by the emulated NVRTC through tandem's
//! kernel path.

#![allow(dead_code)]

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

// out[0] = p[index] (one thread): reads one float, wherever `index` points.
extern "C" __global__ void read_one(const float* p, long long index, float* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = p[index];
    }
}
TANDEM_HOST_EXPORT(read_one)

// Spins until *flag is non-zero or `limit` clock64() cycles have passed; writes the flag it saw
// last to out[0] (0: it gave up).
extern "C" __global__ void wait_for_flag(const volatile unsigned int* flag, long long limit,
                                         unsigned int* out) {
    long long start = clock64();
    unsigned int seen = *flag;
    while (seen == 0u && clock64() - start < limit) {
        seen = *flag;
    }
    out[0] = seen;
}
TANDEM_HOST_EXPORT(wait_for_flag)

// *started = 1, then as wait_for_flag.
extern "C" __global__ void signal_then_wait(volatile unsigned int* started,
                                            const volatile unsigned int* flag, long long limit,
                                            unsigned int* out) {
    *started = 1u;
    long long start = clock64();
    unsigned int seen = *flag;
    while (seen == 0u && clock64() - start < limit) {
        seen = *flag;
    }
    out[0] = seen;
}
TANDEM_HOST_EXPORT(signal_then_wait)

// *flag = value (one thread).
extern "C" __global__ void set_flag(unsigned int* flag, unsigned int value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        *flag = value;
    }
}
TANDEM_HOST_EXPORT(set_flag)
"#,
    headers: &[],
};

/// A launch of the `FAULTS` kernel `kernel` on one block of `threads` threads.
fn faults(kernel: &str, threads: u32, args: Vec<KernelArg>) -> Launch {
    Launch {
        source: &FAULTS,
        kernel: kernel.to_string(),
        config: LaunchConfig::new("test", [1, 1, 1], [threads, 1, 1], 0).unwrap(),
        args,
    }
}

/// A launch of `write_one(p, index, value)`.
pub fn write_one(ptr: u64, index: i64, value: f32) -> Launch {
    let args = vec![
        KernelArg::Out(ptr),
        KernelArg::I64(index),
        KernelArg::F32(value),
    ];
    faults("write_one", 32, args)
}

/// A launch of `read_one(p, index, out)`: `out[0] = p[index]`.
pub fn read_one(ptr: u64, index: i64, out: u64) -> Launch {
    let args = vec![
        KernelArg::In(ptr),
        KernelArg::I64(index),
        KernelArg::Out(out),
    ];
    faults("read_one", 32, args)
}

/// A launch of `wait_for_flag(flag, limit, out)`: one thread spinning until `*flag != 0` or
/// `limit` cycles of clock64() have passed, then `out[0] = *flag`.
pub fn wait_for_flag(flag: u64, limit: i64, out: u64) -> Launch {
    let args = vec![
        KernelArg::In(flag),
        KernelArg::I64(limit),
        KernelArg::Out(out),
    ];
    faults("wait_for_flag", 1, args)
}

/// A launch of `set_flag(flag, value)`.
pub fn set_flag(flag: u64, value: u32) -> Launch {
    faults(
        "set_flag",
        32,
        vec![KernelArg::Out(flag), KernelArg::U32(value)],
    )
}

/// A launch of `signal_then_wait(started, flag, limit, out)`: `*started = 1`, then as
/// [`wait_for_flag`].
pub fn signal_then_wait(started: u64, flag: u64, limit: i64, out: u64) -> Launch {
    let args = vec![
        KernelArg::Out(started),
        KernelArg::In(flag),
        KernelArg::I64(limit),
        KernelArg::Out(out),
    ];
    faults("signal_then_wait", 1, args)
}
