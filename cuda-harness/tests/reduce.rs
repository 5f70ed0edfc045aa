//! The reduction kernels (`ops/src/reduce/reduce.cu`), run on the CPU by the host harness
//! through the plans and launches the CUDA ops use (`tandem_ops::reduce::cuda::launch`), against
//! tandem's CPU ops (`sum`, `mean`, `max`, `argmax`) and direct loops.
//!
//! Inputs hold multiples of 1/8 in [-2, 2], so every sum is exact in f32 whatever the order of
//! addition, and the kernels must match the CPU bit for bit (a mean within one rounding).
//! Layouts cover every plan: rows short enough for a warp and long enough for a block,
//! column-wise sums of a middle block of dims, the two-pass sum of one long row, strided
//! (transposed, narrowed, permuted, offset, expanded) inputs, empty groups, empty outputs and
//! scalars. Outputs start poisoned between guard elements; every launch but the second pass of
//! a partial sum also runs with a grid of two one-warp blocks, so that threads loop.

mod common;

use common::{parts, poison, run_launch, small_grid, HostBuffer};
use rand::{Rng, SeedableRng};
use tandem_autograd::{BackwardOptions, TensorBackward};
use tandem_core::{DType, Device, Element, Layout, Tensor};
use tandem_ops::reduce::cuda::launch::{
    broadcast_scaled_launch, expanded_gradient, grouped_layout, max_rows_launch,
    max_scatter_launch, max_scatter_layouts, plan_sum, sum_launches, SumPlan, PARTIAL_MIN_LEN,
};

/// An input case: a storage of `len` elements viewed through `layout`, reduced over `dims`.
struct Case {
    name: &'static str,
    len: usize,
    layout: Layout,
    dims: Vec<usize>,
}

fn case(name: &'static str, len: usize, layout: Layout, dims: &[usize]) -> Case {
    assert!(layout.storage_extent() <= len, "{name}");
    Case {
        name,
        len,
        layout,
        dims: dims.to_vec(),
    }
}

fn cases() -> Vec<Case> {
    let c = |s: &[usize]| Layout::contiguous(s);
    let t = |s: &[usize], a: usize, b: usize| c(s).transpose("t", a, b).unwrap();
    vec![
        case("[37] over 0 (one warp row)", 37, c(&[37]), &[0]),
        case("[5, 1300] over 1 (block rows)", 6500, c(&[5, 1300]), &[1]),
        case("[7, 33] over 0 (columns)", 231, c(&[7, 33]), &[0]),
        case("[3, 4, 5] over 1 (columns)", 60, c(&[3, 4, 5]), &[1]),
        case("[3, 4, 5] over 0, 1 (columns)", 60, c(&[3, 4, 5]), &[0, 1]),
        case(
            "[3, 4, 5] over 0, 2 (strided rows)",
            60,
            c(&[3, 4, 5]),
            &[0, 2],
        ),
        case("[3, 4, 5] over 2 (rows)", 60, c(&[3, 4, 5]), &[2]),
        case("[3, 4, 5] over all", 60, c(&[3, 4, 5]), &[0, 1, 2]),
        case("[3, 1, 5] over 1 (size-1 dim)", 15, c(&[3, 1, 5]), &[1]),
        case("transposed [6, 5] over 0", 30, t(&[5, 6], 0, 1), &[0]),
        case("transposed [6, 5] over 1", 30, t(&[5, 6], 0, 1), &[1]),
        case(
            "columns 2..7 of [6, 9] over 1",
            54,
            c(&[6, 9]).narrow("t", 1, 2, 5).unwrap(),
            &[1],
        ),
        case(
            "permuted [5, 3, 4] over 0, 2",
            60,
            c(&[5, 3, 4]).permute("t", &[1, 2, 0]).unwrap(),
            &[0, 2],
        ),
        case(
            "row [1, 5] expanded to [6, 5] over 0",
            5,
            c(&[1, 5]).expand("t", &[6, 5]).unwrap(),
            &[0],
        ),
        case(
            "[4, 3] at offset 3 with strides 10, 2 over 1",
            40,
            parts(&[4, 3], &[10, 2], 3),
            &[1],
        ),
        case("[3, 0] over 1 (empty groups)", 0, c(&[3, 0]), &[1]),
        case("[0, 4] over 1 (no groups)", 0, c(&[0, 4]), &[1]),
        case("[2, 0, 3] over 1 (empty middle)", 0, c(&[2, 0, 3]), &[1]),
        case("scalar", 1, c(&[]), &[]),
        case("scalar at offset 2", 3, parts(&[], &[], 2), &[]),
        case("[70001] over 0 (two-pass sum)", 70_001, c(&[70_001]), &[0]),
        case(
            "[3, 23000] over all (two-pass sum)",
            69_000,
            c(&[3, 23_000]),
            &[0, 1],
        ),
    ]
}

