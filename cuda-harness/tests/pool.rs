//! The pooling kernels (`ops/src/pool/pool.cu`), run on the CPU by the host harness through the
//! launch plans the CUDA path uses, against tandem's CPU ops (`max_pool2d`, `avg_pool2d`,
//! `adaptive_avg_pool2d`, forward and backward through autograd).
//!
//! The kernels perform the CPU's operations in the CPU's order, so every value and gradient
//! must equal the CPU's bit for bit (NaN for NaN). Cases cover odd plane sizes, planes and
//! batches that are not a multiple of the block, overlapping windows (where the backward gathers
//! several gradients into one element), strides larger than the kernel (inputs no window
//! covers), padding at the limit of half the kernel, adaptive windows smaller and larger than
//! the input, 3-D inputs, empty batches, ties (ReLU-like zeros), NaN and infinities. Outputs
//! start poisoned inside guard elements, and every launch also runs with a grid of two one-warp
//! blocks so that threads loop through the grid-stride loop. The saved maxima are also checked
//! against an independent left-to-right scan.

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use tandem_autograd::backward;
use tandem_core::cuda::launch::Launch;
use tandem_core::{Device, Element, Layout, Tensor};
use tandem_ops::pool::cuda::launch::{
    avg_pool2d_backward_launch, avg_pool2d_launch, max_pool2d_backward_launch, max_pool2d_launch,
    PoolGeometry,
};
use tandem_ops::pool::PoolWindows;
use tandem_ops::{adaptive_avg_pool2d, avg_pool2d, max_pool2d};

type Pair = (usize, usize);

/// A pool to run: max or average over sliding windows, or adaptive average.
#[derive(Clone, Copy, Debug)]
enum Pool {
    Max { k: Pair, s: Pair, p: Pair },
    Avg { k: Pair, s: Pair, p: Pair },
    Adaptive { out: Pair },
}

impl Pool {
    fn windows(self) -> PoolWindows {
        match self {
            Pool::Max { k, s, p } | Pool::Avg { k, s, p } => PoolWindows::Sliding {
                kernel: k,
                stride: s,
                padding: p,
            },
            Pool::Adaptive { .. } => PoolWindows::Adaptive,
        }
    }

    fn divisor(self) -> Option<usize> {
        match self {
            Pool::Avg { k, .. } => Some(k.0 * k.1),
            _ => None,
        }
    }

    fn cpu(self, x: &Tensor) -> Tensor {
        match self {
            Pool::Max { k, s, p } => max_pool2d(x, k, s, p),
            Pool::Avg { k, s, p } => avg_pool2d(x, k, s, p),
            Pool::Adaptive { out } => adaptive_avg_pool2d(x, out),
        }
        .unwrap_or_else(|e| panic!("CPU {self:?} on {:?}: {e}", x.dims()))
    }
}

/// The shapes and pools every dtype runs.
fn cases() -> Vec<(Vec<usize>, Pool)> {
    let max = |k, s, p| Pool::Max { k, s, p };
    let avg = |k, s, p| Pool::Avg { k, s, p };
    let adaptive = |out| Pool::Adaptive { out };
    vec![
        // MaxPool2d(2) on even and odd planes (an odd edge is dropped).
        (vec![2, 3, 8, 8], max((2, 2), (2, 2), (0, 0))),
        (vec![3, 5, 9, 7], max((2, 2), (2, 2), (0, 0))),
        (vec![3, 5, 9, 7], avg((2, 2), (2, 2), (0, 0))),
        // ResNet's stem pool: 3×3, stride 2, padding 1 (overlapping windows).
        (vec![2, 3, 11, 10], max((3, 3), (2, 2), (1, 1))),
        (vec![2, 3, 11, 10], avg((3, 3), (2, 2), (1, 1))),
        // Stride 1 (every input in up to nine windows), rectangular kernels.
        (vec![1, 2, 7, 9], max((3, 2), (2, 1), (1, 1))),
        (vec![1, 2, 7, 9], avg((3, 2), (2, 1), (1, 1))),
        (vec![2, 1, 9, 6], max((3, 3), (1, 1), (1, 0))),
        (vec![2, 1, 9, 6], avg((3, 3), (2, 3), (1, 0))),
        // The kernel covers the whole padded plane.
        (vec![1, 2, 5, 5], max((5, 4), (1, 1), (2, 2))),
        (vec![1, 2, 5, 5], avg((5, 4), (1, 1), (2, 2))),
        // Stride larger than the kernel: some inputs are in no window.
        (vec![2, 2, 10, 11], max((2, 2), (3, 4), (0, 1))),
        (vec![2, 2, 10, 11], avg((2, 2), (3, 4), (0, 1))),
        (vec![3, 4, 6, 5], max((1, 1), (1, 1), (0, 0))),
        // A 3-D input, planes not a multiple of anything.
        (vec![7, 13, 17], max((2, 3), (2, 2), (1, 1))),
        (vec![7, 13, 17], avg((2, 3), (2, 2), (1, 1))),
        // Enough elements for several blocks of 256 threads.
        (vec![4, 6, 14, 15], max((2, 2), (2, 2), (0, 0))),
        (vec![4, 6, 14, 15], avg((3, 3), (1, 1), (1, 1))),
        // Adaptive: shrinking, global, identity, growing (overlapping windows), uneven.
        (vec![2, 3, 7, 5], adaptive((3, 2))),
        (vec![2, 3, 7, 5], adaptive((1, 1))),
        (vec![2, 3, 7, 5], adaptive((7, 5))),
        (vec![2, 3, 7, 5], adaptive((4, 8))),
        (vec![3, 8, 8], adaptive((5, 3))),
        (vec![4, 16, 8, 8], adaptive((1, 1))),
        // Empty batches.
        (vec![0, 3, 8, 8], max((2, 2), (2, 2), (0, 0))),
        (vec![0, 3, 8, 8], avg((2, 2), (2, 2), (0, 0))),
        (vec![2, 0, 8, 8], adaptive((2, 2))),
    ]
}

