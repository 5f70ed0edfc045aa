//! [`ImageFolder`]: a dataset of image files laid out one sub-folder per class, as torchvision's
//! `ImageFolder` reads them (ImageNet's `train/` and `val/` layout).
//!
//! The class names are the root's sub-folders in sorted (byte) order, their indices the
//! targets; each class's images are found recursively below its folder (symbolic links
//! followed) and kept in the order torchvision keeps them, so sample `i` is the same file in
//! both. [`Dataset::get_batch`] reads, decodes and transforms the batch's files on the
//! dataset's own pool of worker threads, each straight into its slot of the `u8` batch.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use rayon::prelude::*;
use tandem_core::{Device, Tensor};

use super::decode::{read_image, DecodeLimits};
use super::transforms::ImageTransform;
use crate::data::dataset::{check_data_dir, check_indices};
use crate::data::transforms::sample_seed;
use crate::data::{Batch, Dataset};
use crate::{Error, Result};

/// The file name endings [`ImageFolder`] takes as images, compared case-insensitively; other
/// files are ignored, as torchvision ignores files with extensions it does not decode.
pub const IMAGE_EXTENSIONS: [&str; 3] = [".jpg", ".jpeg", ".png"];

/// How an [`ImageFolder`] turns its files into batches. Built with [`ImageFolderConfig::new`]
/// and the `with_*` methods; defaults: seed 0, no worker threads (decode on the calling
/// thread), [`DecodeLimits::default`], bad files are errors.
#[derive(Clone, Debug)]
pub struct ImageFolderConfig {
    /// The transform every image goes through; its output size is the batch's `H × W`.
    pub transform: ImageTransform,
    /// Seed of the random transforms: sample `i` of epoch `e` draws from
    /// `sample_seed(seed, e, i)` (`crate::data::transforms::sample_seed`).
    pub seed: u64,
    /// Threads that decode and transform a batch's images in parallel; 0 does the work on the
    /// thread that asks for the batch (the data loader's thread).
    pub workers: usize,
    /// Bounds on the size of a file and of a decoded image.
    pub limits: DecodeLimits,
    /// Leave a file that cannot be read or decoded out of its batch (counted by
    /// [`ImageFolder::skipped`], reported once on stderr) instead of failing the batch.
    pub skip_bad_files: bool,
}

impl ImageFolderConfig {
    /// A configuration applying `transform`, with the defaults above.
    pub fn new(transform: ImageTransform) -> Self {
        ImageFolderConfig {
            transform,
            seed: 0,
            workers: 0,
            limits: DecodeLimits::default(),
            skip_bad_files: false,
        }
    }

    /// The same configuration with the random transforms seeded by `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        ImageFolderConfig { seed, ..self }
    }

    /// The same configuration decoding on `workers` threads (0: on the calling thread).
    pub fn with_workers(self, workers: usize) -> Self {
        ImageFolderConfig { workers, ..self }
    }

    /// The same configuration with other decoding limits.
    pub fn with_limits(self, limits: DecodeLimits) -> Self {
        ImageFolderConfig { limits, ..self }
    }

    /// The same configuration skipping (`true`) or failing on (`false`) bad files.
    pub fn with_skip_bad_files(self, skip_bad_files: bool) -> Self {
        ImageFolderConfig {
            skip_bad_files,
            ..self
        }
    }
}

