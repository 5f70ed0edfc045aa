//! Hostile peers against a real rank: strangers without the job secret, idle connections, and
//! a member of the job that tries to make a rank read or write memory it chooses. Every test
//! talks to loopback only and ends by itself (bounded waits, timeouts).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tandem_core::{DType, Device, Tensor};

use super::frame::{Algorithm, FrameHeader};
use super::handshake::{connect_side, Channel, Me};
use super::same_host::{abstract_address, agree};
use super::segment::{create_segment, mark, recv_fd, send_fd, Counter, GROW_MESSAGE, HEADER};
use super::TcpProcessGroup;
use crate::auth::JobSecret;
use crate::process_group::{
    describe_all_reduce, describe_barrier, GroupConfig, ProcessGroup, ReduceOp,
};
use crate::store::{StoreConfig, StoreServer, TcpStore};
use crate::DistError;

const SECRET: &str = "attack-tests-job-secret-0123456789";

fn secret() -> JobSecret {
    JobSecret::from_value(SECRET).unwrap()
}

fn config() -> GroupConfig {
    GroupConfig {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(20),
        ..GroupConfig::default()
    }
}

/// A store requiring the job secret, and an authenticated client of it (the test's view).
fn store() -> (StoreServer, String, TcpStore) {
    let server = StoreServer::bind_with(
        "127.0.0.1:0",
        StoreConfig {
            secret: Some(secret()),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let addr = server.local_addr().to_string();
    let view =
        TcpStore::connect_with_secret(&addr, Duration::from_secs(5), Some(secret())).unwrap();
    (server, addr, view)
}

/// A real rank that joins a group of 2 and all-reduces `[rank + 1; 1000]` (sum).
fn real_rank(
    addr: &str,
    rank: usize,
    config: GroupConfig,
) -> JoinHandle<Result<Vec<f32>, DistError>> {
    let addr = addr.to_string();
    std::thread::spawn(move || {
        let store = Arc::new(TcpStore::connect_with_secret(
            &addr,
            Duration::from_secs(10),
            Some(secret()),
        )?);
        let pg = TcpProcessGroup::connect(store, rank, 2, config)?;
        let t = Tensor::full(&[1000], (rank + 1) as f64, DType::F32, Device::Cpu).unwrap();
        pg.all_reduce(&t, ReduceOp::Sum)?.wait()?;
        Ok(t.to_vec::<f32>().unwrap())
    })
}

fn rank0_addr(view: &TcpStore) -> SocketAddr {
    String::from_utf8(view.get("tandem/default/addr/0").unwrap())
        .unwrap()
        .parse()
        .unwrap()
}

fn me(rank: usize, secret: Option<&str>, channel: Channel) -> Me {
    Me {
        rank,
        world: 2,
        name: "default".into(),
        channel,
        secret: secret.map(|s| JobSecret::from_value(s).unwrap()),
    }
}

/// Data frames carrying 1e30 for rank 0's all-reduce, then an abort frame blaming rank 0.
fn injection() -> Vec<u8> {
    let t = Tensor::zeros(&[1000], DType::F32, Device::Cpu).unwrap();
    let desc = describe_all_reduce(1, &t, ReduceOp::Sum).unwrap();
    let mut bytes = FrameHeader::data(desc, Algorithm::Direct, 1, 0, 4000)
        .encode()
        .to_vec();
    bytes.extend(std::iter::repeat_n(1e30f32.to_le_bytes(), 1000).flatten());
    let msg = b"forged: rank 0 is broken";
    bytes.extend_from_slice(&FrameHeader::abort(1, Some(0), msg.len()).encode());
    bytes.extend_from_slice(msg);
    bytes
}

#[test]
fn a_stranger_cannot_take_a_rank_slot_inject_gradients_or_forge_an_abort() {
    let (_server, addr, view) = store();
    let rank0 = real_rank(&addr, 0, config());
    let target = rank0_addr(&view);
    let deadline = Instant::now() + Duration::from_secs(5);

    // Claiming rank 1 without the secret, and with a wrong one: refused by the handshake.
    let mut s = TcpStream::connect(target).unwrap();
    let err = connect_side(&mut s, &me(1, None, Channel::Link), 0, "rank 0", deadline).unwrap_err();
    assert!(err.contains("requires the job secret"), "{err}");
    let _ = s.write_all(&injection());
    let mut s = TcpStream::connect(target).unwrap();
    let wrong = Some("not-the-job-secret-0123456789");
    let err =
        connect_side(&mut s, &me(1, wrong, Channel::Link), 0, "rank 0", deadline).unwrap_err();
    assert!(err.contains("could not prove"), "{err}");
    let _ = s.write_all(&injection());
    // A raw hello claiming rank 1 followed at once by gradients and an abort, no proof.
    let mut raw = TcpStream::connect(target).unwrap();
    let mut hello = FrameHeader::hello(1, 2, 2 + 32 + 7).encode().to_vec();
    hello.extend_from_slice(&[0, 1]);
    hello.extend_from_slice(&[9u8; 32]);
    hello.extend_from_slice(b"default");
    raw.write_all(&hello).unwrap();
    let _ = raw.write_all(&[0u8; 48 + 32]);
    let _ = raw.write_all(&injection());

    // The real rank 1 still gets its slot, and the job completes with the right sum.
    let rank1 = real_rank(&addr, 1, config());
    for (rank, handle) in [rank0, rank1].into_iter().enumerate() {
        let got = handle
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            got.iter().all(|&x| x == 3.0),
            "rank {rank}: {:?}",
            &got[..4]
        );
    }
    drop(raw);
}

#[test]
fn three_idle_connections_do_not_delay_rendezvous() {
    let (_server, addr, view) = store();
    let rank0 = real_rank(&addr, 0, config());
    let target = rank0_addr(&view);
    let idle: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(target).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let rank1 = real_rank(&addr, 1, config());
    for handle in [rank0, rank1] {
        handle.join().unwrap().unwrap();
    }
    // Each idle connection used to hold the accept loop for its 10 s hello timeout.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "rendezvous took {:?}",
        started.elapsed()
    );
    drop(idle);
}

