//! The emulated cuDNN on device memory of the emulated driver, through its C entry points (raw
//! integers for the enums, so that values cuDNN rejects can be passed): a hand-computed case,
//! the forward against a naive convolution written here and the three passes against each
//! other by their adjoint identities `<conv(x, w), g> = <x, bwd_data(g, w)> = <w,
//! bwd_filter(x, g)>`, over groups, dilation, stride, padding, convolution mode, NHWC filters
//! and explicitly strided tensors; alpha and beta; the algorithm enumeration and search; and
//! every argument check, with the status cuDNN returns.

mod common;

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use tandem_core::cuda::{self, libs, CudaDevice};
use tandem_core::{Device, Tensor};

const GPU: Device = Device::Cuda(0);

const SUCCESS: u32 = 0;
const BAD_PARAM: u32 = 2000;
const NULL_POINTER: u32 = 2002;
const NOT_SUPPORTED: u32 = 3000;

const FLOAT: u32 = 0;
const DOUBLE: u32 = 1;
const NCHW: u32 = 0;
const NHWC: u32 = 1;
const CONVOLUTION: u32 = 0;
const CROSS_CORRELATION: u32 = 1;

type P = *mut c_void;

fn lib() -> &'static libloading::Library {
    libs::library(libs::CudaLibrary::Cudnn, GPU).expect("the emulated cuDNN")
}

/// Calls the loaded cuDNN's `$name` with C signature `fn($t…) -> cudnnStatus_t`.
macro_rules! cudnn {
    ($name:ident($($arg:expr),* $(,)?) : ($($t:ty),* $(,)?)) => {{
        type F = unsafe extern "C" fn($($t),*) -> u32;
        // SAFETY: the emulated cuDNN exports `$name` with this signature.
        let f = unsafe { lib().get::<F>(stringify!($name).as_bytes()) }.unwrap();
        // SAFETY: the arguments are what the test means to pass (some wrong on purpose; the
        // emulator checks them before touching memory).
        unsafe { f($($arg),*) }
    }};
}

/// The device and a cuDNN handle on its compute stream.
fn setup() -> (Arc<CudaDevice>, P) {
    common::use_emulator();
    let dev = cuda::device(0).unwrap();
    libs::ensure(libs::CudaLibrary::Cudnn, GPU).unwrap();
    let path = libs::locate(libs::CudaLibrary::Cudnn, GPU).unwrap();
    assert!(path.starts_with(common::use_emulator()), "{path:?}");
    dev.bind("test").unwrap();
    let mut h: P = std::ptr::null_mut();
    assert_eq!(cudnn!(cudnnCreate(&mut h) : (*mut P)), SUCCESS);
    let stream = dev.compute_stream().cu_stream() as P;
    assert_eq!(cudnn!(cudnnSetStream(h, stream) : (P, P)), SUCCESS);
    let mut got: P = std::ptr::null_mut();
    assert_eq!(cudnn!(cudnnGetStream(h, &mut got) : (P, *mut P)), SUCCESS);
    assert_eq!(got, stream);
    (dev, h)
}

fn tensor_desc(dtype: u32, dims: [usize; 4], strides: [usize; 4]) -> P {
    let mut d: P = std::ptr::null_mut();
    assert_eq!(
        cudnn!(cudnnCreateTensorDescriptor(&mut d) : (*mut P)),
        SUCCESS
    );
    let [n, c, h, w] = dims.map(|v| v as c_int);
    let [ns, cs, hs, ws] = strides.map(|v| v as c_int);
    let status = cudnn!(cudnnSetTensor4dDescriptorEx(d, dtype, n, c, h, w, ns, cs, hs, ws)
        : (P, u32, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int));
    assert_eq!(status, SUCCESS);
    d
}

fn dense(dims: [usize; 4]) -> [usize; 4] {
    let [_, c, h, w] = dims;
    [c * h * w, h * w, w, 1]
}

fn filter_desc(dtype: u32, format: u32, dims: [usize; 4]) -> P {
    let mut d: P = std::ptr::null_mut();
    assert_eq!(
        cudnn!(cudnnCreateFilterDescriptor(&mut d) : (*mut P)),
        SUCCESS
    );
    let [k, c, h, w] = dims.map(|v| v as c_int);
    let status = cudnn!(cudnnSetFilter4dDescriptor(d, dtype, format, k, c, h, w) : (P, u32, u32, c_int, c_int, c_int, c_int));
    assert_eq!(status, SUCCESS);
    d
}

/// A geometry: (padding, stride, dilation) as (height, width) pairs, mode, groups.
#[derive(Clone, Copy, Debug)]
struct Geo {
    pad: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    mode: u32,
    groups: usize,
}

const PLAIN: Geo = Geo {
    pad: [0, 0],
    stride: [1, 1],
    dilation: [1, 1],
    mode: CROSS_CORRELATION,
    groups: 1,
};

