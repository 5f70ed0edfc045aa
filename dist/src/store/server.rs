//! The store server: one thread accepts connections, one thread per connection serves it.
//!
//! Every resource a client can make the server spend is bounded ([`StoreConfig`]): connections
//! (over the limit, the oldest connection still in its handshake is dropped to admit the new
//! one, so a flood of strangers cannot lock out the job's ranks; if every connection is
//! authenticated the new one is refused with a message), the time a handshake or one request
//! may take once it has started, and how long one request may wait for keys (the request
//! timeout; clients ask again). Memory is bounded by one budget,
//! [`StoreConfig::max_stored_bytes`], charged with every byte a client can make the server
//! hold: stored keys and values, values being received, wills, and the keys of a request (at
//! most [`MAX_REQUEST_KEY_BYTES`] a request) for as long as it waits and its reply is sent.
//! Replies are never copies: they hold the stored values themselves, and a value replaced or
//! deleted while a reply still holds it stays charged until that reply is sent. A request the
//! budget cannot take is answered with an error, not queued. A connection that fails the
//! handshake or sends a malformed request is closed (and logged, naming the peer address); a
//! connection the client closes is closed here too, and forgotten, so that file descriptors
//! never accumulate.

use std::collections::HashMap;
use std::io::{self, BufWriter, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::wire::*;
use crate::auth::JobSecret;
use crate::{DistError, Result};

/// Bytes charged per stored key on top of its key and value (the map's own bookkeeping), and
/// per key of a request (the key's and its reply's bookkeeping).
const KEY_OVERHEAD: usize = 64;
/// Rejections logged one by one; after these, only every power of two.
const LOGGED_REJECTIONS: u64 = 16;

/// Limits and credentials of a [`StoreServer`]. Every limit has a documented default.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The job secret clients must prove they know; `None` serves anyone (trusted networks
    /// only). Default: `None`.
    pub secret: Option<JobSecret>,
    /// Most connections served at once. Default: half of this process's soft limit on open
    /// files (`ulimit -n`), at least 64 and at most 65536, so that the process serving the
    /// store keeps descriptors for its own work.
    pub max_connections: usize,
    /// Longest time a new connection may take to complete the handshake. Default: 10 s.
    pub handshake_timeout: Duration,
    /// Longest time the bytes of one request may take to arrive once its first byte has, a
    /// reply to be taken by the client, and one `get` or `wait` request to wait on the server
    /// for its keys (it then answers "timed out"; [`super::TcpStore`] asks again until its own
    /// timeout, so this bounds how long one request holds the server's resources, not how long
    /// a client may wait). Default: 30 s.
    pub request_timeout: Duration,
    /// The store's memory budget: most bytes it holds for its clients. Charged: stored keys and
    /// values plus 64 bytes per key (values replaced or deleted stay charged while a reply
    /// still holds them), the values of `set` requests being received, wills, and the keys of
    /// requests being served plus 64 bytes per key (a `wait` holds them while it waits). A
    /// request that would exceed it is answered with an error. Default: 256 MiB.
    pub max_stored_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            secret: None,
            max_connections: default_max_connections(),
            handshake_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_stored_bytes: 256 << 20,
        }
    }
}

fn default_max_connections() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the live, exclusively borrowed `limit`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    let soft = if rc == 0 { limit.rlim_cur } else { 1024 };
    (soft / 2).clamp(64, 65536) as usize
}

struct Data {
    map: HashMap<String, Arc<Value>>,
    /// Bytes reserved for the wills of open connections (set when their connection closes).
    wills: usize,
}

/// A stored value. Its bytes (with its key's and [`KEY_OVERHEAD`]) stay charged to the
/// store's budget until the last reference to it — the map's, or a reply's being sent — is
/// gone, so replies can send it without a copy.
struct Value {
    bytes: Box<[u8]>,
    charged: usize,
    meter: Arc<AtomicUsize>,
}

impl Drop for Value {
    fn drop(&mut self) {
        self.meter.fetch_sub(self.charged, Ordering::SeqCst);
    }
}

