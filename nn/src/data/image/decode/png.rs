//! PNG through the `png` crate (image-rs): every colour type and bit depth, interlaced or not,
//! expanded to 8 bits and converted to RGB as PIL's `convert("RGB")` does.

use std::io::Cursor;
use std::path::Path;

use png::{ColorType, Decoder, Transformations};

use super::{check_pixels, format_error, orientation, DecodeLimits, Format};
use crate::data::image::RgbImage;
use crate::Result;

fn png_error(path: &Path, err: png::DecodingError) -> crate::Error {
    let msg = match err {
        png::DecodingError::IoError(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            "PNG is truncated: the file ends before its image data does".to_string()
        }
        other => format!("PNG is corrupt or unsupported: {other}"),
    };
    format_error(path, msg)
}

/// The EXIF orientation of an `eXIf` chunk (some writers prefix it with JPEG's `Exif\0\0`).
fn exif_orientation(exif: Option<&[u8]>) -> u16 {
    exif.map_or(1, |e| {
        orientation::from_tiff(e.strip_prefix(b"Exif\0\0").unwrap_or(e))
    })
}

/// What the `png` decoder may allocate for itself (row buffers, text, ICC profiles): a row of
/// the widest PNG (2³¹ − 1 pixels of 16-bit RGBA) is 16 GiB, so this bounds the decoder where
/// the pixel limit, checked by tandem, bounds the image.
const PNG_DECODER_BYTES: usize = 64 << 20;

fn decoder(bytes: &[u8]) -> Decoder<Cursor<&[u8]>> {
    let limits = png::Limits {
        bytes: PNG_DECODER_BYTES,
    };
    let mut decoder = Decoder::new_with_limits(Cursor::new(bytes), limits);
    // Palettes and low bit depths expand to 8-bit gray/RGB (+ alpha from tRNS); 16-bit samples
    // keep their high byte. The alpha is dropped below.
    decoder.set_transformations(Transformations::EXPAND | Transformations::STRIP_16);
    // Text and ICC profiles are not used (PIL's convert("RGB") ignores the profile too): not
    // inflating them keeps `image_size` cheap.
    decoder.set_ignore_text_chunk(true);
    decoder.set_ignore_iccp_chunk(true);
    decoder
}

/// The displayed `(width, height)`: the header and the chunks before the image data (where an
/// `eXIf` chunk, if any, usually is).
pub(super) fn size(bytes: &[u8], path: &Path) -> Result<(usize, usize)> {
    let reader = decoder(bytes).read_info().map_err(|e| png_error(path, e))?;
    let info = reader.info();
    Ok(orientation::displayed_size(
        info.width as usize,
        info.height as usize,
        exif_orientation(info.exif_metadata.as_deref()),
    ))
}

/// The stored RGB pixels and the EXIF orientation to apply to them.
pub(super) fn decode(bytes: &[u8], path: &Path, limits: &DecodeLimits) -> Result<(RgbImage, u16)> {
    let mut decoder = decoder(bytes);
    // The header alone first, so a bomb is refused before anything is sized from it.
    let header = decoder.read_header_info().map_err(|e| png_error(path, e))?;
    let (width, height) = (header.width as usize, header.height as usize);
    check_pixels(Format::Png, width, height, limits, path)?;
    let mut reader = decoder.read_info().map_err(|e| png_error(path, e))?;
    let orientation = exif_orientation(reader.info().exif_metadata.as_deref());
    let size = reader
        .output_buffer_size()
        .ok_or_else(|| format_error(path, "PNG is too large for this machine"))?;
    let mut buf = vec![0u8; size];
    let frame = reader
        .next_frame(&mut buf)
        .map_err(|e| png_error(path, e))?;
    let channels = match frame.color_type {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgb => 3,
        ColorType::Rgba => 4,
        ColorType::Indexed => {
            return Err(format_error(path, "PNG palette was not expanded"));
        }
    };
    buf.truncate(frame.buffer_size());
    let pixels = match channels {
        3 => buf,
        _ => to_rgb(&buf, channels),
    };
    let image =
        RgbImage::new(width, height, pixels).map_err(|e| format_error(path, e.to_string()))?;
    Ok((image, orientation))
}

/// 8-bit gray, gray+alpha or RGBA samples → RGB, repeating gray and dropping alpha.
fn to_rgb(samples: &[u8], channels: usize) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(samples.len() / channels * 3);
    for px in samples.chunks_exact(channels) {
        match channels {
            1 | 2 => rgb.extend([px[0]; 3]),
            _ => rgb.extend(&px[..3]),
        }
    }
    rgb
}
