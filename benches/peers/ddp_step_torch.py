"""PyTorch peer of `benches/ddp_step.rs`: times a DistributedDataParallel training step.

Run as one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (the
benchmark starts them). One step is zero_grad, forward through DDP, cross entropy, backward
(with DDP's bucketed all-reduce) and an SGD-with-momentum update, on a fixed random batch per
rank. Rank 0 prints one JSON object on the last line of stdout:
{"median_ms", "mean_ms", "min_ms", "steps", "world_size", "torch_version", "threads", "backend"}.

On the CPU the backend is gloo. With `--device cuda` every rank trains on `cuda:LOCAL_RANK`
(or on `cuda:0` when `--share-gpu` puts all ranks on one GPU; the benchmark then gives each rank
its own NCCL_HOSTID so NCCL treats them as separate hosts) with the NCCL backend, and each timed
step ends with `torch.cuda.synchronize()`. `--amp bf16|f16` runs the forward and the loss under
`torch.autocast` (f16 with `torch.amp.GradScaler`) and `--channels-last` puts the model and the
batch in `torch.channels_last`, as tandem's side does with the same flags.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python3 benches/peers/ddp_step_torch.py --model convnet --batch-size 32 --threads 1
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from models import CifarResNet, convnet, lenet5, resnet50


MODELS = {
    # name: (constructor, input shape without the batch dim, classes)
    "lenet": (lenet5, (1, 28, 28), 10),
    "convnet": (convnet, (3, 32, 32), 10),
    "resnet20": (lambda: CifarResNet(20, 10), (3, 32, 32), 10),
    "resnet50": (resnet50, (3, 224, 224), 1000),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--share-gpu", action="store_true", help="every rank on cuda:0")
    parser.add_argument("--amp", choices=["bf16", "f16"], default=None)
    parser.add_argument("--channels-last", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if cuda:
        local = 0 if args.share_gpu else int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    build, shape, classes = MODELS[args.model]
    model = build().to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if cuda else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    # Each rank its own fixed batch.
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.batch_size, *shape, generator=generator).to(device)
    y = torch.randint(0, classes, (args.batch_size,), generator=generator).to(device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    amp_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, None: None}[args.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "f16")

    def step():
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    dist.barrier()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    dist.barrier()
    if rank == 0:
        print(
            json.dumps(
                {
                    "median_ms": statistics.median(times),
                    "mean_ms": statistics.fmean(times),
                    "min_ms": min(times),
                    "steps": args.steps,
                    "world_size": world,
                    "torch_version": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "backend": backend,
                    "amp": args.amp,
                    "channels_last": args.channels_last,
                }
            )
        )
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
