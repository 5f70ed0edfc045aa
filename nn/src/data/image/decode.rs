//! Decoding JPEG and PNG files into [`RgbImage`]s, as PIL's `Image.open(f).convert("RGB")`
//! does, with the EXIF orientation applied and bounded memory.
//!
//! The format is chosen by the file's first bytes, never by its extension. JPEG is decoded by
//! `zune-jpeg` and PNG by `png` (image-rs); BENCHMARKS.md ("Choosing the image decoders") says
//! why these two. Every conversion to RGB follows PIL's `convert("RGB")`:
//!
//! - grayscale is repeated into the three channels;
//! - alpha (RGBA, gray+alpha, a palette's or a colour key's `tRNS`) is dropped, not blended;
//! - 16-bit samples keep their high byte (PIL does this for 16-bit RGB and gray+alpha; for
//!   16-bit gray without alpha PIL clips every value above 255 to white instead, which loses
//!   the image, so tandem keeps the high byte there too);
//! - CMYK and YCCK JPEGs are read, as PIL reads them, as Adobe's inverted CMYK and become RGB
//!   with PIL's formula `R = (255 − K) − (255 − K)·C / 255`.
//!
//! The EXIF orientation (tags 1–8, in a JPEG's APP1 or a PNG's `eXIf` chunk) is applied, so
//! [`image_size`] and [`decode_image`] give the image as a viewer displays it. torchvision's
//! default loader (`PIL.Image.open(f).convert("RGB")`) does **not** apply it: for a photograph
//! taken with the camera turned, tandem's pixels are those of `ImageOps.exif_transpose` and
//! torchvision's are the stored, unrotated ones.
//!
//! Decompression bombs: [`read_image`] reads at most [`DecodeLimits::max_file_bytes`] bytes,
//! and the width × height of the header is checked against [`DecodeLimits::max_pixels`] before
//! any pixel buffer is allocated; `png`'s own limit on its working memory is set, and
//! zune-jpeg's cap on progressive scans kept. While decoding, memory peaks at about the RGB
//! image (3 bytes a pixel) plus, for a progressive JPEG, its coefficients (2 bytes a sample: 3
//! bytes a pixel at 4:2:0), or for a PNG with alpha or in gray, the 8-bit samples. A decoder
//! panic on malformed input (none is known; both decoders are fuzzed) is caught and reported as
//! an error naming the file: the check costs nothing on the normal path.

mod jpeg;
mod orientation;
mod png;

use std::io::Read;
use std::path::Path;

use super::RgbImage;
use crate::{Error, Result};

/// Bounds on the files and images [`decode_image`] and [`read_image`] accept, so a corrupt or
/// hostile file cannot make a data loader allocate unbounded memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// The most pixels (width × height) an image may have. Default 178,956,970 (PIL's
    /// `Image.MAX_IMAGE_PIXELS` × 2, the size at which PIL refuses an image): about 537 MB of
    /// RGB pixels.
    pub max_pixels: u64,
    /// The most bytes a file may have. Default 256 MiB.
    pub max_file_bytes: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_pixels: 2 * 89_478_485,
            max_file_bytes: 256 << 20,
        }
    }
}

/// The two formats tandem decodes, told apart by their first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Jpeg,
    Png,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Format::Jpeg => "JPEG",
            Format::Png => "PNG",
        }
    }
}

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

/// The format of `bytes` by its magic number, or an error saying what the file starts with.
fn sniff(bytes: &[u8], path: &Path) -> Result<Format> {
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Ok(Format::Jpeg);
    }
    if bytes.starts_with(PNG_SIGNATURE) {
        return Ok(Format::Png);
    }
    let msg = if bytes.is_empty() {
        "is empty (0 bytes), not a JPEG or PNG file".to_string()
    } else {
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!(
            "is not a JPEG or PNG file (starts with bytes {}{}; a JPEG starts with ff d8 ff, a PNG \
             with 89 50 4e 47 0d 0a 1a 0a)",
            head.join(" "),
            if bytes.len() > 8 { " …" } else { "" }
        )
    };
    Err(format_error(path, msg))
}

