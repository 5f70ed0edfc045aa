//! The wire format of the TCP backend: a fixed 48-byte frame header followed by a payload.
//!
//! Every piece of data a rank sends is framed, and every header repeats what the sender
//! believes is going on — the collective's sequence number, kind, dtype, element count, reduce
//! op or root, and the algorithm — so the receiver can tell a peer that issued a *different*
//! collective (a user bug, reported with both sides) from bytes that are simply corrupt (a
//! protocol error). Decoding is strict and total: any 48 bytes either decode to a header whose
//! every field is in range, or to an error; a header's payload length is capped here and then
//! checked against the exact length the receiver expects before a byte of payload is read, so a
//! peer can never make a rank allocate or write more than it planned to.
//!
//! Layout (little endian), by byte offset:
//!
//! * `0..4` magic `TNDM`; `4` version (2);
//! * `5` frame kind: 1 hello, 2 data, 3 abort, 4 goodbye, 5 auth;
//! * `6` collective: 0 none, 1 all_reduce, 2 broadcast, 3 all_gather, 4 reduce_scatter,
//!   5 barrier; `7` reduce op: 0 none, 1 sum, 2 avg, 3 max, 4 min;
//! * `8` dtype: 0 none, 1 f32, 2 f64, 3 f16, 4 bf16, 5 i64, 6 u8;
//! * `9` algorithm: 0 none, 1 direct, 2 ring, 3 chain, 4 same-host copy; `10..12` reserved,
//!   zero;
//! * `12..16` aux: broadcast root, hello sender rank or abort culprit rank (`u32::MAX`: none);
//! * `16..24` sequence number (goodbye: collectives completed);
//! * `24..32` element count per rank, as in `CollectiveDesc::numel`;
//! * `32..40` frame index: the k-th frame from this sender to this receiver in the
//!   collective (hello: the world size);
//! * `40..48` payload length in bytes.
//!
//! Connections start with the handshake of the `handshake` module: hello frames (payload:
//! channel, flags, a 32-byte nonce, the group name) and, in a job with a secret, auth frames
//! whose 32-byte payload proves the sender knows it. No other frame is trusted before that.

use crate::process_group::{codes, CollectiveDesc, CollectiveKind};

/// Bytes in a frame header.
pub(crate) const HEADER_LEN: usize = 48;
const MAGIC: [u8; 4] = *b"TNDM";
const VERSION: u8 = 2;
/// No rank / no root in the `aux` field.
pub(crate) const NO_RANK: u32 = u32::MAX;
/// Largest data payload any frame may announce (the receiver's own expectation is tighter).
pub(crate) const MAX_DATA_PAYLOAD: u64 = 1 << 30;
/// Largest abort message.
pub(crate) const MAX_ABORT_MESSAGE: u64 = 16 << 10;
/// Largest hello payload (channel, flags, nonce and the group name).
pub(crate) const MAX_HELLO_PAYLOAD: u64 = 1 << 10;
/// The payload of an auth frame: one proof.
pub(crate) const AUTH_PAYLOAD: u64 = crate::auth::PROOF_LEN as u64;

/// What a frame is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// Connection handshake: who the sender is and which group it joins.
    Hello,
    /// A piece of a collective's data.
    Data,
    /// The sender failed; the payload is its error message.
    Abort,
    /// The sender is leaving the group cleanly after `seq` collectives (its handle was dropped).
    Goodbye,
    /// Handshake: the sender's proof that it knows the job secret.
    Auth,
}

/// How a collective moves data; ranks must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Algorithm {
    /// Every rank sends straight to the ranks that need its data (small messages).
    Direct,
    /// Reduce-scatter and/or all-gather around a ring, chunked and pipelined.
    Ring,
    /// A pipelined chain from the root (large broadcasts).
    Chain,
    /// Ranks on one host copy straight from each other's memory; frames only synchronise.
    SameHost,
}

impl Algorithm {
    /// The name used in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Algorithm::Direct => "direct",
            Algorithm::Ring => "ring",
            Algorithm::Chain => "chain",
            Algorithm::SameHost => "same-host copy",
        }
    }
}

/// A decoded, range-checked frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub kind: FrameKind,
    /// The collective (data frames only).
    pub desc: Option<CollectiveDesc>,
    /// The algorithm (data frames only).
    pub algorithm: Option<Algorithm>,
    /// Hello: sender rank; abort: the rank the sender blames; otherwise [`NO_RANK`] (the
    /// broadcast root travels in `desc`).
    pub aux: u32,
    pub seq: u64,
    /// Data: frame index; hello: world size.
    pub index: u64,
    pub payload_len: u64,
}

