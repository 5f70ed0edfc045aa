//! How many event objects a backward creates (issue 19, defect 8): none without gradient-ready
//! hooks, and with hooks the same objects again and again across backwards.
//!
//! One test in its own binary: the count of created events is process-wide, and other tests
//! running beside it would create events of their own.

use std::sync::Arc;

use parking_lot::Mutex;
use tandem_autograd::{record_fn, register_grad_ready_hook, TensorBackward};
use tandem_core::stream::events_created;
use tandem_core::{Device, Result, Tensor};

/// `Σ (w_i · x_i)` over several parameters, as one op written here so the test needs no ops
/// crate: the backward of each parameter is `x_i`.
fn weighted_sum(params: &[Tensor], x: &[f64]) -> Result<Tensor> {
    let mut total = 0.0;
    for (p, xi) in params.iter().zip(x) {
        total += p.to_vec_f64()?.iter().sum::<f64>() * xi;
    }
    let out = Tensor::from_vec(vec![total], &[], Device::Cpu)?;
    let inputs: Vec<&Tensor> = params.iter().collect();
    let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.dims().to_vec()).collect();
    let x = x.to_vec();
    Ok(record_fn(out, &inputs, "weighted_sum", move || {
        move |g: &Tensor| {
            let g = g.item()?;
            shapes
                .iter()
                .zip(&x)
                .map(|(shape, xi)| {
                    Tensor::full(shape, g * xi, tandem_core::DType::F64, Device::Cpu).map(Some)
                })
                .collect()
        }
    }))
}

#[test]
fn backward_creates_no_events_without_hooks_and_reuses_them_with_hooks() {
    let params: Vec<Tensor> = (0..8)
        .map(|i| {
            Tensor::from_vec(vec![1.0 + i as f64; 3], &[3], Device::Cpu)
                .unwrap()
                .with_requires_grad()
                .unwrap()
        })
        .collect();
    let x: Vec<f64> = (0..8).map(|i| 0.5 * i as f64).collect();

    // No hooks: no event is recorded, so none is created.
    let before = events_created();
    for _ in 0..3 {
        weighted_sum(&params, &x).unwrap().backward().unwrap();
    }
    assert_eq!(
        events_created() - before,
        0,
        "a backward without gradient-ready hooks created events"
    );

    // With a hook on every parameter each hook still gets a complete event, once per backward.
    let seen = Arc::new(Mutex::new(0usize));
    let handles: Vec<_> = params
        .iter()
        .map(|p| {
            let seen = seen.clone();
            register_grad_ready_hook(p, move |ready| {
                assert!(ready.event.is_complete());
                assert_eq!(ready.event.device(), Device::Cpu);
                *seen.lock() += 1;
                Ok(())
            })
            .unwrap()
        })
        .collect();
    weighted_sum(&params, &x).unwrap().backward().unwrap();
    let after_first = events_created();
    assert!(
        after_first - before <= params.len() as u64,
        "the first backward with hooks created {} events for {} parameters",
        after_first - before,
        params.len()
    );
    for _ in 0..5 {
        weighted_sum(&params, &x).unwrap().backward().unwrap();
    }
    assert_eq!(
        events_created(),
        after_first,
        "later backwards must reuse the events of the first"
    );
    assert_eq!(
        *seen.lock(),
        6 * params.len(),
        "one call per parameter per backward"
    );

    // Removing the hooks stops the events again.
    for h in handles {
        h.remove();
    }
    let before = events_created();
    weighted_sum(&params, &x).unwrap().backward().unwrap();
    assert_eq!(events_created(), before);
}
