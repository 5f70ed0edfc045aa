//! Every collective × data type × operator against the host reference, with ranks as threads
//! (2, 4 and 8 ranks), small and chunked (larger than one staging chunk) sizes, in place and
//! out of place; group calls (nothing runs before `ncclGroupEnd`); sends and receives in a ring
//! inside a group.

mod common;

use std::ffi::c_int;

use common::*;

const COUNT: usize = 37;

/// Every collective for every data type and operator on this rank; returns how many ran.
fn conformance(r: &Rank, case0: u64) -> usize {
    let nccl = nccl();
    let (me, n) = (r.rank, r.world);
    let stream = r.raw_stream();
    let mut checked = 0;
    let mut case = case0;
    for &(dtype, size, dname) in &DTYPES {
        for &(op, oname) in &OPS {
            // all-reduce, out of place and in place.
            for in_place in [false, true] {
                case += 1;
                let mine: Vec<f64> = (0..COUNT).map(|i| value(case, me, i, dtype)).collect();
                let send = Buf::upload(&encode(&mine, dtype));
                let recv = if in_place {
                    None
                } else {
                    Some(Buf::zeros(COUNT * size))
                };
                let out = recv.as_ref().unwrap_or(&send);
                // SAFETY: device buffers of COUNT elements, a live communicator and stream.
                let status = unsafe {
                    (nccl.all_reduce)(send.ptr(), out.ptr(), COUNT, dtype, op, r.comm, stream)
                };
                ok("ncclAllReduce", r.comm, status);
                r.sync();
                let got = decode(&out.read(), dtype);
                for (i, g) in got.iter().enumerate() {
                    let xs: Vec<f64> = (0..n).map(|q| value(case, q, i, dtype)).collect();
                    let want = reference(&xs, op, dtype);
                    assert_eq!(
                        *g, want,
                        "rank {me}/{n}: all_reduce({dname}, {oname}, in place {in_place}) \
                         element {i} of {xs:?}"
                    );
                }
                checked += 1;
            }

            // reduce-scatter.
            case += 1;
            let mine: Vec<f64> = (0..COUNT * n).map(|i| value(case, me, i, dtype)).collect();
            let send = Buf::upload(&encode(&mine, dtype));
            let recv = Buf::zeros(COUNT * size);
            // SAFETY: as above (the input holds n × COUNT elements).
            let status = unsafe {
                (nccl.reduce_scatter)(send.ptr(), recv.ptr(), COUNT, dtype, op, r.comm, stream)
            };
            ok("ncclReduceScatter", r.comm, status);
            r.sync();
            for (i, g) in decode(&recv.read(), dtype).iter().enumerate() {
                let xs: Vec<f64> = (0..n)
                    .map(|q| value(case, q, me * COUNT + i, dtype))
                    .collect();
                assert_eq!(
                    *g,
                    reference(&xs, op, dtype),
                    "rank {me}/{n}: reduce_scatter({dname}, {oname}) element {i}"
                );
            }
            checked += 1;

            // reduce to the last rank.
            case += 1;
            let root = n - 1;
            let mine: Vec<f64> = (0..COUNT).map(|i| value(case, me, i, dtype)).collect();
            let send = Buf::upload(&encode(&mine, dtype));
            let recv = Buf::upload(&vec![0xAB; COUNT * size]);
            // SAFETY: as above.
            let status = unsafe {
                (nccl.reduce)(
                    send.ptr(),
                    recv.ptr(),
                    COUNT,
                    dtype,
                    op,
                    root as c_int,
                    r.comm,
                    stream,
                )
            };
            ok("ncclReduce", r.comm, status);
            r.sync();
            let got = recv.read();
            if me == root {
                for (i, g) in decode(&got, dtype).iter().enumerate() {
                    let xs: Vec<f64> = (0..n).map(|q| value(case, q, i, dtype)).collect();
                    assert_eq!(*g, reference(&xs, op, dtype), "reduce({dname}, {oname})");
                }
            } else {
                assert!(got.iter().all(|&b| b == 0xAB), "reduce wrote a non-root");
            }
            checked += 1;
        }

        // all-gather, out of place and in place (the input is this rank's block of the output).
        for in_place in [false, true] {
            case += 1;
            let mine: Vec<f64> = (0..COUNT).map(|i| value(case, me, i, dtype)).collect();
            let out = Buf::zeros(COUNT * size * n);
            let send = if in_place {
                let mut all = vec![0u8; COUNT * size * n];
                all[me * COUNT * size..][..COUNT * size].copy_from_slice(&encode(&mine, dtype));
                let b = Buf::upload(&all);
                drop(out);
                (None, b)
            } else {
                (Some(Buf::upload(&encode(&mine, dtype))), out)
            };
            let (input, output) = send;
            let input_ptr = match &input {
                Some(b) => b.ptr(),
                // SAFETY: this rank's block lies inside the output buffer.
                None => unsafe { output.ptr().cast::<u8>().add(me * COUNT * size).cast() },
            };
            // SAFETY: as above.
            let status =
                unsafe { (nccl.all_gather)(input_ptr, output.ptr(), COUNT, dtype, r.comm, stream) };
            ok("ncclAllGather", r.comm, status);
            r.sync();
            let want: Vec<f64> = (0..n)
                .flat_map(|q| (0..COUNT).map(move |i| value(case, q, i, dtype)))
                .collect();
            assert_eq!(
                decode(&output.read(), dtype),
                want,
                "rank {me}/{n}: all_gather({dname}, in place {in_place})"
            );
            checked += 1;
        }

        // broadcast from every root.
        for root in 0..n {
            case += 1;
            let mine: Vec<f64> = (0..COUNT).map(|i| value(case, me, i, dtype)).collect();
            let send = Buf::upload(&encode(&mine, dtype));
            let recv = Buf::zeros(COUNT * size);
            // SAFETY: as above.
            let status = unsafe {
                (nccl.broadcast)(
                    send.ptr(),
                    recv.ptr(),
                    COUNT,
                    dtype,
                    root as c_int,
                    r.comm,
                    stream,
                )
            };
            ok("ncclBroadcast", r.comm, status);
            r.sync();
            let want: Vec<f64> = (0..COUNT).map(|i| value(case, root, i, dtype)).collect();
            assert_eq!(
                decode(&recv.read(), dtype),
                want,
                "broadcast({dname}) from {root}"
            );
            checked += 1;
        }
    }
    checked
}

