//! Tests of the transforms against PIL and torchvision. References:
//! nn/tests/fixtures/image_transforms.py wrote nn/tests/data/transforms/ with Pillow 13.0.0 and
//! torchvision 0.29.2 from a 128×96 piece of foolbox 3.3.4's `imagenet_00_243.jpg`, and
//! printed the crop-box statistics held below.

use super::*;

const PHOTO: &[u8] = include_bytes!("../../../../tests/data/transforms/photo_128x96.rgb");

fn photo() -> RgbImage {
    RgbImage::new(128, 96, PHOTO.to_vec()).unwrap()
}

/// The `w × h` piece of `image` at (`left`, `top`), as PIL's `crop` makes it.
fn sub_image(image: &RgbImage, left: usize, top: usize, w: usize, h: usize) -> RgbImage {
    let mut px = Vec::with_capacity(w * h * 3);
    for y in top..top + h {
        let row = (y * image.width() + left) * 3;
        px.extend_from_slice(&image.pixels()[row..row + w * 3]);
    }
    RgbImage::new(w, h, px).unwrap()
}

fn hwc(chw: &[u8], h: usize, w: usize) -> Vec<u8> {
    chw_to_hwc(chw, h, w)
}

/// PIL's bytes, the box (x0, y0, x1, y1), the output (width, height).
type BoxCase = (&'static [u8], [f64; 4], (usize, usize));
/// The source, `resize`, `crop` (height, width), torchvision's bytes.
type EvalCase<'a> = (&'a RgbImage, usize, (usize, usize), &'static [u8]);

/// Largest per-channel difference from PIL's bytes.
fn max_diff(ours: &[u8], pil: &[u8]) -> u8 {
    assert_eq!(ours.len(), pil.len());
    ours.iter()
        .zip(pil)
        .map(|(a, b)| a.abs_diff(*b))
        .max()
        .unwrap()
}

#[test]
fn box_resize_matches_pil_bilinear_with_box() {
    let cases: [BoxCase; 5] = [
        (
            include_bytes!("../../../../tests/data/transforms/box_down.rgb"),
            [0.0, 0.0, 128.0, 96.0],
            (40, 30),
        ),
        (
            include_bytes!("../../../../tests/data/transforms/box_down_frac.rgb"),
            [10.3, 7.75, 100.5, 80.2],
            (33, 29),
        ),
        (
            include_bytes!("../../../../tests/data/transforms/box_up.rgb"),
            [50.0, 30.0, 70.0, 45.0],
            (56, 42),
        ),
        (
            include_bytes!("../../../../tests/data/transforms/box_mixed_frac.rgb"),
            [5.5, 2.25, 125.0, 40.5],
            (30, 50),
        ),
        (
            include_bytes!("../../../../tests/data/transforms/box_vfirst.rgb"),
            [4.25, 10.5, 120.75, 90.0],
            (100, 12),
        ),
    ];
    let image = photo();
    for (pil, [x0, y0, x1, y1], (w, h)) in cases {
        let crop = CropBox {
            left: x0,
            top: y0,
            width: x1 - x0,
            height: y1 - y0,
        };
        let mut out = vec![0; 3 * w * h];
        resize_box_into(&image, crop, h, w, false, &mut out).unwrap();
        // Same weights, same fixed point, same pass order: PIL's bytes exactly.
        assert_eq!(max_diff(&hwc(&out, h, w), pil), 0, "{crop:?} → {w}×{h}");
    }
}

#[test]
fn crop_then_resize_matches_torchvision_resized_crop_and_flip() {
    let down: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_down.rgb");
    let down_flip: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_down_flip.rgb");
    let up: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_up.rgb");
    let up_flip: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_up_flip.rgb");
    let tall: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_vfirst.rgb");
    let tall_flip: &[u8] = include_bytes!("../../../../tests/data/transforms/crop_vfirst_flip.rgb");
    let image = photo();
    // (top, left, height, width) as get_params returns them, output (height, width).
    let cases = [
        ((5, 17, 70, 90), (32, 32), down, down_flip),
        ((40, 60, 20, 15), (24, 32), up, up_flip),
        ((0, 30, 96, 40), (24, 32), tall, tall_flip),
    ];
    for ((top, left, h, w), (out_h, out_w), pil, pil_flip) in cases {
        for (flip, expected) in [(false, pil), (true, pil_flip)] {
            let mut out = vec![0; 3 * out_h * out_w];
            let rows = Axis::cropped(top, h, out_h);
            let columns = Axis::cropped(left, w, out_w);
            resample(&image, &rows, &columns, flip, &mut out);
            assert_eq!(max_diff(&hwc(&out, out_h, out_w), expected), 0);
        }
        // PIL's crop stops the filter at the crop's edge; a box resize reads past it, so
        // the two differ at the border (which is why Train does not use the box form).
        let crop = CropBox {
            left: left as f64,
            top: top as f64,
            width: w as f64,
            height: h as f64,
        };
        let mut boxed = vec![0; 3 * out_h * out_w];
        resize_box_into(&image, crop, out_h, out_w, false, &mut boxed).unwrap();
        assert!(max_diff(&hwc(&boxed, out_h, out_w), pil) > 1);
    }
}

#[test]
fn eval_matches_torchvision_resize_then_center_crop() {
    let image = photo();
    let portrait = sub_image(&image, 10, 0, 60, 96);
    let cases: [EvalCase; 4] = [
        (
            &image,
            48,
            (40, 40),
            include_bytes!("../../../../tests/data/transforms/eval_48_40.rgb"),
        ),
        (
            &image,
            40,
            (36, 50),
            include_bytes!("../../../../tests/data/transforms/eval_40_36x50.rgb"),
        ),
        (
            &image,
            20,
            (24, 30),
            include_bytes!("../../../../tests/data/transforms/eval_pad_20_24x30.rgb"),
        ),
        (
            &portrait,
            50,
            (48, 48),
            include_bytes!("../../../../tests/data/transforms/eval_portrait_50_48.rgb"),
        ),
    ];
    for (src, resize, crop, pil) in cases {
        let transform = ImageTransform::Eval { resize, crop };
        let out = transform.apply(src, 0).unwrap();
        assert_eq!((out.height(), out.width()), crop);
        assert_eq!(
            max_diff(out.pixels(), pil),
            0,
            "Resize({resize}) + {crop:?}"
        );
    }
}

#[test]
fn eval_as_one_fractional_box_is_within_one_of_resize_then_crop() {
    // The source box of Resize + CenterCrop, as the fixture script computes it: PIL gives
    // resize-then-crop's bytes up to ±1 (the box's rounded coordinates move a filter
    // centre by an ulp); the script printed max |diff| 0, 1 and 1 for these.
    let image = photo();
    let portrait = sub_image(&image, 10, 0, 60, 96);
    let cases: [EvalCase; 3] = [
        (
            &image,
            48,
            (40, 40),
            include_bytes!("../../../../tests/data/transforms/eval_48_40.rgb"),
        ),
        (
            &image,
            40,
            (36, 50),
            include_bytes!("../../../../tests/data/transforms/eval_40_36x50.rgb"),
        ),
        (
            &portrait,
            50,
            (48, 48),
            include_bytes!("../../../../tests/data/transforms/eval_portrait_50_48.rgb"),
        ),
    ];
    for (src, resize, (ch, cw), pil) in cases {
        let (nh, nw) = resized_size(src.width(), src.height(), resize);
        let sx = src.width() as f64 / nw as f64;
        let sy = src.height() as f64 / nh as f64;
        let top = ((nh - ch) as f64 / 2.0).round_ties_even();
        let left = ((nw - cw) as f64 / 2.0).round_ties_even();
        let crop = CropBox {
            left: left * sx,
            top: top * sy,
            width: (left + cw as f64) * sx - left * sx,
            height: (top + ch as f64) * sy - top * sy,
        };
        let mut out = vec![0; 3 * ch * cw];
        resize_box_into(src, crop, ch, cw, false, &mut out).unwrap();
        assert!(max_diff(&hwc(&out, ch, cw), pil) <= 1, "{crop:?}");
    }
}

#[test]
fn eval_pads_a_crop_larger_than_the_resized_image_with_zeros() {
    // 4×2 resized to shorter side 2 stays 4×2; CenterCrop (4, 6) pads 1 column each side
    // and 1 row above, 1 below (torchvision: left/top get (c − n) // 2).
    let image = RgbImage::new(4, 2, (1..=24).collect()).unwrap();
    let out = ImageTransform::Eval {
        resize: 2,
        crop: (4, 6),
    }
    .apply(&image, 0)
    .unwrap();
    for y in 0..4 {
        for x in 0..6 {
            let inside = (1..3).contains(&y) && (1..5).contains(&x);
            let expected = if inside {
                image.pixel(x - 1, y - 1)
            } else {
                [0; 3]
            };
            assert_eq!(out.pixel(x, y), expected, "({x}, {y})");
        }
    }
}

#[test]
fn imagenet_recipes_have_torchvision_sizes() {
    assert_eq!(
        ImageTransform::imagenet_eval(224).unwrap(),
        ImageTransform::Eval {
            resize: 256,
            crop: (224, 224)
        }
    );
    assert_eq!(
        ImageTransform::imagenet_train(224).unwrap().output_size(),
        (224, 224)
    );
    // torchvision: int(256 * 500 / 375) = 341; portrait the other way round.
    assert_eq!(resized_size(500, 375, 256), (256, 341));
    assert_eq!(resized_size(375, 500, 256), (341, 256));
    assert_eq!(resized_size(7, 3, 4), (4, 9));
    assert!(ImageTransform::imagenet_eval(0).is_err());
    assert!(ImageTransform::imagenet_train(0).is_err());
}

/// Statistics of `n` boxes: area-fraction mean and quantiles, log-ratio mean and
/// quantiles, mean centre x, and how often the box is the fallback box.
fn box_stats(width: usize, height: usize, n: usize) -> ([f64; 6], [f64; 6], f64, f64) {
    let crop = RandomResizedCrop::new((224, 224)).unwrap();
    let fallback = crop.fallback_rect(width, height);
    let mut rng = Generator::new(5);
    let (mut areas, mut logs) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut centre, mut fallbacks) = (0.0, 0);
    for _ in 0..n {
        let b = crop.sample_box(width, height, &mut rng);
        areas.push(b.width * b.height / (width * height) as f64);
        logs.push((b.width / b.height).ln());
        centre += (b.left + b.width / 2.0) / width as f64;
        fallbacks += usize::from(crop.sample_rect_is(b, fallback));
    }
    let summary = |v: &mut Vec<f64>| {
        let mean = v.iter().sum::<f64>() / n as f64;
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[(p * (n - 1) as f64) as usize];
        [mean, q(0.1), q(0.25), q(0.5), q(0.75), q(0.9)]
    };
    let area = summary(&mut areas);
    let log = summary(&mut logs);
    (area, log, centre / n as f64, fallbacks as f64 / n as f64)
}

