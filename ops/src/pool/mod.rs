//! 2-D pooling over the last two dims: max pooling, average pooling (padding counted in the
//! divisor, PyTorch's default `count_include_pad = true`) and adaptive average pooling to a
//! fixed output size.
//!
//! # Shapes
//! Input `[N, C, H, W]` or `[C, H, W]`; the output keeps the leading dims and replaces
//! `H, W` by the pooled sizes. For max and average pooling,
//! `OH = (H + 2·padding.0 − kernel.0) / stride.0 + 1` (floor) and likewise `OW`.

mod cpu;
pub mod cuda;
mod shape;

use tandem_autograd::{needs_grad, record_fn};
use tandem_core::{checked_numel, Device, Error, Result, Tensor};

use crate::checks::float_dtype;
pub use shape::PoolWindows;
use shape::Windows;

/// The maxima a max pool's forward saved for its backward, on the device it ran on.
enum MaxIndices {
    Cpu(cpu::MaxIndices),
    Cuda(cuda::MaxIndices),
}

/// Checks that `x` is `[N, C, H, W]` or `[C, H, W]` and returns `(H, W)`.
fn plane_dims(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    float_dtype(op, x)?;
    if x.rank() != 3 && x.rank() != 4 {
        return Err(Error::shape(
            op,
            format!("need input [N, C, H, W] or [C, H, W], got {:?}", x.dims()),
        ));
    }
    let r = x.rank();
    Ok((x.dims()[r - 2], x.dims()[r - 1]))
}

/// Validates sliding-pool arguments and builds its windows.
fn sliding_windows(
    op: &'static str,
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    divisor: Option<usize>,
) -> Result<Windows> {
    let (h, w) = plane_dims(op, x)?;
    if h == 0 || w == 0 {
        return Err(Error::shape(
            op,
            format!(
                "input {:?} has empty planes (H and W must be positive)",
                x.dims()
            ),
        ));
    }
    if kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
        return Err(Error::invalid(
            op,
            format!("kernel {kernel:?} and stride {stride:?} must be at least 1"),
        ));
    }
    // `2·padding > kernel`, without overflowing.
    if padding.0 > kernel.0 / 2 || padding.1 > kernel.1 / 2 {
        return Err(Error::invalid(
            op,
            format!("padding {padding:?} must be at most half of kernel {kernel:?}"),
        ));
    }
    let padded = |len: usize, pad: usize| len.checked_add(2 * pad);
    let (Some(padded_h), Some(padded_w)) = (padded(h, padding.0), padded(w, padding.1)) else {
        return Err(Error::shape(
            op,
            format!("input {:?} padded by {padding:?} is too large", x.dims()),
        ));
    };
    if kernel.0 > padded_h || kernel.1 > padded_w {
        return Err(Error::shape(
            op,
            format!(
                "kernel {kernel:?} is larger than input {:?} padded by {padding:?}",
                x.dims()
            ),
        ));
    }
    Ok(Windows {
        rows: shape::sliding(op, h, kernel.0, stride.0, padding.0)?,
        cols: shape::sliding(op, w, kernel.1, stride.1, padding.1)?,
        divisor,
    })
}

/// The output shape of a pool with windows `win`, its product checked.
fn out_shape(op: &'static str, x: &Tensor, win: &Windows) -> Result<Vec<usize>> {
    let mut shape = x.dims().to_vec();
    let r = shape.len();
    shape[r - 2] = win.rows.len();
    shape[r - 1] = win.cols.len();
    checked_numel(op, &shape)?;
    Ok(shape)
}

