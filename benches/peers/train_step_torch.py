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
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


def lenet5():
    """LeNet-5 with the same layers and parameter names as `tandem_nn::models::lenet5`."""
    return nn.Sequential(
        OrderedDict(
            features=nn.Sequential(
                nn.Conv2d(1, 6, 5, padding=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ),
            flatten=nn.Flatten(),
            classifier=nn.Sequential(
                nn.Linear(16 * 5 * 5, 120),
                nn.ReLU(),
                nn.Linear(120, 84),
                nn.ReLU(),
                nn.Linear(84, 10),
            ),
        )
    )


class BasicBlock(nn.Module):
    """ResNet basic block with an option-B (1x1 conv + bn) shortcut, as `tandem_nn::resnet`."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images with the same names as `tandem_nn::resnet`."""

    def __init__(self, depth=20, num_classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        cin = 16
        for i, (c, s) in enumerate([(16, 1), (32, 2), (64, 2)]):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(cin, c, s if j == 0 else 1))
                cin = c
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


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