impl FrameHeader {
    /// A data frame header.
    pub(crate) fn data(
        desc: CollectiveDesc,
        algorithm: Algorithm,
        seq: u64,
        index: u64,
        payload_len: u64,
    ) -> Self {
        FrameHeader {
            kind: FrameKind::Data,
            desc: Some(desc),
            algorithm: Some(algorithm),
            aux: NO_RANK,
            seq,
            index,
            payload_len,
        }
    }

    /// An auth header, followed by a proof.
    pub(crate) fn auth() -> Self {
        FrameHeader {
            kind: FrameKind::Auth,
            desc: None,
            algorithm: None,
            aux: NO_RANK,
            seq: 0,
            index: 0,
            payload_len: AUTH_PAYLOAD,
        }
    }

    /// A hello header from `rank` of a group of `world` ranks, followed by `payload_len` bytes.
    pub(crate) fn hello(rank: usize, world: usize, payload_len: usize) -> Self {
        FrameHeader {
            kind: FrameKind::Hello,
            desc: None,
            algorithm: None,
            aux: rank as u32,
            seq: 0,
            index: world as u64,
            payload_len: payload_len as u64,
        }
    }

    /// An abort header at collective `seq`, blaming `culprit`, followed by `message_len` bytes.
    pub(crate) fn abort(seq: u64, culprit: Option<usize>, message_len: usize) -> Self {
        FrameHeader {
            kind: FrameKind::Abort,
            desc: None,
            algorithm: None,
            aux: culprit.map_or(NO_RANK, |r| r as u32),
            seq,
            index: 0,
            payload_len: message_len as u64,
        }
    }

    /// A goodbye header: the sender leaves after completing `completed` collectives.
    pub(crate) fn goodbye(completed: u64) -> Self {
        FrameHeader {
            kind: FrameKind::Goodbye,
            desc: None,
            algorithm: None,
            aux: NO_RANK,
            seq: completed,
            index: 0,
            payload_len: 0,
        }
    }

