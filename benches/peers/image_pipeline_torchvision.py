"""The torchvision side of `cargo bench --bench image_pipeline`, and the maker of its folder.

    python3 image_pipeline_torchvision.py make-folder --out DIR [--count 500] [--cache DIR]
    python3 image_pipeline_torchvision.py time --root DIR --workers 2 [--batch-size 64] [--runs 5]

`make-folder` builds the benchmark's ImageFolder from the 20 ImageNet photographs (512x512
JPEGs) in PyPI's `foolbox` wheel (fetched once with `pip download --no-deps foolbox==3.3.4`
into `--cache`): image i is photograph i % 20, cropped with PIL to a random 4:3 window
(landscape, every fourth image portrait) covering 75-100% of the largest such window, resized with
Lanczos to 500x375 (or 375x500), mirrored at random, and saved as a JPEG of quality 90 (PIL's
default 4:2:0 subsampling) into `DIR/class<i % 4>/`. It writes `DIR.complete` (beside the folder,
not in it) last, so a folder that was interrupted is rebuilt.

`time` runs torchvision's `ImageFolder` + `DataLoader` (batch 64, shuffled, `--workers`
worker processes, persistent) with `RandomResizedCrop(224)`, `RandomHorizontalFlip()` and
`PILToTensor()` (uint8 CHW, what tandem's loader yields), one untimed epoch to start the
workers and fill the page cache, then `--runs` timed epochs; prints one JSON object: the
median images/s, and the peak memory of the main process and its workers together, sampled
every 50 ms (PSS, which counts pages the forked workers share with the main process once,
and RSS, which counts them in every process). With `--to-tensor` it also times `ToTensor()`
(float32 in [0, 1]) the same way.
"""

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import zipfile

FOOLBOX = "foolbox==3.3.4"
PHOTO_PREFIX = "foolbox/data/imagenet_"


def photographs(cache):
    """The 20 ImageNet photographs of the foolbox wheel, as PIL images (downloads the wheel once)."""
    from PIL import Image

    os.makedirs(cache, exist_ok=True)
    wheels = [f for f in os.listdir(cache) if f.startswith("foolbox-") and f.endswith(".whl")]
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", FOOLBOX, "-d", cache],
            check=True,
        )
        wheels = [f for f in os.listdir(cache) if f.startswith("foolbox-") and f.endswith(".whl")]
    with zipfile.ZipFile(os.path.join(cache, sorted(wheels)[-1])) as wheel:
        names = sorted(n for n in wheel.namelist() if n.startswith(PHOTO_PREFIX))
        images = [Image.open(io.BytesIO(wheel.read(n))).convert("RGB") for n in names]
    if len(images) != 20:
        raise SystemExit(f"expected 20 ImageNet photographs in the foolbox wheel, found {len(images)}")
    return images


def make_folder(args):
    from PIL import Image

    photos = photographs(args.cache)
    rng = random.Random(0)
    for c in range(4):
        os.makedirs(os.path.join(args.out, f"class{c}"), exist_ok=True)
    for i in range(args.count):
        photo = photos[i % len(photos)]
        w, h = photo.size
        size = (375, 500) if i % 4 == 3 else (500, 375)
        # The largest window of the output's aspect that fits, scaled by 75-100%.
        aspect = size[0] / size[1]
        fit_w, fit_h = (h * aspect, h) if w / h > aspect else (w, w / aspect)
        frac = rng.uniform(0.75, 1.0)
        cw, ch = int(fit_w * frac), int(fit_h * frac)
        left = rng.randint(0, w - cw)
        top = rng.randint(0, h - ch)
        image = photo.crop((left, top, left + cw, top + ch)).resize(size, Image.LANCZOS)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        image.save(os.path.join(args.out, f"class{i % 4}", f"{i:04d}.jpg"), quality=90)
    with open(args.out.rstrip("/") + ".complete", "w") as f:
        f.write(f"{args.count} images from {FOOLBOX}\n")


def kib_field(path, field):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_tree(pid):
    """`pid` and its descendants (via /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


class MemorySampler:
    """Peak PSS and RSS (MiB) of this process and its workers, sampled every 50 ms."""

    def __init__(self):
        self.peak_pss = 0.0
        self.peak_rss = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(0.05):
            pids = process_tree(os.getpid())
            pss = sum(kib_field(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
            rss = sum(kib_field(f"/proc/{p}/status", "VmRSS:") for p in pids)
            self.peak_pss = max(self.peak_pss, pss / 1024)
            self.peak_rss = max(self.peak_rss, rss / 1024)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return self.peak_pss, self.peak_rss


def time_loader(args, to_tensor):
    import torch
    from torchvision import datasets, transforms

    torch.manual_seed(args.seed)
    last = transforms.ToTensor() if to_tensor else transforms.PILToTensor()
    transform = transforms.Compose(
        [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), last]
    )
    folder = datasets.ImageFolder(args.root, transform=transform)
    loader = torch.utils.data.DataLoader(
        folder,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    rates = []
    for run in range(args.runs + 1):
        started = time.perf_counter()
        images = 0
        for inputs, targets in loader:
            images += targets.numel()
        if run > 0:  # The first epoch starts the workers and warms the page cache.
            rates.append(images / (time.perf_counter() - started))
    return rates


def time_command(args):
    import torch
    import torchvision

    torch.set_num_threads(1)
    sampler = MemorySampler()
    rates = time_loader(args, to_tensor=False)
    peak_pss, peak_rss = sampler.finish()
    result = {
        "workers": args.workers,
        "images_per_s": statistics.median(rates),
        "runs": rates,
        "peak_pss_mib": peak_pss,
        "peak_rss_sum_mib": peak_rss,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
    }
    if args.to_tensor:
        result["to_tensor_f32_images_per_s"] = statistics.median(time_loader(args, to_tensor=True))
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-folder")
    make.add_argument("--out", required=True)
    make.add_argument("--count", type=int, default=500)
    make.add_argument("--cache", required=True)
    timing = sub.add_parser("time")
    timing.add_argument("--root", required=True)
    timing.add_argument("--workers", type=int, default=1)
    timing.add_argument("--batch-size", type=int, default=64)
    timing.add_argument("--runs", type=int, default=5)
    timing.add_argument("--seed", type=int, default=0)
    timing.add_argument("--to-tensor", action="store_true")
    args = parser.parse_args()
    if args.command == "make-folder":
        make_folder(args)
    else:
        time_command(args)


if __name__ == "__main__":
    main()
