//! conv2d's kernels (`ops/src/conv2d/conv2d.cu`) run on the CPU by the host harness through the
//! launch plans the CUDA path uses (`tandem_ops::conv2d::cuda::launch`), checked two ways:
//!
//! - exactly, against a direct formula written here (im2col is a copy; col2im and the bias
//!   gradient sum values chosen so that every sum is exact; the bias add of such values is
//!   exact too);
//! - through the products the im2col + cuBLAS engine builds from them (done here in f64),
//!   against tandem's CPU op: forward, input gradient and weight gradient of `conv2d`, and its
//!   bias forward and gradient.
//!
//! Geometries: odd sizes, stride 2 with padding, a 7×7 stride-2 stem, 1×1, dilation with
//! uneven padding and strides, a kernel larger than the input, an empty batch; chunks of
//! samples starting past sample 0 (what the engine runs when the batch does not fit its column
//! budget); f32 and f64; the default grid and a two-block grid (every thread loops). Outputs
//! are poisoned first, with guard elements around each buffer, so a missed or stray write
//! fails.

mod common;

use common::{poison, run_launch, small_grid, HostBuffer};
use rand::{Rng, SeedableRng};
use tandem_autograd::{backward, BackwardOptions};
use tandem_core::cuda::launch::Launch;
use tandem_core::{Device, Element, Layout, Tensor};
use tandem_ops::conv2d::cuda::launch::{
    bias_add_launch, bias_grad_launches, col2im_launch, im2col_launch, BiasGradSplit, ColumnLayout,
};
use tandem_ops::conv2d::{Conv2dParams, Geometry};

/// One test geometry: input `[N, C, H, W]`, weight `[O, C, kh, kw]`, parameters.
struct Case {
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    p: Conv2dParams,
}

fn params(
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
) -> Conv2dParams {
    Conv2dParams {
        stride,
        padding,
        dilation,
    }
}

fn cases() -> Vec<Case> {
    let plain = Conv2dParams::default();
    vec![
        Case {
            name: "odd sizes, 3x3",
            x: [2, 3, 7, 9],
            w: [4, 3, 3, 3],
            p: plain,
        },
        Case {
            name: "stride 2, padding 1",
            x: [3, 2, 9, 8],
            w: [5, 2, 3, 3],
            p: params((2, 2), (1, 1), (1, 1)),
        },
        Case {
            name: "7x7 stride 2 padding 3 (ResNet stem)",
            x: [1, 3, 15, 13],
            w: [4, 3, 7, 7],
            p: params((2, 2), (3, 3), (1, 1)),
        },
        Case {
            name: "1x1",
            x: [2, 5, 6, 7],
            w: [3, 5, 1, 1],
            p: plain,
        },
        Case {
            name: "dilation (2, 3), padding (2, 1), stride (1, 2)",
            x: [2, 2, 11, 10],
            w: [3, 2, 3, 2],
            p: params((1, 2), (2, 1), (2, 3)),
        },
        Case {
            name: "kernel larger than the input, stride 3",
            x: [2, 3, 4, 4],
            w: [2, 3, 5, 5],
            p: params((3, 3), (2, 2), (1, 1)),
        },
        Case {
            name: "several blocks per sample",
            x: [2, 4, 17, 19],
            w: [6, 4, 3, 3],
            p: params((1, 1), (1, 1), (1, 1)),
        },
        Case {
            name: "empty batch",
            x: [0, 3, 5, 5],
            w: [2, 3, 3, 3],
            p: plain,
        },
    ]
}

impl Case {
    fn geometry(&self) -> Geometry {
        Geometry::of("test", &self.x, &self.w, &self.p).expect("a valid test geometry")
    }
}

/// Random values in [-1, 1).
fn random<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64(rng.gen::<f64>() * 2.0 - 1.0))
        .collect()
}

