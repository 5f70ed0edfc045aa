//! The runtime's kernels (`core/src/cuda/kernels/runtime.cu`) other than casts, run on the CPU
//! by the host harness through the same launch plans the CUDA runtime executes, against
//! tandem's CPU ops (`fill_`, `copy_`, `scale_`, `add_scaled_`, optim's clipping norm) and, where
//! the CPU has no op, against independent references.
//!
//! Every case starts from a poisoned destination storage framed by guard elements; the whole
//! storage must equal the CPU's (so unwritten elements and writes outside the view show) and the
//! guards must be untouched (writes outside the storage). Layouts (`common::families`) cover odd
//! sizes, sizes that are not a multiple of the block, several blocks, empty tensors, scalars,
//! and transposed, narrowed, permuted, strided, offset and (as sources) expanded views. Each
//! launch also runs with a grid of two one-warp blocks, so threads loop through the grid-stride
//! loop.

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use tandem_core::cuda::launch::GRID_STRIDE_MAX_BLOCKS;
use tandem_core::cuda::runtime_kernels::{
    add_scaled_launch, copy_launch, fill_launch, norm_finish_launch, norm_partial_launch,
    scale_launch, NormKind,
};
use tandem_core::{with_element_type, DType, Device, Element, Layout, Tensor};

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

// ---- copy ------------------------------------------------------------------------------

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
    let mut partials = vec![f64::NAN; GRID_STRIDE_MAX_BLOCKS as usize];
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
