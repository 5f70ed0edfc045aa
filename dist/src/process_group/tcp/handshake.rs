//! The handshake that opens every connection between two ranks — the TCP links of the mesh and
//! the same-host channels — and decides whether the other end is trusted.
//!
//! The connecting rank (always the higher one) speaks first:
//!
//! 1. connector → acceptor: hello (its rank, world size, group name, channel, whether it has a
//!    job secret, a fresh 32-byte nonce);
//! 2. acceptor → connector: its own hello and, in a job with a secret, an auth frame with
//!    `HMAC(secret, "tandem-link-acceptor" ‖ hello₁ ‖ hello₂)`;
//! 3. connector → acceptor: `HMAC(secret, "tandem-link-connector" ‖ hello₁ ‖ hello₂)`.
//!
//! Each proof covers both hellos byte for byte (both nonces, both ranks, the world sizes, the
//! group and the channel), so it is good for this connection only, in this direction only.
//! Only after the proofs check out are the hellos compared: an authenticated peer that
//! disagrees on the world size or the group is a misconfigured job, reported on both sides
//! with both values; a peer that fails the proof, or is not a tandem rank at all, is a
//! stranger: the acceptor closes the connection, logs it and keeps waiting for the real rank.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::frame::{FrameHeader, FrameKind, HEADER_LEN, MAX_HELLO_PAYLOAD};
use crate::auth::{self, JobSecret, Nonce, Proof, NONCE_LEN, PROOF_LEN};

/// The channel a connection is for (part of every proof, so one cannot stand in for another).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Channel {
    /// A TCP link of the mesh, which carries the collectives' frames.
    Link = 0,
    /// A same-host channel, which carries shared-memory segments.
    SameHost = 1,
}

const FLAG_SECRET: u8 = 1;
const ACCEPTOR_ROLE: &str = "tandem-link-acceptor";
const CONNECTOR_ROLE: &str = "tandem-link-connector";

/// Who this rank is in the handshake.
#[derive(Clone, Debug)]
pub(crate) struct Me {
    pub rank: usize,
    pub world: usize,
    pub name: String,
    pub channel: Channel,
    pub secret: Option<JobSecret>,
}

/// How a handshake failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The other end is not a member of this job (or not a tandem rank): drop it, keep waiting.
    Stranger(String),
    /// A member of this job disagrees (world size, group, secret) or cannot be reached: the
    /// rendezvous fails with this message.
    Fatal(String),
}

/// A connected socket the handshake can run over.
pub(crate) trait HandshakeStream: Read + Write {
    /// Bounds every later read and write by `left`.
    fn set_timeouts(&self, left: Duration) -> io::Result<()>;
}

impl HandshakeStream for TcpStream {
    fn set_timeouts(&self, left: Duration) -> io::Result<()> {
        let left = Some(left.max(Duration::from_millis(1)));
        self.set_read_timeout(left)?;
        self.set_write_timeout(left)
    }
}

impl HandshakeStream for UnixStream {
    fn set_timeouts(&self, left: Duration) -> io::Result<()> {
        let left = Some(left.max(Duration::from_millis(1)));
        self.set_read_timeout(left)?;
        self.set_write_timeout(left)
    }
}

/// A received hello, with its bytes as sent (for the proofs).
struct Hello {
    rank: usize,
    world: u64,
    name: String,
    channel: u8,
    has_secret: bool,
    bytes: Vec<u8>,
}

fn encode_hello(me: &Me, nonce: &Nonce) -> Vec<u8> {
    let mut payload = vec![
        me.channel as u8,
        if me.secret.is_some() { FLAG_SECRET } else { 0 },
    ];
    payload.extend_from_slice(nonce);
    payload.extend_from_slice(me.name.as_bytes());
    let mut frame = FrameHeader::hello(me.rank, me.world, payload.len())
        .encode()
        .to_vec();
    frame.extend_from_slice(&payload);
    frame
}

fn read_hello(s: &mut impl Read) -> io::Result<Hello> {
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head)?;
    let h = FrameHeader::decode(&head).map_err(bad)?;
    if h.kind != FrameKind::Hello {
        return Err(bad(format!("expected a hello frame, got {:?}", h.kind)));
    }
    let len = h.payload_len.min(MAX_HELLO_PAYLOAD) as usize;
    if len < 2 + NONCE_LEN {
        return Err(bad(format!("a hello of {len} bytes is too short")));
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    let mut bytes = head.to_vec();
    bytes.extend_from_slice(&payload);
    Ok(Hello {
        rank: h.aux as usize,
        world: h.index,
        name: String::from_utf8_lossy(&payload[2 + NONCE_LEN..]).into_owned(),
        channel: payload[0],
        has_secret: payload[1] & FLAG_SECRET != 0,
        bytes,
    })
}

fn write_auth(s: &mut impl Write, proof: &Proof) -> io::Result<()> {
    let mut frame = FrameHeader::auth().encode().to_vec();
    frame.extend_from_slice(proof);
    s.write_all(&frame)
}

