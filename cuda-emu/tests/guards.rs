//! A kernel writing past the end of its buffer damages the guard bytes; the emulator reports it
//! at the next synchronisation, naming the allocation, and the device stays faulted (as after
//! an illegal address on a GPU). Its own process: the fault is sticky.

mod common;
#[path = "common/kernels.rs"]
mod kernels;

use tandem_core::cuda;
use tandem_core::{DType, Device, Tensor};

#[test]
fn a_write_past_the_end_of_an_allocation_is_reported_at_the_next_synchronisation() {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    let t = Tensor::zeros(&[10], DType::F32, Device::Cuda(0)).unwrap();
    let (_, ptr) = cuda::device_pointer("test", &t).unwrap();
    // In bounds: fine.
    dev.launch(&kernels::write_one(ptr, 9, 1.0), dev.compute_stream())
        .unwrap();
    dev.synchronize().unwrap();
    // One past the end.
    dev.launch(&kernels::write_one(ptr, 10, 1.0), dev.compute_stream())
        .unwrap();
    let err = dev.synchronize().unwrap_err().to_string();
    assert!(err.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{err}");
    let fault = common::last_fault();
    assert!(fault.contains("guard bytes damaged"), "{fault}");
    assert!(fault.contains("of 40 bytes"), "{fault}");
    assert!(
        fault.contains("after its end") && fault.contains("offset +40"),
        "{fault}"
    );
    // Sticky, as on a GPU.
    assert!(dev.synchronize().is_err());
}