/// Random multiples of 1/8 in [-4, 4]: sums of a few thousand of them are exact in f32 and f64,
/// in any order.
fn eighths<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64(rng.gen_range(-32..=32) as f64 / 8.0))
        .collect()
}

/// A poisoned host buffer of `n` elements (with guards) and the address of its element 0.
fn poisoned<T: Element>(n: usize) -> (HostBuffer<T>, u64) {
    let mut buffer = HostBuffer::new(&vec![poison::<T>(); n]);
    let layout = Layout::contiguous(&[n]);
    let address = buffer.view(&layout).ptr;
    (buffer, address)
}

/// A host buffer holding `data` (with guards) and the address of its element 0.
fn holding<T: Element>(data: &[T]) -> (HostBuffer<T>, u64) {
    let mut buffer = HostBuffer::new(data);
    let layout = Layout::contiguous(&[data.len()]);
    let address = buffer.view(&layout).ptr;
    (buffer, address)
}

fn size_of<T: Element>() -> u64 {
    std::mem::size_of::<T>() as u64
}

/// Runs the plan `build` makes for a fresh poisoned output of `len` elements (given its
/// address), once with the plan's grid and once with a two-block grid (every thread loops), and
/// hands each output, its guards checked, to `check`.
fn run_fresh<T: Element>(
    len: usize,
    what: &str,
    build: impl Fn(u64) -> Launch,
    check: impl Fn(&[T], &str),
) {
    for small in [false, true] {
        let what = format!(
            "{what}, {} grid",
            if small { "two-block" } else { "default" }
        );
        let (out, address) = poisoned::<T>(len);
        let launch = build(address);
        let launch = if small { small_grid(&launch) } else { launch };
        run_launch(&launch, &what);
        check(out.storage(&what), &what);
    }
}

/// Asserts `got ≈ want` elementwise within the dtype's tolerance, naming the first misses.
fn assert_close<T: Element>(got: &[T], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let tol = if std::mem::size_of::<T>() == 4 {
        2e-5
    } else {
        1e-11
    };
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| {
            let (g, w) = (g.to_f64(), **w);
            g.is_nan() || (g - w).abs() > tol * (1.0 + w.abs())
        })
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] got {g:?}, want {w:.9e}"))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
}

fn assert_exact<T: Element>(got: &[T], want: &[f64], what: &str) {
    let want: Vec<T> = want.iter().map(|&v| T::from_f64(v)).collect();
    common::assert_same(got, &want, what);
}

// ---- independent references -------------------------------------------------------------------

/// The input element that kernel tap `(c, ki, kj)` reads for output pixel `(oh, ow)` of sample
/// `n` (0 in the padding): straight from the definition of the convolution.
fn tap<T: Element>(
    g: &Geometry,
    x: &[T],
    n: usize,
    c: usize,
    k: (usize, usize),
    o: (usize, usize),
) -> f64 {
    let h = (o.0 * g.stride.0 + k.0 * g.dilation.0) as isize - g.padding.0 as isize;
    let w = (o.1 * g.stride.1 + k.1 * g.dilation.1) as isize - g.padding.1 as isize;
    if h < 0 || w < 0 || h >= g.in_h as isize || w >= g.in_w as isize {
        return 0.0;
    }
    x[((n * g.in_channels + c) * g.in_h + h as usize) * g.in_w + w as usize].to_f64()
}

/// Column matrices of samples `first..first + samples`, entry `(s, k, p)` at the place `layout`
/// gives it (see `ColumnLayout`).
fn columns_reference<T: Element>(
    g: &Geometry,
    x: &[T],
    first: usize,
    samples: usize,
    layout: ColumnLayout,
) -> Vec<f64> {
    let (kh, kw) = g.kernel;
    let (rows, pixels) = (g.patch(), g.out_pixels());
    let mut out = vec![0.0; rows * pixels * samples];
    for s in 0..samples {
        for c in 0..g.in_channels {
            for ki in 0..kh {
                for kj in 0..kw {
                    let k = (c * kh + ki) * kw + kj;
                    for oh in 0..g.out_h {
                        for ow in 0..g.out_w {
                            let p = oh * g.out_w + ow;
                            let at = match layout {
                                ColumnLayout::PerSample => (s * rows + k) * pixels + p,
                                ColumnLayout::Joined => k * samples * pixels + s * pixels + p,
                            };
                            out[at] = tap(g, x, first + s, c, (ki, kj), (oh, ow));
                        }
                    }
                }
            }
        }
    }
    out
}