/// Rank 0 is real; rank 1 is this test, a member of the job (it has the secret) that joins the
/// mesh honestly and then misbehaves. Returns rank 0's error for a 4 MiB all-reduce.
fn with_insider_rank_1(misbehave: impl FnOnce(&TcpStore, &mut TcpStream)) -> DistError {
    let (err, _) = insider_against_rank_0(config(), |store, link| {
        misbehave(store, link);
        Instant::now()
    });
    err
}

/// Like [`with_insider_rank_1`] with rank 0 under `config`; `misbehave` returns when it
/// stopped. Returns rank 0's error and how long its all-reduce took.
fn insider_against_rank_0(
    config: GroupConfig,
    misbehave: impl FnOnce(&TcpStore, &mut TcpStream) -> Instant,
) -> (DistError, Duration) {
    let (_server, addr, view) = store();
    let rank0 = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let store = Arc::new(
                TcpStore::connect_with_secret(&addr, Duration::from_secs(10), Some(secret()))
                    .unwrap(),
            );
            let pg = TcpProcessGroup::connect(store, 0, 2, config).unwrap();
            let t = Tensor::ones(&[1 << 20], DType::F32, Device::Cpu).unwrap();
            let started = Instant::now();
            let result = pg.all_reduce(&t, ReduceOp::Sum).unwrap().wait();
            let took = started.elapsed();
            let err = result.map(|()| format!("rank 0's all-reduce succeeded after {took:?}"));
            (err.unwrap_err(), took)
        })
    };
    let target = rank0_addr(&view);
    let mut link = TcpStream::connect(target).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    connect_side(
        &mut link,
        &me(1, Some(SECRET), Channel::Link),
        0,
        "rank 0",
        deadline,
    )
    .unwrap();
    let started = misbehave(&view, &mut link);
    let (err, took) = rank0.join().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "failed promptly: {err}"
    );
    (err, took)
}

/// The frame that ends phase `phase` of a same-host collective on 2^20 f32.
fn phase_frame(phase: u64) -> [u8; 48] {
    let t = Tensor::zeros(&[1 << 20], DType::F32, Device::Cpu).unwrap();
    let desc = describe_all_reduce(1, &t, ReduceOp::Sum).unwrap();
    FrameHeader::data(desc, Algorithm::SameHost, 1, phase, 0).encode()
}

