//! A kernel reading one element past the end of an allocation touches the inaccessible page
//! placed after it: the emulator names the kernel, the address and the allocation it overran,
//! and aborts the process. The scenario runs in a child process (this test binary run again
//! with [`CHILD`] set, only this test), whose stderr the test reads.

mod common;
#[path = "common/kernels.rs"]
mod kernels;

use tandem_core::cuda;
use tandem_core::{DType, Device, Tensor};

/// Set in the child process: run the scenario instead of checking it.
const CHILD: &str = "TANDEM_CUDA_EMU_TEST_GUARD_PAGE_CHILD";
const TEST: &str = "a_kernel_reading_one_element_past_the_end_is_reported_and_aborts_the_process";

#[test]
fn a_kernel_reading_one_element_past_the_end_is_reported_and_aborts_the_process() {
    if std::env::var_os(CHILD).is_some() {
        read_past_the_end();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let output = std::process::Command::new(exe)
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let both = format!(
        "status {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert!(
        stdout.contains("in bounds: ok"),
        "the read in bounds failed: {both}"
    );
    assert!(
        !output.status.success() && !stdout.contains("past the end: returned"),
        "the read past the end passed silently: {both}"
    );
    assert!(stderr.contains("out-of-range access"), "{both}");
    assert!(
        stderr.contains("kernel read_one (grid [1, 1, 1], block [32, 1, 1]) on stream"),
        "the report does not name the kernel: {both}"
    );
    assert!(stderr.contains("read address 0x"), "{both}");
    assert!(
        stderr.contains("0 bytes past the end of allocation #")
            && stderr.contains("of 256 bytes at 0x")
            && stderr.contains("at offset +256"),
        "the report does not name the allocation: {both}"
    );
}

/// The child's scenario: one read in bounds, then one a single element past the end of a
/// 256-byte buffer (a multiple of the 256-byte rounding, so its end touches the inaccessible
/// page). The second never returns.
fn read_past_the_end() {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    let t = Tensor::zeros(&[64], DType::F32, Device::Cuda(0)).unwrap();
    let out = Tensor::zeros(&[1], DType::F32, Device::Cuda(0)).unwrap();
    let (_, ptr) = cuda::device_pointer("test", &t).unwrap();
    let (_, out_ptr) = cuda::device_pointer("test", &out).unwrap();
    dev.launch(&kernels::read_one(ptr, 63, out_ptr), dev.compute_stream())
        .unwrap();
    dev.synchronize().unwrap();
    println!("in bounds: ok");
    dev.launch(&kernels::read_one(ptr, 64, out_ptr), dev.compute_stream())
        .unwrap();
    let result = dev.synchronize();
    println!("past the end: returned {result:?}");
}