fn conv_desc(g: Geo, compute: u32) -> P {
    let mut d: P = std::ptr::null_mut();
    assert_eq!(
        cudnn!(cudnnCreateConvolutionDescriptor(&mut d) : (*mut P)),
        SUCCESS
    );
    let i = |v: usize| v as c_int;
    let status = cudnn!(cudnnSetConvolution2dDescriptor(
        d, i(g.pad[0]), i(g.pad[1]), i(g.stride[0]), i(g.stride[1]), i(g.dilation[0]),
        i(g.dilation[1]), g.mode, compute
    ) : (P, c_int, c_int, c_int, c_int, c_int, c_int, u32, u32));
    assert_eq!(status, SUCCESS);
    assert_eq!(
        cudnn!(cudnnSetConvolutionGroupCount(d, i(g.groups)) : (P, c_int)),
        SUCCESS
    );
    d
}

/// Which pass a call runs (the emulator's numbering of `cudnnConvolution{Forward,
/// BackwardData, BackwardFilter}`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Pass {
    Forward,
    Data,
    Filter,
}

/// The descriptors of one convolution, by role: input, filter, output.
#[derive(Clone, Copy)]
struct Descs {
    x: P,
    w: P,
    conv: P,
    y: P,
}

/// Runs a pass: buffers by role `[x, w, y]` (the pass writes `y`, `x` or `w`).
#[allow(clippy::too_many_arguments)]
fn run(
    pass: Pass,
    h: P,
    d: Descs,
    [x, w, y]: [u64; 3],
    algo: u32,
    (ws, ws_bytes): (u64, usize),
    alpha: *const c_void,
    beta: *const c_void,
) -> u32 {
    let (x, w, y, ws) = (x as P, w as P, y as P, ws as P);
    match pass {
        Pass::Forward => {
            cudnn!(cudnnConvolutionForward(h, alpha, d.x, x, d.w, w, d.conv, algo, ws, ws_bytes, beta, d.y, y)
            : (P, *const c_void, P, P, P, P, P, u32, P, usize, *const c_void, P, P))
        }
        Pass::Data => {
            cudnn!(cudnnConvolutionBackwardData(h, alpha, d.w, w, d.y, y, d.conv, algo, ws, ws_bytes, beta, d.x, x)
            : (P, *const c_void, P, P, P, P, P, u32, P, usize, *const c_void, P, P))
        }
        Pass::Filter => {
            cudnn!(cudnnConvolutionBackwardFilter(h, alpha, d.x, x, d.y, y, d.conv, algo, ws, ws_bytes, beta, d.w, w)
            : (P, *const c_void, P, P, P, P, P, u32, P, usize, *const c_void, P, P))
        }
    }
}

/// Runs a pass with the default algorithm (0), no workspace, and f32 scalars.
fn run_f32(pass: Pass, h: P, d: Descs, ptrs: [u64; 3], alpha: f32, beta: f32) -> u32 {
    run(
        pass,
        h,
        d,
        ptrs,
        0,
        (0, 0),
        (&alpha as *const f32).cast(),
        (&beta as *const f32).cast(),
    )
}

/// One ranking entry, laid out as `cudnnConvolution*AlgoPerf_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Perf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [c_int; 3],
}

/// The heuristics' ranking (`…Algorithm_v7`), or the status.
fn heuristic(pass: Pass, h: P, d: Descs) -> Result<Vec<Perf>, u32> {
    let mut out = vec![Perf::default(); 8];
    let mut n: c_int = 0;
    let (req, ret, res) = (8, &mut n as *mut c_int, out.as_mut_ptr());
    let status = match pass {
        Pass::Forward => {
            cudnn!(cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.conv, d.y, req, ret, res)
            : (P, P, P, P, P, c_int, *mut c_int, *mut Perf))
        }
        Pass::Data => {
            cudnn!(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w, d.y, d.conv, d.x, req, ret, res)
            : (P, P, P, P, P, c_int, *mut c_int, *mut Perf))
        }
        Pass::Filter => {
            cudnn!(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x, d.y, d.conv, d.w, req, ret, res)
            : (P, P, P, P, P, c_int, *mut c_int, *mut Perf))
        }
    };
    if status != SUCCESS {
        return Err(status);
    }
    out.truncate(n as usize);
    Ok(out)
}

/// The search's ranking (`cudnnFind…AlgorithmEx`, which runs the pass), or the status.
fn find(
    pass: Pass,
    h: P,
    d: Descs,
    [x, w, y]: [u64; 3],
    (ws, bytes): (u64, usize),
) -> Result<Vec<Perf>, u32> {
    let mut out = vec![Perf::default(); 8];
    let mut n: c_int = 0;
    let (x, w, y, ws) = (x as P, w as P, y as P, ws as P);
    let (req, ret, res) = (8, &mut n as *mut c_int, out.as_mut_ptr());
    let status = match pass {
        Pass::Forward => {
            cudnn!(cudnnFindConvolutionForwardAlgorithmEx(h, d.x, x, d.w, w, d.conv, d.y, y, req, ret, res, ws, bytes)
            : (P, P, P, P, P, P, P, P, c_int, *mut c_int, *mut Perf, P, usize))
        }
        Pass::Data => {
            cudnn!(cudnnFindConvolutionBackwardDataAlgorithmEx(h, d.w, w, d.y, y, d.conv, d.x, x, req, ret, res, ws, bytes)
            : (P, P, P, P, P, P, P, P, c_int, *mut c_int, *mut Perf, P, usize))
        }
        Pass::Filter => {
            cudnn!(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, d.x, x, d.y, y, d.conv, d.w, w, req, ret, res, ws, bytes)
            : (P, P, P, P, P, P, P, P, c_int, *mut c_int, *mut Perf, P, usize))
        }
    };
    if status != SUCCESS {
        return Err(status);
    }
    out.truncate(n as usize);
    Ok(out)
}

