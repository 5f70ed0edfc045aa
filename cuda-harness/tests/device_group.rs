//! The device group's kernels (`dist/src/process_group/device_threads/device_group.cu`), run on
//! the CPU by the host harness through the same launch plans the group executes on a GPU,
//! against the CPU op: the threads backend's `all_reduce`, `reduce_scatter` and `all_gather` on
//! the same contributions. Results must be identical bit for bit (NaN for NaN), which is what
//! makes every rank of a device group agree with every other and with the CPU backends.
//!
//! Contributions include the hard cases of each dtype (signed zeros, ties, infinities, NaN,
//! values at the f16 overflow threshold, subnormals); sizes are empty, odd, and several blocks;
//! outputs start poisoned and are framed by guard elements (unwritten elements and writes outside
//! the output show); each plan also runs on a grid of two one-warp blocks so that threads loop.

mod common;

use common::*;
use tandem_core::cuda::launch::Launch;
use tandem_core::{with_element_type, DType, Device, Element, Layout, Tensor};
use tandem_dist::process_group::device_threads::kernels::{
    gather_ranks_launch, reduce_ranks_launch, Span,
};
use tandem_dist::{ProcessGroup, ReduceOp, ThreadProcessGroup};

const WORLDS: [usize; 5] = [1, 2, 3, 5, 8];
const SIZES: [usize; 4] = [0, 1, 37, 1000];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// Rank `k`'s contribution: the dtype's test values, rotated per rank so that the special
/// values meet different partners.
fn contributions<T: Element>(world: usize, n: usize, seed: u64) -> Vec<Vec<T>> {
    (0..world)
        .map(|k| {
            let mut v = values::<T>(n + 7 * k, seed + k as u64);
            let shift = 3 * k % v.len().max(1);
            v.rotate_left(shift);
            v.truncate(n);
            v
        })
        .collect()
}

