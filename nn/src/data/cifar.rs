//! CIFAR-10 (60 000 32×32 colour images of 10 classes) read from its binary distribution, and
//! [`Mnist32`], MNIST shaped like CIFAR for the same 3×32×32 models.
//!
//! The binary version (<https://www.cs.toronto.edu/~kriz/cifar.html>, "CIFAR-10 binary
//! version") holds `data_batch_1.bin` … `data_batch_5.bin` (training) and `test_batch.bin`,
//! each a sequence of 3073-byte records: one label byte (0–9), then 1024 red, 1024 green and
//! 1024 blue bytes, each plane 32×32 row-major. [`CifarDataset`] yields f32 `[B, 3, 32, 32]`
//! images normalised per channel, optionally augmented (see [`super::transforms`]), and i64
//! `[B]` labels.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tandem_core::{Device, Generator, Tensor};

use crate::data::dataset::{check_data_dir, check_indices};
use crate::data::mnist::{MNIST_MEAN, MNIST_STD};
use crate::data::transforms::{sample_seed, transform_image, Augmentation, Normalize};
use crate::data::{Batch, Dataset, Mnist, MnistDataset, Split};
use crate::{Error, Result};

/// Bytes of one CIFAR-10 image (3 × 32 × 32).
pub const CIFAR_IMAGE_BYTES: usize = 3 * 32 * 32;
/// Bytes of one record of the binary files: a label and an image.
pub const CIFAR_RECORD_BYTES: usize = 1 + CIFAR_IMAGE_BYTES;

/// Loads CIFAR-10 from a directory.
pub struct Cifar10;

impl Cifar10 {
    /// Reads `split` from `dir` (`data_batch_1.bin` … `data_batch_5.bin` for
    /// [`Split::Train`], `test_batch.bin` for [`Split::Test`]), normalised with CIFAR-10's
    /// statistics and without augmentation. Errors name the directory if it does not exist,
    /// else the file that is missing, truncated or holds a label that is not 0–9.
    pub fn load(dir: impl AsRef<Path>, split: Split) -> Result<CifarDataset> {
        let dir = dir.as_ref();
        let expected = match split {
            Split::Train => "data_batch_1.bin … data_batch_5.bin (CIFAR-10's binary version)",
            Split::Test => "test_batch.bin (CIFAR-10's binary version)",
        };
        check_data_dir("CIFAR-10", dir, expected)?;
        let files: Vec<PathBuf> = match split {
            Split::Train => (1..=5)
                .map(|i| dir.join(format!("data_batch_{i}.bin")))
                .collect(),
            Split::Test => vec![dir.join("test_batch.bin")],
        };
        CifarDataset::from_files(&files)
    }
}

/// CIFAR-10 images and labels in memory, with their normalisation and augmentation.
///
/// Augmentation is seeded per sample by `(seed, epoch, index)`: call
/// [`set_epoch`](CifarDataset::set_epoch) before each epoch (before asking the loader for
/// it) to draw new crops and flips; the same epoch always gives the same images.
#[derive(Debug)]
pub struct CifarDataset {
    images: Vec<u8>,
    labels: Vec<u8>,
    normalize: Normalize,
    augmentation: Augmentation,
    seed: u64,
    epoch: AtomicU64,
}

impl CifarDataset {
    /// Reads and concatenates binary CIFAR-10 files, in order.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        for path in paths {
            let bytes = std::fs::read(path).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            parse_records(path, &bytes, &mut images, &mut labels)?;
        }
        Ok(CifarDataset {
            images,
            labels,
            normalize: Normalize::cifar10(),
            augmentation: Augmentation::default(),
            seed: 0,
            epoch: AtomicU64::new(0),
        })
    }

    /// The same data with another per-channel normalisation (3 channels).
    pub fn with_normalization(self, normalize: Normalize) -> Result<Self> {
        if normalize.channels() != 3 {
            return Err(Error::config(
                "CifarDataset",
                format!(
                    "normalisation over {} channels; CIFAR has 3",
                    normalize.channels()
                ),
            ));
        }
        Ok(CifarDataset { normalize, ..self })
    }

    /// The same data with random augmentation seeded by `seed`.
    pub fn with_augmentation(self, augmentation: Augmentation, seed: u64) -> Self {
        CifarDataset {
            augmentation,
            seed,
            ..self
        }
    }

    /// Selects the epoch whose augmentation [`get_batch`](Dataset::get_batch) draws.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// Every label, in file order.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }
}