/// The workspace `algo` needs, or the status.
fn workspace(pass: Pass, h: P, d: Descs, algo: u32) -> Result<usize, u32> {
    let mut size = 0usize;
    let s = &mut size as *mut usize;
    let status = match pass {
        Pass::Forward => {
            cudnn!(cudnnGetConvolutionForwardWorkspaceSize(h, d.x, d.w, d.conv, d.y, algo, s)
            : (P, P, P, P, P, u32, *mut usize))
        }
        Pass::Data => {
            cudnn!(cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.w, d.y, d.conv, d.x, algo, s)
            : (P, P, P, P, P, u32, *mut usize))
        }
        Pass::Filter => {
            cudnn!(cudnnGetConvolutionBackwardFilterWorkspaceSize(h, d.x, d.y, d.conv, d.w, algo, s)
            : (P, P, P, P, P, u32, *mut usize))
        }
    };
    if status == SUCCESS {
        Ok(size)
    } else {
        Err(status)
    }
}

/// Values with few significant bits, so products and short sums are exact.
fn values(n: usize, seed: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + seed * 5 + 3) % 11) as f64 * 0.25 - 1.25)
        .collect()
}

/// `v` on the GPU as f64 (or f32) elements.
fn upload(v: &[f64], dtype: u32) -> Tensor {
    let t = if dtype == DOUBLE {
        Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu)
    } else {
        Tensor::from_vec(
            v.iter().map(|&x| x as f32).collect(),
            &[v.len()],
            Device::Cpu,
        )
    };
    t.unwrap().to_device(GPU).unwrap()
}

fn ptr(t: &Tensor) -> u64 {
    cuda::device_pointer("test", t).unwrap().1
}

fn download(dev: &CudaDevice, t: &Tensor) -> Vec<f64> {
    dev.synchronize().unwrap();
    t.to_vec_f64().unwrap()
}

/// The number of elements a tensor of `dims` with `strides` spans.
fn span(dims: [usize; 4], strides: [usize; 4]) -> usize {
    1 + dims
        .iter()
        .zip(&strides)
        .map(|(d, s)| (d - 1) * s)
        .sum::<usize>()
}

/// One test geometry: input dims and strides, filter dims `[K, C/g, R, S]` and layout, geometry.
#[derive(Clone, Copy, Debug)]
struct Case {
    x: [usize; 4],
    x_strides: [usize; 4],
    w: [usize; 4],
    format: u32,
    geo: Geo,
}

impl Case {
    fn out(&self) -> [usize; 4] {
        let g = &self.geo;
        let o = |d: usize| {
            let span = g.dilation[d] * (self.w[2 + d] - 1) + 1;
            (self.x[2 + d] + 2 * g.pad[d] - span) / g.stride[d] + 1
        };
        [self.x[0], self.w[0], o(0), o(1)]
    }

    /// Element strides of the filter `[K, C, R, S]` in its layout.
    fn w_strides(&self) -> [usize; 4] {
        let [_, c, r, s] = self.w;
        if self.format == NHWC {
            [r * s * c, 1, s * c, c]
        } else {
            [c * r * s, r * s, s, 1]
        }
    }

    /// The elements `x`, `w` and `y` span (`y` dense).
    fn spans(&self) -> (usize, usize, usize) {
        let y = self.out();
        (
            span(self.x, self.x_strides),
            span(self.w, self.w_strides()),
            span(y, dense(y)),
        )
    }

    fn descs(&self, dtype: u32, compute: u32) -> Descs {
        let y = self.out();
        Descs {
            x: tensor_desc(dtype, self.x, self.x_strides),
            w: filter_desc(dtype, self.format, self.w),
            conv: conv_desc(self.geo, compute),
            y: tensor_desc(dtype, y, dense(y)),
        }
    }
}