    /// The 48 bytes on the wire.
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = match self.kind {
            FrameKind::Hello => 1,
            FrameKind::Data => 2,
            FrameKind::Abort => 3,
            FrameKind::Goodbye => 4,
            FrameKind::Auth => 5,
        };
        let mut aux = self.aux;
        if let Some(d) = &self.desc {
            b[6] = codes::kind_code(d.kind);
            b[7] = codes::op_code(d.op);
            b[8] = codes::dtype_code(d.dtype);
            if let Some(root) = d.root {
                aux = root;
            }
            b[24..32].copy_from_slice(&d.numel.to_le_bytes());
        }
        b[9] = match self.algorithm {
            None => 0,
            Some(Algorithm::Direct) => 1,
            Some(Algorithm::Ring) => 2,
            Some(Algorithm::Chain) => 3,
            Some(Algorithm::SameHost) => 4,
        };
        b[12..16].copy_from_slice(&aux.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.index.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and range-checks a header. Never panics.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if b[0..4] != MAGIC {
            return Err(format!(
                "bad magic {:02x?} (not a tandem frame; is another program on this port?)",
                &b[0..4]
            ));
        }
        if b[4] != VERSION {
            return Err(format!(
                "protocol version {} (this build speaks {VERSION})",
                b[4]
            ));
        }
        if b[10] != 0 || b[11] != 0 {
            return Err("reserved header bytes are not zero".into());
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let fields = Fields {
            aux: u32_at(12),
            seq: u64_at(16),
            numel: u64_at(24),
            index: u64_at(32),
            payload_len: u64_at(40),
        };
        let kind = match b[5] {
            1 => FrameKind::Hello,
            2 => FrameKind::Data,
            3 => FrameKind::Abort,
            4 => FrameKind::Goodbye,
            5 => FrameKind::Auth,
            k => return Err(format!("unknown frame kind {k}")),
        };
        if kind == FrameKind::Data {
            Self::decode_data(b, fields)
        } else {
            Self::decode_control(kind, b, fields)
        }
    }

    /// The rest of a hello, abort, goodbye or auth header: no collective fields, a payload
    /// within the kind's limit.
    fn decode_control(
        kind: FrameKind,
        b: &[u8; HEADER_LEN],
        fields: Fields,
    ) -> Result<Self, String> {
        let Fields {
            aux,
            seq,
            numel,
            index,
            payload_len,
        } = fields;
        if b[6] != 0 || b[7] != 0 || b[8] != 0 || b[9] != 0 || numel != 0 {
            return Err(format!("{kind:?} frame carries collective fields"));
        }
        let cap = match kind {
            FrameKind::Hello => MAX_HELLO_PAYLOAD,
            FrameKind::Abort => MAX_ABORT_MESSAGE,
            FrameKind::Auth => AUTH_PAYLOAD,
            _ => 0,
        };
        if payload_len > cap || (kind == FrameKind::Auth && payload_len != AUTH_PAYLOAD) {
            return Err(format!(
                "{kind:?} frame announces {payload_len} bytes (at most {cap})"
            ));
        }
        Ok(FrameHeader {
            kind,
            desc: None,
            algorithm: None,
            aux,
            seq,
            index,
            payload_len,
        })
    }

    /// The rest of a data header: a collective descriptor whose fields agree with its kind, an
    /// algorithm, a payload within the limit.
    fn decode_data(b: &[u8; HEADER_LEN], fields: Fields) -> Result<Self, String> {
        let Fields {
            aux,
            seq,
            numel,
            index,
            payload_len,
        } = fields;
        let coll = codes::kind_of(b[6])?;
        let op = codes::op_of(b[7])?;
        let dtype = codes::dtype_of(b[8])?;
        let algorithm = match b[9] {
            1 => Algorithm::Direct,
            2 => Algorithm::Ring,
            3 => Algorithm::Chain,
            4 => Algorithm::SameHost,
            a => return Err(format!("unknown algorithm code {a}")),
        };
        let reduces = matches!(
            coll,
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
        );
        if reduces != op.is_some() {
            return Err(format!(
                "{} frame with reduce op code {}",
                coll.name(),
                b[7]
            ));
        }
        let is_barrier = coll == CollectiveKind::Barrier;
        if is_barrier != dtype.is_none() || (is_barrier && numel != 0) {
            return Err(format!(
                "{} frame with dtype code {} and {numel} elements",
                coll.name(),
                b[8]
            ));
        }
        let root = if coll == CollectiveKind::Broadcast {
            Some(aux)
        } else if aux == NO_RANK {
            None
        } else {
            return Err(format!("{} frame names root {aux}", coll.name()));
        };
        if payload_len > MAX_DATA_PAYLOAD {
            return Err(format!(
                "data frame announces {payload_len} bytes (at most {MAX_DATA_PAYLOAD})"
            ));
        }
        Ok(FrameHeader {
            kind: FrameKind::Data,
            desc: Some(CollectiveDesc {
                kind: coll,
                dtype,
                numel,
                op,
                root,
            }),
            algorithm: Some(algorithm),
            aux: NO_RANK,
            seq,
            index,
            payload_len,
        })
    }
}

/// The numeric fields of a header, read before its kind says what they mean.
struct Fields {
    aux: u32,
    seq: u64,
    numel: u64,
    index: u64,
    payload_len: u64,
}

/// What the receiver expects of the next data frame from one peer.
pub(crate) struct Expected<'a> {
    pub seq: u64,
    pub desc: &'a CollectiveDesc,
    pub algorithm: Algorithm,
    pub index: u64,
    pub payload_len: usize,
}

/// How a received header relates to what was expected.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The frame is the expected one; its payload may be read.
    Expected,
    /// The peer issued a different collective (or the same one under another number).
    Mismatch { their_seq: u64, theirs: String },
    /// The peer failed and says why.
    Abort { culprit: Option<usize> },
    /// The peer left the group cleanly after completing this many collectives.
    Goodbye { completed: u64 },
    /// The bytes break the protocol.
    Bad(String),
}

