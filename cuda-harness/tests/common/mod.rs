//! Shared by the harness's kernel tests: the layouts every kernel is run over, test values,
//! poisoned host buffers with guard elements, and the comparison and rounding references.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use tandem_core::cuda::launch::{Launch, LaunchConfig};
use tandem_core::cuda::runtime_kernels::DeviceView;
use tandem_core::storage::CpuStorage;
use tandem_core::{DType, Device, Element, Layout, Shape, Tensor};
use tandem_cuda_harness::run;

pub const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];
pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
pub const GUARD: usize = 16;

// ---- layouts -----------------------------------------------------------------------------------

/// A view into a storage of `len` elements.
#[derive(Clone, Debug)]
pub struct View {
    pub name: &'static str,
    pub len: usize,
    pub layout: Layout,
}

pub fn view(name: &'static str, len: usize, layout: Layout) -> View {
    assert!(layout.storage_extent() <= len, "{name}");
    View { name, len, layout }
}

pub fn parts(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
    Layout::from_parts(
        Shape::from_slice(shape),
        strides.iter().copied().collect(),
        offset,
    )
}

/// Groups of views with one shape each; `expanded` views may only be sources.
pub fn families() -> Vec<Vec<(View, bool)>> {
    let c = |s: &[usize]| Layout::contiguous(s);
    vec![
        // Odd length, not a multiple of a warp.
        vec![
            (view("contiguous [37]", 37, c(&[37])), false),
            (
                view("every other of [75], offset 1", 75, parts(&[37], &[2], 1)),
                false,
            ),
            (
                view(
                    "slice 5..42 of [50]",
                    50,
                    c(&[50]).narrow("t", 0, 5, 37).unwrap(),
                ),
                false,
            ),
            (
                view("one element expanded to [37]", 1, parts(&[37], &[0], 0)),
                true,
            ),
        ],
        // Several blocks of 256, the last one partial.
        vec![
            (view("contiguous [1000]", 1000, c(&[1000])), false),
            (
                view(
                    "slice 50..1050 of [1100]",
                    1100,
                    c(&[1100]).narrow("t", 0, 50, 1000).unwrap(),
                ),
                false,
            ),
        ],
        vec![
            (view("contiguous [25, 40]", 1000, c(&[25, 40])), false),
            (
                view(
                    "transposed [40, 25]",
                    1000,
                    c(&[40, 25]).transpose("t", 0, 1).unwrap(),
                ),
                false,
            ),
        ],
        // Matrices: transposed, narrowed, expanded both ways.
        vec![
            (view("contiguous [6, 5]", 30, c(&[6, 5])), false),
            (
                view(
                    "transposed [5, 6]",
                    30,
                    c(&[5, 6]).transpose("t", 0, 1).unwrap(),
                ),
                false,
            ),
            (
                view(
                    "columns 2..7 of [6, 9]",
                    54,
                    c(&[6, 9]).narrow("t", 1, 2, 5).unwrap(),
                ),
                false,
            ),
            (
                view(
                    "row [1, 5] expanded",
                    5,
                    c(&[1, 5]).expand("t", &[6, 5]).unwrap(),
                ),
                true,
            ),
            (
                view(
                    "column [6, 1] expanded",
                    6,
                    c(&[6, 1]).expand("t", &[6, 5]).unwrap(),
                ),
                true,
            ),
        ],
        // Rank 3: permuted, with a size-1 dimension and odd strides.
        vec![
            (view("contiguous [3, 4, 5]", 60, c(&[3, 4, 5])), false),
            (
                view(
                    "permuted [5, 3, 4] by (1, 2, 0)",
                    60,
                    c(&[5, 3, 4]).permute("t", &[1, 2, 0]).unwrap(),
                ),
                false,
            ),
            (
                view(
                    "rows 1..4 of [3, 5, 6], cols 1..6",
                    90,
                    c(&[3, 5, 6])
                        .narrow("t", 1, 1, 4)
                        .unwrap()
                        .narrow("t", 2, 1, 5)
                        .unwrap(),
                ),
                false,
            ),
        ],
        vec![
            (view("[4, 1, 3] contiguous", 12, c(&[4, 1, 3])), false),
            (
                view(
                    "[4, 1, 3] with a stray size-1 stride",
                    40,
                    parts(&[4, 1, 3], &[10, 7, 2], 3),
                ),
                false,
            ),
        ],
        // Scalars.
        vec![
            (view("scalar", 1, c(&[])), false),
            (view("scalar at offset 2", 3, parts(&[], &[], 2)), false),
        ],
        // Empty tensors.
        vec![(view("empty [0]", 0, c(&[0])), false)],
        vec![
            (view("empty [2, 0, 3]", 0, c(&[2, 0, 3])), false),
            (
                view(
                    "empty [2, 0, 3] in a storage",
                    6,
                    parts(&[2, 0, 3], &[3, 3, 1], 1),
                ),
                false,
            ),
        ],
    ]
}

