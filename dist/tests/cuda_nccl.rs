//! The NCCL backend on a real GPU: every collective, reduce op and dtype against a reference
//! computed on the CPU, in a world of 1 (in this process) and with 2 real processes sharing one
//! GPU; stream ordering (`Work::wait` does not block the host, `wait_host` and a barrier's
//! `wait` do); and failures — a killed rank, a stopped rank, a rank that never issues a
//! collective, mismatched collectives — that must fail the other rank within 10 s, naming the
//! culprit, instead of hanging.
//!
//! **Two ranks on one GPU (test-only arrangement).** NCCL up to 2.29 refuses two ranks of a
//! communicator on one GPU ("Duplicate GPU detected"). Each rank process here gets its own
//! `NCCL_HOSTID`, so NCCL takes them for two hosts and connects them through sockets (on
//! loopback: `NCCL_SOCKET_IFNAME=lo`, `NCCL_IB_DISABLE=1`), and `LOCAL_RANK=0`,
//! `LOCAL_WORLD_SIZE=1`, as one rank per "host" would have. Slow and unsupported for training;
//! good enough to check correctness and failure handling with one GPU.
//!
//! **On the CUDA emulator** (no GPU; `tandem-test-support` chooses) every test runs, with the
//! stream sanitizer on, against the emulated NCCL (`cuda-emu/nccl`, copied as `libnccl.so.2`
//! into the emulator's folder, which comes first in `TANDEM_CUDA_LIBS`, so it is found before
//! the real NCCL CI installs for `tests/nccl_id.rs`). The rank processes inherit that
//! `TANDEM_CUDA_LIBS` and `TANDEM_CUDA_SANITIZER` from the test, which `select_cuda` set before
//! starting them. The emulated NCCL's collectives run on the comm stream's worker and block it
//! until the peer arrives, so the stream ordering and the failure paths (a killed, stopped or
//! silent rank left pending until tandem's watchdog aborts the communicator) run as on a GPU;
//! the `NCCL_*` variables below are ignored there. The compute work that keeps the stream busy
//! in `a_world_of_1_wait_orders_…` is smaller on the emulator.
//!
//! On a GPU, each test prints `skipped: NCCL not found (…)` where NCCL cannot be loaded (put the
//! folder of `libnccl.so.2`, e.g. `<site-packages>/nvidia/nccl/lib`, in `TANDEM_CUDA_LIBS`);
//! `TANDEM_REQUIRE_NCCL=1` makes that a failure, so that a GPU run cannot pass by skipping.
//! Tests take a lock so that they use the GPU one at a time (timings are asserted).

mod common;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::Job;
use tandem_core::{DType, Device, Tensor};
use tandem_dist::process_group::nccl;
use tandem_dist::{
    init_with_options, GroupConfig, InitOptions, LaunchEnv, NcclConfig, NcclProcessGroup,
    ProcessGroup, ReduceOp, StoreServer, TcpStore,
};

const GPU: Device = Device::Cuda(0);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// `None` (after printing why) when there is no GPU or no NCCL; else the GPU lock. Under
/// `TANDEM_REQUIRE_NCCL=1` a GPU without NCCL fails instead, naming what to install.
fn gpu() -> Option<MutexGuard<'static, ()>> {
    tandem_test_support::select_cuda()?;
    if let Err(e) = nccl::version() {
        assert!(
            std::env::var("TANDEM_REQUIRE_NCCL").as_deref() != Ok("1"),
            "TANDEM_REQUIRE_NCCL=1 and this machine has a CUDA device, but NCCL cannot be used: \
             {e}. Put the folder of libnccl.so.2 (<site-packages>/nvidia/nccl/lib of the pip \
             package nvidia-nccl-cu13) in TANDEM_CUDA_LIBS"
        );
        println!("skipped: NCCL not found ({e})");
        return None;
    }
    if tandem_test_support::on_emulator() {
        // The real NCCL may be in TANDEM_CUDA_LIBS too (CI has it, after the emulator's folder).
        let path = nccl::library_path().unwrap_or_default();
        assert!(
            std::path::Path::new(&path).starts_with(tandem_test_support::use_emulator()),
            "on the CUDA emulator the NCCL group must load the emulated NCCL, not {path}"
        );
    }
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner()))
}