/// Compares a decoded header with the receiver's expectation.
pub(crate) fn judge(h: &FrameHeader, want: &Expected<'_>) -> Verdict {
    match h.kind {
        FrameKind::Abort => {
            return Verdict::Abort {
                culprit: (h.aux != NO_RANK).then_some(h.aux as usize),
            }
        }
        FrameKind::Goodbye => return Verdict::Goodbye { completed: h.seq },
        FrameKind::Hello | FrameKind::Auth => {
            return Verdict::Bad(format!(
                "unexpected {:?} frame in the middle of a collective",
                h.kind
            ))
        }
        FrameKind::Data => {}
    }
    let (Some(desc), Some(algorithm)) = (h.desc, h.algorithm) else {
        return Verdict::Bad("data frame without a collective".into());
    };
    if h.seq != want.seq || desc != *want.desc {
        return Verdict::Mismatch {
            their_seq: h.seq,
            theirs: desc.to_string(),
        };
    }
    if algorithm != want.algorithm {
        return Verdict::Bad(format!(
            "peer runs {} with the {} algorithm, this rank with {}; every rank must use the same \
             GroupConfig",
            desc,
            algorithm.name(),
            want.algorithm.name()
        ));
    }
    if h.index != want.index {
        return Verdict::Bad(format!(
            "frame #{} arrived where #{} was expected",
            h.index, want.index
        ));
    }
    if h.payload_len != want.payload_len as u64 {
        return Verdict::Bad(format!(
            "frame #{} announces {} payload bytes where {} were expected",
            h.index, h.payload_len, want.payload_len
        ));
    }
    Verdict::Expected
}

/// Why a peer closed its connection, as found in what it sent last.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Farewell {
    /// It failed at its collective `seq`, blaming `culprit`, with this message.
    Abort {
        seq: u64,
        culprit: Option<usize>,
        message: String,
    },
    /// It left cleanly after completing `completed` collectives.
    Goodbye { completed: u64 },
}

