//! Per-sample image transforms for training: per-channel normalisation, random crop with zero
//! padding and random horizontal flip (the standard CIFAR augmentation).
//!
//! Randomness is explicit and reproducible: each sample draws from its own [`Generator`]
//! seeded by [`sample_seed`]`(seed, epoch, index)`, so a sample gets the same crop and flip
//! whichever batch, worker or order it is built in, and a different one every epoch.

use tandem_core::{DType, Generator, Tensor};

use crate::{Error, Result};

/// Mean of the CIFAR-10 training pixels per channel (R, G, B), after scaling to [0, 1].
pub const CIFAR10_MEAN: [f32; 3] = [0.4914, 0.4822, 0.4465];
/// Standard deviation of the CIFAR-10 training pixels per channel (R, G, B).
pub const CIFAR10_STD: [f32; 3] = [0.2470, 0.2435, 0.2616];
/// Mean of the ImageNet training pixels per channel (R, G, B), after scaling to [0, 1]: the
/// statistics torchvision's pretrained models and ImageNet recipes use.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// Standard deviation of the ImageNet training pixels per channel (R, G, B).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The seed of sample `index` in `epoch` for a run seeded with `seed` (SplitMix64 over the
/// three, so nearby inputs give unrelated seeds).
pub fn sample_seed(seed: u64, epoch: u64, index: u64) -> u64 {
    let mut z = seed;
    for v in [epoch, index] {
        z = splitmix64(z ^ v.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
    z
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Random augmentation of training images. Default: none (crop padding 0, no flip).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Augmentation {
    /// Pad each side with this many black pixels, then crop a random window of the original
    /// size (`RandomCrop(32, padding=4)` is 4); 0 disables cropping.
    pub crop_padding: usize,
    /// Mirror left–right with probability ½.
    pub horizontal_flip: bool,
}

impl Augmentation {
    /// The CIFAR recipe: crop with 4 pixels of padding and random horizontal flips.
    pub fn cifar() -> Self {
        Augmentation {
            crop_padding: 4,
            horizontal_flip: true,
        }
    }

    /// Whether it changes nothing.
    pub fn is_identity(&self) -> bool {
        self.crop_padding == 0 && !self.horizontal_flip
    }
}

/// Per-channel normalisation `(pixel / 255 − mean[c]) / std[c]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalize {
    mean: Vec<f32>,
    std: Vec<f32>,
}

impl Normalize {
    /// Normalisation with one mean and standard deviation per channel. Errors if the lengths
    /// differ, are 0, or a value is not finite or a std not > 0.
    pub fn new(mean: &[f32], std: &[f32]) -> Result<Self> {
        let finite = mean.iter().chain(std).all(|v| v.is_finite());
        if mean.is_empty() || mean.len() != std.len() || !finite || std.iter().any(|&s| s <= 0.0) {
            return Err(Error::config(
                "Normalize",
                format!("need as many finite means as stds > 0, got mean {mean:?} and std {std:?}"),
            ));
        }
        Ok(Normalize {
            mean: mean.to_vec(),
            std: std.to_vec(),
        })
    }

    /// CIFAR-10's statistics ([`CIFAR10_MEAN`], [`CIFAR10_STD`]).
    pub fn cifar10() -> Self {
        Normalize {
            mean: CIFAR10_MEAN.to_vec(),
            std: CIFAR10_STD.to_vec(),
        }
    }

    /// ImageNet's statistics ([`IMAGENET_MEAN`], [`IMAGENET_STD`]).
    pub fn imagenet() -> Self {
        Normalize {
            mean: IMAGENET_MEAN.to_vec(),
            std: IMAGENET_STD.to_vec(),
        }
    }

    /// Number of channels it expects.
    pub fn channels(&self) -> usize {
        self.mean.len()
    }

    /// A batch of images `[N, C, H, W]` of bytes normalised to f32 `(x / 255 − mean[c]) /
    /// std[c]`, computed on the device the batch is on.
    ///
    /// This is where a `u8` batch becomes `f32`: an image dataset ([`super::image::ImageFolder`])
    /// yields bytes, the data loader copies those to the GPU (a quarter of the bytes an `f32`
    /// batch would take), and this runs there, on the compute stream, after the copy. On the CPU
    /// it is the same computation on the CPU. `images` may be `u8` or `f32`; an `f32` batch is
    /// taken to hold pixel values on the same 0–255 scale. The result is a new tensor outside
    /// the autograd graph. Errors if `images` is not 4-D with [`channels`](Self::channels)
    /// channels in dim 1, or is of another dtype.
    pub fn normalize_batch(&self, images: &Tensor) -> Result<Tensor> {
        let dims = images.dims();
        if dims.len() != 4 || dims[1] != self.channels() {
            return Err(Error::input(
                "Normalize",
                format!(
                    "normalize_batch needs [N, {}, H, W] images, got shape {dims:?}",
                    self.channels()
                ),
            ));
        }
        if !matches!(images.dtype(), DType::U8 | DType::F32) {
            return Err(Error::input(
                "Normalize",
                format!(
                    "normalize_batch takes u8 or f32 images, got {:?} {dims:?} on {:?}",
                    images.dtype(),
                    images.device()
                ),
            ));
        }
        // (x/255 − m)/s as one multiply and one subtract: x·(1/(255·s)) − m/s, with the
        // per-channel factors as [1, C, 1, 1] tensors that broadcast over the batch.
        let per_channel = |values: Vec<f32>| -> Result<Tensor> {
            let t = Tensor::from_vec(
                values,
                &[1, self.channels(), 1, 1],
                tandem_core::Device::Cpu,
            )?;
            Ok(t.to_device(images.device())?)
        };
        let scale = per_channel(self.std.iter().map(|s| 1.0 / (255.0 * s)).collect())?;
        let shift = per_channel(
            self.mean
                .iter()
                .zip(&self.std)
                .map(|(m, s)| m / s)
                .collect(),
        )?;
        let x = match images.dtype() {
            DType::F32 => images.detach(),
            _ => images.to_dtype(DType::F32)?,
        };
        Ok(tandem_ops::sub(&tandem_ops::mul(&x, &scale)?, &shift)?)
    }
}

/// Transforms one `[C, H, W]` image of bytes into normalised f32s appended to `out`: a random
/// crop and flip drawn from `rng` as `augmentation` asks (padding pixels are black, i.e.
/// byte 0, before normalisation, as torchvision's `RandomCrop` on a PIL image), then
/// `normalize`. Errors if the sizes disagree.
pub fn transform_image(
    pixels: &[u8],
    shape: [usize; 3],
    normalize: &Normalize,
    augmentation: Augmentation,
    rng: &mut Generator,
    out: &mut Vec<f32>,
) -> Result<()> {
    let [c, h, w] = shape;
    if pixels.len() != c * h * w || normalize.channels() != c {
        return Err(Error::input(
            "transform_image",
            format!(
                "{} bytes for a {c}×{h}×{w} image normalised over {} channels",
                pixels.len(),
                normalize.channels()
            ),
        ));
    }
    let pad = augmentation.crop_padding;
    // Offsets of the crop window in the padded image; (pad, pad) is the original.
    let (dy, dx) = if pad > 0 {
        (rng.below(2 * pad + 1), rng.below(2 * pad + 1))
    } else {
        (0, 0)
    };
    let flip = augmentation.horizontal_flip && rng.uniform() < 0.5;
    for ch in 0..c {
        let scale = 1.0 / (255.0 * normalize.std[ch]);
        let shift = normalize.mean[ch] / normalize.std[ch];
        let plane = &pixels[ch * h * w..(ch + 1) * h * w];
        for y in 0..h {
            // Row of the original image, if the padded row y + dy is inside it.
            let sy = (y + dy).checked_sub(pad).filter(|&sy| sy < h);
            for x in 0..w {
                let xo = if flip { w - 1 - x } else { x };
                let sx = (xo + dx).checked_sub(pad).filter(|&sx| sx < w);
                let byte = match (sy, sx) {
                    (Some(sy), Some(sx)) => plane[sy * w + sx],
                    _ => 0,
                };
                out.push(byte as f32 * scale - shift);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::Device;

    /// A 1×3×3 image with pixels 10, 20, …, 90.
    fn image() -> Vec<u8> {
        (1..=9).map(|v| v * 10).collect()
    }

    fn plain() -> Normalize {
        Normalize::new(&[0.0], &[1.0 / 255.0]).unwrap()
    }

    #[test]
    fn normalisation_matches_the_per_channel_formula() {
        let pixels = [0u8, 255, 51, 102];
        let n = Normalize::new(&[0.5, 0.2], &[0.25, 0.4]).unwrap();
        let mut out = Vec::new();
        let mut rng = Generator::new(0);
        transform_image(
            &pixels,
            [2, 1, 2],
            &n,
            Augmentation::default(),
            &mut rng,
            &mut out,
        )
        .unwrap();
        let expect = [
            (0.0 - 0.5) / 0.25,
            (1.0 - 0.5) / 0.25,
            (0.2 - 0.2) / 0.4,
            (0.4 - 0.2) / 0.4,
        ];
        for (o, e) in out.iter().zip(expect) {
            assert!((o - e).abs() < 1e-5, "{out:?}");
        }
    }

    #[test]
    fn crop_and_flip_move_pixels_and_pad_with_black() {
        // Every (dy, dx, flip) shows up over many seeds; check each output against a direct
        // reading of the padded, cropped, flipped image.
        let pixels = image();
        let aug = Augmentation {
            crop_padding: 1,
            horizontal_flip: true,
        };
        let mut seen = std::collections::HashSet::new();
        for seed in 0..200 {
            let mut out = Vec::new();
            transform_image(
                &pixels,
                [1, 3, 3],
                &plain(),
                aug,
                &mut Generator::new(seed),
                &mut out,
            )
            .unwrap();
            let got: Vec<u8> = out.iter().map(|v| v.round() as u8).collect();
            // Find the (dy, dx, flip) that explains the output.
            let explained = (0..3)
                .flat_map(|dy| (0..3).flat_map(move |dx| [(dy, dx, false), (dy, dx, true)]))
                .find(|&(dy, dx, flip)| {
                    (0..9).all(|i| {
                        let (y, x) = (i / 3, i % 3);
                        let x = if flip { 2 - x } else { x };
                        let (py, px) = (y + dy, x + dx);
                        let want = if (1..=3).contains(&py) && (1..=3).contains(&px) {
                            pixels[(py - 1) * 3 + px - 1]
                        } else {
                            0
                        };
                        got[i] == want
                    })
                });
            seen.insert(explained.expect("output is a padded crop, maybe flipped"));
        }
        assert!(
            seen.len() >= 16,
            "only {} of 18 crops/flips drawn",
            seen.len()
        );
    }

    #[test]
    fn transforms_are_reproducible_per_epoch_and_index() {
        let pixels = image();
        let run = |epoch, index| {
            let mut out = Vec::new();
            let mut rng = Generator::new(sample_seed(7, epoch, index));
            transform_image(
                &pixels,
                [1, 3, 3],
                &plain(),
                Augmentation {
                    crop_padding: 2,
                    horizontal_flip: true,
                },
                &mut rng,
                &mut out,
            )
            .unwrap();
            out
        };
        assert_eq!(run(0, 5), run(0, 5));
        let differs = (0..20).any(|e| run(e, 5) != run(0, 5));
        assert!(differs, "every epoch drew the same augmentation");
        assert_ne!(sample_seed(1, 0, 1), sample_seed(1, 1, 0));
    }

    #[test]
    fn normalize_batch_matches_the_per_pixel_formula_for_bytes_and_floats() {
        let n = Normalize::imagenet();
        let (b, h, w) = (2, 3, 5);
        let bytes: Vec<u8> = (0..b * 3 * h * w).map(|i| (i * 37 % 256) as u8).collect();
        let want: Vec<f64> = bytes
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let c = i / (h * w) % 3;
                (x as f64 / 255.0 - IMAGENET_MEAN[c] as f64) / IMAGENET_STD[c] as f64
            })
            .collect();
        let u8_batch = Tensor::from_vec(bytes.clone(), &[b, 3, h, w], Device::Cpu).unwrap();
        let floats: Vec<f32> = bytes.iter().map(|&x| x as f32).collect();
        let f32_batch = Tensor::from_vec(floats, &[b, 3, h, w], Device::Cpu).unwrap();
        for batch in [u8_batch, f32_batch] {
            let out = n.normalize_batch(&batch).unwrap();
            assert_eq!((out.dims(), out.dtype()), (&[b, 3, h, w][..], DType::F32));
            for (i, (g, e)) in out.to_vec::<f32>().unwrap().iter().zip(&want).enumerate() {
                assert!((*g as f64 - e).abs() < 1e-5, "element {i}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn normalize_batch_rejects_other_ranks_channels_and_dtypes() {
        let n = Normalize::imagenet();
        let err = |t: Tensor| n.normalize_batch(&t).unwrap_err().to_string();
        let e = err(Tensor::zeros(&[2, 1, 4, 4], DType::U8, Device::Cpu).unwrap());
        assert!(
            e.contains("[N, 3, H, W]") && e.contains("[2, 1, 4, 4]"),
            "{e}"
        );
        let e = err(Tensor::zeros(&[3, 4, 4], DType::U8, Device::Cpu).unwrap());
        assert!(e.contains("[3, 4, 4]"), "{e}");
        let e = err(Tensor::zeros(&[1, 3, 2, 2], DType::I64, Device::Cpu).unwrap());
        assert!(e.contains("I64") && e.contains("u8 or f32"), "{e}");
    }

    #[test]
    fn bad_sizes_and_statistics_are_errors() {
        let mut out = Vec::new();
        let err = transform_image(
            &[0; 5],
            [1, 2, 2],
            &plain(),
            Augmentation::default(),
            &mut Generator::new(0),
            &mut out,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("5 bytes") && err.contains("1×2×2"), "{err}");
        assert!(Normalize::new(&[0.5], &[0.0]).is_err());
        assert!(Normalize::new(&[0.5, 0.5], &[0.2]).is_err());
    }
}
