//! The store's wire format: the connection handshake (who speaks, what proves the job secret)
//! and the encoding of requests and replies. Both ends live here so that they cannot drift.
//!
//! Handshake (client speaks first, so that a foreign program on the port answers something
//! that is visibly not a tandem store, at once):
//!
//! 1. client → server: `TNDMSTOR`, version (2), flags (bit 0: the client has a secret),
//!    client nonce (32 bytes);
//! 2. server → client: `TNDMSTOR`, version, then `1` + `u32` length + message when it refuses
//!    the connection (too many connections, another version), or `0`, flags (bit 0: the
//!    server requires the secret), server nonce (32 bytes) and, when it requires the secret,
//!    its proof `HMAC(secret, "tandem-store-server" ‖ client nonce ‖ server nonce)`;
//! 3. client → server (secret required): `HMAC(secret, "tandem-store-client" ‖ client nonce ‖
//!    server nonce)`;
//! 4. server → client: `0` (accepted), or `1` + `u32` length + message before closing.
//!
//! Requests then follow (little endian; strings and byte strings are a `u32` length and the
//! bytes): an opcode byte and its fields; the reply is a status byte (0 ok, 1 timed out, 2
//! error followed by a message) and the result.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::auth::{self, JobSecret, Nonce, NONCE_LEN, PROOF_LEN};

/// Longest key.
pub(crate) const MAX_KEY: usize = 4 << 10;
/// Longest value.
pub(crate) const MAX_VALUE: usize = 64 << 20;
/// Most keys in one request.
pub(crate) const MAX_KEYS: usize = 4096;
/// Most bytes of keys in one request (`wait`, `check`, `get_many`): what one waiting
/// connection can make the store hold.
pub const MAX_REQUEST_KEY_BYTES: usize = 1 << 20;
/// Longest message in a refusal or error reply.
pub(crate) const MAX_MESSAGE: usize = 4 << 10;

pub(crate) const MAGIC: [u8; 8] = *b"TNDMSTOR";
pub(crate) const VERSION: u8 = 2;
pub(crate) const FLAG_SECRET: u8 = 1;
pub(crate) const ANSWER_ACCEPT: u8 = 0;
pub(crate) const ANSWER_REFUSE: u8 = 1;
pub(crate) const SERVER_ROLE: &str = "tandem-store-server";
pub(crate) const CLIENT_ROLE: &str = "tandem-store-client";

pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_ADD: u8 = 3;
pub(crate) const OP_WAIT: u8 = 4;
pub(crate) const OP_CHECK: u8 = 5;
pub(crate) const OP_DELETE: u8 = 6;
/// Reads several keys without waiting: `u32` count and keys; the reply is the count and, per
/// key, `0` (missing) or `1` and the value.
pub(crate) const OP_GET_MANY: u8 = 7;
/// Leaves a will: key and value, set by the server when this connection closes.
pub(crate) const OP_SET_WILL: u8 = 8;

/// Longest value of a will.
pub(crate) const MAX_WILL_VALUE: usize = 64 << 10;
/// Most wills one connection may leave.
pub(crate) const MAX_WILLS: usize = 16;

pub(crate) const STATUS_OK: u8 = 0;
pub(crate) const STATUS_TIMEOUT: u8 = 1;
pub(crate) const STATUS_ERROR: u8 = 2;

pub(crate) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub(crate) fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// A length announced by the peer, checked against `cap` before anything is allocated.
pub(crate) fn read_len(r: &mut impl Read, cap: usize) -> io::Result<usize> {
    let len = read_u32(r)? as usize;
    if len > cap {
        return Err(invalid(format!("length {len} over the cap {cap}")));
    }
    Ok(len)
}

pub(crate) fn read_bytes(r: &mut impl Read, cap: usize) -> io::Result<Vec<u8>> {
    let len = read_len(r, cap)?;
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

pub(crate) fn read_key(r: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_bytes(r, MAX_KEY)?).map_err(|_| invalid("key is not UTF-8"))
}

/// Reads from a socket with every read bounded by one overall deadline, so that a peer
/// dripping one byte at a time cannot hold a request open longer than the deadline.
pub(crate) struct Deadline<'a> {
    pub stream: &'a TcpStream,
    pub deadline: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

/// How a client handshake failed.
pub(crate) enum ClientFailure {
    /// Trying again may help (the store refused a connection for now, or closed it).
    Retry(String),
    /// It will not help: the wrong program, the wrong secret, the wrong version.
    Fatal(String),
}

/// Shows the first bytes a foreign program sent, for a message.
fn show(bytes: &[u8]) -> String {
    let text: String = bytes
        .iter()
        .take(24)
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    format!("{text:?}")
}