/// Collectives larger than a staging chunk (512 KiB): several rounds each.
fn chunked(r: &Rank) {
    let nccl = nccl();
    let (me, n) = (r.rank, r.world);
    let stream = r.raw_stream();
    let count = 300_001; // f32: 1.2 MB, three chunks; reduce-scatter: count per rank
    let f32s = |case: u64, rank: usize, len: usize| -> Vec<f64> {
        (0..len).map(|i| value(case, rank, i, 7)).collect()
    };
    let send = Buf::upload(&encode(&f32s(1, me, count), 7));
    let recv = Buf::zeros(count * 4);
    // SAFETY: device buffers of `count` f32, a live communicator and stream.
    ok("chunked ncclAllReduce", r.comm, unsafe {
        (nccl.all_reduce)(send.ptr(), recv.ptr(), count, 7, 0, r.comm, stream)
    });
    let input = Buf::upload(&encode(&f32s(2, me, count * n), 7));
    let scattered = Buf::zeros(count * 4);
    // SAFETY: as above, the input holds n × count.
    ok("chunked ncclReduceScatter", r.comm, unsafe {
        (nccl.reduce_scatter)(input.ptr(), scattered.ptr(), count, 7, 2, r.comm, stream)
    });
    let gathered = Buf::zeros(count * 4 * n);
    // SAFETY: as above, the output holds n × count.
    ok("chunked ncclAllGather", r.comm, unsafe {
        (nccl.all_gather)(send.ptr(), gathered.ptr(), count, 7, r.comm, stream)
    });
    r.sync();
    let got = decode(&recv.read(), 7);
    for (i, g) in got.iter().enumerate() {
        let xs: Vec<f64> = (0..n).map(|q| value(1, q, i, 7)).collect();
        assert_eq!(*g, reference(&xs, 0, 7), "chunked all_reduce element {i}");
    }
    for (i, g) in decode(&scattered.read(), 7).iter().enumerate() {
        let xs: Vec<f64> = (0..n).map(|q| value(2, q, me * count + i, 7)).collect();
        assert_eq!(
            *g,
            reference(&xs, 2, 7),
            "chunked reduce_scatter element {i}"
        );
    }
    let want: Vec<f64> = (0..n).flat_map(|q| f32s(1, q, count)).collect();
    assert!(decode(&gathered.read(), 7) == want, "chunked all_gather");
}

fn world(n: usize) {
    let started = std::time::Instant::now();
    let counts = on_threads(n, |r| {
        let checked = conformance(&r, 1000);
        chunked(&r);
        r.destroy();
        checked
    });
    println!(
        "{n} ranks: {} collectives per rank matched the reference in {:?}",
        counts[0],
        started.elapsed()
    );
}

#[test]
fn two_thread_ranks_match_the_reference() {
    world(2);
}

#[test]
fn four_thread_ranks_match_the_reference() {
    world(4);
}

#[test]
fn eight_thread_ranks_match_the_reference() {
    world(8);
}

