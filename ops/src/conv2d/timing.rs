//! Release-mode timing of the conv2d CPU kernels over the LeNet-5 and ResNet-20 layer shapes
//! (forward, input gradient, weight gradient), at 1 and 2 rayon threads. Ignored by default:
//! `cargo test -p tandem-ops --release conv_timing -- --ignored --nocapture`.

use tandem_core::alloc::recycle;

use super::cpu::{backward, forward, Geometry, Grads, Needs};

use crate::testing::best_ms;

/// Hands the gradients back to the caching allocator, as dropping their tensors would.
fn recycle_all(grads: Grads<f32>) {
    [grads.input, grads.weight, grads.bias]
        .into_iter()
        .flatten()
        .for_each(recycle);
}

/// `(name, N, C, H, W, O, k, stride, pad)` of a layer.
type Shape = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// The layer shapes timed.
const SHAPES: [Shape; 8] = [
    ("lenet1", 64, 1, 28, 28, 6, 5, 1, 2),
    ("lenet2", 64, 6, 14, 14, 16, 5, 1, 0),
    ("r20_3_16", 32, 3, 32, 32, 16, 3, 1, 1),
    ("r20_16_16", 32, 16, 32, 32, 16, 3, 1, 1),
    ("r20_16_32s2", 32, 16, 32, 32, 32, 3, 2, 1),
    ("r20_32_32", 32, 32, 16, 16, 32, 3, 1, 1),
    ("r20_32_64s2", 32, 32, 16, 16, 64, 3, 2, 1),
    ("r20_64_64", 32, 64, 8, 8, 64, 3, 1, 1),
];

#[test]
#[ignore]
fn conv_timing() {
    // CONV_SHAPE=<name prefix> and CONV_THREADS=<n> narrow the run (for profiling).
    let only_shape = std::env::var("CONV_SHAPE").unwrap_or_default();
    let thread_counts: Vec<usize> = match std::env::var("CONV_THREADS") {
        Ok(t) => vec![t.parse().unwrap_or(1)],
        Err(_) => vec![1, 2],
    };
    for threads in thread_counts {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (mut tot_lenet, mut tot_resnet) = (0.0, 0.0);
        for (name, n, c, h, w, o, k, s, p) in SHAPES {
            if !name.starts_with(only_shape.as_str()) {
                continue;
            }
            let oh = (h + 2 * p - k) / s + 1;
            let g = Geometry {
                batch: n,
                in_channels: c,
                in_h: h,
                in_w: w,
                out_channels: o,
                kernel: (k, k),
                stride: (s, s),
                padding: (p, p),
                dilation: (1, 1),
                out_h: oh,
                out_w: oh,
            };
            let x: Vec<f32> = (0..n * c * h * w)
                .map(|i| (i % 17) as f32 * 0.1 - 0.8)
                .collect();
            let wt: Vec<f32> = (0..o * c * k * k)
                .map(|i| (i % 13) as f32 * 0.1 - 0.6)
                .collect();
            let b: Vec<f32> = (0..o).map(|i| i as f32 * 0.01).collect();
            let gy: Vec<f32> = (0..n * o * oh * oh)
                .map(|i| (i % 7) as f32 * 0.1 - 0.3)
                .collect();
            let only = |input, weight| Needs {
                input,
                weight,
                bias: weight,
            };
            let (f, gi, gw) = pool.install(|| {
                (
                    best_ms(|| recycle(forward(&x, &wt, Some(&b), &g))),
                    best_ms(|| recycle_all(backward(&x, &wt, &gy, &g, only(true, false)))),
                    best_ms(|| recycle_all(backward(&x, &wt, &gy, &g, only(false, true)))),
                )
            });
            let both = pool
                .install(|| best_ms(|| recycle_all(backward(&x, &wt, &gy, &g, only(c > 1, true)))));
            let total = f + both;
            if name.starts_with("lenet") {
                tot_lenet += total;
            } else {
                tot_resnet += total;
            }
            println!(
                "T{threads} {name:12} fwd {f:7.3} dx {gi:7.3} dw {gw:7.3} bwd {both:7.3} total {total:7.3} ms"
            );
        }
        println!("T{threads} TOTAL lenet {tot_lenet:7.3} resnet {tot_resnet:7.3} ms");
    }
}

#[test]
#[ignore]
fn conv_timing_kernel_rate() {
    use super::tile_product::{product, TileShape};
    for (o_n, depth, width) in [
        (16, 144, 64),
        (16, 144, 48),
        (64, 576, 64),
        (6, 25, 784),
        (32, 288, 64),
    ] {
        let a = vec![0.5f32; o_n * depth];
        let b = vec![0.25f32; depth * width];
        let mut out = vec![0f32; o_n * width];
        let s = TileShape {
            o_n,
            depth,
            width,
            a_rs: 1,
            a_cs: o_n,
            b_rs: width,
            out_stride: width,
            accumulate: false,
        };
        let reps = 20000;
        let ms = best_ms(|| {
            for _ in 0..reps {
                product(s, &a, &b, None, &mut out);
            }
        });
        let gflops = (2 * o_n * depth * width * reps) as f64 / (ms * 1e6);
        println!("kernel {o_n}x{depth}x{width}: {gflops:.1} GFLOP/s");
    }
}