impl RandomResizedCrop {
    fn sample_rect_is(&self, b: CropBox, r: PixelRect) -> bool {
        (b.left, b.top, b.width, b.height)
            == (r.left as f64, r.top as f64, r.width as f64, r.height as f64)
    }
}

#[test]
fn crop_boxes_have_torchvision_distribution() {
    // torchvision's get_params, 100 000 draws each (see the fixture script). With n this
    // large, one estimate's standard error is ≈ 0.002 (area, log ratio) and ≈ 0.0006
    // (fallback frequency), so 0.01 and 0.004 are ≈ 5 standard errors of a difference.
    type Reference = ([f64; 6], [f64; 6], f64, f64);
    let references: [((usize, usize), Reference); 2] = [
        (
            (500, 375),
            (
                [0.43381, 0.14771, 0.25088, 0.42224, 0.59442, 0.73786],
                [0.03096, -0.20963, -0.10495, 0.04686, 0.17398, 0.24353],
                0.49936,
                0.0,
            ),
        ),
        (
            (100, 300),
            (
                [0.22515, 0.1071, 0.148, 0.216, 0.288, 0.3584],
                [-0.04556, -0.25996, -0.19167, -0.06385, 0.08995, 0.20203],
                0.49999,
                0.03548,
            ),
        ),
    ];
    for ((w, h), (area_ref, log_ref, centre_ref, fallback_ref)) in references {
        let (area, log, centre, fallback) = box_stats(w, h, 100_000);
        for (k, (a, b)) in area.iter().zip(area_ref).enumerate() {
            assert!((a - b).abs() < 0.01, "{w}×{h} area stat {k}: {a} vs {b}");
        }
        for (k, (a, b)) in log.iter().zip(log_ref).enumerate() {
            assert!(
                (a - b).abs() < 0.01,
                "{w}×{h} log-ratio stat {k}: {a} vs {b}"
            );
        }
        assert!(
            (centre - centre_ref).abs() < 0.005,
            "{w}×{h} centre {centre}"
        );
        assert!(
            (fallback - fallback_ref).abs() < 0.004,
            "{w}×{h} fallback {fallback} vs {fallback_ref}"
        );
    }
}

