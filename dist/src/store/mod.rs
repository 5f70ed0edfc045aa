//! The rendezvous store: a small TCP key-value server ([`StoreServer`]) and its client
//! ([`TcpStore`]).
//!
//! Before ranks can talk to each other they need to find each other. One process — rank 0, or
//! the `tandem-run` launcher on node 0 — serves the store at `MASTER_ADDR:MASTER_PORT`; every
//! rank connects to it, publishes what the others need (its listening address) and waits for
//! what it needs from them. The operations are those of PyTorch's `TCPStore`: `set`, `get`
//! (waits for the key), `add` (an atomic counter), `wait` for several keys, `check`, `delete`;
//! and two that heartbeats need: `get_many` (several keys at once, without waiting) and
//! `set_will` (a key the server sets when the client's connection closes, so that a process
//! that dies is noticed at once). Every blocking call has a timeout, and a server that goes
//! away is an error, not a hang.
//!
//! Every connection starts with a handshake in which the client speaks first (see `wire`), so a
//! program on the port that is not a tandem store is recognised by its first answer, and in
//! which both sides prove that they know the job secret ([`JobSecret`]) when the server has
//! one; until then nothing the client sends is read as a request. Lengths are capped (keys 4
//! KiB, values 64 MiB, 4096 keys and [`MAX_REQUEST_KEY_BYTES`] of keys per request) and checked
//! before anything is allocated; a request over the caps, or malformed, closes the connection
//! or is answered with an error. The server bounds connections, request time, how long one
//! request waits, and the memory clients can make it hold ([`StoreConfig`]).

mod server;
mod wire;

use std::io::{self, Write};
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use server::{StoreConfig, StoreServer};
pub use wire::MAX_REQUEST_KEY_BYTES;
use wire::*;

use crate::auth::JobSecret;
use crate::{DistError, Result};

/// How long past a request's own timeout the client waits for the server's answer.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// Longest time a client waits for the store's handshake answer.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// How often a client still trying to reach the store says so on stderr, unless told otherwise
/// ([`TcpStore::connect_logging`]).
const CONNECT_LOG_INTERVAL: Duration = Duration::from_secs(30);

// ---- client -------------------------------------------------------------------------------

/// A connection to a rendezvous store. Thread-safe; requests are serialised.
pub struct TcpStore {
    addr: String,
    conn: Mutex<TcpStream>,
    timeout: Duration,
    local_ip: IpAddr,
    secret: Option<JobSecret>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpStore({})", self.addr)
    }
}