/// Bytes of the budget reserved for a request (the value of a `set` being received, the keys
/// of a request and its reply's bookkeeping); given back when dropped.
struct Reservation {
    bytes: usize,
    meter: Arc<AtomicUsize>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.meter.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// The store's budget: what is charged now, and the limit.
struct Budget {
    /// Bytes of the values alive (stored, or held by replies), with their keys' charges.
    values: Arc<AtomicUsize>,
    /// Bytes reserved by requests being served.
    requests: Arc<AtomicUsize>,
    limit: usize,
}

impl Budget {
    /// Bytes charged now. Charges grow only under the data lock (which the caller holds, as
    /// `data`); they may shrink at any time, so the answer is never too small.
    fn used(&self, data: &Data) -> usize {
        self.values.load(Ordering::SeqCst) + self.requests.load(Ordering::SeqCst) + data.wills
    }

    /// Whether `bytes` more fit, given that `freed` bytes will be given back by the change.
    fn fits(&self, data: &Data, bytes: usize, freed: usize) -> bool {
        self.used(data) + bytes <= self.limit + freed
    }

    /// Reserves `bytes` for a request if they fit.
    fn reserve(&self, data: &Data, bytes: usize) -> Option<Reservation> {
        if !self.fits(data, bytes, 0) {
            return None;
        }
        self.requests.fetch_add(bytes, Ordering::SeqCst);
        Some(Reservation {
            bytes,
            meter: self.requests.clone(),
        })
    }

    /// Grows `reservation` by `bytes` if they fit.
    fn grow(&self, data: &Data, reservation: &mut Reservation, bytes: usize) -> bool {
        if !self.fits(data, bytes, 0) {
            return false;
        }
        self.requests.fetch_add(bytes, Ordering::SeqCst);
        reservation.bytes += bytes;
        true
    }