/// All (destination, source) pairs of a family with the same shape.
pub fn pairs() -> Vec<(View, View)> {
    let mut out = Vec::new();
    for family in families() {
        for (dst, dst_expanded) in &family {
            for (src, _) in &family {
                if !dst_expanded && dst.layout.shape() == src.layout.shape() {
                    out.push((dst.clone(), src.clone()));
                }
            }
        }
    }
    out
}

pub fn destinations() -> Vec<View> {
    families()
        .into_iter()
        .flatten()
        .filter(|(_, expanded)| !expanded)
        .map(|(v, _)| v)
        .collect()
}

// ---- values --------------------------------------------------------------------------------

/// Values for a dtype, starting with the hard cases of conversions (ties, overflow thresholds,
/// subnormals, infinities, NaN, integer extremes), then random ones.
pub fn values<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let storage = match T::DTYPE {
        DType::I64 => {
            let specials = [
                0,
                1,
                -1,
                255,
                256,
                -300,
                i64::MAX,
                i64::MIN,
                (1 << 53) + 1,
                -(1 << 53) - 3,
                (1 << 62) + 12345,
                65519,
                65520,
            ];
            CpuStorage::I64(
                (0..n)
                    .map(|i| match specials.get(i) {
                        Some(&s) => s,
                        None if i % 3 == 0 => rng.gen_range(-1000..1000),
                        None => rng.gen::<i64>() >> rng.gen_range(0..60),
                    })
                    .collect(),
            )
        }
        DType::U8 => CpuStorage::U8((0..n).map(|_| rng.gen()).collect()),
        _ => {
            let specials = [
                0.0,
                -0.0,
                1.0,
                -1.0,
                0.5,
                1.5,
                2.5,
                -2.5,
                65504.0,
                65519.0,
                65520.0,
                1e5,
                -1e5,
                255.5,
                256.0,
                -0.7,
                1e-8,
                6e-8,
                3e-8,
                2f64.powi(-25),
                f64::INFINITY,
                f64::NEG_INFINITY,
                f64::NAN,
                1e300,
                -1e300,
                3.4e38,
                3.5e38,
                9.3e18,
                -9.3e18,
                1e-40,
                1e-45,
                1e-310,
                1.0 + f64::EPSILON,
                1.0009765625 + 1e-12,
            ];
            let data: Vec<f64> = (0..n)
                .map(|i| match specials.get(i) {
                    Some(&s) => s,
                    None => {
                        let scale = 10f64.powi(rng.gen_range(-6..6));
                        (rng.gen::<f64>() - 0.5) * scale
                    }
                })
                .collect();
            T::into_storage(data.into_iter().map(T::from_f64).collect())
        }
    };
    T::slice(&storage).expect("the storage holds T").to_vec()
}

/// A value no kernel writes in these tests.
pub fn poison<T: Element>() -> T {
    match T::DTYPE {
        DType::I64 => T::from_f64(-4_242_424_242.0),
        DType::U8 => T::from_f64(0xa5 as f64),
        _ => T::from_f64(-7777.0),
    }
}

