//! Checks of the host emulation itself, with the kernels in `kernels/emulator_checks.cu`:
//! reductions through shared memory, barriers and warp shuffles, atomics, votes, dynamic shared
//! memory and multi-dimensional indices against known results, and the faults it must report
//! for kernels that break the rules.

use std::time::{Duration, Instant};

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};
use tandem_cuda_harness::{run, run_with_timeout};

static CHECKS: KernelSource = KernelSource {
    name: "emulator_checks",
    source: include_str!("../kernels/emulator_checks.cu"),
    headers: &[],
};

fn launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    args: Vec<KernelArg>,
) -> Launch {
    Launch {
        source: &CHECKS,
        kernel: kernel.to_string(),
        config: LaunchConfig::new("emulator test", grid, block, shared).unwrap(),
        args,
    }
}

/// A buffer the kernel only reads (`const T*`).
fn input<T>(data: &[T]) -> KernelArg {
    KernelArg::In(data.as_ptr() as u64)
}

/// A buffer the kernel writes (`T*`).
fn output<T>(data: &mut [T]) -> KernelArg {
    KernelArg::Out(data.as_mut_ptr() as u64)
}

#[test]
fn shared_memory_tree_reduction_with_barriers_and_shuffles_sums_every_block() {
    // 1000 elements over 3 blocks of 128 threads: the grid-stride loop wraps around.
    let x: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
    let mut sums = vec![f32::NAN; 3];
    let l = launch(
        "block_sum_tree_f32",
        [3, 1, 1],
        [128, 1, 1],
        0,
        vec![input(&x), KernelArg::U64(1000), output(&mut sums)],
    );
    // SAFETY: the pointers cover what the kernel touches (1000 inputs, 3 sums).
    unsafe { run(&l) }.unwrap();
    // Thread t of block b sums x[b*128 + t + k*384]; integers, so exact.
    for (b, &got) in sums.iter().enumerate() {
        let want: f32 = (0..1000)
            .filter(|i| (i % 384) / 128 == b)
            .map(|i| (i % 7) as f32)
            .sum();
        assert_eq!(got, want, "block {b}");
    }
    assert_eq!(sums.iter().sum::<f32>(), x.iter().sum::<f32>());
}

#[test]
fn block_reduce_helper_gives_sum_and_max_with_nan_winning() {
    let n = 777;
    let mut x: Vec<f64> = (0..n).map(|i| ((i * 37) % 101) as f64 - 50.0).collect();
    let mut out = vec![f64::NAN; 4];
    let run_it = |x: &mut [f64], out: &mut [f64]| {
        let l = launch(
            "block_reduce_f64",
            [2, 1, 1],
            [64, 1, 1],
            0,
            vec![input(x), KernelArg::U64(n as u64), output(out)],
        );
        // SAFETY: n inputs, 2 blocks × 2 outputs.
        unsafe { run(&l) }.unwrap();
    };
    run_it(&mut x, &mut out);
    for b in 0..2 {
        let share: Vec<f64> = (0..n)
            .filter(|i| (i % 128) / 64 == b)
            .map(|i| x[i])
            .collect();
        assert_eq!(out[b], share.iter().sum::<f64>());
        assert_eq!(out[2 + b], share.iter().cloned().fold(f64::MIN, f64::max));
    }
    x[500] = f64::NAN; // 500 % 128 = 116: block 1
    run_it(&mut x, &mut out);
    assert!(out[3].is_nan() && !out[2].is_nan(), "{out:?}");
}

#[test]
fn atomics_count_every_element_exactly() {
    let n = 3000u64;
    let (mut count, mut wide, mut fsum, mut dsum) =
        (vec![0i32], vec![0u64], vec![0f32], vec![0f64]);
    let l = launch(
        "atomic_counts",
        [4, 1, 1],
        [256, 1, 1],
        0,
        vec![
            KernelArg::U64(n),
            output(&mut count),
            output(&mut wide),
            output(&mut fsum),
            output(&mut dsum),
        ],
    );
    // SAFETY: one element per counter.
    unsafe { run(&l) }.unwrap();
    assert_eq!(
        (count[0], wide[0], fsum[0], dsum[0]),
        (3000, 3000, 3000.0, 1500.0)
    );
}