/// Walks the frames in `bytes` (what was left in a closed connection) and returns the first
/// abort or goodbye, if any. Stops at the first malformed or truncated frame. Never panics.
pub(crate) fn find_farewell(mut bytes: &[u8]) -> Option<Farewell> {
    while bytes.len() >= HEADER_LEN {
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&bytes[..HEADER_LEN]);
        let h = FrameHeader::decode(&head).ok()?;
        bytes = &bytes[HEADER_LEN..];
        let len = usize::try_from(h.payload_len).ok()?;
        let payload = bytes.get(..len)?;
        match h.kind {
            FrameKind::Abort => {
                return Some(Farewell::Abort {
                    seq: h.seq,
                    culprit: (h.aux != NO_RANK).then_some(h.aux as usize),
                    message: String::from_utf8_lossy(payload).into_owned(),
                })
            }
            FrameKind::Goodbye => return Some(Farewell::Goodbye { completed: h.seq }),
            _ => {}
        }
        bytes = &bytes[len..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process_group::ReduceOp;
    use proptest::prelude::*;
    use tandem_core::DType;

    fn sample_desc() -> CollectiveDesc {
        CollectiveDesc {
            kind: CollectiveKind::AllReduce,
            dtype: Some(DType::F32),
            numel: 100,
            op: Some(ReduceOp::Sum),
            root: None,
        }
    }

    fn all_descs() -> Vec<CollectiveDesc> {
        let mut v = vec![sample_desc()];
        for dtype in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::U8,
        ] {
            v.push(CollectiveDesc {
                kind: CollectiveKind::Broadcast,
                dtype: Some(dtype),
                numel: 7,
                op: None,
                root: Some(3),
            });
            v.push(CollectiveDesc {
                kind: CollectiveKind::AllGather,
                dtype: Some(dtype),
                numel: 0,
                op: None,
                root: None,
            });
        }
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            v.push(CollectiveDesc {
                kind: CollectiveKind::ReduceScatter,
                dtype: Some(DType::BF16),
                numel: 1 << 40,
                op: Some(op),
                root: None,
            });
        }
        v.push(crate::process_group::describe_barrier());
        v
    }

    #[test]
    fn every_header_round_trips() {
        for desc in all_descs() {
            for algorithm in [
                Algorithm::Direct,
                Algorithm::Ring,
                Algorithm::Chain,
                Algorithm::SameHost,
            ] {
                let h = FrameHeader::data(desc, algorithm, 42, 7, 4096);
                assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            }
        }
        for h in [
            FrameHeader::hello(3, 8, 7),
            FrameHeader::abort(9, Some(2), 100),
            FrameHeader::abort(9, None, 0),
            FrameHeader::goodbye(5),
            FrameHeader::auth(),
        ] {
            assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn oversized_payloads_are_rejected_at_decode() {
        let mut b = FrameHeader::data(sample_desc(), Algorithm::Ring, 1, 0, 0).encode();
        b[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(FrameHeader::decode(&b).unwrap_err().contains("announces"));
        let mut b = FrameHeader::abort(1, None, 0).encode();
        b[40..48].copy_from_slice(&(MAX_ABORT_MESSAGE + 1).to_le_bytes());
        assert!(FrameHeader::decode(&b).is_err());
    }

    #[test]
    fn judge_tells_mismatches_from_corruption() {
        let ours = sample_desc();
        let want = Expected {
            seq: 3,
            desc: &ours,
            algorithm: Algorithm::Direct,
            index: 0,
            payload_len: 400,
        };
        let same = FrameHeader::data(ours, Algorithm::Direct, 3, 0, 400);
        assert_eq!(judge(&same, &want), Verdict::Expected);
        let other = CollectiveDesc {
            kind: CollectiveKind::Broadcast,
            op: None,
            root: Some(0),
            ..ours
        };
        let theirs = FrameHeader::data(other, Algorithm::Direct, 3, 0, 400);
        assert_eq!(
            judge(&theirs, &want),
            Verdict::Mismatch {
                their_seq: 3,
                theirs: "broadcast(f32, 100, root 0)".into()
            }
        );
        let longer = FrameHeader::data(ours, Algorithm::Direct, 3, 0, 401);
        assert!(matches!(judge(&longer, &want), Verdict::Bad(m) if m.contains("401")));
        let algo = FrameHeader::data(ours, Algorithm::Ring, 3, 0, 400);
        assert!(matches!(judge(&algo, &want), Verdict::Bad(m) if m.contains("GroupConfig")));
        let abort = FrameHeader::abort(3, Some(5), 10);
        assert_eq!(judge(&abort, &want), Verdict::Abort { culprit: Some(5) });
    }

    #[test]
    fn find_farewell_skips_data_frames_and_reads_the_report() {
        let mut stream = Vec::new();
        stream.extend_from_slice(
            &FrameHeader::data(sample_desc(), Algorithm::Direct, 1, 0, 3).encode(),
        );
        stream.extend_from_slice(&[1, 2, 3]);
        let msg = b"rank 3 closed its connection";
        stream.extend_from_slice(&FrameHeader::abort(2, Some(3), msg.len()).encode());
        stream.extend_from_slice(msg);
        let report = find_farewell(&stream).unwrap();
        assert_eq!(
            report,
            Farewell::Abort {
                seq: 2,
                culprit: Some(3),
                message: "rank 3 closed its connection".into()
            }
        );
        assert_eq!(
            find_farewell(&stream[..stream.len() - 1]),
            None,
            "truncated report"
        );
        let bye = FrameHeader::goodbye(17).encode();
        assert_eq!(
            find_farewell(&bye),
            Some(Farewell::Goodbye { completed: 17 })
        );
    }

    fn valid_frame() -> impl Strategy<Value = [u8; HEADER_LEN]> {
        (
            0..all_descs().len(),
            0u8..3,
            any::<u64>(),
            any::<u64>(),
            0u64..=MAX_DATA_PAYLOAD,
        )
            .prop_map(|(d, a, seq, index, len)| {
                let algorithm = [Algorithm::Direct, Algorithm::Ring, Algorithm::Chain][a as usize];
                FrameHeader::data(all_descs()[d], algorithm, seq, index, len).encode()
            })
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::array::uniform32(any::<u8>()),
                                              tail in proptest::array::uniform16(any::<u8>())) {
            let mut b = [0u8; HEADER_LEN];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&tail);
            if let Ok(h) = FrameHeader::decode(&b) {
                prop_assert!(h.payload_len <= MAX_DATA_PAYLOAD);
                prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            }
        }

        #[test]
        fn mutated_valid_frames_decode_to_valid_headers_or_errors(
            frame in valid_frame(),
            flips in proptest::collection::vec((0..HEADER_LEN, any::<u8>()), 1..6),
        ) {
            let mut b = frame;
            for (i, v) in flips {
                b[i] = v;
            }
            if let Ok(h) = FrameHeader::decode(&b) {
                // Whatever decodes is in range and judged without panicking.
                let ours = sample_desc();
                let want = Expected {
                    seq: 1,
                    desc: &ours,
                    algorithm: Algorithm::Ring,
                    index: 0,
                    payload_len: 400,
                };
                let _ = judge(&h, &want);
                prop_assert!(h.payload_len <= MAX_DATA_PAYLOAD);
            }
        }

        #[test]
        fn scanning_random_streams_for_aborts_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
            frame in valid_frame(),
            cut in 0usize..200,
        ) {
            let _ = find_farewell(&bytes);
            let mut stream = frame.to_vec();
            stream.extend_from_slice(&bytes);
            stream.truncate(cut.min(stream.len()));
            let _ = find_farewell(&stream);
        }
    }
}