fn read_auth(s: &mut impl Read) -> io::Result<Proof> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head)?;
    let h =
        FrameHeader::decode(&head).map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))?;
    if h.kind != FrameKind::Auth {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected an auth frame, got {:?}", h.kind),
        ));
    }
    let mut proof = [0u8; PROOF_LEN];
    s.read_exact(&mut proof)?;
    Ok(proof)
}

fn io_text(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => "it closed the connection".into(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "it did not answer in time".into(),
        _ => e.to_string(),
    }
}

/// The message for two ranks that disagree on the job; `None` if they agree.
fn disagreement(me: &Me, peer: &Hello, peer_desc: &str) -> Option<String> {
    if peer.world != me.world as u64 {
        return Some(format!(
            "rank {} ({peer_desc}) has WORLD_SIZE {} but rank {} has WORLD_SIZE {}: every rank \
             must be started with the same WORLD_SIZE",
            peer.rank, peer.world, me.rank, me.world
        ));
    }
    if peer.name != me.name {
        return Some(format!(
            "rank {} ({peer_desc}) joined group {:?} but rank {} group {:?}",
            peer.rank, peer.name, me.rank, me.name
        ));
    }
    None
}

/// How the connecting side's handshake failed.
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// The acceptor closed or reset the connection before the handshake finished (it may have
    /// dropped it to admit a newer connection during a flood): connecting again may succeed.
    Closed(String),
    /// Anything else: the deadline passed, or the other end is not the expected rank of this
    /// job. Trying again will not help.
    Fatal(String),
}

#[cfg(test)]
impl ConnectFailure {
    /// The message, whatever the kind of failure.
    pub(crate) fn into_message(self) -> String {
        match self {
            ConnectFailure::Closed(m) | ConnectFailure::Fatal(m) => m,
        }
    }
}

/// The connecting side: runs the handshake with the rank `expected` reached at `peer_desc`.
/// (The group's setup uses [`try_connect_side`] through `mesh::handshake_with_retry`; tests
/// drive single handshakes with this.)
#[cfg(test)]
pub(crate) fn connect_side(
    s: &mut impl HandshakeStream,
    me: &Me,
    expected: usize,
    peer_desc: &str,
    deadline: Instant,
) -> Result<(), String> {
    try_connect_side(s, me, expected, peer_desc, deadline).map_err(ConnectFailure::into_message)
}

/// [`connect_side`], telling a connection the acceptor closed (worth another try) from the
/// other failures.
pub(crate) fn try_connect_side(
    s: &mut impl HandshakeStream,
    me: &Me,
    expected: usize,
    peer_desc: &str,
    deadline: Instant,
) -> Result<(), ConnectFailure> {
    let fail = |e: io::Error| {
        let message = format!(
            "handshake with rank {expected} at {peer_desc}: {}",
            io_text(&e)
        );
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => ConnectFailure::Closed(message),
            _ => ConnectFailure::Fatal(message),
        }
    };
    s.set_timeouts(deadline.saturating_duration_since(Instant::now()))
        .map_err(fail)?;
    let nonce = auth::nonce().map_err(fail)?;
    let mine = encode_hello(me, &nonce);
    s.write_all(&mine).map_err(fail)?;
    let theirs = read_hello(s).map_err(fail)?;
    if theirs.channel != me.channel as u8 {
        return Err(ConnectFailure::Fatal(format!(
            "{peer_desc} answered on another channel ({}) than this one ({:?})",
            theirs.channel, me.channel
        )));
    }
    let parts: [&[u8]; 2] = [&mine, &theirs.bytes];
    match (&me.secret, theirs.has_secret) {
        (Some(_), false) => {
            return Err(ConnectFailure::Fatal(format!(
                "rank {expected} at {peer_desc} runs without a job secret and rank {} with one: \
                 give every rank the same {}",
                me.rank,
                auth::SECRET_VAR
            )))
        }
        (None, true) => {
            return Err(ConnectFailure::Fatal(format!(
                "rank {expected} at {peer_desc} requires the job secret and rank {} has none: \
                 set {} to the job's secret",
                me.rank,
                auth::SECRET_VAR
            )))
        }
        (None, false) => {}
        (Some(secret), true) => {
            let proof = read_auth(s).map_err(fail)?;
            if !secret.verify(ACCEPTOR_ROLE, &parts, &proof) {
                return Err(ConnectFailure::Fatal(format!(
                    "{peer_desc}, published as rank {expected}'s address, could not prove that \
                     it knows the job secret (another job, or a different {})",
                    auth::SECRET_VAR
                )));
            }
            write_auth(s, &secret.prove(CONNECTOR_ROLE, &parts)).map_err(fail)?;
        }
    }
    if let Some(problem) = disagreement(me, &theirs, peer_desc) {
        return Err(ConnectFailure::Fatal(problem));
    }
    if theirs.rank != expected {
        return Err(ConnectFailure::Fatal(format!(
            "{peer_desc} answered as rank {}, expected rank {expected}",
            theirs.rank
        )));
    }
    Ok(())
}

