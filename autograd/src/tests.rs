//! Engine tests with two tiny ops written here (elementwise product and sum of two tensors),
//! so the engine is tested without `tandem-ops`.

use std::sync::Arc;

use parking_lot::Mutex;
use tandem_core::{DType, Device, Result, Tensor};

use crate::*;

fn zip(a: &Tensor, b: &Tensor, f: impl Fn(f64, f64) -> f64) -> Result<Tensor> {
    let (x, y) = (a.to_vec_f64()?, b.to_vec_f64()?);
    let v: Vec<f64> = x.iter().zip(&y).map(|(p, q)| f(*p, *q)).collect();
    Tensor::from_vec(v, a.dims(), Device::Cpu)?.to_dtype(a.dtype())
}

fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = zip(a, b, |x, y| x * y)?;
    let (sa, sb) = (a.detach(), b.detach());
    Ok(record_fn(out, &[a, b], "mul", move || {
        move |g: &Tensor| {
            Ok(vec![
                Some(zip(g, &sb, |x, y| x * y)?),
                Some(zip(g, &sa, |x, y| x * y)?),
            ])
        }
    }))
}

fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = zip(a, b, |x, y| x + y)?;
    Ok(record_fn(out, &[a, b], "add", || {
        |g: &Tensor| Ok(vec![Some(g.clone()), Some(g.clone())])
    }))
}

fn sum_all(a: &Tensor) -> Result<Tensor> {
    let total: f64 = a.to_vec_f64()?.iter().sum();
    let out = Tensor::from_vec(vec![total], &[], Device::Cpu)?.to_dtype(a.dtype())?;
    let shape = a.dims().to_vec();
    let dtype = a.dtype();
    Ok(record_fn(out, &[a], "sum", move || {
        move |g: &Tensor| {
            Ok(vec![Some(Tensor::full(
                &shape,
                g.item()?,
                dtype,
                Device::Cpu,
            )?)])
        }
    }))
}

fn param(values: &[f64]) -> Tensor {
    Tensor::from_slice(values, &[values.len()], Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap()
}

#[test]
fn product_rule_and_accumulation_over_two_uses() {
    let x = param(&[1.0, 2.0]);
    let w = param(&[3.0, 5.0]);
    // loss = sum(x*w + x*x): dL/dx = w + 2x, dL/dw = x
    let loss = sum_all(&add(&mul(&x, &w).unwrap(), &mul(&x, &x).unwrap()).unwrap()).unwrap();
    loss.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![5.0, 9.0]);
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
    // A second pass accumulates.
    let loss = sum_all(&mul(&x, &w).unwrap()).unwrap();
    loss.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 4.0]);
}

#[test]
fn hooks_fire_once_per_pass_after_the_gradient_is_final_and_in_reverse_layer_order() {
    let w1 = param(&[2.0]);
    let w2 = param(&[3.0]);
    let x = Tensor::from_slice(&[1.5f64], &[1], Device::Cpu).unwrap();
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    for (name, w) in [("w1", &w1), ("w2", &w2)] {
        let log = log.clone();
        let name = name.to_string();
        register_grad_ready_hook(w, move |ready| {
            assert!(ready.event.is_complete());
            assert!(ready.param.grad().unwrap().same_tensor(&ready.grad));
            log.lock().push(format!("{name}={}", ready.grad.item()?));
            Ok(())
        })
        .unwrap();
    }
    let log2 = log.clone();
    register_backward_finished_hook(&[w1.clone(), w2.clone()], move |summary| {
        log2.lock()
            .push(format!("finished({})", summary.reached.len()));
        Ok(())
    })
    .unwrap();
    // layer 1: h = x*w1; layer 2: y = h*w2 + h*w2 (w2 used twice). loss = y.
    let h = mul(&x, &w1).unwrap();
    let y = add(&mul(&h, &w2).unwrap(), &mul(&h, &w2).unwrap()).unwrap();
    sum_all(&y).unwrap().backward().unwrap();
    // d/dw2 = 2h = 6 (one event, with both contributions); d/dw1 = 2*w2*x = 9.
    assert_eq!(*log.lock(), vec!["w2=6", "w1=9", "finished(2)"]);
}

