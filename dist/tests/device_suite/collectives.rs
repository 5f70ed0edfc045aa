//! Every collective of a device group, every reduce op and dtype, against the threads backend
//! (the CPU reference) on the same inputs: results must agree bit for bit (NaN for NaN), and
//! every rank's reduction must equal every other's. Inputs start with the hard values of each
//! dtype (signed zeros, infinities, NaN, the f16 overflow threshold, subnormals); sizes are
//! empty, tiny, odd and several blocks long.

use std::sync::Arc;

use tandem_core::{DType, Device, Generator, Tensor};
use tandem_dist::{DistError, ProcessGroup, ReduceOp, ThreadProcessGroup, Work};

use super::on_device_ranks;

pub const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];
pub const SIZES: [usize; 5] = [0, 1, 5, 1001, 20_003];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const ALL: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// Rank `rank`'s input for case `case`: hard values first (rotated per rank), then random ones.
fn input(case: u64, rank: usize, n: usize, dtype: DType) -> Tensor {
    const SPECIAL: [f64; 12] = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        65504.0,
        65520.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1e-8,
        3e38,
        -1e-40,
    ];
    let mut g = Generator::new(case * 1_000 + rank as u64);
    let random = Tensor::randn(&[n], 0.0, 100.0, DType::F64, Device::Cpu, &mut g)
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    let values: Vec<f64> = random
        .into_iter()
        .enumerate()
        .map(|(i, r)| match dtype {
            DType::I64 => (r * 1e6).round(),
            DType::U8 => r.abs().min(255.0),
            _ if i < SPECIAL.len() => SPECIAL[(i + 5 * rank) % SPECIAL.len()],
            _ => r,
        })
        .collect();
    Tensor::from_vec(values, &[n], Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The elements' bit patterns (every NaN as one value), for exact comparisons.
fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::I64 => t
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|v| v as u64)
            .collect(),
        DType::U8 => t
            .to_vec::<u8>()
            .unwrap()
            .into_iter()
            .map(u64::from)
            .collect(),
        _ => t
            .to_vec_f64()
            .unwrap()
            .into_iter()
            .map(|v| if v.is_nan() { u64::MAX } else { v.to_bits() })
            .collect(),
    }
}

/// One collective's result on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub what: String,
    pub bits: Vec<u64>,
}

/// Runs the whole sequence of collectives on `group` (inputs made on the CPU and moved to
/// `device`), waiting for each, and returns every result in order.
fn sequence(group: &dyn ProcessGroup, device: Device) -> Vec<Outcome> {
    let (rank, world) = (group.rank(), group.world_size());
    let mut out = Vec::new();
    let mut case = 0u64;
    let run = |w: tandem_dist::Result<Work>, what: &str| {
        w.and_then(|w| w.wait())
            .unwrap_or_else(|e| panic!("{device} rank {rank} of {world}: {what}: {e}"))
    };
    let on = |t: Tensor| t.to_device(device).unwrap();
    for dtype in FLOATS {
        for n in SIZES {
            for op in OPS {
                case += 1;
                let what = format!("all_reduce({dtype}, {n}, {op})");
                let t = on(input(case, rank, n, dtype));
                run(group.all_reduce(&t, op), &what);
                out.push(Outcome {
                    what,
                    bits: bits(&t),
                });

                case += 1;
                let what = format!("reduce_scatter({dtype}, {n} per rank, {op})");
                let t = on(input(case, rank, n * world, dtype));
                let before = bits(&t);
                let o = on(Tensor::zeros(&[n], dtype, Device::Cpu).unwrap());
                run(group.reduce_scatter(&t, &o, op), &what);
                assert_eq!(
                    bits(&t),
                    before,
                    "{device} rank {rank}: {what} changed its input"
                );
                out.push(Outcome {
                    what,
                    bits: bits(&o),
                });
            }
        }
    }
    for dtype in ALL {
        for n in SIZES {
            case += 1;
            let what = format!("all_gather({dtype}, {n} per rank)");
            let t = on(input(case, rank, n, dtype));
            let o = on(Tensor::zeros(&[n * world], dtype, Device::Cpu).unwrap());
            run(group.all_gather(&t, &o), &what);
            out.push(Outcome {
                what,
                bits: bits(&o),
            });
            for root in 0..world {
                case += 1;
                let what = format!("broadcast({dtype}, {n}, root {root})");
                let t = on(input(case, rank, n, dtype));
                run(group.broadcast(&t, root), &what);
                out.push(Outcome {
                    what,
                    bits: bits(&t),
                });
            }
        }
    }
    run(group.barrier(), "barrier");
    out
}

