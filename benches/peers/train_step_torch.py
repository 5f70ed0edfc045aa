"""PyTorch peer of `benches/train_step.rs`: times the same training step on the same model.

One step is forward, cross entropy, zero_grad, backward and an SGD-with-momentum update, on a
fixed random batch, on the CPU or a CUDA device. On CUDA each timed step ends with
`torch.cuda.synchronize()`; the host time (issuing the step, before the synchronisation) is
reported beside it, and the peak device memory is `torch.cuda.max_memory_allocated()` over the
whole run (parameters, optimizer state and activations). TF32: matmuls off, convolutions on,
PyTorch's defaults and tandem's (`--tf32-matmul` turns matmuls on). `--amp bf16|f16` runs the
forward and the loss under `torch.autocast` with that dtype (f16 with `torch.amp.GradScaler`,
PyTorch's defaults), and `--channels-last` puts the model and the batch in
`torch.channels_last`, the settings tandem's side takes with the same flags. Prints one JSON object on
the last line of stdout: {"median_ms", "mean_ms", "min_ms", "host_ms", "steps",
"peak_rss_mib", "peak_device_mib", "torch_version", "threads", "device"}.

    python3 benches/peers/train_step_torch.py --model lenet --batch-size 64 --threads 2
    python3 benches/peers/train_step_torch.py --model resnet20 --batch-size 128 --device cuda
"""

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from models import CifarResNet, lenet5, resnet50


MODELS = {
    # name: (constructor, input shape without the batch dim, classes)
    "lenet": (lenet5, (1, 28, 28), 10),
    "resnet20": (lambda: CifarResNet(20, 10), (3, 32, 32), 10),
    "resnet56": (lambda: CifarResNet(56, 10), (3, 32, 32), 10),
    "resnet50": (resnet50, (3, 224, 224), 1000),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tf32-matmul", action="store_true")
    parser.add_argument("--amp", choices=["bf16", "f16"], default=None)
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32_matmul
        torch.backends.cudnn.allow_tf32 = True
    build, shape, classes = MODELS[args.model]
    model = build().to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    x = torch.randn(args.batch_size, *shape).to(device)
    y = torch.randint(0, classes, (args.batch_size,)).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    amp_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, None: None}[args.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "f16")

    def step():
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(x)
            loss = F.cross_entropy(out, y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    times, host = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        sync()
        end = time.perf_counter()
        times.append((end - start) * 1e3)
        host.append((issued - start) * 1e3)

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak_device = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    print(
        json.dumps(
            {
                "median_ms": statistics.median(times),
                "mean_ms": statistics.fmean(times),
                "min_ms": min(times),
                "host_ms": statistics.median(host),
                "steps": args.steps,
                "peak_rss_mib": peak_kib / 1024.0,
                "peak_device_mib": peak_device,
                "torch_version": torch.__version__,
                "threads": torch.get_num_threads(),
                "device": str(device),
                "amp": args.amp,
                "channels_last": args.channels_last,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