#[test]
fn publishing_another_process_address_cannot_make_rank_0_write_there() {
    // The old same-host path trusted `pid address token` published in the store and the
    // buffer address sent in the first phase, and process_vm_writev'd the result there. The
    // victim here is a buffer of this process (rank 0 is a thread of it, so it could reach it).
    let victim = vec![0x5Au8; 1 << 22];
    let pid = std::process::id();
    let addr = victim.as_ptr() as usize;
    let err = with_insider_rank_1(|store, link| {
        let token: String = victim[..32].iter().map(|b| format!("{b:02x}")).collect();
        store
            .set(
                "tandem/default/same_host/probe/1",
                format!("{pid} {addr} {token}").as_bytes(),
            )
            .unwrap();
        store.set("tandem/default/same_host/ok/1", b"1").unwrap();
        store.set("tandem/default/same_host/socket/1", b"").unwrap();
        store
            .set("tandem/default/same_host/reachable/1", b"0")
            .unwrap();
        // Phase 0 of the old protocol: "my buffer is at `addr`, 4 MiB long".
        let t = Tensor::zeros(&[1 << 20], DType::F32, Device::Cpu).unwrap();
        let desc = describe_all_reduce(1, &t, ReduceOp::Sum).unwrap();
        let mut frame = FrameHeader::data(desc, Algorithm::SameHost, 1, 0, 16)
            .encode()
            .to_vec();
        frame.extend_from_slice(&(addr as u64).to_le_bytes());
        frame.extend_from_slice(&(1u64 << 22).to_le_bytes());
        link.write_all(&frame).unwrap();
    });
    assert_eq!(err.blamed_ranks(), vec![1], "{err}");
    assert!(matches!(err, DistError::Protocol { peer: 1, .. }), "{err}");
    assert!(
        victim.iter().all(|&b| b == 0x5A),
        "rank 0 wrote into the victim"
    );
}

/// Joins the same-host channel of rank 0 as rank 1 and returns it.
fn join_same_host(store: &TcpStore) -> UnixStream {
    let name = store
        .get_timeout("tandem/default/same_host/socket/0", Duration::from_secs(10))
        .unwrap();
    let sock = std::os::unix::net::SocketAddr::from_abstract_name(&name).unwrap();
    let mut channel = UnixStream::connect_addr(&sock).unwrap();
    store
        .set("tandem/default/same_host/socket/1", b"unused")
        .unwrap();
    store
        .set("tandem/default/same_host/reachable/1", b"1")
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    connect_side(
        &mut channel,
        &me(1, Some(SECRET), Channel::SameHost),
        0,
        "rank 0",
        deadline,
    )
    .unwrap();
    channel
}

fn segment_message(capacity: usize) -> [u8; GROW_MESSAGE] {
    let mut m = [0u8; GROW_MESSAGE];
    m[..8].copy_from_slice(&(capacity as u64).to_le_bytes());
    m[8..].copy_from_slice(&1u64.to_le_bytes());
    m
}