#[test]
fn a_group_issues_its_collectives_at_group_end() {
    let nccl = nccl();
    on_threads(2, |r| {
        let stream = r.raw_stream();
        let inputs: Vec<Buf> = (0..3)
            .map(|k| Buf::upload(&encode(&vec![(r.rank + k) as f64; 100], 7)))
            .collect();
        let outputs: Vec<Buf> = (0..3).map(|_| Buf::zeros(400)).collect();
        // SAFETY: plain group calls.
        ok("ncclGroupStart", r.comm, unsafe { (nccl.group_start)() });
        for (i, o) in inputs.iter().zip(&outputs) {
            // SAFETY: 100 f32 each, a live communicator and stream.
            ok("grouped ncclAllReduce", r.comm, unsafe {
                (nccl.all_reduce)(i.ptr(), o.ptr(), 100, 7, 0, r.comm, stream)
            });
        }
        // Nothing was enqueued yet: the stream is idle and the outputs untouched.
        r.sync();
        assert!(outputs.iter().all(|o| o.read().iter().all(|&b| b == 0)));
        // SAFETY: as above.
        ok("ncclGroupEnd", r.comm, unsafe { (nccl.group_end)() });
        r.sync();
        for (k, o) in outputs.iter().enumerate() {
            assert_eq!(decode(&o.read(), 7), vec![(1 + 2 * k) as f64; 100]);
        }
        // A group end without a start is refused.
        // SAFETY: as above.
        assert_eq!(unsafe { (nccl.group_end)() }, INVALID_USAGE);
        r.destroy();
    });
}

#[test]
fn sends_and_receives_in_a_ring_complete_inside_a_group() {
    let nccl = nccl();
    for n in [2, 3] {
        on_threads(n, move |r| {
            let stream = r.raw_stream();
            let (me, n) = (r.rank, r.world);
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            // Three chunks' worth, so the mailboxes turn over while both directions move.
            let count = 400_000;
            let mine: Vec<f64> = (0..count).map(|i| value(7, me, i, 8)).collect();
            let send = Buf::upload(&encode(&mine, 8));
            let recv = Buf::zeros(count * 8);
            // SAFETY: plain group calls and f64 buffers of `count`.
            unsafe {
                ok("ncclGroupStart", r.comm, (nccl.group_start)());
                ok(
                    "ncclSend",
                    r.comm,
                    (nccl.send)(send.ptr(), count, 8, next as c_int, r.comm, stream),
                );
                ok(
                    "ncclRecv",
                    r.comm,
                    (nccl.recv)(recv.ptr(), count, 8, prev as c_int, r.comm, stream),
                );
                ok("ncclGroupEnd", r.comm, (nccl.group_end)());
            }
            r.sync();
            let want: Vec<f64> = (0..count).map(|i| value(7, prev, i, 8)).collect();
            assert!(
                decode(&recv.read(), 8) == want,
                "rank {me}/{n}: ring receive"
            );
            r.destroy();
        });
    }
}

static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

unsafe extern "C" fn hold_stream(_: *mut std::ffi::c_void) {
    while !RELEASE.load(std::sync::atomic::Ordering::Acquire) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn a_collective_reads_its_input_when_its_stream_gets_there() {
    let nccl = nccl();
    on_threads(1, |r| {
        type LaunchHostFunc = unsafe extern "C" fn(
            *mut std::ffi::c_void,
            Option<unsafe extern "C" fn(*mut std::ffi::c_void)>,
            *mut std::ffi::c_void,
        ) -> u32;
        let driver =
            tandem_core::cuda::libs::library(tandem_core::cuda::libs::CudaLibrary::Driver, GPU)
                .unwrap();
        // SAFETY: the emulated driver exports cuLaunchHostFunc with this signature.
        let launch = unsafe { driver.get::<LaunchHostFunc>(b"cuLaunchHostFunc") }.unwrap();
        let input = Buf::upload(&encode(&[1.0; 256], 7));
        let output = Buf::zeros(1024);
        // The stream is held by a host function until RELEASE; the all-reduce queues behind it.
        // SAFETY: a live stream and a function that takes no data.
        assert_eq!(
            unsafe { launch(r.raw_stream(), Some(hold_stream), std::ptr::null_mut()) },
            0
        );
        // SAFETY: 256 f32 each, a live communicator and stream.
        ok("ncclAllReduce", r.comm, unsafe {
            (nccl.all_reduce)(input.ptr(), output.ptr(), 256, 7, 0, r.comm, r.raw_stream())
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let new = encode(&[5.0; 256], 7);
        // SAFETY: the emulator's device memory is host memory: 1024 bytes at each address,
        // which nothing else touches while the stream is held.
        let untouched = unsafe {
            let out = std::slice::from_raw_parts(output.ptr().cast::<u8>(), 1024).to_vec();
            std::ptr::copy_nonoverlapping(new.as_ptr(), input.ptr().cast::<u8>(), 1024);
            out
        };
        assert!(
            untouched.iter().all(|&b| b == 0),
            "the all-reduce ran before its stream got there"
        );
        RELEASE.store(true, std::sync::atomic::Ordering::Release);
        r.sync();
        // It read the input written after the call, as a GPU kernel would.
        assert_eq!(decode(&output.read(), 7), vec![5.0; 256]);
        r.destroy();
    });
}