// ---- a world of 1, in this process ---------------------------------------------------------

/// A one-rank NCCL group with its own store (the group is dropped before the store).
struct Solo {
    pg: NcclProcessGroup,
    _server: StoreServer,
}

fn solo(name: &str) -> Solo {
    let server = StoreServer::bind("127.0.0.1:0").expect("store");
    let store = Arc::new(
        TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(10))
            .expect("store connection"),
    );
    let group = GroupConfig {
        name: name.into(),
        ..GroupConfig::default()
    };
    let pg = NcclProcessGroup::connect(store, 0, 1, GPU, group, NcclConfig::default())
        .unwrap_or_else(|e| panic!("a world of 1 on {GPU}: {e}"));
    Solo {
        pg,
        _server: server,
    }
}

#[test]
fn a_world_of_1_runs_every_collective_op_and_dtype_like_the_cpu_reference() {
    let Some(_gpu) = gpu() else { return };
    let s = solo("solo-conformance");
    println!("{:?}", s.pg);
    let summary = conformance(&s.pg, 17).unwrap_or_else(|e| panic!("{e}"));
    println!("world of 1: {summary}");
}

#[test]
fn a_world_of_1_wait_orders_the_compute_stream_without_blocking_the_host() {
    let Some(_gpu) = gpu() else { return };
    let s = solo("solo-no-host-block");
    // Keep the compute stream busy for a while (about 0.2 s on an H100, about as long on the
    // emulator with far less work): the collective is ordered after this work, so it cannot
    // have finished when wait() returns.
    let (n, adds) = if tandem_test_support::on_emulator() {
        (1 << 16, 8)
    } else {
        (64 << 20, 400)
    };
    let a = Tensor::ones(&[n], DType::F32, GPU).unwrap();
    let b = Tensor::ones(&[n], DType::F32, GPU).unwrap();
    tandem_core::cuda::device(0).unwrap().synchronize().unwrap();
    for _ in 0..adds {
        a.add_(&b).unwrap();
    }
    let t = Tensor::full(&[1000], 3.0, DType::F32, GPU).unwrap();
    let work = s.pg.all_reduce(&t, ReduceOp::Sum).unwrap();
    let started = Instant::now();
    work.wait().unwrap();
    let waited = started.elapsed();
    let done_at_return = work.is_completed();
    // On the emulator the host may be descheduled for a while (CI's 2 cores run every test
    // at once); the compute work above still lasts far longer than this bound.
    let bound = if tandem_test_support::on_emulator() {
        Duration::from_millis(500)
    } else {
        Duration::from_millis(50)
    };
    assert!(waited < bound, "Work::wait blocked the host for {waited:?}");
    assert!(
        !done_at_return,
        "the collective was complete before the compute work it is ordered after"
    );
    work.wait_host().unwrap();
    let host_done = started.elapsed();
    assert!(work.is_completed());
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 1000]);
    // The compute stream's work finished too: a holds 1 + adds.
    assert_eq!(a.to_vec::<f32>().unwrap()[n - 1], (adds + 1) as f32);
    println!("wait returned after {waited:?}; wait_host after {host_done:?}");
}

