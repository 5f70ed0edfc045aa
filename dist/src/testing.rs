//! The conformance suite every process-group backend must pass.
//!
//! [`conformance`] runs on every rank of a group at once. Each rank generates *every* rank's
//! inputs from a shared seed, so it can compute the expected result of each collective serially
//! in f64 without any communication, then compares its own output with it. It covers every
//! collective, every reduce op and every supported dtype, sizes that do not divide by the world
//! size, empty tensors, each broadcast root, several collectives in flight at once, and checks
//! that all ranks end with bit-identical reductions (by all-gathering the results). The same
//! function serves the threads backend, in-process TCP groups and real multi-process runs.

use half::{bf16, f16};
use tandem_core::{DType, Device, Element, Tensor};

use crate::{ProcessGroup, ReduceOp};

/// A small deterministic generator (SplitMix64), so every rank can regenerate every rank's data.
struct SplitMix(u64);

impl SplitMix {
    fn new(seed: u64, stream: u64) -> Self {
        SplitMix(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Values of rank `rank` for test case `case`: random in [-1, 1) for f32/f64, small integers
/// for the half types (so sums are exact and only averages round).
fn values(seed: u64, case: u64, rank: usize, n: usize, dtype: DType) -> Vec<f64> {
    let mut g = SplitMix::new(seed, case * 1_000 + rank as u64);
    (0..n)
        .map(|_| match dtype {
            DType::F16 | DType::BF16 => (g.next() % 9) as f64 - 4.0,
            _ => g.unit(),
        })
        .collect()
}

fn tensor_of(values: &[f64], dtype: DType) -> Result<Tensor, String> {
    fn make<T: Element>(v: &[f64]) -> tandem_core::Result<Tensor> {
        Tensor::from_vec(
            v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>(),
            &[v.len()],
            Device::Cpu,
        )
    }
    match dtype {
        DType::F32 => make::<f32>(values),
        DType::F64 => make::<f64>(values),
        DType::F16 => make::<f16>(values),
        DType::BF16 => make::<bf16>(values),
        DType::I64 => make::<i64>(values),
        DType::U8 => make::<u8>(values),
    }
    .map_err(|e| e.to_string())
}

/// The values as stored in `dtype` (what the ranks actually contribute).
fn stored(values: &[f64], dtype: DType) -> Result<Vec<f64>, String> {
    tensor_of(values, dtype)?
        .to_vec_f64()
        .map_err(|e| e.to_string())
}

fn tolerance(dtype: DType, world: usize, op: ReduceOp, expected: f64) -> f64 {
    match (dtype, op) {
        (_, ReduceOp::Max | ReduceOp::Min) => 0.0,
        (DType::F16 | DType::BF16, ReduceOp::Sum) => 0.0,
        (DType::F16, _) => expected.abs().max(1.0) * 1e-3,
        (DType::BF16, _) => expected.abs().max(1.0) * 8e-3,
        (DType::F64, _) => 1e-12 * world as f64,
        _ => 2e-6 * world as f64,
    }
}

fn reference(inputs: &[Vec<f64>], op: ReduceOp, i: usize) -> f64 {
    let mut acc = inputs[0][i];
    for x in &inputs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x[i],
            ReduceOp::Max => acc.max(x[i]),
            ReduceOp::Min => acc.min(x[i]),
        };
    }
    if op == ReduceOp::Avg {
        acc / inputs.len() as f64
    } else {
        acc
    }
}

fn compare(what: &str, got: &[f64], want: &[f64], tol: impl Fn(f64) -> f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).abs() > tol(*w) {
            return Err(format!("{what}: element {i} is {g}, expected {w}"));
        }
    }
    Ok(())
}