    /// A value to store under `key`, charged from now on.
    fn value(&self, key: &str, bytes: Box<[u8]>) -> Arc<Value> {
        let charged = charge(key, &bytes);
        self.values.fetch_add(charged, Ordering::SeqCst);
        Arc::new(Value {
            bytes,
            charged,
            meter: self.values.clone(),
        })
    }
}

/// A key and value a connection leaves to be set when it closes (see `OP_SET_WILL`).
struct Will {
    key: String,
    value: Arc<[u8]>,
}

fn charge(key: &str, value: &[u8]) -> usize {
    key.len() + value.len() + KEY_OVERHEAD
}

struct Conn {
    /// The socket, owned by the connection's thread, which forgets the entry before closing it.
    fd: RawFd,
    authenticated: bool,
    evicted: bool,
    since: Instant,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    live: HashMap<u64, Conn>,
}

struct Shared {
    config: StoreConfig,
    addr: SocketAddr,
    budget: Budget,
    data: Mutex<Data>,
    changed: Condvar,
    stop: AtomicBool,
    conns: Mutex<Conns>,
    rejections: AtomicU64,
}

/// Serves a rendezvous store until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreServer({})", self.addr)
    }
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port; see [`StoreServer::local_addr`]) and serves
    /// anyone who connects, with the default limits. For a job, prefer
    /// [`StoreServer::bind_with`] and a [`JobSecret`].
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        Self::bind_with(addr, StoreConfig::default())
    }

    /// Binds `addr` and serves with `config`'s secret and limits on a background thread.
    pub fn bind_with(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        config: StoreConfig,
    ) -> Result<Self> {
        let what = format!("{addr:?}");
        let listener = TcpListener::bind(addr)
            .map_err(|e| DistError::io(format!("store: cannot listen on {what}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| DistError::io("store: local address", e))?;
        let budget = Budget {
            values: Arc::default(),
            requests: Arc::default(),
            limit: config.max_stored_bytes,
        };
        let shared = Arc::new(Shared {
            config,
            addr,
            budget,
            data: Mutex::new(Data {
                map: HashMap::new(),
                wills: 0,
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            rejections: AtomicU64::new(0),
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

    /// The value of `key` as stored now, read directly (no connection, no waiting).
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared
            .data
            .lock()
            .map
            .get(key)
            .map(|v| v.bytes.to_vec())
    }

    /// How many connections the server holds open now.
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().live.len()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        for conn in self.shared.conns.lock().live.values() {
            shutdown(conn.fd);
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

/// Shuts a registered connection's socket down, which ends its thread's blocking read.
fn shutdown(fd: RawFd) {
    // SAFETY: shutdown(2) has no memory-safety preconditions. `fd` is open: it belongs to a
    // registered connection, and its thread forgets the entry (under the lock our caller
    // holds) before it closes the socket.
    unsafe {
        libc::shutdown(fd, libc::SHUT_RDWR);
    }
}

fn log_rejection(shared: &Shared, peer: &str, reason: &str) {
    let n = shared.rejections.fetch_add(1, Ordering::Relaxed) + 1;
    if n <= LOGGED_REJECTIONS || n.is_power_of_two() {
        let more = if n > LOGGED_REJECTIONS {
            format!(" ({n} connections closed so far; not all are logged)")
        } else {
            String::new()
        };
        eprintln!(
            "tandem: store at {}: closed the connection from {peer}: {reason}{more}",
            shared.addr
        );
    }
}

/// Owns a served connection; forgets its registration before the socket closes.
struct Served {
    shared: Arc<Shared>,
    id: u64,
    stream: TcpStream,
    peer: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        // Runs before the field `stream` is dropped, i.e. before the socket is closed.
        self.shared.conns.lock().live.remove(&self.id);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        match conn {
            Ok(conn) => admit(&shared, conn),
            // Out of descriptors or memory: back off instead of spinning on the same error.
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn admit(shared: &Arc<Shared>, conn: TcpStream) {
    let peer = conn
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    let max = shared.config.max_connections.max(1);
    let id = {
        let mut conns = shared.conns.lock();
        let active = conns.live.values().filter(|c| !c.evicted).count();
        if active >= max {
            let oldest_pending = conns
                .live
                .values_mut()
                .filter(|c| !c.authenticated && !c.evicted)
                .min_by_key(|c| c.since);
            match oldest_pending {
                Some(victim) => {
                    shutdown(victim.fd);
                    victim.evicted = true;
                }
                None => {
                    drop(conns);
                    let msg = format!(
                        "too many connections (the limit is {max}; raise StoreConfig::\
                         max_connections or `ulimit -n`)"
                    );
                    let _ = conn.set_write_timeout(Some(Duration::from_millis(100)));
                    let _ = (&conn).write_all(&refusal(&msg));
                    log_rejection(shared, &peer, &msg);
                    return;
                }
            }
        }
        conns.next_id += 1;
        let id = conns.next_id;
        conns.live.insert(
            id,
            Conn {
                fd: conn.as_raw_fd(),
                authenticated: false,
                evicted: false,
                since: Instant::now(),
            },
        );
        id
    };
    let _ = conn.set_nodelay(true);
    let served = Served {
        shared: shared.clone(),
        id,
        stream: conn,
        peer,
    };
    // If the thread cannot start, the closure (and with it `served`) is dropped: the entry is
    // forgotten and the socket closed.
    let _ = std::thread::Builder::new()
        .name("tandem-store-client".into())
        .spawn(move || serve(served));
}

fn serve(served: Served) {
    let shared = &*served.shared;
    let deadline = Instant::now() + shared.config.handshake_timeout;
    // Marked authenticated before the client learns it is accepted, so that a flood of new
    // connections arriving right after can no longer evict it.
    let accepted = || {
        if let Some(c) = shared.conns.lock().live.get_mut(&served.id) {
            c.authenticated = true;
        }
    };
    let handshake = server_handshake(
        &served.stream,
        shared.config.secret.as_ref(),
        deadline,
        accepted,
    );
    if let Err(reason) = handshake {
        let evicted = shared
            .conns
            .lock()
            .live
            .get(&served.id)
            .is_some_and(|c| c.evicted);
        let reason = if evicted {
            "dropped to admit a new connection while it was still in its handshake".into()
        } else {
            reason
        };
        log_rejection(shared, &served.peer, &reason);
        return;
    }
    let mut wills = Vec::new();
    serve_requests(&served, &mut wills);
    fire_wills(shared, wills);
}

/// Answers requests until the connection closes or fails.
fn serve_requests(served: &Served, wills: &mut Vec<Will>) {
    let shared = &*served.shared;
    let stream = &served.stream;
    loop {
        // Between requests a client may stay silent as long as it likes.
        if stream.set_read_timeout(None).is_err() {
            return;
        }
        let op = match read_u8(&mut &*stream) {
            Ok(op) => op,
            Err(_) => return, // closed by the client, or shut down by the server
        };
        let mut r = Deadline {
            stream,
            deadline: Instant::now() + shared.config.request_timeout,
        };
        let reply = match handle(op, &mut r, shared, wills) {
            Ok(reply) => reply,
            Err(e) => {
                if !shared.stop.load(Ordering::SeqCst) {
                    log_rejection(shared, &served.peer, &format!("bad request: {e}"));
                }
                return;
            }
        };
        let _ = stream.set_write_timeout(Some(shared.config.request_timeout));
        let sent = send(stream, &reply);
        // The reply's values and reservation are given back only now that it is sent.
        drop(reply);
        if sent.is_err() || shared.stop.load(Ordering::SeqCst) {
            return;
        }
    }
}

/// Sets the keys a closed connection left wills for (unless the server is stopping). Their
/// bytes were reserved when the wills were made, so this never exceeds the store's limit.
fn fire_wills(shared: &Shared, wills: Vec<Will>) {
    if wills.is_empty() {
        return;
    }
    let stopping = shared.stop.load(Ordering::SeqCst);
    let mut data = shared.data.lock();
    for will in wills {
        data.wills -= charge(&will.key, &will.value);
        if stopping {
            continue;
        }
        let value = shared.budget.value(&will.key, will.value.as_ref().into());
        data.map.insert(will.key, value);
    }
    drop(data);
    shared.changed.notify_all();
}

/// A reply: its head, then each stored value it carries (sent without a copy) followed by the
/// bytes that come after that value. It keeps its request's reservation until it is sent.
struct Reply {
    head: Vec<u8>,
    values: Vec<(Arc<Value>, Vec<u8>)>,
    _reserved: Option<Reservation>,
}

impl Reply {
    fn status(status: u8) -> Self {
        Reply {
            head: vec![status],
            values: Vec::new(),
            _reserved: None,
        }
    }

    fn error(message: &str) -> Self {
        let mut head = vec![STATUS_ERROR];
        put_bytes(
            &mut head,
            &message.as_bytes()[..message.len().min(MAX_MESSAGE)],
        );
        Reply {
            head,
            values: Vec::new(),
            _reserved: None,
        }
    }
}

/// Writes `reply` (many small pieces go out through a buffer; large values straight from
/// the store).
fn send(stream: &TcpStream, reply: &Reply) -> io::Result<()> {
    if reply.values.is_empty() {
        return (&*stream).write_all(&reply.head);
    }
    let mut w = BufWriter::with_capacity(64 << 10, stream);
    w.write_all(&reply.head)?;
    for (value, after) in &reply.values {
        w.write_all(&value.bytes)?;
        w.write_all(after)?;
    }
    w.flush()
}

/// A request's wait, bounded by the request timeout (the client asks again for the rest).
fn read_wait(r: &mut impl Read, shared: &Shared) -> io::Result<Duration> {
    Ok(Duration::from_millis(read_u64(r)?).min(shared.config.request_timeout))
}

/// Reads the keys of a request, reserving their bytes (and [`KEY_OVERHEAD`] each) in the
/// budget before reading them. When they exceed [`MAX_REQUEST_KEY_BYTES`] or the budget, the
/// rest of the request is read and dropped and the error to answer is returned, so that the
/// client reads an error rather than a reset connection.
fn read_keys_reserved(
    r: &mut impl Read,
    shared: &Shared,
) -> io::Result<std::result::Result<(Vec<String>, Reservation), String>> {
    let n = read_u32(r)? as usize;
    if n > MAX_KEYS {
        return Err(invalid(format!("{n} keys in one request")));
    }
    let mut reservation = shared.budget.reserve(&shared.data.lock(), 0);
    let mut keys = Vec::new();
    let mut key_bytes = 0usize;
    let mut refusal = None;
    for _ in 0..n {
        let len = read_len(r, MAX_KEY)?;
        key_bytes += len;
        if refusal.is_none() && key_bytes > MAX_REQUEST_KEY_BYTES {
            refusal = Some(format!(
                "the keys of this request exceed {MAX_REQUEST_KEY_BYTES} bytes together; ask                  for fewer at a time"
            ));
        }
        if refusal.is_none() {
            let fits = match reservation.as_mut() {
                Some(res) => shared
                    .budget
                    .grow(&shared.data.lock(), res, len + KEY_OVERHEAD),
                None => false,
            };
            if !fits {
                refusal = Some(format!(
                    "the store is full: the keys of this {n}-key request would exceed its limit                      of {} bytes (StoreConfig::max_stored_bytes)",
                    shared.budget.limit
                ));
            }
        }
        if refusal.is_some() {
            reservation = None;
            keys = Vec::new();
            discard(r, len)?;
            continue;
        }
        let mut bytes = vec![0u8; len];
        r.read_exact(&mut bytes)?;
        keys.push(String::from_utf8(bytes).map_err(|_| invalid("key is not UTF-8"))?);
    }
    Ok(match (refusal, reservation) {
        (None, Some(reservation)) => Ok((keys, reservation)),
        (Some(message), _) => Err(message),
        (None, None) => Err(format!(
            "the store is full (its limit is {} bytes, StoreConfig::max_stored_bytes)",
            shared.budget.limit
        )),
    })
}

/// Reads and discards `len` bytes (the value of a refused `set`), so that the client can
/// read the error instead of a reset connection.
fn discard(r: &mut impl Read, mut len: usize) -> io::Result<()> {
    let mut sink = [0u8; 64 << 10];
    while len > 0 {
        let n = len.min(sink.len());
        r.read_exact(&mut sink[..n])?;
        len -= n;
    }
    Ok(())
}

fn handle(
    op: u8,
    r: &mut Deadline<'_>,
    shared: &Shared,
    wills: &mut Vec<Will>,
) -> io::Result<Reply> {
    match op {
        OP_SET => op_set(r, shared),
        OP_GET => {
            let timeout = read_wait(r, shared)?;
            let key = read_key(r)?;
            Ok(
                match wait_for(shared, std::slice::from_ref(&key), timeout) {
                    Some(mut values) => match values.pop() {
                        Some(value) => {
                            let mut head = vec![STATUS_OK];
                            head.extend_from_slice(&(value.bytes.len() as u32).to_le_bytes());
                            Reply {
                                head,
                                values: vec![(value, Vec::new())],
                                _reserved: None,
                            }
                        }
                        None => Reply::status(STATUS_TIMEOUT),
                    },
                    None => Reply::status(STATUS_TIMEOUT),
                },
            )
        }
        OP_ADD => op_add(r, shared),
        OP_WAIT => {
            let timeout = read_wait(r, shared)?;
            let (keys, reserved) = match read_keys_reserved(r, shared)? {
                Ok(k) => k,
                Err(message) => return Ok(Reply::error(&message)),
            };
            let status = if wait_for(shared, &keys, timeout).is_some() {
                STATUS_OK
            } else {
                STATUS_TIMEOUT
            };
            drop((keys, reserved));
            Ok(Reply::status(status))
        }
        OP_CHECK => {
            let (keys, reserved) = match read_keys_reserved(r, shared)? {
                Ok(k) => k,
                Err(message) => return Ok(Reply::error(&message)),
            };
            let all = {
                let data = shared.data.lock();
                keys.iter().all(|k| data.map.contains_key(k))
            };
            drop((keys, reserved));
            let mut reply = Reply::status(STATUS_OK);
            reply.head.push(all as u8);
            Ok(reply)
        }
        OP_DELETE => {
            let key = read_key(r)?;
            let old = shared.data.lock().map.remove(&key);
            let mut reply = Reply::status(STATUS_OK);
            reply.head.push(old.is_some() as u8);
            Ok(reply)
        }
        OP_GET_MANY => op_get_many(r, shared),
        OP_SET_WILL => op_set_will(r, shared, wills),
        other => Err(invalid(format!("unknown store opcode {other}"))),
    }
}

/// Stores a value, within the store's byte limit.
fn op_set(r: &mut Deadline<'_>, shared: &Shared) -> io::Result<Reply> {
    let budget = &shared.budget;
    let limit = shared.budget.limit;
    let key = read_key(r)?;
    let len = read_len(r, MAX_VALUE)?;
    let need = key.len() + len + KEY_OVERHEAD;
    let reserved = budget.reserve(&shared.data.lock(), need);
    let Some(reserved) = reserved else {
        discard(r, len)?;
        return Ok(Reply::error(&format!(
            "the store is full: setting {key:?} ({len} bytes) would exceed its limit of \
             {limit} bytes (StoreConfig::max_stored_bytes)"
        )));
    };
    let mut value = vec![0u8; len];
    let read = r.read_exact(&mut value);
    // The value's own charge replaces the reservation (under the lock, so that no
    // other request sees the bytes charged twice or not at all).
    let mut data = shared.data.lock();
    drop(reserved);
    read?;
    let value = budget.value(&key, value.into());
    let old = data.map.insert(key, value);
    drop(data);
    drop(old);
    shared.changed.notify_all();
    Ok(Reply::status(STATUS_OK))
}

/// Adds to an integer value, within the store's byte limit.
fn op_add(r: &mut Deadline<'_>, shared: &Shared) -> io::Result<Reply> {
    let budget = &shared.budget;
    let limit = shared.budget.limit;
    let key = read_key(r)?;
    let delta = read_u64(r)? as i64;
    let mut data = shared.data.lock();
    let current = match data.map.get(&key) {
        None => Some(0i64),
        Some(v) => std::str::from_utf8(&v.bytes)
            .ok()
            .and_then(|s| s.parse::<i64>().ok()),
    };
    let Some(c) = current else {
        return Ok(Reply::error(&format!("value of {key:?} is not an integer")));
    };
    let new = c.wrapping_add(delta);
    let bytes = new.to_string().into_bytes();
    let old = data.map.get(&key).map_or(0, |v| v.charged);
    if !budget.fits(&data, charge(&key, &bytes), old) {
        return Ok(Reply::error(&format!(
            "the store is full: adding to {key:?} would exceed its limit of {limit} bytes"
        )));
    }
    let value = budget.value(&key, bytes.into());
    let old = data.map.insert(key, value);
    drop(data);
    drop(old);
    shared.changed.notify_all();
    let mut reply = Reply::status(STATUS_OK);
    reply.head.extend_from_slice(&new.to_le_bytes());
    Ok(reply)
}

/// Reads many values at once (absent ones marked as such).
fn op_get_many(r: &mut Deadline<'_>, shared: &Shared) -> io::Result<Reply> {
    let (keys, reserved) = match read_keys_reserved(r, shared)? {
        Ok(k) => k,
        Err(message) => return Ok(Reply::error(&message)),
    };
    // The reply holds the values themselves and keeps the keys' reservation (which
    // covers its bookkeeping) until it is sent.
    let mut head = vec![STATUS_OK];
    head.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    let mut values: Vec<(Arc<Value>, Vec<u8>)> = Vec::new();
    let mut total = 0usize;
    let data = shared.data.lock();
    for key in &keys {
        let tail = match values.last_mut() {
            Some((_, after)) => after,
            None => &mut head,
        };
        match data.map.get(key) {
            None => tail.push(0),
            Some(value) => {
                total += value.bytes.len();
                if total > MAX_VALUE {
                    drop(data);
                    return Ok(Reply::error(&format!(
                        "the values of these {} keys exceed {MAX_VALUE} bytes together; \
                         ask for fewer at a time",
                        keys.len()
                    )));
                }
                tail.push(1);
                tail.extend_from_slice(&(value.bytes.len() as u32).to_le_bytes());
                values.push((value.clone(), Vec::new()));
            }
        }
    }
    drop(data);
    Ok(Reply {
        head,
        values,
        _reserved: Some(reserved),
    })
}

/// Leaves a will: a value the store sets when this connection closes without leaving.
fn op_set_will(r: &mut Deadline<'_>, shared: &Shared, wills: &mut Vec<Will>) -> io::Result<Reply> {
    let budget = &shared.budget;
    let limit = shared.budget.limit;
    let key = read_key(r)?;
    let value: Arc<[u8]> = read_bytes(r, MAX_WILL_VALUE)?.into();
    let need = charge(&key, &value);
    let replaced = wills.iter().position(|w| w.key == key);
    if replaced.is_none() && wills.len() >= MAX_WILLS {
        return Ok(Reply::error(&format!(
            "a connection may leave at most {MAX_WILLS} wills"
        )));
    }
    let mut data = shared.data.lock();
    let old = replaced.map_or(0, |i| charge(&wills[i].key, &wills[i].value));
    if !budget.fits(&data, need, old) {
        return Ok(Reply::error(&format!(
            "the store is full: a will for {key:?} would exceed its limit of {limit} bytes"
        )));
    }
    data.wills = data.wills + need - old;
    drop(data);
    let will = Will { key, value };
    match replaced {
        Some(i) => wills[i] = will,
        None => wills.push(will),
    }
    Ok(Reply::status(STATUS_OK))
}

/// Waits until all `keys` exist; returns their values in order, or `None` on timeout or
/// shutdown.
fn wait_for(shared: &Shared, keys: &[String], timeout: Duration) -> Option<Vec<Arc<Value>>> {
    let deadline = Instant::now() + timeout;
    let mut data = shared.data.lock();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return None;
        }
        if keys.iter().all(|k| data.map.contains_key(k)) {
            return Some(
                keys.iter()
                    .filter_map(|k| data.map.get(k).cloned())
                    .collect(),
            );
        }
        if shared.changed.wait_until(&mut data, deadline).timed_out()
            && !keys.iter().all(|k| data.map.contains_key(k))
        {
            return None;
        }
    }
}
