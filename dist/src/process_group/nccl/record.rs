//! What NCCL ranks publish in the rendezvous store for each other: heartbeat records and the
//! descriptors of their latest collectives, as small fixed-layout binary values.
//!
//! Every value is read from the store, where any rank (or anything holding the job secret) may
//! have written it, so decoding checks every length, code and count and fails with a
//! description instead of trusting it. Encodings are little endian:
//!
//! * a **descriptor** (16 bytes): kind, dtype, reduce op, a zero byte, root (`u32`, `u32::MAX`
//!   for none), element count (`u64`);
//! * a **heartbeat** (`TNHB`, version 1): state, two zero bytes, then `beat` (a counter the
//!   rank bumps at every publication), `issued`, `started` and `done` (sequence numbers of
//!   the last collective issued, seen starting and seen finishing on the comm stream), the
//!   chain hash of every descriptor issued so far; a failed rank adds its error message;
//! * a **history** (`TNHH`, version 1): the rank's last collectives as `(seq, chain hash,
//!   descriptor)`, oldest first.
//!
//! The chain hash of collective #k hashes the hash of #k−1 with k and #k's descriptor, so two
//! ranks that issued the same collectives in the same order have equal hashes at every k, and
//! the first k at which their hashes differ is where their collectives first differ.

use crate::process_group::{codes, CollectiveDesc};

/// Bytes of an encoded descriptor.
pub(crate) const DESC_BYTES: usize = 16;
/// Most collectives a history record carries.
pub(crate) const HISTORY_WINDOW: usize = 64;
/// Longest failure message a heartbeat carries.
pub(crate) const MAX_MESSAGE: usize = 2048;
/// Longest heartbeat value (a reader refuses anything longer before reading it).
pub(crate) const MAX_BEAT_BYTES: usize = 64 + MAX_MESSAGE;
/// Longest history value.
pub(crate) const MAX_HISTORY_BYTES: usize = 8 + HISTORY_WINDOW * (16 + DESC_BYTES);

const BEAT_MAGIC: &[u8; 4] = b"TNHB";
const HISTORY_MAGIC: &[u8; 4] = b"TNHH";
const VERSION: u8 = 1;

/// Encodes `desc` into its 16 bytes.
pub(crate) fn encode_desc(desc: &CollectiveDesc) -> [u8; DESC_BYTES] {
    let mut out = [0u8; DESC_BYTES];
    out[0] = codes::kind_code(desc.kind);
    out[1] = codes::dtype_code(desc.dtype);
    out[2] = codes::op_code(desc.op);
    out[4..8].copy_from_slice(&desc.root.unwrap_or(u32::MAX).to_le_bytes());
    out[8..16].copy_from_slice(&desc.numel.to_le_bytes());
    out
}

/// Decodes a descriptor; unknown codes are an error.
pub(crate) fn decode_desc(bytes: &[u8]) -> Result<CollectiveDesc, String> {
    if bytes.len() != DESC_BYTES {
        return Err(format!("a descriptor of {} bytes", bytes.len()));
    }
    let kind = codes::kind_of(bytes[0])?;
    let dtype = codes::dtype_of(bytes[1])?;
    let op = codes::op_of(bytes[2])?;
    let root = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let numel = u64::from_le_bytes(bytes[8..16].try_into().map_err(|_| "short descriptor")?);
    Ok(CollectiveDesc {
        kind,
        dtype,
        numel,
        op,
        root: (root != u32::MAX).then_some(root),
    })
}

/// The chain hash after collective `seq` with encoded descriptor `desc` (FNV-1a, 64 bits).
pub(crate) fn chain_hash(previous: u64, seq: u64, desc: &[u8; DESC_BYTES]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in previous
        .to_le_bytes()
        .iter()
        .chain(&seq.to_le_bytes())
        .chain(desc)
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Where a rank is in its life, as its heartbeat says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PeerState {
    /// Working.
    Running,
    /// Its group failed; the message is its error.
    Failed(String),
    /// It dropped its group after finishing its collectives.
    Left,
    /// Its connection to the store closed without it leaving: the process exited or died (the
    /// store sets this value, the rank's will, when the connection closes).
    Gone,
}

/// One heartbeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Beat {
    pub state: PeerState,
    pub beat: u64,
    pub issued: u64,
    pub started: u64,
    pub done: u64,
    pub hash: u64,
}

