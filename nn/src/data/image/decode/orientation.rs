//! The EXIF orientation tag: reading it from the TIFF structure an EXIF block holds, and
//! turning a decoded image so it reads as displayed.
//!
//! Only IFD0's tag 0x0112 is needed, so the few lines of TIFF walking are written here rather
//! than pulling in an EXIF crate. A missing, malformed or out-of-range tag means orientation 1
//! (as stored), which is what PIL's `ImageOps.exif_transpose` does with it too.

use crate::data::image::RgbImage;

/// The orientation (1–8) in an EXIF block that starts at the TIFF header (`II*\0` or `MM\0*`),
/// or 1 when there is none or it is unreadable.
pub(super) fn from_tiff(tiff: &[u8]) -> u16 {
    read_tag(tiff).filter(|o| (1..=8).contains(o)).unwrap_or(1)
}

fn read_tag(tiff: &[u8]) -> Option<u16> {
    let little = match tiff.get(0..4)? {
        b"II*\0" => true,
        b"MM\0*" => false,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b: [u8; 2] = tiff.get(at..at.checked_add(2)?)?.try_into().ok()?;
        Some(if little {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = tiff.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(if little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    };
    let ifd = u32_at(4)? as usize;
    let entries = u16_at(ifd)? as usize;
    (0..entries).find_map(|i| {
        let entry = ifd.checked_add(2 + 12 * i)?;
        // Tag 0x0112, type SHORT (3), count 1: the value sits in the entry's first two bytes.
        (u16_at(entry)? == 0x0112 && u16_at(entry + 2)? == 3).then(|| u16_at(entry + 8))?
    })
}

/// `image` turned as EXIF `orientation` says the stored pixels must be to display them
/// (orientations outside 2–8 leave it as it is).
pub(super) fn apply(image: RgbImage, orientation: u16) -> RgbImage {
    if !(2..=8).contains(&orientation) {
        return image;
    }
    let (w, h) = (image.width() as isize, image.height() as isize);
    // The stored pixel shown at (x, y) is `first + x * step_x + y * step_y` (pixel indices).
    let (first, step_x, step_y) = match orientation {
        2 => (w - 1, -1, w),       // mirrored left–right
        3 => (h * w - 1, -1, -w),  // turned 180°
        4 => ((h - 1) * w, 1, -w), // mirrored top–bottom
        5 => (0, w, 1),            // transposed
        6 => ((h - 1) * w, -w, 1), // to be turned 90° clockwise
        7 => (h * w - 1, -w, -1),  // transversed
        _ => (w - 1, w, -1),       // to be turned 90° anticlockwise
    };
    let (out_w, out_h) = displayed_size(image.width(), image.height(), orientation);
    let src = image.pixels();
    let mut out = Vec::with_capacity(src.len());
    for y in 0..out_h as isize {
        let row = first + y * step_y;
        for x in 0..out_w as isize {
            // In range: the mapping is a bijection of the w × h pixels (tested for all eight).
            let s = (row + x * step_x) as usize * 3;
            out.extend_from_slice(&src[s..s + 3]);
        }
    }
    RgbImage::new(out_w, out_h, out).expect("a turned image has the pixels of the original")
}

/// The displayed `(width, height)` of a stored `width × height` image with `orientation`.
pub(super) fn displayed_size(width: usize, height: usize, orientation: u16) -> (usize, usize) {
    if (5..=8).contains(&orientation) {
        (height, width)
    } else {
        (width, height)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiff(little: bool, orientation: u16) -> Vec<u8> {
        let u16b = |v: u16| {
            if little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            }
        };
        let u32b = |v: u32| {
            if little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            }
        };
        let mut t = if little {
            b"II*\0".to_vec()
        } else {
            b"MM\0*".to_vec()
        };
        t.extend(u32b(8));
        t.extend(u16b(2));
        // An unrelated tag first (ImageWidth), then Orientation.
        t.extend(u16b(0x0100));
        t.extend(u16b(3));
        t.extend(u32b(1));
        t.extend(u32b(640));
        t.extend(u16b(0x0112));
        t.extend(u16b(3));
        t.extend(u32b(1));
        t.extend(u16b(orientation));
        t.extend([0, 0]);
        t
    }

    #[test]
    fn the_orientation_tag_is_read_in_both_byte_orders_and_garbage_means_as_stored() {
        assert_eq!(from_tiff(&tiff(true, 6)), 6);
        assert_eq!(from_tiff(&tiff(false, 3)), 3);
        assert_eq!(from_tiff(&tiff(true, 9)), 1);
        let t = tiff(false, 8);
        for n in 0..t.len() {
            assert!((1..=8).contains(&from_tiff(&t[..n])));
        }
        assert_eq!(from_tiff(b"nonsense"), 1);
    }

    #[test]
    fn each_orientation_turns_a_2x3_image_as_exif_defines() {
        // Stored image (values are pixel numbers):  0 1
        //                                           2 3
        //                                           4 5
        let px = |v: &[u8]| v.iter().flat_map(|&p| [p, p, p]).collect::<Vec<u8>>();
        let image = RgbImage::new(2, 3, px(&[0, 1, 2, 3, 4, 5])).unwrap();
        let cases: [(u16, (usize, usize), &[u8]); 8] = [
            (1, (2, 3), &[0, 1, 2, 3, 4, 5]),
            (2, (2, 3), &[1, 0, 3, 2, 5, 4]),
            (3, (2, 3), &[5, 4, 3, 2, 1, 0]),
            (4, (2, 3), &[4, 5, 2, 3, 0, 1]),
            (5, (3, 2), &[0, 2, 4, 1, 3, 5]),
            (6, (3, 2), &[4, 2, 0, 5, 3, 1]),
            (7, (3, 2), &[5, 3, 1, 4, 2, 0]),
            (8, (3, 2), &[1, 3, 5, 0, 2, 4]),
        ];
        for (orientation, size, expected) in cases {
            let out = apply(image.clone(), orientation);
            assert_eq!(
                (out.width(), out.height()),
                size,
                "orientation {orientation}"
            );
            assert_eq!(
                displayed_size(2, 3, orientation),
                size,
                "orientation {orientation}"
            );
            assert_eq!(out.pixels(), &px(expected)[..], "orientation {orientation}");
        }
    }
}
