//! Passing a rank's output on to the launcher's stdout or stderr, labelled `[rank K] `.
//!
//! Output is passed on as it comes, never held until the rank exits: every piece that ends a
//! line — at `\n`, or at `\r`, which progress bars use to redraw their line — is written (and
//! flushed) as soon as it arrives, with the rank's prefix at the start of each line, `\r`
//! included, so a redrawn progress bar keeps its label (`\r\n` counts as one line end). Text
//! without a line end is held back only up to [`PENDING_LIMIT`] bytes, then written as it is,
//! so memory stays bounded whatever a rank prints. Lines are written whole under the
//! destination's lock, so ranks' lines do not interleave unless one exceeds the limit. If the
//! launcher's own output is gone, the rank's output is still read (and dropped), so the rank
//! never blocks on a full pipe.

use std::io::{ErrorKind, Read, Write};

/// Text without a line end held back before it is written anyway.
pub const PENDING_LIMIT: usize = 8 << 10;

/// Bytes read from the rank at a time.
const READ_CHUNK: usize = 8 << 10;

/// Copies `from` to the launcher's stdout (or stderr) until it ends, labelling each line.
pub fn relay(mut from: impl Read, prefix: String, to_stderr: bool) {
    let mut labeller = Labeller::new(prefix.into_bytes());
    let mut buf = vec![0u8; READ_CHUNK];
    let write = |bytes: &[u8]| {
        // A closed or failing launcher output must not stop the draining.
        let _ = if to_stderr {
            let mut out = std::io::stderr().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        } else {
            let mut out = std::io::stdout().lock();
            out.write_all(bytes).and_then(|()| out.flush())
        };
    };
    loop {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let out = labeller.feed(&buf[..n]);
                if !out.is_empty() {
                    write(&out);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
    }
    let rest = labeller.finish();
    if !rest.is_empty() {
        write(&rest);
    }
}

/// Writes a line of the launcher's own (`[launcher] …`) to stderr, ignoring a closed stderr.
pub fn note(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "[launcher] {text}").and_then(|()| err.flush());
}

/// Inserts the label at line starts of a byte stream fed in arbitrary pieces.
#[derive(Debug)]
pub(crate) struct Labeller {
    prefix: Vec<u8>,
    /// The next byte written starts a line.
    at_line_start: bool,
    /// The last byte written was `\r` (a following `\n` ends the same line).
    after_cr: bool,
    /// The start of a line, not yet written.
    pending: Vec<u8>,
}

impl Labeller {
    pub(crate) fn new(prefix: Vec<u8>) -> Self {
        Labeller {
            prefix,
            at_line_start: true,
            after_cr: false,
            pending: Vec::with_capacity(PENDING_LIMIT),
        }
    }

    /// Takes the next bytes of the stream; returns what is ready to be written.
    pub(crate) fn feed(&mut self, mut data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while !data.is_empty() {
            match data.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(end) => {
                    self.pending.extend_from_slice(&data[..=end]);
                    data = &data[end + 1..];
                    self.emit_pending(&mut out);
                }
                None => {
                    let room = PENDING_LIMIT - self.pending.len();
                    let take = room.min(data.len());
                    self.pending.extend_from_slice(&data[..take]);
                    data = &data[take..];
                    if self.pending.len() == PENDING_LIMIT {
                        self.emit_pending(&mut out);
                    }
                }
            }
        }
        out
    }

    /// The end of the stream: what is still held back, and a final line end if the stream
    /// did not end with `\n`.
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        self.emit_pending(&mut out);
        if !self.at_line_start || self.after_cr {
            out.push(b'\n');
            self.at_line_start = true;
            self.after_cr = false;
        }
        out
    }

    fn emit_pending(&mut self, out: &mut Vec<u8>) {
        let Some(&last) = self.pending.last() else {
            return;
        };
        let continues_crlf = self.after_cr && self.pending[0] == b'\n';
        if self.at_line_start && !continues_crlf {
            out.extend_from_slice(&self.prefix);
        }
        out.append(&mut self.pending);
        self.at_line_start = last == b'\n' || last == b'\r';
        self.after_cr = last == b'\r';
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labelled(pieces: &[&[u8]]) -> String {
        let mut l = Labeller::new(b"[rank 1] ".to_vec());
        let mut out = Vec::new();
        for p in pieces {
            out.extend(l.feed(p));
        }
        out.extend(l.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn every_line_and_every_redrawn_line_is_labelled() {
        assert_eq!(
            labelled(&[b"a\nb", b"c\n\n"]),
            "[rank 1] a\n[rank 1] bc\n[rank 1] \n"
        );
        assert_eq!(
            labelled(&[b"step 1\rstep 2\r", b"step 3\rdone\n"]),
            "[rank 1] step 1\r[rank 1] step 2\r[rank 1] step 3\r[rank 1] done\n"
        );
        assert_eq!(
            labelled(&[b"crlf\r", b"\nnext\r\n"]),
            "[rank 1] crlf\r\n[rank 1] next\r\n"
        );
        assert_eq!(labelled(&[b"no end"]), "[rank 1] no end\n");
        assert_eq!(labelled(&[b"bar 100%\r"]), "[rank 1] bar 100%\r\n");
        assert_eq!(labelled(&[]), "");
    }

    #[test]
    fn a_redrawn_line_is_passed_on_at_once() {
        let mut l = Labeller::new(b"[rank 0] ".to_vec());
        assert_eq!(l.feed(b"10%\r"), b"[rank 0] 10%\r");
        assert_eq!(l.feed(b"20"), b"");
        assert_eq!(l.feed(b"%\r"), b"[rank 0] 20%\r");
    }

    #[test]
    fn output_without_line_ends_is_passed_on_in_bounded_pieces() {
        let mut l = Labeller::new(b"[rank 0] ".to_vec());
        let piece = vec![b'x'; 1000];
        let mut written = 0;
        for i in 1..=1000 {
            written += l.feed(&piece).len();
            assert!(l.pending.len() < PENDING_LIMIT);
            assert!(i * 1000 + 9 - written < PENDING_LIMIT, "held back too much");
        }
        written += l.finish().len();
        // One label, a million x and the final line end.
        assert_eq!(written, 9 + 1_000_000 + 1);
    }
}
