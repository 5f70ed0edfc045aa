//! Winograd against f64 direct loops: forward, input gradient (a Winograd forward of the
//! flipped weights, and through `cpu::backward`) and weight gradient, over channel counts that
//! are not multiples of 16 (any count: the tests lift the threshold of `Winograd::new`), odd
//! sizes, paddings 0–2, one and several samples, chunks that split samples, at 1 and 2
//! threads.

use super::super::{self as cpu, Needs};
use super::*;

/// `(N, C, H, W, O, padding, bias)` of the geometries tested.
const CASES: [(usize, usize, usize, usize, usize, usize, bool); 13] = [
    (2, 3, 7, 9, 5, 1, true),
    (4, 64, 8, 8, 64, 1, true),
    (4, 32, 16, 16, 32, 1, true),
    (1, 17, 5, 7, 19, 1, true),
    (3, 17, 9, 6, 23, 0, false),
    (2, 16, 8, 8, 24, 2, true),
    (4, 20, 11, 13, 18, 1, true),
    (2, 64, 8, 8, 64, 1, false),
    (3, 16, 32, 32, 16, 1, true),
    // Chunks of a few tile rows: they end inside samples.
    (2, 64, 30, 31, 64, 1, true),
    (1, 33, 4, 4, 16, 2, false),
    // padding wider than the image, and a single pixel
    (1, 16, 2, 3, 16, 4, true),
    (2, 16, 1, 1, 17, 1, true),
];

fn geometry(n: usize, c: usize, h: usize, w: usize, o: usize, p: usize) -> Geometry {
    Geometry {
        batch: n,
        in_channels: c,
        in_h: h,
        in_w: w,
        out_channels: o,
        kernel: (3, 3),
        stride: (1, 1),
        padding: (p, p),
        dilation: (1, 1),
        out_h: h + 2 * p - 2,
        out_w: w + 2 * p - 2,
    }
}