/// Multiples of 1/8 in [-2, 2]: every sum of fewer than 2^19 of them is exact in f32.
fn eighths<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f64(rng.gen_range(-16i32..=16) as f64 / 8.0))
        .collect()
}

fn cpu_view<T: Element>(storage: &[T], layout: &Layout) -> Tensor {
    common::cpu_view(storage, layout)
}

fn kept_shape(layout: &Layout, dims: &[usize]) -> Vec<usize> {
    (0..layout.rank())
        .map(|d| {
            if dims.contains(&d) {
                1
            } else {
                layout.shape()[d]
            }
        })
        .collect()
}

fn isize_dims(dims: &[usize]) -> Vec<isize> {
    dims.iter().map(|&d| d as isize).collect()
}

fn check_sum<T: Element>(c: &Case, scale_for_mean: bool) {
    let what = format!(
        "{} {} ({})",
        if scale_for_mean { "mean" } else { "sum" },
        T::DTYPE,
        c.name
    );
    let storage = eighths::<T>(c.len, 7);
    let x = cpu_view(&storage, &c.layout);
    let count: usize = c.dims.iter().map(|&d| c.layout.shape()[d]).product();
    let scale = if scale_for_mean && count > 0 {
        1.0 / count as f64
    } else {
        1.0
    };
    let want: Vec<f64> = if scale_for_mean && count > 0 {
        tandem_ops::mean(&x, &isize_dims(&c.dims), true)
    } else {
        tandem_ops::sum(&x, &isize_dims(&c.dims), true)
    }
    .unwrap()
    .to_vec_f64()
    .unwrap();
    let rows = want.len();
    let plan = plan_sum("sum", &c.layout, &c.dims).unwrap();
    assert_ne!(plan, SumPlan::Copy, "{what}");
    if c.len >= PARTIAL_MIN_LEN && c.dims.len() == c.layout.rank() {
        assert!(matches!(plan, SumPlan::Partial { .. }), "{what}: {plan:?}");
    }
    for small in [false, true] {
        let mut input = HostBuffer::new(&storage);
        let mut out = HostBuffer::new(&vec![poison::<T>(); rows]);
        let blocks = match plan {
            SumPlan::Partial { blocks, .. } => blocks,
            _ => 0,
        };
        let mut partials = HostBuffer::new(&vec![poison::<T>(); blocks]);
        let dense = Layout::contiguous(&[0]);
        let launches = sum_launches(
            "sum",
            &plan,
            input.view(&c.layout),
            out.view(&dense).ptr,
            partials.view(&dense).ptr,
            scale,
        )
        .unwrap();
        if rows == 0 {
            continue; // the op launches nothing for an empty output
        }
        let partial = launches.len() > 1;
        for launch in &launches {
            let launch = if small && !partial {
                small_grid(launch)
            } else {
                launch.clone()
            };
            run_launch(&launch, &what);
        }
        input.storage(&format!("{what}: input"));
        partials.storage(&format!("{what}: partials"));
        let got: Vec<f64> = out.storage(&what).iter().map(|v| v.to_f64()).collect();
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let tolerance = if scale_for_mean { 1e-6 * w.abs() } else { 0.0 };
            assert!(
                (g - w).abs() <= tolerance,
                "{what} (plan {plan:?}, small grid {small}): output {r} is {g}, the CPU's {w}"
            );
        }
    }
}

