//! The runtime's kernels (`core/src/cuda/kernels/runtime.cu`), run on the CPU by the host
//! harness through the same launch plans the CUDA runtime executes, against tandem's CPU ops
//! (`fill_`, `copy_`, `to_dtype`, `scale_`, `add_scaled_`) and, where the CPU has no op or is not
//! exact, against independent references.
//!
//! Every case starts from a poisoned destination storage framed by guard elements; the whole
//! storage must equal the CPU's (so unwritten elements and writes outside the view show) and the
//! guards must be untouched (writes outside the storage). Layouts cover odd sizes, sizes that are
//! not a multiple of the block, several blocks, empty tensors, scalars, and transposed, narrowed,
//! permuted, strided, offset and (as sources) expanded views.

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use tandem_core::cuda::launch::{Launch, LaunchConfig};
use tandem_core::cuda::runtime_kernels::{
    add_scaled_launch, cast_launch, copy_launch, fill_launch, norm_finish_launch,
    norm_partial_launch, scale_launch, DeviceView, NormKind,
};
use tandem_core::storage::CpuStorage;
use tandem_core::{with_element_type, DType, Device, Element, Layout, Shape, Tensor};
use tandem_cuda_harness::run;

const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const GUARD: usize = 16;

// ---- layouts -----------------------------------------------------------------------------------

/// A view into a storage of `len` elements.
#[derive(Clone, Debug)]
struct View {
    name: &'static str,
    len: usize,
    layout: Layout,
}

fn view(name: &'static str, len: usize, layout: Layout) -> View {
    assert!(layout.storage_extent() <= len, "{name}");
    View { name, len, layout }
}

fn parts(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
    Layout::from_parts(
        Shape::from_slice(shape),
        strides.iter().copied().collect(),
        offset,
    )
}

