//! Images from files: decoding JPEG and PNG, the ImageNet transforms, and the
//! [`ImageFolder`] dataset built from them.
//!
//! Every stage works on [`RgbImage`], 8-bit RGB pixels in memory order row by row, so decoding,
//! cropping, resizing and flipping stay in `u8` until a batch is assembled. Batches leave the
//! pipeline as `u8` and are normalised to `f32` where they are used (on the GPU: after a copy
//! four times smaller than the `f32` batch would be).

pub mod decode;
pub mod folder;
pub mod transforms;

pub use decode::{decode_image, image_size, read_image, DecodeLimits};
pub use folder::{ImageFolder, ImageFolderConfig};
pub use transforms::{resize_box_into, CropBox, ImageTransform, RandomResizedCrop};

use crate::{Error, Result};

/// An 8-bit RGB image: `height` rows of `width` pixels, each pixel three bytes (R, G, B), rows
/// top to bottom without padding (`pixels.len() == width * height * 3`).
#[derive(Clone, PartialEq, Eq)]
pub struct RgbImage {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl RgbImage {
    /// An image of `width × height` pixels from interleaved RGB bytes. Errors if a side is 0 or
    /// `pixels` does not hold exactly `width * height * 3` bytes.
    pub fn new(width: usize, height: usize, pixels: Vec<u8>) -> Result<Self> {
        let expected = width.checked_mul(height).and_then(|n| n.checked_mul(3));
        if width == 0 || height == 0 || expected != Some(pixels.len()) {
            return Err(Error::data(
                "RgbImage",
                format!(
                    "a {width}×{height} RGB image needs {} bytes, got {}",
                    expected.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
                    pixels.len()
                ),
            ));
        }
        Ok(RgbImage {
            width,
            height,
            pixels,
        })
    }

    /// Width in pixels.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> usize {
        self.height
    }

    /// The interleaved RGB bytes, row by row.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The three bytes of the pixel in row `y`, column `x` (panics outside the image, like
    /// slice indexing).
    pub fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = (y * self.width + x) * 3;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }

    /// The pixel bytes, giving up the image.
    pub fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }
}

impl std::fmt::Debug for RgbImage {
    // The pixels are left out: a photograph's bytes would flood any error or test output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RgbImage({}×{})", self.width, self.height)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_needs_exactly_three_bytes_per_pixel() {
        let img = RgbImage::new(2, 1, vec![1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(img.pixel(1, 0), [4, 5, 6]);
        assert_eq!(format!("{img:?}"), "RgbImage(2×1)");
        let err = RgbImage::new(2, 2, vec![0; 6]).unwrap_err().to_string();
        assert!(
            err.contains("2×2") && err.contains("12 bytes") && err.contains("got 6"),
            "{err}"
        );
        assert!(RgbImage::new(0, 5, vec![]).is_err());
        assert!(RgbImage::new(usize::MAX, 2, vec![]).is_err());
    }
}