/// Runs the client's side of the handshake on a fresh connection to `addr`.
pub(crate) fn client_handshake(
    conn: &TcpStream,
    addr: &str,
    secret: Option<&JobSecret>,
    deadline: Instant,
) -> Result<(), ClientFailure> {
    use ClientFailure::{Fatal, Retry};
    let wait = deadline.saturating_duration_since(Instant::now());
    let io_failure = |e: io::Error, stage: &str| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Fatal(format!(
            "the program listening at {addr} did not answer tandem's store handshake within \
             {wait:.0?} ({stage}); it is not a tandem store (is another program using \
             MASTER_PORT?), or the process serving the store is stopped"
        )),
        _ => Retry(format!(
            "the store closed the connection during the handshake ({stage}: {e})"
        )),
    };
    let client_nonce = auth::nonce().map_err(|e| Fatal(format!("no random nonce: {e}")))?;
    let mut hello = MAGIC.to_vec();
    hello.push(VERSION);
    hello.push(if secret.is_some() { FLAG_SECRET } else { 0 });
    hello.extend_from_slice(&client_nonce);
    let mut r = Deadline {
        stream: conn,
        deadline,
    };
    conn.set_write_timeout(Some(wait.max(Duration::from_millis(1))))
        .map_err(|e| io_failure(e, "sending the greeting"))?;
    (&*conn)
        .write_all(&hello)
        .map_err(|e| io_failure(e, "sending the greeting"))?;

    read_magic(&mut r, addr, &io_failure)?;
    let version = read_u8(&mut r).map_err(|e| io_failure(e, "reading its version"))?;
    if version != VERSION {
        return Err(Fatal(format!(
            "the store at {addr} speaks protocol version {version}, this build version \
             {VERSION}: run the same tandem build everywhere"
        )));
    }
    match read_u8(&mut r).map_err(|e| io_failure(e, "reading its answer"))? {
        ANSWER_ACCEPT => {}
        ANSWER_REFUSE => {
            let msg = read_bytes(&mut r, MAX_MESSAGE)
                .map_err(|e| io_failure(e, "reading its refusal"))?;
            return Err(Retry(format!(
                "the store refused the connection: {}",
                String::from_utf8_lossy(&msg)
            )));
        }
        other => {
            return Err(Fatal(format!(
                "the store at {addr} sent answer code {other} in its handshake"
            )))
        }
    }
    let flags = read_u8(&mut r).map_err(|e| io_failure(e, "reading its flags"))?;
    let mut server_nonce: Nonce = [0; NONCE_LEN];
    r.read_exact(&mut server_nonce)
        .map_err(|e| io_failure(e, "reading its nonce"))?;
    let parts: [&[u8]; 2] = [&client_nonce, &server_nonce];
    authenticate(
        conn,
        &mut r,
        addr,
        secret,
        flags & FLAG_SECRET != 0,
        &parts,
        &io_failure,
    )?;
    match read_u8(&mut r).map_err(|e| io_failure(e, "reading its verdict"))? {
        ANSWER_ACCEPT => Ok(()),
        _ => {
            let msg = read_bytes(&mut r, MAX_MESSAGE).unwrap_or_default();
            Err(Fatal(format!(
                "the store at {addr} rejected this process: {}",
                String::from_utf8_lossy(&msg)
            )))
        }
    }
}

/// How an I/O error at a stage of the handshake is reported.
type IoFailure<'a> = dyn Fn(io::Error, &str) -> ClientFailure + 'a;

/// Reads the store's magic, judging the answer byte by byte: a foreign program is recognised
/// by its first byte.
fn read_magic(
    r: &mut Deadline<'_>,
    addr: &str,
    io_failure: &IoFailure<'_>,
) -> Result<(), ClientFailure> {
    use ClientFailure::{Fatal, Retry};
    let mut got = Vec::with_capacity(MAGIC.len());
    while got.len() < MAGIC.len() {
        let mut b = [0u8; 8];
        let want = MAGIC.len() - got.len();
        match r.read(&mut b[..want]) {
            Ok(0) if got.is_empty() => {
                return Err(Retry(format!(
                    "the program at {addr} closed the connection without answering (a full \
                     store, or not a tandem store)"
                )))
            }
            Ok(0) => {
                return Err(Fatal(format!(
                    "the program at {addr} is not a tandem store: it answered {} and closed",
                    show(&got)
                )))
            }
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_failure(e, "waiting for its greeting")),
        }
        if !MAGIC.starts_with(&got) {
            return Err(Fatal(format!(
                "the program at {addr} is not a tandem store: it answered {} (is another \
                 program using MASTER_PORT?)",
                show(&got)
            )));
        }
    }
    Ok(())
}

