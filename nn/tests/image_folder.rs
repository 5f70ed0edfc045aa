//! `ImageFolder` on small trees of PNG files the tests write: the scan (classes, sample order,
//! extensions, links, errors naming the directory), batches (shape, dtype, targets, pixels
//! equal to decoding and transforming each file alone, the same for any number of workers and
//! any index list, reproducible per epoch) and bad files (an error naming the file and sample,
//! or skipped and counted).

use std::path::{Path, PathBuf};

use tandem_core::DType;
use tandem_nn::data::image::decode::{read_image, DecodeLimits};
use tandem_nn::data::image::transforms::ImageTransform;
use tandem_nn::data::transforms::sample_seed;
use tandem_nn::data::{Dataset, ImageFolder, ImageFolderConfig};

/// A directory under the system's temporary folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tandem-image-folder-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A PNG file (8-bit RGB, no filtering) of `width × height` pixels whose bytes follow from
/// `seed`, written with zlib and CRC-32 from `flate2` so the test needs no image encoder.
fn png_bytes(width: u32, height: u32, seed: u32) -> Vec<u8> {
    use std::io::Write;
    let mut raw = Vec::new();
    for y in 0..height {
        raw.push(0); // filter type None
        for x in 0..width {
            for c in 0..3 {
                raw.push(((x * 7 + y * 13 + c * 50 + seed * 31) % 256) as u8);
            }
        }
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(&raw).unwrap();
    let idat = z.finish().unwrap();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    for (kind, data) in [(b"IHDR", ihdr), (b"IDAT", idat), (b"IEND", Vec::new())] {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut crc = flate2::Crc::new();
        crc.update(kind);
        crc.update(&data);
        out.extend_from_slice(kind);
        out.extend_from_slice(&data);
        out.extend_from_slice(&crc.sum().to_be_bytes());
    }
    out
}

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// Writes PNG images (of varied sizes) at the paths below `root`.
fn write_images(root: &Path, rels: &[&str]) {
    for (i, rel) in rels.iter().enumerate() {
        let i = i as u32;
        write(root, rel, &png_bytes(12 + i % 5, 10 + i % 3, i));
    }
}

/// Three classes of 4, 5 and 3 images.
fn three_classes(dir: &Path) {
    write_images(
        dir,
        &[
            "cat/1.png",
            "cat/2.png",
            "cat/3.png",
            "cat/4.png",
            "dog/a.png",
            "dog/b.png",
            "dog/c.png",
            "dog/d.png",
            "dog/e.png",
            "owl/x.png",
            "owl/y.png",
            "owl/z.png",
        ],
    );
}

fn rel_samples(ds: &ImageFolder) -> Vec<(String, usize)> {
    ds.samples()
        .map(|(p, c)| {
            let rel = p.strip_prefix(ds.root()).unwrap();
            (rel.to_string_lossy().into_owned(), c)
        })
        .collect()
}

fn eval_config() -> ImageFolderConfig {
    ImageFolderConfig::new(ImageTransform::imagenet_eval(8).unwrap())
}

#[test]
fn classes_are_sorted_folders_and_samples_follow_torchvisions_walk() {
    let tmp = TempDir::new("scan");
    let root = &tmp.0;
    write_images(
        root,
        &[
            "b/x.jpeg",
            "a/2.png",
            "a/10.PNG",
            "a/s/1.png",
            "a/s-t/1.png",
            "a/s/u/1.png",
            "C/img.Jpg",
            "C/.jpg",
        ],
    );
    write(root, "a/notes.txt", b"not an image");
    write(root, "a/s/pic.gif", b"GIF89a");
    write(root, "stray.png", &png_bytes(4, 4, 0)); // a file in the root is no class
                                                   // A link to a folder outside the tree is followed; a link back to an ancestor is not
                                                   // entered again.
    let outside = TempDir::new("scan-outside");
    write_images(&outside.0, &["far.png"]);
    std::os::unix::fs::symlink(&outside.0, root.join("b/link")).unwrap();
    std::os::unix::fs::symlink(root.join("b"), root.join("b/loop")).unwrap();
    let ds = ImageFolder::new(root, eval_config()).unwrap();
    assert_eq!(ds.classes(), ["C", "a", "b"]);
    let want = [
        ("C/.jpg", 0),
        ("C/img.Jpg", 0),
        ("a/10.PNG", 1),
        ("a/2.png", 1),
        ("a/s/1.png", 1),
        ("a/s-t/1.png", 1),
        ("a/s/u/1.png", 1),
        ("b/x.jpeg", 2),
        ("b/link/far.png", 2),
    ];
    let want: Vec<(String, usize)> = want.iter().map(|&(p, c)| (p.to_string(), c)).collect();
    assert_eq!(rel_samples(&ds), want);
    assert_eq!(ds.len(), 9);
    assert_eq!(ds.sample(2).unwrap().1, 1);
    assert!(ds.sample(9).is_none());
}

#[test]
fn a_missing_root_an_empty_root_and_an_empty_class_are_errors_naming_the_folder() {
    let tmp = TempDir::new("errors");
    let missing = tmp.0.join("nowhere");
    let err = ImageFolder::new(&missing, eval_config())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("does not exist"),
        "{err}"
    );
    write(&tmp.0, "only-a-file.png", &png_bytes(4, 4, 0));
    let err = ImageFolder::new(&tmp.0, eval_config())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&tmp.0.display().to_string()) && err.contains("no class folder"),
        "{err}"
    );
    write_images(&tmp.0, &["full/1.png"]);
    write(&tmp.0, "empty/readme.txt", b"no images here");
    let err = ImageFolder::new(&tmp.0, eval_config())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&tmp.0.join("empty").display().to_string()) && err.contains("no image"),
        "{err}"
    );
}