impl Beat {
    /// The encoded record.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        out.extend_from_slice(BEAT_MAGIC);
        out.push(VERSION);
        out.push(match self.state {
            PeerState::Running => 0,
            PeerState::Failed(_) => 1,
            PeerState::Left => 2,
            PeerState::Gone => 3,
        });
        out.extend_from_slice(&[0, 0]);
        for v in [self.beat, self.issued, self.started, self.done, self.hash] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        if let PeerState::Failed(message) = &self.state {
            let mut cut = message.len().min(MAX_MESSAGE);
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            out.extend_from_slice(&(cut as u16).to_le_bytes());
            out.extend_from_slice(&message.as_bytes()[..cut]);
        }
        out
    }

    /// Decodes a record, checking its magic, version, state, lengths and counters.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Beat, String> {
        if bytes.len() < 48 {
            return Err(format!(
                "a heartbeat of {} bytes (at least 48)",
                bytes.len()
            ));
        }
        if &bytes[..4] != BEAT_MAGIC {
            return Err("a heartbeat without the TNHB magic".into());
        }
        if bytes[4] != VERSION {
            return Err(format!(
                "heartbeat version {} (this build speaks 1)",
                bytes[4]
            ));
        }
        let word = |i: usize| {
            let at = 8 + 8 * i;
            u64::from_le_bytes([
                bytes[at],
                bytes[at + 1],
                bytes[at + 2],
                bytes[at + 3],
                bytes[at + 4],
                bytes[at + 5],
                bytes[at + 6],
                bytes[at + 7],
            ])
        };
        let (beat, issued, started, done, hash) = (word(0), word(1), word(2), word(3), word(4));
        if started > issued || done > started {
            return Err(format!(
                "a heartbeat claiming {done} collectives done, {started} started and {issued} \
                 issued"
            ));
        }
        let rest = &bytes[48..];
        let state = match bytes[5] {
            0 | 2 | 3 if !rest.is_empty() => {
                return Err(format!("{} stray bytes after a heartbeat", rest.len()))
            }
            0 => PeerState::Running,
            2 => PeerState::Left,
            3 => PeerState::Gone,
            1 => {
                if rest.len() < 2 {
                    return Err("a failure heartbeat without its message".into());
                }
                let len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
                if len > MAX_MESSAGE || rest.len() != 2 + len {
                    return Err(format!(
                        "a failure message of {len} bytes in {} bytes",
                        rest.len() - 2
                    ));
                }
                PeerState::Failed(String::from_utf8_lossy(&rest[2..]).into_owned())
            }
            other => return Err(format!("unknown heartbeat state {other}")),
        };
        Ok(Beat {
            state,
            beat,
            issued,
            started,
            done,
            hash,
        })
    }
}

/// One published collective: its sequence number, the chain hash after it, its descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HistoryEntry {
    pub seq: u64,
    pub hash: u64,
    pub desc: [u8; DESC_BYTES],
}

/// Encodes up to [`HISTORY_WINDOW`] entries (the last ones of `entries`).
pub(crate) fn encode_history(entries: &[HistoryEntry]) -> Vec<u8> {
    let entries = &entries[entries.len().saturating_sub(HISTORY_WINDOW)..];
    let mut out = Vec::with_capacity(8 + entries.len() * 32);
    out.extend_from_slice(HISTORY_MAGIC);
    out.push(VERSION);
    out.push(entries.len() as u8);
    out.extend_from_slice(&[0, 0]);
    for e in entries {
        out.extend_from_slice(&e.seq.to_le_bytes());
        out.extend_from_slice(&e.hash.to_le_bytes());
        out.extend_from_slice(&e.desc);
    }
    out
}

