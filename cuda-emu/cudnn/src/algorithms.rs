//! The algorithms the emulated cuDNN offers for each pass, what each supports, the workspace it
//! needs, and how the heuristics and the search rank them.
//!
//! Every algorithm computes the same [`reference`](crate::reference) convolution; they differ in
//! what tandem's choice logic sees, modelled on cuDNN's own (the sizes are the emulator's):
//!
//! | pass | algorithm | supports | workspace | 16-byte buffers |
//! |---|---|---|---|---|
//! | forward | `IMPLICIT_GEMM` (0) | all | none | no |
//! | forward | `IMPLICIT_PRECOMP_GEMM` (1) | all | an index table, `8·C/g·R·S` | yes |
//! | forward | `GEMM` (2) | all | one sample's columns, `b·C/g·R·S·P·Q` | no |
//! | forward | `WINOGRAD` (6) | 3×3, stride 1, dilation 1, 1 group | none | no |
//! | forward | `WINOGRAD_NONFUSED` (7) | 3×3 or 5×5, stride 1, dilation 1, 1 group | transformed tiles, `b·16·(C+K)·⌈P/4⌉·⌈Q/4⌉` | yes |
//! | backward-data | `ALGO_0` (0) | all | none | no |
//! | backward-data | `ALGO_1` (1) | all | `b·C/g·R·S·P·Q` | yes |
//! | backward-data | `WINOGRAD` (4), `WINOGRAD_NONFUSED` (5) | as forward | as forward | as forward |
//! | backward-filter | `ALGO_0` (0) | all | none | no |
//! | backward-filter | `ALGO_1` (1) | all | `b·C/g·R·S·P·Q` | yes |
//! | backward-filter | `ALGO_3` (3) | all | partial sums, `4·K·C/g·R·S` | no |
//! | backward-filter | `WINOGRAD_NONFUSED` (5) | as forward | as forward | yes |
//!
//! (`b` bytes per element, `g` groups, `P×Q` the output.) `…FWD_ALGO_DIRECT`, the FFT
//! algorithms and `…BWD_FILTER_ALGO_WINOGRAD` are never supported, as `DIRECT` and the filter
//! Winograd are not in cuDNN; 16-byte buffers are asked of every tensor the pass touches. The
//! ranking puts the algorithms with a workspace first (they are "faster"), so tandem's choice
//! normally takes one that needs a workspace; the heuristics estimate a time from the
//! multiply-adds, the search scales the time it measured.

use crate::reference::{Pass, Problem};

/// Supported: `CUDNN_STATUS_SUCCESS` in a ranking.
const OK: u32 = 0;
/// `CUDNN_STATUS_NOT_SUPPORTED`.
const NOT_SUPPORTED: u32 = 3000;

/// One algorithm of one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Algo {
    /// The pass it computes.
    pub pass: Pass,
    /// Its number in the pass's `cudnnConvolution…Algo_t`.
    pub value: u32,
}

/// What an algorithm needs for one problem.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spec {
    /// Workspace bytes.
    pub workspace: usize,
    /// Relative time (lower is faster).
    pub factor: f64,
    /// Whether every buffer must be 16-byte aligned.
    pub aligned: bool,
    /// `CUDNN_DETERMINISTIC` (1) or `CUDNN_NON_DETERMINISTIC` (0).
    pub deterministic: u32,
}

/// How many algorithms `pass` has (cuDNN's enum sizes).
pub fn count(pass: Pass) -> u32 {
    match pass {
        Pass::Forward => 8,
        Pass::BackwardData => 6,
        Pass::BackwardFilter => 7,
    }
}

/// The C name of `pass`'s algorithm enum.
pub fn enum_name(pass: Pass) -> &'static str {
    match pass {
        Pass::Forward => "cudnnConvolutionFwdAlgo_t",
        Pass::BackwardData => "cudnnConvolutionBwdDataAlgo_t",
        Pass::BackwardFilter => "cudnnConvolutionBwdFilterAlgo_t",
    }
}

impl Algo {
    /// Algorithm `value` of `pass`, if cuDNN has one by that number.
    pub fn new(pass: Pass, value: u32) -> Option<Self> {
        (value < count(pass)).then_some(Algo { pass, value })
    }