/// Sample `index` decoded and transformed on its own, as `get_batch` must place it.
fn expected_sample(ds: &ImageFolder, index: usize, seed: u64, epoch: u64) -> Vec<u8> {
    let (path, _) = ds.sample(index).unwrap();
    let image = read_image(&path, &DecodeLimits::default()).unwrap();
    let (h, w) = ds.config().transform.output_size();
    let mut out = vec![0; 3 * h * w];
    ds.config()
        .transform
        .apply_into(&image, sample_seed(seed, epoch, index as u64), &mut out)
        .unwrap();
    out
}

#[test]
fn batches_hold_each_sample_transformed_alone_for_any_worker_count_and_index_list() {
    let tmp = TempDir::new("batches");
    three_classes(&tmp.0);
    let size = 8;
    let transform = ImageTransform::imagenet_train(size).unwrap();
    let seed = 11;
    // Index lists as a distributed sampler hands them to two ranks: shuffled, uneven.
    let lists: [&[usize]; 3] = [&[7, 0, 11, 4, 4, 9, 2], &[1, 10, 5, 3, 8], &[6]];
    let mut first: Option<Vec<Vec<u8>>> = None;
    for workers in [0, 1, 3] {
        let config = ImageFolderConfig::new(transform)
            .with_seed(seed)
            .with_workers(workers);
        let ds = ImageFolder::new(&tmp.0, config).unwrap();
        assert_eq!(ds.classes(), ["cat", "dog", "owl"]);
        ds.set_epoch(2);
        let mut all = Vec::new();
        for indices in lists {
            let batch = ds.get_batch(indices).unwrap();
            assert_eq!(batch.inputs.dims(), &[indices.len(), 3, size, size]);
            assert_eq!(batch.inputs.dtype(), DType::U8);
            assert_eq!(batch.targets.dtype(), DType::I64);
            let targets: Vec<i64> = indices
                .iter()
                .map(|&i| [0, 4, 9].iter().filter(|&&s| i >= s).count() as i64 - 1)
                .collect();
            assert_eq!(batch.targets.to_vec::<i64>().unwrap(), targets);
            let pixels = batch.inputs.to_vec::<u8>().unwrap();
            for (slot, &index) in pixels.chunks(3 * size * size).zip(indices) {
                assert_eq!(slot, expected_sample(&ds, index, seed, 2), "sample {index}");
            }
            all.push(pixels);
        }
        match &first {
            None => first = Some(all),
            Some(first) => assert_eq!(first, &all, "{workers} workers"),
        }
    }
}

#[test]
fn random_transforms_repeat_per_epoch_and_differ_across_epochs() {
    let tmp = TempDir::new("epochs");
    three_classes(&tmp.0);
    let config = ImageFolderConfig::new(ImageTransform::imagenet_train(8).unwrap()).with_seed(3);
    let ds = ImageFolder::new(&tmp.0, config).unwrap();
    let indices: Vec<usize> = (0..ds.len()).collect();
    let images = |epoch| {
        ds.set_epoch(epoch);
        ds.get_batch(&indices)
            .unwrap()
            .inputs
            .to_vec::<u8>()
            .unwrap()
    };
    let epoch0 = images(0);
    assert_eq!(images(1), images(1));
    assert_eq!(images(0), epoch0);
    assert_ne!(images(1), epoch0);
}