/// What the CPU op gives: `(y, dx, dw, db)` of `conv2d(x, w, b)` with output gradient `gy`.
fn cpu_op<T: Element>(
    case: &Case,
    x: &[T],
    w: &[T],
    b: &[T],
    gy: &[T],
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let g = case.geometry();
    let leaf = |data: &[T], shape: &[usize]| {
        let t = Tensor::from_vec(data.to_vec(), shape, Device::Cpu).unwrap();
        t.set_requires_grad(true).unwrap();
        t
    };
    let (xt, wt, bt) = (leaf(x, &case.x), leaf(w, &case.w), leaf(b, &[case.w[0]]));
    let y = tandem_ops::conv2d(&xt, &wt, Some(&bt), &case.p).unwrap();
    let gyt = Tensor::from_vec(gy.to_vec(), &g.out_shape(), Device::Cpu).unwrap();
    backward(&y, Some(&gyt), &BackwardOptions::default()).unwrap();
    let grad = |t: &Tensor| match t.grad() {
        Some(g) => g.to_vec_f64().unwrap(),
        None => vec![0.0; t.numel()],
    };
    (y.to_vec_f64().unwrap(), grad(&xt), grad(&wt), grad(&bt))
}

// ---- im2col -----------------------------------------------------------------------------------

/// The chunks a case is run in: the whole batch, and (with more than one sample) the samples
/// after the first, so the input address is not the start of the tensor.
fn chunks(batch: usize) -> Vec<(usize, usize)> {
    let mut out = vec![(0, batch)];
    if batch > 1 {
        out.push((1, batch - 1));
    }
    out
}

fn im2col_matches_the_definition<T: Element>(seed: u64) {
    for case in cases() {
        let g = case.geometry();
        let x: Vec<T> = random(case.x.iter().product(), seed);
        let (_x_buffer, xa) = holding(&x);
        for (first, samples) in chunks(g.batch) {
            for layout in [ColumnLayout::PerSample, ColumnLayout::Joined] {
                let what = format!(
                    "im2col, {} {}, samples {first}..{}, {layout:?}",
                    case.name,
                    T::DTYPE,
                    first + samples
                );
                let want = columns_reference(&g, &x, first, samples, layout);
                let start = xa + (first * g.in_per_sample()) as u64 * size_of::<T>();
                run_fresh::<T>(
                    want.len(),
                    &what,
                    |cols| {
                        im2col_launch(T::DTYPE, &g, start, cols, samples, layout)
                            .unwrap_or_else(|e| panic!("{what}: {e}"))
                    },
                    |got, what| assert_exact(got, &want, what),
                );
            }
        }
    }
}

#[test]
fn im2col_writes_every_column_entry_as_the_definition_says_f32() {
    im2col_matches_the_definition::<f32>(1);
}

#[test]
fn im2col_writes_every_column_entry_as_the_definition_says_f64() {
    im2col_matches_the_definition::<f64>(2);
}

// ---- col2im -----------------------------------------------------------------------------------

