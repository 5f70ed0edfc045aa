//! JPEG through `zune-jpeg`: header reading, the pixel limit, CMYK/YCCK to RGB as PIL does it,
//! and refusing truncated files.
//!
//! zune-jpeg is run in its lenient mode (as libjpeg, and so PIL, decode files with extraneous
//! bytes before a marker, which ImageNet has), and completeness is checked separately by
//! walking the file's markers: a file whose scans end before the end-of-image marker is
//! truncated, which PIL refuses too ("image file is truncated") while zune-jpeg would fill the
//! missing rows with grey.

use std::path::Path;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::errors::DecodeErrors;
use zune_jpeg::JpegDecoder;

use super::{check_pixels, format_error, orientation, DecodeLimits, Format};
use crate::data::image::RgbImage;
use crate::Result;

/// Walks the JPEG's markers to the end-of-image marker; errors if the file ends first.
fn walk_markers(bytes: &[u8], path: &Path) -> Result<()> {
    let truncated = || {
        format_error(
            path,
            "JPEG is truncated: the file ends before its end-of-image marker",
        )
    };
    let mut pos = 2; // after SOI
    loop {
        // Find the next marker: 0xFF (fill bytes 0xFF may repeat) then a code. Stray bytes are
        // skipped, as libjpeg does with a warning.
        pos += bytes
            .get(pos..)
            .ok_or_else(truncated)?
            .iter()
            .position(|&b| b == 0xFF)
            .ok_or_else(truncated)?;
        while bytes.get(pos + 1) == Some(&0xFF) {
            pos += 1;
        }
        let code = *bytes.get(pos + 1).ok_or_else(truncated)?;
        match code {
            0xD9 => return Ok(()),
            // Markers without a length: RSTn, TEM, and a stuffed zero (not a marker).
            0xD0..=0xD7 | 0x01 | 0x00 => pos += 2,
            _ => {
                let len = bytes.get(pos + 2..pos + 4).ok_or_else(truncated)?;
                let len = u16::from_be_bytes([len[0], len[1]]) as usize;
                pos += 2 + len.max(2);
                if pos > bytes.len() {
                    return Err(truncated());
                }
                if code == 0xDA {
                    pos = end_of_entropy_data(bytes, pos).ok_or_else(truncated)?;
                }
            }
        }
    }
}

/// The position of the first marker (other than RSTn) after entropy-coded data starting at
/// `from`, where a 0xFF data byte is always followed by a stuffed 0x00.
fn end_of_entropy_data(bytes: &[u8], from: usize) -> Option<usize> {
    let mut pos = from;
    loop {
        pos += bytes.get(pos..)?.iter().position(|&b| b == 0xFF)?;
        match *bytes.get(pos + 1)? {
            0x00 | 0xD0..=0xD7 | 0xFF => pos += 1,
            _ => return Some(pos),
        }
    }
}

/// A decoder with its side limits opened to JPEG's own (65535): tandem checks width × height
/// against [`DecodeLimits::max_pixels`] itself, after the headers and before any pixel memory,
/// with a clearer message. zune-jpeg's cap of 100 progressive scans (against files whose many
/// scans make decoding slow without making them large) stays.
fn decoder(bytes: &[u8]) -> JpegDecoder<ZCursor<&[u8]>> {
    let options = DecoderOptions::default()
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX))
        .set_strict_mode(false);
    JpegDecoder::new_with_options(ZCursor::new(bytes), options)
}

fn zune_error(path: &Path, err: impl std::fmt::Display) -> crate::Error {
    format_error(path, format!("JPEG is corrupt or unsupported: {err}"))
}

/// zune-jpeg's error, named "truncated" when the data ran out.
fn header_error(path: &Path, err: DecodeErrors) -> crate::Error {
    match err {
        DecodeErrors::IoErrors(_) | DecodeErrors::ExhaustedData => format_error(
            path,
            format!("JPEG is truncated: the file ends inside its headers ({err})"),
        ),
        other => zune_error(path, other),
    }
}

/// Stored width, height and EXIF orientation, from the headers.
fn read_headers(
    decoder: &mut JpegDecoder<ZCursor<&[u8]>>,
    path: &Path,
) -> Result<(usize, usize, u16)> {
    decoder
        .decode_headers()
        .map_err(|e| header_error(path, e))?;
    let (width, height) = decoder
        .dimensions()
        .ok_or_else(|| zune_error(path, "no frame header"))?;
    let orientation = decoder.exif().map_or(1, |e| orientation::from_tiff(e));
    Ok((width, height, orientation))
}

/// The displayed `(width, height)`.
pub(super) fn size(bytes: &[u8], path: &Path) -> Result<(usize, usize)> {
    let (width, height, orientation) = read_headers(&mut decoder(bytes), path)?;
    Ok(orientation::displayed_size(width, height, orientation))
}