/// Bitwise equal, or both NaN.
pub fn same<T: Element>(a: T, b: T) -> bool {
    #[allow(clippy::eq_op)]
    let both_nan = a != a && b != b;
    both_nan || (a == b && a.to_f64().is_sign_negative() == b.to_f64().is_sign_negative())
}

pub fn assert_same<T: Element>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| !same(**g, **w))
        .take(5)
        .map(|(i, (g, w))| format!("[{i}] got {g:?}, want {w:?}"))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
}

// ---- running both sides ----------------------------------------------------------------------

/// A storage as the kernel sees it: guard elements on both sides of `len` elements.
pub struct HostBuffer<T: Element> {
    data: Vec<T>,
    len: usize,
}

impl<T: Element> HostBuffer<T> {
    pub fn new(storage: &[T]) -> Self {
        let mut data = vec![poison::<T>(); GUARD];
        data.extend_from_slice(storage);
        data.resize(GUARD + storage.len() + GUARD, poison::<T>());
        HostBuffer {
            data,
            len: storage.len(),
        }
    }

    pub fn view<'a>(&mut self, layout: &'a Layout) -> DeviceView<'a> {
        DeviceView {
            ptr: self.data[GUARD..].as_mut_ptr() as u64,
            dtype: T::DTYPE,
            layout,
        }
    }

    /// The storage, after checking that the guards are untouched.
    pub fn storage(&self, what: &str) -> &[T] {
        let (head, rest) = self.data.split_at(GUARD);
        let (body, tail) = rest.split_at(self.len);
        assert!(
            head.iter().chain(tail).all(|&g| same(g, poison::<T>())),
            "{what}: wrote outside the storage"
        );
        body
    }
}

/// A CPU tensor viewing a copy of `storage` through `layout`.
pub fn cpu_view<T: Element>(storage: &[T], layout: &Layout) -> Tensor {
    Tensor::from_vec(storage.to_vec(), &[storage.len()], Device::Cpu)
        .unwrap()
        .view_detached(layout.clone())
        .unwrap()
}

/// Every element of the storage under a CPU view.
pub fn cpu_storage<T: Element>(t: &Tensor, len: usize) -> Vec<T> {
    t.view_detached(Layout::contiguous(&[len]))
        .unwrap()
        .to_vec::<T>()
        .unwrap()
}

/// Runs a launch in the harness; a failure names the case.
pub fn run_launch(launch: &Launch, what: &str) {
    // SAFETY: every pointer in the launch points into a live HostBuffer covering the layouts
    // the builder checked.
    unsafe { run(launch) }.unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// The launch with a grid of two one-warp blocks, so that every thread loops several times
/// through the grid-stride loop.
pub fn small_grid(launch: &Launch) -> Launch {
    let mut small = launch.clone();
    small.config = LaunchConfig::new("test", [2, 1, 1], [32, 1, 1], 0).unwrap();
    small
}

/// f64 → f32 rounding to odd: exact for the narrowing that follows, so `narrow(to_odd(x))` is
/// `x` rounded once to the narrower type (both narrower types have at most 16 significant bits).
pub fn round_to_odd_f32(x: f64) -> f32 {
    let nearest = x as f32;
    if nearest as f64 == x || x.is_nan() {
        return nearest;
    }
    // Truncate toward zero, then mark inexact in the last bit.
    let mut truncated = nearest;
    if (nearest as f64).abs() > x.abs() {
        truncated = f32::from_bits(nearest.to_bits() - 1);
    }
    f32::from_bits(truncated.to_bits() | 1)
}

/// `x` rounded once, to nearest even, to f16 or bf16: an independent reference (round to odd
/// into f32, then `half`'s correctly rounded f32 conversion).
pub fn correctly_rounded<D: Element>(x: f64) -> D {
    let odd = round_to_odd_f32(x);
    let storage = match D::DTYPE {
        DType::F16 => CpuStorage::F16(vec![f16::from_f32(odd)]),
        DType::BF16 => CpuStorage::BF16(vec![bf16::from_f32(odd)]),
        other => unreachable!("only for the 16-bit floats, not {other}"),
    };
    D::slice(&storage).expect("holds D")[0]
}