/// The input gradient of samples `first..first + samples` from their column-matrix gradients
/// (`PerSample` layout), as a scatter: every column entry adds into the input element its tap
/// read (the adjoint of im2col, written the other way round from the kernel's gather).
fn col2im_reference<T: Element>(g: &Geometry, cols: &[T], samples: usize) -> Vec<f64> {
    let (kh, kw) = g.kernel;
    let (rows, pixels) = (g.patch(), g.out_pixels());
    let mut dx = vec![0.0; samples * g.in_per_sample()];
    for s in 0..samples {
        for c in 0..g.in_channels {
            for ki in 0..kh {
                for kj in 0..kw {
                    let k = (c * kh + ki) * kw + kj;
                    for oh in 0..g.out_h {
                        for ow in 0..g.out_w {
                            let h = (oh * g.stride.0 + ki * g.dilation.0) as isize
                                - g.padding.0 as isize;
                            let w = (ow * g.stride.1 + kj * g.dilation.1) as isize
                                - g.padding.1 as isize;
                            if h < 0 || w < 0 || h >= g.in_h as isize || w >= g.in_w as isize {
                                continue;
                            }
                            let p = oh * g.out_w + ow;
                            dx[((s * g.in_channels + c) * g.in_h + h as usize) * g.in_w
                                + w as usize] += cols[(s * rows + k) * pixels + p].to_f64();
                        }
                    }
                }
            }
        }
    }
    dx
}

fn col2im_matches_the_scatter<T: Element>(seed: u64) {
    for case in cases() {
        let g = case.geometry();
        for (first, samples) in chunks(g.batch) {
            let what = format!(
                "col2im, {} {}, samples {first}..{}",
                case.name,
                T::DTYPE,
                first + samples
            );
            // Only this chunk's column matrices exist (the engine reuses one buffer per chunk).
            let cols: Vec<T> = eighths(g.patch() * g.out_pixels() * samples, seed + first as u64);
            let (_cols_buffer, ca) = holding(&cols);
            let want = col2im_reference(&g, &cols, samples);
            run_fresh::<T>(
                want.len(),
                &what,
                |dx| {
                    col2im_launch(T::DTYPE, &g, ca, dx, samples)
                        .unwrap_or_else(|e| panic!("{what}: {e}"))
                },
                |got, what| assert_exact(got, &want, what),
            );
        }
    }
}

#[test]
fn col2im_sums_every_tap_that_read_an_input_element_f32() {
    col2im_matches_the_scatter::<f32>(3);
}

#[test]
fn col2im_sums_every_tap_that_read_an_input_element_f64() {
    col2im_matches_the_scatter::<f64>(4);
}

// ---- bias -------------------------------------------------------------------------------------

fn bias_add_matches_the_definition<T: Element>(seed: u64) {
    for case in cases() {
        let g = case.geometry();
        let (o, pixels) = (g.out_channels, g.out_pixels());
        let what = format!("bias add, {} {}", case.name, T::DTYPE);
        let out: Vec<T> = eighths(g.batch * o * pixels, seed);
        let bias: Vec<T> = eighths(o, seed + 1);
        let (_bias_buffer, ba) = holding(&bias);
        let want: Vec<f64> = out
            .iter()
            .enumerate()
            .map(|(i, v)| v.to_f64() + bias[(i / pixels) % o].to_f64())
            .collect();
        for small in [false, true] {
            let what = format!(
                "{what}, {}",
                if small {
                    "two-block grid"
                } else {
                    "default grid"
                }
            );
            let (buffer, address) = holding(&out);
            let launch = bias_add_launch(T::DTYPE, address, ba, g.batch, o, pixels)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let launch = if small { small_grid(&launch) } else { launch };
            run_launch(&launch, &what);
            assert_exact(buffer.storage(&what), &want, &what);
        }
    }
}

#[test]
fn bias_add_adds_each_channels_bias_to_its_pixels_f32() {
    bias_add_matches_the_definition::<f32>(5);
}

#[test]
fn bias_add_adds_each_channels_bias_to_its_pixels_f64() {
    bias_add_matches_the_definition::<f64>(6);
}