#[test]
fn atomic_max_min_cas_and_exchange_agree_with_a_serial_run() {
    let n = 513u64;
    let x: Vec<i32> = (0..n as i32).map(|i| (i * 7919) % 1009 - 500).collect();
    let (mut max, mut min, mut winner, mut last) = (
        vec![i32::MIN],
        vec![i32::MAX],
        vec![u32::MAX],
        vec![i32::MIN],
    );
    let l = launch(
        "atomic_extremes",
        [2, 1, 1],
        [128, 1, 1],
        0,
        vec![
            input(&x),
            KernelArg::U64(n),
            output(&mut max),
            output(&mut min),
            output(&mut winner),
            output(&mut last),
        ],
    );
    // SAFETY: n inputs, one element per result.
    unsafe { run(&l) }.unwrap();
    assert_eq!(max[0], *x.iter().max().unwrap());
    assert_eq!(min[0], *x.iter().min().unwrap());
    assert!(
        (winner[0] as u64) < n,
        "exactly one compare-and-swap won: {}",
        winner[0]
    );
    assert!(x.contains(&last[0]));
}

#[test]
fn warp_shuffles_and_votes_follow_cuda_semantics() {
    let threads = 64usize;
    let mut out = vec![i32::MIN; 9 * threads];
    let l = launch(
        "warp_intrinsics",
        [1, 1, 1],
        [threads as u32, 1, 1],
        0,
        vec![output(&mut out)],
    );
    // SAFETY: nine results per thread.
    unsafe { run(&l) }.unwrap();
    for t in 0..threads {
        let lane = (t % 32) as i32;
        let want = [
            30,
            if lane >= 1 { (lane - 1) * 10 } else { 0 },
            if lane + 2 < 32 {
                (lane + 2) * 10
            } else {
                lane * 10
            },
            (lane ^ 1) * 10,
            0x5555_5555,
            1,
            1,
            0,
            ((lane & !7) + 1) * 10,
        ];
        assert_eq!(out[9 * t..9 * t + 9], want, "thread {t}");
    }
}

#[test]
fn dynamic_shared_memory_reverses_each_chunk() {
    let n = 100usize;
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut out = vec![f32::NAN; n];
    let block = 32u32;
    let l = launch(
        "reverse_chunks",
        [n.div_ceil(32) as u32, 1, 1],
        [block, 1, 1],
        block * 4,
        vec![input(&data), output(&mut out), KernelArg::U64(n as u64)],
    );
    // SAFETY: n inputs and outputs; the kernel checks bounds.
    unsafe { run(&l) }.unwrap();
    let want: Vec<f32> = data
        .chunks(32)
        .flat_map(|c| c.iter().rev().copied())
        .collect();
    assert_eq!(out, want);
}