#[test]
fn sum_and_mean_match_the_cpu_for_every_plan_and_layout() {
    for c in cases() {
        for mean in [false, true] {
            check_sum::<f32>(&c, mean);
            check_sum::<f64>(&c, mean);
        }
    }
}

#[test]
fn layouts_that_need_more_than_eight_kernel_dims_are_summed_from_a_copy() {
    // The first two of three along each of 9 dims, reduced over every other dim: nothing merges.
    let strides = tandem_core::Layout::contiguous(&[3; 9]).strides().clone();
    let layout = Layout::from_parts([2usize; 9].into_iter().collect(), strides, 0);
    assert_eq!(
        plan_sum("sum", &layout, &[0, 2, 4, 6, 8]).unwrap(),
        SumPlan::Copy
    );
}

/// The gradient of `scale · sum` from a direct loop: every input element gets the output
/// gradient of its group.
fn check_sum_backward<T: Element>(c: &Case, g_transposed: bool) {
    let in_shape: Vec<usize> = c.layout.shape().to_vec();
    let kept: Vec<usize> = (0..in_shape.len())
        .filter(|d| !c.dims.contains(d))
        .map(|d| in_shape[d])
        .collect();
    let rows: usize = kept.iter().product();
    // The output gradient, dense or (rank 2) a transposed view.
    let (g_storage, g_layout) = if g_transposed && kept.len() == 2 {
        let l = Layout::contiguous(&[kept[1], kept[0]])
            .transpose("t", 0, 1)
            .unwrap();
        (eighths::<T>(rows, 3), l)
    } else {
        (eighths::<T>(rows, 3), Layout::contiguous(&kept))
    };
    let g_values: Vec<f64> = cpu_view(&g_storage, &g_layout).to_vec_f64().unwrap();
    let n: usize = in_shape.iter().product();
    let scale = 0.25;
    let want: Vec<f64> = (0..n)
        .map(|i| {
            let index = unravel(i, &in_shape);
            let kept_index: Vec<usize> = (0..in_shape.len())
                .filter(|d| !c.dims.contains(d))
                .map(|d| index[d])
                .collect();
            g_values[ravel(&kept_index, &kept)] * scale
        })
        .collect();
    let what = format!("sum backward {} ({}), g {:?}", T::DTYPE, c.name, g_layout);
    let expanded = expanded_gradient(&g_layout, &in_shape, &c.dims);
    for keepdim in [false, true] {
        // With keepdim the gradient has the reduced dims as size 1 (stride anything).
        let g_view = if keepdim {
            let mut strides = Vec::new();
            let mut k = 0;
            for d in 0..in_shape.len() {
                if c.dims.contains(&d) {
                    strides.push(99);
                } else {
                    strides.push(g_layout.strides()[k]);
                    k += 1;
                }
            }
            parts(&kept_shape(&c.layout, &c.dims), &strides, 0)
        } else {
            g_layout.clone()
        };
        let layout = expanded_gradient(&g_view, &in_shape, &c.dims);
        assert_eq!(layout, expanded, "{what}: keepdim {keepdim}");
        for small in [false, true] {
            let mut g = HostBuffer::new(&g_storage);
            let mut out = HostBuffer::new(&vec![poison::<T>(); n]);
            let dense = Layout::contiguous(&[0]);
            let launch = broadcast_scaled_launch(
                "sum",
                T::DTYPE,
                out.view(&dense).ptr,
                g.view(&dense).ptr,
                &layout,
                scale,
            )
            .unwrap();
            if n == 0 {
                continue;
            }
            run_launch(&if small { small_grid(&launch) } else { launch }, &what);
            let got: Vec<f64> = out.storage(&what).iter().map(|v| v.to_f64()).collect();
            assert_eq!(got, want, "{what}: keepdim {keepdim}, small grid {small}");
        }
    }
}

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        index[d] = i % shape[d];
        i /= shape[d];
    }
    index
}