/// Runs `f(rank, group)` on every rank of a threads group and returns the results in rank order.
fn on_threads<R: Send>(world: usize, f: impl Fn(usize, &dyn ProcessGroup) -> R + Sync) -> Vec<R> {
    let groups = ThreadProcessGroup::new_group(world).unwrap();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(k, g)| s.spawn(move || f(k, &g)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The inputs in host buffers and the spans the kernels see.
struct Sources<T: Element> {
    buffers: Vec<HostBuffer<T>>,
    layout: Layout,
}

impl<T: Element> Sources<T> {
    fn new(inputs: &[Vec<T>]) -> Self {
        let n = inputs.first().map_or(0, Vec::len);
        Sources {
            buffers: inputs.iter().map(|v| HostBuffer::new(v)).collect(),
            layout: Layout::contiguous(&[n]),
        }
    }

    fn spans(&mut self) -> Vec<Span> {
        let layout = self.layout.clone();
        let len = layout.numel();
        self.buffers
            .iter_mut()
            .map(|b| Span {
                ptr: b.view(&layout).ptr,
                len,
            })
            .collect()
    }

    fn unchanged(&self, inputs: &[Vec<T>], what: &str) {
        for (b, want) in self.buffers.iter().zip(inputs) {
            assert_same(
                b.storage(what),
                want,
                &format!("{what}: a snapshot changed"),
            );
        }
    }
}

/// Runs `launch` (and its small-grid twin) into a fresh poisoned output of `len` elements each
/// time; returns the output.
fn run_into<T: Element>(len: usize, what: &str, plan: impl Fn(Span) -> Launch) -> Vec<T> {
    let mut results = Vec::new();
    for small in [false, true] {
        let mut out = HostBuffer::new(&vec![poison::<T>(); len]);
        let layout = Layout::contiguous(&[len]);
        let span = Span {
            ptr: out.view(&layout).ptr,
            len,
        };
        let launch = plan(span);
        run_launch(&if small { small_grid(&launch) } else { launch }, what);
        results.push(out.storage(what).to_vec());
    }
    let big = results.remove(0);
    assert_same(&results[0], &big, &format!("{what}: small grid"));
    big
}

fn tensor<T: Element>(v: &[T]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu).unwrap()
}

fn check_reductions<T: Element>(world: usize, n: usize, op: ReduceOp, seed: u64) {
    let dtype = T::DTYPE;
    // all_reduce: every rank reduces the whole snapshots.
    let inputs = contributions::<T>(world, n, seed);
    let want = on_threads(world, |k, pg| {
        let t = tensor(&inputs[k]);
        pg.all_reduce(&t, op).unwrap().wait().unwrap();
        t.to_vec::<T>().unwrap()
    });
    let mut sources = Sources::new(&inputs);
    let spans = sources.spans();
    let what = format!("all_reduce {dtype} {op}, {world} ranks × {n}");
    let got = run_into::<T>(n, &what, |out| {
        reduce_ranks_launch(dtype, out, &spans, n, 0, op).unwrap()
    });
    assert_same(&got, &want[0], &what);
    sources.unchanged(&inputs, &what);

    // reduce_scatter: rank k reduces block k.
    let inputs = contributions::<T>(world, n * world, seed + 100);
    let want = on_threads(world, |k, pg| {
        let out = Tensor::zeros(&[n], dtype, Device::Cpu).unwrap();
        pg.reduce_scatter(&tensor(&inputs[k]), &out, op)
            .unwrap()
            .wait()
            .unwrap();
        out.to_vec::<T>().unwrap()
    });
    let mut sources = Sources::new(&inputs);
    let spans = sources.spans();
    for (k, want) in want.iter().enumerate() {
        let what = format!("reduce_scatter {dtype} {op}, rank {k} of {world}, {n} per rank");
        let got = run_into::<T>(n, &what, |out| {
            reduce_ranks_launch(dtype, out, &spans, n * world, k * n, op).unwrap()
        });
        assert_same(&got, want, &what);
    }
    sources.unchanged(&inputs, "reduce_scatter");
}

fn check_gather<T: Element>(world: usize, n: usize, seed: u64) {
    let dtype = T::DTYPE;
    let inputs = contributions::<T>(world, n, seed);
    let want = on_threads(world, |k, pg| {
        let out = Tensor::zeros(&[n * world], dtype, Device::Cpu).unwrap();
        pg.all_gather(&tensor(&inputs[k]), &out)
            .unwrap()
            .wait()
            .unwrap();
        out.to_vec::<T>().unwrap()
    });
    let mut sources = Sources::new(&inputs);
    let spans = sources.spans();
    let what = format!("all_gather {dtype}, {world} ranks × {n}");
    let got = run_into::<T>(n * world, &what, |out| {
        gather_ranks_launch(dtype, out, &spans).unwrap()
    });
    assert_same(&got, &want[0], &what);
    assert_same(&got, &inputs.concat(), &format!("{what}: rank-major order"));
    sources.unchanged(&inputs, &what);
}

#[test]
fn reductions_match_the_cpu_backend_bit_for_bit_for_every_dtype_op_and_size() {
    let mut seed = 1;
    for dtype in FLOATS {
        for world in WORLDS {
            for n in SIZES {
                for op in OPS {
                    seed += 1;
                    with_element_type!(dtype, T => check_reductions::<T>(world, n, op, seed));
                }
            }
        }
    }
}

#[test]
fn gathers_match_the_cpu_backend_for_every_dtype_and_size() {
    let mut seed = 500;
    for dtype in DTYPES {
        for world in WORLDS {
            for n in SIZES {
                seed += 1;
                with_element_type!(dtype, T => check_gather::<T>(world, n, seed));
            }
        }
    }
}

#[test]
fn half_sums_accumulate_in_f32_over_ranks_and_round_once() {
    // 2048 + 1 + 1 in f16: rounding after each rank would give 2048; f32 accumulation gives
    // 2050, as the CPU backends compute.
    let inputs: Vec<Vec<half::f16>> = [2048.0f32, 1.0, 1.0]
        .iter()
        .map(|&x| vec![half::f16::from_f32(x)])
        .collect();
    let mut sources = Sources::new(&inputs);
    let spans = sources.spans();
    let got = run_into::<half::f16>(1, "f16 sum", |out| {
        reduce_ranks_launch(DType::F16, out, &spans, 1, 0, ReduceOp::Sum).unwrap()
    });
    assert_eq!(got[0].to_f32(), 2050.0);
    let avg = run_into::<half::f16>(1, "f16 avg", |out| {
        reduce_ranks_launch(DType::F16, out, &spans, 1, 0, ReduceOp::Avg).unwrap()
    });
    assert_eq!(avg[0].to_f32(), half::f16::from_f32(2050.0 / 3.0).to_f32());
    sources.unchanged(&inputs, "f16 sum");
}