/// The forward convolution, naively: every output element as a sum over its taps, skipping
/// taps in the padding.
fn naive_forward(c: &Case, x: &[f64], w: &[f64]) -> Vec<f64> {
    let [n_, _, h_, w_] = c.x;
    let [k_, cg, r_, s_] = c.w;
    let y = c.out();
    let (xs, ws, ys) = (c.x_strides, c.w_strides(), dense(y));
    let g = &c.geo;
    let mut out = vec![0.0; span(y, ys)];
    for n in 0..n_ {
        for k in 0..k_ {
            let group = k / (k_ / g.groups);
            for p in 0..y[2] {
                for q in 0..y[3] {
                    let mut sum = 0.0;
                    for cl in 0..cg {
                        for r in 0..r_ {
                            for s in 0..s_ {
                                let ih =
                                    (p * g.stride[0] + r * g.dilation[0]) as i64 - g.pad[0] as i64;
                                let iw =
                                    (q * g.stride[1] + s * g.dilation[1]) as i64 - g.pad[1] as i64;
                                if ih < 0 || iw < 0 || ih >= h_ as i64 || iw >= w_ as i64 {
                                    continue;
                                }
                                let (fr, fs) = if g.mode == CONVOLUTION {
                                    (r_ - 1 - r, s_ - 1 - s)
                                } else {
                                    (r, s)
                                };
                                let ch = group * cg + cl;
                                let xv = x[n * xs[0]
                                    + ch * xs[1]
                                    + ih as usize * xs[2]
                                    + iw as usize * xs[3]];
                                let wv = w[k * ws[0] + cl * ws[1] + fr * ws[2] + fs * ws[3]];
                                sum += xv * wv;
                            }
                        }
                    }
                    out[n * ys[0] + k * ys[1] + p * ys[2] + q * ys[3]] = sum;
                }
            }
        }
    }
    out
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Elements a tensor of `dims` with `strides` really holds (padding elements between them are
/// left out of dot products).
fn held(v: &[f64], dims: [usize; 4], strides: [usize; 4]) -> Vec<f64> {
    let mut out = Vec::new();
    for a in 0..dims[0] {
        for b in 0..dims[1] {
            for c in 0..dims[2] {
                for d in 0..dims[3] {
                    out.push(v[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]]);
                }
            }
        }
    }
    out
}

fn cases() -> Vec<Case> {
    let nhwc = |[_, c, h, w]: [usize; 4]| [h * w * c, 1, w * c, c];
    vec![
        Case {
            x: [2, 3, 7, 6],
            x_strides: dense([2, 3, 7, 6]),
            w: [4, 3, 3, 3],
            format: NCHW,
            geo: Geo {
                pad: [1, 1],
                ..PLAIN
            },
        },
        Case {
            x: [1, 4, 9, 8],
            x_strides: dense([1, 4, 9, 8]),
            w: [6, 2, 3, 2],
            format: NCHW,
            geo: Geo {
                pad: [2, 0],
                stride: [2, 1],
                dilation: [1, 2],
                groups: 2,
                ..PLAIN
            },
        },
        Case {
            x: [2, 3, 8, 9],
            x_strides: nhwc([2, 3, 8, 9]),
            w: [2, 3, 2, 3],
            format: NHWC,
            geo: Geo {
                pad: [0, 1],
                stride: [3, 2],
                dilation: [2, 1],
                mode: CONVOLUTION,
                groups: 1,
            },
        },
        Case {
            // An input with room between its rows and samples (a view of a larger buffer).
            x: [2, 2, 5, 5],
            x_strides: [80, 35, 7, 1],
            w: [3, 2, 5, 5],
            format: NCHW,
            geo: Geo {
                pad: [1, 2],
                ..PLAIN
            },
        },
    ]
}

#[test]
fn a_hand_computed_padded_and_strided_cross_correlation() {
    let (dev, h) = setup();
    // x = [[1, 2], [3, 4]], w = all ones 2×2, padding 1: every output sums the input pixels
    // under the window.
    let case = Case {
        x: [1, 1, 2, 2],
        x_strides: dense([1, 1, 2, 2]),
        w: [1, 1, 2, 2],
        format: NCHW,
        geo: Geo {
            pad: [1, 1],
            ..PLAIN
        },
    };
    for (geo, want) in [
        (case.geo, vec![1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 3.0, 7.0, 4.0]),
        (
            Geo {
                stride: [2, 2],
                ..case.geo
            },
            vec![1.0, 2.0, 3.0, 4.0],
        ),
    ] {
        let c = Case { geo, ..case };
        let d = c.descs(FLOAT, FLOAT);
        let x = upload(&[1.0, 2.0, 3.0, 4.0], FLOAT);
        let w = upload(&[1.0; 4], FLOAT);
        let y = upload(&vec![0.0; want.len()], FLOAT);
        let status = run_f32(Pass::Forward, h, d, [ptr(&x), ptr(&w), ptr(&y)], 1.0, 0.0);
        assert_eq!(status, SUCCESS);
        assert_eq!(download(&dev, &y), want, "{geo:?}");
    }
}

#[test]
fn forward_matches_a_naive_convolution_and_the_passes_are_adjoint() {
    let (dev, h) = setup();
    for (i, c) in cases().into_iter().enumerate() {
        let d = c.descs(DOUBLE, DOUBLE);
        let (xn, wn, yn) = c.spans();
        let (xv, wv, gv) = (values(xn, i), values(wn, i + 1), values(yn, i + 2));
        let (x, w, g) = (
            upload(&xv, DOUBLE),
            upload(&wv, DOUBLE),
            upload(&gv, DOUBLE),
        );
        let (y, dx, dw) = (
            upload(&vec![0.0; yn], DOUBLE),
            upload(&vec![0.0; xn], DOUBLE),
            upload(&vec![0.0; wn], DOUBLE),
        );
        let (one, zero) = (1.0f64, 0.0f64);
        let (one, zero) = ((&one as *const f64).cast(), (&zero as *const f64).cast());
        for (pass, ptrs) in [
            (Pass::Forward, [ptr(&x), ptr(&w), ptr(&y)]),
            (Pass::Data, [ptr(&dx), ptr(&w), ptr(&g)]),
            (Pass::Filter, [ptr(&x), ptr(&dw), ptr(&g)]),
        ] {
            // The heuristics' first choice, with the workspace it asks for.
            let best = heuristic(pass, h, d).unwrap()[0];
            assert_eq!(best.status, SUCCESS);
            let bytes = workspace(pass, h, d, best.algo).unwrap();
            assert_eq!(bytes, best.memory, "{c:?} {pass:?}");
            let ws = upload(&vec![0.0; bytes.div_ceil(8).max(1)], DOUBLE);
            let status = run(pass, h, d, ptrs, best.algo, (ptr(&ws), bytes), one, zero);
            assert_eq!(status, SUCCESS, "{c:?} {pass:?} algo {}", best.algo);
        }
        let (y, dx, dw) = (download(&dev, &y), download(&dev, &dx), download(&dev, &dw));
        let want = naive_forward(&c, &xv, &wv);
        for (k, (a, b)) in y.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
                "case {i} {c:?}: y[{k}] = {a}, naively {b}"
            );
        }
        let x_held = |v: &[f64]| held(v, c.x, c.x_strides);
        let w_held = |v: &[f64]| held(v, c.w, c.w_strides());
        let forward = dot(&y, &gv);
        let data = dot(&x_held(&xv), &x_held(&dx));
        let filter = dot(&w_held(&wv), &w_held(&dw));
        let tol = 1e-9 * (1.0 + forward.abs());
        assert!(
            (forward - data).abs() <= tol,
            "case {i} {c:?}: <conv(x,w),g> = {forward}, <x,bwd_data> = {data}"
        );
        assert!(
            (forward - filter).abs() <= tol,
            "case {i} {c:?}: <conv(x,w),g> = {forward}, <w,bwd_filter> = {filter}"
        );
    }
}