/// An error about the file at `path`.
fn format_error(path: &Path, msg: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// The error for an image larger than [`DecodeLimits::max_pixels`].
fn check_pixels(
    format: Format,
    width: usize,
    height: usize,
    limits: &DecodeLimits,
    path: &Path,
) -> Result<()> {
    let pixels = width as u64 * height as u64;
    if pixels > limits.max_pixels {
        return Err(format_error(
            path,
            format!(
                "{} is {width}×{height} = {pixels} pixels, above the limit of {} pixels; raise \
                 DecodeLimits::max_pixels to accept it",
                format.name(),
                limits.max_pixels
            ),
        ));
    }
    Ok(())
}

/// The error for a file larger than [`DecodeLimits::max_file_bytes`].
fn file_too_large(path: &Path, len: u64, limits: &DecodeLimits) -> Error {
    format_error(
        path,
        format!(
            "file is {len} bytes or more, above the limit of {} bytes; raise \
             DecodeLimits::max_file_bytes to accept it",
            limits.max_file_bytes
        ),
    )
}

/// Runs a decoder call, turning a panic inside it into an error naming the file: the decoders
/// are fuzzed and should not panic, but a data loader must not die on one bad file.
fn guard<T>(format: Format, path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(format_error(
            path,
            format!("the {} decoder panicked on this file", format.name()),
        ))
    })
}

/// The `(width, height)` of the JPEG or PNG image in `bytes` as displayed, that is after its
/// EXIF orientation (a photograph stored 4000×3000 with orientation 6 is 3000×4000). Reads only
/// the headers, not the pixels. `path` names the file in errors.
pub fn image_size(bytes: &[u8], path: &Path) -> Result<(usize, usize)> {
    let format = sniff(bytes, path)?;
    guard(format, path, || match format {
        Format::Jpeg => jpeg::size(bytes, path),
        Format::Png => png::size(bytes, path),
    })
}

/// Decodes the JPEG or PNG image in `bytes` (told apart by content) to 8-bit RGB as PIL's
/// `convert("RGB")` does, with its EXIF orientation applied; see the [module docs](self) for
/// the conversions. Errors, naming `path`, on a file that is not JPEG or PNG, is truncated or
/// corrupt, or exceeds `limits` (checked before the pixels are allocated).
pub fn decode_image(bytes: &[u8], path: &Path, limits: &DecodeLimits) -> Result<RgbImage> {
    if bytes.len() as u64 > limits.max_file_bytes {
        return Err(file_too_large(path, bytes.len() as u64, limits));
    }
    let format = sniff(bytes, path)?;
    let (image, orientation) = guard(format, path, || match format {
        Format::Jpeg => jpeg::decode(bytes, path, limits),
        Format::Png => png::decode(bytes, path, limits),
    })?;
    Ok(orientation::apply(image, orientation))
}

/// Reads the file at `path` (at most [`DecodeLimits::max_file_bytes`] bytes: a larger file is
/// an error, found without reading it all) and decodes it with [`decode_image`].
pub fn read_image(path: &Path, limits: &DecodeLimits) -> Result<RgbImage> {
    let io_error = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_error)?;
    // The length from metadata sizes the buffer; `take` bounds the read even if the file grows
    // meanwhile (or is a pipe whose metadata says 0).
    let hint = file.metadata().map(|m| m.len()).unwrap_or(0);
    if hint > limits.max_file_bytes {
        return Err(file_too_large(path, hint, limits));
    }
    let mut bytes = Vec::with_capacity(hint as usize);
    file.take(limits.max_file_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_error)?;
    if bytes.len() as u64 > limits.max_file_bytes {
        return Err(file_too_large(path, bytes.len() as u64, limits));
    }
    decode_image(&bytes, path, limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_recognised_by_content_and_others_are_named_with_their_first_bytes() {
        let path = Path::new("cat.jpg");
        assert_eq!(sniff(b"\xff\xd8\xff\xe0", path).unwrap(), Format::Jpeg);
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n", path).unwrap(), Format::Png);
        let err = sniff(b"hello world, not an image", path)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("cat.jpg: ")
                && err.contains("not a JPEG or PNG")
                && err.contains("68 65 6c 6c"),
            "{err}"
        );
        let err = sniff(b"", path).unwrap_err().to_string();
        assert!(err.contains("cat.jpg") && err.contains("empty"), "{err}");
    }

    #[test]
    fn the_default_limits_are_pils() {
        let limits = DecodeLimits::default();
        assert_eq!(limits.max_pixels, 178_956_970);
        assert_eq!(limits.max_file_bytes, 268_435_456);
    }
}
