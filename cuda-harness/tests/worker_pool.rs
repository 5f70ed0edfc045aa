//! The emulation's worker pool under launches of changing sizes from several threads, with
//! workers made to dawdle between seeing a launch and reading it (`TANDEM_HOST_WORKER_DELAY_US`).
//!
//! A worker that sat out a small launch used to read the size of the next, larger one under the
//! small one's generation: it ran a thread of the larger launch twice, so the launch could return
//! while one of its threads still ran, and that thread then read the next launch's state (a
//! SIGSEGV in the elementwise tests about one run in ten on a 2-core machine, and a hang under a
//! debugger). Each kernel thread here counts its own runs: every count must be exactly 1 as soon
//! as the launch returns.
//!
//! This file holds one test so that the environment variable is set before the process's first
//! launch and nothing else runs beside it.

use tandem_core::cuda::launch::{KernelArg, KernelSource, Launch, LaunchConfig};
use tandem_cuda_harness::run;

static CHECKS: KernelSource = KernelSource {
    name: "emulator_checks",
    source: include_str!("../kernels/emulator_checks.cu"),
    headers: &[],
};

#[test]
fn launches_of_changing_sizes_from_several_threads_run_each_kernel_thread_exactly_once() {
    // Read once by the emulation, at the first launch; no launch has happened yet.
    std::env::set_var("TANDEM_HOST_WORKER_DELAY_US", "200");
    std::thread::scope(|scope| {
        for caller in 0..3u32 {
            scope.spawn(move || {
                for round in 0..150u32 {
                    let block = if (round + caller) % 2 == 0 { 1 } else { 96 };
                    let grid = 1 + round % 3;
                    let mut hits = vec![0u32; (grid * block) as usize];
                    let launch = Launch {
                        source: &CHECKS,
                        kernel: "count_each_thread".to_string(),
                        config: LaunchConfig::new(
                            "worker pool test",
                            [grid, 1, 1],
                            [block, 1, 1],
                            0,
                        )
                        .unwrap(),
                        args: vec![KernelArg::Out(hits.as_mut_ptr() as u64)],
                    };
                    // SAFETY: one slot per thread of the grid, alive until the launch returns.
                    unsafe { run(&launch) }.unwrap();
                    let wrong: Vec<(usize, u32)> = hits
                        .iter()
                        .copied()
                        .enumerate()
                        .filter(|&(_, h)| h != 1)
                        .take(5)
                        .collect();
                    assert!(
                        wrong.is_empty(),
                        "caller {caller} round {round} ({grid} x {block}): (thread, runs) {wrong:?}"
                    );
                }
            });
        }
    });
}
