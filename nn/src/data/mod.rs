//! Data loading: datasets, samplers, a prefetching data loader, and MNIST.
//!
//! A [`Dataset`] turns a list of sample indices into one [`Batch`] of tensors. A [`Sampler`]
//! decides which indices an epoch visits and in what order (every index in order, a seeded
//! shuffle, or — in distributed training — one rank's share). A [`DataLoader`] cuts the
//! sampler's order into batches and builds them on a background thread while the caller
//! trains on the previous ones. [`cifar`] reads CIFAR-10 (and shapes MNIST like it), with the
//! augmentations of [`transforms`]. [`image`] decodes JPEG and PNG files and applies the
//! ImageNet transforms; [`ImageFolder`] reads a tree of them, one folder per class, into `u8`
//! batches that [`Normalize::normalize_batch`] turns into `f32` on the device they are on.

pub mod cifar;
mod dataset;
pub mod idx;
pub mod image;
mod loader;
pub mod mnist;
mod sampler;
pub mod transforms;

pub use cifar::{Cifar10, CifarDataset, Mnist32};
pub use dataset::{Batch, Dataset, TensorDataset};
pub use image::{ImageFolder, ImageFolderConfig};
pub use loader::{Batches, DataLoader, DataLoaderConfig};
pub use mnist::{Mnist, MnistDataset, Split};
pub use sampler::{RandomSampler, Sampler, SequentialSampler};
pub use transforms::{Augmentation, Normalize};
