//! What the emulated NCCL refuses or reports: non-blocking init in progress until the peers
//! join; an abort that unblocks a collective whose peer never arrives (and fails every later
//! call); mismatched collectives; a wrong data type that reads past a buffer; ids and shared
//! segments it did not make (forged, garbage, another rank count, a duplicate rank, a peer that
//! posts an impossible length).

mod common;

use std::ffi::c_int;
use std::time::{Duration, Instant};

use common::*;
use tandem_cuda_emu_nccl::segment::{Desc, Segment, CHUNK};

/// The segment file's path for `id` (the emulator names it from the id's random bytes).
fn segment_path(id: &Id) -> String {
    let hex: String = id.0[16..32]
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect();
    Segment::path_for(&hex)
}

/// Starts a non-blocking init of `rank` of `world`.
fn start_nonblocking(id: Id, rank: usize, world: usize) -> Comm {
    let mut comm: Comm = std::ptr::null_mut();
    let mut config = Config::new(false);
    // SAFETY: out-parameter, config and id are valid.
    let status = unsafe {
        (nccl().init_rank_config)(&mut comm, world as c_int, id, rank as c_int, &mut config)
    };
    assert_eq!(status, IN_PROGRESS, "{}", last_error(comm));
    assert!(!comm.is_null());
    comm
}

#[test]
fn a_non_blocking_init_is_in_progress_until_every_rank_joined() {
    let id = new_id();
    let first = start_nonblocking(id, 0, 2);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(async_error(first), IN_PROGRESS, "rank 1 has not joined");
    let second = start_nonblocking(id, 1, 2);
    assert_eq!(settle(first), SUCCESS, "{}", last_error(first));
    assert_eq!(settle(second), SUCCESS, "{}", last_error(second));
    // Every rank joined: the segment's file is gone.
    assert!(!std::path::Path::new(&segment_path(&id)).exists());
    let (mut count, mut rank) = (0, -1);
    // SAFETY: live communicators and out-parameters.
    unsafe {
        assert_eq!((nccl().count)(second, &mut count), SUCCESS);
        assert_eq!((nccl().user_rank)(second, &mut rank), SUCCESS);
        assert_eq!((nccl().abort)(first), SUCCESS);
        assert_eq!((nccl().abort)(second), SUCCESS);
    }
    assert_eq!((count, rank), (2, 1));
}

#[test]
fn an_abort_unblocks_a_collective_whose_peer_never_arrives_and_fails_later_calls() {
    let nccl = nccl();
    let id = new_id();
    // Rank 1 joins and never issues anything.
    let peer = std::thread::spawn(move || Rank::join(id, 1, 2));
    let r = Rank::join(id, 0, 2);
    let peer = peer.join().unwrap();
    let buf = Buf::upload(&encode(&[1.0; 64], 7));
    // SAFETY: 64 f32, a live communicator and stream.
    ok("ncclAllReduce", r.comm, unsafe {
        (nccl.all_reduce)(buf.ptr(), buf.ptr(), 64, 7, 0, r.comm, r.raw_stream())
    });
    let done = r.stream.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !done.is_complete(),
        "the all-reduce finished without its peer"
    );
    assert_eq!(async_error(r.comm), SUCCESS, "pending is not an error");
    let aborted_at = Instant::now();
    // SAFETY: a live communicator; no other thread calls NCCL on it.
    assert_eq!(unsafe { (nccl.abort)(r.comm) }, SUCCESS);
    assert!(
        done.wait_timeout(Duration::from_secs(5)).unwrap(),
        "the stream's worker stayed blocked after the abort"
    );
    println!(
        "the worker returned {:?} after the abort",
        aborted_at.elapsed()
    );
    // Every later call on the aborted communicator fails.
    // SAFETY: the handle is no longer live; the emulator refuses it.
    let status =
        unsafe { (nccl.all_reduce)(buf.ptr(), buf.ptr(), 64, 7, 0, r.comm, r.raw_stream()) };
    assert_eq!(status, INVALID_USAGE);
    assert!(
        last_error(r.comm).contains("was aborted"),
        "{}",
        last_error(r.comm)
    );
    assert_ne!(async_error(r.comm), SUCCESS);
    // SAFETY: as above.
    assert_eq!(unsafe { (nccl.abort)(r.comm) }, INVALID_USAGE);
    // SAFETY: the peer's live communicator.
    assert_eq!(unsafe { (nccl.abort)(peer.comm) }, SUCCESS);
}

#[test]
fn mismatched_collectives_set_an_async_error_naming_both() {
    let nccl = nccl();
    let errors = on_threads(2, move |r| {
        let t = Buf::upload(&encode(&[1.0; 100], 7));
        let out = Buf::zeros(800);
        // SAFETY: 100 f32 in (and 200 out for the all-gather), a live communicator and stream.
        let status = unsafe {
            if r.rank == 0 {
                (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 7, 0, r.comm, r.raw_stream())
            } else {
                (nccl.all_gather)(t.ptr(), out.ptr(), 100, 7, r.comm, r.raw_stream())
            }
        };
        ok("issuing", r.comm, status);
        r.sync();
        let state = async_error(r.comm);
        let text = last_error(r.comm);
        // Later operations fail at once.
        // SAFETY: as above.
        let later =
            unsafe { (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 7, 0, r.comm, r.raw_stream()) };
        // SAFETY: a live communicator.
        assert_eq!(unsafe { (nccl.abort)(r.comm) }, SUCCESS);
        (state, later, text)
    });
    for (rank, (state, later, text)) in errors.iter().enumerate() {
        println!("rank {rank}: {text}");
        assert_eq!(*state, INVALID_USAGE, "rank {rank}");
        assert_eq!(*later, INVALID_USAGE, "rank {rank}");
        assert!(
            text.contains("mismatched collectives")
                && text.contains("ncclAllReduce(count 100, ncclFloat32, ncclSum) as collective #1")
                && text.contains("ncclAllGather(count 100, ncclFloat32) as collective #1"),
            "rank {rank}: {text}"
        );
    }
}

