//! Ranks as processes on one host: two processes (this test binary re-run as workers, the id
//! passed in hex through the environment) run every collective, data type and operator against
//! the host reference; and a rank process killed mid-run leaves its peer's collective pending —
//! no timeout makes it succeed or fail — until the peer aborts its communicator, which returns
//! promptly.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const WORKER: &str = "TANDEM_NCCL_EMU_TEST_WORKER";

/// Starts this binary as rank `rank` of `world` in worker `mode`.
fn spawn(mode: &str, id: &Id, rank: usize, world: usize) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        .env(WORKER, mode)
        .env("NCCL_EMU_TEST_ID", id_to_hex(id))
        .env("NCCL_EMU_TEST_RANK", rank.to_string())
        .env("NCCL_EMU_TEST_WORLD", world.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` (at most `limit`, then kills it) and returns whether it succeeded and its
/// output.
fn finish(mut child: Child, limit: Duration) -> (bool, String) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(_status) = child.try_wait().unwrap() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER) else {
        return;
    };
    let id = id_from_hex(&std::env::var("NCCL_EMU_TEST_ID").unwrap());
    let rank: usize = std::env::var("NCCL_EMU_TEST_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let world: usize = std::env::var("NCCL_EMU_TEST_WORLD")
        .unwrap()
        .parse()
        .unwrap();
    let r = Rank::join(id, rank, world);
    match mode.as_str() {
        "conformance" => {
            let mut checked = 0;
            for &(dtype, size, _) in &DTYPES {
                for &(op, _) in &OPS {
                    let case = (dtype * 10 + op) as u64;
                    // all-reduce of a chunk and a half, so two rounds cross the processes.
                    let count = (512 << 10) * 3 / 2 / size + 3;
                    let mine: Vec<f64> = (0..count).map(|i| value(case, rank, i, dtype)).collect();
                    let send = Buf::upload(&encode(&mine, dtype));
                    let recv = Buf::zeros(count * size);
                    // SAFETY: device buffers of `count` elements, a live communicator.
                    ok("ncclAllReduce", r.comm, unsafe {
                        (nccl().all_reduce)(
                            send.ptr(),
                            recv.ptr(),
                            count,
                            dtype,
                            op,
                            r.comm,
                            r.raw_stream(),
                        )
                    });
                    let scattered = Buf::zeros(17 * size);
                    // SAFETY: the input holds at least 2 × 17 elements.
                    ok("ncclReduceScatter", r.comm, unsafe {
                        (nccl().reduce_scatter)(
                            send.ptr(),
                            scattered.ptr(),
                            17,
                            dtype,
                            op,
                            r.comm,
                            r.raw_stream(),
                        )
                    });
                    r.sync();
                    for (i, g) in decode(&recv.read(), dtype).iter().enumerate() {
                        let xs: Vec<f64> = (0..world).map(|q| value(case, q, i, dtype)).collect();
                        assert_eq!(
                            *g,
                            reference(&xs, op, dtype),
                            "all_reduce {dtype} {op} element {i}"
                        );
                    }
                    for (i, g) in decode(&scattered.read(), dtype).iter().enumerate() {
                        let xs: Vec<f64> = (0..world)
                            .map(|q| value(case, q, rank * 17 + i, dtype))
                            .collect();
                        assert_eq!(*g, reference(&xs, op, dtype), "reduce_scatter {dtype} {op}");
                    }
                    checked += 2;
                }
                let mine: Vec<f64> = (0..50)
                    .map(|i| value(dtype as u64, rank, i, dtype))
                    .collect();
                let send = Buf::upload(&encode(&mine, dtype));
                let gathered = Buf::zeros(50 * size * world);
                let root = Buf::zeros(50 * size);
                // SAFETY: as above.
                unsafe {
                    ok(
                        "ncclAllGather",
                        r.comm,
                        (nccl().all_gather)(
                            send.ptr(),
                            gathered.ptr(),
                            50,
                            dtype,
                            r.comm,
                            r.raw_stream(),
                        ),
                    );
                    ok(
                        "ncclBroadcast",
                        r.comm,
                        (nccl().broadcast)(
                            send.ptr(),
                            root.ptr(),
                            50,
                            dtype,
                            1,
                            r.comm,
                            r.raw_stream(),
                        ),
                    );
                }
                r.sync();
                let want: Vec<f64> = (0..world)
                    .flat_map(|q| (0..50).map(move |i| value(dtype as u64, q, i, dtype)))
                    .collect();
                assert_eq!(decode(&gathered.read(), dtype), want, "all_gather {dtype}");
                let want: Vec<f64> = (0..50).map(|i| value(dtype as u64, 1, i, dtype)).collect();
                assert_eq!(decode(&root.read(), dtype), want, "broadcast {dtype}");
                checked += 2;
            }
            // How long a DDP-sized bucket takes across the processes (printed, not asserted).
            let count = 4 << 20;
            let big = Buf::zeros(count * 4);
            let started = Instant::now();
            for _ in 0..4 {
                // SAFETY: `count` f32, a live communicator.
                ok("ncclAllReduce", r.comm, unsafe {
                    (nccl().all_reduce)(big.ptr(), big.ptr(), count, 7, 0, r.comm, r.raw_stream())
                });
            }
            r.sync();
            let each = started.elapsed() / 4;
            r.destroy();
            println!(
                "rank {rank}: {checked} collectives matched the reference; a 16 MiB f32 \
                 all-reduce took {each:?}"
            );
        }
        "loop" => {
            // All-reduces until killed.
            let t = Buf::upload(&encode(&[1.0; 1000], 7));
            for i in 0u64.. {
                // SAFETY: 1000 f32, a live communicator.
                ok("ncclAllReduce", r.comm, unsafe {
                    (nccl().all_reduce)(t.ptr(), t.ptr(), 1000, 7, 2, r.comm, r.raw_stream())
                });
                r.sync();
                if i == 20 {
                    println!("ready");
                }
            }
        }
        "exit-pending" => {
            // An all-reduce the peer never joins, then the process ends with it pending.
            let t = Buf::upload(&encode(&[1.0; 1000], 7));
            // SAFETY: 1000 f32, a live communicator.
            ok("ncclAllReduce", r.comm, unsafe {
                (nccl().all_reduce)(t.ptr(), t.ptr(), 1000, 7, 0, r.comm, r.raw_stream())
            });
            std::thread::sleep(Duration::from_millis(200));
            println!("exiting with a collective pending");
            std::process::exit(0);
        }
        other => panic!("unknown mode {other}"),
    }
}

#[test]
fn two_processes_match_the_reference() {
    nccl();
    let id = new_id();
    let started = Instant::now();
    let children: Vec<Child> = (0..2)
        .map(|rank| spawn("conformance", &id, rank, 2))
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let (success, output) = finish(child, Duration::from_secs(300));
        assert!(success, "rank {rank}:\n{output}");
        let line = output
            .lines()
            .find(|l| l.contains("matched"))
            .unwrap_or_default();
        println!("{line}");
    }
    println!("in {:?}", started.elapsed());
}

#[test]
fn a_killed_rank_leaves_the_peer_pending_until_it_aborts() {
    let nccl = nccl();
    let id = new_id();
    let mut child = spawn("loop", &id, 1, 2);
    let r = Rank::join(id, 0, 2);
    let t = Buf::upload(&encode(&[1.0; 1000], 7));
    // Run in step with the child for a while, then kill it between two collectives.
    for _ in 0..30 {
        // SAFETY: 1000 f32, a live communicator.
        ok("ncclAllReduce", r.comm, unsafe {
            (nccl.all_reduce)(t.ptr(), t.ptr(), 1000, 7, 2, r.comm, r.raw_stream())
        });
        r.sync();
    }
    child.kill().unwrap();
    let _ = child.wait();
    // Two more: the child may have issued one more before it died, which completes the first.
    for _ in 0..2 {
        // SAFETY: as above.
        ok("ncclAllReduce", r.comm, unsafe {
            (nccl.all_reduce)(t.ptr(), t.ptr(), 1000, 7, 2, r.comm, r.raw_stream())
        });
    }
    let done = r.stream.record_event().unwrap();
    assert!(
        !done.wait_timeout(Duration::from_secs(2)).unwrap(),
        "a collective completed without its killed peer"
    );
    assert_eq!(
        async_error(r.comm),
        SUCCESS,
        "still pending, no error by itself"
    );
    let aborted_at = Instant::now();
    // SAFETY: a live communicator, no other thread in NCCL on it.
    assert_eq!(unsafe { (nccl.abort)(r.comm) }, SUCCESS);
    assert!(
        done.wait_timeout(Duration::from_secs(5)).unwrap(),
        "the abort did not release the stream"
    );
    println!("released {:?} after the abort", aborted_at.elapsed());
}

#[test]
fn a_process_exits_with_a_collective_pending() {
    nccl();
    let id = new_id();
    let child = spawn("exit-pending", &id, 1, 2);
    // Rank 0 joins and never issues the all-reduce.
    let r = Rank::join(id, 0, 2);
    let started = Instant::now();
    let (success, output) = finish(child, Duration::from_secs(30));
    let took = started.elapsed();
    assert!(
        success && output.contains("exiting with a collective pending"),
        "the rank did not exit by itself within 30 s:\n{output}"
    );
    println!("exited {took:?} after joining");
    // SAFETY: a live communicator.
    assert_eq!(unsafe { (nccl().abort)(r.comm) }, SUCCESS);
}
