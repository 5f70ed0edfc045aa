//! Decoding real photographs against PIL's pixels, and refusing bad files.
//!
//! The fixtures in `tests/data/images/` and their goldens (`NAME.WxH.rgb.gz`: PIL 13's decoded
//! RGB, libjpeg-turbo 3.2 for JPEG, after `ImageOps.exif_transpose`) were made by
//! `tests/fixtures/make_image_fixtures.py` from the ImageNet photographs in PyPI's foolbox
//! wheel. PNGs must match exactly. JPEGs may differ by what separates two correct decoders
//! (IDCT rounding, chroma upsampling): see `JPEG_MEAN_BOUND` and `JPEG_MAX_BOUND`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tandem_nn::data::image::{decode_image, image_size, read_image, DecodeLimits, RgbImage};

/// The system allocator, recording the largest single allocation, so the bomb tests can check
/// that no pixel buffer was sized from a hostile header (the other tests of this binary
/// allocate at most a few hundred KB at once).
struct LargestAllocation;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is added.
unsafe impl GlobalAlloc for LargestAllocation {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds `alloc`'s contract, which `System.alloc` shares.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: `ptr` and `layout` come from this allocator, which is `System`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: LargestAllocation = LargestAllocation;

/// Mean absolute difference per channel value allowed between zune-jpeg and libjpeg-turbo, per
/// image. Measured (Pillow 13.0, libjpeg-turbo 3.2, zune-jpeg 0.5.15): at most 0.363 on these
/// fixtures and 0.377 on the 20 foolbox photographs at 500×375 (BENCHMARKS.md, "Choosing the
/// image decoders"). Grayscale and 4:4:4 files differ by ≤ 0.014: the difference is chroma
/// upsampling (both decoders use the "fancy" triangle filter, rounded differently), plus IDCT
/// rounding.
const JPEG_MEAN_BOUND: f64 = 0.5;
/// Largest single difference allowed: measured at most 4 here and 7 on the 500×375 set, at
/// sharp colour edges where the upsampled chroma differs most.
const JPEG_MAX_BOUND: u8 = 8;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/images")
}

/// Every fixture that has a golden: (fixture path, golden path, width, height).
fn fixtures() -> Vec<(PathBuf, PathBuf, usize, usize)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir()).unwrap() {
        let golden = entry.unwrap().path();
        let name = golden.file_name().unwrap().to_str().unwrap().to_string();
        let Some(stem) = name.strip_suffix(".rgb.gz") else {
            continue;
        };
        let (base, size) = stem.rsplit_once('.').unwrap();
        let (w, h) = size.split_once('x').unwrap();
        let file = ["jpg", "png"]
            .iter()
            .map(|ext| dir().join(format!("{base}.{ext}")))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("no fixture for golden {name}"));
        out.push((file, golden, w.parse().unwrap(), h.parse().unwrap()));
    }
    out.sort();
    out
}

fn golden_pixels(path: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// (mean, max) absolute difference of two equally long pixel buffers.
fn diff(a: &[u8], b: &[u8]) -> (f64, u8) {
    let total: u64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| u64::from(x.abs_diff(*y)))
        .sum();
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0);
    (total as f64 / a.len() as f64, max)
}

#[test]
fn photographs_decode_as_pil_decodes_them() {
    let limits = DecodeLimits::default();
    let cases = fixtures();
    assert!(cases.len() >= 30, "fixtures missing: {}", cases.len());
    let mut report = Vec::new();
    for (file, golden, w, h) in &cases {
        let image: RgbImage = read_image(file, &limits).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        assert_eq!((image.width(), image.height()), (*w, *h), "{name}");
        let bytes = std::fs::read(file).unwrap();
        assert_eq!(image_size(&bytes, file).unwrap(), (*w, *h), "{name}");
        let expected = golden_pixels(golden);
        let (mean, max) = diff(image.pixels(), &expected);
        report.push(format!("{name:32} {w:4}x{h:<4} mean {mean:.3} max {max}"));
        if name.ends_with(".png") {
            assert!(
                image.pixels() == &expected[..],
                "{name}: differs from PIL (mean {mean}, max {max})"
            );
        } else {
            assert!(
                mean <= JPEG_MEAN_BOUND && max <= JPEG_MAX_BOUND,
                "{name}: mean |diff| {mean:.3} (bound {JPEG_MEAN_BOUND}), max {max} (bound {JPEG_MAX_BOUND})"
            );
        }
    }
    // Shown with --nocapture: the measured differences the bounds are set from.
    println!("{}", report.join("\n"));
}