#[test]
fn alpha_and_beta_scale_and_accumulate_and_beta_zero_ignores_the_output() {
    let (dev, h) = setup();
    let c = cases()[0];
    let d = c.descs(FLOAT, FLOAT);
    let (xn, wn, yn) = c.spans();
    let (xv, wv) = (values(xn, 1), values(wn, 2));
    let (x, w) = (upload(&xv, FLOAT), upload(&wv, FLOAT));
    let plain = naive_forward(&c, &xv, &wv);
    let old = values(yn, 3);
    let y = upload(&old, FLOAT);
    let status = run_f32(Pass::Forward, h, d, [ptr(&x), ptr(&w), ptr(&y)], 2.0, 0.5);
    assert_eq!(status, SUCCESS);
    let got = download(&dev, &y);
    for k in 0..yn {
        let want = 2.0 * plain[k] + 0.5 * old[k];
        assert!(
            (got[k] - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "y[{k}] = {}, want {want}",
            got[k]
        );
    }
    // With beta = 0 the output is not read: NaNs there do not reach the result.
    let fresh = upload(&vec![f64::NAN; yn], FLOAT);
    let status = run_f32(
        Pass::Forward,
        h,
        d,
        [ptr(&x), ptr(&w), ptr(&fresh)],
        1.0,
        0.0,
    );
    assert_eq!(status, SUCCESS);
    let got = download(&dev, &fresh);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "beta = 0 read the output: {got:?}"
    );
}

#[test]
fn the_rankings_offer_algorithms_with_and_without_workspace_and_the_search_runs_the_pass() {
    let (dev, h) = setup();
    // 3×3, stride 1: the Winograd algorithms apply too.
    let c = cases()[0];
    let d = c.descs(FLOAT, FLOAT);
    let (xn, wn, yn) = c.spans();
    let (xv, wv) = (values(xn, 4), values(wn, 5));
    let (x, w) = (upload(&xv, FLOAT), upload(&wv, FLOAT));
    let y = Tensor::empty(&[yn], tandem_core::DType::F32, GPU).unwrap();
    let ws = Tensor::empty(&[1 << 16], tandem_core::DType::F32, GPU).unwrap();
    for pass in [Pass::Forward, Pass::Data, Pass::Filter] {
        let ranked = heuristic(pass, h, d).unwrap();
        let ok: Vec<&Perf> = ranked.iter().filter(|p| p.status == SUCCESS).collect();
        assert!(ok.len() >= 3, "{pass:?}: {ranked:?}");
        assert!(
            ok.iter().any(|p| p.memory == 0) && ok.iter().any(|p| p.memory > 0),
            "{pass:?}: {ranked:?}"
        );
        assert!(
            ok.windows(2).all(|p| p[0].time <= p[1].time),
            "{pass:?}: ranked by time: {ranked:?}"
        );
        let first_refused = ranked
            .iter()
            .position(|p| p.status != SUCCESS)
            .unwrap_or(ranked.len());
        assert!(
            ranked[first_refused..]
                .iter()
                .all(|p| p.status == NOT_SUPPORTED),
            "{pass:?}: refused ones last: {ranked:?}"
        );
        for p in &ok {
            assert_eq!(
                workspace(pass, h, d, p.algo),
                Ok(p.memory),
                "{pass:?} algo {}",
                p.algo
            );
        }
        for p in &ranked[first_refused..] {
            assert_eq!(
                workspace(pass, h, d, p.algo),
                Err(NOT_SUPPORTED),
                "{pass:?} algo {}",
                p.algo
            );
        }
    }
    // The search runs the forward pass (the output is written) and, with no workspace, ranks
    // only the algorithms that need none.
    let found = find(Pass::Forward, h, d, [ptr(&x), ptr(&w), ptr(&y)], (0, 0)).unwrap();
    let ok: Vec<&Perf> = found.iter().filter(|p| p.status == SUCCESS).collect();
    assert!(
        !ok.is_empty() && ok.iter().all(|p| p.memory == 0),
        "{found:?}"
    );
    let got = download(&dev, &y);
    let want = naive_forward(&c, &xv, &wv);
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())),
        "{got:?} {want:?}"
    );
    let with_workspace = find(
        Pass::Forward,
        h,
        d,
        [ptr(&x), ptr(&w), ptr(&y)],
        (ptr(&ws), 1 << 18),
    )
    .unwrap();
    assert!(
        with_workspace
            .iter()
            .any(|p| p.status == SUCCESS && p.memory > 0),
        "{with_workspace:?}"
    );
    // A misaligned output: the algorithms that need 16-byte buffers are refused by the search,
    // and by the pass itself.
    let big = Tensor::empty(&[yn + 4], tandem_core::DType::F32, GPU).unwrap();
    let shifted = ptr(&big) + 4;
    let found = find(
        Pass::Forward,
        h,
        d,
        [ptr(&x), ptr(&w), shifted],
        (ptr(&ws), 1 << 18),
    )
    .unwrap();
    let precomp = found.iter().find(|p| p.algo == 1).unwrap();
    assert_eq!(precomp.status, NOT_SUPPORTED, "{found:?}");
    let bytes = workspace(Pass::Forward, h, d, 1).unwrap();
    let (one, zero) = (1.0f32, 0.0f32);
    let status = run(
        Pass::Forward,
        h,
        d,
        [ptr(&x), ptr(&w), shifted],
        1,
        (ptr(&ws), bytes),
        (&one as *const f32).cast(),
        (&zero as *const f32).cast(),
    );
    assert_eq!(status, NOT_SUPPORTED);
}