#[test]
fn crop_boxes_are_whole_pixels_inside_the_image_within_the_ranges() {
    let crop = RandomResizedCrop::new((8, 8)).unwrap();
    let mut rng = Generator::new(1);
    for (w, h) in [(500, 375), (100, 300), (1, 1), (2, 9), (64, 64)] {
        for _ in 0..2000 {
            let b = crop.sample_box(w, h, &mut rng);
            assert!(b.width >= 1.0 && b.height >= 1.0);
            assert!(b.left + b.width <= w as f64 && b.top + b.height <= h as f64);
            assert!([b.left, b.top, b.width, b.height]
                .iter()
                .all(|v| v.fract() == 0.0));
            if crop.sample_rect_is(b, crop.fallback_rect(w, h)) || w * h < 100 {
                continue; // rounding dominates the ratio of tiny boxes
            }
            let area = b.width * b.height / (w * h) as f64;
            let ratio = b.width / b.height;
            // Sides are rounded, so allow half a pixel on each.
            let slack = 1.0 / b.width.min(b.height);
            assert!(
                (0.08 - 2.0 * slack..=1.0 + 2.0 * slack).contains(&area),
                "{b:?}"
            );
            assert!((0.75 * (1.0 - slack)..=4.0 / 3.0 * (1.0 + slack)).contains(&ratio));
        }
    }
}

