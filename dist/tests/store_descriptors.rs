//! A port scan against the rendezvous store: thousands of connections that close at once (some
//! after sending garbage) leave no file descriptor behind, and rendezvous still works. Alone in
//! its test binary, so that the process's descriptor count is this test's to read.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tandem_dist::{StoreServer, TcpStore};

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Waits (up to 20 s) until the descriptor count is back to `baseline`; returns the last count
/// seen, so as soon as it is back.
fn settle(baseline: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = open_descriptors();
        if now <= baseline || Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn thousands_of_short_connections_leave_no_descriptor_behind() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().to_string();
    // Warm up (threads, the allocator), then take the baseline with the server idle: once the
    // server has closed its end of the warm-up connection, the count is back to what it was
    // before it (or, if the warm-up left something open for good, what it is after 20 s).
    let idle = open_descriptors();
    drop(TcpStream::connect(&addr).unwrap());
    let baseline = settle(idle).max(idle);
    for round in 0..60 {
        let batch: Vec<TcpStream> = (0..50)
            .filter_map(|_| TcpStream::connect(&addr).ok())
            .collect();
        for (k, mut conn) in batch.into_iter().enumerate() {
            if (round + k) % 3 == 0 {
                let _ = conn.write_all(b"GET / HTTP/1.0\r\n\r\n");
            }
        }
        // Let the server accept the batch before the next one: the kernel queues at most 128
        // connections it has not accepted and drops the next SYNs, which the client resends
        // only after a second — 20 s of stalls in all. A store request answered on a new
        // connection means every connection queued before it was accepted.
        TcpStore::connect(&addr, Duration::from_secs(10))
            .and_then(|s| s.check(&["pace"]))
            .unwrap();
    }
    let after = settle(baseline);
    assert!(
        after <= baseline,
        "{} descriptors remain open after 3060 closed connections ({baseline} before)",
        after
    );
    let store = TcpStore::connect(&addr, Duration::from_secs(10)).unwrap();
    store.set("after the scan", b"still works").unwrap();
    assert_eq!(store.get("after the scan").unwrap(), b"still works");
    drop(store);
    assert!(settle(baseline) <= baseline);
}
