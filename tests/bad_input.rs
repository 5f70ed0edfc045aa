//! Bad input is an error that names the op and what was wrong — never a panic.

use tandem::core::storage::{CpuStorage, Storage};
use tandem::core::{DType, Device, Layout, Tensor};

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, Device::Cpu).unwrap()
}

#[test]
fn device_mismatch_names_the_op_and_both_devices() {
    let on_gpu = Tensor::from_storage(
        Storage::host_memory_labelled(CpuStorage::zeros(DType::F32, 6), Device::Cuda(1)),
        Layout::contiguous(&[2, 3]),
    )
    .unwrap();
    let err = tandem::ops::add(&zeros(&[2, 3]), &on_gpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("add") && err.contains("cpu") && err.contains("cuda:1"),
        "{err}"
    );
    let err = tandem::ops::matmul::matmul(&zeros(&[2, 3]), &on_gpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("matmul") && err.contains("cuda:1"), "{err}");
}

#[test]
fn matmul_inner_dimension_mismatch_names_both_shapes() {
    let err = tandem::ops::matmul::matmul(&zeros(&[2, 3]), &zeros(&[4, 5]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("matmul") && err.contains("[2, 3]") && err.contains("[4, 5]"),
        "{err}"
    );
}

#[test]
fn conv_channel_mismatch_names_both_shapes() {
    let params = tandem::ops::conv2d::Conv2dParams::default();
    let err =
        tandem::ops::conv2d::conv2d(&zeros(&[1, 3, 8, 8]), &zeros(&[4, 2, 3, 3]), None, &params)
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("conv2d") && err.contains("[1, 3, 8, 8]") && err.contains("[4, 2, 3, 3]"),
        "{err}"
    );
}

#[test]
fn cross_entropy_label_out_of_range_names_the_label_and_the_class_count() {
    let labels = Tensor::from_vec(vec![1i64, 10], &[2], Device::Cpu).unwrap();
    let err = tandem::ops::loss::cross_entropy(
        &zeros(&[2, 10]),
        &labels,
        tandem::ops::loss::Reduction::Mean,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("cross_entropy") && err.contains("10"), "{err}");
}

#[test]
fn creating_a_cuda_tensor_without_cuda_names_what_is_missing() {
    if tandem::core::cuda::is_available() {
        println!("skipped: this machine has a CUDA device");
        return;
    }
    let err = Tensor::zeros(&[1], DType::F32, Device::Cuda(0))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cuda:0") && err.contains("libcuda.so.1") && err.contains("TANDEM_CUDA_LIBS"),
        "{err}"
    );
}