#[test]
fn a_wrong_data_type_that_reads_past_the_buffer_is_refused_naming_call_count_and_type() {
    let nccl = nccl();
    on_threads(1, move |r| {
        // 100 f32 (400 bytes) passed as 100 f64 (800 bytes).
        let t = Buf::upload(&encode(&[1.0; 100], 7));
        // SAFETY: the emulator checks the range before touching it.
        let status =
            unsafe { (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 8, 0, r.comm, r.raw_stream()) };
        let text = last_error(r.comm);
        println!("{text}");
        assert_eq!(status, INVALID_ARGUMENT);
        assert!(
            text.contains("ncclAllReduce(count 100, ncclFloat64)")
                && text.contains("800 bytes")
                && text.contains("not inside one live device allocation"),
            "{text}"
        );
        // An unknown data type and operator are refused too.
        // SAFETY: as above.
        unsafe {
            assert_eq!(
                (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 11, 0, r.comm, r.raw_stream()),
                INVALID_ARGUMENT
            );
            assert_eq!(
                (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 7, 9, r.comm, r.raw_stream()),
                INVALID_ARGUMENT
            );
        }
        // The communicator is intact: a right call works.
        // SAFETY: as above.
        ok("ncclAllReduce", r.comm, unsafe {
            (nccl.all_reduce)(t.ptr(), t.ptr(), 100, 7, 0, r.comm, r.raw_stream())
        });
        r.sync();
        r.destroy();
    });
}

#[test]
fn ids_the_emulator_did_not_make_are_refused() {
    let nccl = nccl();
    let mut garbage = Id([0; 128]);
    for (i, b) in garbage.0.iter_mut().enumerate() {
        *b = (i * 37 + 11) as i8;
    }
    let mut altered = new_id();
    altered.0[100] = 1;
    for (id, what) in [(garbage, "not made by"), (altered, "altered")] {
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: an out-parameter and an id (refused before use).
        let status = unsafe { (nccl.init_rank)(&mut comm, 2, id, 0) };
        assert_eq!(status, INVALID_ARGUMENT);
        let text = last_error(std::ptr::null_mut());
        assert!(text.contains(what), "{text}");
    }
}

/// A non-blocking init of rank 0 of `world` under `id` that must fail; its message.
fn init_fails(id: Id, rank: usize, world: usize) -> String {
    let comm = start_nonblocking(id, rank, world);
    let state = settle(comm);
    let text = last_error(comm);
    assert_eq!(state, INVALID_USAGE, "{text}");
    // SAFETY: a communicator of the emulator.
    assert_eq!(unsafe { (nccl().abort)(comm) }, SUCCESS);
    text
}

#[test]
fn a_forged_segment_header_is_refused() {
    nccl();
    let id = new_id();
    let path = segment_path(&id);
    std::fs::write(&path, vec![0x5Au8; 8192]).unwrap();
    let text = init_fails(id, 0, 2);
    let _ = std::fs::remove_file(&path);
    assert!(
        text.contains("is not a segment of the emulated NCCL"),
        "{text}"
    );
}

#[test]
fn a_rank_with_another_world_size_or_a_duplicate_rank_is_refused() {
    nccl();
    let id = new_id();
    let first = start_nonblocking(id, 0, 3);
    // Wait until rank 0 has joined (its rendezvous runs on a thread of its own).
    let view = Segment::open(&segment_path(&id), 3).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while view.joined() < 1 {
        assert!(Instant::now() < deadline, "rank 0 never joined");
        std::thread::sleep(Duration::from_millis(1));
    }
    let text = init_fails(id, 1, 2);
    assert!(
        text.contains("communicator of 2 ranks") && text.contains("one of 3"),
        "{text}"
    );
    let text = init_fails(id, 0, 3);
    assert!(
        text.contains("rank 0 joined this communicator twice"),
        "{text}"
    );
    assert_eq!(async_error(first), IN_PROGRESS);
    // SAFETY: a communicator of the emulator; aborting before the rendezvous removes the file.
    assert_eq!(unsafe { (nccl().abort)(first) }, SUCCESS);
    assert!(!std::path::Path::new(&segment_path(&id)).exists());
}

#[test]
fn a_peer_posting_an_impossible_length_is_an_error_not_a_wild_copy() {
    let nccl = nccl();
    let id = new_id();
    // A forged rank 1: maps the segment itself and joins.
    let forger = Segment::open(&segment_path(&id), 2).unwrap();
    forger.join(1).unwrap();
    let r = Rank::join(id, 0, 2);
    let slot = forger.slot(1);
    slot.set_desc(&Desc {
        kind: 1,
        dtype: 7,
        op: 0,
        root: 0,
        count: 16,
        seq: 1,
        part: 0,
        len: (CHUNK * 64) as u64,
    });
    slot.posted.store(1, std::sync::atomic::Ordering::Release);
    let t = Buf::upload(&encode(&[1.0; 16], 7));
    // SAFETY: 16 f32, a live communicator and stream.
    ok("ncclAllReduce", r.comm, unsafe {
        (nccl.all_reduce)(t.ptr(), t.ptr(), 16, 7, 0, r.comm, r.raw_stream())
    });
    r.sync();
    let text = last_error(r.comm);
    assert_ne!(async_error(r.comm), SUCCESS);
    assert!(text.contains("written by something else"), "{text}");
    // SAFETY: a live communicator.
    assert_eq!(unsafe { (nccl.abort)(r.comm) }, SUCCESS);
}