#[test]
fn a_world_of_1_refuses_cpu_and_strided_tensors_and_keeps_working() {
    let Some(_gpu) = gpu() else { return };
    let s = solo("solo-bad-arguments");
    let cpu = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
    let err =
        s.pg.all_reduce(&cpu, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
    assert!(err.contains("is on cpu") && err.contains("cuda:0"), "{err}");
    let square = Tensor::zeros(&[2, 3], DType::F32, GPU).unwrap();
    let transposed = square
        .view_detached(square.layout().transpose("t", 0, 1).unwrap())
        .unwrap();
    let err = s.pg.broadcast(&transposed, 0).unwrap_err().to_string();
    assert!(err.contains("not contiguous"), "{err}");
    let ints = Tensor::zeros(&[4], DType::I64, GPU).unwrap();
    let err =
        s.pg.all_reduce(&ints, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
    assert!(err.contains("cannot reduce i64"), "{err}");
    // Bad arguments consume no sequence number: the next collective is #1 and works.
    let t = Tensor::full(&[3], 2.0, DType::F32, GPU).unwrap();
    let work = s.pg.all_reduce(&t, ReduceOp::Max).unwrap();
    assert_eq!(work.sequence_number(), 1);
    work.wait_host().unwrap();
    assert!(s.pg.failure().is_none());
}

// ---- two processes on one GPU --------------------------------------------------------------

/// Starts the 2-rank job in worker `mode`, one GPU shared through per-rank `NCCL_HOSTID`s.
fn two_ranks(mode: &str) -> Job {
    Job::start_on_one_gpu(2, mode)
}

/// The line a worker printed with its error (`worker error: …`).
fn error_line(output: &str) -> String {
    output
        .lines()
        .find(|l| l.contains("worker error"))
        .unwrap_or_default()
        .to_string()
}

fn wait_until(what: &str, deadline: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + deadline;
    while !done() {
        assert!(
            Instant::now() < until,
            "{what} did not happen within {deadline:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn worker() {
    let Ok(mode) = std::env::var(common::WORKER_VAR) else {
        return;
    };
    let code = match nccl_worker(&mode) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("worker error: {e}");
            1
        }
    };
    std::process::exit(code);
}

#[test]
fn two_processes_on_one_gpu_run_every_collective_like_the_cpu_reference() {
    let Some(_gpu) = gpu() else { return };
    let results = two_ranks("conformance").wait(Duration::from_secs(300));
    for (rank, (status, output)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {rank} failed with {status}:\n{output}"
        );
        assert!(output.contains(&format!("rank {rank} of 2: ")), "{output}");
        println!(
            "{}",
            output
                .lines()
                .find(|l| l.contains("of 2: "))
                .unwrap_or_default()
        );
    }
}

#[test]
fn two_processes_wait_without_blocking_the_host_while_the_peer_is_late() {
    let Some(_gpu) = gpu() else { return };
    let results = two_ranks("late-peer").wait(Duration::from_secs(120));
    for (rank, (status, output)) in results.iter().enumerate() {
        assert!(
            status.success(),
            "rank {rank} failed with {status}:\n{output}"
        );
    }
    println!("{}", results[0].1);
}

#[test]
fn killing_one_of_two_ranks_fails_the_other_within_10s_naming_it() {
    let Some(_gpu) = gpu() else { return };
    let mut job = two_ranks("kill");
    job.wait_for_all("ready", Duration::from_secs(120));
    std::thread::sleep(Duration::from_millis(200));
    let killed_at = Instant::now();
    job.kill(1);
    wait_until("rank 0 failing", Duration::from_secs(30), || {
        job.output(0).contains("worker error")
    });
    let took = killed_at.elapsed();
    let results = job.wait(Duration::from_secs(30));
    let (status, output) = &results[0];
    assert!(!status.success(), "rank 0 should have failed:\n{output}");
    let error = error_line(output);
    println!("{took:?}: {error}");
    assert!(
        took < Duration::from_secs(10),
        "rank 0 took {took:?} to fail:\n{output}"
    );
    assert!(
        error.contains("rank 1's process exited") && error.contains("(collective #"),
        "rank 0's error does not name rank 1 and the collective:\n{output}"
    );
}

#[test]
fn a_stopped_rank_fails_the_other_within_10s_naming_it() {
    let Some(_gpu) = gpu() else { return };
    let mut job = two_ranks("stop");
    wait_until("rank 1 stopping", Duration::from_secs(120), || {
        job.output(1).contains("stopping now")
    });
    let stopped_at = Instant::now();
    wait_until("rank 0 failing", Duration::from_secs(30), || {
        job.output(0).contains("worker error")
    });
    let took = stopped_at.elapsed();
    job.kill(1);
    let results = job.wait(Duration::from_secs(30));
    let error = error_line(&results[0].1);
    println!("{took:?}: {error}");
    assert!(
        took < Duration::from_secs(10),
        "rank 0 took {took:?}:\n{}",
        results[0].1
    );
    assert!(
        error.contains("no heartbeat from rank 1"),
        "rank 0's error does not name the stopped rank 1:\n{}",
        results[0].1
    );
}

#[test]
fn a_rank_that_never_issues_a_collective_times_out_the_other_naming_it() {
    let Some(_gpu) = gpu() else { return };
    let mut job = two_ranks("stuck");
    wait_until("rank 0 failing", Duration::from_secs(60), || {
        job.output(0).contains("worker error")
    });
    job.kill(1);
    let results = job.wait(Duration::from_secs(30));
    let error = error_line(&results[0].1);
    println!("{error}");
    assert!(
        error.contains("(collective #3) timed out after 3s waiting for rank 1"),
        "{}",
        results[0].1
    );
    // The diagnosis, from the heartbeats: rank 1 is idle after the barrier, rank 0 waits.
    assert!(
        error.contains(
            "Diagnosis: rank 1 is at barrier #2, completed, and has issued nothing since, while \
             rank 0 waits at all_reduce #3 (f32 × 1024)"
        ),
        "{}",
        results[0].1
    );
}

#[test]
fn ranks_issuing_different_collectives_get_an_error_naming_both() {
    let Some(_gpu) = gpu() else { return };
    for mode in ["mismatch", "mismatch-checked"] {
        let results = two_ranks(mode).wait(Duration::from_secs(120));
        for (rank, (status, output)) in results.iter().enumerate() {
            let error = error_line(output);
            println!("{mode}: {error}");
            assert!(!status.success(), "{mode}: rank {rank}: {output}");
            assert!(
                error.contains("all_reduce(f32, 100, sum)")
                    && error.contains("all_gather(f32, 100 per rank)")
                    && error.contains("as collective #2 but rank"),
                "{mode}: rank {rank}: {output}"
            );
        }
    }
}

// ---- the workers ---------------------------------------------------------------------------

fn nccl_worker(mode: &str) -> Result<(), String> {
    let env = LaunchEnv::from_process_env().map_err(|e| e.to_string())?;
    let mut options = InitOptions {
        device: GPU,
        group: GroupConfig {
            name: format!("cuda-nccl-{mode}"),
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(120),
            ..GroupConfig::default()
        },
        ..InitOptions::default()
    };
    match mode {
        "stuck" => options.group.timeout = Duration::from_secs(3),
        "mismatch-checked" => options.nccl.check_every_collective = true,
        _ => {}
    }
    let pg = init_with_options(&env, options).map_err(|e| e.to_string())?;
    let rank = pg.rank();
    let e = |e: tandem_dist::DistError| e.to_string();
    let t_err = |e: tandem_core::Error| e.to_string();
    match mode {
        "conformance" => {
            let summary = conformance(pg.as_ref(), 29)?;
            println!("rank {rank} of 2: {summary}");
            Ok(())
        }
        "late-peer" => {
            let t = Tensor::full(&[1 << 16], (rank + 1) as f64, DType::F32, GPU).map_err(t_err)?;
            pg.barrier().and_then(|w| w.wait()).map_err(e)?;
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(2));
            }
            let work = pg.all_reduce(&t, ReduceOp::Sum).map_err(e)?;
            let started = Instant::now();
            work.wait().map_err(e)?;
            let waited = started.elapsed();
            let done_at_return = work.is_completed();
            work.wait_host().map_err(e)?;
            let finished = started.elapsed();
            let got = t.to_vec::<f32>().map_err(t_err)?;
            if got.iter().any(|&x| x != 3.0) {
                return Err(format!("sum of 1 and 2 gave {}", got[0]));
            }
            if rank == 0 {
                println!(
                    "wait returned after {waited:?}, the collective finished after {finished:?}"
                );
                if waited > Duration::from_millis(200) || done_at_return {
                    return Err(format!(
                        "Work::wait blocked the host ({waited:?}, complete: {done_at_return}) \
                         while rank 1 had not issued its all_reduce"
                    ));
                }
                if finished < Duration::from_millis(1500) {
                    return Err(format!(
                        "the collective finished after {finished:?}, before rank 1 joined"
                    ));
                }
            }
            // A barrier's wait blocks the host until every rank is there.
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(1));
            }
            let started = Instant::now();
            pg.barrier().and_then(|w| w.wait()).map_err(e)?;
            if rank == 0 && started.elapsed() < Duration::from_millis(700) {
                return Err(format!(
                    "barrier().wait() returned after {:?}, before rank 1 arrived",
                    started.elapsed()
                ));
            }
            Ok(())
        }
        "kill" | "stop" => {
            let t = Tensor::ones(&[1 << 20], DType::F32, GPU).map_err(t_err)?;
            for i in 0u64.. {
                pg.all_reduce(&t, ReduceOp::Avg)
                    .and_then(|w| w.wait())
                    .map_err(e)?;
                if i % 8 == 0 {
                    pg.barrier().and_then(|w| w.wait()).map_err(e)?;
                }
                if i == 5 {
                    println!("ready");
                }
                if mode == "stop" && rank == 1 && i == 20 {
                    println!("stopping now");
                    // SAFETY: raise(2) has no memory-safety preconditions; the process stops
                    // here until the test kills it.
                    unsafe {
                        libc::raise(libc::SIGSTOP);
                    }
                }
            }
            Ok(())
        }
        "stuck" => {
            let t = Tensor::ones(&[1024], DType::F32, GPU).map_err(t_err)?;
            pg.all_reduce(&t, ReduceOp::Sum)
                .and_then(|w| w.wait_host())
                .map_err(e)?;
            pg.barrier().and_then(|w| w.wait()).map_err(e)?;
            if rank == 1 {
                // Alive and beating, but never issuing collective #3.
                std::thread::sleep(Duration::from_secs(120));
                return Ok(());
            }
            pg.all_reduce(&t, ReduceOp::Sum)
                .and_then(|w| w.wait_host())
                .map_err(e)
        }
        "mismatch" | "mismatch-checked" => {
            let t = Tensor::zeros(&[100], DType::F32, GPU).map_err(t_err)?;
            let out = Tensor::zeros(&[200], DType::F32, GPU).map_err(t_err)?;
            pg.barrier().and_then(|w| w.wait()).map_err(e)?;
            let work = if rank == 0 {
                pg.all_reduce(&t, ReduceOp::Sum)
            } else {
                pg.all_gather(&t, &out)
            };
            work.and_then(|w| w.wait_host()).map_err(e)?;
            // Should NCCL have completed the mismatched pair, the heartbeats report it by the
            // next collective.
            std::thread::sleep(Duration::from_secs(2));
            pg.barrier().and_then(|w| w.wait()).map_err(e)?;
            Err("the mismatched collectives were not reported".into())
        }
        other => Err(format!("unknown worker mode {other}")),
    }
}