/// Runs `f(rank, group)` on every rank of a threads group (the CPU reference).
fn on_thread_ranks<T: Send>(
    world: usize,
    f: impl Fn(usize, &dyn ProcessGroup) -> T + Sync,
) -> Vec<T> {
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

/// Every collective on 1, 2, 3, 4 and 8 ranks of a device group equals the threads backend's
/// result on the same inputs, bit for bit, on every rank.
pub fn every_collective_matches_the_cpu_backend_bit_for_bit(device: Device) {
    for world in WORLDS {
        let want = on_thread_ranks(world, |_, g| sequence(g, Device::Cpu));
        let got = on_device_ranks(device, world, |_, g| sequence(g.as_ref(), device));
        for rank in 0..world {
            assert_eq!(got[rank].len(), want[rank].len());
            for (g, w) in got[rank].iter().zip(&want[rank]) {
                assert_eq!(g.what, w.what);
                if g.bits != w.bits {
                    let at = g.bits.iter().zip(&w.bits).position(|(a, b)| a != b);
                    panic!(
                        "{device}, {world} ranks, rank {rank}: {} differs from the threads \
                         backend: {} vs {} elements, first difference at element {at:?} \
                         (device bits {:?}, CPU bits {:?})",
                        g.what,
                        g.bits.len(),
                        w.bits.len(),
                        at.map(|i| g.bits[i]),
                        at.map(|i| w.bits[i]),
                    );
                }
            }
        }
        // Reductions are identical on every rank.
        for rank in 1..world {
            for (g, r0) in got[rank].iter().zip(&got[0]) {
                if g.what.starts_with("all_reduce") || g.what.starts_with("broadcast") {
                    assert_eq!(
                        g.bits, r0.bits,
                        "{device}, {world} ranks: rank {rank}'s {} differs from rank 0's",
                        g.what
                    );
                }
            }
        }
    }
}

/// Collectives issued back to back without waiting complete in issue order, and a barrier
/// issued after them completes after all of them.
pub fn collectives_in_flight_complete_in_issue_order(device: Device) {
    let world = 4;
    on_device_ranks(device, world, |rank, g| {
        let tensors: Vec<Tensor> = (0..6)
            .map(|k| {
                Tensor::full(&[4097], (rank + k) as f64, DType::F32, Device::Cpu)
                    .unwrap()
                    .to_device(device)
                    .unwrap()
            })
            .collect();
        let works: Vec<Work> = tensors
            .iter()
            .map(|t| g.all_reduce(t, ReduceOp::Sum).unwrap())
            .collect();
        let barrier = g.barrier().unwrap();
        barrier.wait().unwrap();
        for (k, (t, w)) in tensors.iter().zip(&works).enumerate() {
            assert!(
                w.is_completed(),
                "{device} rank {rank}: all_reduce #{} not complete when the later barrier was",
                w.sequence_number()
            );
            w.wait().unwrap();
            let want = (0..world).map(|q| (q + k) as f32).sum::<f32>();
            let got = t.to_vec::<f32>().unwrap();
            assert!(
                got.iter().all(|&v| v == want),
                "{device} rank {rank}: in-flight all_reduce {k}: {} instead of {want}",
                got[0]
            );
        }
        let seqs: Vec<u64> = works.iter().map(Work::sequence_number).collect();
        assert_eq!(seqs, (1..=6).collect::<Vec<_>>(), "{device} rank {rank}");
        assert_eq!(barrier.sequence_number(), 7);
    });
}

/// Ranks issuing different collectives under one sequence number both get an error naming the
/// two collectives and the two ranks, and the group refuses later collectives.
pub fn mismatched_collectives_are_named_and_break_the_group(device: Device) {
    let errors = on_device_ranks(device, 2, |rank, g| {
        let t = Tensor::zeros(&[100], DType::F32, device).unwrap();
        g.barrier().unwrap().wait().unwrap();
        let work = if rank == 0 {
            g.broadcast(&t, 0).unwrap()
        } else {
            g.all_reduce(&t, ReduceOp::Sum).unwrap()
        };
        let err = work.wait().unwrap_err();
        let later = g.barrier().unwrap().wait().unwrap_err();
        (err, later)
    });
    for (rank, (err, later)) in errors.iter().enumerate() {
        let msg = err.to_string();
        assert!(
            msg.contains("collective #2")
                && msg.contains("broadcast(f32, 100, root 0)")
                && msg.contains("all_reduce(f32, 100, sum)"),
            "{device} rank {rank}: {msg}"
        );
        assert_eq!(
            err.blamed_ranks(),
            vec![1 - rank],
            "{device} rank {rank}: {msg}"
        );
        assert!(
            matches!(later, DistError::GroupBroken { .. }),
            "{device} rank {rank}: {later}"
        );
    }
}

/// A dropped rank makes the others fail naming it, promptly.
pub fn a_dropped_rank_is_named(device: Device) {
    let mut groups = tandem_dist::DeviceThreadGroup::new_group(device, 3).unwrap();
    drop(groups.pop());
    let started = std::time::Instant::now();
    let errors: Vec<DistError> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let g: Arc<dyn ProcessGroup> = Arc::new(g);
                    let t = Tensor::ones(&[8], DType::F32, device).unwrap();
                    g.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap_err()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    for err in errors {
        assert_eq!(err.blamed_ranks(), vec![2], "{device}: {err}");
        assert!(
            err.to_string().contains("rank 2 left the group"),
            "{device}: {err}"
        );
    }
}

/// A device group also reduces CPU tensors (through host copies; complete when the call
/// returns), and two ranks that issue the same collective on different devices are told so.
pub fn cpu_tensors_work_and_mixed_placements_are_named(device: Device) {
    let results = on_device_ranks(device, 2, |rank, g| {
        let t = Tensor::full(&[7], rank as f64 + 1.0, DType::F64, Device::Cpu).unwrap();
        g.all_reduce(&t, ReduceOp::Sum).unwrap().wait().unwrap();
        let sum = t.to_vec::<f64>().unwrap();
        // Same collective, different devices (on a CPU group both are CPU tensors).
        let place = if rank == 0 { Device::Cpu } else { device };
        let u = Tensor::ones(&[3], DType::F32, place).unwrap();
        let mixed = g.all_reduce(&u, ReduceOp::Sum).unwrap().wait();
        (sum, mixed.map_err(|e| e.to_string()))
    });
    for (rank, (sum, mixed)) in results.iter().enumerate() {
        assert_eq!(sum, &vec![3.0; 7], "{device} rank {rank}: CPU all_reduce");
        if device == Device::Cpu {
            mixed
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        } else {
            let err = mixed.as_ref().unwrap_err();
            assert!(
                err.contains("on cpu") && err.contains(&format!("on {device}")),
                "{device} rank {rank}: {err}"
            );
        }
    }
}

/// Issuing a collective never waits for the device: with the device's compute stream held by a
/// [`Gate`](super::gate::Gate), every rank's `all_reduce` returns, its work stays pending (the
/// comm stream is ordered after the held compute stream), and once the last rank has issued and
/// the stream is released the work completes with the right sum. CUDA devices only (a CPU stream
/// cannot be held). Nothing here can hang: the gate opens by itself after
/// [`GATE_LIMIT`](super::gate::GATE_LIMIT) and every wait is bounded by the group's timeout.
pub fn issuing_does_not_wait_for_the_device(device: Device) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    assert!(
        matches!(device, Device::Cuda(_)),
        "{device}: only a CUDA stream can be held"
    );
    let world = 2;
    // Inputs are made (and their copies finished) before the stream is held.
    let inputs: Vec<Tensor> = (0..world)
        .map(|rank| {
            Tensor::full(&[10_007], rank as f64 + 1.0, DType::F32, Device::Cpu)
                .and_then(|t| t.to_device(device))
                .unwrap_or_else(|e| panic!("{device}: input of rank {rank}: {e}"))
        })
        .collect();
    let compute = tandem_core::Stream::compute(device).unwrap();
    compute.synchronize().unwrap();
    let gate = Mutex::new(Some(super::gate::Gate::hold(&compute)));
    let issued = AtomicUsize::new(0);
    let seen = on_device_ranks(device, world, |rank, g| {
        let started = Instant::now();
        let work = g.all_reduce(&inputs[rank], ReduceOp::Sum);
        let took = started.elapsed();
        let pending = work
            .as_ref()
            .map(|w| !w.is_completed())
            .map_err(Clone::clone);
        let held = gate
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|gate| !gate.opened());
        if issued.fetch_add(1, Ordering::SeqCst) + 1 == world {
            // Every rank has issued: let the device go on.
            drop(gate.lock().unwrap().take());
        }
        let result = work.and_then(|w| w.wait()).map(|()| {
            let got = inputs[rank].to_vec::<f32>().unwrap();
            got.iter().find(|&&v| v != 3.0).copied()
        });
        (took, pending, held, result)
    });
    for (rank, (took, pending, held, result)) in seen.into_iter().enumerate() {
        let pending =
            pending.unwrap_or_else(|e| panic!("{device} rank {rank}: issuing all_reduce: {e}"));
        assert!(
            held,
            "{device} rank {rank}: the gate was open when all_reduce returned (after {took:?}); \
             the test proves nothing"
        );
        assert!(
            pending,
            "{device} rank {rank}: all_reduce completed while the compute stream it is ordered \
             after was held"
        );
        assert!(
            took < Duration::from_secs(5),
            "{device} rank {rank}: issuing all_reduce took {took:?}: it waited for the device"
        );
        let wrong = result
            .unwrap_or_else(|e| panic!("{device} rank {rank}: all_reduce after release: {e}"));
        assert_eq!(
            wrong, None,
            "{device} rank {rank}: all_reduce of 1.0 (rank 0) and 2.0 (rank 1) must give 3.0"
        );
    }
}