/// The stored RGB pixels and the EXIF orientation to apply to them.
pub(super) fn decode(bytes: &[u8], path: &Path, limits: &DecodeLimits) -> Result<(RgbImage, u16)> {
    let mut decoder = decoder(bytes);
    let (width, height, orientation) = read_headers(&mut decoder, path)?;
    check_pixels(Format::Jpeg, width, height, limits, path)?;
    walk_markers(bytes, path)?;
    let input = decoder
        .input_colorspace()
        .ok_or_else(|| zune_error(path, "no colour space"))?;
    // Four-component JPEGs are decoded raw and converted here with PIL's exact formula.
    let four = matches!(input, ColorSpace::CMYK | ColorSpace::YCCK);
    let out = if four { input } else { ColorSpace::RGB };
    decoder.set_options(decoder.options().jpeg_set_out_colorspace(out));
    let size = decoder
        .output_buffer_size()
        .ok_or_else(|| zune_error(path, "image too large for this machine"))?;
    let mut pixels = vec![0u8; size];
    decoder
        .decode_into(&mut pixels)
        .map_err(|e| zune_error(path, e))?;
    if four {
        pixels = four_to_rgb(&pixels, input == ColorSpace::YCCK);
    }
    let image = RgbImage::new(width, height, pixels).map_err(|e| zune_error(path, e))?;
    Ok((image, orientation))
}

/// `a·b/255` rounded as PIL's `MULDIV255` macro does.
fn muldiv255(a: u32, b: u32) -> u32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}

/// libjpeg's YCC → RGB (fixed point, 16 fraction bits, as its `ycck_cmyk_convert`).
fn ycc_to_rgb(y: u8, cb: u8, cr: u8) -> [u8; 3] {
    const HALF: i32 = 1 << 15;
    let fix = |x: f64| (x * 65536.0 + 0.5) as i32;
    let (y, cb, cr) = (i32::from(y), i32::from(cb) - 128, i32::from(cr) - 128);
    let r = y + ((fix(1.40200) * cr + HALF) >> 16);
    let g = y + ((-fix(0.34414) * cb - fix(0.71414) * cr + HALF) >> 16);
    let b = y + ((fix(1.77200) * cb + HALF) >> 16);
    [r, g, b].map(|v| v.clamp(0, 255) as u8)
}

/// Four-component samples (CMYK, or YCCK decoded as libjpeg does to CMYK) → RGB as PIL does:
/// PIL reads every CMYK JPEG as Adobe's inverted CMYK (rawmode `CMYK;I`, with or without the
/// Adobe marker, as Photoshop writes them), then `convert("RGB")` computes
/// `(255 − K) − MULDIV255(C, 255 − K)` per channel.
fn four_to_rgb(samples: &[u8], ycck: bool) -> Vec<u8> {
    let mut rgb = Vec::with_capacity(samples.len() / 4 * 3);
    for px in samples.chunks_exact(4) {
        let mut cmyk = [px[0], px[1], px[2], px[3]];
        if ycck {
            let [r, g, b] = ycc_to_rgb(px[0], px[1], px[2]);
            cmyk = [255 - r, 255 - g, 255 - b, px[3]];
        }
        cmyk = cmyk.map(|v| 255 - v);
        let nk = 255 - u32::from(cmyk[3]);
        for &c in &cmyk[..3] {
            rgb.push((nk - muldiv255(u32::from(c), nk)) as u8);
        }
    }
    rgb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmyk_converts_with_pils_formula() {
        // Values from Pillow 13: Image.new("CMYK", …).convert("RGB"), from the samples a
        // JPEG stores (inverted).
        let cmyk = [0, 0, 0, 0, 255, 0, 0, 0, 100, 50, 20, 30, 10, 200, 30, 255];
        let stored: Vec<u8> = cmyk.iter().map(|v| 255 - v).collect();
        assert_eq!(
            four_to_rgb(&stored, false),
            [255, 255, 255, 0, 255, 255, 137, 181, 207, 0, 0, 0]
        );
    }

    #[test]
    fn a_file_that_ends_inside_a_scan_or_a_segment_is_truncated() {
        let path = Path::new("t.jpg");
        // SOI, APP14, SOS (length 2, no real header), data with a stuffed FF and a restart
        // marker, EOI.
        let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xEE, 0x00, 0x07];
        jpeg.extend(b"Adobe");
        jpeg.extend([
            0xFF, 0xDA, 0x00, 0x02, 0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56,
        ]);
        jpeg.extend([0xFF, 0xD9]);
        walk_markers(&jpeg, path).unwrap();
        for cut in 2..jpeg.len() {
            let err = walk_markers(&jpeg[..cut], path).err().unwrap().to_string();
            assert!(err.contains("t.jpg") && err.contains("truncated"), "{err}");
        }
    }
}
