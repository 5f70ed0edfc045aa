#!/usr/bin/env bash
# Runs GPU test files on the CUDA emulator (cuda-emu/: an emulated driver, NVRTC, cuBLAS and
# cuBLASLt that run tandem's unchanged CUDA code on the host; see README "Development").
#
# This is the first step of issue 20's "every GPU test runs in CI": the files listed below
# pass on the emulator and run in every CI run (.ci/run calls this after the README's test
# command). The others are not listed yet because they need an emulated cuDNN or NCCL (part 2),
# or are too slow on the emulator (GPU-sized inputs: core's cuda_runtime, whose gate tests now
# run, as kernels of different streams run at the same time). A listed test that prints
# "skipped: no CUDA device" fails here: on the emulator every GPU test must really run.
#
# The test binaries are the ones `cargo test --workspace` built (same profile and environment,
# so nothing is rebuilt); only TANDEM_CUDA_LIBS changes, at run time, with the emulator's folder
# first. On a machine with a GPU this still runs on the emulator; the real GPU run is the GPU
# bundle's (scripts/gpu-bundle.sh).
#
# Usage: scripts/emulated-gpu-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/test-binary.sh
. scripts/test-binary.sh

tests=(
  "tandem-ops cuda_elementwise"
  "tandem-ops cuda_reduce"
  "tandem-ops cuda_loss"
  "tandem-ops cuda_pool"
  "tandem-ops cuda_matmul"
  "tandem-ops cuda_batch_norm_count"
  "tandem-nn cuda_batch_norm_layer"
  "tandem cuda_grad_ready"
  "tandem cuda_checkpoint"
)

echo "emulated-gpu-tests: building the emulator"
cargo build -q -p tandem-cuda-emu -p tandem-cuda-emu-nvrtc -p tandem-cuda-emu-cublas \
  -p tandem-cuda-emu-cublaslt
libs=$(mktemp -d -t tandem-cuda-emu-libs.XXXXXX)
trap 'rm -rf "$libs"' EXIT
# Copies under the names tandem's library search opens (tandem resolves a loaded library to its
# real path and looks for NVRTC's builtins beside it, so no links to target/).
cp target/debug/libtandem_cuda_emu.so "$libs/libcuda.so"
cp target/debug/libtandem_cuda_emu_nvrtc.so "$libs/libnvrtc.so"
cp target/debug/libtandem_cuda_emu_cublas.so "$libs/libcublas.so"
cp target/debug/libtandem_cuda_emu_cublaslt.so "$libs/libcublasLt.so"
ln -s libnvrtc.so "$libs/libnvrtc-builtins.so.13.99"
# Only the test processes see it: cargo keeps its own environment, so nothing is rebuilt.
emulated_libs="$libs${TANDEM_CUDA_LIBS:+:$TANDEM_CUDA_LIBS}"
# tandem's kernel cache keys images by the NVRTC version, which does not change with the
# emulation's headers: a fresh folder, so no image compiled against an older tandem_host.h is
# loaded (the emulated NVRTC's own cache, keyed by the headers, keeps compiles cheap).
mkdir "$libs/kernel-cache"

failed=()
ran=0
for entry in "${tests[@]}"; do
  read -r pkg target <<<"$entry"
  # The binary and its package's folder (tests run in their package's folder, as under cargo).
  read -r exe dir < <(test_binary "$pkg" "$target") || true
  if [ -z "${exe:-}" ]; then
    echo "emulated-gpu-tests: $pkg/$target did not build" >&2
    failed+=("$pkg/$target (no binary)")
    continue
  fi
  echo "== $pkg/$target on the emulator"
  start=$SECONDS
  log=$(mktemp)
  if (cd "$dir" && TANDEM_CUDA_LIBS="$emulated_libs" TANDEM_KERNEL_CACHE="$libs/kernel-cache" "$exe") >"$log" 2>&1; then status=0; else status=$?; fi
  grep -E "^test result|^test .*FAILED" "$log" || true
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log"
    failed+=("$pkg/$target (exit $status)")
  elif grep -q "skipped: no CUDA device" "$log"; then
    grep -m 5 "skipped: no CUDA device" "$log"
    failed+=("$pkg/$target (skipped instead of running on the emulator)")
  fi
  echo "   ($((SECONDS - start)) s)"
  ran=$((ran + 1))
  rm -f "$log"
  unset exe dir
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "emulated-gpu-tests: ${#failed[@]} of ${#tests[@]} GPU test files failed on the emulator:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "emulated-gpu-tests: all $ran GPU test files passed on the emulator"