/// The accepting side: runs the handshake with whoever connected from `peer_desc`; the hello
/// and the proof must arrive by `deadline`. Returns the peer's rank.
pub(crate) fn accept_side(
    s: &mut impl HandshakeStream,
    me: &Me,
    peer_desc: &str,
    deadline: Instant,
) -> Result<usize, Failure> {
    let stranger = |e: io::Error| Failure::Stranger(io_text(&e));
    s.set_timeouts(deadline.saturating_duration_since(Instant::now()))
        .map_err(stranger)?;
    let theirs =
        read_hello(s).map_err(|e| Failure::Stranger(format!("no valid hello: {}", io_text(&e))))?;
    if theirs.channel != me.channel as u8 {
        return Err(Failure::Stranger(format!(
            "a hello for channel {} on the {:?} channel",
            theirs.channel, me.channel
        )));
    }
    let nonce = auth::nonce().map_err(stranger)?;
    let mine = encode_hello(me, &nonce);
    s.write_all(&mine).map_err(stranger)?;
    let parts: [&[u8]; 2] = [&theirs.bytes, &mine];
    if let Some(secret) = &me.secret {
        write_auth(s, &secret.prove(ACCEPTOR_ROLE, &parts)).map_err(stranger)?;
        if !theirs.has_secret {
            return Err(Failure::Stranger(format!(
                "it claims to be rank {} but has no job secret",
                theirs.rank
            )));
        }
        let proof = read_auth(s).map_err(|e| {
            Failure::Stranger(format!(
                "it claims to be rank {} but sent no proof: {}",
                theirs.rank,
                io_text(&e)
            ))
        })?;
        if !secret.verify(CONNECTOR_ROLE, &parts, &proof) {
            return Err(Failure::Stranger(format!(
                "it claims to be rank {} but failed authentication (wrong job secret)",
                theirs.rank
            )));
        }
    } else if theirs.has_secret {
        return Err(Failure::Stranger(format!(
            "it claims to be rank {} and has a job secret, this rank none",
            theirs.rank
        )));
    }
    if let Some(problem) = disagreement(me, &theirs, peer_desc) {
        return Err(Failure::Fatal(problem));
    }
    Ok(theirs.rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn me(rank: usize, world: usize, secret: Option<&str>) -> Me {
        Me {
            rank,
            world,
            name: "default".into(),
            channel: Channel::Link,
            secret: secret.map(|s| JobSecret::from_value(s).unwrap()),
        }
    }

    /// Runs both sides over loopback; returns (connector result, acceptor result).
    fn pair(connector: Me, acceptor: Me) -> (Result<(), String>, Result<usize, Failure>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            accept_side(
                &mut s,
                &acceptor,
                "peer",
                Instant::now() + Duration::from_secs(5),
            )
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let expected = 0;
        let c = connect_side(
            &mut s,
            &connector,
            expected,
            "peer",
            Instant::now() + Duration::from_secs(5),
        );
        drop(s);
        (c, accepting.join().unwrap())
    }

    const K: &str = "the-job-secret-0123456789";

    #[test]
    fn members_with_the_same_secret_agree() {
        let (c, a) = pair(me(1, 2, Some(K)), me(0, 2, Some(K)));
        assert!(c.is_ok(), "{c:?}");
        assert_eq!(a.unwrap(), 1);
        let (c, a) = pair(me(1, 2, None), me(0, 2, None));
        assert!(c.is_ok() && a.is_ok());
    }

    #[test]
    fn a_wrong_or_missing_secret_is_a_stranger_to_the_acceptor_and_named_to_the_connector() {
        let (c, a) = pair(
            me(1, 2, Some("another-secret-0123456789")),
            me(0, 2, Some(K)),
        );
        assert!(c.unwrap_err().contains("could not prove"));
        assert!(matches!(a, Err(Failure::Stranger(_))), "{a:?}");
        let (c, a) = pair(me(1, 2, None), me(0, 2, Some(K)));
        assert!(c.unwrap_err().contains("requires the job secret"));
        assert!(matches!(a, Err(Failure::Stranger(m)) if m.contains("no job secret")));
    }

    #[test]
    fn a_world_size_mismatch_names_both_sizes_on_both_sides() {
        let (c, a) = pair(me(1, 3, Some(K)), me(0, 2, Some(K)));
        let c = c.unwrap_err();
        assert!(
            c.contains("WORLD_SIZE 2") && c.contains("WORLD_SIZE 3"),
            "{c}"
        );
        match a {
            Err(Failure::Fatal(m)) => {
                assert!(
                    m.contains("WORLD_SIZE 3") && m.contains("WORLD_SIZE 2"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
