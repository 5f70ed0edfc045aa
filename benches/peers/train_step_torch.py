"""PyTorch peer of `benches/train_step.rs`: times the same training step on the same model.

One step is forward, cross entropy, zero_grad, backward and an SGD-with-momentum update, on a
fixed random batch. Prints one JSON object on the last line of stdout:
{"median_ms", "mean_ms", "min_ms", "steps", "peak_rss_mib", "torch_version", "threads"}.

    python3 benches/peers/train_step_torch.py --model lenet --batch-size 64 --threads 2
"""

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from models import CifarResNet, lenet5


MODELS = {
    # name: (constructor, input shape without the batch dim, classes)
    "lenet": (lenet5, (1, 28, 28), 10),
    "resnet20": (lambda: CifarResNet(20, 10), (3, 32, 32), 10),
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
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    build, shape, classes = MODELS[args.model]
    model = build()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    x = torch.randn(args.batch_size, *shape)
    y = torch.randint(0, classes, (args.batch_size,))

    def step():
        out = model(x)
        loss = F.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps(
            {
                "median_ms": statistics.median(times),
                "mean_ms": statistics.fmean(times),
                "min_ms": min(times),
                "steps": args.steps,
                "peak_rss_mib": peak_kib / 1024.0,
                "torch_version": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