#[test]
fn three_dimensional_blocks_and_grids_get_cuda_indices() {
    let (block, grid) = ([4u32, 2, 2], [2u32, 3, 2]);
    let threads = 16usize;
    let mut out = vec![u32::MAX; threads * 12];
    let l = launch("indices_3d", grid, block, 0, vec![output(&mut out)]);
    // SAFETY: one element per thread of the grid.
    unsafe { run(&l) }.unwrap();
    let mut k = 0;
    for bz in 0..2 {
        for by in 0..3 {
            for bx in 0..2 {
                for tz in 0..2 {
                    for ty in 0..2 {
                        for tx in 0..4 {
                            let want = tx | ty << 4 | tz << 8 | bx << 12 | by << 16 | bz << 20;
                            assert_eq!(out[k], want, "element {k}");
                            k += 1;
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_barrier_after_an_early_return_is_reported() {
    let mut out = vec![0i32; 64];
    let l = launch(
        "broken_early_return",
        [1, 1, 1],
        [64, 1, 1],
        0,
        vec![output(&mut out)],
    );
    // SAFETY: one element per thread.
    let err = unsafe { run(&l) }.unwrap_err().to_string();
    assert!(
        err.contains("__syncthreads()") && err.contains("returned"),
        "{err}"
    );
}

#[test]
fn threads_stuck_at_different_barriers_are_reported_not_hung() {
    let mut out = vec![0i32; 64];
    let l = launch(
        "broken_mismatched_barriers",
        [1, 1, 1],
        [64, 1, 1],
        0,
        vec![output(&mut out)],
    );
    let start = Instant::now();
    // SAFETY: one element per thread.
    let err = unsafe { run_with_timeout(&l, Duration::from_millis(300)) }
        .unwrap_err()
        .to_string();
    assert!(err.contains("stuck at different barriers"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_shuffle_over_part_of_a_warp_is_reported() {
    let mut out = vec![0i32; 32];
    let l = launch(
        "broken_partial_mask",
        [1, 1, 1],
        [32, 1, 1],
        0,
        vec![output(&mut out)],
    );
    // SAFETY: one element per thread.
    let err = unsafe { run(&l) }.unwrap_err().to_string();
    assert!(err.contains("mask 0xffff"), "{err}");
}

#[test]
fn a_kernel_without_a_host_entry_is_a_clear_error() {
    let l = launch("no_such_kernel", [1, 1, 1], [32, 1, 1], 0, vec![]);
    // SAFETY: the kernel does not exist, nothing runs.
    let err = unsafe { run(&l) }.unwrap_err().to_string();
    assert!(
        err.contains("tandem_host_no_such_kernel") && err.contains("TANDEM_HOST_EXPORT"),
        "{err}"
    );
}

/// `block_sum_tree_f32(const float* x, tandem_u64 n, float* block_sums)` with `args`: the
/// harness's error, after checking that the kernel did not run (`block_sums` untouched).
fn declaration_error(args: impl FnOnce(&[f32], &mut [f32]) -> Vec<KernelArg>) -> String {
    let x = vec![1.0f32; 64];
    let mut sums = vec![f32::NAN; 1];
    let l = launch(
        "block_sum_tree_f32",
        [1, 1, 1],
        [32, 1, 1],
        0,
        args(&x, &mut sums),
    );
    // SAFETY: the arguments are refused before the kernel runs; were they not, the pointers
    // still cover 64 inputs and one sum.
    let err = unsafe { run(&l) }.unwrap_err().to_string();
    assert!(sums[0].is_nan(), "the kernel ran despite: {err}");
    err
}

#[test]
fn a_written_pointer_declared_in_is_refused_before_the_kernel_runs() {
    let err = declaration_error(|x, sums| {
        vec![
            input(x),
            KernelArg::U64(64),
            KernelArg::In(sums.as_ptr() as u64),
        ]
    });
    assert!(
        err.contains("block_sum_tree_f32")
            && err.contains("argument 2")
            && err.contains("declared In")
            && err.contains("pointer to non-const"),
        "{err}"
    );
}

#[test]
fn a_const_pointer_declared_out_is_refused() {
    let err = declaration_error(|x, sums| {
        vec![
            KernelArg::Out(x.as_ptr() as u64),
            KernelArg::U64(64),
            output(sums),
        ]
    });
    assert!(
        err.contains("block_sum_tree_f32")
            && err.contains("argument 0")
            && err.contains("declared Out")
            && err.contains("pointer to const"),
        "{err}"
    );
}

#[test]
fn values_pointers_counts_and_sizes_must_match_the_parameters() {
    // A device pointer passed as a plain integer: undeclared.
    let err = declaration_error(|x, sums| {
        vec![
            KernelArg::U64(x.as_ptr() as u64),
            KernelArg::U64(64),
            output(sums),
        ]
    });
    assert!(
        err.contains("argument 0") && err.contains("declare the device pointer as In or Out"),
        "{err}"
    );
    // A pointer where the kernel takes a value.
    let err = declaration_error(|x, sums| vec![input(x), input(x), output(sums)]);
    assert!(
        err.contains("argument 1") && err.contains("is a value"),
        "{err}"
    );
    // A value of the wrong size.
    let err = declaration_error(|x, sums| vec![input(x), KernelArg::U32(64), output(sums)]);
    assert!(
        err.contains("argument 1") && err.contains("4 bytes") && err.contains("8 bytes"),
        "{err}"
    );
    // An argument missing.
    let err = declaration_error(|x, _| vec![input(x), KernelArg::U64(64)]);
    assert!(
        err.contains("takes 3 parameters") && err.contains("passes 2 arguments"),
        "{err}"
    );
}

#[test]
fn clock64_counts_cycles_of_a_2_ghz_clock() {
    // 2 ms of the emulated clock.
    const CYCLES: i64 = 4_000_000;
    let mut out = vec![-1i64; 3];
    let l = launch(
        "clock_spin",
        [1, 1, 1],
        [1, 1, 1],
        0,
        vec![KernelArg::I64(CYCLES), output(&mut out)],
    );
    let started = Instant::now();
    // SAFETY: three outputs.
    unsafe { run(&l) }.unwrap();
    let wall = started.elapsed();
    let counted = out[1] - out[0];
    assert!(out[0] > 0 && counted >= CYCLES, "{out:?}");
    // The cycles counted fit in the time the launch took, at 2 GHz: the unit is a 2 GHz cycle
    // (not a nanosecond, which would take twice as long).
    assert!(
        counted as f64 / 2e9 <= wall.as_secs_f64(),
        "{counted} cycles in {wall:?}"
    );
    assert!(wall >= Duration::from_millis(2), "{wall:?}");
    // clock() is the low 32 bits of the counter.
    assert!((0..1i64 << 32).contains(&out[2]), "{out:?}");
}

#[test]
fn launches_of_different_kernels_from_two_threads_run_at_the_same_time() {
    // One launch spins (for at most ~5 s) until the other, from another thread, raises its flag.
    let mut flag = vec![0i32; 1];
    let mut seen = vec![-1i32; 1];
    let flag_ptr = flag.as_mut_ptr() as u64;
    let waiter = launch(
        "wait_for_flag",
        [1, 1, 1],
        [1, 1, 1],
        0,
        vec![
            KernelArg::In(flag_ptr),
            KernelArg::I64(10_000_000_000),
            output(&mut seen),
        ],
    );
    let raiser = launch(
        "raise_flag",
        [1, 1, 1],
        [64, 1, 1],
        0,
        vec![KernelArg::Out(flag_ptr)],
    );
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| {
            // SAFETY: the flag and the output outlive the scope.
            unsafe { run(&waiter) }.unwrap()
        });
        // Give the waiter a head start, so that it is spinning when the flag is raised (if it is
        // not, the test passes without proving anything, never fails wrongly).
        std::thread::sleep(Duration::from_millis(50));
        // SAFETY: as above.
        unsafe { run(&raiser) }.unwrap();
        waiting.join().unwrap();
    });
    assert_eq!(
        seen[0], 1,
        "the spinning launch gave up: the other thread's launch did not run beside it"
    );
    assert_eq!(flag[0], 1);
}

#[test]
fn shared_storage_of_a_device_function_used_by_two_running_launches_is_reported() {
    // Two kernels calling one `__device__` function that declares `__shared__` storage (one
    // static copy on the host): the second, started while the first holds the storage, fails
    // naming the declaration instead of racing with the first.
    let mut started = vec![0i32; 2];
    let mut release = vec![0i32; 2];
    let mut out = vec![-1i32; 2];
    let (started_ptr, release_ptr, out_ptr) = (
        started.as_mut_ptr() as u64,
        release.as_mut_ptr() as u64,
        out.as_mut_ptr() as u64,
    );
    let user = |kernel: &str, i: u64| {
        launch(
            kernel,
            [1, 1, 1],
            [32, 1, 1],
            0,
            vec![
                KernelArg::Out(started_ptr + 4 * i),
                KernelArg::In(release_ptr + 4 * i),
                KernelArg::I64(10_000_000_000),
                KernelArg::Out(out_ptr + 4 * i),
            ],
        )
    };
    let (first, second) = (
        user("shared_scratch_first", 0),
        user("shared_scratch_second", 1),
    );
    // The second launch is not held up.
    release[1] = 1;
    let second_result = std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            // SAFETY: the flags and outputs outlive the scope.
            unsafe { run(&first) }
        });
        // Wait (at most ~5 s) until the first holds the storage.
        let deadline = Instant::now() + Duration::from_secs(5);
        // SAFETY: the kernel writes the flag atomically; read it as the atomic it is.
        let flag = unsafe { &*(started_ptr as *const std::sync::atomic::AtomicI32) };
        while flag.load(std::sync::atomic::Ordering::Acquire) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: as above.
        let second_result = unsafe { run(&second) };
        // SAFETY: the first kernel polls this flag through a volatile read.
        unsafe { (release_ptr as *mut i32).write_volatile(1) };
        running.join().unwrap().unwrap();
        second_result
    });
    let err = second_result.unwrap_err().to_string();
    assert!(
        err.contains("__shared__ variable declared at") && err.contains("another launch"),
        "{err}"
    );
    assert_eq!(out[0], 1, "the first launch's scratch was overwritten");
}
