//! The contract between autograd and distributed training, shown on a small CNN: every
//! parameter's gradient-ready event fires exactly once per backward, after its gradient is
//! final (also for a parameter used twice in forward), in reverse layer order; the
//! backward-finished hook fires once, after all of them.

use std::sync::Arc;

use parking_lot::Mutex;
use tandem::autograd::{register_grad_ready_hook, TensorBackward};
use tandem::core::{Device, Tensor};
use tandem::ops::linear::linear;

#[path = "support/grad_ready.rs"]
mod support;

#[test]
fn grad_ready_fires_once_per_parameter_after_its_gradient_is_final_in_reverse_layer_order() {
    support::check_contract(Device::Cpu);
}

#[test]
fn a_parameter_used_twice_gets_the_sum_of_both_contributions() {
    // d/dw of (w·x)·w summed = 2·w·x per element for a scalar pair, checked with numbers.
    let w = Tensor::from_vec(vec![3.0f32], &[1, 1], Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let x = Tensor::from_vec(vec![2.0f32], &[1, 1], Device::Cpu).unwrap();
    let count = Arc::new(Mutex::new(0));
    let c = count.clone();
    register_grad_ready_hook(&w, move |_| {
        *c.lock() += 1;
        Ok(())
    })
    .unwrap();
    let y = linear(&linear(&x, &w, None).unwrap(), &w, None).unwrap(); // y = w·w·x
    tandem::ops::sum_all(&y).unwrap().backward().unwrap();
    assert_eq!(*count.lock(), 1);
    assert_eq!(
        w.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![2.0 * 3.0 * 2.0]
    );
}
