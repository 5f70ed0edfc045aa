//! The gradient kernels (`optim/src/kernels/grads.cu`), run on the CPU by the host harness
//! through the launch plans the CUDA path uses:
//!
//! - clipping, as the CUDA path runs it (partial norms per dtype into one array, the runtime's
//!   `norm_finish`, scaling that reads the norm from memory), against optim's CPU
//!   `clip_grad_norm` on the same gradients: the norm within f64 rounding of the CPU's (the
//!   summation order differs), every gradient scaled exactly as the CPU scales by that norm and
//!   within f32 rounding of the CPU's result, for norms of order 2, 1, ∞, 3 and 0.5, with and
//!   without clipping, f32, f64 and both in one call, several chunkings and grids; a NaN or an
//!   infinity makes the norm non-finite and leaves every gradient untouched; the norm does not
//!   depend on the grid;
//! - zeroing: every element of every gradient, nothing around it;
//! - the gradient scaler's unscale: every element multiplied by the inverse scale exactly as the
//!   CPU multiplies it, f32 and f64 sharing one found-inf flag, which is raised by an infinity
//!   or a NaN anywhere (first, middle or last element of a chunk) and never lowered.

mod common;
mod optim_common;

use common::poison;
use optim_common::*;
use rand::SeedableRng;
use tandem_core::cuda::runtime_kernels::{norm_finish_launch, NormKind};
use tandem_core::{DType, Element, Tensor};
use tandem_optim::clip_grad_norm;
use tandem_optim::multi_tensor::{
    grad_clip_scale_launch, grad_norm_partial_launch, grad_unscale_launch, grad_zero_launch,
    TableEntry, TensorTable,
};

/// Gradients of one dtype in guarded buffers.
struct Grads<T: Element> {
    values: Vec<Vec<T>>,
    buffers: Vec<Dense<T>>,
}

impl<T: Element> Grads<T> {
    fn new(values: Vec<Vec<T>>) -> Self {
        let buffers = values.iter().map(|v| Dense::new(v)).collect();
        Grads { values, buffers }
    }

    fn table(&mut self, chunk: u64) -> TensorTable {
        let entries: Vec<TableEntry> = self
            .buffers
            .iter_mut()
            .map(|b| TableEntry {
                grad: b.address(),
                numel: b.len as u64,
                ..Default::default()
            })
            .collect();
        TensorTable::new("test", T::DTYPE, &entries, chunk).unwrap()
    }

    fn cpu_params(&self) -> Vec<Tensor> {
        self.values
            .iter()
            .map(|v| {
                let p = cpu_param(&vec![T::from_f64(0.0); v.len()]);
                set_cpu_grad(&p, v);
                p
            })
            .collect()
    }
}

/// Runs the CUDA path's clipping pipeline over both groups and returns the finished norm the
/// scaling kernel stored.
fn clip_on_harness(
    f32s: &mut Grads<f32>,
    f64s: &mut Grads<f64>,
    kind: NormKind,
    max_norm: f64,
    cut: Cut,
) -> f64 {
    let mut tables = Vec::new();
    let mut total = 0u64;
    for table in [f32s.table(cut.chunk), f64s.table(cut.chunk)] {
        if !table.is_empty() {
            tables.push((total, table.clone()));
            total += table.chunks();
        }
    }
    assert!(total > 0, "the cases have elements");
    let mut partials = Dense::new(&vec![poison::<f64>(); total as usize + 2]);
    let base = partials.address();
    let (reduced, norm) = (base + 8 * total, base + 8 * (total + 1));
    for (first, table) in &tables {
        let launch =
            grad_norm_partial_launch(table, table.words().as_ptr() as u64, kind, base + 8 * first)
                .unwrap();
        run_cut(&launch, cut, "norm partials");
    }
    let finish = norm_finish_launch(base, total as usize, kind, reduced).unwrap();
    let whole = Cut {
        chunk: cut.chunk,
        small_grid: false,
    };
    run_cut(&finish, whole, "norm finish");
    for (i, (_, table)) in tables.iter().enumerate() {
        let out = if i == 0 { norm } else { 0 };
        let launch = grad_clip_scale_launch(
            table,
            table.words().as_ptr() as u64,
            reduced,
            kind,
            max_norm,
            out,
        )
        .unwrap();
        run_cut(&launch, cut, "clip scale");
    }
    partials.values("partials")[total as usize + 1]
}

