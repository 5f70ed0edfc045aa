//! Reading IDX files (the format of MNIST), raw or gzip-compressed.
//!
//! An IDX file is a 4-byte magic number — two zero bytes, a type code (0x08 for unsigned
//! bytes) and the number of dimensions — followed by each dimension as a big-endian u32 and
//! then the data in row-major order. Gzip input is recognised by its magic bytes `1f 8b`, not
//! by the file name. Every inconsistency (a wrong magic number, a truncated file, trailing
//! bytes, a corrupt gzip stream) is an error naming the file.
//!
//! Files are streamed, never read whole: the header is read first, and then at most the
//! number of data bytes it promises plus one, so a small gzip file that inflates to gigabytes
//! ("gzip bomb") costs no more memory than the array its header describes, and a file with
//! more data than that is rejected as soon as one byte too many arrives.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use flate2::read::GzDecoder;

use crate::{Error, Result};

/// Magic number of an IDX file of unsigned bytes with three dimensions (MNIST images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of unsigned bytes with one dimension (MNIST labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// An array of unsigned bytes read from an IDX file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxArray {
    /// The dimensions from the header.
    pub dims: Vec<usize>,
    /// The elements, row-major; `data.len()` is the product of `dims`.
    pub data: Vec<u8>,
}

/// Reads an IDX file of unsigned bytes whose magic number must be `magic` (which fixes the
/// number of dimensions), checking that the data is exactly as long as the header says. Gzip
/// files are decompressed on the fly, never beyond one byte past what the header promises.
pub fn read_idx_u8(path: &Path, magic: u32) -> Result<IdxArray> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut reader = BufReader::new(file);
    let gzipped = reader.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
    if gzipped {
        read_idx_u8_from(GzDecoder::new(reader), path, magic, None)
    } else {
        read_idx_u8_from(reader, path, magic, Some(file_len))
    }
}

/// Reads an IDX array of unsigned bytes from a stream (see [`read_idx_u8`]): the header, then
/// at most the promised data and one byte more. `total_len` is the stream's length when known
/// (a raw file), which makes the error for trailing bytes exact; `path` is only used in
/// messages (and to tell gzip errors apart: a stream of unknown length is taken to be
/// decompressed).
pub fn read_idx_u8_from(
    mut reader: impl Read,
    path: &Path,
    magic: u32,
    total_len: Option<u64>,
) -> Result<IdxArray> {
    let fail = |msg: String| Error::Format {
        path: path.to_path_buf(),
        msg,
    };
    let read_error = |e: std::io::Error| match total_len {
        None => fail(format!("corrupt or truncated gzip data: {e}")),
        Some(_) => Error::Io {
            path: path.to_path_buf(),
            source: e,
        },
    };
    let mut magic_bytes = Vec::with_capacity(4);
    read_up_to(&mut reader, &mut magic_bytes, 4).map_err(read_error)?;
    if magic_bytes.len() < 4 {
        return Err(fail(format!(
            "{} bytes is too short for an IDX header (truncated file?)",
            magic_bytes.len()
        )));
    }
    let found = u32::from_be_bytes([
        magic_bytes[0],
        magic_bytes[1],
        magic_bytes[2],
        magic_bytes[3],
    ]);
    check_magic(path, found, magic)?;
    let rank = (magic & 0xff) as usize;
    let header = 4 + 4 * rank;
    let mut dim_bytes = Vec::with_capacity(4 * rank);
    read_up_to(&mut reader, &mut dim_bytes, 4 * rank as u64).map_err(read_error)?;
    if dim_bytes.len() < 4 * rank {
        return Err(fail(format!(
            "truncated header: {rank} dimensions need {header} bytes, the file has {}",
            4 + dim_bytes.len()
        )));
    }
    let dims = decode_dims(&dim_bytes);
    let count = element_count(path, &dims)?;
    // Never allocate for the header's promise up front: a lying header must not make us
    // reserve gigabytes. The buffer grows with the bytes that actually arrive.
    let mut data = Vec::with_capacity(count.min(1 << 20));
    read_up_to(&mut reader, &mut data, (count as u64).saturating_add(1)).map_err(read_error)?;
    if data.len() < count {
        return Err(fail(format!(
            "truncated: the header promises {dims:?} = {count} bytes of data, but only {} \
             follow",
            data.len()
        )));
    }
    if data.len() > count {
        return Err(fail(match total_len {
            Some(len) => format!(
                "{} unexpected bytes after the {dims:?} data (corrupt file?)",
                len.saturating_sub((header + count) as u64)
            ),
            None => format!(
                "unexpected bytes after the {dims:?} data: the file holds more than the \
                 {count} bytes its header promises (corrupt file?)"
            ),
        }));
    }
    Ok(IdxArray { dims, data })
}

