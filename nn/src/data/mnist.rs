//! The MNIST handwritten digits: 28×28 grey images of 0–9, 60 000 for training and 10 000 for
//! testing, read from the four IDX files (raw or gzipped) of the original distribution.
//!
//! [`MnistDataset`] yields f32 `[B, 1, 28, 28]` images scaled to [0, 1] and normalised with
//! MNIST's mean 0.1307 and standard deviation 0.3081 (changeable), and i64 `[B]` labels.

use std::path::{Path, PathBuf};

use tandem_core::{Device, Tensor};

use crate::data::dataset::{check_data_dir, check_indices};
use crate::data::idx::{read_idx_u8, IMAGES_MAGIC, LABELS_MAGIC};
use crate::data::{Batch, Dataset};
use crate::{Error, Result};

/// Mean pixel value of the MNIST training images (after scaling to [0, 1]).
pub const MNIST_MEAN: f32 = 0.1307;
/// Standard deviation of the MNIST training pixels (after scaling to [0, 1]).
pub const MNIST_STD: f32 = 0.3081;

/// Which half of MNIST.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The 60 000 training images (`train-*`).
    Train,
    /// The 10 000 test images (`t10k-*`).
    Test,
}

impl Split {
    fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }
}

/// Loads MNIST from a directory.
pub struct Mnist;

impl Mnist {
    /// Reads `split` from `dir`, which holds `train-images-idx3-ubyte` (or `….gz`),
    /// `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`.
    /// Errors name the directory if it does not exist, else the file that is missing,
    /// truncated or corrupt.
    pub fn load(dir: impl AsRef<Path>, split: Split) -> Result<MnistDataset> {
        let dir = dir.as_ref();
        let images_name = format!("{}-images-idx3-ubyte", split.prefix());
        let labels_name = format!("{}-labels-idx1-ubyte", split.prefix());
        check_data_dir(
            "MNIST",
            dir,
            &format!("{images_name} and {labels_name} (raw or gzipped, `.gz`)"),
        )?;
        let images = find(dir, &images_name)?;
        let labels = find(dir, &labels_name)?;
        MnistDataset::from_files(&images, &labels)
    }
}

/// `dir/name` if it exists, else `dir/name.gz`; an error naming both if neither does.
fn find(dir: &Path, name: &str) -> Result<PathBuf> {
    let raw = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    if raw.is_file() {
        Ok(raw)
    } else if gz.is_file() {
        Ok(gz)
    } else {
        Err(Error::Io {
            path: raw.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("neither {} nor {} exists", raw.display(), gz.display()),
            ),
        })
    }
}

/// MNIST images and labels in memory.
#[derive(Clone, Debug)]
pub struct MnistDataset {
    images: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    mean: f32,
    std: f32,
}

impl MnistDataset {
    /// Reads an images file and a labels file (raw or gzipped IDX), checking magic numbers,
    /// sizes, that both hold the same number of samples, and that labels are digits.
    pub fn from_files(images_path: &Path, labels_path: &Path) -> Result<Self> {
        let images = read_idx_u8(images_path, IMAGES_MAGIC)?;
        let labels = read_idx_u8(labels_path, LABELS_MAGIC)?;
        let (count, rows, cols) = (images.dims[0], images.dims[1], images.dims[2]);
        if rows == 0 || cols == 0 {
            return Err(Error::Format {
                path: images_path.to_path_buf(),
                msg: format!("images of {rows}×{cols} pixels"),
            });
        }
        if labels.dims[0] != count {
            return Err(Error::Format {
                path: labels_path.to_path_buf(),
                msg: format!(
                    "{} labels, but {} holds {count} images",
                    labels.dims[0],
                    images_path.display()
                ),
            });
        }
        if let Some((i, &l)) = labels.data.iter().enumerate().find(|(_, &l)| l > 9) {
            return Err(Error::Format {
                path: labels_path.to_path_buf(),
                msg: format!("label {l} at index {i} is not a digit 0–9"),
            });
        }
        Ok(MnistDataset {
            images: images.data,
            labels: labels.data,
            rows,
            cols,
            mean: MNIST_MEAN,
            std: MNIST_STD,
        })
    }

    /// The same data normalised as `(pixel / 255 − mean) / std` (defaults: [`MNIST_MEAN`],
    /// [`MNIST_STD`]; `0` and `1` give plain [0, 1] pixels).
    pub fn with_normalization(self, mean: f32, std: f32) -> Result<Self> {
        if !(mean.is_finite() && std.is_finite() && std > 0.0) {
            return Err(Error::config(
                "MnistDataset",
                format!("normalisation needs a finite mean and std > 0, got {mean} and {std}"),
            ));
        }
        Ok(MnistDataset { mean, std, ..self })
    }

    /// `(rows, cols)` of each image.
    pub fn image_size(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Every label, in file order.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }
}

impl Dataset for MnistDataset {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        check_indices("MnistDataset", indices, self.len())?;
        let pixels = self.rows * self.cols;
        let scale = 1.0 / (255.0 * self.std);
        let shift = self.mean / self.std;
        let mut inputs = Vec::with_capacity(indices.len() * pixels);
        for &i in indices {
            let image = &self.images[i * pixels..(i + 1) * pixels];
            inputs.extend(image.iter().map(|&p| p as f32 * scale - shift));
        }
        let targets: Vec<i64> = indices.iter().map(|&i| self.labels[i] as i64).collect();
        Ok(Batch {
            inputs: Tensor::from_vec(
                inputs,
                &[indices.len(), 1, self.rows, self.cols],
                Device::Cpu,
            )?,
            targets: Tensor::from_vec(targets, &[indices.len()], Device::Cpu)?,
        })
    }
}

#[cfg(test)]
mod tests;