/// Images in class sub-folders: `root/<class>/**/<name>.{jpg,jpeg,png}`.
///
/// Batches are `u8` `[B, 3, H, W]` inputs (`H × W` the transform's output size) and `i64`
/// `[B]` class indices: normalise them where they are used with
/// [`Normalize::normalize_batch`](crate::data::Normalize::normalize_batch) — on the GPU, after
/// the data loader's copy, which moves a quarter of the bytes an `f32` batch would.
///
/// Random transforms are seeded per sample by `(seed, epoch, index)`: call
/// [`set_epoch`](ImageFolder::set_epoch) before asking the loader for each epoch; the same
/// epoch always gives the same images, whatever the batch, the order or the number of workers.
///
/// Memory: the file list takes about the length of each path below its class folder plus 8
/// bytes a sample. While loading, a [`DataLoader`](crate::data::DataLoader) holds at most
/// `prefetch + 1` batches (the finished ones waiting for the caller and the one being built)
/// besides the one the caller holds, and each worker thread holds one file and one decoded
/// image at a time (bounded by [`DecodeLimits`]).
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    /// The class folders' names as the file system spells them (`classes` may be lossy).
    class_dirs: Vec<OsString>,
    /// Samples of class `c` are `class_ends[c - 1]..class_ends[c]` (from 0 for class 0).
    class_ends: Vec<usize>,
    /// Every sample's path below its class folder, concatenated (`OsStr` encoded bytes).
    names: Vec<u8>,
    /// Sample `i`'s path is `names[name_ends[i - 1]..name_ends[i]]` (from 0 for sample 0).
    name_ends: Vec<usize>,
    config: ImageFolderConfig,
    /// `None` when `config.workers` is 0.
    pool: Option<rayon::ThreadPool>,
    epoch: AtomicU64,
    /// Indices of the samples skipped as bad files, each reported once.
    bad: Mutex<HashSet<usize>>,
}

impl std::fmt::Debug for ImageFolder {
    // The file list is left out: a million paths would flood any output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageFolder")
            .field("root", &self.root)
            .field("classes", &self.classes.len())
            .field("samples", &self.name_ends.len())
            .field("config", &self.config)
            .finish()
    }
}

impl ImageFolder {
    /// Scans `root` for class folders and their images. Errors, naming the directory, if
    /// `root` is missing or not a directory, holds no class folder, or a class folder (with
    /// its sub-folders) holds no image, or a directory cannot be read; errors if the
    /// transform's output is empty or the worker threads cannot be started.
    pub fn new(root: impl AsRef<Path>, config: ImageFolderConfig) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        check_data_dir(
            "ImageFolder",
            &root,
            "one sub-folder of .jpg/.jpeg/.png images per class",
        )?;
        let (h, w) = config.transform.output_size();
        if h == 0 || w == 0 {
            return Err(Error::config(
                "ImageFolder",
                format!("the transform's output size {h}×{w} is empty"),
            ));
        }
        let pool = match config.workers {
            0 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("tandem-imagefolder-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::config(
                            "ImageFolder",
                            format!("could not start {n} worker threads: {e}"),
                        )
                    })?,
            ),
        };
        let class_dirs = find_classes(&root)?;
        let mut scan = Scan::default();
        let mut class_ends = Vec::with_capacity(class_dirs.len());
        for class in &class_dirs {
            let dir = root.join(class);
            let before = scan.ends.len();
            scan.class(&dir)?;
            if scan.ends.len() == before {
                return Err(Error::Format {
                    path: dir,
                    msg: format!(
                        "class folder holds no image (files ending in {})",
                        IMAGE_EXTENSIONS.join(", ")
                    ),
                });
            }
            class_ends.push(scan.ends.len());
        }
        scan.names.shrink_to_fit();
        scan.ends.shrink_to_fit();
        Ok(ImageFolder {
            root,
            classes: class_dirs
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect(),
            class_dirs,
            class_ends,
            names: scan.names,
            name_ends: scan.ends,
            config,
            pool,
            epoch: AtomicU64::new(0),
            bad: Mutex::new(HashSet::new()),
        })
    }

    /// The root folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The class names, sorted; a sample's target is its class's index here.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The configuration.
    pub fn config(&self) -> &ImageFolderConfig {
        &self.config
    }

    /// Every sample's file and class index, in sample order (by class, then as torchvision
    /// walks the class folder). The paths are built on the fly from a compact list, so this
    /// is an iterator rather than a slice.
    pub fn samples(&self) -> impl ExactSizeIterator<Item = (PathBuf, usize)> + '_ {
        (0..self.len()).map(|i| (self.path(i), self.target(i)))
    }

    /// Sample `index`'s file and class index, or `None` past the end.
    pub fn sample(&self, index: usize) -> Option<(PathBuf, usize)> {
        (index < self.len()).then(|| (self.path(index), self.target(index)))
    }

    /// Selects the epoch whose random transforms [`get_batch`](Dataset::get_batch) draws.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// How many distinct files have been left out of batches as unreadable so far (with
    /// `skip_bad_files`; always 0 without).
    pub fn skipped(&self) -> usize {
        self.bad.lock().len()
    }

    /// The class index of sample `index` (< len).
    fn target(&self, index: usize) -> usize {
        self.class_ends.partition_point(|&end| end <= index)
    }

    /// The file of sample `index` (< len).
    fn path(&self, index: usize) -> PathBuf {
        let start = index.checked_sub(1).map_or(0, |i| self.name_ends[i]);
        let bytes = &self.names[start..self.name_ends[index]];
        // SAFETY: `bytes` is exactly what `OsStr::as_encoded_bytes` returned for one path
        // during the scan (names are pushed whole and cut at the same offsets), in this
        // process, which is what `from_encoded_bytes_unchecked` requires.
        let name = unsafe { OsStr::from_encoded_bytes_unchecked(bytes) };
        self.root
            .join(&self.class_dirs[self.target(index)])
            .join(name)
    }

    /// Reads, decodes and transforms sample `index` into `slot` (3 × H × W bytes).
    fn load_into(&self, index: usize, epoch: u64, slot: &mut [u8]) -> SampleResult {
        let image = match read_image(&self.path(index), &self.config.limits) {
            Ok(image) => image,
            Err(e) => return SampleResult::Unreadable(e),
        };
        let seed = sample_seed(self.config.seed, epoch, index as u64);
        match self.config.transform.apply_into(&image, seed, slot) {
            Ok(()) => SampleResult::Loaded,
            Err(e) => SampleResult::Failed(e),
        }
    }

    /// An error of sample `index`, naming it and its class (a decode error names the file).
    fn sample_error(&self, index: usize, e: Error) -> Error {
        let class = &self.classes[self.target(index)];
        Error::data(
            "ImageFolder",
            format!("sample {index} (class `{class}`): {e}"),
        )
    }

    /// Keeps the loaded samples of a batch and drops the unreadable ones (each reported once),
    /// or returns the first failure. Returns the positions kept.
    fn sort_out(&self, indices: &[usize], results: Vec<SampleResult>) -> Result<Vec<usize>> {
        let mut kept = Vec::with_capacity(indices.len());
        for (pos, (&index, result)) in indices.iter().zip(results).enumerate() {
            match result {
                SampleResult::Loaded => kept.push(pos),
                SampleResult::Unreadable(e) if self.config.skip_bad_files => {
                    if self.bad.lock().insert(index) {
                        // The error says `ImageFolder: sample i (class …): path: problem`.
                        eprintln!("skipping a bad file: {}", self.sample_error(index, e));
                    }
                }
                SampleResult::Unreadable(e) | SampleResult::Failed(e) => {
                    return Err(self.sample_error(index, e))
                }
            }
        }
        if kept.is_empty() {
            return Err(Error::data(
                "ImageFolder",
                format!(
                    "every file of the batch of samples {indices:?} is bad (skipped); \
                     no sample is left"
                ),
            ));
        }
        Ok(kept)
    }
}