/// Checks that `t` holds the same bits on every rank, by all-gathering it.
fn check_identical(pg: &dyn ProcessGroup, what: &str, t: &Tensor) -> Result<(), String> {
    let world = pg.world_size();
    let gathered =
        Tensor::zeros(&[world * t.numel()], t.dtype(), Device::Cpu).map_err(|e| e.to_string())?;
    pg.all_gather(t, &gathered)
        .and_then(|w| w.wait())
        .map_err(|e| e.to_string())?;
    let bits = |v: Vec<f64>| v.into_iter().map(f64::to_bits).collect::<Vec<_>>();
    let all = bits(gathered.to_vec_f64().map_err(|e| e.to_string())?);
    let n = t.numel();
    for q in 1..world {
        if all[q * n..(q + 1) * n] != all[..n] {
            return Err(format!(
                "{what}: rank {q}'s result differs from rank 0's in some bits"
            ));
        }
    }
    Ok(())
}

/// Runs `f(group)` on one thread per rank, one group each, and returns the results in rank
/// order. A panicking rank panics the caller.
pub fn on_each_rank<G: Send, R: Send>(groups: Vec<G>, f: impl Fn(G) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Runs the suite on rank `pg.rank()`; every rank of the group must call it with the same
/// `seed` and `sizes` (element counts; include 0 and sizes that do not divide by the world size,
/// and one above the group's small-message threshold to exercise the large-message path).
/// Returns the first discrepancy.
pub fn conformance(pg: &dyn ProcessGroup, seed: u64, sizes: &[usize]) -> Result<(), String> {
    let mut case = 0u64;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for &n in sizes {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                check_reductions(pg, seed, &mut case, dtype, n, op)?;
            }
            check_gather_and_broadcast(pg, seed, &mut case, dtype, n)?;
        }
    }
    check_in_flight_order(pg, sizes.iter().copied().max().unwrap_or(0))?;
    check_bad_argument(pg)
}

/// Waits for `w` (the outcome of issuing a collective), as a message.
fn run(w: crate::Result<crate::Work>) -> Result<(), String> {
    w.and_then(|w| w.wait()).map_err(|e| e.to_string())
}

/// `all_reduce` and `reduce_scatter` of `n` elements of `dtype` with `op`, against the serial
/// reference; cases numbered from `case`.
fn check_reductions(
    pg: &dyn ProcessGroup,
    seed: u64,
    case: &mut u64,
    dtype: DType,
    n: usize,
    op: ReduceOp,
) -> Result<(), String> {
    let (rank, world) = (pg.rank(), pg.world_size());
    *case += 1;
    let what = format!("rank {rank}/{world}: all_reduce({dtype}, {n}, {op})");
    let inputs: Vec<Vec<f64>> = (0..world)
        .map(|q| stored(&values(seed, *case, q, n, dtype), dtype))
        .collect::<Result<_, _>>()?;
    let t = tensor_of(&inputs[rank], dtype)?;
    run(pg.all_reduce(&t, op))?;
    let want: Vec<f64> = (0..n).map(|i| reference(&inputs, op, i)).collect();
    compare(
        &what,
        &t.to_vec_f64().map_err(|e| e.to_string())?,
        &want,
        |w| tolerance(dtype, world, op, w),
    )?;
    check_identical(pg, &what, &t)?;

    *case += 1;
    let what = format!("rank {rank}/{world}: reduce_scatter({dtype}, {n} per rank, {op})");
    let inputs: Vec<Vec<f64>> = (0..world)
        .map(|q| stored(&values(seed, *case, q, n * world, dtype), dtype))
        .collect::<Result<_, _>>()?;
    let input = tensor_of(&inputs[rank], dtype)?;
    let before = input.to_vec_f64().map_err(|e| e.to_string())?;
    let output = Tensor::zeros(&[n], dtype, Device::Cpu).map_err(|e| e.to_string())?;
    run(pg.reduce_scatter(&input, &output, op))?;
    let want: Vec<f64> = (0..n)
        .map(|i| reference(&inputs, op, rank * n + i))
        .collect();
    compare(
        &what,
        &output.to_vec_f64().map_err(|e| e.to_string())?,
        &want,
        |w| tolerance(dtype, world, op, w),
    )?;
    if input.to_vec_f64().map_err(|e| e.to_string())? != before {
        return Err(format!("{what}: the input was modified"));
    }
    Ok(())
}