#[test]
fn impossible_areas_fall_back_to_the_centre_box_clamped_to_the_ratio() {
    // A scale above 1 can never fit, so every draw is the fallback.
    let crop = RandomResizedCrop::new((4, 4))
        .unwrap()
        .with_scale((2.0, 3.0))
        .unwrap();
    let mut rng = Generator::new(3);
    let cases = [
        // (w, h) → (left, top, width, height): too wide, too tall, in range, a line.
        ((1000, 10), (493.0, 0.0, 13.0, 10.0)),
        ((100, 300), (0.0, 83.0, 100.0, 133.0)),
        ((40, 35), (0.0, 0.0, 40.0, 35.0)),
        ((1, 1000), (0.0, 499.0, 1.0, 1.0)),
        ((1000, 1), (499.0, 0.0, 1.0, 1.0)),
    ];
    for ((w, h), (left, top, width, height)) in cases {
        let expected = CropBox {
            left,
            top,
            width,
            height,
        };
        assert_eq!(crop.sample_box(w, h, &mut rng), expected, "{w}×{h}");
    }
}

#[test]
fn train_is_reproducible_per_seed_and_flips_half_the_time() {
    let image = photo();
    let transform = ImageTransform::imagenet_train(24).unwrap();
    let mut a = vec![0; 3 * 24 * 24];
    let mut b = vec![0; 3 * 24 * 24];
    transform.apply_into(&image, 42, &mut a).unwrap();
    transform.apply_into(&image, 42, &mut b).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        transform.apply(&image, 42).unwrap().pixels(),
        hwc(&a, 24, 24)
    );
    let distinct = (0..8u64)
        .map(|s| transform.apply(&image, s).unwrap().into_pixels())
        .collect::<std::collections::HashSet<_>>();
    assert_eq!(distinct.len(), 8);

    // The flip is one draw after the box: with the same box, half the seeds mirror it.
    let mut flips = 0;
    let no_flip = ImageTransform::Train {
        crop: RandomResizedCrop::new((24, 24)).unwrap(),
        flip: false,
    };
    for seed in 0..400 {
        transform.apply_into(&image, seed, &mut a).unwrap();
        no_flip.apply_into(&image, seed, &mut b).unwrap();
        let mirrored: Vec<u8> = b
            .chunks_exact(24)
            .flat_map(|row| row.iter().rev().copied())
            .collect();
        assert!(a == b || a == mirrored, "seed {seed}");
        flips += usize::from(a != b);
    }
    assert!((160..240).contains(&flips), "{flips} flips of 400");
}