/// Deterministic values in [−1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// Calls `f(n, o, i, j, c, a, b, y, z)` for every term of the direct convolution whose input
/// pixel `(y, z)` lies inside the input.
fn for_each_term(g: &Geometry, mut f: impl FnMut([usize; 9])) {
    let p = g.padding.0;
    for n in 0..g.batch {
        for o in 0..g.out_channels {
            for i in 0..g.out_h {
                for j in 0..g.out_w {
                    for c in 0..g.in_channels {
                        for a in 0..3 {
                            for b in 0..3 {
                                let (y, z) = ((i + a).wrapping_sub(p), (j + b).wrapping_sub(p));
                                if y < g.in_h && z < g.in_w {
                                    f([n, o, i, j, c, a, b, y, z]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Index helpers for `[N, C, H, W]`, `[N, O, OH, OW]` and `[O, C, 3, 3]`.
fn x_at(g: &Geometry, n: usize, c: usize, y: usize, z: usize) -> usize {
    ((n * g.in_channels + c) * g.in_h + y) * g.in_w + z
}
fn y_at(g: &Geometry, n: usize, o: usize, i: usize, j: usize) -> usize {
    ((n * g.out_channels + o) * g.out_h + i) * g.out_w + j
}
fn w_at(g: &Geometry, o: usize, c: usize, a: usize, b: usize) -> usize {
    ((o * g.in_channels + c) * 3 + a) * 3 + b
}

/// Asserts `got` within `tol` of `want`, relative to the sum of the magnitudes of the terms
/// of each element (`scale`).
fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (k, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (g as f64 - w).abs() / s.max(1e-3);
        assert!(
            err <= tol,
            "{what}: element {k}: {g} vs {w} (relative {err:e})"
        );
    }
}

fn in_pools(f: impl Fn() + Send + Sync) {
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(&f);
    }
}

#[test]
fn winograd_forward_matches_a_direct_f64_convolution() {
    if !tile_product::available() {
        return;
    }
    in_pools(|| {
        for (n, c, h, w, o, p, with_bias) in CASES {
            let g = geometry(n, c, h, w, o, p);
            let x = values(n * c * h * w, 1);
            let wt = values(o * c * 9, 2);
            let bias = values(o, 3);
            let bias = with_bias.then_some(&bias[..]);
            let len = n * o * g.out_h * g.out_w;
            let mut want: Vec<f64> = (0..len)
                .map(|k| bias.map_or(0.0, |b| b[k / (g.out_h * g.out_w) % o] as f64))
                .collect();
            let mut scale: Vec<f64> = want.iter().map(|v| v.abs()).collect();
            for_each_term(&g, |[n, o, i, j, c, a, b, y, z]| {
                let t = x[x_at(&g, n, c, y, z)] as f64 * wt[w_at(&g, o, c, a, b)] as f64;
                want[y_at(&g, n, o, i, j)] += t;
                scale[y_at(&g, n, o, i, j)] += t.abs();
            });
            let plan = Winograd::with_min_channels(&g, 1).expect("Winograd applies");
            let mut out = vec![f32::NAN; len];
            plan.forward(&x, &wt, bias, &mut out).unwrap();
            assert_close(&format!("forward {g:?}"), &out, &want, &scale, 1e-5);
        }
    });
}

#[test]
fn winograd_input_gradient_matches_a_direct_f64_sum() {
    if !tile_product::available() {
        return;
    }
    in_pools(|| {
        for (n, c, h, w, o, p, _) in CASES {
            let g = geometry(n, c, h, w, o, p);
            let x = values(n * c * h * w, 4);
            let wt = values(o * c * 9, 5);
            let gy = values(n * o * g.out_h * g.out_w, 6);
            let mut want = vec![0.0f64; x.len()];
            let mut scale = vec![0.0f64; x.len()];
            for_each_term(&g, |[n, o, i, j, c, a, b, y, z]| {
                let t = gy[y_at(&g, n, o, i, j)] as f64 * wt[w_at(&g, o, c, a, b)] as f64;
                want[x_at(&g, n, c, y, z)] += t;
                scale[x_at(&g, n, c, y, z)] += t.abs();
            });
            let needs = Needs {
                input: true,
                weight: false,
                bias: false,
            };
            // Through the backward (Winograd where it is used), and as the Winograd forward of
            // the flipped weights where the input gradient is a convolution.
            let grads = cpu::backward(&x, &wt, &gy, &g, needs).unwrap();
            let gx = grads.input.expect("input gradient");
            assert_close(&format!("input gradient {g:?}"), &gx, &want, &scale, 1e-5);
            if let Some(t) = g.transposed() {
                let plan = Winograd::with_min_channels(&t, 1).expect("Winograd applies");
                let mut gx = vec![f32::NAN; x.len()];
                let flipped = cpu::flipped_weights(&wt, &g).unwrap();
                plan.forward(&gy, &flipped, None, &mut gx).unwrap();
                assert_close(
                    &format!("Winograd input gradient {g:?}"),
                    &gx,
                    &want,
                    &scale,
                    1e-5,
                );
            }
        }
    });
}

#[test]
fn winograd_weight_gradient_matches_a_direct_f64_sum() {
    if !tile_product::available() {
        return;
    }
    in_pools(|| {
        for (n, c, h, w, o, p, _) in CASES {
            let g = geometry(n, c, h, w, o, p);
            let x = values(n * c * h * w, 8);
            let gy = values(n * o * g.out_h * g.out_w, 9);
            let mut want = vec![0.0f64; o * c * 9];
            let mut scale = vec![0.0f64; o * c * 9];
            for_each_term(&g, |[n, o, i, j, c, a, b, y, z]| {
                let t = gy[y_at(&g, n, o, i, j)] as f64 * x[x_at(&g, n, c, y, z)] as f64;
                want[w_at(&g, o, c, a, b)] += t;
                scale[w_at(&g, o, c, a, b)] += t.abs();
            });
            let plan = Winograd::with_min_channels(&g, 1).expect("Winograd applies");
            let gw = plan.weight_gradient(&x, &gy).expect("slices fit");
            assert_close(&format!("weight gradient {g:?}"), &gw, &want, &scale, 1e-5);
            // Through the backward (Winograd where it is used), with the bias gradient.
            let needs = Needs {
                input: false,
                weight: true,
                bias: true,
            };
            let wt = values(o * c * 9, 10);
            let grads = cpu::backward(&x, &wt, &gy, &g, needs).unwrap();
            let gw = grads.weight.expect("weight gradient");
            assert_close(&format!("backward weight {g:?}"), &gw, &want, &scale, 1e-5);
            let gb = grads.bias.expect("bias gradient");
            let plane = g.out_h * g.out_w;
            for (oc, &got) in gb.iter().enumerate() {
                let want: f64 = (0..n)
                    .flat_map(|s| &gy[(s * o + oc) * plane..][..plane])
                    .map(|&v| v as f64)
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-4 * (plane * n) as f64,
                    "bias {oc}"
                );
            }
        }
    });
}

#[test]
fn winograd_is_left_to_thin_and_other_geometries() {
    assert!(Winograd::new(&geometry(2, 3, 32, 32, 16, 1)).is_none());
    assert!(Winograd::new(&geometry(2, 64, 32, 32, 8, 1)).is_none());
    assert!(Winograd::new(&geometry(2, 32, 16, 16, 32, 1)).is_some());
    let strided = Geometry {
        stride: (2, 2),
        out_h: 16,
        out_w: 16,
        ..geometry(2, 16, 32, 32, 16, 1)
    };
    assert!(Winograd::new(&strided).is_none());
}

#[test]
fn weight_transform_matches_g_k_gt_in_f64() {
    if !tile_product::available() {
        return;
    }
    let (c_n, o_n) = (3, 21);
    let w = values(o_n * c_n * 9, 7);
    let mut u = vec![f32::NAN; XI * c_n * o_n];
    transforms::weight_tiles(&w, c_n, o_n, &mut u);
    let gm = [
        [1.0, 0.0, 0.0],
        [0.5, 0.5, 0.5],
        [0.5, -0.5, 0.5],
        [0.0, 0.0, 1.0],
    ];
    for o in 0..o_n {
        for c in 0..c_n {
            let k = &w[(o * c_n + c) * 9..][..9];
            for i in 0..4 {
                for j in 0..4 {
                    let mut want = 0.0f64;
                    for a in 0..3 {
                        for b in 0..3 {
                            want += gm[i][a] * k[a * 3 + b] as f64 * gm[j][b];
                        }
                    }
                    let got = u[((4 * i + j) * c_n + c) * o_n + o] as f64;
                    assert!((got - want).abs() < 1e-6, "o {o} c {c} ({i}, {j})");
                }
            }
        }
    }
}