#[test]
fn arguments_cudnn_refuses_give_its_status() {
    let (_dev, h) = setup();
    let c = cases()[0];
    let d = c.descs(FLOAT, FLOAT);
    let (xn, wn, yn) = c.spans();
    let (x, w, y) = (
        upload(&values(xn, 1), FLOAT),
        upload(&values(wn, 2), FLOAT),
        upload(&vec![0.0; yn], FLOAT),
    );
    let ptrs = [ptr(&x), ptr(&w), ptr(&y)];
    let ws = Tensor::empty(&[1 << 16], tandem_core::DType::F32, GPU).unwrap();
    let (one, zero) = (1.0f32, 0.0f32);
    let (one, zero): (*const c_void, *const c_void) =
        ((&one as *const f32).cast(), (&zero as *const f32).cast());
    let fwd = |d: Descs, ptrs: [u64; 3], algo: u32, ws: (u64, usize), alpha: *const c_void| {
        run(Pass::Forward, h, d, ptrs, algo, ws, alpha, zero)
    };
    // GEMM (2) needs a workspace.
    let need = workspace(Pass::Forward, h, d, 2).unwrap();
    assert!(need > 0);
    assert_eq!(
        fwd(d, ptrs, 2, (ptr(&ws), need - 1), one),
        BAD_PARAM,
        "a workspace one byte short"
    );
    assert_eq!(
        fwd(d, ptrs, 2, (0, need), one),
        BAD_PARAM,
        "a null workspace"
    );
    assert_eq!(
        fwd(d, ptrs, 2, (ptr(&ws), need), one),
        SUCCESS,
        "the workspace asked for"
    );
    assert_eq!(
        fwd(d, ptrs, 99, (0, 0), one),
        BAD_PARAM,
        "an algorithm that does not exist"
    );
    assert_eq!(fwd(d, ptrs, 3, (0, 0), one), NOT_SUPPORTED, "DIRECT");
    assert_eq!(workspace(Pass::Forward, h, d, 99), Err(BAD_PARAM));
    assert_eq!(
        fwd(d, [0, ptrs[1], ptrs[2]], 0, (0, 0), one),
        NULL_POINTER,
        "a null input"
    );
    assert_eq!(
        fwd(d, ptrs, 0, (0, 0), std::ptr::null()),
        NULL_POINTER,
        "a null alpha"
    );
    // An output one element longer than its buffer: outside the allocation.
    let short = upload(&vec![0.0; yn - 1], FLOAT);
    assert_eq!(
        fwd(d, [ptrs[0], ptrs[1], ptr(&short)], 0, (0, 0), one),
        BAD_PARAM,
        "an output past its buffer"
    );
    assert!(
        common::last_fault().contains("cudnnConvolutionForward"),
        "{}",
        common::last_fault()
    );
    // Descriptors that contradict each other.
    let y_dims = c.out();
    let [n, k, p, q] = y_dims;
    let wrong_y = Descs {
        y: tensor_desc(FLOAT, [n, k, p + 1, q], dense([n, k, p + 1, q])),
        ..d
    };
    assert_eq!(
        fwd(wrong_y, ptrs, 0, (0, 0), one),
        NOT_SUPPORTED,
        "an output of the wrong size"
    );
    let wrong_k = Descs {
        y: tensor_desc(FLOAT, [n, k + 1, p, q], dense([n, k + 1, p, q])),
        ..d
    };
    assert_eq!(
        fwd(wrong_k, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "output channels that are not the filters"
    );
    let wrong_c = Descs {
        w: filter_desc(FLOAT, NCHW, [c.w[0], c.w[1] + 1, 3, 3]),
        ..d
    };
    assert_eq!(
        fwd(wrong_c, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "filter channels that are not the input's"
    );
    let wrong_type = Descs {
        w: filter_desc(DOUBLE, NCHW, c.w),
        ..d
    };
    assert_eq!(
        fwd(wrong_type, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "data types that differ"
    );
    let grouped = Descs {
        conv: conv_desc(Geo { groups: 3, ..c.geo }, FLOAT),
        ..d
    };
    assert_eq!(
        fwd(grouped, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "4 filters in 3 groups"
    );
    let too_big = Descs {
        w: filter_desc(FLOAT, NCHW, [c.w[0], c.w[1], 10, 3]),
        ..d
    };
    assert_eq!(
        fwd(too_big, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "a filter taller than the padded input"
    );
    let double_x = Descs {
        x: tensor_desc(DOUBLE, c.x, c.x_strides),
        w: filter_desc(DOUBLE, NCHW, c.w),
        y: tensor_desc(DOUBLE, y_dims, dense(y_dims)),
        ..d
    };
    assert_eq!(
        fwd(double_x, ptrs, 0, (0, 0), one),
        NOT_SUPPORTED,
        "f64 data with f32 compute"
    );
    // Handles and descriptors.
    assert_eq!(
        run(
            Pass::Forward,
            std::ptr::null_mut(),
            d,
            ptrs,
            0,
            (0, 0),
            one,
            zero
        ),
        BAD_PARAM,
        "a null handle"
    );
    let mut gone: P = std::ptr::null_mut();
    assert_eq!(cudnn!(cudnnCreate(&mut gone) : (*mut P)), SUCCESS);
    assert_eq!(cudnn!(cudnnDestroy(gone) : (P)), SUCCESS);
    assert_eq!(
        run(Pass::Forward, gone, d, ptrs, 0, (0, 0), one, zero),
        BAD_PARAM,
        "a destroyed handle"
    );
    let unset = {
        let mut t: P = std::ptr::null_mut();
        assert_eq!(
            cudnn!(cudnnCreateTensorDescriptor(&mut t) : (*mut P)),
            SUCCESS
        );
        t
    };
    assert_eq!(
        fwd(Descs { y: unset, ..d }, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "a descriptor never set"
    );
    assert_eq!(
        fwd(Descs { y: d.w, ..d }, ptrs, 0, (0, 0), one),
        BAD_PARAM,
        "a filter as the output"
    );
    // Setting descriptors.
    let status = cudnn!(cudnnSetTensor4dDescriptor(unset, NCHW, FLOAT, 1, 0, 3, 3) : (P, u32, u32, c_int, c_int, c_int, c_int));
    assert_eq!(status, BAD_PARAM, "a zero dim");
    let status = cudnn!(cudnnSetTensor4dDescriptor(unset, 7, FLOAT, 1, 1, 3, 3) : (P, u32, u32, c_int, c_int, c_int, c_int));
    assert_eq!(status, BAD_PARAM, "an unknown format");
    let status = cudnn!(cudnnSetConvolution2dDescriptor(d.conv, -1, 0, 1, 1, 1, 1, CROSS_CORRELATION, FLOAT) : (P, c_int, c_int, c_int, c_int, c_int, c_int, u32, u32));
    assert_eq!(status, BAD_PARAM, "a negative padding");
    let status = cudnn!(cudnnSetConvolution2dDescriptor(d.conv, 0, 0, 0, 1, 1, 1, CROSS_CORRELATION, FLOAT) : (P, c_int, c_int, c_int, c_int, c_int, c_int, u32, u32));
    assert_eq!(status, BAD_PARAM, "a zero stride");
    assert_eq!(
        cudnn!(cudnnSetConvolutionMathType(d.conv, 9) : (P, u32)),
        BAD_PARAM,
        "an unknown math type"
    );
    assert_eq!(
        cudnn!(cudnnSetConvolutionGroupCount(d.conv, 0) : (P, c_int)),
        BAD_PARAM,
        "no groups"
    );
    // Rankings.
    let mut n_out: c_int = 0;
    let mut perf = [Perf::default(); 8];
    let status = cudnn!(cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.conv, d.y, 0, &mut n_out, perf.as_mut_ptr())
        : (P, P, P, P, P, c_int, *mut c_int, *mut Perf));
    assert_eq!(status, BAD_PARAM, "no algorithm requested");
    let status = find(Pass::Forward, h, d, ptrs, (0, 1024));
    assert_eq!(
        status.unwrap_err(),
        BAD_PARAM,
        "a null workspace of 1024 bytes"
    );
}

#[test]
fn every_pass_counts_as_a_convolution() {
    let (dev, h) = setup();
    let c = cases()[0];
    let d = c.descs(FLOAT, FLOAT);
    let (xn, wn, yn) = c.spans();
    let (x, w, y) = (
        upload(&values(xn, 1), FLOAT),
        upload(&values(wn, 2), FLOAT),
        upload(&vec![0.0; yn], FLOAT),
    );
    dev.synchronize().unwrap();
    let before = common::counters();
    for pass in [Pass::Forward, Pass::Data, Pass::Filter] {
        let status = run_f32(pass, h, d, [ptr(&x), ptr(&w), ptr(&y)], 1.0, 0.0);
        assert_eq!(status, SUCCESS, "{pass:?}");
    }
    dev.synchronize().unwrap();
    let after = common::counters().since(&before);
    // Other tests of this binary may run convolutions at the same time.
    assert!(after.convolutions >= 3, "{after:?}");
}

const HALF: u32 = 2;
const BFLOAT16: u32 = 9;
const TENSOR_OP_MATH: u32 = 1;

/// `v` on the GPU as f16 or bf16 elements (exact: the test values have few bits).
fn upload_low(v: &[f64], dtype: u32) -> Tensor {
    let t = upload(v, FLOAT);
    let low = if dtype == HALF {
        tandem_core::DType::F16
    } else {
        tandem_core::DType::BF16
    };
    t.to_dtype(low).unwrap()
}

/// `v` rounded to nearest even in f16 or bf16.
fn round_low(v: f64, dtype: u32) -> f64 {
    if dtype == HALF {
        half::f16::from_f64(v).to_f64()
    } else {
        half::bf16::from_f64(v).to_f64()
    }
}

#[test]
fn low_precision_passes_with_f32_compute_and_tensor_op_math_round_the_f64_result_once() {
    // The test values' products and sums are exact in f32, so a pass that accumulates in f32
    // and rounds once gives exactly the f64 pass's result rounded to the low dtype (an f16 or
    // bf16 accumulation would round on the way). NCHW and NHWC cases, the last one with a
    // channels-last output as well.
    let (dev, h) = setup();
    let nhwc = |[_, c, h, w]: [usize; 4]| [h * w * c, 1, w * c, c];
    let mut cases: Vec<(Case, bool)> = cases().into_iter().map(|c| (c, false)).collect();
    let last = cases[2].0;
    cases.push((last, true));
    for dtype in [HALF, BFLOAT16] {
        for (i, &(c, nhwc_out)) in cases.iter().enumerate() {
            let y_dims = c.out();
            let y_strides = if nhwc_out {
                nhwc(y_dims)
            } else {
                dense(y_dims)
            };
            let descs = |data: u32, compute: u32| Descs {
                x: tensor_desc(data, c.x, c.x_strides),
                w: filter_desc(data, c.format, c.w),
                conv: conv_desc(c.geo, compute),
                y: tensor_desc(data, y_dims, y_strides),
            };
            let (d64, dl) = (descs(DOUBLE, DOUBLE), descs(dtype, FLOAT));
            assert_eq!(
                cudnn!(cudnnSetConvolutionMathType(dl.conv, TENSOR_OP_MATH) : (P, u32)),
                SUCCESS
            );
            let (xn, wn) = (span(c.x, c.x_strides), span(c.w, c.w_strides()));
            let yn = span(y_dims, y_strides);
            let (xv, wv, gv) = (values(xn, i), values(wn, i + 1), values(yn, i + 2));
            let mut results = Vec::new();
            for (d, low) in [(d64, false), (dl, true)] {
                let up = |v: &[f64]| {
                    if low {
                        upload_low(v, dtype)
                    } else {
                        upload(v, DOUBLE)
                    }
                };
                let (x, w, g) = (up(&xv), up(&wv), up(&gv));
                let (y, dx, dw) = (up(&vec![0.0; yn]), up(&vec![0.0; xn]), up(&vec![0.0; wn]));
                let (one, zero) = (1.0f64, 0.0f64);
                let (onef, zerof) = (1.0f32, 0.0f32);
                // Scalars are double for f64 data, float for f16/bf16.
                let (one, zero): (*const c_void, *const c_void) = if low {
                    ((&onef as *const f32).cast(), (&zerof as *const f32).cast())
                } else {
                    ((&one as *const f64).cast(), (&zero as *const f64).cast())
                };
                for (pass, ptrs) in [
                    (Pass::Forward, [ptr(&x), ptr(&w), ptr(&y)]),
                    (Pass::Data, [ptr(&dx), ptr(&w), ptr(&g)]),
                    (Pass::Filter, [ptr(&x), ptr(&dw), ptr(&g)]),
                ] {
                    let status = run(pass, h, d, ptrs, 0, (0, 0), one, zero);
                    assert_eq!(status, SUCCESS, "{c:?} {pass:?} dtype {dtype}");
                }
                results.push([y, dx, dw].map(|t| download(&dev, &t)));
            }
            for (k, name) in ["forward", "backward-data", "backward-filter"]
                .iter()
                .enumerate()
            {
                let (exact, low) = (&results[0][k], &results[1][k]);
                for (j, (e, l)) in exact.iter().zip(low).enumerate() {
                    assert_eq!(
                        *l,
                        round_low(*e, dtype),
                        "case {i} {c:?} (NHWC output {nhwc_out}) {name} dtype {dtype}: \
                         element {j} is {l}, the f64 pass gives {e}"
                    );
                }
            }
        }
    }
}