/// Groups of views with one shape each; `expanded` views may only be sources.
fn families() -> Vec<Vec<(View, bool)>> {
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
fn pairs() -> Vec<(View, View)> {
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

fn destinations() -> Vec<View> {
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
fn values<T: Element>(n: usize, seed: u64) -> Vec<T> {
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
fn poison<T: Element>() -> T {
    match T::DTYPE {
        DType::I64 => T::from_f64(-4_242_424_242.0),
        DType::U8 => T::from_f64(0xa5 as f64),
        _ => T::from_f64(-7777.0),
    }
}

/// Bitwise equal, or both NaN.
fn same<T: Element>(a: T, b: T) -> bool {
    #[allow(clippy::eq_op)]
    let both_nan = a != a && b != b;
    both_nan || (a == b && a.to_f64().is_sign_negative() == b.to_f64().is_sign_negative())
}

fn assert_same<T: Element>(got: &[T], want: &[T], what: &str) {
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
struct HostBuffer<T: Element> {
    data: Vec<T>,
    len: usize,
}

impl<T: Element> HostBuffer<T> {
    fn new(storage: &[T]) -> Self {
        let mut data = vec![poison::<T>(); GUARD];
        data.extend_from_slice(storage);
        data.resize(GUARD + storage.len() + GUARD, poison::<T>());
        HostBuffer {
            data,
            len: storage.len(),
        }
    }

    fn view<'a>(&mut self, layout: &'a Layout) -> DeviceView<'a> {
        DeviceView {
            ptr: self.data[GUARD..].as_mut_ptr() as u64,
            dtype: T::DTYPE,
            layout,
        }
    }

    /// The storage, after checking that the guards are untouched.
    fn storage(&self, what: &str) -> &[T] {
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
fn cpu_view<T: Element>(storage: &[T], layout: &Layout) -> Tensor {
    Tensor::from_vec(storage.to_vec(), &[storage.len()], Device::Cpu)
        .unwrap()
        .view_detached(layout.clone())
        .unwrap()
}

/// Every element of the storage under a CPU view.
fn cpu_storage<T: Element>(t: &Tensor, len: usize) -> Vec<T> {
    t.view_detached(Layout::contiguous(&[len]))
        .unwrap()
        .to_vec::<T>()
        .unwrap()
}

/// Runs a launch in the harness, and again with a grid of two blocks of one warp so that every
/// thread loops several times through the grid-stride loop (the second run must give the same
/// result from the same starting storage, checked by the caller through `reset`).
fn run_launch(launch: &Launch, what: &str) {
    // SAFETY: every pointer in the launch points into a live HostBuffer covering the layouts
    // the builder checked.
    unsafe { run(launch) }.unwrap_or_else(|e| panic!("{what}: {e}"));
}

fn small_grid(launch: &Launch) -> Launch {
    let mut small = launch.clone();
    small.config = LaunchConfig::new("test", [2, 1, 1], [32, 1, 1], 0).unwrap();
    small
}

// ---- fill -------------------------------------------------------------------------------------

fn check_fill<T: Element>(dst: &View, value: f64) {
    let storage = vec![poison::<T>(); dst.len];
    let cpu = cpu_view(&storage, &dst.layout);
    cpu.fill_(value).unwrap();
    let want = cpu_storage::<T>(&cpu, dst.len);
    let what = format!("fill_ {} {} with {value}", T::DTYPE, dst.name);
    for small in [false, true] {
        let mut buffer = HostBuffer::new(&storage);
        let launch = fill_launch(buffer.view(&dst.layout), value).unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_same(buffer.storage(&what), &want, &what);
    }
}

#[test]
fn fill_matches_the_cpu_for_every_dtype_and_layout() {
    for dtype in DTYPES {
        for dst in destinations() {
            for value in [2.5, -300.7] {
                with_element_type!(dtype, T => check_fill::<T>(&dst, value));
            }
        }
    }
    // An expanded destination is allowed for fill: every copy gets the value.
    let expanded = view(
        "expanded",
        5,
        Layout::contiguous(&[1, 5]).expand("t", &[4, 5]).unwrap(),
    );
    check_fill::<f32>(&expanded, 1.25);
}

// ---- copy and cast ------------------------------------------------------------------------------

fn check_copy<T: Element>(dst: &View, src: &View, seed: u64) {
    let src_storage = values::<T>(src.len, seed);
    let dst_storage = vec![poison::<T>(); dst.len];
    let cpu = cpu_view(&dst_storage, &dst.layout);
    cpu.copy_(&cpu_view(&src_storage, &src.layout)).unwrap();
    let want = cpu_storage::<T>(&cpu, dst.len);
    let what = format!("copy_ {} from {} to {}", T::DTYPE, src.name, dst.name);
    for small in [false, true] {
        let mut dst_buffer = HostBuffer::new(&dst_storage);
        let mut src_buffer = HostBuffer::new(&src_storage);
        let launch =
            copy_launch(dst_buffer.view(&dst.layout), src_buffer.view(&src.layout)).unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_same(dst_buffer.storage(&what), &want, &what);
        assert_same(
            src_buffer.storage(&what),
            &src_storage,
            &format!("{what}: source changed"),
        );
    }
}

#[test]
fn copy_matches_the_cpu_for_every_dtype_and_layout_pair() {
    for dtype in DTYPES {
        for (seed, (dst, src)) in pairs().into_iter().enumerate() {
            with_element_type!(dtype, T => check_copy::<T>(&dst, &src, seed as u64));
        }
    }
}

/// f64 → f32 rounding to odd: exact for the narrowing that follows, so `narrow(to_odd(x))` is
/// `x` rounded once to the narrower type (both narrower types have at most 16 significant bits).
fn round_to_odd_f32(x: f64) -> f32 {
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
fn correctly_rounded<D: Element>(x: f64) -> D {
    let odd = round_to_odd_f32(x);
    let storage = match D::DTYPE {
        DType::F16 => CpuStorage::F16(vec![f16::from_f32(odd)]),
        DType::BF16 => CpuStorage::BF16(vec![bf16::from_f32(odd)]),
        other => unreachable!("only for the 16-bit floats, not {other}"),
    };
    D::slice(&storage).expect("holds D")[0]
}

fn check_cast<S: Element, D: Element>(dst: &View, src: &View, seed: u64) -> usize {
    let src_storage = values::<S>(src.len, seed);
    let dst_storage = vec![poison::<D>(); dst.len];
    let source = cpu_view(&src_storage, &src.layout);
    let converted = source.to_dtype(D::DTYPE).unwrap();
    let cpu = cpu_view(&dst_storage, &dst.layout);
    cpu.copy_(&converted).unwrap();
    let cpu_result = cpu_storage::<D>(&cpu, dst.len);
    // Into the 16-bit floats the CPU (`half`'s `from_f64`) is not always correctly rounded: it
    // rounds through f32 (f16, on CPUs with F16C) or drops the low 32 bits of the f64 first
    // (bf16 always, f16 otherwise), which misrounds values just above a tie, even ones that came
    // from f32. The kernel rounds once, to nearest even; it is checked against an independent
    // correctly rounded reference, and the differences from the CPU are counted.
    let rounds_once = matches!(D::DTYPE, DType::F16 | DType::BF16);
    let want = if rounds_once {
        let reference: Vec<D> = source
            .to_vec::<S>()
            .unwrap()
            .into_iter()
            .map(|x| correctly_rounded::<D>(x.to_f64()))
            .collect();
        let cpu = cpu_view(&dst_storage, &dst.layout);
        cpu.copy_(&Tensor::from_vec(reference, dst.layout.shape(), Device::Cpu).unwrap())
            .unwrap();
        cpu_storage::<D>(&cpu, dst.len)
    } else {
        cpu_result.clone()
    };
    let what = format!(
        "cast {} {} -> {} {}",
        S::DTYPE,
        src.name,
        D::DTYPE,
        dst.name
    );
    let mut dst_buffer = HostBuffer::new(&dst_storage);
    let mut src_buffer = HostBuffer::new(&src_storage);
    let launch = cast_launch(dst_buffer.view(&dst.layout), src_buffer.view(&src.layout)).unwrap();
    run_launch(&launch, &what);
    assert_same(dst_buffer.storage(&what), &want, &what);
    // How often the CPU's rounding differs from the correctly rounded result.
    cpu_result
        .iter()
        .zip(&want)
        .filter(|(c, w)| !same(**c, **w))
        .count()
}

#[test]
fn cast_matches_the_cpu_to_dtype_for_every_dtype_pair() {
    let representative: Vec<(View, View)> = pairs()
        .into_iter()
        .filter(|(d, s)| {
            [
                "contiguous [1000]",
                "transposed [5, 6]",
                "columns 2..7 of [6, 9]",
                "permuted [5, 3, 4] by (1, 2, 0)",
                "scalar",
                "empty [2, 0, 3]",
            ]
            .contains(&d.name)
                || s.name.contains("expanded")
        })
        .collect();
    let mut cpu_differences = 0;
    for from in DTYPES {
        for to in DTYPES {
            if from == to {
                continue;
            }
            for (seed, (dst, src)) in representative.iter().enumerate() {
                cpu_differences += with_element_type!(from, S => with_element_type!(to, D => check_cast::<S, D>(dst, src, seed as u64)));
            }
        }
    }
    // Every layout pair for one cast.
    for (seed, (dst, src)) in pairs().into_iter().enumerate() {
        check_cast::<f32, f16>(&dst, &src, seed as u64);
    }
    println!(
        "casts into f16/bf16 where the CPU's to_dtype differs from the correctly rounded kernel: \
         {cpu_differences}"
    );
}

/// Casts a whole vector through a kernel with a small grid (each thread loops many times).
fn cast_all<S: Element, D: Element>(input: &[S]) -> Vec<D> {
    let layout = Layout::contiguous(&[input.len()]);
    let mut src = HostBuffer::new(input);
    let mut dst = HostBuffer::new(&vec![poison::<D>(); input.len()]);
    let mut launch = cast_launch(dst.view(&layout), src.view(&layout)).unwrap();
    launch.config = LaunchConfig::new("test", [4, 1, 1], [256, 1, 1], 0).unwrap();
    run_launch(&launch, "cast_all");
    dst.storage("cast_all").to_vec()
}

#[test]
fn half_conversions_are_exact_over_every_bit_pattern() {
    // Every f16 and bf16 to f32 and f64 (exact) and back (the identity, NaNs quieted).
    let all_f16: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let all_bf16: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let wide: Vec<f32> = cast_all(&all_f16);
    assert_same(
        &wide,
        &all_f16.iter().map(|h| h.to_f32()).collect::<Vec<_>>(),
        "f16 -> f32",
    );
    assert_same(&cast_all::<f32, f16>(&wide), &all_f16, "f16 -> f32 -> f16");
    let wide: Vec<f64> = cast_all(&all_bf16);
    assert_same(
        &wide,
        &all_bf16.iter().map(|h| h.to_f64()).collect::<Vec<_>>(),
        "bf16 -> f64",
    );
    assert_same(
        &cast_all::<f64, bf16>(&wide),
        &all_bf16,
        "bf16 -> f64 -> bf16",
    );

    // Random f32 bit patterns (every exponent) to f16 and bf16 against `half`, which is
    // correctly rounded from f32.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let floats: Vec<f32> = (0..100_000).map(|_| f32::from_bits(rng.gen())).collect();
    assert_same(
        &cast_all::<f32, f16>(&floats),
        &floats.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
        "f32 -> f16",
    );
    assert_same(
        &cast_all::<f32, bf16>(&floats),
        &floats
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect::<Vec<_>>(),
        "f32 -> bf16",
    );

    // Random f64 near the 16-bit types' range, and exact ties with a tiny excess (where rounding
    // through f32 goes wrong), against the correctly rounded reference.
    let mut doubles: Vec<f64> = (0..50_000)
        .map(|_| {
            let exponent = rng.gen_range(-150..140);
            f64::from_bits(
                (rng.gen::<u64>() & 0x800f_ffff_ffff_ffff) | (((1023 + exponent) as u64) << 52),
            )
        })
        .collect();
    for tie in [
        1.0 + 2f64.powi(-11),
        1.0 + 2f64.powi(-8),
        2f64.powi(-25),
        65520.0,
    ] {
        doubles.extend([tie, tie + tie * 1e-15, tie - tie * 1e-15, -tie]);
    }
    let reference = |x: &f64| correctly_rounded::<f16>(*x);
    assert_same(
        &cast_all::<f64, f16>(&doubles),
        &doubles.iter().map(reference).collect::<Vec<_>>(),
        "f64 -> f16",
    );
    let reference = |x: &f64| correctly_rounded::<bf16>(*x);
    assert_same(
        &cast_all::<f64, bf16>(&doubles),
        &doubles.iter().map(reference).collect::<Vec<_>>(),
        "f64 -> bf16",
    );
}

// ---- scale and add_scaled -------------------------------------------------------------------

/// The CPU's `scale_` for f32 and f64; for f16 and bf16 (no CPU op) the product in f32, rounded
/// once.
fn expected_scale<T: Element>(storage: &[T], layout: &Layout, factor: f64) -> Vec<T> {
    let cpu = cpu_view(storage, layout);
    if matches!(T::DTYPE, DType::F32 | DType::F64) {
        cpu.scale_(factor).unwrap();
    } else {
        let scaled: Vec<T> = cpu
            .to_vec::<T>()
            .unwrap()
            .into_iter()
            .map(|x| correctly_rounded::<T>((x.to_f64() as f32 * factor as f32) as f64))
            .collect();
        cpu.copy_(&Tensor::from_vec(scaled, layout.shape(), Device::Cpu).unwrap())
            .unwrap();
    }
    cpu_storage::<T>(&cpu, storage.len())
}

fn check_scale<T: Element>(dst: &View, factor: f64, seed: u64) {
    let storage = values::<T>(dst.len, seed);
    let want = expected_scale(&storage, &dst.layout, factor);
    let what = format!("scale_ {} {} by {factor}", T::DTYPE, dst.name);
    for small in [false, true] {
        let mut buffer = HostBuffer::new(&storage);
        let launch = scale_launch(buffer.view(&dst.layout), factor).unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_same(buffer.storage(&what), &want, &what);
    }
}

#[test]
fn scale_matches_the_cpu_for_every_float_dtype_and_layout() {
    for dtype in FLOATS {
        for (seed, dst) in destinations().into_iter().enumerate() {
            with_element_type!(dtype, T => check_scale::<T>(&dst, -0.3, seed as u64));
        }
    }
}

fn check_add_scaled<T: Element>(dst: &View, src: &View, alpha: f64, seed: u64) {
    let dst_storage = values::<T>(dst.len, seed);
    let src_storage = values::<T>(src.len, seed + 1000);
    let cpu = cpu_view(&dst_storage, &dst.layout);
    let source = cpu_view(&src_storage, &src.layout);
    if matches!(T::DTYPE, DType::F32 | DType::F64) {
        cpu.add_scaled_(&source, alpha).unwrap();
    } else {
        // No CPU op for the 16-bit floats: in f32, product then sum, rounded once at the end.
        let d = cpu.to_vec::<T>().unwrap();
        let s = source.to_vec::<T>().unwrap();
        let sum: Vec<T> = d
            .iter()
            .zip(&s)
            .map(|(d, s)| {
                correctly_rounded::<T>(
                    (d.to_f64() as f32 + alpha as f32 * s.to_f64() as f32) as f64,
                )
            })
            .collect();
        cpu.copy_(&Tensor::from_vec(sum, dst.layout.shape(), Device::Cpu).unwrap())
            .unwrap();
    }
    let want = cpu_storage::<T>(&cpu, dst.len);
    let what = format!(
        "add_scaled_ {} {} += {alpha} * {}",
        T::DTYPE,
        dst.name,
        src.name
    );
    for small in [false, true] {
        let mut dst_buffer = HostBuffer::new(&dst_storage);
        let mut src_buffer = HostBuffer::new(&src_storage);
        let launch = add_scaled_launch(
            dst_buffer.view(&dst.layout),
            src_buffer.view(&src.layout),
            alpha,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        assert_same(dst_buffer.storage(&what), &want, &what);
    }
}

#[test]
fn add_scaled_matches_the_cpu_for_every_float_dtype_and_layout_pair() {
    for dtype in FLOATS {
        for (seed, (dst, src)) in pairs().into_iter().enumerate() {
            with_element_type!(dtype, T => check_add_scaled::<T>(&dst, &src, 0.37, seed as u64));
        }
    }
}

#[test]
fn add_scaled_of_a_view_onto_itself_matches_the_cpu() {
    // `t += -0.5 * t` through the very same view, as the CPU test of access.rs does.
    let layout = Layout::contiguous(&[6, 5]).transpose("t", 0, 1).unwrap();
    let storage = values::<f32>(30, 3);
    let cpu = cpu_view(&storage, &layout);
    cpu.add_scaled_(&cpu.clone(), -0.5).unwrap();
    let want = cpu_storage::<f32>(&cpu, 30);
    let mut buffer = HostBuffer::new(&storage);
    let same_view = buffer.view(&layout);
    let launch = add_scaled_launch(same_view, same_view, -0.5).unwrap();
    run_launch(&launch, "self add_scaled_");
    assert_same(
        buffer.storage("self add_scaled_"),
        &want,
        "self add_scaled_",
    );
}

// ---- norms ------------------------------------------------------------------------------------

/// The norm of order `p` as optim's `clip_grad_norm` computes it: in f64, NaN winning the max.
fn cpu_norm(values: &[f64], p: f64) -> f64 {
    if p == f64::INFINITY {
        return values.iter().fold(0.0f64, |m, x| {
            if x.abs() > m || x.is_nan() {
                x.abs()
            } else {
                m
            }
        });
    }
    values
        .iter()
        .map(|x| x.abs().powf(p))
        .sum::<f64>()
        .powf(1.0 / p)
}

fn check_norm<T: Element>(src: &View, p: f64, seed: u64) {
    // Finite values in every dtype's range; NaN is checked separately.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let storage: Vec<T> = (0..src.len)
        .map(|_| T::from_f64(rng.gen_range(-100.0..100.0)))
        .collect();
    let source = cpu_view(&storage, &src.layout);
    let want = cpu_norm(&source.to_vec_f64().unwrap(), p);
    let kind = NormKind::for_order(p);
    let mut buffer = HostBuffer::new(&storage);
    let mut partials = vec![f64::NAN; tandem_core::cuda::launch::GRID_STRIDE_MAX_BLOCKS as usize];
    let mut out = [f64::NAN];
    let first =
        norm_partial_launch(buffer.view(&src.layout), kind, partials.as_mut_ptr() as u64).unwrap();
    let what = format!("norm p={p} {} {}", T::DTYPE, src.name);
    run_launch(&first, &what);
    let count = first.config.grid[0] as usize;
    let second = norm_finish_launch(
        partials.as_mut_ptr() as u64,
        count,
        kind,
        out.as_mut_ptr() as u64,
    )
    .unwrap();
    run_launch(&second, &what);
    let got = kind.finish(out[0]);
    assert!(
        (got - want).abs() <= 1e-12 * want.abs().max(1e-300),
        "{what}: got {got}, want {want}"
    );
}

#[test]
fn norms_match_the_cpu_gradient_clipping_norms() {
    // Block reductions are the slowest thing to emulate (every shuffle is a warp barrier): every
    // layout in f32 for each order, a representative few for the other dtypes.
    let views: Vec<View> = families().into_iter().flatten().map(|(v, _)| v).collect();
    for (seed, src) in views.iter().enumerate() {
        for p in [2.0, 1.0, f64::INFINITY, 3.0] {
            check_norm::<f32>(src, p, seed as u64);
        }
    }
    let few = [
        "contiguous [1000]",
        "transposed [40, 25]",
        "columns 2..7 of [6, 9]",
        "scalar",
        "empty [0]",
    ];
    for dtype in [DType::F64, DType::F16, DType::BF16] {
        for (seed, src) in views.iter().filter(|v| few.contains(&v.name)).enumerate() {
            for p in [2.0, f64::INFINITY] {
                with_element_type!(dtype, T => check_norm::<T>(src, p, seed as u64));
            }
        }
    }
    // A NaN anywhere makes the max norm NaN, and the sums too.
    let layout = Layout::contiguous(&[1000]);
    let mut data: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    data[777] = f32::NAN;
    for p in [f64::INFINITY, 2.0] {
        let kind = NormKind::for_order(p);
        let mut buffer = HostBuffer::new(&data);
        let (mut partials, mut out) = (vec![0.0f64; 16], [0.0f64]);
        let first =
            norm_partial_launch(buffer.view(&layout), kind, partials.as_mut_ptr() as u64).unwrap();
        run_launch(&first, "nan norm");
        let second = norm_finish_launch(
            partials.as_mut_ptr() as u64,
            first.config.grid[0] as usize,
            kind,
            out.as_mut_ptr() as u64,
        )
        .unwrap();
        run_launch(&second, "nan norm");
        assert!(out[0].is_nan(), "p={p}: {}", out[0]);
    }
}
