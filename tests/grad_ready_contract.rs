//! The contract between autograd and distributed training, shown on a small CNN: every
//! parameter's gradient-ready event fires exactly once per backward, after its gradient is
//! final (also for a parameter used twice in forward), in reverse layer order; the
//! backward-finished hook fires once, after all of them.

use std::sync::Arc;

use parking_lot::Mutex;
use tandem::autograd::{register_backward_finished_hook, register_grad_ready_hook, TensorBackward};
use tandem::core::{DType, Device, Generator, Tensor};
use tandem::ops::conv2d::{conv2d, Conv2dParams};
use tandem::ops::linear::linear;
use tandem::ops::loss::{cross_entropy, Reduction};
use tandem::ops::unary::relu;
use tandem::ops::{flatten, mul_scalar};

struct Cnn {
    /// (layer number, parameter name, tensor) in registration order.
    params: Vec<(usize, &'static str, Tensor)>,
}

impl Cnn {
    fn new(gen: &mut Generator) -> Self {
        let mut p = |shape: &[usize]| {
            Tensor::randn(shape, 0.0, 0.3, DType::F32, Device::Cpu, gen)
                .unwrap()
                .with_requires_grad()
                .unwrap()
        };
        let params = vec![
            (1, "conv1.weight", p(&[4, 1, 3, 3])),
            (1, "conv1.bias", p(&[4])),
            (2, "conv2.weight", p(&[6, 4, 3, 3])),
            (2, "conv2.bias", p(&[6])),
            (3, "fc.weight", p(&[8, 6 * 4 * 4])),
            (3, "fc.bias", p(&[8])),
            // Used twice: by layer 4 and again by layer 5.
            (5, "shared.weight", p(&[8, 8])),
            (6, "head.weight", p(&[3, 8])),
        ];
        Cnn { params }
    }

    fn get(&self, name: &str) -> &Tensor {
        &self.params.iter().find(|(_, n, _)| *n == name).unwrap().2
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let same = Conv2dParams::default();
        let h = relu(
            &conv2d(
                x,
                self.get("conv1.weight"),
                Some(self.get("conv1.bias")),
                &same,
            )
            .unwrap(),
        )
        .unwrap();
        let h = relu(
            &conv2d(
                &h,
                self.get("conv2.weight"),
                Some(self.get("conv2.bias")),
                &same,
            )
            .unwrap(),
        )
        .unwrap();
        let h = relu(
            &linear(
                &flatten(&h, 1, -1).unwrap(),
                self.get("fc.weight"),
                Some(self.get("fc.bias")),
            )
            .unwrap(),
        )
        .unwrap();
        let h = linear(&h, self.get("shared.weight"), None).unwrap();
        let h = mul_scalar(
            &relu(&linear(&h, self.get("shared.weight"), None).unwrap()).unwrap(),
            0.5,
        )
        .unwrap();
        let logits = linear(&h, self.get("head.weight"), None).unwrap();
        cross_entropy(&logits, y, Reduction::Mean).unwrap()
    }
}

#[derive(Debug, Clone)]
enum Record {
    Ready {
        layer: usize,
        name: &'static str,
        grad_at_event: Vec<f32>,
    },
    Finished,
}

#[test]
fn grad_ready_fires_once_per_parameter_after_its_gradient_is_final_in_reverse_layer_order() {
    let mut gen = Generator::new(11);
    let model = Cnn::new(&mut gen);
    let x = Tensor::randn(&[5, 1, 8, 8], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
    let y = Tensor::from_vec(vec![0i64, 2, 1, 1, 0], &[5], Device::Cpu).unwrap();

    let log: Arc<Mutex<Vec<Record>>> = Arc::default();
    for (layer, name, p) in &model.params {
        let (log, layer, name) = (log.clone(), *layer, *name);
        register_grad_ready_hook(p, move |ready| {
            assert!(
                ready.event.is_complete() || {
                    ready.event.synchronize()?;
                    true
                }
            );
            let grad_at_event = ready.grad.to_vec::<f32>()?;
            log.lock().push(Record::Ready {
                layer,
                name,
                grad_at_event,
            });
            Ok(())
        })
        .unwrap();
    }
    let all: Vec<Tensor> = model.params.iter().map(|(_, _, p)| p.clone()).collect();
    let finished_log = log.clone();
    register_backward_finished_hook(&all, move |summary| {
        assert_eq!(summary.reached.len(), 8);
        finished_log.lock().push(Record::Finished);
        Ok(())
    })
    .unwrap();

    for pass in 0..2 {
        for p in &all {
            p.set_grad(None).unwrap();
        }
        log.lock().clear();
        model.loss(&x, &y).backward().unwrap();
        let records = log.lock().clone();

        // Exactly once per parameter, then the finished hook, once, last.
        assert_eq!(
            records.len(),
            model.params.len() + 1,
            "pass {pass}: {records:?}"
        );
        assert!(matches!(records.last(), Some(Record::Finished)));
        let mut names: Vec<&str> = records
            .iter()
            .filter_map(|r| match r {
                Record::Ready { name, .. } => Some(*name),
                Record::Finished => None,
            })
            .collect();
        // Reverse layer order: the layer numbers of successive events never increase.
        let layers: Vec<usize> = records
            .iter()
            .filter_map(|r| match r {
                Record::Ready { layer, .. } => Some(*layer),
                Record::Finished => None,
            })
            .collect();
        assert!(
            layers.windows(2).all(|w| w[0] >= w[1]),
            "pass {pass}: layers in event order {layers:?}"
        );
        assert_eq!(layers.first(), Some(&6));
        assert_eq!(layers.last(), Some(&1));
        // After the gradient is final: what the hook saw is what .grad holds at the end,
        // including the parameter used twice (both contributions were in).
        for r in &records {
            if let Record::Ready {
                name,
                grad_at_event,
                ..
            } = r
            {
                let final_grad = model.get(name).grad().unwrap().to_vec::<f32>().unwrap();
                assert_eq!(
                    grad_at_event, &final_grad,
                    "pass {pass}: {name} changed after its event"
                );
            }
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 8);
    }
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