/// Input values: random, with runs of tied zeros (as after a ReLU) and, when `specials`, a NaN
/// and infinities in the first plane.
fn input_values<T: Element>(n: usize, seed: u64, specials: bool) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let x: f64 = rng.gen_range(-1.0..1.0);
            if rng.gen_bool(0.3) {
                0.0
            } else {
                x
            }
        })
        .collect();
    if specials && n > 12 {
        v[3] = f64::NAN;
        v[7] = f64::INFINITY;
        v[12] = f64::NEG_INFINITY;
    }
    v.into_iter().map(T::from_f64).collect()
}

fn gradient_values<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64(rng.gen_range(-2.0..2.0)))
        .collect()
}

/// The plane index of each window's maximum by a left-to-right scan (the first NaN, else the
/// first maximum): an independent reference for the saved indices.
fn scan_indices(x: &[f64], dims: &[usize], pool: Pool, out: Pair) -> Vec<u32> {
    let Pool::Max { k, s, p } = pool else {
        unreachable!("only max pools save indices")
    };
    let r = dims.len();
    let (h, w) = (dims[r - 2], dims[r - 1]);
    let planes = x.len() / (h * w);
    let mut want = Vec::new();
    for plane in 0..planes {
        for i in 0..out.0 {
            for j in 0..out.1 {
                let mut best: Option<(f64, usize)> = None;
                for a in 0..k.0 {
                    for b in 0..k.1 {
                        let (row, col) = (
                            (i * s.0 + a) as isize - p.0 as isize,
                            (j * s.1 + b) as isize - p.1 as isize,
                        );
                        if row < 0 || col < 0 || row >= h as isize || col >= w as isize {
                            continue;
                        }
                        let at = row as usize * w + col as usize;
                        let v = x[plane * h * w + at];
                        match best {
                            Some((bv, _)) if bv.is_nan() => {}
                            Some((bv, _)) if !(v.is_nan() || v > bv) => {}
                            _ => best = Some((v, at)),
                        }
                    }
                }
                want.push(best.expect("every window holds an input element").1 as u32);
            }
        }
    }
    want
}

/// u32 indices framed by guard values.
struct IndexBuffer {
    data: Vec<u32>,
    len: usize,
}

const INDEX_POISON: u32 = 0xdead_beef;

impl IndexBuffer {
    fn new(len: usize) -> Self {
        IndexBuffer {
            data: vec![INDEX_POISON; GUARD + len + GUARD],
            len,
        }
    }

    fn ptr(&mut self) -> u64 {
        self.data[GUARD..].as_mut_ptr() as u64
    }

    fn body(&self, what: &str) -> &[u32] {
        let (head, rest) = self.data.split_at(GUARD);
        let (body, tail) = rest.split_at(self.len);
        assert!(
            head.iter().chain(tail).all(|&g| g == INDEX_POISON),
            "{what}: wrote outside the indices"
        );
        body
    }
}

fn both_grids(
    launch: &Launch,
    what: &str,
    mut before_each: impl FnMut(),
    mut after_each: impl FnMut(&str),
) {
    for small in [false, true] {
        before_each();
        let what = format!(
            "{what}{}",
            if small { " (two one-warp blocks)" } else { "" }
        );
        run_launch(
            &if small {
                small_grid(launch)
            } else {
                launch.clone()
            },
            &what,
        );
        after_each(&what);
    }
}