/// The mutual proof of the job secret, when the store (`server_has_secret`) and this process
/// (`secret`) both have one; having it on one side only is refused.
fn authenticate(
    conn: &TcpStream,
    r: &mut Deadline<'_>,
    addr: &str,
    secret: Option<&JobSecret>,
    server_has_secret: bool,
    parts: &[&[u8]; 2],
    io_failure: &IoFailure<'_>,
) -> Result<(), ClientFailure> {
    use ClientFailure::Fatal;
    match (server_has_secret, secret) {
        (true, None) => {
            return Err(Fatal(format!(
                "the store at {addr} requires the job secret and this process has none: set \
                 {} to the job's secret (tandem-run sets it for the ranks it starts)",
                auth::SECRET_VAR
            )))
        }
        (false, Some(_)) => {
            return Err(Fatal(format!(
                "the store at {addr} does not authenticate its clients, but this process has \
                 a job secret ({}): it is not this job's store, or it was started without the \
                 secret",
                auth::SECRET_VAR
            )))
        }
        (false, None) => {}
        (true, Some(secret)) => {
            let mut proof = [0u8; PROOF_LEN];
            r.read_exact(&mut proof)
                .map_err(|e| io_failure(e, "reading its proof"))?;
            if !secret.verify(SERVER_ROLE, parts, &proof) {
                return Err(Fatal(format!(
                    "the store at {addr} could not prove that it knows the job secret: it \
                     belongs to another job, or {} differs between this process and the one \
                     serving the store",
                    auth::SECRET_VAR
                )));
            }
            (&*conn)
                .write_all(&secret.prove(CLIENT_ROLE, parts))
                .map_err(|e| io_failure(e, "sending this process's proof"))?;
        }
    }
    Ok(())
}

/// Writes a refusal (`answer` already sent or not) and leaves closing to the caller.
pub(crate) fn refusal(message: &str) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(VERSION);
    out.push(ANSWER_REFUSE);
    put_bytes(
        &mut out,
        &message.as_bytes()[..message.len().min(MAX_MESSAGE)],
    );
    out
}

/// Runs the server's side of the handshake. `Err` carries why the connection is refused (for
/// the log); the caller closes it. `accepted` runs once the client is verified, before the
/// final accept is sent: whatever it records is in place by the time the client can act on
/// the accept (the server must not evict a connection whose client already holds one).
pub(crate) fn server_handshake(
    conn: &TcpStream,
    secret: Option<&JobSecret>,
    deadline: Instant,
    accepted: impl FnOnce(),
) -> Result<(), String> {
    let mut r = Deadline {
        stream: conn,
        deadline,
    };
    let fail = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof => "closed during the handshake".to_string(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            "did not complete the handshake in time".to_string()
        }
        _ => format!("handshake failed: {e}"),
    };
    let _ = conn.set_write_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ));
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(fail)?;
    if magic != MAGIC {
        return Err(format!("not a tandem client (it sent {})", show(&magic)));
    }
    let version = read_u8(&mut r).map_err(fail)?;
    if version != VERSION {
        let msg = format!("this store speaks protocol version {VERSION}, the client {version}");
        let _ = (&*conn).write_all(&refusal(&msg));
        return Err(msg);
    }
    let client_flags = read_u8(&mut r).map_err(fail)?;
    let mut client_nonce: Nonce = [0; NONCE_LEN];
    r.read_exact(&mut client_nonce).map_err(fail)?;
    let server_nonce = auth::nonce().map_err(|e| format!("no random nonce: {e}"))?;
    let parts: [&[u8]; 2] = [&client_nonce, &server_nonce];
    let mut answer = MAGIC.to_vec();
    answer.push(VERSION);
    answer.push(ANSWER_ACCEPT);
    answer.push(if secret.is_some() { FLAG_SECRET } else { 0 });
    answer.extend_from_slice(&server_nonce);
    if let Some(secret) = secret {
        answer.extend_from_slice(&secret.prove(SERVER_ROLE, &parts));
    }
    (&*conn).write_all(&answer).map_err(fail)?;
    if let Some(secret) = secret {
        if client_flags & FLAG_SECRET == 0 {
            return Err("the client has no job secret".into());
        }
        let mut proof = [0u8; PROOF_LEN];
        r.read_exact(&mut proof).map_err(fail)?;
        if !secret.verify(CLIENT_ROLE, &parts, &proof) {
            let mut verdict = vec![ANSWER_REFUSE];
            put_bytes(&mut verdict, b"wrong job secret");
            let _ = (&*conn).write_all(&verdict);
            return Err("failed authentication (wrong job secret)".into());
        }
    }
    accepted();
    (&*conn).write_all(&[ANSWER_ACCEPT]).map_err(fail)
}