/// Decodes a history record; entries must be in increasing, consecutive sequence order and
/// their descriptors valid.
pub(crate) fn decode_history(bytes: &[u8]) -> Result<Vec<HistoryEntry>, String> {
    if bytes.len() < 8 || &bytes[..4] != HISTORY_MAGIC || bytes[4] != VERSION {
        return Err("a history record without the TNHH magic and version 1".into());
    }
    let count = bytes[5] as usize;
    if count > HISTORY_WINDOW || bytes.len() != 8 + count * 32 {
        return Err(format!(
            "a history of {count} entries in {} bytes",
            bytes.len()
        ));
    }
    let mut out: Vec<HistoryEntry> = Vec::with_capacity(count);
    for chunk in bytes[8..].chunks_exact(32) {
        let seq = u64::from_le_bytes(chunk[..8].try_into().map_err(|_| "short entry")?);
        let hash = u64::from_le_bytes(chunk[8..16].try_into().map_err(|_| "short entry")?);
        let desc: [u8; DESC_BYTES] = chunk[16..].try_into().map_err(|_| "short entry")?;
        decode_desc(&desc)?;
        if let Some(last) = out.last() {
            if last.seq.checked_add(1) != Some(seq) {
                return Err(format!("history entry #{seq} after #{}", last.seq));
            }
        }
        out.push(HistoryEntry { seq, hash, desc });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process_group::{CollectiveKind, ReduceOp};
    use tandem_core::DType;

    fn all_reduce(numel: u64) -> CollectiveDesc {
        CollectiveDesc {
            kind: CollectiveKind::AllReduce,
            dtype: Some(DType::BF16),
            numel,
            op: Some(ReduceOp::Avg),
            root: None,
        }
    }

    #[test]
    fn descriptors_round_trip() {
        let broadcast = CollectiveDesc {
            kind: CollectiveKind::Broadcast,
            dtype: Some(DType::U8),
            numel: u64::MAX,
            op: None,
            root: Some(3),
        };
        for desc in [
            all_reduce(7),
            broadcast,
            crate::process_group::describe_barrier(),
        ] {
            assert_eq!(decode_desc(&encode_desc(&desc)).unwrap(), desc);
        }
        let mut bad = encode_desc(&all_reduce(1));
        bad[0] = 9;
        assert!(decode_desc(&bad).unwrap_err().contains("collective code 9"));
    }

    #[test]
    fn beats_round_trip_in_every_state() {
        for state in [
            PeerState::Running,
            PeerState::Left,
            PeerState::Gone,
            PeerState::Failed("rank 1: all_reduce failed ✓".into()),
        ] {
            let beat = Beat {
                state,
                beat: 9,
                issued: 5,
                started: 4,
                done: 3,
                hash: 0xfeed,
            };
            assert_eq!(Beat::decode(&beat.encode()).unwrap(), beat);
        }
        let long = Beat {
            state: PeerState::Failed("é".repeat(MAX_MESSAGE)),
            beat: 0,
            issued: 0,
            started: 0,
            done: 0,
            hash: 0,
        };
        let encoded = long.encode();
        assert!(encoded.len() <= MAX_BEAT_BYTES);
        assert!(
            Beat::decode(&encoded).is_ok(),
            "cut at a character boundary"
        );
    }

    #[test]
    fn malformed_beats_are_described_not_trusted() {
        let good = Beat {
            state: PeerState::Running,
            beat: 1,
            issued: 2,
            started: 2,
            done: 1,
            hash: 0,
        }
        .encode();
        assert!(Beat::decode(&good[..47]).is_err());
        let mut wrong_magic = good.clone();
        wrong_magic[0] = b'X';
        assert!(Beat::decode(&wrong_magic).unwrap_err().contains("magic"));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(Beat::decode(&trailing).unwrap_err().contains("stray"));
        let mut backwards = good.clone();
        backwards[32..40].copy_from_slice(&10u64.to_le_bytes()); // done > started
        assert!(Beat::decode(&backwards).is_err());
        let mut lying = good;
        lying[5] = 1; // failed, but no message follows
        lying.extend_from_slice(&5000u16.to_le_bytes());
        assert!(Beat::decode(&lying).is_err());
        // Random bytes never panic.
        let mut x: u64 = 0x1234_5678;
        for _ in 0..2000 {
            let len = (x % 80) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 56) as u8
                })
                .collect();
            let _ = Beat::decode(&bytes);
            let _ = decode_history(&bytes);
        }
    }

    #[test]
    fn histories_keep_the_last_window_and_check_their_order() {
        let mut hash = 0;
        let entries: Vec<HistoryEntry> = (1..=100u64)
            .map(|seq| {
                let desc = encode_desc(&all_reduce(seq));
                hash = chain_hash(hash, seq, &desc);
                HistoryEntry { seq, hash, desc }
            })
            .collect();
        let encoded = encode_history(&entries);
        assert!(encoded.len() <= MAX_HISTORY_BYTES);
        let decoded = decode_history(&encoded).unwrap();
        assert_eq!(decoded.len(), HISTORY_WINDOW);
        assert_eq!(decoded[0].seq, 100 - HISTORY_WINDOW as u64 + 1);
        assert_eq!(decoded.last().unwrap(), entries.last().unwrap());
        let mut gap = encode_history(&entries[..3]);
        gap[8 + 32..8 + 40].copy_from_slice(&7u64.to_le_bytes());
        assert!(decode_history(&gap).unwrap_err().contains("#7 after #1"));
    }

    #[test]
    fn chain_hashes_differ_from_the_first_different_collective_on() {
        let a = encode_desc(&all_reduce(10));
        let b = encode_desc(&all_reduce(11));
        let h1 = chain_hash(0, 1, &a);
        assert_eq!(h1, chain_hash(0, 1, &a));
        assert_ne!(h1, chain_hash(0, 1, &b));
        assert_ne!(
            chain_hash(h1, 2, &a),
            chain_hash(chain_hash(0, 1, &b), 2, &a)
        );
        assert_ne!(
            chain_hash(0, 1, &a),
            chain_hash(0, 2, &a),
            "the position counts"
        );
    }
}
