use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use flate2::write::GzEncoder;
use flate2::Compression;

use super::*;

/// A fresh directory under the system temp dir, unique to this process and call.
fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tandem-nn-mnist-{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = magic.to_be_bytes().to_vec();
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Three 2×2 images with pixels 0, 1, …, 11 and labels 7, 0, 9.
fn tiny_files() -> (Vec<u8>, Vec<u8>) {
    let pixels: Vec<u8> = (0..12).collect();
    (
        idx(IMAGES_MAGIC, &[3, 2, 2], &pixels),
        idx(LABELS_MAGIC, &[3], &[7, 0, 9]),
    )
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn raw_and_gzipped_files_parse_to_the_same_samples() {
    let (images, labels) = tiny_files();
    let raw_dir = temp_dir("raw");
    write(&raw_dir, "t10k-images-idx3-ubyte", &images);
    write(&raw_dir, "t10k-labels-idx1-ubyte", &labels);
    let gz_dir = temp_dir("gz");
    write(&gz_dir, "t10k-images-idx3-ubyte.gz", &gzip(&images));
    write(&gz_dir, "t10k-labels-idx1-ubyte.gz", &gzip(&labels));

    let plain = |d: MnistDataset| d.with_normalization(0.0, 1.0).unwrap();
    let raw = plain(Mnist::load(&raw_dir, Split::Test).unwrap());
    let gz = plain(Mnist::load(&gz_dir, Split::Test).unwrap());
    for ds in [&raw, &gz] {
        assert_eq!(ds.len(), 3);
        assert_eq!(ds.image_size(), (2, 2));
        let b = ds.get_batch(&[2, 0]).unwrap();
        assert_eq!(b.inputs.dims(), &[2, 1, 2, 2]);
        let want: Vec<f32> = [8u8, 9, 10, 11, 0, 1, 2, 3]
            .iter()
            .map(|&p| p as f32 / 255.0)
            .collect();
        let got = b.inputs.to_vec::<f32>().unwrap();
        assert!(
            got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-6),
            "{got:?}"
        );
        assert_eq!(b.targets.to_vec::<i64>().unwrap(), vec![9, 7]);
    }
    std::fs::remove_dir_all(raw_dir).ok();
    std::fs::remove_dir_all(gz_dir).ok();
}

#[test]
fn default_normalisation_uses_mnist_mean_and_std() {
    let dir = temp_dir("norm");
    let images = write(&dir, "img", &idx(IMAGES_MAGIC, &[1, 1, 2], &[0, 255]));
    let labels = write(&dir, "lbl", &idx(LABELS_MAGIC, &[1], &[3]));
    let ds = MnistDataset::from_files(&images, &labels).unwrap();
    let got = ds.get_batch(&[0]).unwrap().inputs.to_vec::<f32>().unwrap();
    let want = [-0.1307f64 / 0.3081, (1.0 - 0.1307) / 0.3081];
    for (g, w) in got.iter().zip(want) {
        assert!((*g as f64 - w).abs() < 1e-5, "{got:?}");
    }
    assert!(ds.with_normalization(0.0, 0.0).is_err());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn wrong_magic_number_names_the_file() {
    let dir = temp_dir("magic");
    let (images, _) = tiny_files();
    // A labels file where an images file is expected.
    let images_path = write(&dir, "img", &idx(LABELS_MAGIC, &[3], &[1, 2, 3]));
    let labels_path = write(&dir, "lbl", &images);
    let err = MnistDataset::from_files(&images_path, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("img") && err.contains("magic") && err.contains("0x00000801"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn truncated_files_are_reported_raw_and_gzipped() {
    let dir = temp_dir("trunc");
    let (images, labels) = tiny_files();
    let labels_path = write(&dir, "lbl", &labels);
    let short = write(&dir, "short-img", &images[..images.len() - 5]);
    let err = MnistDataset::from_files(&short, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("short-img") && err.contains("truncated") && err.contains("only 7"),
        "{err}"
    );

    let gz = gzip(&images);
    let cut = write(&dir, "cut-img.gz", &gz[..gz.len() / 2]);
    let err = MnistDataset::from_files(&cut, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cut-img.gz") && err.contains("gzip"), "{err}");

    let header_only = write(&dir, "hdr-img", &images[..6]);
    let err = MnistDataset::from_files(&header_only, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hdr-img") && err.contains("truncated header"),
        "{err}"
    );

    let mut long = images.clone();
    long.push(0);
    let long = write(&dir, "long-img", &long);
    let err = MnistDataset::from_files(&long, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("long-img") && err.contains("1 unexpected bytes"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn image_and_label_counts_must_match() {
    let dir = temp_dir("count");
    let (images, _) = tiny_files();
    let images_path = write(&dir, "img", &images);
    let labels_path = write(&dir, "lbl", &idx(LABELS_MAGIC, &[2], &[1, 2]));
    let err = MnistDataset::from_files(&images_path, &labels_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lbl") && err.contains("2 labels") && err.contains("3 images"),
        "{err}"
    );
    let bad_label = write(&dir, "lbl10", &idx(LABELS_MAGIC, &[3], &[1, 10, 2]));
    let err = MnistDataset::from_files(&images_path, &bad_label)
        .unwrap_err()
        .to_string();
    assert!(err.contains("label 10 at index 1"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn missing_files_name_both_candidates() {
    let dir = temp_dir("missing");
    let err = Mnist::load(&dir, Split::Train).unwrap_err().to_string();
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("train-images-idx3-ubyte.gz"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_missing_directory_is_reported_as_itself_with_the_files_it_should_hold() {
    let dir = temp_dir("gone").join("no-such-mnist");
    let err = Mnist::load(&dir, Split::Test).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "{}: the MNIST directory does not exist",
            dir.display()
        )),
        "{msg}"
    );
    assert!(
        msg.contains("t10k-images-idx3-ubyte") && msg.contains("t10k-labels-idx1-ubyte"),
        "{msg}"
    );
    assert!(
        matches!(&err, Error::Io { path, source } if path == &dir && source.kind() == std::io::ErrorKind::NotFound),
        "{msg}"
    );
    // A file where the directory should be.
    let file = write(dir.parent().unwrap(), "a-file", b"");
    let msg = Mnist::load(&file, Split::Train).unwrap_err().to_string();
    assert!(
        msg.contains("is not a directory") && msg.contains("train-labels-idx1-ubyte"),
        "{msg}"
    );
    std::fs::remove_dir_all(dir.parent().unwrap()).ok();
}

#[test]
fn shipped_test_set_has_ten_thousand_images_of_every_digit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/mnist");
    let ds = Mnist::load(&dir, Split::Test).unwrap();
    assert_eq!(ds.len(), 10_000);
    assert_eq!(ds.image_size(), (28, 28));
    let mut histogram = [0usize; 10];
    for &l in ds.labels() {
        histogram[l as usize] += 1;
    }
    // MNIST's test set has between 892 (fives) and 1135 (ones) of each digit.
    assert!(
        histogram.iter().all(|&n| (850..1200).contains(&n)),
        "{histogram:?}"
    );
    let batch = ds.get_batch(&[0, 1]).unwrap();
    assert_eq!(batch.inputs.dims(), &[2, 1, 28, 28]);
    // Normalised pixels: background at −mean/std, ink up to (1 − mean)/std.
    let v = batch.inputs.to_vec::<f32>().unwrap();
    let lo = v.iter().cloned().fold(f32::MAX, f32::min);
    let hi = v.iter().cloned().fold(f32::MIN, f32::max);
    assert!((lo + 0.4242).abs() < 1e-3 && hi > 2.0, "{lo} {hi}");
}