/// Appends the records of one file to `images` and `labels`.
fn parse_records(
    path: &Path,
    bytes: &[u8],
    images: &mut Vec<u8>,
    labels: &mut Vec<u8>,
) -> Result<()> {
    if bytes.is_empty() || !bytes.len().is_multiple_of(CIFAR_RECORD_BYTES) {
        return Err(Error::Format {
            path: path.to_path_buf(),
            msg: format!(
                "{} bytes is not a positive whole number of {CIFAR_RECORD_BYTES}-byte CIFAR-10 \
                 records (truncated or not a CIFAR-10 binary file)",
                bytes.len()
            ),
        });
    }
    for (i, record) in bytes.chunks_exact(CIFAR_RECORD_BYTES).enumerate() {
        if record[0] > 9 {
            return Err(Error::Format {
                path: path.to_path_buf(),
                msg: format!("label {} of record {i} is not a class 0–9", record[0]),
            });
        }
        labels.push(record[0]);
        images.extend_from_slice(&record[1..]);
    }
    Ok(())
}

impl Dataset for CifarDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        check_indices("CifarDataset", indices, self.len())?;
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut inputs = Vec::with_capacity(indices.len() * CIFAR_IMAGE_BYTES);
        for &i in indices {
            let mut rng = Generator::new(sample_seed(self.seed, epoch, i as u64));
            transform_image(
                &self.images[i * CIFAR_IMAGE_BYTES..(i + 1) * CIFAR_IMAGE_BYTES],
                [3, 32, 32],
                &self.normalize,
                self.augmentation,
                &mut rng,
                &mut inputs,
            )?;
        }
        let targets: Vec<i64> = indices.iter().map(|&i| self.labels[i] as i64).collect();
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, &[indices.len(), 3, 32, 32], Device::Cpu)?,
            targets: Tensor::from_vec(targets, &[indices.len()], Device::Cpu)?,
        })
    }
}

/// MNIST as 3×32×32 images: each 28×28 digit padded with 2 black pixels on every side and
/// repeated into 3 identical channels, normalised with MNIST's mean and std. Lets the CIFAR
/// ResNets train on the MNIST files shipped with tandem.
#[derive(Clone, Debug)]
pub struct Mnist32 {
    mnist: MnistDataset,
}

impl Mnist32 {
    /// Reads `split` of MNIST from `dir` (see [`Mnist::load`]).
    pub fn load(dir: impl AsRef<Path>, split: Split) -> Result<Self> {
        Self::new(Mnist::load(dir, split)?)
    }

    /// Wraps a loaded MNIST dataset (which must hold 28×28 images).
    pub fn new(mnist: MnistDataset) -> Result<Self> {
        if mnist.image_size() != (28, 28) {
            return Err(Error::config(
                "Mnist32",
                format!("needs 28×28 images, got {:?}", mnist.image_size()),
            ));
        }
        // Plain [0, 1] pixels; padding and normalisation happen here.
        Ok(Mnist32 {
            mnist: mnist.with_normalization(0.0, 1.0)?,
        })
    }
}