fn error_of(result: tandem_nn::Result<RgbImage>) -> String {
    result.expect_err("a bad file must be refused").to_string()
}

#[test]
fn truncated_files_are_refused_naming_the_file() {
    let limits = DecodeLimits::default();
    for name in [
        "photo0_q90.jpg",
        "photo1_progressive.jpg",
        "png_rgb8.png",
        "png_rgb8_interlaced.png",
    ] {
        let bytes = std::fs::read(dir().join(name)).unwrap();
        // Half the file; the first 40 bytes (headers only); and, for a PNG, into the last
        // image-data chunk (its IEND chunk is 12 bytes), for a JPEG, without its end marker.
        let tail = if name.ends_with(".png") { 13 } else { 2 };
        for keep in [bytes.len() / 2, 40, bytes.len() - tail] {
            let path = Path::new("/data/train/cat/cut.jpg");
            let err = error_of(decode_image(&bytes[..keep], path, &limits));
            assert!(
                err.starts_with("/data/train/cat/cut.jpg: ")
                    && (err.contains("truncated") || err.contains("corrupt")),
                "{name} cut to {keep} bytes: {err}"
            );
        }
    }
}

#[test]
fn image_size_reads_only_the_headers() {
    // Half of each file is enough: the pixels are neither decoded nor needed.
    for (name, size) in [
        ("photo0_q90.jpg", (160, 160)),
        ("exif6.jpg", (64, 96)),
        ("png_rgb8.png", (67, 45)),
        ("png_exif6.png", (45, 67)),
    ] {
        let bytes = std::fs::read(dir().join(name)).unwrap();
        let half = &bytes[..bytes.len() / 2];
        assert_eq!(image_size(half, Path::new(name)).unwrap(), size, "{name}");
    }
}