/// The bias gradient of `gy` (`[samples, channels, pixels]`) under `split`, run as the CUDA
/// path runs it (one or two launches), on poisoned outputs.
fn run_bias_grad<T: Element>(
    gy: &[T],
    dims: [usize; 3],
    split: BiasGradSplit,
    small: bool,
    what: &str,
) -> Vec<T> {
    let (_gy_buffer, ga) = holding(gy);
    let (grad, grad_address) = poisoned::<T>(dims[1]);
    let (partials, partials_address) = poisoned::<T>(split.partials_len(dims[1]));
    let partials_address = if split.partials_len(dims[1]) == 0 {
        0
    } else {
        partials_address
    };
    let launches = bias_grad_launches(T::DTYPE, ga, grad_address, partials_address, dims, split)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        launches.len(),
        if split.splits == 1 { 1 } else { 2 },
        "{what}"
    );
    for launch in &launches {
        let launch = if small {
            small_grid(launch)
        } else {
            launch.clone()
        };
        run_launch(&launch, what);
    }
    partials.storage(what);
    grad.storage(what).to_vec()
}

/// The splits a bias gradient of `total` entries per channel is tried with besides the one the
/// CUDA path picks: three slices (the last one short), and one entry per slice where that is
/// few slices (every block of the emulation is slow to run).
fn splits(total: usize) -> Vec<BiasGradSplit> {
    let mut out = Vec::new();
    if total > 1 {
        out.push(BiasGradSplit {
            splits: 3,
            span: total.div_ceil(3),
        });
    }
    if (2..=48).contains(&total) {
        out.push(BiasGradSplit {
            splits: total,
            span: 1,
        });
    }
    out
}

fn bias_grad_matches_the_sum<T: Element>(seed: u64) {
    let mut dims: Vec<(String, [usize; 3])> = cases()
        .iter()
        .map(|c| {
            let g = c.geometry();
            (
                c.name.to_string(),
                [g.batch, g.out_channels, g.out_pixels()],
            )
        })
        .collect();
    // More entries per channel than one slice of the default split: two passes.
    dims.push(("5000 entries per channel".into(), [3, 2, 1667]));
    for (name, [samples, channels, pixels]) in dims {
        let gy: Vec<T> = eighths(samples * channels * pixels, seed);
        let mut want = vec![0.0; channels];
        for s in 0..samples {
            for (o, w) in want.iter_mut().enumerate() {
                for p in 0..pixels {
                    *w += gy[(s * channels + o) * pixels + p].to_f64();
                }
            }
        }
        let total = samples * pixels;
        let default = BiasGradSplit::new(samples, pixels);
        for split in splits(total).into_iter().chain([default]) {
            for small in [false, true] {
                let what = format!(
                    "bias gradient, {name} {}, {split:?}, {}",
                    T::DTYPE,
                    if small {
                        "two-block grid"
                    } else {
                        "default grid"
                    }
                );
                let got = run_bias_grad(&gy, [samples, channels, pixels], split, small, &what);
                assert_exact(&got, &want, &what);
            }
        }
    }
}

#[test]
fn bias_grad_sums_each_channel_over_samples_and_pixels_f32() {
    bias_grad_matches_the_sum::<f32>(7);
}

#[test]
fn bias_grad_sums_each_channel_over_samples_and_pixels_f64() {
    bias_grad_matches_the_sum::<f64>(8);
}

// ---- the im2col + cuBLAS engine against the CPU op -------------------------------------------