/// `values` as the CPU scales them once the norm is `norm`.
fn scaled<T: Element>(values: &[T], norm: f64, max_norm: f64) -> Vec<T> {
    let coefficient = max_norm / (norm + 1e-6);
    if !norm.is_finite() || coefficient >= 1.0 {
        return values.to_vec();
    }
    let f = T::from_f64(coefficient).to_f64();
    values
        .iter()
        .map(|&x| match T::DTYPE {
            DType::F32 => T::from_f64((x.to_f64() as f32 * f as f32) as f64),
            _ => T::from_f64(x.to_f64() * f),
        })
        .collect()
}

fn check_scaled<T: Element>(
    grads: &Grads<T>,
    cpu: &[Tensor],
    norm: f64,
    max_norm: f64,
    what: &str,
) {
    for (i, (buffer, values)) in grads.buffers.iter().zip(&grads.values).enumerate() {
        let what = format!("{what}: {} gradient {i}", T::DTYPE);
        buffer.assert_equals(&scaled(values, norm, max_norm), &what);
        // And close to what the CPU's own clipping made of them.
        let want = cpu[i].grad().unwrap().to_vec_f64().unwrap();
        for (j, (g, w)) in buffer.values(&what).iter().zip(&want).enumerate() {
            let g = g.to_f64();
            let ok = (g - w).abs() <= 2e-7 * w.abs() || (g.is_nan() && w.is_nan());
            assert!(ok, "{what}[{j}]: harness {g}, cpu {w}");
        }
    }
}

const ORDERS: [f64; 5] = [2.0, 1.0, f64::INFINITY, 3.0, 0.5];

fn check_clip(with_f32: bool, with_f64: bool, p: f64, max_norm: f64, cut: Cut, seed: u64) {
    let what = format!("clip p={p} max_norm={max_norm} f32={with_f32} f64={with_f64} {cut:?}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let sizes = |on: bool| if on { &SIZES[..] } else { &[][..] };
    let mut f32s = Grads::new(
        sizes(with_f32)
            .iter()
            .map(|&n| random(&mut rng, n))
            .collect(),
    );
    let mut f64s = Grads::new(
        sizes(with_f64)
            .iter()
            .map(|&n| random(&mut rng, n))
            .collect(),
    );
    let (cpu32, cpu64) = (f32s.cpu_params(), f64s.cpu_params());
    let all: Vec<Tensor> = cpu32.iter().chain(&cpu64).cloned().collect();
    let cpu_norm = clip_grad_norm(&all, max_norm, p).unwrap();

    let norm = clip_on_harness(&mut f32s, &mut f64s, NormKind::for_order(p), max_norm, cut);
    assert!(
        (norm - cpu_norm).abs() <= 1e-12 * cpu_norm,
        "{what}: norm {norm} on the harness, {cpu_norm} on the CPU"
    );
    check_scaled(&f32s, &cpu32, norm, max_norm, &what);
    check_scaled(&f64s, &cpu64, norm, max_norm, &what);
}

#[test]
fn clipping_matches_the_cpu_for_every_order_dtype_mix_and_chunking() {
    let mut seed = 0;
    for p in ORDERS {
        for max_norm in [0.5, 1e6] {
            for (with_f32, with_f64) in [(true, false), (false, true), (true, true)] {
                for cut in few_cuts() {
                    seed += 1;
                    check_clip(with_f32, with_f64, p, max_norm, cut, seed);
                }
            }
        }
    }
}

#[test]
fn the_norm_does_not_depend_on_the_grid() {
    for p in ORDERS {
        let norms: Vec<f64> = [false, true]
            .into_iter()
            .map(|small_grid| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(42);
                let mut f32s = Grads::new(SIZES.iter().map(|&n| random(&mut rng, n)).collect());
                let mut f64s = Grads::<f64>::new(Vec::new());
                let cut = Cut {
                    chunk: 64,
                    small_grid,
                };
                clip_on_harness(&mut f32s, &mut f64s, NormKind::for_order(p), 1e6, cut)
            })
            .collect();
        assert_eq!(norms[0].to_bits(), norms[1].to_bits(), "p={p}: {norms:?}");
    }
}