/// Two class folders with good images and the bad files of the issue: a text file named
/// `.jpg`, an empty `.png`, a PNG whose header claims 100000×100000 pixels (a decompression
/// bomb), a JPEG and a PNG cut short. Returns the bad samples' indices and file names.
fn with_bad_files(dir: &Path) -> [(usize, &'static str); 5] {
    write_images(dir, &["a/good1.png", "a/good2.png", "b/good3.png"]);
    write(dir, "a/text.jpg", b"this is not a JPEG");
    write(dir, "a/zero.png", b"");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/images");
    let bomb = std::fs::read(fixtures.join("bomb_100000x100000.png")).unwrap();
    write(dir, "b/bomb.png", &bomb);
    let jpeg = std::fs::read(fixtures.join("photo0_q90.jpg")).unwrap();
    write(dir, "b/cut.jpg", &jpeg[..jpeg.len() / 2]);
    let png = png_bytes(30, 30, 1);
    write(dir, "b/truncated.png", &png[..png.len() / 2]);
    // Samples: a/good1, a/good2, a/text.jpg, a/zero.png, b/bomb.png, b/cut.jpg, b/good3,
    // b/truncated.png.
    [
        (2, "text.jpg"),
        (3, "zero.png"),
        (4, "bomb.png"),
        (5, "cut.jpg"),
        (7, "truncated.png"),
    ]
}

#[test]
fn a_bad_file_is_an_error_naming_the_file_and_the_sample() {
    let tmp = TempDir::new("bad");
    let bad = with_bad_files(&tmp.0);
    let ds = ImageFolder::new(&tmp.0, eval_config().with_workers(2)).unwrap();
    for (index, name) in bad {
        let err = ds.get_batch(&[0, index, 1]).unwrap_err().to_string();
        assert!(
            err.contains(name) && err.contains(&format!("sample {index}")),
            "{err}"
        );
    }
    assert_eq!(ds.skipped(), 0);
}

#[test]
fn bad_files_can_be_skipped_and_counted_once() {
    let tmp = TempDir::new("skip");
    let bad = with_bad_files(&tmp.0);
    let config = eval_config().with_workers(2).with_skip_bad_files(true);
    let ds = ImageFolder::new(&tmp.0, config).unwrap();
    let indices = [7, 0, 2, 6, 3, 1, 4, 5];
    for _ in 0..2 {
        let batch = ds.get_batch(&indices).unwrap();
        assert_eq!(batch.inputs.dims(), &[3, 3, 8, 8]);
        assert_eq!(batch.targets.to_vec::<i64>().unwrap(), vec![0, 1, 0]);
        let pixels = batch.inputs.to_vec::<u8>().unwrap();
        for (slot, index) in pixels.chunks(3 * 8 * 8).zip([0, 6, 1]) {
            assert_eq!(slot, expected_sample(&ds, index, 0, 0), "sample {index}");
        }
        assert_eq!(ds.skipped(), 5);
    }
    let bad: Vec<usize> = bad.iter().map(|&(index, _)| index).collect();
    let err = ds.get_batch(&bad).unwrap_err().to_string();
    assert!(err.contains("no sample is left"), "{err}");
    // Asking for no sample is not a batch left empty by bad files.
    assert_eq!(ds.get_batch(&[]).unwrap().inputs.dims(), &[0, 3, 8, 8]);
    let err = ds.get_batch(&[8]).unwrap_err().to_string();
    assert!(
        err.contains("index 8") && err.contains("8 samples"),
        "{err}"
    );
}

#[test]
fn a_data_loader_over_real_jpegs_yields_the_samples_its_sampler_chose() {
    use std::sync::Arc;
    use tandem_nn::data::{DataLoader, DataLoaderConfig};
    let tmp = TempDir::new("loader");
    let photos = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/images");
    for (i, name) in [
        "photo0_q90",
        "photo1_q90",
        "photo2_q90",
        "photo3_q90",
        "photo4_q90",
    ]
    .iter()
    .enumerate()
    {
        let class = ["indoor", "outdoor"][i % 2];
        let to = tmp.0.join(class).join(format!("{name}.jpg"));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(photos.join(format!("{name}.jpg")), to).unwrap();
    }
    let config = ImageFolderConfig::new(ImageTransform::imagenet_train(32).unwrap())
        .with_seed(5)
        .with_workers(2);
    let ds = Arc::new(ImageFolder::new(&tmp.0, config).unwrap());
    let loader_config = DataLoaderConfig {
        batch_size: 2,
        shuffle: true,
        seed: 9,
        ..Default::default()
    };
    let loader = DataLoader::new(ds.clone(), loader_config).unwrap();
    for epoch in [0, 1] {
        ds.set_epoch(epoch);
        let order = loader.sampler().indices(epoch);
        let mut batches = loader.epoch(epoch);
        for indices in order.chunks(2) {
            let batch = batches.next().unwrap().unwrap();
            let want_targets: Vec<i64> = indices
                .iter()
                .map(|&i| ds.sample(i).unwrap().1 as i64)
                .collect();
            assert_eq!(batch.targets.to_vec::<i64>().unwrap(), want_targets);
            let pixels = batch.inputs.to_vec::<u8>().unwrap();
            for (slot, &index) in pixels.chunks(3 * 32 * 32).zip(indices) {
                assert_eq!(
                    slot,
                    expected_sample(&ds, index, 5, epoch),
                    "epoch {epoch}, sample {index}"
                );
            }
        }
        assert!(batches.next().is_none());
    }
}