impl Dataset for Mnist32 {
    fn len(&self) -> usize {
        self.mnist.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        let batch = self.mnist.get_batch(indices)?;
        let small = batch.inputs.read_slice::<f32>()?;
        let background = -MNIST_MEAN / MNIST_STD;
        let mut inputs = vec![background; indices.len() * CIFAR_IMAGE_BYTES];
        for (n, image) in small.chunks_exact(28 * 28).enumerate() {
            for c in 0..3 {
                let plane = &mut inputs[n * CIFAR_IMAGE_BYTES + c * 1024..][..1024];
                for (y, row) in image.chunks_exact(28).enumerate() {
                    for (x, &p) in row.iter().enumerate() {
                        plane[(y + 2) * 32 + x + 2] = (p - MNIST_MEAN) / MNIST_STD;
                    }
                }
            }
        }
        Ok(Batch {
            inputs: Tensor::from_vec(inputs, &[indices.len(), 3, 32, 32], Device::Cpu)?,
            targets: batch.targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record with `label` whose pixel bytes are `(i + seed) % 256`.
    fn record(label: u8, seed: usize) -> Vec<u8> {
        let mut r = vec![label];
        r.extend((0..CIFAR_IMAGE_BYTES).map(|i| ((i + seed) % 256) as u8));
        r
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-cifar-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn cifar_files_round_trip_labels_and_normalised_pixels() {
        let dir = temp_dir("good");
        let mut bytes = record(3, 0);
        bytes.extend(record(9, 7));
        std::fs::write(dir.join("test_batch.bin"), &bytes).unwrap();
        let ds = Cifar10::load(&dir, Split::Test).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.labels(), &[3, 9]);
        let b = ds.get_batch(&[1, 0]).unwrap();
        assert_eq!(b.inputs.dims(), &[2, 3, 32, 32]);
        assert_eq!(b.targets.to_vec::<i64>().unwrap(), vec![9, 3]);
        let x = b.inputs.to_vec::<f32>().unwrap();
        // Sample 1's green plane starts at byte 1024 of its image: (1024 + 7) % 256 = 7.
        let expect = (7.0 / 255.0 - 0.4822) / 0.2435;
        assert!((x[1024] - expect).abs() < 1e-5, "{}", x[1024]);
        // Sample 0's red pixel (0, 5) is byte 5.
        let expect = (5.0 / 255.0 - 0.4914) / 0.2470;
        assert!((x[CIFAR_IMAGE_BYTES + 5] - expect).abs() < 1e-5);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn truncated_and_missing_files_are_errors_naming_the_file() {
        let dir = temp_dir("truncated");
        let mut bytes = record(1, 0);
        bytes.extend(&record(2, 0)[..100]);
        std::fs::write(dir.join("test_batch.bin"), &bytes).unwrap();
        let err = Cifar10::load(&dir, Split::Test).unwrap_err().to_string();
        assert!(
            err.contains("test_batch.bin") && err.contains("3173 bytes"),
            "{err}"
        );
        let err = Cifar10::load(&dir, Split::Train).unwrap_err().to_string();
        assert!(err.contains("data_batch_1.bin"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_missing_directory_is_reported_as_itself_with_the_files_it_should_hold() {
        let dir = std::env::temp_dir().join(format!("tandem-cifar-none-{}", std::process::id()));
        for (split, file) in [
            (Split::Train, "data_batch_5.bin"),
            (Split::Test, "test_batch.bin"),
        ] {
            let err = Cifar10::load(&dir, split).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!(
                    "{}: the CIFAR-10 directory does not exist",
                    dir.display()
                )) && err.contains(file),
                "{err}"
            );
        }
        // Mnist32 reads MNIST and reports its directory the same way.
        let err = Mnist32::load(&dir, Split::Test).unwrap_err().to_string();
        assert!(err.contains("the MNIST directory does not exist"), "{err}");
    }

    #[test]
    fn labels_above_nine_are_errors_naming_file_and_record() {
        let dir = temp_dir("label");
        let mut bytes = record(1, 0);
        bytes.extend(record(10, 0));
        std::fs::write(dir.join("test_batch.bin"), &bytes).unwrap();
        let err = Cifar10::load(&dir, Split::Test).unwrap_err().to_string();
        assert!(
            err.contains("test_batch.bin") && err.contains("label 10 of record 1"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn augmented_batches_are_reproducible_per_epoch() {
        let dir = temp_dir("augment");
        std::fs::write(dir.join("test_batch.bin"), record(0, 3)).unwrap();
        let ds = Cifar10::load(&dir, Split::Test)
            .unwrap()
            .with_augmentation(Augmentation::cifar(), 11);
        let image = |epoch| {
            ds.set_epoch(epoch);
            ds.get_batch(&[0]).unwrap().inputs.to_vec::<f32>().unwrap()
        };
        let first = image(0);
        assert_eq!(first, image(0));
        assert!((1..20).any(|e| image(e) != first));
        assert!(ds.get_batch(&[1]).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn mnist32_pads_digits_and_repeats_them_into_three_channels() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/mnist");
        let mnist = Mnist::load(dir, Split::Test).unwrap();
        let digits = mnist
            .clone()
            .with_normalization(MNIST_MEAN, MNIST_STD)
            .unwrap()
            .get_batch(&[0])
            .unwrap()
            .inputs
            .to_vec::<f32>()
            .unwrap();
        let ds = Mnist32::new(mnist).unwrap();
        let b = ds.get_batch(&[0]).unwrap();
        assert_eq!(b.inputs.dims(), &[1, 3, 32, 32]);
        let x = b.inputs.to_vec::<f32>().unwrap();
        let background = -MNIST_MEAN / MNIST_STD;
        for c in 0..3 {
            let plane = &x[c * 1024..(c + 1) * 1024];
            assert!((plane[0] - background).abs() < 1e-6);
            assert!((plane[31 * 32 + 31] - background).abs() < 1e-6);
            for (i, &d) in digits.iter().enumerate() {
                let (y, xx) = (i / 28, i % 28);
                assert!((plane[(y + 2) * 32 + xx + 2] - d).abs() < 1e-5);
            }
        }
    }
}
