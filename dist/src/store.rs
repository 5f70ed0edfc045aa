//! The rendezvous store: a small TCP key-value server ([`StoreServer`]) and its client
//! ([`TcpStore`]).
//!
//! Before ranks can talk to each other they need to find each other. One process — rank 0, or
//! the `tandem-run` launcher on node 0 — serves the store at `MASTER_ADDR:MASTER_PORT`; every
//! rank connects to it, publishes what the others need (its listening address) and waits for
//! what it needs from them. The operations are those of PyTorch's `TCPStore`: `set`, `get`
//! (waits for the key), `add` (an atomic counter), `wait` for several keys, `check`, `delete`.
//! Every blocking call has a timeout, and a server that goes away is an error, not a hang.
//!
//! Wire protocol (little endian; strings and byte strings are a `u32` length then the bytes):
//! a request is an opcode byte followed by its fields, the reply a status byte (0 ok, 1 timed
//! out, 2 error followed by a message) followed by the result. Lengths are capped
//! (keys 4 KiB, values 64 MiB, 4096 keys per request); a request over the caps closes the
//! connection.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::{DistError, Result};

const MAX_KEY: usize = 4 << 10;
const MAX_VALUE: usize = 64 << 20;
const MAX_KEYS: usize = 4096;
/// How long past a request's own timeout the client waits for the server's answer.
const REPLY_GRACE: Duration = Duration::from_secs(10);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_CHECK: u8 = 5;
const OP_DELETE: u8 = 6;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;
const STATUS_ERROR: u8 = 2;

// ---- encoding helpers ---------------------------------------------------------------------

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read, cap: usize) -> io::Result<Vec<u8>> {
    let len = read_u32(r)? as usize;
    if len > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("length {len} over the cap {cap}"),
        ));
    }
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn read_key(r: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_bytes(r, MAX_KEY)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
}

fn read_keys(r: &mut impl Read) -> io::Result<Vec<String>> {
    let n = read_u32(r)? as usize;
    if n > MAX_KEYS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{n} keys in one request"),
        ));
    }
    (0..n).map(|_| read_key(r)).collect()
}

// ---- server -------------------------------------------------------------------------------

struct ServerShared {
    data: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    clients: Mutex<Vec<TcpStream>>,
}

/// Serves a rendezvous store until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreServer({})", self.addr)
    }
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and starts
    /// serving on a background thread.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let what = format!("{addr:?}");
        let listener = TcpListener::bind(addr)
            .map_err(|e| DistError::io(format!("store: cannot listen on {what}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| DistError::io("store: local address", e))?;
        let shared = Arc::new(ServerShared {
            data: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            clients: Mutex::new(Vec::new()),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name("tandem-store".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| DistError::io("store: starting the server thread", e))?;
        Ok(StoreServer {
            addr,
            shared,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        for client in self.shared.clients.lock().drain(..) {
            let _ = client.shutdown(Shutdown::Both);
        }
        // Wake the accept loop with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(if wake.is_ipv4() {
                IpAddr::from([127, 0, 0, 1])
            } else {
                IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1])
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let _ = conn.set_nodelay(true);
        if let Ok(clone) = conn.try_clone() {
            shared.clients.lock().push(clone);
        }
        let s = shared.clone();
        let _ = std::thread::Builder::new()
            .name("tandem-store-client".into())
            .spawn(move || serve_client(conn, s));
    }
}

fn serve_client(mut conn: TcpStream, shared: Arc<ServerShared>) {
    // Any malformed request ends the connection; the client sees an error.
    while let Ok(reply) = handle_request(&mut conn, &shared) {
        if conn.write_all(&reply).is_err() || shared.stop.load(Ordering::SeqCst) {
            break;
        }
    }
}

fn handle_request(conn: &mut TcpStream, shared: &ServerShared) -> io::Result<Vec<u8>> {
    let op = read_u8(conn)?;
    let mut reply = Vec::new();
    match op {
        OP_SET => {
            let key = read_key(conn)?;
            let value = read_bytes(conn, MAX_VALUE)?;
            shared.data.lock().insert(key, value);
            shared.changed.notify_all();
            reply.push(STATUS_OK);
        }
        OP_GET => {
            let timeout = Duration::from_millis(read_u64(conn)?);
            let key = read_key(conn)?;
            match wait_for(shared, std::slice::from_ref(&key), timeout) {
                Some(mut data) => {
                    reply.push(STATUS_OK);
                    let value = data.remove(&key).unwrap_or_default();
                    put_bytes(&mut reply, &value);
                }
                None => reply.push(STATUS_TIMEOUT),
            }
        }
        OP_ADD => {
            let key = read_key(conn)?;
            let delta = read_u64(conn)? as i64;
            let mut data = shared.data.lock();
            let current = match data.get(&key) {
                None => Some(0i64),
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok()),
            };
            match current {
                Some(c) => {
                    let new = c.wrapping_add(delta);
                    data.insert(key, new.to_string().into_bytes());
                    drop(data);
                    shared.changed.notify_all();
                    reply.push(STATUS_OK);
                    reply.extend_from_slice(&new.to_le_bytes());
                }
                None => {
                    reply.push(STATUS_ERROR);
                    put_bytes(
                        &mut reply,
                        format!("value of {key:?} is not an integer").as_bytes(),
                    );
                }
            }
        }
        OP_WAIT => {
            let timeout = Duration::from_millis(read_u64(conn)?);
            let keys = read_keys(conn)?;
            reply.push(if wait_for(shared, &keys, timeout).is_some() {
                STATUS_OK
            } else {
                STATUS_TIMEOUT
            });
        }
        OP_CHECK => {
            let keys = read_keys(conn)?;
            let data = shared.data.lock();
            reply.push(STATUS_OK);
            reply.push(keys.iter().all(|k| data.contains_key(k)) as u8);
        }
        OP_DELETE => {
            let key = read_key(conn)?;
            let existed = shared.data.lock().remove(&key).is_some();
            reply.push(STATUS_OK);
            reply.push(existed as u8);
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown store opcode {other}"),
            ))
        }
    }
    Ok(reply)
}

