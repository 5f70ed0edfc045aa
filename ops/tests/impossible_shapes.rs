//! Ops asked for results that cannot exist — a product of dims past what any tensor can hold,
//! or more memory than the machine has — return an error naming the op: never a panic, an
//! abort, or a wrapped-around size. The inputs are small tensors or broadcast views, so
//! nothing large is ever allocated.

use tandem_core::{DType, Device, Tensor};
use tandem_ops as ops;

fn zeros(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, Device::Cpu).unwrap()
}

/// A broadcast view of one zero to `shape` (no memory behind the extra elements).
fn broadcast(shape: &[usize]) -> Tensor {
    ops::expand(&zeros(&vec![1; shape.len()]), shape).unwrap()
}

fn error_of(result: tandem_core::Result<Tensor>) -> String {
    match result {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn matmul_whose_product_cannot_exist_is_an_error_naming_matmul() {
    // [2^20, 1] x [1, 2^20]: 2^40 f32 (4 TiB) of output.
    let err = error_of(ops::matmul(&zeros(&[1 << 20, 1]), &zeros(&[1, 1 << 20])));
    assert!(
        err.starts_with("matmul:") && err.contains("out of memory"),
        "{err}"
    );
    // [2^40, 1] x [1, 2^40]: 2^80 elements, past usize.
    let (a, b) = (broadcast(&[1 << 40, 1]), broadcast(&[1, 1 << 40]));
    let err = error_of(ops::matmul(&a, &b));
    assert!(
        err.starts_with("matmul:") && err.contains("more elements"),
        "{err}"
    );
}

#[test]
fn sum_over_a_view_too_large_to_materialise_is_an_error_naming_sum() {
    // 2^58 elements of a broadcast view.
    let x = broadcast(&[1 << 29, 1 << 29]);
    for result in [
        ops::sum(&x, &[0], false),
        ops::sum_all(&x),
        ops::mean(&x, &[1], true),
    ] {
        let err = error_of(result);
        assert!(
            err.starts_with("sum:") && err.contains("out of memory"),
            "{err}"
        );
    }
}

#[test]
fn conv2d_whose_output_cannot_exist_is_an_error_naming_conv2d() {
    let x = zeros(&[1, 1, 1, 1]);
    let w = zeros(&[1024, 1, 1, 1]);
    // Padding 2^14 on a 1×1 input: 1024 channels of (2^15 + 1)² pixels, 2^40 f32.
    let padded = ops::Conv2dParams {
        padding: (1 << 14, 1 << 14),
        ..Default::default()
    };
    let err = error_of(ops::conv2d(&x, &w, None, &padded));
    assert!(
        err.starts_with("conv2d:") && err.contains("out of memory"),
        "{err}"
    );
    // Sizes that overflow: padding and dilation near usize::MAX.
    let huge_padding = ops::Conv2dParams {
        padding: (usize::MAX / 2 + 1, 1),
        ..Default::default()
    };
    let err = error_of(ops::conv2d(&x, &w, None, &huge_padding));
    assert!(
        err.starts_with("conv2d:") && err.contains("overflow"),
        "{err}"
    );
    let huge_dilation = ops::Conv2dParams {
        dilation: (usize::MAX, 1),
        ..Default::default()
    };
    let err = error_of(ops::conv2d(&x, &zeros(&[1, 1, 3, 1]), None, &huge_dilation));
    assert!(err.starts_with("conv2d:"), "{err}");
}

#[test]
fn cat_whose_size_overflows_is_an_error_naming_cat() {
    let part = broadcast(&[1 << 59]);
    let parts: Vec<&Tensor> = vec![&part; 16];
    let err = error_of(ops::cat(&parts, 0));
    assert!(
        err.starts_with("cat:") && err.contains("more elements"),
        "{err}"
    );
    let parts: Vec<&Tensor> = vec![&part; 40];
    let err = error_of(ops::cat(&parts, 0));
    assert!(
        err.starts_with("cat:") && err.contains("more elements"),
        "{err}"
    );
}

#[test]
fn pools_with_sizes_that_overflow_are_errors_naming_the_pool() {
    let x = zeros(&[1, 1, 2, 2]);
    let err = error_of(ops::max_pool2d(
        &x,
        (usize::MAX, 2),
        (1, 1),
        (usize::MAX / 2, 0),
    ));
    assert!(err.starts_with("max_pool2d:"), "{err}");
    let err = error_of(ops::avg_pool2d(
        &x,
        (1 << 33, 1 << 33),
        (1, 1),
        (1 << 32, 1 << 32),
    ));
    assert!(err.starts_with("avg_pool2d:"), "{err}");
    let err = error_of(ops::adaptive_avg_pool2d(&x, (1 << 40, 1 << 40)));
    assert!(
        err.starts_with("adaptive_avg_pool2d:") && err.contains("more elements"),
        "{err}"
    );
}