/// `v`, the row-major elements of an `[N, C, H, W]` tensor, in NHWC (channels-last storage)
/// order.
fn to_nhwc<T: Copy>(v: &[T], dims: &[usize]) -> Vec<T> {
    let (n, c, h, w) = (dims[0], dims[1], dims[2], dims[3]);
    let mut out = Vec::with_capacity(v.len());
    for ni in 0..n {
        for hi in 0..h {
            for wi in 0..w {
                for ci in 0..c {
                    out.push(v[((ni * c + ci) * h + hi) * w + wi]);
                }
            }
        }
    }
    out
}

/// `dims` in NHWC order.
fn nhwc_dims(dims: &[usize]) -> Vec<usize> {
    vec![dims[0], dims[2], dims[3], dims[1]]
}

fn check<T: Element>(dims: &[usize], pool: Pool, seed: u64) {
    check_in::<T>(dims, pool, seed, false);
}

/// [`check`], with the kernels run on row-major planes, or (`nhwc`, 4-D `dims` only) on
/// channels-last data: every buffer in NHWC order and the geometry's `channels` = C, against
/// the CPU's values and indices laid out the same way.
fn check_in<T: Element>(dims: &[usize], pool: Pool, seed: u64, nhwc: bool) {
    let op = "harness";
    let what = format!(
        "{pool:?} {} on {dims:?}{}",
        T::DTYPE,
        if nhwc { " channels-last" } else { "" }
    );
    let n: usize = dims.iter().product();
    let specials = seed % 2 == 1;
    let x_values = input_values::<T>(n, seed, specials);

    // The CPU op, forward and backward with a random output gradient.
    let x_cpu = Tensor::from_vec(x_values.clone(), dims, Device::Cpu)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let y_cpu = pool.cpu(&x_cpu);
    let out_dims = y_cpu.dims().to_vec();
    let m: usize = out_dims.iter().product();
    let g_values = gradient_values::<T>(m, seed + 100);
    let g_cpu = Tensor::from_vec(g_values.clone(), &out_dims, Device::Cpu).unwrap();
    backward(&y_cpu, Some(&g_cpu), &Default::default()).unwrap();
    let want_y = y_cpu.to_vec::<T>().unwrap();
    let mut want_gx = match x_cpu.grad() {
        Some(g) => g.to_vec::<T>().unwrap(),
        None => vec![T::from_f64(0.0); n],
    };
    let mut want_y = want_y;
    let (mut x_values, mut g_values) = (x_values, g_values);
    let x64: Vec<f64> = x_values.iter().map(|v| v.to_f64()).collect();

    let r = dims.len();
    let planes = dims[..r - 2].iter().product();
    let out = (out_dims[r - 2], out_dims[r - 1]);
    let mut geometry = PoolGeometry::new(
        op,
        planes,
        (dims[r - 2], dims[r - 1]),
        out,
        pool.windows(),
        pool.divisor(),
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let is_max = matches!(pool, Pool::Max { .. });
    let mut want_indices = if is_max {
        scan_indices(&x64, dims, pool, out)
    } else {
        Vec::new()
    };
    let (mut x_layout, mut y_layout) = (Layout::contiguous(dims), Layout::contiguous(&out_dims));
    if nhwc {
        geometry = geometry
            .channels_last(op, dims[1])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        x_values = to_nhwc(&x_values, dims);
        g_values = to_nhwc(&g_values, &out_dims);
        want_y = to_nhwc(&want_y, &out_dims);
        want_gx = to_nhwc(&want_gx, dims);
        if is_max {
            want_indices = to_nhwc(&want_indices, &out_dims);
        }
        x_layout = Layout::contiguous(&nhwc_dims(dims));
        y_layout = Layout::contiguous(&nhwc_dims(&out_dims));
    }
    let mut x_buffer = HostBuffer::new(&x_values);
    let mut g_buffer = HostBuffer::new(&g_values);

    // Forward.
    let mut y_buffer = HostBuffer::new(&vec![poison::<T>(); m]);
    let mut indices = IndexBuffer::new(m);
    let forward = if is_max {
        max_pool2d_launch(
            op,
            x_buffer.view(&x_layout),
            y_buffer.view(&y_layout),
            indices.ptr(),
            &geometry,
        )
    } else {
        avg_pool2d_launch(
            op,
            x_buffer.view(&x_layout),
            y_buffer.view(&y_layout),
            &geometry,
        )
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    both_grids(
        &forward,
        &format!("{what} forward"),
        || {},
        |what| {
            assert_same(y_buffer.storage(what), &want_y, what);
            if is_max {
                assert_eq!(
                    indices.body(what),
                    &want_indices[..],
                    "{what}: saved maxima"
                );
            }
        },
    );

    // Backward, from the indices the forward saved.
    let mut gx_buffer = HostBuffer::new(&vec![poison::<T>(); n]);
    let backward = if is_max {
        max_pool2d_backward_launch(
            op,
            g_buffer.view(&y_layout),
            indices.ptr(),
            gx_buffer.view(&x_layout),
            &geometry,
        )
    } else {
        avg_pool2d_backward_launch(
            op,
            g_buffer.view(&y_layout),
            gx_buffer.view(&x_layout),
            &geometry,
        )
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    both_grids(
        &backward,
        &format!("{what} backward"),
        || {},
        |what| {
            assert_same(gx_buffer.storage(what), &want_gx, what);
        },
    );
    // The inputs are untouched.
    assert_same(
        x_buffer.storage(&what),
        &x_values,
        &format!("{what}: input"),
    );
    assert_same(
        g_buffer.storage(&what),
        &g_values,
        &format!("{what}: gradient"),
    );
}

#[test]
fn pools_match_the_cpu_bit_for_bit_forward_and_backward() {
    for (i, (dims, pool)) in cases().into_iter().enumerate() {
        for seed in [2 * i as u64, 2 * i as u64 + 1] {
            check::<f32>(&dims, pool, seed);
            check::<f64>(&dims, pool, seed + 1000);
        }
    }
}

/// The channels-last kernels (the geometry's `channels` = C, NHWC buffers) on the 4-D cases:
/// the CPU's values, indices and gradients bit for bit, laid out channels-last.
#[test]
fn channels_last_pools_match_the_cpu_bit_for_bit_forward_and_backward() {
    for (i, (dims, pool)) in cases().into_iter().enumerate() {
        if dims.len() != 4 || dims[1] == 0 {
            continue;
        }
        check_in::<f32>(&dims, pool, 2 * i as u64 + 1, true);
        check_in::<f64>(&dims, pool, 2 * i as u64 + 1000, true);
    }
}

#[test]
fn channels_last_geometry_needs_whole_samples() {
    let geometry = PoolGeometry::new(
        "harness",
        6,
        (4, 4),
        (2, 2),
        PoolWindows::Sliding {
            kernel: (2, 2),
            stride: (2, 2),
            padding: (0, 0),
        },
        None,
    )
    .unwrap();
    assert!(geometry.channels_last("harness", 3).is_ok());
    for bad in [0, 4] {
        let err = geometry
            .channels_last("harness", bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("harness") && err.contains("channels"), "{err}");
    }
}

#[test]
fn builders_refuse_views_that_do_not_fit_the_geometry() {
    let geometry = PoolGeometry::new(
        "t",
        2,
        (4, 4),
        (2, 2),
        PoolWindows::Sliding {
            kernel: (2, 2),
            stride: (2, 2),
            padding: (0, 0),
        },
        Some(4),
    )
    .unwrap();
    let mut x = HostBuffer::new(&[0.0f32; 40]);
    let mut y = HostBuffer::new(&[0.0f32; 8]);
    // A strided input, an input of the wrong size, an f64 output for an f32 input.
    let strided = Layout::contiguous(&[2, 4, 5]).narrow("t", 2, 0, 4).unwrap();
    let y_layout = Layout::contiguous(&[2, 2, 2]);
    let err = avg_pool2d_launch("avg_pool2d", x.view(&strided), y.view(&y_layout), &geometry)
        .unwrap_err()
        .to_string();
    assert!(err.contains("avg_pool2d") && err.contains("dense"), "{err}");
    let wrong = Layout::contiguous(&[2, 4, 3]);
    assert!(avg_pool2d_launch("t", x.view(&wrong), y.view(&y_layout), &geometry).is_err());
    let mut y64 = HostBuffer::new(&[0.0f64; 8]);
    let x_layout = Layout::contiguous(&[2, 4, 4]);
    let err = avg_pool2d_launch("t", x.view(&x_layout), y64.view(&y_layout), &geometry)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f64") && err.contains("f32"), "{err}");
    // Max pooling of integers has no kernel.
    let mut xi = HostBuffer::new(&vec![0i64; 32]);
    let mut yi = HostBuffer::new(&[0i64; 8]);
    assert!(
        max_pool2d_launch("t", xi.view(&x_layout), yi.view(&y_layout), 0, &geometry)
            .unwrap_err()
            .to_string()
            .contains("i64")
    );
}
