//! Release-mode timing of the LeNet-5 elementwise-and-pool stages (ReLU then `MaxPool2d(2)`
//! on `[64, 6, 28, 28]` and `[64, 16, 10, 10]`, f32), forward and forward + backward, at 1 and
//! 2 rayon threads. Ignored by default:
//! `cargo test -p tandem-ops --release pool_timing -- --ignored --nocapture`.

use tandem_autograd::backward;
use tandem_core::{DType, Device, Generator, Tensor};

use crate::testing::best_ms;
use crate::unary::relu;

#[test]
#[ignore]
fn pool_timing() {
    let mut gen = Generator::new(1);
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for shape in [[64, 6, 28, 28], [64, 16, 10, 10]] {
                let x = Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen)
                    .unwrap()
                    .with_requires_grad()
                    .unwrap();
                let r = relu(&x.detach()).unwrap().with_requires_grad().unwrap();
                let mut out = shape;
                out[2] /= 2;
                out[3] /= 2;
                let g_pool =
                    Tensor::randn(&out, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
                let g_relu =
                    Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen).unwrap();
                let stage = |t: &Tensor, g: &Tensor, f: &dyn Fn(&Tensor) -> Tensor| {
                    let fwd = best_ms(|| drop(f(t)));
                    let both = best_ms(|| {
                        let y = f(t);
                        backward(&y, Some(g), &Default::default()).unwrap();
                        t.set_grad(None).unwrap();
                    });
                    (fwd, both - fwd)
                };
                let (rf, rb) = stage(&x, &g_relu, &|t| relu(t).unwrap());
                let (pf, pb) = stage(&r, &g_pool, &|t| {
                    super::max_pool2d(t, (2, 2), (2, 2), (0, 0)).unwrap()
                });
                println!(
                    "threads {threads} {shape:?}: relu fwd {rf:.3} bwd {rb:.3} ms | \
                     max_pool2d fwd {pf:.3} bwd {pb:.3} ms"
                );
            }
        });
    }
}
