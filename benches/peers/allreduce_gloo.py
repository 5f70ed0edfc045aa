"""torch.distributed (gloo) side of `cargo bench --bench allreduce`.

Launched by the bench (through tandem's launcher with --no-store) as N processes with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, the variables torchrun sets. Every rank runs the
same f32 all_reduce sizes with the same warm-up and repetition protocol as the tandem side: per
size, untimed warm-up repetitions, then timed ones, each preceded by a one-element broadcast
from rank 0 saying whether to go on. Rank 0 writes one JSON object per size to --out (or
stdout): {"bytes": B, "median_us": T, "times_us": [...]}.

Usage (normally done by the bench):
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
        python3 allreduce_gloo.py --sizes 4096,16384 --iters 20 --warmup 3
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions per size")
    parser.add_argument("--max-seconds", type=float, default=2.0,
                        help="stop repeating a size after this much time (at least 3 repetitions)")
    parser.add_argument("--out", help="file for rank 0's results (default: stdout)")
    args = parser.parse_args()

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    out = open(args.out, "w") if (rank == 0 and args.out) else sys.stdout
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        times = []
        started = time.perf_counter()
        for i in range(args.iters):
            # Every rank must run the same number of repetitions: rank 0 decides and tells.
            go = torch.tensor([1 if (i < 3 or time.perf_counter() - started < args.max_seconds) else 0])
            dist.broadcast(go, 0)
            if go.item() == 0:
                break
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append((time.perf_counter() - t0) * 1e6)
        if rank == 0:
            print(json.dumps({"bytes": nbytes, "median_us": statistics.median(times),
                              "times_us": times}), file=out, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