#[test]
fn bad_sizes_ranges_boxes_and_buffers_are_errors() {
    assert!(RandomResizedCrop::new((0, 3)).is_err());
    let crop = RandomResizedCrop::new((3, 3)).unwrap();
    for range in [
        (0.0, 1.0),
        (0.5, 0.4),
        (f64::NAN, 1.0),
        (0.1, f64::INFINITY),
    ] {
        assert!(crop.with_scale(range).is_err(), "{range:?}");
        assert!(crop.with_ratio(range).is_err(), "{range:?}");
    }
    let image = RgbImage::new(4, 4, vec![7; 48]).unwrap();
    let mut out = vec![0; 3 * 2 * 2];
    let ok = CropBox {
        left: 0.5,
        top: 1.0,
        width: 3.5,
        height: 2.0,
    };
    resize_box_into(&image, ok, 2, 2, true, &mut out).unwrap();
    assert_eq!(out, vec![7; 12]);
    for bad in [
        CropBox { left: -0.5, ..ok },
        CropBox { width: 3.6, ..ok },
        CropBox { height: 0.0, ..ok },
        CropBox {
            top: f64::NAN,
            ..ok
        },
    ] {
        let err = resize_box_into(&image, bad, 2, 2, false, &mut out).unwrap_err();
        assert!(err.to_string().contains("4×4"), "{err}");
    }
    let err = resize_box_into(&image, ok, 2, 3, false, &mut out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3×2×3") && err.contains("18 bytes") && err.contains("12"));
    let train = ImageTransform::imagenet_train(2).unwrap();
    assert!(train.apply_into(&image, 0, &mut out[..11]).is_err());
    let eval = ImageTransform::Eval {
        resize: 0,
        crop: (2, 2),
    };
    assert!(eval.apply_into(&image, 0, &mut out).is_err());
    let huge = ImageTransform::Eval {
        resize: 4,
        crop: (usize::MAX / 2, 3),
    };
    let err = huge.apply(&image, 0).unwrap_err().to_string();
    assert!(err.contains("too large"), "{err}");
    assert!(ImageTransform::Eval {
        resize: 4,
        crop: (0, 3)
    }
    .apply(&image, 0)
    .is_err());
}

#[test]
fn full_windows_put_the_same_weight_on_every_source_pixel() {
    // The horizontal pass's fixed-length windows only move PIL's taps and add zeros.
    let mut rng = Generator::new(9);
    for _ in 0..500 {
        let extent = 1 + rng.below(60);
        let start = rng.uniform() * extent as f64 * 0.9;
        let len = (extent as f64 - start) * (0.05 + 0.95 * rng.uniform());
        let axis = Axis::boxed(extent, start, len, 1 + rng.below(80));
        let (pil, windows) = (taps(&axis, false), taps(&axis, true));
        for i in 0..axis.out_len {
            let mut weights = vec![0; extent];
            for (taps, sign) in [(&pil, 1), (&windows, -1)] {
                for t in 0..taps.count[i] {
                    weights[taps.first[i] + t] += sign * taps.weights[i * taps.stride + t];
                }
            }
            assert!(weights.iter().all(|&w| w == 0), "{i} of {:?}", axis.out_len);
        }
    }
}

#[test]
fn extreme_shapes_keep_a_uniform_image_uniform() {
    let colour = [200u8, 17, 99];
    for (w, h) in [(1, 1), (1, 7), (300, 2), (3, 3)] {
        let image = RgbImage::new(w, h, colour.repeat(w * h)).unwrap();
        let transforms = [
            ImageTransform::imagenet_train(16).unwrap(),
            ImageTransform::Train {
                crop: RandomResizedCrop::new((1, 5)).unwrap(),
                flip: true,
            },
            ImageTransform::Eval {
                resize: 2,
                crop: (2, 2),
            },
            // Only the kept pixels of the (huge) resized image are ever computed.
            ImageTransform::Eval {
                resize: 1 << 40,
                crop: (3, 4),
            },
        ];
        for transform in transforms {
            for seed in 0..20 {
                let out = transform.apply(&image, seed).unwrap();
                assert!(out.pixels().chunks(3).all(|p| p == colour), "{w}×{h}");
            }
        }
        let whole = CropBox {
            left: 0.0,
            top: 0.0,
            width: w as f64,
            height: h as f64,
        };
        for (oh, ow) in [(1, 1), (9, 4), (1, 40)] {
            let mut out = vec![0; 3 * oh * ow];
            resize_box_into(&image, whole, oh, ow, true, &mut out).unwrap();
            let plane = oh * ow;
            for (c, &v) in colour.iter().enumerate() {
                assert!(out[c * plane..(c + 1) * plane].iter().all(|&b| b == v));
            }
        }
    }
}

/// A 500×375 image (ImageNet's typical size) tiled from the photograph.
fn tiled_500x375() -> RgbImage {
    let image = photo();
    let mut px = Vec::with_capacity(500 * 375 * 3);
    for y in 0..375 {
        for x in 0..500 {
            px.extend_from_slice(&image.pixel(x % 128, y % 96));
        }
    }
    RgbImage::new(500, 375, px).unwrap()
}

/// Not a test: prints the median time of `RandomResizedCrop(224)` + flip on a 500×375
/// image (`cargo test -p tandem-nn --lib apply_into_timing -- --ignored --nocapture`).
/// Its Python peer is `nn/tests/fixtures/image_transforms.py PHOTO --timing`.
#[test]
#[ignore]
fn apply_into_timing() {
    let image = tiled_500x375();
    let transform = ImageTransform::imagenet_train(224).unwrap();
    let mut out = vec![0; 3 * 224 * 224];
    let mut times = Vec::new();
    for seed in 0..2000 {
        let start = std::time::Instant::now();
        transform.apply_into(&image, seed, &mut out).unwrap();
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let eval = ImageTransform::imagenet_eval(224).unwrap();
    let mut eval_times = Vec::new();
    for seed in 0..500 {
        let start = std::time::Instant::now();
        eval.apply_into(&image, seed, &mut out).unwrap();
        eval_times.push(start.elapsed().as_secs_f64());
    }
    eval_times.sort_by(f64::total_cmp);
    println!(
        "apply_into on 500×375: train median {:.1} µs, eval median {:.1} µs",
        times[times.len() / 2] * 1e6,
        eval_times[eval_times.len() / 2] * 1e6
    );
}
