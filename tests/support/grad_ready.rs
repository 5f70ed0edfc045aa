//! The gradient-ready contract, checked on any device: shared by `grad_ready_contract.rs`
//! (the CPU) and `cuda_grad_ready.rs` (a GPU).

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
    /// Parameters drawn on the CPU (the same values on every device) and moved to `device`.
    fn new(gen: &mut Generator, device: Device) -> Self {
        let mut p = |shape: &[usize]| {
            Tensor::randn(shape, 0.0, 0.3, DType::F32, Device::Cpu, gen)
                .unwrap()
                .to_device(device)
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

/// Checks the contract on `device` (parameters, inputs and backward there) and returns the
/// final gradients by parameter name.
pub fn check_contract(device: Device) -> Vec<(&'static str, Vec<f32>)> {
    let mut gen = Generator::new(11);
    let model = Cnn::new(&mut gen, device);
    let x = Tensor::randn(&[5, 1, 8, 8], 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
        .unwrap()
        .to_device(device)
        .unwrap();
    let y = Tensor::from_vec(vec![0i64, 2, 1, 1, 0], &[5], Device::Cpu)
        .unwrap()
        .to_device(device)
        .unwrap();

    let log: Arc<Mutex<Vec<Record>>> = Arc::default();
    for (layer, name, p) in &model.params {
        let (log, layer, name) = (log.clone(), *layer, *name);
        register_grad_ready_hook(p, move |ready| {
            // The event is recorded on the parameter's device (its compute stream).
            assert_eq!(
                ready.event.device(),
                device,
                "{name}: event on the wrong device"
            );
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
    model
        .params
        .iter()
        .map(|(_, name, p)| (*name, p.grad().unwrap().to_vec::<f32>().unwrap()))
        .collect()
}