/// What became of one sample of a batch.
enum SampleResult {
    Loaded,
    /// The file could not be read or decoded: skippable.
    Unreadable(Error),
    /// The transform failed: never skipped (it is not the file's fault).
    Failed(Error),
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.name_ends.len()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Batch> {
        check_indices("ImageFolder", indices, self.len())?;
        let (h, w) = self.config.transform.output_size();
        let slot = 3 * h * w;
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut pixels = vec![0u8; indices.len() * slot];
        let work = |(out, &index): (&mut [u8], &usize)| self.load_into(index, epoch, out);
        let results: Vec<SampleResult> = match &self.pool {
            None => pixels.chunks_mut(slot).zip(indices).map(work).collect(),
            Some(pool) => pool.install(|| {
                pixels
                    .par_chunks_mut(slot)
                    .zip(indices.par_iter())
                    .map(work)
                    .collect()
            }),
        };
        // An empty request is an empty batch, not a batch whose every file was skipped.
        let kept = if indices.is_empty() {
            Vec::new()
        } else {
            self.sort_out(indices, results)?
        };
        // Close the gaps the skipped samples left, keeping the order.
        for (to, &from) in kept.iter().enumerate() {
            if to != from {
                pixels.copy_within(from * slot..(from + 1) * slot, to * slot);
            }
        }
        pixels.truncate(kept.len() * slot);
        let targets: Vec<i64> = kept
            .iter()
            .map(|&pos| self.target(indices[pos]) as i64)
            .collect();
        Ok(Batch {
            inputs: Tensor::from_vec(pixels, &[kept.len(), 3, h, w], Device::Cpu)?,
            targets: Tensor::from_vec(targets, &[kept.len()], Device::Cpu)?,
        })
    }
}