    /// The C name of the algorithm.
    pub fn name(&self) -> &'static str {
        const FWD: [&str; 8] = [
            "CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM",
            "CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM",
            "CUDNN_CONVOLUTION_FWD_ALGO_GEMM",
            "CUDNN_CONVOLUTION_FWD_ALGO_DIRECT",
            "CUDNN_CONVOLUTION_FWD_ALGO_FFT",
            "CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING",
            "CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD",
            "CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED",
        ];
        const DATA: [&str; 6] = [
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_0",
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_1",
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT",
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING",
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD",
            "CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED",
        ];
        const FILTER: [&str; 7] = [
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED",
            "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING",
        ];
        let v = self.value as usize;
        match self.pass {
            Pass::Forward => FWD[v],
            Pass::BackwardData => DATA[v],
            Pass::BackwardFilter => FILTER[v],
        }
    }

    /// What the algorithm needs for `p`, or why it does not support it.
    pub fn spec(&self, p: &Problem) -> Result<Spec, &'static str> {
        let b = p.elem.size();
        let [_, cg, r, s] = p.w.dims;
        let [_, k, out_h, out_w] = p.y.dims;
        let c = &p.conv;
        let columns = b * cg * r * s * out_h * out_w;
        let winograd = |sizes: &[usize]| -> Result<(), &'static str> {
            if !(r == s && sizes.contains(&r)) {
                return Err("Winograd takes 3×3 (or, non-fused, 5×5) filters only");
            }
            if c.stride != [1, 1] || c.dilation != [1, 1] {
                return Err("Winograd takes stride 1 and dilation 1 only");
            }
            if c.groups != 1 {
                return Err("Winograd takes one group only");
            }
            Ok(())
        };
        let tiles = b * 16 * (cg + k) * out_h.div_ceil(4) * out_w.div_ceil(4);
        let spec = |workspace: usize, factor: f64, aligned: bool, deterministic: bool| Spec {
            workspace,
            factor,
            aligned,
            deterministic: deterministic as u32,
        };
        let fft = Err("the FFT algorithms are not emulated");
        Ok(match (self.pass, self.value) {
            (Pass::Forward, 0) => spec(0, 1.0, false, true),
            (Pass::Forward, 1) => spec(8 * cg * r * s, 0.6, true, true),
            (Pass::Forward, 2) => spec(columns, 0.8, false, true),
            (Pass::Forward, 3) => {
                return Err("CUDNN_CONVOLUTION_FWD_ALGO_DIRECT is not implemented in cuDNN")
            }
            (Pass::Forward, 6) => {
                winograd(&[3])?;
                spec(0, 0.5, false, true)
            }
            (Pass::Forward, 7) | (Pass::BackwardData, 5) => {
                winograd(&[3, 5])?;
                spec(tiles, 0.4, true, true)
            }
            (Pass::BackwardData, 0) => spec(0, 1.0, false, false),
            (Pass::BackwardData, 1) => spec(columns, 0.7, true, true),
            (Pass::BackwardData, 4) => {
                winograd(&[3])?;
                spec(0, 0.5, false, true)
            }
            (Pass::BackwardFilter, 0) => spec(0, 1.0, false, false),
            (Pass::BackwardFilter, 1) => spec(columns, 0.6, true, true),
            (Pass::BackwardFilter, 3) => spec(4 * k * cg * r * s, 0.8, false, false),
            (Pass::BackwardFilter, 4) => {
                return Err(
                    "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD is not implemented in cuDNN",
                )
            }
            (Pass::BackwardFilter, 5) => {
                winograd(&[3, 5])?;
                spec(tiles, 0.5, true, true)
            }
            _ => return fft,
        })
    }
}

/// Why the buffers at `ptrs` do not suit `spec`, if they do not.
pub fn misaligned(spec: &Spec, ptrs: [u64; 3]) -> Option<String> {
    if !spec.aligned {
        return None;
    }
    ptrs.iter()
        .find(|&&p| p % 16 != 0)
        .map(|p| format!("it needs 16-byte-aligned buffers, and one starts at {p:#x}"))
}

/// `pass`'s algorithms for `p`, best first: the supported ones by time, then the others with
/// `CUDNN_STATUS_NOT_SUPPORTED`. Without `measured`, the heuristics: the time is an estimate
/// from the multiply-adds and no address is known. With `measured = (ms, buffers, workspace)`,
/// the search: the time is the pass's measured time scaled per algorithm, and an algorithm the
/// buffers' alignment or the workspace given do not allow is NOT_SUPPORTED.
pub fn rank(
    pass: Pass,
    p: &Problem,
    math: u32,
    measured: Option<(f64, [u64; 3], usize)>,
) -> Vec<crate::Perf> {
    let macs = p.y.dims.iter().product::<usize>() * p.w.dims[1..].iter().product::<usize>();
    // An H100 does some 2·10¹³ multiply-adds per second in f32: an estimate in milliseconds.
    let estimate = macs as f64 / 2e10;
    let mut ok = Vec::new();
    let mut refused = Vec::new();
    for value in 0..count(pass) {
        let algo = Algo { pass, value };
        let spec = algo.spec(p).ok().filter(|s| match measured {
            Some((_, ptrs, workspace)) => misaligned(s, ptrs).is_none() && s.workspace <= workspace,
            None => true,
        });
        let perf = crate::Perf {
            algo: value,
            status: if spec.is_some() { OK } else { NOT_SUPPORTED },
            time: match (spec, measured) {
                (Some(s), Some((ms, _, _))) => (ms * s.factor) as f32,
                (Some(s), None) => (estimate * s.factor) as f32,
                (None, _) => -1.0,
            },
            memory: spec.map_or(0, |s| s.workspace),
            determinism: spec.map_or(0, |s| s.deterministic),
            math_type: math,
            reserved: [0; 3],
        };
        if spec.is_some() {
            ok.push(perf);
        } else {
            refused.push(perf);
        }
    }
    ok.sort_by(|a, b| a.time.total_cmp(&b.time));
    ok.extend(refused);
    ok
}