/// Max pooling over `kernel`-sized windows moved by `stride`, with implicit `-inf` padding.
///
/// # Shapes
/// `[N, C, H, W]` (or `[C, H, W]`) → `[N, C, OH, OW]`, `OH = (H + 2·padding.0 − kernel.0) /
/// stride.0 + 1`. Padding may be at most half the kernel (as in PyTorch). The gradient goes to
/// the first maximal element of each window.
pub fn max_pool2d(
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("max_pool2d", tandem_core::profile::Phase::Forward);
    const OP: &str = "max_pool2d";
    if x.dtype().is_half() {
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| {
            max_pool2d(&w[0], kernel, stride, padding)
        });
    }
    let win = sliding_windows(OP, x, kernel, stride, padding, None)?;
    let hw = plane_dims(OP, x)?;
    let keep = needs_grad(&[x]);
    let shape = out_shape(OP, x, &win)?;
    let spec = PoolWindows::Sliding {
        kernel,
        stride,
        padding,
    };
    let (out, indices) = match x.device() {
        Device::Cpu => {
            let (out, indices) = cpu::max_pool(OP, x, hw, &win, keep, &shape)?;
            (out, MaxIndices::Cpu(indices))
        }
        Device::Cuda(_) => match cuda::max_pool(OP, x, spec, keep, &shape)? {
            (out, Some(indices)) => (out, MaxIndices::Cuda(indices)),
            // Nothing needs a gradient, so no backward is recorded to read the indices.
            (out, None) => return Ok(out),
        },
    };
    let in_shape = x.dims().to_vec();
    let forward_device = x.device();
    Ok(record_fn(out, &[x], OP, move || {
        move |g: &Tensor| {
            const BACKWARD: &str = "max_pool2d_backward";
            let gx = match (g.device(), &indices) {
                (Device::Cpu, MaxIndices::Cpu(indices)) => {
                    cpu::max_pool_backward(BACKWARD, g, indices, hw, &win, &in_shape)?
                }
                (Device::Cuda(_), MaxIndices::Cuda(indices)) => {
                    cuda::max_pool_backward(BACKWARD, g, indices, spec, &in_shape)?
                }
                _ => {
                    return Err(Error::DeviceMismatch {
                        op: BACKWARD,
                        lhs: forward_device,
                        rhs: g.device(),
                    })
                }
            };
            Ok(vec![Some(gx)])
        }
    }))
}

/// Average pooling; windows of `kernel` moved by `stride` over the zero-padded input, each
/// divided by `kernel.0 · kernel.1` (padding counts, PyTorch's `count_include_pad = true`).
///
/// # Shapes
/// `[N, C, H, W]` (or `[C, H, W]`) → `[N, C, OH, OW]`, `OH = (H + 2·padding.0 − kernel.0) /
/// stride.0 + 1`. Padding may be at most half the kernel.
pub fn avg_pool2d(
    x: &Tensor,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
) -> Result<Tensor> {
    let _profile = tandem_core::profile::scope("avg_pool2d", tandem_core::profile::Phase::Forward);
    const OP: &str = "avg_pool2d";
    if x.dtype().is_half() {
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| {
            avg_pool2d(&w[0], kernel, stride, padding)
        });
    }
    let divisor = kernel.0.checked_mul(kernel.1).ok_or_else(|| {
        Error::invalid(
            OP,
            format!("kernel {kernel:?} has more elements than fit in usize"),
        )
    })?;
    let win = sliding_windows(OP, x, kernel, stride, padding, Some(divisor))?;
    let spec = PoolWindows::Sliding {
        kernel,
        stride,
        padding,
    };
    average(OP, x, win, spec)
}

/// Adaptive average pooling to a fixed `output` size `(OH, OW)`: output row `i` averages
/// input rows `floor(i·H/OH) .. ceil((i+1)·H/OH)` (likewise columns), as in PyTorch.
///
/// # Shapes
/// `[N, C, H, W]` (or `[C, H, W]`) → `[N, C, OH, OW]`. `H`, `W`, `OH` and `OW` must be
/// positive; `OH` may exceed `H` (windows then overlap).
pub fn adaptive_avg_pool2d(x: &Tensor, output: (usize, usize)) -> Result<Tensor> {
    let _profile =
        tandem_core::profile::scope("adaptive_avg_pool2d", tandem_core::profile::Phase::Forward);
    const OP: &str = "adaptive_avg_pool2d";
    if x.dtype().is_half() {
        return crate::low_precision::via_f32(x.dtype(), &[x], |w| {
            adaptive_avg_pool2d(&w[0], output)
        });
    }
    let (h, w) = plane_dims(OP, x)?;
    if output.0 == 0 || output.1 == 0 || h == 0 || w == 0 {
        return Err(Error::shape(
            OP,
            format!(
                "input {:?} and output size {output:?} must have positive spatial sizes",
                x.dims()
            ),
        ));
    }
    let mut shape = x.dims().to_vec();
    let r = shape.len();
    (shape[r - 2], shape[r - 1]) = output;
    checked_numel(OP, &shape)?;
    let win = Windows {
        rows: shape::adaptive(OP, h, output.0)?,
        cols: shape::adaptive(OP, w, output.1)?,
        divisor: None,
    };
    average(OP, x, win, PoolWindows::Adaptive)
}

