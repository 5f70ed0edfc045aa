//! A kernel writing to a buffer after its stream-ordered free writes poisoned memory in
//! quarantine; the emulator finds the change and names the allocation and who freed it. Its own
//! process: the fault is sticky.

mod common;
#[path = "common/kernels.rs"]
mod kernels;

use tandem_core::cuda;
use tandem_core::{DType, Device, Tensor};

#[test]
fn a_write_after_a_stream_ordered_free_is_reported() {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    let t = Tensor::full(&[16], 1.0, DType::F32, Device::Cuda(0)).unwrap();
    let (_, ptr) = cuda::device_pointer("test", &t).unwrap();
    dev.synchronize().unwrap();
    assert_eq!(common::check_quarantine(), 0, "{}", common::last_fault());
    // The free is ordered on the compute stream; the launch after it writes freed memory.
    drop(t);
    dev.launch(&kernels::write_one(ptr, 3, 5.0), dev.compute_stream())
        .unwrap();
    dev.synchronize().unwrap();
    assert_eq!(
        common::check_quarantine(),
        700,
        "CUDA_ERROR_ILLEGAL_ADDRESS"
    );
    let fault = common::last_fault();
    assert!(fault.contains("use after free"), "{fault}");
    assert!(
        fault.contains("of 64 bytes") && fault.contains("offset 12"),
        "{fault}"
    );
    assert!(fault.contains("cuMemFreeAsync on stream"), "{fault}");
    assert!(dev.synchronize().is_err(), "the fault is sticky");
}