/// The im2col + cuBLAS engine's three products, done here in f64 on the kernels' outputs (the
/// matrices are small; spelling them out keeps the layouts visible), against the CPU op.
fn engine_matches_the_cpu_op<T: Element>(seed: u64) {
    for case in cases() {
        let g = case.geometry();
        let (k, p, o) = (g.patch(), g.out_pixels(), g.out_channels);
        let n = g.batch;
        let x: Vec<T> = random(case.x.iter().product(), seed);
        let w: Vec<T> = random(case.w.iter().product(), seed + 1);
        let b: Vec<T> = random(o, seed + 2);
        let gy: Vec<T> = random(n * o * p, seed + 3);
        let (y_cpu, dx_cpu, dw_cpu, db_cpu) = cpu_op(&case, &x, &w, &b, &gy);
        let (_x_buffer, xa) = holding(&x);
        let wf: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
        let what = |part: &str| format!("{part} of {} {} against the CPU op", case.name, T::DTYPE);

        // Forward: im2col, y[n] = W·cols[n] (here, in f64), bias add.
        let (cols, ca) = poisoned::<T>(k * p * n);
        run_launch(
            &im2col_launch(T::DTYPE, &g, xa, ca, n, ColumnLayout::PerSample).unwrap(),
            &what("im2col"),
        );
        let cols = cols.storage(&what("im2col")).to_vec();
        let mut y = vec![T::from_f64(0.0); n * o * p];
        for s in 0..n {
            for oc in 0..o {
                for px in 0..p {
                    let acc: f64 = (0..k)
                        .map(|r| wf[oc * k + r] * cols[(s * k + r) * p + px].to_f64())
                        .sum();
                    y[(s * o + oc) * p + px] = T::from_f64(acc);
                }
            }
        }
        let (_b_buffer, ba) = holding(&b);
        let (y_buffer, ya) = holding(&y);
        run_launch(
            &bias_add_launch(T::DTYPE, ya, ba, n, o, p).unwrap(),
            &what("bias add"),
        );
        assert_close(y_buffer.storage(&what("output")), &y_cpu, &what("output"));

        // Input gradient: cols[n] = Wᵀ·dy[n] (here), col2im.
        let mut dcols = vec![T::from_f64(0.0); n * k * p];
        for s in 0..n {
            for r in 0..k {
                for px in 0..p {
                    let acc: f64 = (0..o)
                        .map(|oc| wf[oc * k + r] * gy[(s * o + oc) * p + px].to_f64())
                        .sum();
                    dcols[(s * k + r) * p + px] = T::from_f64(acc);
                }
            }
        }
        let (_dcols_buffer, dca) = holding(&dcols);
        let (dx, dxa) = poisoned::<T>(n * g.in_per_sample());
        run_launch(
            &col2im_launch(T::DTYPE, &g, dca, dxa, n).unwrap(),
            &what("col2im"),
        );
        assert_close(
            dx.storage(&what("input gradient")),
            &dx_cpu,
            &what("input gradient"),
        );

        // Weight gradient: joined columns, dW = dy (O×NP) · colsᵀ (NP×K) (here).
        let (joined, ja) = poisoned::<T>(k * p * n);
        run_launch(
            &im2col_launch(T::DTYPE, &g, xa, ja, n, ColumnLayout::Joined).unwrap(),
            &what("joined im2col"),
        );
        let joined = joined.storage(&what("joined im2col")).to_vec();
        let mut dw = vec![0.0; o * k];
        for oc in 0..o {
            for r in 0..k {
                dw[oc * k + r] = (0..n * p)
                    .map(|j| {
                        let (s, px) = (j / p, j % p);
                        gy[(s * o + oc) * p + px].to_f64() * joined[r * n * p + j].to_f64()
                    })
                    .sum();
            }
        }
        let dw: Vec<T> = dw.into_iter().map(T::from_f64).collect();
        assert_close(&dw, &dw_cpu, &what("weight gradient"));

        // Bias gradient.
        let db = run_bias_grad(
            &gy,
            [n, o, p],
            BiasGradSplit::new(n, p),
            false,
            &what("bias gradient"),
        );
        assert_close(&db, &db_cpu, &what("bias gradient"));
    }
}

#[test]
fn im2col_engine_gives_the_cpu_ops_output_and_gradients_f32() {
    engine_matches_the_cpu_op::<f32>(9);
}

#[test]
fn im2col_engine_gives_the_cpu_ops_output_and_gradients_f64() {
    engine_matches_the_cpu_op::<f64>(10);
}