/// Shared forward/backward of the average pools: `win` lists the windows (for the CPU),
/// `spec` describes them (for the CUDA kernels, which compute each window themselves).
fn average(op: &'static str, x: &Tensor, win: Windows, spec: PoolWindows) -> Result<Tensor> {
    let hw = plane_dims(op, x)?;
    let shape = out_shape(op, x, &win)?;
    let out = match x.device() {
        Device::Cpu => cpu::avg_pool(op, x, hw, &win, &shape)?,
        Device::Cuda(_) => cuda::avg_pool(op, x, spec, win.divisor, &shape)?,
    };
    let in_shape = x.dims().to_vec();
    // The input gradient keeps the input's format (channels-last in, channels-last out).
    let format = if x.layout().is_channels_last() {
        tandem_core::MemoryFormat::ChannelsLast
    } else {
        tandem_core::MemoryFormat::Contiguous
    };
    Ok(record_fn(out, &[x], op, move || {
        move |g: &Tensor| {
            let gx = match g.device() {
                Device::Cpu => cpu::avg_pool_backward(op, g, hw, &win, &in_shape, format)?,
                Device::Cuda(_) => {
                    cuda::avg_pool_backward(op, g, spec, win.divisor, &in_shape, format)?
                }
            };
            Ok(vec![Some(gx)])
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, rand_f64, rand_f64_noncontiguous};
    use tandem_core::{DType, Device};

    type Pool = (usize, usize);

    /// Direct-loop reference of max (`is_max`) or average pooling on `[P, H, W]` values.
    fn naive_sliding(x: &Tensor, k: Pool, s: Pool, p: Pool, is_max: bool) -> Vec<f64> {
        let d = x.dims();
        let (h, w) = (d[d.len() - 2], d[d.len() - 1]);
        let planes = x.numel() / (h * w);
        let v = x.to_vec_f64().unwrap();
        let (oh, ow) = ((h + 2 * p.0 - k.0) / s.0 + 1, (w + 2 * p.1 - k.1) / s.1 + 1);
        let mut out = Vec::new();
        for pl in 0..planes {
            for i in 0..oh {
                for j in 0..ow {
                    let mut acc = if is_max { f64::NEG_INFINITY } else { 0.0 };
                    for a in 0..k.0 {
                        for b in 0..k.1 {
                            let r = (i * s.0 + a) as isize - p.0 as isize;
                            let c = (j * s.1 + b) as isize - p.1 as isize;
                            if r < 0 || c < 0 || r >= h as isize || c >= w as isize {
                                continue;
                            }
                            let e = v[pl * h * w + r as usize * w + c as usize];
                            acc = if is_max { acc.max(e) } else { acc + e };
                        }
                    }
                    out.push(if is_max {
                        acc
                    } else {
                        acc / (k.0 * k.1) as f64
                    });
                }
            }
        }
        out
    }

    fn assert_close(got: &Tensor, want: &[f64]) {
        let got = got.to_vec_f64().unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() < 1e-12, "{i}: {g} vs {w}");
        }
    }

    #[test]
    fn sliding_pools_match_direct_loops_with_padding_and_strides() {
        let cases: [([usize; 4], Pool, Pool, Pool); 4] = [
            ([2, 3, 8, 8], (2, 2), (2, 2), (0, 0)),
            ([1, 2, 7, 9], (3, 2), (2, 1), (1, 1)),
            ([2, 1, 9, 6], (3, 3), (2, 3), (1, 0)),
            ([1, 2, 5, 5], (5, 4), (1, 1), (2, 2)),
        ];
        for (i, (shape, k, s, p)) in cases.iter().enumerate() {
            let x = rand_f64(shape, i as u64);
            let y = max_pool2d(&x, *k, *s, *p).unwrap();
            assert_close(&y, &naive_sliding(&x, *k, *s, *p, true));
            let y = avg_pool2d(&x, *k, *s, *p).unwrap();
            assert_close(&y, &naive_sliding(&x, *k, *s, *p, false));
        }
        let x = rand_f64(&[3, 7, 9], 9);
        assert_eq!(
            max_pool2d(&x, (3, 2), (2, 1), (1, 1)).unwrap().dims(),
            &[3, 4, 10]
        );
    }

    #[test]
    fn two_by_two_max_pool_on_ties_matches_direct_loops_in_parallel() {
        // ReLU-like input (many tied zeros) large enough for the parallel kernels; odd width
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (planes, h, w) = (32usize, 32usize, 35usize);
        let x = rand_f64(&[4, 8, h, w], 40);
        x.map_inplace_f64("test", |v| v.max(0.0)).unwrap();
        let (y, gx) = pool.install(|| {
            let y = max_pool2d(&x, (2, 2), (2, 2), (0, 0)).unwrap();
            let g = Tensor::ones(y.dims(), DType::F64, Device::Cpu).unwrap();
            tandem_autograd::backward(&y, Some(&g), &Default::default()).unwrap();
            (y, x.grad().unwrap())
        });
        assert_close(&y, &naive_sliding(&x, (2, 2), (2, 2), (0, 0), true));
        // the gradient goes to the first maximum of each window, in row-major order
        let v = x.to_vec_f64().unwrap();
        let mut want = vec![0.0; v.len()];
        for p in 0..planes {
            for i in 0..h / 2 {
                for j in 0..w / 2 {
                    let at = |a: usize, b: usize| p * h * w + (2 * i + a) * w + 2 * j + b;
                    let mut best = at(0, 0);
                    for k in [at(0, 1), at(1, 0), at(1, 1)] {
                        if v[k] > v[best] {
                            best = k;
                        }
                    }
                    want[best] = 1.0;
                }
            }
        }
        assert_eq!(gx.to_vec_f64().unwrap(), want);
    }

    #[test]
    fn adaptive_avg_pool_uses_pytorch_window_bounds() {
        let x = rand_f64(&[2, 3, 7, 5], 20);
        let v = x.to_vec_f64().unwrap();
        for (oh, ow) in [(3, 2), (1, 1), (7, 5), (4, 8)] {
            let y = adaptive_avg_pool2d(&x, (oh, ow)).unwrap();
            assert_eq!(y.dims(), &[2, 3, oh, ow]);
            let mut want = Vec::new();
            for pl in 0..6 {
                for i in 0..oh {
                    for j in 0..ow {
                        let (r0, r1) =
                            ((i * 7) as f64 / oh as f64, ((i + 1) * 7) as f64 / oh as f64);
                        let (c0, c1) =
                            ((j * 5) as f64 / ow as f64, ((j + 1) * 5) as f64 / ow as f64);
                        let (r0, r1) = (r0.floor() as usize, r1.ceil() as usize);
                        let (c0, c1) = (c0.floor() as usize, c1.ceil() as usize);
                        let mut acc = 0.0;
                        for r in r0..r1 {
                            for c in c0..c1 {
                                acc += v[pl * 35 + r * 5 + c];
                            }
                        }
                        want.push(acc / ((r1 - r0) * (c1 - c0)) as f64);
                    }
                }
            }
            assert_close(&y, &want);
        }
    }

    #[test]
    fn gradcheck_pools() {
        let x = rand_f64(&[2, 2, 7, 6], 30);
        check(
            |t| max_pool2d(&t[0], (3, 2), (2, 1), (1, 1)),
            std::slice::from_ref(&x),
        );
        check(
            |t| avg_pool2d(&t[0], (3, 2), (2, 1), (1, 1)),
            std::slice::from_ref(&x),
        );
        check(
            |t| adaptive_avg_pool2d(&t[0], (3, 4)),
            std::slice::from_ref(&x),
        );
        check(|t| adaptive_avg_pool2d(&t[0], (1, 1)), &[x]);
        let nc = rand_f64_noncontiguous(&[2, 3, 5, 7], 31);
        check(
            |t| max_pool2d(&t[0], (2, 3), (2, 2), (1, 1)),
            std::slice::from_ref(&nc),
        );
        check(
            |t| avg_pool2d(&t[0], (3, 3), (1, 2), (1, 0)),
            std::slice::from_ref(&nc),
        );
        check(|t| adaptive_avg_pool2d(&t[0], (2, 3)), &[nc]);
        check(
            |t| max_pool2d(&t[0], (2, 2), (2, 2), (0, 0)),
            &[rand_f64(&[3, 4, 4], 32)],
        );
    }

    #[test]
    fn bad_inputs_are_errors_naming_the_op_and_shape() {
        let flat = Tensor::zeros(&[4, 4], DType::F32, Device::Cpu).unwrap();
        for err in [
            max_pool2d(&flat, (2, 2), (2, 2), (0, 0)).unwrap_err(),
            avg_pool2d(&flat, (2, 2), (2, 2), (0, 0)).unwrap_err(),
            adaptive_avg_pool2d(&flat, (1, 1)).unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(msg.contains("pool2d:") && msg.contains("[4, 4]"), "{msg}");
        }
        let x = Tensor::zeros(&[1, 1, 4, 4], DType::F32, Device::Cpu).unwrap();
        let err = max_pool2d(&x, (6, 2), (1, 1), (0, 0))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("[1, 1, 4, 4]") && err.contains("(6, 2)"),
            "{err}"
        );
        assert!(avg_pool2d(&x, (2, 2), (1, 1), (2, 0))
            .unwrap_err()
            .to_string()
            .contains("half"));
        assert!(max_pool2d(&x, (2, 2), (0, 1), (0, 0)).is_err());
        assert!(adaptive_avg_pool2d(&x, (0, 2)).is_err());
        let ints = Tensor::zeros(&[1, 1, 4, 4], DType::I64, Device::Cpu).unwrap();
        assert!(max_pool2d(&ints, (2, 2), (2, 2), (0, 0))
            .unwrap_err()
            .to_string()
            .contains("dtype"));
    }
}
