#!/usr/bin/env bash
# tandem's GPU checks beyond the conformance suite (copied into the GPU bundle as checks.sh by
# scripts/gpu-bundle.sh). Run from the repository root on a machine with a CUDA GPU and
# PyTorch, after `gpu-bundle/run.sh env` has shown where the libraries are:
#
#   gpu-bundle/checks.sh train   cifar_resnet on mnist32 (1 epoch) and MNIST on 2 NCCL ranks
#                                (2 epochs, with a timeline), both on the GPU
#   gpu-bundle/checks.sh bench   train_step (LeNet-5, ResNet-20/56/50) and cuda_kernels against
#                                PyTorch, ddp_step on 2 NCCL ranks, a ResNet-50 recording for
#                                tandem-project and its projection
#
# Output goes to stdout and, with OUT set, files into $OUT (metrics, traces, recordings).
# With one GPU the 2-rank runs share it: each rank gets its own NCCL_HOSTID (NCCL then takes
# the ranks for separate hosts and connects them over loopback sockets) — a test arrangement.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin="$here/bin"
out=${OUT:-/tmp/tandem-gpu-checks}
mkdir -p "$out"
eval "$("$here/run.sh" env | sed -n 's/^TANDEM_CUDA_LIBS=\(.*\)$/export TANDEM_CUDA_LIBS="\1"/p')"
echo "TANDEM_CUDA_LIBS=$TANDEM_CUDA_LIBS"

# Starts `ranks` processes of PROGRAM ARGS… as one job on cuda:0 (per-rank NCCL_HOSTID).
two_ranks_one_gpu() {
  local ranks=$1; shift
  local port=$((29500 + RANDOM % 1000))
  local pids=()
  for ((r = 0; r < ranks; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$ranks LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port TANDEM_JOB_SECRET=tandem-gpu-checks-shared-secret \
      CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="tandem-check-rank-$r" NCCL_SOCKET_IFNAME=lo \
      NCCL_IB_DISABLE=1 "$@" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}

case "${1:-}" in
train)
  echo "== cifar_resnet --dataset mnist32 --epochs 1 --device cuda"
  "$bin/cifar_resnet" --dataset mnist32 --epochs 1 --device cuda --checkpoint-dir "$out/ckpt" \
    --metrics-out "$out/cifar_mnist32.json" 2>&1 | tail -5
  echo "== mnist, 2 NCCL ranks on one GPU, 2 epochs, timeline"
  two_ranks_one_gpu 2 "$bin/mnist" --device cuda --epochs 2 --metrics-out "$out/mnist_2ranks.json" \
    --trace-out "$out/mnist_2ranks_trace.json" 2>&1 | tail -8
  ;;
bench)
  for m in "lenet 256" "resnet20 128" "resnet56 128" "resnet50 64"; do
    set -- $m
    echo "== train_step --device cuda --model $1 --batch-size $2"
    "$bin/train_step" --device cuda --model "$1" --batch-size "$2" --steps 30 --warmup 10 \
      --json "$out/train_step_$1.json" 2>&1 | tail -6
  done
  echo "== train_step ResNet-20 host profile"
  "$bin/train_step" --device cuda --model resnet20 --batch-size 128 --no-peer --profile 10 2>&1 |
    tail -40
  echo "== cuda_kernels"
  "$bin/cuda_kernels" 2>&1 | tail -12
  echo "== ddp_step --device cuda --nproc 2 --model resnet20 --batch-size 128"
  "$bin/ddp_step" --device cuda --nproc 2 --model resnet20 --batch-size 128 --steps 30 \
    --json "$out/ddp_step_resnet20.json" 2>&1 | tail -14
  echo "== ddp_step --device cuda --nproc 1 --model resnet50 --batch-size 64 --record"
  "$bin/ddp_step" --device cuda --nproc 1 --model resnet50 --batch-size 64 --steps 20 --no-peer \
    --record "$out/resnet50_h100.json" 2>&1 | tail -6
  [ -f "$out/resnet50_h100.json" ] && "$bin/tandem-project" "$out/resnet50_h100.json" 2>&1 | tail -30
  ;;
*)
  echo "usage: $0 train|bench" >&2
  exit 2
  ;;
esac