#[test]
fn a_non_finite_norm_leaves_every_gradient_untouched() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for p in ORDERS {
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            let mut values: Vec<Vec<f32>> = SIZES.iter().map(|&n| random(&mut rng, n)).collect();
            values[4][100] = bad;
            let mut f32s = Grads::new(values.clone());
            let mut f64s = Grads::new(vec![random::<f64>(&mut rng, 300)]);
            let f64_values = f64s.values.clone();
            let cut = Cut {
                chunk: 64,
                small_grid: false,
            };
            let norm = clip_on_harness(&mut f32s, &mut f64s, NormKind::for_order(p), 0.1, cut);
            let what = format!("{bad} in a gradient, p={p}");
            assert!(!norm.is_finite(), "{what}: norm {norm}");
            if bad.is_nan() {
                assert!(norm.is_nan(), "{what}: a NaN must win, got {norm}");
            }
            for (b, v) in f32s.buffers.iter().zip(&values) {
                b.assert_equals(v, &what);
            }
            f64s.buffers[0].assert_equals(&f64_values[0], &what);
            let cpu = clip_grad_norm(&Grads::new(values).cpu_params(), 0.1, p);
            assert!(cpu.is_err(), "{what}: the CPU reports it too");
        }
    }
}

fn check_zero<T: Element>(cut: Cut) {
    let mut grads = Grads::new(
        SIZES
            .iter()
            .map(|&n| vec![T::from_f64(-3.5); n])
            .collect::<Vec<_>>(),
    );
    let table = grads.table(cut.chunk);
    let launch = grad_zero_launch(&table, table.words().as_ptr() as u64).unwrap();
    let what = format!("zero {} {cut:?}", T::DTYPE);
    run_cut(&launch, cut, &what);
    for (b, n) in grads.buffers.iter().zip(SIZES) {
        b.assert_equals(&vec![T::from_f64(0.0); n], &what);
    }
}

#[test]
fn zeroing_clears_every_gradient_and_nothing_else() {
    for cut in cuts() {
        check_zero::<f32>(cut);
        check_zero::<f64>(cut);
    }
}

/// Runs the unscale kernel over both groups with one flag starting at `flag`; returns the flag.
fn unscale_on_harness(
    f32s: &mut Grads<f32>,
    f64s: &mut Grads<f64>,
    inv_scale: f64,
    flag: i64,
    cut: Cut,
) -> i64 {
    let mut found = Dense::new(&[flag]);
    let address = found.address();
    for table in [f32s.table(cut.chunk), f64s.table(cut.chunk)] {
        if table.is_empty() {
            continue;
        }
        let launch =
            grad_unscale_launch(&table, table.words().as_ptr() as u64, inv_scale, address).unwrap();
        run_cut(&launch, cut, "unscale");
    }
    found.values("found-inf flag")[0]
}

fn unscaled<T: Element + std::ops::Mul<Output = T>>(values: &[T], inv_scale: f64) -> Vec<T> {
    let inv = T::from_f64(inv_scale);
    values.iter().map(|&x| x * inv).collect()
}

#[test]
fn unscaling_multiplies_like_the_cpu_and_raises_one_shared_flag() {
    let inv_scale = 1.0 / 3000.0;
    let mut seed = 100;
    // (which tensor of the f32 group, which element) holds the bad value, or none.
    let spots: [Option<(usize, usize)>; 4] = [None, Some((6, 0)), Some((4, 128)), Some((6, 999))];
    for cut in few_cuts() {
        for spot in spots {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                seed += 1;
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut values: Vec<Vec<f32>> =
                    SIZES.iter().map(|&n| random(&mut rng, n)).collect();
                if let Some((t, i)) = spot {
                    values[t][i] = bad;
                }
                let f64_values: Vec<Vec<f64>> = vec![random(&mut rng, 300), random(&mut rng, 5)];
                let mut f32s = Grads::new(values.clone());
                let mut f64s = Grads::new(f64_values.clone());
                let flag = unscale_on_harness(&mut f32s, &mut f64s, inv_scale, 0, cut);
                let what = format!("{bad} at {spot:?}, {cut:?}");
                assert_eq!(flag, spot.is_some() as i64, "{what}: flag");
                for (b, v) in f32s.buffers.iter().zip(&values) {
                    b.assert_equals(&unscaled(v, inv_scale), &what);
                }
                for (b, v) in f64s.buffers.iter().zip(&f64_values) {
                    b.assert_equals(&unscaled(v, inv_scale), &what);
                }
                if spot.is_none() {
                    break;
                }
            }
        }
    }
    // A NaN in the f64 group alone raises the shared flag; a raised flag is never lowered.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut f32s = Grads::new(vec![random::<f32>(&mut rng, 100)]);
    let mut f64s = Grads::new(vec![vec![1.0, f64::NAN, 2.0]]);
    let cut = few_cuts()[0];
    assert_eq!(unscale_on_harness(&mut f32s, &mut f64s, 0.5, 0, cut), 1);
    let mut f64s = Grads::new(vec![vec![1.0, 2.0]]);
    assert_eq!(unscale_on_harness(&mut f32s, &mut f64s, 0.5, 1, cut), 1);
}