/// `all_gather` of `n` elements of `dtype`, and `broadcast` from every root.
fn check_gather_and_broadcast(
    pg: &dyn ProcessGroup,
    seed: u64,
    case: &mut u64,
    dtype: DType,
    n: usize,
) -> Result<(), String> {
    let (rank, world) = (pg.rank(), pg.world_size());
    *case += 1;
    let what = format!("rank {rank}/{world}: all_gather({dtype}, {n} per rank)");
    let inputs: Vec<Vec<f64>> = (0..world)
        .map(|q| stored(&values(seed, *case, q, n, dtype), dtype))
        .collect::<Result<_, _>>()?;
    let input = tensor_of(&inputs[rank], dtype)?;
    let output = Tensor::zeros(&[world * n], dtype, Device::Cpu).map_err(|e| e.to_string())?;
    run(pg.all_gather(&input, &output))?;
    compare(
        &what,
        &output.to_vec_f64().map_err(|e| e.to_string())?,
        &inputs.concat(),
        |_| 0.0,
    )?;

    for root in 0..world {
        *case += 1;
        let what = format!("rank {rank}/{world}: broadcast({dtype}, {n}, root {root})");
        let mine = stored(&values(seed, *case, rank, n, dtype), dtype)?;
        let t = tensor_of(&mine, dtype)?;
        run(pg.broadcast(&t, root))?;
        let want = stored(&values(seed, *case, root, n, dtype), dtype)?;
        compare(
            &what,
            &t.to_vec_f64().map_err(|e| e.to_string())?,
            &want,
            |_| 0.0,
        )?;
    }
    Ok(())
}

/// Several collectives (of `n` elements) in flight at once complete in issue order.
fn check_in_flight_order(pg: &dyn ProcessGroup, n: usize) -> Result<(), String> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let tensors: Vec<Tensor> = (0..4)
        .map(|k| tensor_of(&vec![(rank + k) as f64; n], DType::F32))
        .collect::<Result<_, _>>()?;
    let works: Vec<_> = tensors
        .iter()
        .map(|t| pg.all_reduce(t, ReduceOp::Sum))
        .collect::<crate::Result<_>>()
        .map_err(|e| e.to_string())?;
    let barrier = pg.barrier().map_err(|e| e.to_string())?;
    run(Ok(barrier.clone()))?;
    for (k, (t, w)) in tensors.iter().zip(&works).enumerate() {
        if !w.is_completed() {
            return Err(format!(
                "rank {rank}: all_reduce #{} was not complete when a later barrier was",
                w.sequence_number()
            ));
        }
        w.wait().map_err(|e| e.to_string())?;
        let want = (0..world).map(|q| (q + k) as f64).sum::<f64>();
        compare(
            &format!("rank {rank}: in-flight all_reduce {k}"),
            &t.to_vec_f64().map_err(|e| e.to_string())?,
            &vec![want; n],
            |_| 0.0,
        )?;
    }
    Ok(())
}

/// A bad argument is refused on the spot and does not disturb the sequence.
fn check_bad_argument(pg: &dyn ProcessGroup) -> Result<(), String> {
    let rank = pg.rank();
    let square = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu).map_err(|e| e.to_string())?;
    let transposed = square
        .view_detached(
            square
                .layout()
                .transpose("t", 0, 1)
                .map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
    match pg.all_reduce(&transposed, ReduceOp::Sum) {
        Err(e) if e.to_string().contains("contiguous") => {}
        other => {
            return Err(format!(
                "rank {rank}: all_reduce of a non-contiguous tensor gave {other:?}"
            ))
        }
    }
    run(pg.barrier())
}
