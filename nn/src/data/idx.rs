//! Reading IDX files (the format of MNIST), raw or gzip-compressed.
//!
//! An IDX file is a 4-byte magic number — two zero bytes, a type code (0x08 for unsigned
//! bytes) and the number of dimensions — followed by each dimension as a big-endian u32 and
//! then the data in row-major order. Gzip input is recognised by its magic bytes `1f 8b`, not
//! by the file name. Every inconsistency (a wrong magic number, a truncated file, trailing
//! bytes, a corrupt gzip stream) is an error naming the file.

use std::io::Read;
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

/// Reads the whole file, decompressing it if it is gzip.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 4);
        GzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .map_err(|e| Error::Format {
                path: path.to_path_buf(),
                msg: format!("corrupt or truncated gzip data: {e}"),
            })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Reads an IDX file of unsigned bytes whose magic number must be `magic` (which fixes the
/// number of dimensions), checking that the data is exactly as long as the header says.
pub fn read_idx_u8(path: &Path, magic: u32) -> Result<IdxArray> {
    let bytes = read_bytes(path)?;
    parse_idx_u8(path, &bytes, magic)
}

/// Parses the bytes of an IDX file (see [`read_idx_u8`]); `path` is only used in messages.
pub fn parse_idx_u8(path: &Path, bytes: &[u8], magic: u32) -> Result<IdxArray> {
    let fail = |msg: String| Error::Format {
        path: path.to_path_buf(),
        msg,
    };
    if bytes.len() < 4 {
        return Err(fail(format!(
            "{} bytes is too short for an IDX header (truncated file?)",
            bytes.len()
        )));
    }
    let found = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if found != magic {
        return Err(fail(format!(
            "bad magic number 0x{found:08x}, expected 0x{magic:08x} (an IDX file of unsigned \
             bytes with {} dimension(s)); is this the right file?",
            magic & 0xff
        )));
    }
    let rank = (magic & 0xff) as usize;
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(fail(format!(
            "truncated header: {rank} dimensions need {header} bytes, the file has {}",
            bytes.len()
        )));
    }
    let dims: Vec<usize> = (0..rank)
        .map(|d| {
            let at = 4 + 4 * d;
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
        })
        .collect();
    let count = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| fail(format!("dimensions {dims:?} overflow")))?;
    let body = bytes.len() - header;
    if body < count {
        return Err(fail(format!(
            "truncated: the header promises {dims:?} = {count} bytes of data, but only {body} \
             follow"
        )));
    }
    if body > count {
        return Err(fail(format!(
            "{} unexpected bytes after the {dims:?} data (corrupt file?)",
            body - count
        )));
    }
    Ok(IdxArray {
        dims,
        data: bytes[header..].to_vec(),
    })
}
