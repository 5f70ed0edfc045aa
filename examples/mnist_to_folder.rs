//! Writes the shipped MNIST as an ImageFolder of JPEGs, the layout of ImageNet and of
//! torchvision's `ImageFolder`: `OUT/train/<digit>/<index>.jpg` (60 000 images) and
//! `OUT/val/<digit>/<index>.jpg` (10 000), each an RGB JPEG (the gray digit in all three
//! channels, 28×28, quality 90, 4:2:0 chroma subsampling as PIL saves by default), so the
//! `imagenet` example and anything that reads ImageFolders can train on real data the
//! repository ships.
//!
//! ```text
//! cargo run --release --example mnist_to_folder -- --out mnist-jpeg
//! cargo run --release --example mnist_to_folder -- --out tiny --limit 200   # first 200 per split
//! cargo run --release --example imagenet -- --data-dir mnist-jpeg --model resnet20 --image-size 32
//! ```
//!
//! The MNIST folder is found as the other examples find it (`--data-dir`, else
//! `$TANDEM_DATA_DIR/mnist`, else `data/mnist` in the current folder, the executable's folder
//! or a folder above either). `<index>` is the image's position in its IDX file, zero-padded to
//! five digits so the sorted file names keep the file's order. Images are encoded on all cores
//! (a few seconds for all 70 000). Existing files of the same names are overwritten.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use jpeg_encoder::{ColorType, Encoder};
use rayon::prelude::*;
use tandem::nn::data::idx::{read_idx_u8, IMAGES_MAGIC, LABELS_MAGIC};

/// Write MNIST as an ImageFolder of RGB JPEGs (OUT/train/<digit>/, OUT/val/<digit>/).
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// The folder to write (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// The MNIST folder [default: $TANDEM_DATA_DIR/mnist, else data/mnist in the current
    /// folder or one above it, else above the executable's folder].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Write only the first this many images of each split (for tests and quick runs).
    #[arg(long)]
    limit: Option<usize>,
    /// JPEG quality, 1–100.
    #[arg(long, default_value_t = 90)]
    quality: u8,
}

/// Errors of the tool.
pub type ToolError = Box<dyn std::error::Error + Send + Sync>;

#[allow(dead_code)] // A test includes this file for `write_mnist_folder` alone.
fn main() -> ExitCode {
    let args = Args::parse();
    let started = Instant::now();
    let written = tandem::locate::mnist_dir(args.data_dir.as_deref())
        .map_err(ToolError::from)
        .and_then(|dir| write_mnist_folder(&dir, &args.out, args.limit, args.quality));
    match written {
        Ok((train, val)) => {
            println!(
                "wrote {train} training and {val} validation images to {} in {:.1} s",
                args.out.display(),
                started.elapsed().as_secs_f64()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes MNIST from `mnist_dir` as `out/train/<digit>/<index>.jpg` and
/// `out/val/<digit>/<index>.jpg` (the first `limit` images of each split, all without one) at
/// JPEG `quality`; gives the numbers of training and validation images written.
pub fn write_mnist_folder(
    mnist_dir: &Path,
    out: &Path,
    limit: Option<usize>,
    quality: u8,
) -> Result<(usize, usize), ToolError> {
    if !(1..=100).contains(&quality) {
        return Err(format!("--quality must be in 1..=100, got {quality}").into());
    }
    let train = write_split(mnist_dir, "train", &out.join("train"), limit, quality)?;
    let val = write_split(mnist_dir, "t10k", &out.join("val"), limit, quality)?;
    Ok((train, val))
}

/// Writes the split whose IDX files start with `prefix` into `out/<digit>/`.
fn write_split(
    mnist_dir: &Path,
    prefix: &str,
    out: &Path,
    limit: Option<usize>,
    quality: u8,
) -> Result<usize, ToolError> {
    let images = read_idx_u8(
        &idx_file(mnist_dir, &format!("{prefix}-images-idx3-ubyte"))?,
        IMAGES_MAGIC,
    )?;
    let labels = read_idx_u8(
        &idx_file(mnist_dir, &format!("{prefix}-labels-idx1-ubyte"))?,
        LABELS_MAGIC,
    )?;
    let (rows, cols) = (images.dims[1], images.dims[2]);
    let count = images.dims[0].min(labels.dims[0]);
    let count = limit.map_or(count, |l| l.min(count));
    let (width, height) = match (u16::try_from(cols), u16::try_from(rows)) {
        (Ok(w), Ok(h)) if w > 0 && h > 0 => (w, h),
        _ => return Err(format!("MNIST {prefix}: images of {rows}×{cols} pixels").into()),
    };
    for digit in 0..10 {
        let folder = out.join(digit.to_string());
        std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
    }
    let pixels = rows * cols;
    (0..count).into_par_iter().try_for_each(|i| {
        let label = labels.data[i];
        if label > 9 {
            return Err(ToolError::from(format!(
                "MNIST {prefix}: label {label} of image {i} is not a digit"
            )));
        }
        let gray = &images.data[i * pixels..(i + 1) * pixels];
        let rgb: Vec<u8> = gray.iter().flat_map(|&g| [g, g, g]).collect();
        let mut jpeg = Vec::with_capacity(1024);
        Encoder::new(&mut jpeg, quality).encode(&rgb, width, height, ColorType::Rgb)?;
        let path = out.join(label.to_string()).join(format!("{i:05}.jpg"));
        std::fs::write(&path, &jpeg).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(())
    })?;
    Ok(count)
}

/// `dir/name`, or `dir/name.gz` where only that exists (the shipped files are gzipped).
fn idx_file(dir: &Path, name: &str) -> Result<PathBuf, ToolError> {
    let raw = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    match (raw.is_file(), gz.is_file()) {
        (true, _) => Ok(raw),
        (false, true) => Ok(gz),
        _ => Err(format!("neither {} nor {} exists", raw.display(), gz.display()).into()),
    }
}