fn ravel(index: &[usize], shape: &[usize]) -> usize {
    index.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

#[test]
fn sum_backward_broadcasts_the_gradient_over_the_reduced_dims() {
    for c in cases().iter().filter(|c| c.len < 10_000) {
        for transposed in [false, true] {
            check_sum_backward::<f32>(c, transposed);
            check_sum_backward::<f64>(c, transposed);
        }
    }
}

// ---- max -----------------------------------------------------------------------------------

/// Values with many ties (so "first maximum" matters), and -inf and NaN in some groups.
fn tied<T: Element>(n: usize, seed: u64, with_nan: bool) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let v = match rng.gen_range(0..20) {
                0 => f64::NEG_INFINITY,
                1 if with_nan && i % 7 == 3 => f64::NAN,
                k => (k % 5) as f64 - 2.0,
            };
            T::from_f64(v)
        })
        .collect()
}

/// The first maximum of each group (NaN beats every number) and its position, from a loop.
fn max_reference(values: &[f64], shape: &[usize], dims: &[usize]) -> (Vec<f64>, Vec<i64>) {
    let kept: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
    let kept_shape: Vec<usize> = kept.iter().map(|&d| shape[d]).collect();
    let reduced_shape: Vec<usize> = dims.iter().map(|&d| shape[d]).collect();
    let rows: usize = kept_shape.iter().product();
    let len: usize = reduced_shape.iter().product();
    let mut best = vec![(f64::NEG_INFINITY, -1i64); rows];
    for (r, slot) in best.iter_mut().enumerate() {
        let ki = unravel(r, &kept_shape);
        for k in 0..len {
            let ri = unravel(k, &reduced_shape);
            let mut index = vec![0; shape.len()];
            for (j, &d) in kept.iter().enumerate() {
                index[d] = ki[j];
            }
            for (j, &d) in dims.iter().enumerate() {
                index[d] = ri[j];
            }
            let v = values[ravel(&index, shape)];
            let (b, at) = *slot;
            let better = at < 0 || (v.is_nan() && !b.is_nan()) || (!b.is_nan() && v > b);
            if better {
                *slot = (v, k as i64);
            }
        }
    }
    best.into_iter().unzip()
}