#[test]
fn a_freed_graph_is_an_error_and_retain_graph_allows_a_second_pass() {
    let w = param(&[2.0]);
    let loss = sum_all(&mul(&w, &w).unwrap()).unwrap();
    loss.backward_with(None, &BackwardOptions { retain_graph: true })
        .unwrap();
    loss.backward().unwrap();
    assert_eq!(w.grad().unwrap().item().unwrap(), 8.0);
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("retain_graph"), "{err}");
}

#[test]
fn no_grad_records_nothing_and_detach_cuts_the_graph() {
    let w = param(&[2.0]);
    let y = no_grad(|| mul(&w, &w).unwrap());
    assert!(!y.requires_grad());
    let z = mul(&w, &w).unwrap();
    assert!(z.requires_grad() && !z.detach().requires_grad());
    assert!(sum_all(&y).unwrap().backward().is_err());
}

#[test]
fn hook_errors_stop_backward() {
    let w = param(&[1.0]);
    register_grad_ready_hook(&w, |_| Err(tandem_core::Error::autograd("refused by hook"))).unwrap();
    let err = sum_all(&mul(&w, &w).unwrap())
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("refused by hook"));
}

#[test]
fn non_scalar_backward_needs_an_explicit_gradient() {
    let w = param(&[1.0, 2.0]);
    let y = mul(&w, &w).unwrap();
    assert!(y.backward().is_err());
    let g = Tensor::ones(&[2], DType::F64, Device::Cpu).unwrap();
    y.backward_with(Some(&g), &BackwardOptions::default())
        .unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 4.0]);
}

#[test]
fn gradcheck_accepts_a_correct_backward_and_rejects_a_wrong_one() {
    let a = param(&[0.3, -1.2, 2.0]);
    let b = param(&[1.1, 0.4, -0.7]);
    gradcheck(
        |x| mul(&x[0], &x[1]),
        &[a.clone(), b.clone()],
        &GradcheckOptions::default(),
    )
    .unwrap();
    let wrong = |x: &[Tensor]| -> Result<Tensor> {
        let out = zip(&x[0], &x[0], |p, q| p * q)?;
        Ok(record_fn(out, &[&x[0]], "bad_square", || {
            |g: &Tensor| Ok(vec![Some(g.clone())])
        }))
    };
    let err = gradcheck(wrong, &[a], &GradcheckOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("analytic"), "{err}");
}

#[test]
fn a_channels_last_leaf_gets_a_channels_last_gradient() {
    use tandem_core::MemoryFormat;
    let shape = [2, 3, 2, 2];
    let values: Vec<f64> = (0..24).map(|v| v as f64).collect();
    let w = Tensor::from_slice(&values, &shape, Device::Cpu)
        .unwrap()
        .contiguous_in(MemoryFormat::ChannelsLast)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let c = Tensor::from_slice(&values, &shape, Device::Cpu).unwrap();
    // loss = sum(w*c + w*w): dL/dw = c + 2w, delivered row-major by the test ops.
    let loss = sum_all(&add(&mul(&w, &c).unwrap(), &mul(&w, &w).unwrap()).unwrap()).unwrap();
    loss.backward().unwrap();
    let grad = w.grad().unwrap();
    assert!(grad.layout().is_channels_last(), "{:?}", grad.layout());
    let want: Vec<f64> = values.iter().map(|v| 3.0 * v).collect();
    assert_eq!(grad.to_vec::<f64>().unwrap(), want);
    // The next pass accumulates into it, keeping the format.
    sum_all(&mul(&w, &c).unwrap()).unwrap().backward().unwrap();
    let grad = w.grad().unwrap();
    assert!(grad.layout().is_channels_last());
    let want: Vec<f64> = values.iter().map(|v| 4.0 * v).collect();
    assert_eq!(grad.to_vec::<f64>().unwrap(), want);
    // A row-major leaf still gets a row-major gradient.
    let r = Tensor::from_slice(&values, &shape, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    sum_all(&mul(&r, &c).unwrap()).unwrap().backward().unwrap();
    assert!(r.grad().unwrap().is_contiguous());
}