/// The class folders of `root`: its sub-directories (symbolic links to directories included),
/// sorted by the bytes of their names. Errors if there is none.
fn find_classes(root: &Path) -> Result<Vec<OsString>> {
    let mut classes: Vec<OsString> = Vec::new();
    for entry in read_dir(root)? {
        let (name, is_dir) = entry?;
        if is_dir {
            classes.push(name);
        }
    }
    if classes.is_empty() {
        return Err(Error::Format {
            path: root.to_path_buf(),
            msg: "holds no class folder; an ImageFolder root holds one sub-folder of images \
                  per class"
                .to_string(),
        });
    }
    classes.sort_unstable_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
    Ok(classes)
}

/// The entries of `dir` as (name, whether it is a directory, following symbolic links). A
/// link that leads nowhere counts as a file, as in Python's `os.walk`.
fn read_dir(dir: &Path) -> Result<impl Iterator<Item = Result<(OsString, bool)>> + '_> {
    let io = move |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    let entries = std::fs::read_dir(dir).map_err(io)?;
    Ok(entries.map(move |entry| {
        let entry = entry.map_err(io)?;
        let kind = entry.file_type().map_err(io)?;
        // The entry's own type costs no system call; only links need a look at the target.
        let is_dir = kind.is_dir()
            || (kind.is_symlink() && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()));
        Ok((entry.file_name(), is_dir))
    }))
}

/// Whether a file name ends in one of [`IMAGE_EXTENSIONS`], ignoring case (the whole name is
/// compared, as torchvision's `has_file_allowed_extension` does, so `.jpg` alone counts).
fn is_image_name(name: &OsStr) -> bool {
    let bytes = name.as_encoded_bytes();
    IMAGE_EXTENSIONS.iter().any(|ext| {
        bytes.len() >= ext.len()
            && bytes[bytes.len() - ext.len()..].eq_ignore_ascii_case(ext.as_bytes())
    })
}

/// The file list being built: every sample's path below its class folder, concatenated.
#[derive(Default)]
struct Scan {
    names: Vec<u8>,
    ends: Vec<usize>,
}

impl Scan {
    /// Appends the images below `class_dir` in torchvision's order: the folders (the class
    /// folder and every folder below it, links followed) sorted by their path, then each
    /// folder's image files sorted by name. A folder that is its own ancestor through a link
    /// is not entered again (Python's walk would loop).
    fn class(&mut self, class_dir: &Path) -> Result<()> {
        // (path below the class folder, image file names) of every folder.
        let mut folders: Vec<(PathBuf, Vec<OsString>)> = Vec::new();
        // Depth-first: (path below the class folder, canonical paths of it and its ancestors).
        let mut pending: Vec<(PathBuf, Vec<PathBuf>)> = vec![(PathBuf::new(), Vec::new())];
        while let Some((rel, mut ancestors)) = pending.pop() {
            let dir = class_dir.join(&rel);
            let canonical = std::fs::canonicalize(&dir).map_err(|source| Error::Io {
                path: dir.clone(),
                source,
            })?;
            if ancestors.contains(&canonical) {
                continue;
            }
            ancestors.push(canonical);
            let mut files = Vec::new();
            for entry in read_dir(&dir)? {
                let (name, is_dir) = entry?;
                if is_dir {
                    pending.push((rel.join(&name), ancestors.clone()));
                } else if is_image_name(&name) {
                    files.push(name);
                }
            }
            files.sort_unstable_by(|a, b| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
            folders.push((rel, files));
        }
        folders.sort_unstable_by(|a, b| {
            (a.0.as_os_str().as_encoded_bytes()).cmp(b.0.as_os_str().as_encoded_bytes())
        });
        for (rel, files) in folders {
            for name in files {
                let path = rel.join(name);
                self.names
                    .extend_from_slice(path.as_os_str().as_encoded_bytes());
                self.ends.push(self.names.len());
            }
        }
        Ok(())
    }
}