/// Appends up to `limit` bytes of `reader` to `out`, stopping early only at the end of the
/// stream.
fn read_up_to(reader: &mut impl Read, out: &mut Vec<u8>, limit: u64) -> std::io::Result<()> {
    reader.take(limit).read_to_end(out)?;
    Ok(())
}

fn check_magic(path: &Path, found: u32, magic: u32) -> Result<()> {
    if found != magic {
        return Err(Error::Format {
            path: path.to_path_buf(),
            msg: format!(
                "bad magic number 0x{found:08x}, expected 0x{magic:08x} (an IDX file of \
                 unsigned bytes with {} dimension(s)); is this the right file?",
                magic & 0xff
            ),
        });
    }
    Ok(())
}

fn decode_dims(bytes: &[u8]) -> Vec<usize> {
    bytes
        .chunks_exact(4)
        .map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize)
        .collect()
}

fn element_count(path: &Path, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::Format {
            path: path.to_path_buf(),
            msg: format!("dimensions {dims:?} overflow"),
        })
}

/// Parses the bytes of an IDX file held in memory (see [`read_idx_u8`]); `path` is only used
/// in messages.
pub fn parse_idx_u8(path: &Path, bytes: &[u8], magic: u32) -> Result<IdxArray> {
    read_idx_u8_from(bytes, path, magic, Some(bytes.len() as u64))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::write::GzEncoder;
    use flate2::Compression;

    use super::*;

    /// An IDX labels header for `n` labels followed by endless zero bytes, counting how many
    /// bytes the reader was handed.
    struct EndlessZeros {
        header: Vec<u8>,
        handed_out: u64,
    }

    impl Read for EndlessZeros {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let at = self.handed_out as usize;
            let n = if at < self.header.len() {
                let n = buf.len().min(self.header.len() - at);
                buf[..n].copy_from_slice(&self.header[at..at + n]);
                n
            } else {
                buf.fill(0);
                buf.len()
            };
            self.handed_out += n as u64;
            Ok(n)
        }
    }

    fn labels_header(n: u32) -> Vec<u8> {
        let mut h = LABELS_MAGIC.to_be_bytes().to_vec();
        h.extend_from_slice(&n.to_be_bytes());
        h
    }

    #[test]
    fn an_endless_stream_is_read_only_one_byte_past_what_the_header_promises() {
        let mut stream = EndlessZeros {
            header: labels_header(1000),
            handed_out: 0,
        };
        let err = read_idx_u8_from(&mut stream, Path::new("endless"), LABELS_MAGIC, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("endless") && err.contains("more than the 1000 bytes"),
            "{err}"
        );
        assert_eq!(stream.handed_out, 8 + 1000 + 1);
    }

    #[test]
    fn a_gzip_bomb_is_rejected_without_inflating_it() {
        // 10 labels, then 64 MiB of zeros: about 64 KiB of gzip.
        let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(&labels_header(10)).unwrap();
        encoder.write_all(&[0u8; 10]).unwrap();
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..64 {
            encoder.write_all(&zeros).unwrap();
        }
        let bomb = encoder.finish().unwrap();
        assert!(bomb.len() < 1 << 20);
        let dir = std::env::temp_dir().join(format!("tandem-idx-bomb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bomb-labels.gz");
        std::fs::write(&path, &bomb).unwrap();
        let err = read_idx_u8(&path, LABELS_MAGIC).unwrap_err().to_string();
        assert!(
            err.contains("bomb-labels.gz") && err.contains("more than the 10 bytes"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_header_promising_gigabytes_allocates_only_what_arrives() {
        // 4 GiB promised, 3 bytes present: truncated, without reserving the promise.
        let mut bytes = IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [1024u32, 1024, 4096] {
            bytes.extend_from_slice(&d.to_be_bytes());
        }
        bytes.extend_from_slice(&[1, 2, 3]);
        let err = parse_idx_u8(Path::new("liar"), &bytes, IMAGES_MAGIC)
            .unwrap_err()
            .to_string();
        assert!(err.contains("truncated") && err.contains("only 3"), "{err}");
    }
}