/// Waits until all `keys` exist; returns the values of those keys, or `None` on timeout or
/// shutdown.
fn wait_for(
    shared: &ServerShared,
    keys: &[String],
    timeout: Duration,
) -> Option<HashMap<String, Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    let mut data = shared.data.lock();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return None;
        }
        if keys.iter().all(|k| data.contains_key(k)) {
            return Some(
                keys.iter()
                    .filter_map(|k| data.get(k).map(|v| (k.clone(), v.clone())))
                    .collect(),
            );
        }
        if shared.changed.wait_until(&mut data, deadline).timed_out()
            && !keys.iter().all(|k| data.contains_key(k))
        {
            return None;
        }
    }
}

// ---- client -------------------------------------------------------------------------------

/// A connection to a rendezvous store. Thread-safe; requests are serialised.
pub struct TcpStore {
    addr: String,
    conn: Mutex<TcpStream>,
    timeout: Duration,
    local_ip: IpAddr,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpStore({})", self.addr)
    }
}

impl TcpStore {
    /// Connects to the store at `addr` (`host:port`), retrying until `timeout` while the
    /// server is not up yet. `timeout` is also the default timeout of `get` and `wait`.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut last_error = String::from("no address");
        loop {
            match addr.to_socket_addrs() {
                Ok(candidates) => {
                    for candidate in candidates {
                        let left = deadline
                            .saturating_duration_since(Instant::now())
                            .clamp(Duration::from_millis(1), Duration::from_secs(5));
                        match TcpStream::connect_timeout(&candidate, left) {
                            Ok(conn) => {
                                let local_ip = conn
                                    .local_addr()
                                    .map_err(|e| DistError::io("store: local address", e))?
                                    .ip();
                                let _ = conn.set_nodelay(true);
                                return Ok(TcpStore {
                                    addr: addr.to_string(),
                                    conn: Mutex::new(conn),
                                    timeout,
                                    local_ip,
                                });
                            }
                            Err(e) => last_error = e.to_string(),
                        }
                    }
                }
                Err(e) => last_error = format!("cannot resolve: {e}"),
            }
            if Instant::now() >= deadline {
                return Err(DistError::Store {
                    addr: addr.to_string(),
                    op: "connect".into(),
                    detail: format!(
                        "no store answered within {timeout:?} ({last_error}); is rank 0 (or \
                         tandem-run) running, and are MASTER_ADDR/MASTER_PORT right?"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
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
        let status = read_u8(&mut *conn).map_err(io_err)?;
        if status == STATUS_ERROR {
            let msg = read_bytes(&mut *conn, MAX_KEY).map_err(io_err)?;
            return Err(self.error(op(), String::from_utf8_lossy(&msg).into_owned()));
        }
        parse(status, &mut conn).map_err(io_err)
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

    /// The value of `key`, waiting for it up to the store's default timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting for it up to `timeout`.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.check_key(key)?;
        let mut req = vec![OP_GET];
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        put_bytes(&mut req, key.as_bytes());
        let value = self.call(
            || format!("get {key:?}"),
            &req,
            timeout,
            |status, conn| {
                (status == STATUS_OK)
                    .then(|| read_bytes(conn, MAX_VALUE))
                    .transpose()
            },
        )?;
        value.ok_or_else(|| DistError::StoreTimeout {
            addr: self.addr.clone(),
            keys: vec![key.to_string()],
            timeout,
        })
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
        let req = self.keys_request(OP_WAIT, Some(timeout), keys)?;
        let ok = self.call(
            || format!("wait {keys:?}"),
            &req,
            timeout,
            |status, _| Ok(status == STATUS_OK),
        )?;
        if ok {
            return Ok(());
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

    #[test]
    fn garbage_requests_close_the_connection_without_harming_the_server() {
        let (_server, addr) = server();
        let mut raw = TcpStream::connect(&addr).unwrap();
        // A SET announcing a 4 GiB key: refused, connection closed, nothing allocated.
        raw.write_all(&[OP_SET, 0xff, 0xff, 0xff, 0xff]).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(raw.read(&mut buf).unwrap_or(0), 0);
        let store = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        store.set("still", b"fine").unwrap();
        assert_eq!(store.get("still").unwrap(), b"fine");
    }
}