/// One sample of a 3×3, stride-1, padding-1 convolution: `c` channels of `h × h` to `o`.
fn same_3x3(c: usize, h: usize, o: usize) -> Geometry {
    Geometry {
        batch: 1,
        in_channels: c,
        in_h: h,
        in_w: h,
        out_channels: o,
        kernel: (3, 3),
        stride: (1, 1),
        padding: (1, 1),
        dilation: (1, 1),
        out_h: h,
        out_w: h,
    }
}

#[test]
#[ignore]
fn conv_timing_implicit_rate() {
    use super::implicit::Implicit;
    for (c, h, o) in [(16, 32, 16), (32, 16, 32), (64, 8, 64), (3, 32, 16)] {
        let g = same_3x3(c, h, o);
        let Some(plan) = Implicit::new(&g) else {
            return;
        };
        let x = vec![0.5f32; c * h * h];
        let wt = vec![0.25f32; c * 9 * o];
        let mut padded = vec![0f32; plan.padded_len()];
        let mut tile = vec![0f32; plan.tile_len()];
        let mut out = vec![0f32; o * h * h];
        let reps = 200;
        let ms = best_ms(|| {
            for _ in 0..reps {
                plan.sample(&wt, None, &x, &mut padded, &mut tile, &mut out);
            }
        });
        let gflops = (2 * o * c * 9 * h * h * reps) as f64 / (ms * 1e6);
        println!("implicit C{c} {h}x{h} O{o}: {gflops:.1} GFLOP/s");
    }
}

#[test]
#[ignore]
fn conv_timing_implicit_weight_rate() {
    use super::implicit::Implicit;
    for (c, h, o) in [(16, 32, 16), (32, 16, 32), (64, 8, 64), (3, 32, 16)] {
        let g = same_3x3(c, h, o);
        let Some(plan) = Implicit::new(&g) else {
            return;
        };
        let x = vec![0.5f32; c * h * h];
        let gy = vec![0.25f32; o * h * h];
        let mut padded = vec![0f32; plan.padded_len()];
        let mut spread = vec![0f32; plan.spread_len()];
        let mut gw = vec![0f32; c * 9 * o];
        let reps = 200;
        let ms = best_ms(|| {
            for _ in 0..reps {
                plan.weight_sample(&x, &gy, &mut padded, &mut spread, &mut gw);
            }
        });
        let gflops = (2 * o * c * 9 * h * h * reps) as f64 / (ms * 1e6);
        println!("implicit weight C{c} {h}x{h} O{o}: {gflops:.1} GFLOP/s");
    }
}

/// Winograd against the current kernels over the 3×3 unit-stride ResNet-20 layers (batch 32):
/// the forward, the input gradient (the forward convolution `cpu::backward` runs for it) and
/// the weight gradient (with the bias gradient, as in training). The 16-channel layer is below
/// Winograd's channel threshold (see `winograd.rs`), so both columns time the same kernels.
#[test]
#[ignore]
fn conv_timing_winograd() {
    use super::cpu::{backward_with, flipped_weights, forward_with, transposed};
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut totals = [0.0; 2];
        for (c, h) in [(16, 32), (32, 16), (64, 8)] {
            let g = Geometry {
                batch: 32,
                ..same_3x3(c, h, c)
            };
            let x: Vec<f32> = (0..32 * c * h * h)
                .map(|i| (i % 17) as f32 * 0.1 - 0.8)
                .collect();
            let wt: Vec<f32> = (0..c * c * 9)
                .map(|i| (i % 13) as f32 * 0.1 - 0.6)
                .collect();
            let b: Vec<f32> = (0..c).map(|i| i as f32 * 0.01).collect();
            let gy: Vec<f32> = (0..32 * c * h * h)
                .map(|i| (i % 7) as f32 * 0.1 - 0.3)
                .collect();
            let Some(gt) = transposed(&g) else {
                return;
            };
            let flipped = flipped_weights(&wt, &g);
            let weight = Needs {
                input: false,
                weight: true,
                bias: true,
            };
            // [current, Winograd] for the forward, input gradient, weight gradient.
            let times: [[f64; 2]; 3] = pool.install(|| {
                [0, 1, 2].map(|pass| {
                    [false, true].map(|wino| {
                        best_ms(|| match pass {
                            0 => recycle(forward_with(&x, &wt, Some(&b), &g, wino)),
                            1 => recycle(forward_with(&gy, &flipped, None, &gt, wino)),
                            _ => recycle_all(backward_with(&x, &wt, &gy, &g, weight, wino)),
                        })
                    })
                })
            });
            let line: Vec<String> = ["fwd", "dx", "dw"]
                .iter()
                .zip(times)
                .map(|(name, [before, after])| {
                    format!("{name} {before:.3} -> {after:.3} ({:.2}x)", before / after)
                })
                .collect();
            for (total, k) in totals.iter_mut().zip(0..2) {
                *total += times.iter().map(|t| t[k]).sum::<f64>();
            }
            println!("T{threads} C{c} {h}x{h} ms: {}", line.join(", "));
        }
        println!(
            "T{threads} three layers: {:.3} -> {:.3} ms ({:.2}x)",
            totals[0],
            totals[1],
            totals[0] / totals[1]
        );
    }
}
