//! Casts between every pair of dtypes (`cast_<from>_<to>` in runtime.cu), run on the CPU by the
//! host harness, against the CPU's `to_dtype` and, into f16 and bf16, against an independent
//! correctly rounded reference; and the 16-bit float conversions of `tandem.cuh` over every bit
//! pattern.

mod common;

use common::*;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use tandem_core::cuda::launch::LaunchConfig;
use tandem_core::cuda::runtime_kernels::cast_launch;
use tandem_core::{with_element_type, DType, Device, Element, Layout, Tensor};

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
