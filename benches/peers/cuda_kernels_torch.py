"""PyTorch peer of `benches/cuda_kernels.rs`: times the same GPU kernels on the same GPU.

Measures an f32 matrix product of `--size`³ with TF32 off and on (`torch.matmul` through
cuBLAS) and a bandwidth-bound in-place `y += alpha·x` over `--elements` f32 values, each as the
median over `--iters` timed calls (after `--warmup`), timed with CUDA events around each call.
Prints one JSON object on the last line of stdout:
{"matmul_ms", "matmul_tf32_ms", "axpy_ms", "torch_version", "device"}.

    python3 benches/peers/cuda_kernels_torch.py --size 4096 --elements 67108864
"""

import argparse
import json
import statistics

import torch


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda", args.device)
    torch.manual_seed(0)
    n = args.size
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    results = {}
    for key, tf32 in (("matmul_ms", False), ("matmul_tf32_ms", True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        results[key] = timed(lambda: torch.matmul(a, b), args.warmup, args.iters)
    torch.backends.cuda.matmul.allow_tf32 = False
    del a, b

    x = torch.randn(args.elements, device=device)
    y = torch.randn(args.elements, device=device)
    results["axpy_ms"] = timed(lambda: y.add_(x, alpha=0.5), args.warmup, args.iters)
    results["torch_version"] = torch.__version__
    results["device"] = torch.cuda.get_device_name(device)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
