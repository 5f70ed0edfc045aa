//! Release-mode timing of the ResNet-20 normalisation stages (batch norm in training mode,
//! ReLU, the residual add, and the residual join `add_relu(batch_norm(x), skip)` unfused and
//! as `batch_norm_add_relu`, on `[32, 16, 32, 32]`, `[32, 32, 16, 16]` and `[32, 64, 8, 8]`,
//! f32), forward and forward + backward, at 1 and 2 rayon threads. Ignored by default:
//! `cargo test -p tandem-ops --release batch_norm_timing -- --ignored --nocapture`.

use tandem_autograd::backward;
use tandem_core::{DType, Device, Generator, Tensor};

use crate::binary::add;
use crate::testing::best_ms;
use crate::unary::relu;

#[test]
#[ignore]
fn batch_norm_timing() {
    let mut gen = Generator::new(2);
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for shape in [[32, 16, 32, 32], [32, 32, 16, 16], [32, 64, 8, 8]] {
                let c = shape[1];
                let rand = |gen: &mut Generator| {
                    Tensor::randn(&shape, 0.0, 1.0, DType::F32, Device::Cpu, gen).unwrap()
                };
                let x = rand(&mut gen).with_requires_grad().unwrap();
                let skip = rand(&mut gen).with_requires_grad().unwrap();
                let g = rand(&mut gen);
                let ones = || Tensor::ones(&[c], DType::F32, Device::Cpu).unwrap();
                let zeros = || Tensor::zeros(&[c], DType::F32, Device::Cpu).unwrap();
                let (rm, rv) = (zeros(), ones());
                let w = ones().with_requires_grad().unwrap();
                let b = zeros().with_requires_grad().unwrap();
                let leaves = [&x, &skip, &w, &b];
                let stage = |f: &dyn Fn() -> Tensor| {
                    let fwd = best_ms(|| drop(f()));
                    let both = best_ms(|| {
                        let y = f();
                        backward(&y, Some(&g), &Default::default()).unwrap();
                        leaves.iter().for_each(|t| t.set_grad(None).unwrap());
                    });
                    (fwd, both - fwd)
                };
                let bn = || {
                    super::batch_norm(
                        &x,
                        Some(&rm),
                        Some(&rv),
                        Some(&w),
                        Some(&b),
                        true,
                        0.1,
                        1e-5,
                    )
                    .unwrap()
                };
                let (bf, bb) = stage(&bn);
                let (rf, rb) = stage(&|| relu(&x).unwrap());
                let (af, ab) = stage(&|| add(&x, &skip).unwrap());
                let join = || {
                    let y = bn();
                    crate::binary::add_relu(&y, &skip).unwrap()
                };
                let (jf, jb) = stage(&join);
                let fused = || {
                    super::batch_norm_add_relu(
                        &x,
                        &skip,
                        Some(&rm),
                        Some(&rv),
                        Some(&w),
                        Some(&b),
                        true,
                        0.1,
                        1e-5,
                    )
                    .unwrap()
                };
                let (ff, fb) = stage(&fused);
                println!(
                    "threads {threads} {shape:?}: batch_norm fwd {bf:.3} bwd {bb:.3} | \
                     relu fwd {rf:.3} bwd {rb:.3} | add fwd {af:.3} bwd {ab:.3} | \
                     add_relu(batch_norm) fwd {jf:.3} bwd {jb:.3} | \
                     batch_norm_add_relu fwd {ff:.3} bwd {fb:.3} ms"
                );
            }
        });
    }
}
