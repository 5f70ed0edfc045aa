//! Helpers for the ops' tests: random f64 leaves (contiguous or not) and a gradcheck wrapper.

use tandem_autograd::{gradcheck, GradcheckOptions};
use tandem_core::{DType, Device, Generator, Result, Tensor};

/// A random f64 leaf in [-1, 1) that requires grad.
pub fn rand_f64(shape: &[usize], seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::rand(shape, -1.0, 1.0, DType::F64, Device::Cpu, &mut g)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

/// A random f64 leaf of `shape` whose layout is not contiguous: it is the transpose of its
/// last two dims' storage order.
pub fn rand_f64_noncontiguous(shape: &[usize], seed: u64) -> Tensor {
    assert!(shape.len() >= 2);
    let mut swapped = shape.to_vec();
    let r = shape.len();
    swapped.swap(r - 1, r - 2);
    let base = rand_f64(&swapped, seed).detach();
    let t = base
        .view_detached(base.layout().transpose("test", r - 1, r - 2).unwrap())
        .unwrap();
    assert!(!t.is_contiguous());
    t.set_requires_grad(true).unwrap();
    t
}

/// Gradient-checks `f` at `inputs`, panicking with the mismatch.
pub fn check(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs, &GradcheckOptions::default()) {
        panic!("{e}");
    }
}
