//! Shared by the ops' CUDA conformance tests (`ops/tests/cuda_*.rs`): the device they run on
//! (each test first calls `tandem_test_support::select_cuda`: the GPU, else the CUDA emulator),
//! and comparisons of a GPU result with the CPU's within the tolerances
//! of [`tolerance`].

// Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod half;
pub mod tolerance;

use tandem_core::{DType, Device, Tensor};

/// The device every CUDA test runs on.
pub const GPU: Device = Device::Cuda(0);

/// The machine epsilon of a float dtype (f32 or f64).
pub fn epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => tolerance::epsilon_of_size(dtype.size_in_bytes()),
        other => panic!("no epsilon for {other}"),
    }
}

/// The smallest positive normal number of a float dtype: the unit of an ulp bound for results
/// below it.
pub fn smallest_normal(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::MIN_POSITIVE as f64,
        _ => f64::MIN_POSITIVE,
    }
}

/// Every element of `t` (any device, any float dtype) as f64.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// Asserts that `got` (any device) has `want`'s shape and dtype and that element `i` is within
/// `bounds[i]` of `want`'s (NaN matching NaN), naming `what`, the count of elements outside and
/// the first five.
pub fn assert_within(got: &Tensor, want: &Tensor, bounds: &[f64], what: &str) {
    assert_eq!(
        got.dims(),
        want.dims(),
        "{what}: shape {:?} on {}, {:?} on the CPU",
        got.dims(),
        got.device(),
        want.dims()
    );
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (values(got), values(want));
    assert_eq!(bounds.len(), w.len(), "{what}: one bound per element");
    let outside: Vec<usize> = (0..w.len())
        .filter(|&i| !tolerance::within(g[i], w[i], bounds[i]))
        .collect();
    let first: Vec<String> = outside
        .iter()
        .take(5)
        .map(|&i| {
            format!(
                "element {i}: got {:e}, want {:e} (bound {:e})",
                g[i], w[i], bounds[i]
            )
        })
        .collect();
    assert!(
        outside.is_empty(),
        "{what} ({}, shape {:?}): {} of {} elements outside their bound; {}",
        want.dtype(),
        want.dims(),
        outside.len(),
        w.len(),
        first.join("; ")
    );
}

/// Asserts that `got` equals `want` within `ulps` units in the last place of `want`'s dtype
/// (0 = bit for bit, for results both devices compute with the same IEEE operations).
pub fn assert_ulps(got: &Tensor, want: &Tensor, ulps: f64, what: &str) {
    let (eps, tiny) = (epsilon(want.dtype()), smallest_normal(want.dtype()));
    let bounds: Vec<f64> = values(want)
        .iter()
        .map(|w| ulps * eps * w.abs().max(tiny))
        .collect();
    assert_within(got, want, &bounds, what);
}

/// For a `full` tensor broadcast from `target` (the shape of the input whose gradient sums
/// `full` over its broadcast dims): per element of `target`, the number of terms summed and
/// Σ|x| over them, in f64. The bound of [`tolerance::sum_order_bound`] needs both.
pub fn broadcast_sums(full: &Tensor, target: &[usize]) -> (usize, Vec<f64>) {
    let shape = full.dims().to_vec();
    let lead = shape.len() - target.len();
    let n_target: usize = target.iter().product();
    let mut abs_sums = vec![0.0; n_target];
    let v = values(full);
    for (flat, x) in v.iter().enumerate() {
        // Unravel `flat` in `shape` and ravel the broadcast position in `target`.
        let mut rest = flat;
        let mut index = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            index[d] = rest % shape[d];
            rest /= shape[d];
        }
        let t = target.iter().enumerate().fold(0, |acc, (d, &size)| {
            acc * size + if size == 1 { 0 } else { index[lead + d] }
        });
        abs_sums[t] += x.abs();
    }
    let len = v.len().checked_div(n_target).unwrap_or(0);
    (len, abs_sums)
}