#[test]
fn a_segment_that_could_shrink_or_is_too_small_or_is_no_memory_file_is_refused() {
    // Two ranks with the default 256 KiB chunks agree on segments of 4 slots × 2 pieces.
    let capacity = 4 * 2 * (256 << 10);
    let pipe = || {
        let mut fds = [0; 2];
        // SAFETY: pipe(2) writes two new descriptors into the live array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned by nothing else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    };
    let unsealed = move || {
        // SAFETY: a valid name; a fresh descriptor is returned.
        let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is fresh; ftruncate takes plain integers.
        unsafe {
            assert_eq!(libc::ftruncate(fd, capacity as libc::off_t), 0);
            OwnedFd::from_raw_fd(fd)
        }
    };
    type MakeFd = Box<dyn Fn() -> OwnedFd>;
    let cases: Vec<(MakeFd, &str)> = vec![
        (Box::new(unsealed), "sealed"),
        (Box::new(|| create_segment(4096).unwrap().0), "4096 bytes"),
        (Box::new(move || pipe().0), "sealed"),
    ];
    for (make, want) in cases {
        let err = with_insider_rank_1(|store, link| {
            let channel = join_same_host(store);
            let fd = make();
            send_fd(&channel, fd.as_raw_fd(), &segment_message(capacity)).unwrap();
            link.write_all(&phase_frame(0)).unwrap();
            // Keep the channel open until rank 0 has judged the segment.
            std::thread::sleep(Duration::from_millis(300));
            drop(channel);
        });
        assert!(matches!(err, DistError::Protocol { peer: 1, .. }), "{err}");
        assert!(err.to_string().contains(want), "{err}");
    }
}

#[test]
fn a_member_sending_another_collective_on_the_same_host_path_is_named() {
    let err = with_insider_rank_1(|store, link| {
        let _channel = join_same_host(store);
        let barrier = FrameHeader::data(describe_barrier(), Algorithm::Direct, 1, 0, 0).encode();
        // Rank 0 issues an all-reduce; a barrier frame is a mismatch naming both.
        link.write_all(&barrier).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    assert!(matches!(err, DistError::Mismatch { peer: 1, .. }), "{err}");
}

#[test]
fn a_flood_of_idle_connections_during_rendezvous_does_not_keep_a_rank_out() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    const FLOOD: usize = 300;
    let (_server, addr, view) = store();
    let rank0 = real_rank(&addr, 0, config());
    let target = rank0_addr(&view);
    // A stranger opens 300 idle connections: 200 at once (more than rank 0's 128 handshake
    // slots), then one every 10 ms while rank 1 joins; it holds them all until it is done.
    let opened = Arc::new(AtomicUsize::new(0));
    let flood = {
        let opened = opened.clone();
        std::thread::spawn(move || {
            let mut idle = Vec::new();
            for i in 0..FLOOD {
                if let Ok(s) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
                    idle.push(s);
                }
                opened.store(i + 1, Ordering::SeqCst);
                if i >= 200 {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            idle
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while opened.load(Ordering::SeqCst) < 200 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Let rank 0 accept them and fill its handshake slots.
    std::thread::sleep(Duration::from_millis(200));
    let rank1 = real_rank(&addr, 1, config());
    for handle in [rank0, rank1] {
        assert_eq!(handle.join().unwrap().unwrap(), vec![3.0f32; 1000]);
    }
    drop(flood.join().unwrap());
}

#[test]
fn a_rank_whose_handshake_is_closed_connects_again() {
    use super::mesh::connect_to_peer;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    // Rank 0 (this test) closes the first three connections during their handshake, then
    // completes the fourth.
    let acceptor = std::thread::spawn(move || {
        for _ in 0..3 {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        }
        let (mut s, _) = listener.accept().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        super::handshake::accept_side(
            &mut s,
            &me(0, Some(SECRET), Channel::Link),
            "rank 1",
            deadline,
        )
        .map_err(|f| format!("{f:?}"))
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let connected = connect_to_peer(&me(1, Some(SECRET), Channel::Link), 0, target, deadline);
    assert!(connected.is_ok(), "{:?}", connected.err());
    assert_eq!(acceptor.join().unwrap(), Ok(1));
}

#[test]
fn a_flood_of_idle_connections_on_a_same_host_socket_does_not_keep_a_rank_out() {
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
    let name = format!("tandem-flood-test-{}", std::process::id());
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = UnixListener::bind_addr(&addr).unwrap();
    let rank0 = std::thread::spawn(move || {
        let config = GroupConfig {
            connect_timeout: Duration::from_secs(20),
            ..GroupConfig::default()
        };
        let me = me(0, Some(SECRET), Channel::SameHost);
        super::mesh::accept_peers(&listener, &me, &config, Instant::now())
            .map(|got| got.into_iter().map(|(q, _)| q).collect::<Vec<_>>())
    });
    // 200 idle connections (more than rank 0's 128 handshake slots), held during the join.
    let idle: Vec<UnixStream> = (0..200)
        .filter_map(|_| UnixStream::connect_addr(&addr).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let joined = connect_side(
        &mut s,
        &me(1, Some(SECRET), Channel::SameHost),
        0,
        "rank 0's same-host socket",
        deadline,
    );
    assert!(joined.is_ok(), "{joined:?}");
    assert_eq!(rank0.join().unwrap().unwrap(), vec![1]);
    drop(idle);
}

/// Bytes of the data area two ranks with the default 256 KiB chunks agree on: 4 slots × 2
/// pieces.
const CAPACITY: usize = 4 * 2 * (256 << 10);

/// A new Unix-domain socket (non-blocking unless `blocking`), owned.
fn unix_socket(blocking: bool) -> OwnedFd {
    let nonblock = if blocking { 0 } else { libc::SOCK_NONBLOCK };
    // SAFETY: socket(2) takes plain integers and returns a new descriptor.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | nonblock, 0) };
    assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
    // SAFETY: `fd` is fresh and owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[test]
fn a_peer_that_never_accepts_on_its_same_host_socket_is_named_by_the_setup_deadline() {
    let (_server, addr, view) = store();
    // Rank 0 (this test) listens with a backlog of one pending connection, fills it, and never
    // accepts: a blocking connect to it waits for ever.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let name = format!("tandem-test-full-{}-{nanos}", std::process::id());
    let (sockaddr, len) = abstract_address(name.as_bytes()).unwrap();
    let as_sockaddr = (&sockaddr as *const libc::sockaddr_un).cast::<libc::sockaddr>();
    let listener = unix_socket(true);
    // SAFETY: `sockaddr` is a live, initialised address of `len` bytes; bind and listen only
    // read it and take plain integers.
    unsafe {
        assert_eq!(libc::bind(listener.as_raw_fd(), as_sockaddr, len), 0);
        assert_eq!(libc::listen(listener.as_raw_fd(), 0), 0);
    }
    let mut pending = Vec::new();
    let full = (0..64).any(|_| {
        let s = unix_socket(false);
        // SAFETY: as above; connect only reads the address.
        if unsafe { libc::connect(s.as_raw_fd(), as_sockaddr, len) } == 0 {
            pending.push(s);
            return false;
        }
        let err = io::Error::last_os_error();
        assert_eq!(err.raw_os_error(), Some(libc::EAGAIN), "{err}");
        true
    });
    assert!(full, "the backlog never filled");
    view.set("tandem/default/same_host/socket/0", name.as_bytes())
        .unwrap();

    // Rank 1 connects to it during setup, with a 2 s connect timeout.
    let connect_timeout = Duration::from_secs(2);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let store =
            TcpStore::connect_with_secret(&addr, Duration::from_secs(10), Some(secret())).unwrap();
        let config = GroupConfig {
            connect_timeout,
            ..config()
        };
        let started = Instant::now();
        let result = agree(&store, 1, 2, &config, started).map(|sh| sh.is_some());
        let _ = tx.send((result, started.elapsed()));
    });
    let (result, took) = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| {
        panic!("rank 1 is still connecting to rank 0's full socket after 10 s ({connect_timeout:?} connect timeout)")
    });
    let err = result.expect_err("rank 1 connected to a socket that accepts nothing");
    assert!(matches!(err, DistError::Connect { rank: 1, .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("rank 0's same-host socket"), "{message}");
    assert!(message.contains(&name), "{message}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {message}");
    drop(pending);
}

/// Rank 1 as an insider on the same-host path, late at every step: before each thing rank 0
/// waits for (its progress counters; with `late_setup` also its phase frame and its segment)
/// it sleeps `late`, less than rank 0's timeout, so that each wait of rank 0 on its own would
/// succeed. Stops when rank 0 writes anything after its phase frame (its abort or goodbye).
fn late_at_every_step(
    store: &TcpStore,
    link: &mut TcpStream,
    late: Duration,
    late_setup: bool,
) -> Instant {
    let channel = join_same_host(store);
    link.set_read_timeout(Some(Duration::from_millis(10)))
        .unwrap();
    let mut heard = 0usize;
    // Sleeps `late`, watching the link; false once rank 0 has finished its collective.
    let mut nap = |link: &mut TcpStream| {
        let until = Instant::now() + late;
        let mut buf = [0u8; 256];
        while Instant::now() < until {
            match link.read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => heard += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return false,
            }
            // More than rank 0's phase frame: it has aborted or said goodbye.
            if heard > phase_frame(0).len() {
                return false;
            }
        }
        true
    };
    if late_setup && !nap(link) {
        return Instant::now();
    }
    link.write_all(&phase_frame(0)).unwrap();
    if late_setup && !nap(link) {
        return Instant::now();
    }
    let (fd, own) = create_segment(HEADER + CAPACITY).unwrap();
    send_fd(&channel, fd.as_raw_fd(), &segment_message(CAPACITY)).unwrap();
    // 8 pieces of rank 0's 2 MiB share; a few more steps than needed, in case.
    for step in 1..=12 {
        if !nap(link) {
            break;
        }
        for counter in [Counter::Staged, Counter::Reduced, Counter::Consumed] {
            own.counter(counter).store(mark(1, step), Ordering::Release);
        }
    }
    Instant::now()
}

#[test]
fn a_peer_late_at_every_step_cannot_stretch_a_same_host_collective_past_the_timeout() {
    let timeout = Duration::from_secs(1);
    let config = GroupConfig {
        timeout,
        ..config()
    };
    for late_setup in [false, true] {
        let (err, took) = insider_against_rank_0(config.clone(), |store, link| {
            late_at_every_step(store, link, timeout * 7 / 10, late_setup)
        });
        assert!(
            matches!(&err, DistError::Timeout { rank: 0, seq: 1, waiting_for, .. } if waiting_for == &[1]),
            "late setup {late_setup}: {err}"
        );
        assert!(err.to_string().contains("all_reduce"), "{err}");
        // Each wait alone ends within the timeout; the collective as a whole must too.
        assert!(
            took < Duration::from_secs(3),
            "late setup {late_setup}: the all-reduce failed only after {took:?} with a timeout \
             of {timeout:?}: {err}"
        );
    }
}

/// The error `op` returned, or a panic naming `what` if it succeeded.
fn refused(rc: libc::c_int, what: &str) -> io::Error {
    assert!(rc < 0, "a peer could {what} rank 0's segment");
    io::Error::last_os_error()
}

/// Tries to write into a received segment `fd` of `len` bytes every way a peer could.
fn try_to_write_through(fd: RawFd, len: usize) {
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a new mapping with a null hint touches no existing memory; unmapped at once if
    // it were created.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, rw, libc::MAP_SHARED, fd, 0) };
    if ptr != libc::MAP_FAILED {
        // SAFETY: `ptr`/`len` is the mapping just created.
        unsafe { libc::munmap(ptr, len) };
        panic!("a peer mapped rank 0's segment writable (PROT_WRITE, MAP_SHARED)");
    }
    let err = io::Error::last_os_error();
    assert!(
        matches!(err.raw_os_error(), Some(libc::EPERM | libc::EACCES)),
        "{err}"
    );
    let byte = [0xEEu8];
    // SAFETY: `byte` is live for the call; pwrite only reads it.
    let rc = unsafe { libc::pwrite(fd, byte.as_ptr().cast(), 1, HEADER as libc::off_t) };
    let _ = refused(rc as libc::c_int, "write(2) into");
    // A read-only mapping cannot be made writable afterwards.
    // SAFETY: as above, read-only.
    let ro = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(ro, libc::MAP_FAILED, "{}", io::Error::last_os_error());
    // SAFETY: `ro`/`len` is the mapping just created; mprotect changes only its protection.
    let rc = unsafe { libc::mprotect(ro, len, rw) };
    // SAFETY: as above.
    unsafe { libc::munmap(ro, len) };
    let _ = refused(rc, "mprotect a read-only mapping of");
    // Nor does a new, read-write open of the same file.
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    // SAFETY: `path` is a valid NUL-terminated string.
    let reopened = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if reopened >= 0 {
        // SAFETY: `reopened` is fresh and owned by nothing else.
        let reopened = unsafe { OwnedFd::from_raw_fd(reopened) };
        // SAFETY: as for the first mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                rw,
                libc::MAP_SHARED,
                reopened.as_raw_fd(),
                0,
            )
        };
        assert_eq!(
            ptr,
            libc::MAP_FAILED,
            "a peer mapped a reopened segment writable"
        );
        // SAFETY: `byte` is live for the call.
        let rc = unsafe { libc::pwrite(reopened.as_raw_fd(), byte.as_ptr().cast(), 1, 0) };
        let _ = refused(rc as libc::c_int, "write(2) through a reopened");
    }
}

#[test]
fn a_peer_cannot_write_into_a_segment_it_received() {
    let err = with_insider_rank_1(|store, link| {
        let channel = join_same_host(store);
        link.write_all(&phase_frame(0)).unwrap();
        let (fd, message) = recv_fd(&channel, Instant::now() + Duration::from_secs(5)).unwrap();
        let fd = fd.expect("rank 0 sent its segment");
        let mut word = [0u8; 8];
        word.copy_from_slice(&message[..8]);
        assert_eq!(u64::from_le_bytes(word), CAPACITY as u64);
        try_to_write_through(fd.as_raw_fd(), HEADER + CAPACITY);
        // Rank 1 leaves without sending a segment: rank 0 names it.
    });
    assert_eq!(err.blamed_ranks(), vec![1], "{err}");
}

#[test]
fn a_segment_others_could_write_or_that_is_not_the_peers_own_is_refused() {
    // A memory file sealed as segments were before: against shrinking, growing and more
    // seals, but not against writing.
    let writable = || {
        // SAFETY: a valid name; a fresh descriptor is returned.
        let fd = unsafe {
            libc::memfd_create(
                c"writable".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0);
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: `fd` is fresh; ftruncate and fcntl take plain integers.
        unsafe {
            assert_eq!(libc::ftruncate(fd, (HEADER + CAPACITY) as libc::off_t), 0);
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, seals), 0);
            OwnedFd::from_raw_fd(fd)
        }
    };
    for own_back in [false, true] {
        let err = with_insider_rank_1(|store, link| {
            let channel = join_same_host(store);
            link.write_all(&phase_frame(0)).unwrap();
            let fd = if own_back {
                // Rank 0's own segment, handed back as rank 1's.
                let (fd, _) = recv_fd(&channel, Instant::now() + Duration::from_secs(5)).unwrap();
                fd.expect("rank 0 sent its segment")
            } else {
                writable()
            };
            send_fd(&channel, fd.as_raw_fd(), &segment_message(CAPACITY)).unwrap();
            // Keep the channel open until rank 0 has judged the segment.
            std::thread::sleep(Duration::from_millis(300));
            drop(channel);
        });
        assert!(matches!(err, DistError::Protocol { peer: 1, .. }), "{err}");
        let want = if own_back {
            "not its own"
        } else {
            "not sealed against writing"
        };
        assert!(err.to_string().contains(want), "{err}");
    }
}

#[test]
fn a_rank_whose_same_host_handshake_is_dropped_connects_again() {
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
    let (_server, addr, view) = store();
    // Rank 0 (this test) drops rank 1's first three connections during their handshake, as a
    // listener under a flood drops its oldest pending handshakes, then completes the fourth.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let name = format!("tandem-test-dropped-{}-{nanos}", std::process::id());
    let listener =
        UnixListener::bind_addr(&UnixAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    view.set("tandem/default/same_host/socket/0", name.as_bytes())
        .unwrap();
    view.set("tandem/default/same_host/reachable/0", b"1")
        .unwrap();
    let acceptor = std::thread::spawn(move || {
        for _ in 0..3 {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        }
        let (mut s, _) = listener.accept().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        super::handshake::accept_side(
            &mut s,
            &me(0, Some(SECRET), Channel::SameHost),
            "rank 1",
            deadline,
        )
        .map_err(|f| format!("{f:?}"))
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let store =
            TcpStore::connect_with_secret(&addr, Duration::from_secs(10), Some(secret())).unwrap();
        let config = GroupConfig {
            connect_timeout: Duration::from_secs(10),
            ..config()
        };
        let result = agree(&store, 1, 2, &config, Instant::now()).map(|sh| sh.is_some());
        let _ = tx.send(result);
    });
    let result = rx
        .recv_timeout(Duration::from_secs(15))
        .expect("rank 1 is still setting up its same-host channel after 15 s");
    assert!(matches!(result, Ok(true)), "{result:?}");
    assert_eq!(acceptor.join().unwrap(), Ok(1));
}