impl TcpStore {
    /// Connects to the store at `addr` (`host:port`) without a job secret (for a store that
    /// serves anyone), retrying until `timeout` while the server is not up yet. `timeout` is
    /// also the default timeout of `get` and `wait`.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        Self::connect_with_secret(addr, timeout, None)
    }

    /// Connects to the store at `addr`, proving knowledge of `secret` and requiring the store to
    /// prove it too (`None`: a store without authentication). Retries until `timeout` while
    /// nothing listens or the store refuses connections for now, saying so on stderr every 30 s;
    /// fails at once when `addr` cannot be resolved, when the program listening there is not a
    /// tandem store, or when the secrets do not match.
    pub fn connect_with_secret(
        addr: &str,
        timeout: Duration,
        secret: Option<JobSecret>,
    ) -> Result<Self> {
        Self::connect_logging(addr, timeout, secret, "this process", CONNECT_LOG_INTERVAL)
    }

    /// [`TcpStore::connect_with_secret`], saying on stderr every `log_interval` while the store
    /// does not answer yet: `tandem: <who>: still waiting for the rendezvous store at <addr>
    /// (<why the last try failed>; <time> so far, timeout <timeout>)`. `who` names the waiting
    /// process, e.g. `rank 3`.
    pub fn connect_logging(
        addr: &str,
        timeout: Duration,
        secret: Option<JobSecret>,
        who: &str,
        log_interval: Duration,
    ) -> Result<Self> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut next_log = started + log_interval;
        let fail = |detail: String| DistError::Store {
            addr: addr.to_string(),
            op: "connect".into(),
            detail,
        };
        let mut last_error = String::from("no address");
        loop {
            let candidates: Vec<_> = addr
                .to_socket_addrs()
                .map_err(|e| {
                    fail(format!(
                        "cannot resolve {addr:?}: {e}; check MASTER_ADDR (and MASTER_PORT)"
                    ))
                })?
                .collect();
            for candidate in candidates {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), Duration::from_secs(5));
                let conn = match TcpStream::connect_timeout(&candidate, left) {
                    Ok(conn) => conn,
                    Err(e) => {
                        last_error = e.to_string();
                        continue;
                    }
                };
                let _ = conn.set_nodelay(true);
                let wait = deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_secs(2), HANDSHAKE_WAIT);
                match client_handshake(&conn, addr, secret.as_ref(), Instant::now() + wait) {
                    Ok(()) => {
                        let local_ip = conn
                            .local_addr()
                            .map_err(|e| DistError::io("store: local address", e))?
                            .ip();
                        return Ok(TcpStore {
                            addr: addr.to_string(),
                            conn: Mutex::new(conn),
                            timeout,
                            local_ip,
                            secret,
                        });
                    }
                    Err(ClientFailure::Fatal(detail)) => return Err(fail(detail)),
                    Err(ClientFailure::Retry(detail)) => last_error = detail,
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(fail(format!(
                    "no store answered within {timeout:?} ({last_error}); is rank 0 (or \
                     tandem-run) running, and are MASTER_ADDR/MASTER_PORT right?"
                )));
            }
            if now >= next_log {
                eprintln!(
                    "tandem: {who}: still waiting for the rendezvous store at {addr} \
                     ({last_error}; {:.0?} so far, timeout {timeout:?}); is rank 0 (or \
                     tandem-run) running, and are MASTER_ADDR/MASTER_PORT right?",
                    now.duration_since(started)
                );
                next_log = now + log_interval;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The job secret this client authenticated with, if any (a process group that meets
    /// through this store authenticates its connections with the same secret).
    pub fn secret(&self) -> Option<&JobSecret> {
        self.secret.as_ref()
    }

    /// The store's address as given to [`TcpStore::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The default timeout of `get` and `wait`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The local IP address this process uses to reach the store (the interface other ranks
    /// can reach it on, too).
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn error(&self, op: String, detail: impl Into<String>) -> DistError {
        DistError::Store {
            addr: self.addr.clone(),
            op,
            detail: detail.into(),
        }
    }

    /// Sends `request`, reads the reply with `parse` (given the status byte), all within
    /// `wait` plus a grace period.
    fn call<T>(
        &self,
        op: impl Fn() -> String,
        request: &[u8],
        wait: Duration,
        parse: impl FnOnce(u8, &mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let mut conn = self.conn.lock();
        self.call_on(&mut conn, op, request, wait, parse)
    }

    /// [`TcpStore::call`] on the already locked connection.
    fn call_on<T>(
        &self,
        conn: &mut TcpStream,
        op: impl Fn() -> String,
        request: &[u8],
        wait: Duration,
        parse: impl FnOnce(u8, &mut TcpStream) -> io::Result<T>,
    ) -> Result<T> {
        let io_err = |e: io::Error| {
            use io::ErrorKind::*;
            let detail = match e.kind() {
                UnexpectedEof | ConnectionReset | BrokenPipe => {
                    "the store closed the connection (did the process serving it, rank 0 or \
                     tandem-run, exit?)"
                        .to_string()
                }
                WouldBlock | TimedOut => "the store did not answer in time".to_string(),
                _ => e.to_string(),
            };
            self.error(op(), detail)
        };
        conn.set_write_timeout(Some(REPLY_GRACE)).map_err(io_err)?;
        conn.set_read_timeout(Some(wait + REPLY_GRACE))
            .map_err(io_err)?;
        conn.write_all(request).map_err(io_err)?;
        let status = read_u8(conn).map_err(io_err)?;
        if status == STATUS_ERROR {
            let msg = read_bytes(conn, MAX_MESSAGE).map_err(io_err)?;
            return Err(self.error(op(), String::from_utf8_lossy(&msg).into_owned()));
        }
        parse(status, conn).map_err(io_err)
    }

    /// Sets `key` to `value`, waking anyone waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        if value.len() > MAX_VALUE {
            return Err(self.error(
                format!("set {key:?}"),
                format!(
                    "value of {} bytes is over the {MAX_VALUE}-byte cap",
                    value.len()
                ),
            ));
        }
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.call(
            || format!("set {key:?}"),
            &req,
            Duration::ZERO,
            |_, _| Ok(()),
        )
    }

    /// Sets `key` to `value` if no other request of this client is in progress; returns
    /// whether it did. For callers that must not wait behind a long `get` or `wait`.
    pub fn try_set(&self, key: &str, value: &[u8]) -> Result<bool> {
        self.check_key(key)?;
        if value.len() > MAX_VALUE {
            return Ok(false);
        }
        let Some(mut conn) = self.conn.try_lock() else {
            return Ok(false);
        };
        let mut req = vec![OP_SET];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.call_on(
            &mut conn,
            || format!("set {key:?}"),
            &req,
            Duration::ZERO,
            |_, _| Ok(()),
        )?;
        Ok(true)
    }

    /// The value of `key`, waiting for it up to the store's default timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting for it up to `timeout`.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.check_key(key)?;
        let deadline = Instant::now() + timeout;
        loop {
            // The server bounds one wait (by its request timeout): ask again for the rest.
            let wait = deadline.saturating_duration_since(Instant::now());
            let mut req = vec![OP_GET];
            req.extend_from_slice(&(wait.as_millis() as u64).to_le_bytes());
            put_bytes(&mut req, key.as_bytes());
            let value = self.call(
                || format!("get {key:?}"),
                &req,
                wait,
                |status, conn| {
                    (status == STATUS_OK)
                        .then(|| read_bytes(conn, MAX_VALUE))
                        .transpose()
                },
            )?;
            match value {
                Some(value) => return Ok(value),
                None if Instant::now() < deadline => continue,
                None => {
                    return Err(DistError::StoreTimeout {
                        addr: self.addr.clone(),
                        keys: vec![key.to_string()],
                        timeout,
                    })
                }
            }
        }
    }

    /// Adds `delta` to the integer at `key` (missing counts as 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.check_key(key)?;
        let mut req = vec![OP_ADD];
        put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        self.call(
            || format!("add {key:?}"),
            &req,
            Duration::ZERO,
            |_, conn| Ok(read_u64(conn)? as i64),
        )
    }

    /// Waits until all `keys` exist, up to the store's default timeout.
    pub fn wait(&self, keys: &[&str]) -> Result<()> {
        self.wait_timeout(keys, self.timeout)
    }

    /// Waits until all `keys` exist, up to `timeout`.
    pub fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            // The server bounds one wait (by its request timeout): ask again for the rest.
            let wait = deadline.saturating_duration_since(Instant::now());
            let req = self.keys_request(OP_WAIT, Some(wait), keys)?;
            let ok = self.call(
                || format!("wait {keys:?}"),
                &req,
                wait,
                |status, _| Ok(status == STATUS_OK),
            )?;
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        let missing = keys
            .iter()
            .filter(|k| !self.check(&[k]).unwrap_or(false))
            .map(|k| k.to_string())
            .collect();
        Err(DistError::StoreTimeout {
            addr: self.addr.clone(),
            keys: missing,
            timeout,
        })
    }

    /// Whether all `keys` exist, without waiting.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let req = self.keys_request(OP_CHECK, None, keys)?;
        self.call(
            || format!("check {keys:?}"),
            &req,
            Duration::ZERO,
            |_, conn| Ok(read_u8(conn)? != 0),
        )
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        self.check_key(key)?;
        let mut req = vec![OP_DELETE];
        put_bytes(&mut req, key.as_bytes());
        self.call(
            || format!("delete {key:?}"),
            &req,
            Duration::ZERO,
            |_, conn| Ok(read_u8(conn)? != 0),
        )
    }

    /// The values of `keys` as stored now, without waiting: `None` for a key that is not set.
    /// A value longer than `max_value` bytes is an error (callers know how large their values
    /// are, so a longer one is not theirs), as is a reply of more than 64 MiB in all.
    pub fn get_many(&self, keys: &[&str], max_value: usize) -> Result<Vec<Option<Vec<u8>>>> {
        let req = self.keys_request(OP_GET_MANY, None, keys)?;
        let cap = max_value.min(MAX_VALUE);
        self.call(
            || format!("get_many of {} keys", keys.len()),
            &req,
            Duration::ZERO,
            |_, conn| {
                let n = read_u32(conn)? as usize;
                if n != keys.len() {
                    return Err(invalid(format!("{n} values for {} keys", keys.len())));
                }
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(match read_u8(conn)? {
                        0 => None,
                        1 => Some(read_bytes(conn, cap)?),
                        other => return Err(invalid(format!("presence flag {other}"))),
                    });
                }
                Ok(values)
            },
        )
    }

    /// Leaves a *will* with the store: when this client's connection closes — the client is
    /// dropped, or its process exits or dies — the store sets `key` to `value` (unless the
    /// store itself is shutting down). A later will for the same key replaces the earlier one;
    /// one client may leave up to 16 wills of up to 64 KiB each.
    pub fn set_will(&self, key: &str, value: &[u8]) -> Result<()> {
        self.check_key(key)?;
        if value.len() > MAX_WILL_VALUE {
            return Err(self.error(
                format!("set_will {key:?}"),
                format!(
                    "value of {} bytes is over the {MAX_WILL_VALUE}-byte cap of a will",
                    value.len()
                ),
            ));
        }
        let mut req = vec![OP_SET_WILL];
        put_bytes(&mut req, key.as_bytes());
        put_bytes(&mut req, value);
        self.call(
            || format!("set_will {key:?}"),
            &req,
            Duration::ZERO,
            |_, _| Ok(()),
        )
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.len() > MAX_KEY {
            return Err(self.error(
                "request".into(),
                format!("key of {} bytes is over the {MAX_KEY}-byte cap", key.len()),
            ));
        }
        Ok(())
    }

    fn keys_request(&self, op: u8, timeout: Option<Duration>, keys: &[&str]) -> Result<Vec<u8>> {
        if keys.len() > MAX_KEYS {
            return Err(self.error(
                "request".into(),
                format!("{} keys in one request (at most {MAX_KEYS})", keys.len()),
            ));
        }
        let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
        if key_bytes > MAX_REQUEST_KEY_BYTES {
            return Err(self.error(
                "request".into(),
                format!(
                    "{key_bytes} bytes of keys in one request (at most {MAX_REQUEST_KEY_BYTES})"
                ),
            ));
        }
        let mut req = vec![op];
        if let Some(t) = timeout {
            req.extend_from_slice(&(t.as_millis() as u64).to_le_bytes());
        }
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            self.check_key(k)?;
            put_bytes(&mut req, k.as_bytes());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn server() -> (StoreServer, String) {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        (server, addr)
    }

    #[test]
    fn set_get_add_check_delete_round_trip() {
        let (_server, addr) = server();
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("a", b"hello").unwrap();
        assert_eq!(store.get("a").unwrap(), b"hello");
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", -5).unwrap(), -3);
        assert!(store.check(&["a", "n"]).unwrap());
        assert!(!store.check(&["a", "zzz"]).unwrap());
        assert!(store.delete("a").unwrap());
        assert!(!store.delete("a").unwrap());
        let err = store.add("x", 1).and_then(|_| {
            store.set("x", b"not a number")?;
            store.add("x", 1)
        });
        assert!(err.unwrap_err().to_string().contains("not an integer"));
    }

    #[test]
    fn get_many_reads_present_and_missing_keys_without_waiting() {
        let (_server, addr) = server();
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("a", b"one").unwrap();
        store.set("c", b"").unwrap();
        let started = Instant::now();
        let values = store.get_many(&["a", "b", "c"], 16).unwrap();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(values, vec![Some(b"one".to_vec()), None, Some(Vec::new())]);
        assert_eq!(
            store.get_many(&[], 16).unwrap(),
            Vec::<Option<Vec<u8>>>::new()
        );
        // A value longer than the caller allows is an error, not an allocation.
        store.set("big", &[7u8; 100]).unwrap();
        let err = store.get_many(&["big"], 10).unwrap_err().to_string();
        assert!(err.contains("get_many"), "{err}");
    }

    #[test]
    fn a_will_is_set_when_its_connection_closes_and_can_be_replaced() {
        let (server, addr) = server();
        let watcher = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        client.set("hb", b"alive").unwrap();
        client.set_will("hb", b"gone").unwrap();
        client.set_will("hb", b"gone for good").unwrap();
        client.set_will("other", b"x").unwrap();
        assert_eq!(watcher.get("hb").unwrap(), b"alive");
        assert!(!watcher.check(&["other"]).unwrap());
        drop(client);
        let deadline = Instant::now() + Duration::from_secs(5);
        while watcher.get_many(&["hb"], 64).unwrap()[0].as_deref() != Some(b"gone for good") {
            assert!(Instant::now() < deadline, "the will was not set");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(watcher.get("other").unwrap(), b"x");
        assert_eq!(server.value("hb").unwrap(), b"gone for good");
    }

    #[test]
    fn wills_are_bounded_in_number_size_and_stored_bytes() {
        let server = StoreServer::bind_with(
            "127.0.0.1:0",
            StoreConfig {
                max_stored_bytes: 5_000,
                ..StoreConfig::default()
            },
        )
        .unwrap();
        let addr = server.local_addr().to_string();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        for k in 0..MAX_WILLS {
            client.set_will(&format!("w{k}"), b"v").unwrap();
        }
        let err = client
            .set_will("one-too-many", b"v")
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most 16 wills"), "{err}");
        client
            .set_will("w0", b"replacing an existing will is fine")
            .unwrap();
        let err = client
            .set_will("huge", &vec![0u8; MAX_WILL_VALUE + 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cap of a will"), "{err}");
        let other = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let err = other
            .set_will("fat", &[0u8; 5_000])
            .unwrap_err()
            .to_string();
        assert!(err.contains("store is full"), "{err}");
        // Reserved will bytes count against the limit of ordinary sets too.
        other.set_will("fat", &[0u8; 3_000]).unwrap();
        let err = client.set("k", &[0u8; 1_000]).unwrap_err().to_string();
        assert!(err.contains("store is full"), "{err}");
        drop(other);
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.value("fat").is_none() {
            assert!(Instant::now() < deadline, "the will was not set");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn get_waits_for_a_key_set_later_by_another_client() {
        let (_server, addr) = server();
        let waiter = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let setter = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            setter.set("late", b"42").unwrap();
        });
        let started = Instant::now();
        waiter.wait(&["late"]).unwrap();
        assert_eq!(waiter.get("late").unwrap(), b"42");
        assert!(started.elapsed() >= Duration::from_millis(90));
        t.join().unwrap();
    }

    #[test]
    fn waiting_for_a_missing_key_times_out_naming_it() {
        let (_server, addr) = server();
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("present", b"").unwrap();
        let err = store
            .wait_timeout(&["present", "absent"], Duration::from_millis(100))
            .unwrap_err();
        assert!(
            matches!(&err, DistError::StoreTimeout { keys, .. } if keys == &["absent".to_string()]),
            "{err}"
        );
        let err = store
            .get_timeout("absent", Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent") && err.contains("timed out"), "{err}");
    }

    #[test]
    fn a_vanished_server_is_an_error_not_a_hang() {
        let (server, addr) = server();
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("k", b"v").unwrap();
        drop(server);
        let err = store.get("missing").unwrap_err().to_string();
        assert!(err.contains(&addr), "{err}");
    }

    #[test]
    fn connecting_to_nothing_fails_within_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let started = Instant::now();
        let err = TcpStore::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(300))
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
    }

    /// Reads from `raw` until the server closes it; fails the test if it stays open.
    fn assert_closed_by_server(raw: &mut TcpStream) {
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match raw.read(&mut buf) {
                Ok(0) => return,
                Ok(_) => continue, // a refusal or an answer before the close
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("the server did not close the connection: {e}"),
            }
        }
    }

    /// A raw connection that has completed the handshake (no secret).
    fn handshaken(addr: &str) -> TcpStream {
        let raw = TcpStream::connect(addr).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(client_handshake(&raw, addr, None, deadline).is_ok());
        raw
    }

    #[test]
    fn garbage_before_the_handshake_closes_the_connection() {
        let (server, addr) = server();
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(&[0xAB; 64]).unwrap();
        assert_closed_by_server(&mut raw);
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("still", b"fine").unwrap();
        assert_eq!(store.get("still").unwrap(), b"fine");
        drop(store);
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.connections() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(server.connections(), 0, "closed connections are forgotten");
    }

    #[test]
    fn requests_over_the_caps_close_the_connection_without_harming_the_server() {
        let (_server, addr) = server();
        // A SET announcing a 4 GiB key: refused, connection closed, nothing allocated.
        let mut raw = handshaken(&addr);
        raw.write_all(&[OP_SET, 0xff, 0xff, 0xff, 0xff]).unwrap();
        assert_closed_by_server(&mut raw);
        // An unknown opcode.
        let mut raw = handshaken(&addr);
        raw.write_all(&[99]).unwrap();
        assert_closed_by_server(&mut raw);
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("still", b"fine").unwrap();
        assert_eq!(store.get("still").unwrap(), b"fine");
    }

    #[test]
    fn a_request_dripping_in_slower_than_the_request_timeout_is_cut_off() {
        let config = StoreConfig {
            request_timeout: Duration::from_millis(300),
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        let mut raw = handshaken(&addr);
        // The opcode and half a key length, then nothing: the server gives up.
        raw.write_all(&[OP_GET, 0, 0]).unwrap();
        let started = Instant::now();
        assert_closed_by_server(&mut raw);
        assert!(started.elapsed() < Duration::from_secs(4));
    }

    #[test]
    fn the_store_refuses_values_beyond_its_byte_limit_and_stays_usable() {
        let config = StoreConfig {
            max_stored_bytes: 10_000,
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let store =
            TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5)).unwrap();
        store.set("a", &[1u8; 6000]).unwrap();
        let err = store.set("b", &[2u8; 6000]).unwrap_err().to_string();
        assert!(err.contains("full") && err.contains("10000"), "{err}");
        // Replacing and deleting give the room back.
        store.set("a", &[3u8; 100]).unwrap();
        store.set("b", &[2u8; 6000]).unwrap();
        assert!(store.delete("b").unwrap());
        store.set("c", &[4u8; 6000]).unwrap();
        assert_eq!(store.get("a").unwrap(), vec![3u8; 100]);
        assert!(store.add("counter", 1).is_ok());
    }

    #[test]
    fn a_flood_of_silent_connections_cannot_lock_out_a_real_client() {
        let config = StoreConfig {
            max_connections: 8,
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        let first = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let silent: Vec<TcpStream> = (0..20)
            .map(|_| TcpStream::connect(&addr).unwrap())
            .collect();
        // The newest connections evicted the oldest silent ones; a real client still gets in,
        // and the authenticated one is never evicted.
        let second = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        second.set("k", b"v").unwrap();
        assert_eq!(first.get("k").unwrap(), b"v");
        // Evicted connections are forgotten as soon as their threads notice the shutdown.
        let deadline = Instant::now() + Duration::from_secs(5);
        while server.connections() > 9 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(server.connections() <= 9, "{}", server.connections());
        drop(silent);
    }

    #[test]
    fn a_foreign_program_on_the_port_is_reported_at_once() {
        for answer in [
            &b"HTTP/1.1 400 Bad Request\r\n\r\n"[..],
            &[0x17, 0x03, 0x03, 0x00][..],
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let answer = answer.to_vec();
            let foreign = std::thread::spawn(move || {
                let (mut c, _) = listener.accept().unwrap();
                let mut buf = [0u8; 64];
                let _ = c.read(&mut buf);
                let _ = c.write_all(&answer);
                std::thread::sleep(Duration::from_millis(500));
            });
            let started = Instant::now();
            let err = TcpStore::connect(&addr, Duration::from_secs(300))
                .unwrap_err()
                .to_string();
            assert!(started.elapsed() < Duration::from_secs(2), "{err}");
            assert!(err.contains("not a tandem store"), "{err}");
            foreign.join().unwrap();
        }
    }

    #[test]
    fn an_unresolvable_host_fails_at_once_naming_it() {
        let started = Instant::now();
        let err = TcpStore::connect("no-such-host.invalid:29500", Duration::from_secs(300))
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(30), "{err}");
        assert!(
            err.contains("no-such-host.invalid") && err.contains("MASTER_ADDR"),
            "{err}"
        );
    }

    fn secret(s: &str) -> JobSecret {
        JobSecret::from_value(s).unwrap()
    }

    #[test]
    fn clients_without_the_secret_can_neither_read_nor_write() {
        let good = secret("the-right-secret-0123456789");
        let config = StoreConfig {
            secret: Some(good.clone()),
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        let member =
            TcpStore::connect_with_secret(&addr, Duration::from_secs(5), Some(good)).unwrap();
        member
            .set("tandem/default/addr/0", b"127.0.0.1:1234")
            .unwrap();

        let err = TcpStore::connect(&addr, Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(err.contains("requires the job secret"), "{err}");
        let wrong = Some(secret("the-wrong-secret-0123456789"));
        let err = TcpStore::connect_with_secret(&addr, Duration::from_secs(5), wrong)
            .unwrap_err()
            .to_string();
        assert!(err.contains("could not prove"), "{err}");

        // A raw client that skips the handshake and sends requests: a GET of the key and a SET
        // overwriting it. Neither is answered or applied, and the connection is closed.
        let mut raw = TcpStream::connect(&addr).unwrap();
        let mut get = vec![OP_GET];
        get.extend_from_slice(&0u64.to_le_bytes());
        put_bytes(&mut get, b"tandem/default/addr/0");
        let mut set = vec![OP_SET];
        put_bytes(&mut set, b"tandem/default/addr/0");
        put_bytes(&mut set, b"10.6.6.6:6666");
        // The server may close (and reset) the connection as soon as it has read the first
        // request, so a later write can fail with ECONNRESET: that is the expected outcome,
        // not a test failure. What matters is that nothing is answered or applied.
        let _ = raw.write_all(&get).and_then(|()| raw.write_all(&set));
        assert_closed_by_server(&mut raw);

        // A raw client that answers the challenge with a made-up proof.
        let mut raw = TcpStream::connect(&addr).unwrap();
        let mut hello = MAGIC.to_vec();
        hello.push(VERSION);
        hello.push(FLAG_SECRET);
        hello.extend_from_slice(&[7u8; 32]);
        let _ = raw
            .write_all(&hello)
            .and_then(|()| raw.write_all(&[0u8; 32]))
            .and_then(|()| raw.write_all(&set));
        assert_closed_by_server(&mut raw);

        assert_eq!(
            member.get("tandem/default/addr/0").unwrap(),
            b"127.0.0.1:1234"
        );
    }

    /// A raw connection of an insider: it has completed the handshake with the job secret.
    fn insider(addr: &str, secret: &JobSecret) -> TcpStream {
        let raw = TcpStream::connect(addr).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(client_handshake(&raw, addr, Some(secret), deadline).is_ok());
        raw
    }

    /// This process's anonymous resident memory (the heap), from `/proc`.
    fn heap_bytes() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
        let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib << 10
    }

    fn keys_request(op: u8, wait: Option<Duration>, keys: &[String]) -> Vec<u8> {
        let mut req = vec![op];
        if let Some(w) = wait {
            req.extend_from_slice(&(w.as_millis() as u64).to_le_bytes());
        }
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            put_bytes(&mut req, k.as_bytes());
        }
        req
    }

    /// The status byte of the reply on `raw`, if one comes within `wait`.
    fn reply_status(raw: &mut TcpStream, wait: Duration) -> Option<u8> {
        raw.set_read_timeout(Some(wait)).unwrap();
        read_u8(raw).ok()
    }

    #[test]
    fn insiders_cannot_make_get_many_replies_hold_copies_of_a_value() {
        let good = secret("the-insiders-secret-0123456789");
        let config = StoreConfig {
            secret: Some(good.clone()),
            max_stored_bytes: 8 << 20,
            request_timeout: Duration::from_secs(5),
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        let honest =
            TcpStore::connect_with_secret(&addr, Duration::from_secs(5), Some(good.clone()))
                .unwrap();
        honest.set("v", &[7u8; 16 << 10]).unwrap();
        let before = heap_bytes();
        // 8 insiders each ask for the 16 KiB value 4096 times in one GET_MANY (64 MiB if the
        // reply were a copy) and never read the reply.
        let keys = vec!["v".to_string(); MAX_KEYS];
        let req = keys_request(OP_GET_MANY, None, &keys);
        let insiders: Vec<TcpStream> = (0..8)
            .map(|_| {
                let mut raw = insider(&addr, &good);
                raw.write_all(&req).unwrap();
                raw
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        // The smallest growth of several samples: the other tests of this binary run in the same
        // process, and their transient allocations (freed, and given back to the system for
        // large ones) must not count, while replies held for the insiders would stay.
        let grown = (0..5)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(200));
                heap_bytes().saturating_sub(before)
            })
            .min()
            .unwrap_or(0);
        // The honest client is still served.
        honest.set("k", b"x").unwrap();
        assert_eq!(honest.get("k").unwrap(), b"x");
        eprintln!(
            "heap grew by {:.1} MiB with 8 pending GET_MANY replies of 64 MiB each",
            grown as f64 / (1 << 20) as f64
        );
        assert!(grown < 64 << 20, "the heap grew by {grown} bytes");
        drop(insiders);
    }

    #[test]
    fn insiders_cannot_make_waits_hold_more_key_bytes_than_the_caps_allow() {
        let good = secret("the-insiders-secret-0123456789");
        let config = StoreConfig {
            secret: Some(good.clone()),
            max_stored_bytes: 4 << 20,
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        let honest =
            TcpStore::connect_with_secret(&addr, Duration::from_secs(5), Some(good.clone()))
                .unwrap();
        let day = Duration::from_secs(24 * 3600);
        // 16 MiB of keys in one WAIT: over the per-request cap, answered with an error.
        let huge: Vec<String> = (0..MAX_KEYS).map(|i| format!("{i:04000}")).collect();
        let mut raw = insider(&addr, &good);
        raw.write_all(&keys_request(OP_WAIT, Some(day), &huge))
            .unwrap();
        assert_eq!(
            reply_status(&mut raw, Duration::from_secs(10)),
            Some(STATUS_ERROR),
            "a WAIT with 16 MiB of keys was not refused"
        );
        // 8 WAITs of about 1 MiB of keys each on keys that never come: the 4 MiB budget takes 3
        // (1.3 MiB each, with the per-key charge); the others are refused at once.
        let mut waiting = Vec::new();
        let mut refused = 0;
        for c in 0..8 {
            let keys: Vec<String> = (0..MAX_KEYS).map(|i| format!("{c}-{i:0248}")).collect();
            let mut raw = insider(&addr, &good);
            raw.write_all(&keys_request(OP_WAIT, Some(day), &keys))
                .unwrap();
            match reply_status(&mut raw, Duration::from_millis(500)) {
                Some(STATUS_ERROR) => refused += 1,
                None => waiting.push(raw),
                Some(other) => panic!("status {other} for a WAIT on missing keys"),
            }
        }
        assert!(refused >= 5, "only {refused} of 8 WAITs were refused");
        // The honest client is still served.
        honest.set("k", b"x").unwrap();
        assert_eq!(honest.get("k").unwrap(), b"x");
        drop(waiting);
    }

    #[test]
    fn one_wait_is_bounded_by_the_request_timeout_and_clients_ask_again() {
        let config = StoreConfig {
            request_timeout: Duration::from_millis(300),
            ..StoreConfig::default()
        };
        let server = StoreServer::bind_with("127.0.0.1:0", config).unwrap();
        let addr = server.local_addr().to_string();
        // A WAIT asking for a day is answered "timed out" after the request timeout.
        let mut raw = handshaken(&addr);
        let day = Duration::from_secs(24 * 3600);
        raw.write_all(&keys_request(OP_WAIT, Some(day), &["never".to_string()]))
            .unwrap();
        assert_eq!(
            reply_status(&mut raw, Duration::from_secs(10)),
            Some(STATUS_TIMEOUT)
        );
        // A client waiting longer than that asks again until its own timeout.
        let waiter = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let setter = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            setter.set("late", b"1").unwrap();
        });
        waiter
            .wait_timeout(&["late"], Duration::from_secs(10))
            .unwrap();
        let err = waiter
            .get_timeout("later", Duration::from_millis(700))
            .unwrap_err()
            .to_string();
        assert!(err.contains("timed out"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn a_client_with_a_secret_refuses_a_store_without_one() {
        let (_server, addr) = server();
        let err = TcpStore::connect_with_secret(
            &addr,
            Duration::from_secs(5),
            Some(secret("some-job-secret-0123456789")),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("does not authenticate"), "{err}");
    }
}