#[test]
fn a_text_file_and_an_empty_file_are_not_images() {
    let limits = DecodeLimits::default();
    let text = dir().join("not_an_image.jpg");
    let err = error_of(read_image(&text, &limits));
    assert!(
        err.contains("not_an_image.jpg") && err.contains("not a JPEG or PNG"),
        "{err}"
    );
    let err = error_of(decode_image(b"", Path::new("empty.png"), &limits));
    assert!(err.contains("empty.png") && err.contains("empty"), "{err}");
    let zero = std::env::temp_dir().join(format!("tandem-zero-{}.jpg", std::process::id()));
    std::fs::write(&zero, b"").unwrap();
    let err = error_of(read_image(&zero, &limits));
    std::fs::remove_file(&zero).unwrap();
    assert!(
        err.contains(&*zero.to_string_lossy()) && err.contains("is empty (0 bytes)"),
        "{err}"
    );
    let err = image_size(b"GIF89a", Path::new("a.gif"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("a.gif") && err.contains("47 49 46"), "{err}");
}

#[test]
fn decompression_bombs_are_refused_from_the_header() {
    let limits = DecodeLimits::default();
    let png = dir().join("bomb_100000x100000.png");
    let err = error_of(read_image(&png, &limits));
    assert!(
        err.contains("bomb_100000x100000.png")
            && err.contains("PNG is 100000×100000 = 10000000000 pixels")
            && err.contains("DecodeLimits::max_pixels"),
        "{err}"
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(image_size(&bytes, &png).unwrap(), (100000, 100000));
    let jpeg = dir().join("bomb_65500x65500.jpg");
    let err = error_of(read_image(&jpeg, &limits));
    assert!(
        err.contains("bomb_65500x65500.jpg")
            && err.contains("JPEG is 65500×65500 = 4290250000 pixels"),
        "{err}"
    );
    // Neither header made anything large be allocated (the PNG's pixels would be 30 GB, the
    // JPEG's 12.9 GB).
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < 64 << 20, "an allocation of {largest} bytes");
    // A lower limit refuses an ordinary photograph the same way.
    let small = DecodeLimits {
        max_pixels: 160 * 159,
        ..limits
    };
    let err = error_of(read_image(&dir().join("photo0_q90.jpg"), &small));
    assert!(
        err.contains("160×160 = 25600 pixels, above the limit of 25440"),
        "{err}"
    );
}

#[test]
fn files_above_the_byte_limit_are_refused_before_decoding() {
    let limits = DecodeLimits {
        max_file_bytes: 1000,
        ..DecodeLimits::default()
    };
    let path = dir().join("photo0_q90.jpg");
    let err = error_of(read_image(&path, &limits));
    assert!(
        err.contains("photo0_q90.jpg") && err.contains("above the limit of 1000 bytes"),
        "{err}"
    );
    let bytes = std::fs::read(&path).unwrap();
    let err = error_of(decode_image(&bytes, &path, &limits));
    assert!(err.contains("DecodeLimits::max_file_bytes"), "{err}");
    let err = error_of(read_image(Path::new("/no/such/file.jpg"), &limits));
    assert!(err.contains("/no/such/file.jpg"), "{err}");
}

#[test]
fn the_format_comes_from_the_content_not_the_extension() {
    let bytes = std::fs::read(dir().join("png_rgb8.png")).unwrap();
    let image = decode_image(
        &bytes,
        Path::new("really_a_png.jpg"),
        &DecodeLimits::default(),
    )
    .unwrap();
    assert_eq!((image.width(), image.height()), (67, 45));
}

#[test]
fn garbage_after_a_valid_header_is_an_error_never_a_panic() {
    let limits = DecodeLimits::default();
    for name in [
        "photo0_q90.jpg",
        "photo1_progressive.jpg",
        "photo5_cmyk.jpg",
        "png_palette_trns.png",
    ] {
        let bytes = std::fs::read(dir().join(name)).unwrap();
        // Deterministic corruption: flip bytes at a stride through the file.
        for stride in [7usize, 31, 101, 997] {
            let mut bad = bytes.clone();
            for i in (stride..bad.len()).step_by(stride) {
                bad[i] ^= 0x5A;
            }
            // Either outcome is fine; what matters is no panic and, on error, the file named.
            if let Err(e) = decode_image(&bad, Path::new("bad.jpg"), &limits) {
                assert!(e.to_string().contains("bad.jpg"), "{e}");
            }
        }
    }
}

/// Not run by CI (`--ignored`): many random corruptions of every fixture, looking for a panic
/// or an error that does not name the file. Run once for the decoder choice; see the report in
/// BENCHMARKS.md.
#[test]
#[ignore]
fn random_corruptions_never_panic() {
    let limits = DecodeLimits::default();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut ok, mut refused) = (0, 0);
    for (file, ..) in fixtures() {
        let bytes = std::fs::read(&file).unwrap();
        for _ in 0..2000 {
            let mut bad = bytes.clone();
            for _ in 0..1 + next() % 8 {
                let i = (next() % bad.len() as u64) as usize;
                bad[i] = next() as u8;
            }
            if next() % 4 == 0 {
                bad.truncate((next() % bad.len() as u64) as usize);
            }
            match decode_image(&bad, Path::new("fuzz.bin"), &limits) {
                Ok(_) => ok += 1,
                Err(e) => {
                    assert!(e.to_string().starts_with("fuzz.bin: "), "{e}");
                    refused += 1;
                }
            }
            let _ = image_size(&bad, Path::new("fuzz.bin"));
        }
    }
    println!("{ok} decoded, {refused} refused");
}