fn check_max<T: Element>(c: &Case, with_nan: bool) {
    let what = format!("max {} ({}), NaN {with_nan}", T::DTYPE, c.name);
    let in_shape = c.layout.shape().to_vec();
    let len: usize = c.dims.iter().map(|&d| in_shape[d]).product();
    let rows: usize = (0..in_shape.len())
        .filter(|d| !c.dims.contains(d))
        .map(|d| in_shape[d])
        .product();
    if len == 0 || rows == 0 {
        return; // the op refuses a maximum over nothing and launches nothing for no groups
    }
    let storage = tied::<T>(c.len, 11, with_nan);
    let x = cpu_view(&storage, &c.layout);
    let values: Vec<f64> = x.to_vec_f64().unwrap();
    let (want_values, want_positions) = max_reference(&values, &in_shape, &c.dims);
    // The CPU op agrees with the loop (so the kernel is checked against both).
    let cpu = tandem_ops::max(&x, &isize_dims(&c.dims), false).unwrap();
    let cpu_values = cpu.to_vec_f64().unwrap();
    for (a, b) in cpu_values.iter().zip(&want_values) {
        assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: the CPU op");
    }
    let grouped = grouped_layout("max", &c.layout, &c.dims).unwrap();
    for small in [false, true] {
        let mut input = HostBuffer::new(&storage);
        let mut out = HostBuffer::new(&vec![poison::<T>(); rows]);
        let mut positions = HostBuffer::new(&vec![poison::<i64>(); rows]);
        let dense = Layout::contiguous(&[0]);
        let launch = max_rows_launch(
            "max",
            T::DTYPE,
            input.view(&dense).ptr,
            &grouped,
            out.view(&dense).ptr,
            positions.view(&dense).ptr,
            rows,
            len,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        let got: Vec<f64> = out.storage(&what).iter().map(|v| v.to_f64()).collect();
        for (r, (g, w)) in got.iter().zip(&want_values).enumerate() {
            assert!(
                g == w || (g.is_nan() && w.is_nan()),
                "{what}, small grid {small}: group {r} maximum {g}, want {w}"
            );
        }
        assert_eq!(
            positions.storage(&what),
            want_positions.as_slice(),
            "{what}, small grid {small}: positions of the first maxima"
        );
    }
}

#[test]
fn max_finds_the_first_maximum_with_nan_winning_for_every_layout() {
    for c in cases() {
        for with_nan in [false, true] {
            check_max::<f32>(&c, with_nan);
            check_max::<f64>(&c, with_nan);
        }
    }
}

fn check_max_backward<T: Element>(c: &Case) {
    let in_shape = c.layout.shape().to_vec();
    let n: usize = in_shape.iter().product();
    let len: usize = c.dims.iter().map(|&d| in_shape[d]).product();
    let kept: Vec<usize> = (0..in_shape.len())
        .filter(|d| !c.dims.contains(d))
        .map(|d| in_shape[d])
        .collect();
    let rows: usize = kept.iter().product();
    if len == 0 || rows == 0 || n > 10_000 {
        return;
    }
    let what = format!("max backward {} ({})", T::DTYPE, c.name);
    let values: Vec<f64> = cpu_view(&tied::<T>(c.len, 5, false), &c.layout)
        .to_vec_f64()
        .unwrap();
    let (_, positions) = max_reference(&values, &in_shape, &c.dims);
    let g_storage = eighths::<T>(rows, 9);
    let g_layout = Layout::contiguous(&kept);
    // The CPU op's gradient: sum of the maximum's gradient (through autograd).
    let x = Tensor::from_vec(values.clone(), &in_shape, Device::Cpu)
        .unwrap()
        .to_dtype(T::DTYPE)
        .unwrap()
        .with_requires_grad()
        .unwrap();
    let m = tandem_ops::max(&x, &isize_dims(&c.dims), false).unwrap();
    let g_cpu = cpu_view(&g_storage, &g_layout);
    m.backward_with(Some(&g_cpu), &BackwardOptions::default())
        .unwrap();
    let want: Vec<f64> = x.grad().unwrap().to_vec_f64().unwrap();
    let (g_kept, kept_layout, reduced) = max_scatter_layouts(&g_layout, &in_shape, &c.dims);
    for small in [false, true] {
        let mut grad = HostBuffer::new(&vec![T::from_f64(0.0); n]);
        let mut g = HostBuffer::new(&g_storage);
        let mut p = HostBuffer::new(&positions);
        let dense = Layout::contiguous(&[0]);
        let launch = max_scatter_launch(
            "max backward",
            T::DTYPE,
            grad.view(&dense).ptr,
            g.view(&dense).ptr,
            &g_kept,
            p.view(&dense).ptr,
            &kept_layout,
            &reduced,
        )
        .unwrap();
        run_launch(&if small { small_grid(&launch) } else { launch }, &what);
        let got: Vec<f64> = grad.storage(&what).iter().map(|v| v.to_f64()).collect();
        assert_eq!(got, want, "{what}, small grid {small}");
    }
}

#[test]
fn max_backward_writes_each_gradient_at_its_first_maximum() {
    for c in cases() {
        check_max_backward::<f32>(&c);
        check_max_backward::<f64>(&c);
    }
}

#[test]
fn unsupported_dtypes_are_refused_by_name() {
    let l = Layout::contiguous(&[4]);
    let err =
        tandem_ops::reduce::cuda::launch::sum_rows_launch("sum", DType::F16, 1, &l, 2, 1, 4, 1.0)
            .unwrap_err()
            .to_string();
    assert!(err.contains("sum") && err.contains("f16"), "{err}");
    let err = max_rows_launch("max", DType::F32, 1, &l, 2, 3, 3, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("max"), "{err}");
}