// ---- every collective against the CPU reference --------------------------------------------

/// SplitMix64, so that every rank can generate every rank's inputs.
fn splitmix(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Rank `rank`'s values for test case `case`, as stored in `dtype`: uniform in [-1, 1) for
/// f32/f64, small integers for the half types (so that sums are exact).
fn values(seed: u64, case: u64, rank: usize, n: usize, dtype: DType) -> Result<Vec<f64>, String> {
    let mut next = splitmix(seed ^ (case * 1000 + rank as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let raw: Vec<f64> = (0..n)
        .map(|_| match dtype {
            DType::F16 | DType::BF16 => (next() % 9) as f64 - 4.0,
            _ => (next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0,
        })
        .collect();
    host(&raw, dtype)?.to_vec_f64().map_err(|e| e.to_string())
}

fn host(values: &[f64], dtype: DType) -> Result<Tensor, String> {
    Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(|e| e.to_string())
}

fn on_gpu(values: &[f64], dtype: DType) -> Result<Tensor, String> {
    host(values, dtype)?
        .to_device(GPU)
        .map_err(|e| e.to_string())
}

fn reduce(inputs: &[Vec<f64>], op: ReduceOp, i: usize) -> f64 {
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

fn tolerance(dtype: DType, world: usize, op: ReduceOp, expected: f64) -> f64 {
    match (dtype, op) {
        (_, ReduceOp::Max | ReduceOp::Min) => 0.0,
        (DType::F16 | DType::BF16, ReduceOp::Sum) => 0.0,
        (DType::F16, _) => expected.abs().max(1.0) * 1e-3,
        (DType::BF16, _) => expected.abs().max(1.0) * 8e-3,
        (DType::F64, _) => 1e-12 * world as f64,
        _ => 4e-6 * world as f64,
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

/// Runs every collective, reduce op and dtype on `pg` (every rank calls it with the same seed)
/// and compares with the reference; `Work::wait` (device) orders the read-back. Returns a
/// summary.
fn conformance(pg: &dyn ProcessGroup, seed: u64) -> Result<String, String> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let e = |what: &str| {
        let what = what.to_string();
        move |err: tandem_dist::DistError| format!("{what}: {err}")
    };
    let read = |t: &Tensor| t.to_vec_f64().map_err(|err| err.to_string());
    let mut case = 0u64;
    let mut checked = 0usize;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for n in [0usize, 1, 5, 1001, 65_537] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                case += 1;
                let what = format!("rank {rank}/{world}: all_reduce({dtype}, {n}, {op})");
                let inputs: Vec<Vec<f64>> = (0..world)
                    .map(|q| values(seed, case, q, n, dtype))
                    .collect::<Result<_, _>>()?;
                let t = on_gpu(&inputs[rank], dtype)?;
                pg.all_reduce(&t, op)
                    .and_then(|w| w.wait())
                    .map_err(e(&what))?;
                let want: Vec<f64> = (0..n).map(|i| reduce(&inputs, op, i)).collect();
                compare(&what, &read(&t)?, &want, |w| tolerance(dtype, world, op, w))?;
                checked += 1;

                case += 1;
                let what =
                    format!("rank {rank}/{world}: reduce_scatter({dtype}, {n} per rank, {op})");
                let inputs: Vec<Vec<f64>> = (0..world)
                    .map(|q| values(seed, case, q, n * world, dtype))
                    .collect::<Result<_, _>>()?;
                let input = on_gpu(&inputs[rank], dtype)?;
                let output = Tensor::zeros(&[n], dtype, GPU).map_err(|err| err.to_string())?;
                pg.reduce_scatter(&input, &output, op)
                    .and_then(|w| w.wait())
                    .map_err(e(&what))?;
                let want: Vec<f64> = (0..n).map(|i| reduce(&inputs, op, rank * n + i)).collect();
                compare(&what, &read(&output)?, &want, |w| {
                    tolerance(dtype, world, op, w)
                })?;
                compare(
                    &format!("{what}: the input"),
                    &read(&input)?,
                    &inputs[rank],
                    |_| 0.0,
                )?;
                checked += 1;
            }

            case += 1;
            let what = format!("rank {rank}/{world}: all_gather({dtype}, {n} per rank)");
            let inputs: Vec<Vec<f64>> = (0..world)
                .map(|q| values(seed, case, q, n, dtype))
                .collect::<Result<_, _>>()?;
            let input = on_gpu(&inputs[rank], dtype)?;
            let output = Tensor::zeros(&[world * n], dtype, GPU).map_err(|err| err.to_string())?;
            pg.all_gather(&input, &output)
                .and_then(|w| w.wait())
                .map_err(e(&what))?;
            compare(&what, &read(&output)?, &inputs.concat(), |_| 0.0)?;
            checked += 1;

            for root in 0..world {
                case += 1;
                let what = format!("rank {rank}/{world}: broadcast({dtype}, {n}, root {root})");
                let t = on_gpu(&values(seed, case, rank, n, dtype)?, dtype)?;
                pg.broadcast(&t, root)
                    .and_then(|w| w.wait())
                    .map_err(e(&what))?;
                compare(
                    &what,
                    &read(&t)?,
                    &values(seed, case, root, n, dtype)?,
                    |_| 0.0,
                )?;
                checked += 1;
            }
        }
    }

    // Broadcast and all-gather move any dtype.
    for dtype in [DType::I64, DType::U8] {
        let what = format!("rank {rank}/{world}: all_gather({dtype}, 7 per rank)");
        let mine: Vec<f64> = (0..7).map(|i| (rank * 10 + i) as f64).collect();
        let input = on_gpu(&mine, dtype)?;
        let output = Tensor::zeros(&[7 * world], dtype, GPU).map_err(|err| err.to_string())?;
        pg.all_gather(&input, &output)
            .and_then(|w| w.wait())
            .map_err(e(&what))?;
        let want: Vec<f64> = (0..world)
            .flat_map(|q| (0..7).map(move |i| (q * 10 + i) as f64))
            .collect();
        compare(&what, &read(&output)?, &want, |_| 0.0)?;
        checked += 1;
    }

    // In place: the input is this rank's block of the output.
    let n = 333;
    let output = Tensor::zeros(&[world * n], DType::F32, GPU).map_err(|err| err.to_string())?;
    let block = |q: usize| -> Result<Tensor, String> {
        let layout = output
            .layout()
            .narrow("test", 0, q * n, n)
            .map_err(|err| err.to_string())?;
        output.view_detached(layout).map_err(|err| err.to_string())
    };
    block(rank)?
        .fill_((rank + 1) as f64)
        .map_err(|err| err.to_string())?;
    pg.all_gather(&block(rank)?, &output)
        .and_then(|w| w.wait())
        .map_err(e("in-place all_gather"))?;
    let want: Vec<f64> = (0..world).flat_map(|q| vec![(q + 1) as f64; n]).collect();
    compare(
        &format!("rank {rank}: in-place all_gather"),
        &read(&output)?,
        &want,
        |_| 0.0,
    )?;
    // An input that overlaps the output elsewhere than in its own block: it is copied before
    // the collective overwrites it. Rank r sends the block of rank r + 1, which holds r + 2.
    if world > 1 {
        let input = block((rank + 1) % world)?;
        pg.all_gather(&input, &output)
            .and_then(|w| w.wait())
            .map_err(e("overlapping all_gather"))?;
        let want: Vec<f64> = (0..world)
            .flat_map(|q| vec![((q + 1) % world + 1) as f64; n])
            .collect();
        compare(
            &format!("rank {rank}: all_gather of a block of its own output"),
            &read(&output)?,
            &want,
            |_| 0.0,
        )?;
        checked += 1;
    }
    // reduce_scatter whose output is a block of its own input.
    let input_values: Vec<f64> = (0..world * n)
        .map(|i| (i % 7) as f64 + rank as f64)
        .collect();
    let input = on_gpu(&input_values, DType::F32)?;
    let out_view = {
        let layout = input
            .layout()
            .narrow("test", 0, rank * n, n)
            .map_err(|err| err.to_string())?;
        input.view_detached(layout).map_err(|err| err.to_string())?
    };
    pg.reduce_scatter(&input, &out_view, ReduceOp::Sum)
        .and_then(|w| w.wait())
        .map_err(e("reduce_scatter into its own input"))?;
    let want: Vec<f64> = (0..n)
        .map(|i| {
            (0..world)
                .map(|q| ((rank * n + i) % 7) as f64 + q as f64)
                .sum()
        })
        .collect();
    compare(
        &format!("rank {rank}: reduce_scatter into a block of its own input"),
        &read(&out_view)?,
        &want,
        |_| 0.0,
    )?;
    checked += 2;

    // Several collectives in flight complete in issue order; a barrier waits for them.
    let tensors: Vec<Tensor> = (0..4)
        .map(|k| {
            Tensor::full(&[4096], (rank + k) as f64, DType::F32, GPU).map_err(|err| err.to_string())
        })
        .collect::<Result<_, _>>()?;
    let works: Vec<_> = tensors
        .iter()
        .map(|t| pg.all_reduce(t, ReduceOp::Sum))
        .collect::<Result<_, _>>()
        .map_err(e("in-flight all_reduce"))?;
    pg.barrier().and_then(|w| w.wait()).map_err(e("barrier"))?;
    for (k, (t, w)) in tensors.iter().zip(&works).enumerate() {
        if !w.is_completed() {
            return Err(format!(
                "rank {rank}: all_reduce #{} was not complete after a later barrier",
                w.sequence_number()
            ));
        }
        w.wait_host().map_err(e("in-flight all_reduce"))?;
        let want = (0..world).map(|q| (q + k) as f64).sum::<f64>();
        compare(
            &format!("rank {rank}: in-flight all_reduce {k}"),
            &read(t)?,
            &vec![want; 4096],
            |_| 0.0,
        )?;
    }
    checked += 4;
    Ok(format!(
        "{checked} collectives matched the CPU reference (NCCL {})",
        nccl::version().map_err(|err| err.to_string())?
    ))
}
