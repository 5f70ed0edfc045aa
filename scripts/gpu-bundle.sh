#!/usr/bin/env bash
# Builds tandem's GPU bundle: the GPU test binaries, the examples and the benchmarks in release
# mode, stripped, with a runner script, in one folder (default: gpu-bundle/ in the repository).
#
# A GPU host may have CUDA and Python but no Rust toolchain. Build the bundle here, copy the
# repository (the examples read data/ and the benchmarks benches/peers/) with the bundle inside it
# to the GPU host, at any path, and run `gpu-bundle/run.sh all` there: the runner finds the CUDA
# libraries, runs the GPU conformance suite, the training checks, a 2-rank timeline and the
# benchmarks within a time budget, and writes one report ($OUT/report.md when OUT is set); see
# README.md ("Development: CUDA without a GPU, and GPU checks without a Rust toolchain").
# Nothing in the bundle depends on the folder it was built in.
#
# Usage: scripts/gpu-bundle.sh [--tests-only] [OUT_DIR]
# The binaries (about 80 MiB, much of it the same code linked into each) are packed into
# OUT_DIR/bundle.tar.xz (about 7 MiB), beside run.sh, checks.sh and BUILD_INFO: small enough to
# travel with a working tree whose transfer is size-limited. run.sh unpacks it by itself on its
# first run (into OUT_DIR/bin and OUT_DIR/tests). TANDEM_BUNDLE_PACK=0 leaves them unpacked.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/test-binary.sh
. scripts/test-binary.sh
tests_only=0
if [ "${1:-}" = --tests-only ]; then
  tests_only=1
  shift
fi
out=${1:-gpu-bundle}
rm -rf "$out"
mkdir -p "$out/tests" "$out/bin"

# The test targets whose tests need a GPU: every integration test file named `cuda_*.rs` in a
# workspace package (each runs on the GPU there: run.sh sets TANDEM_TEST_CUDA=gpu). The NVRTC compile test
# stays in CI: it checks the kernels against the host harness's build, which is not bundled.
gpu_tests=()
while read -r pkg path; do
  for f in "$(dirname "$path")"/tests/cuda_*.rs; do
    [ -f "$f" ] && gpu_tests+=("$pkg $(basename "$f" .rs)")
  done
done < <(cargo metadata --format-version 1 --no-deps |
  python3 -c "import json,sys; [print(p['name'], p['manifest_path']) for p in json.load(sys.stdin)['packages']]")

manifest="$out/tests/MANIFEST"
: >"$manifest"
for entry in "${gpu_tests[@]}"; do
  read -r pkg target <<<"$entry"
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c "import json,sys; m=json.load(sys.stdin); print(next((p['manifest_path'] for p in m['packages'] if p['name']=='$pkg'), ''))")
  [ -n "$dir" ] || continue
  dir=$(dirname "$dir")
  [ -f "$dir/tests/$target.rs" ] || continue
  read -r exe _ < <(test_binary "$pkg" "$target" --release) || true
  [ -n "$exe" ] || { echo "gpu-bundle: $pkg/$target did not build" >&2; exit 1; }
  if [ -e "$out/tests/$target" ]; then
    echo "gpu-bundle: two packages have a GPU test named $target; rename one" >&2
    exit 1
  fi
  cp "$exe" "$out/tests/$target"
  strip "$out/tests/$target"
  # The runner runs each test binary in its package's folder, as cargo does.
  echo "$target $(python3 -c 'import os, sys; print(os.path.relpath(sys.argv[1]))' "$dir")" >>"$manifest"
done

if [ "$tests_only" = 0 ]; then
cargo build --release --examples --benches --message-format=json 2>/dev/null |
  python3 -c "
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get('reason') == 'compiler-artifact' and m.get('executable'):
        kind = m['target']['kind'][0]
        if kind in ('example', 'bench'):
            shutil.copy(m['executable'], '$out/bin/' + m['target']['name'])
"
cargo build --release -p tandem-dist --bin tandem-run --bin tandem-project
cp target/release/tandem-run target/release/tandem-project "$out/bin/"
strip "$out"/bin/*
fi

# What the report names as the bundle's origin.
{
  printf 'built %s from %s' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo 'an unknown commit')"
  git diff --quiet HEAD 2>/dev/null || printf ' (with uncommitted changes)'
  printf ', %s\n' "$(rustc --version 2>/dev/null || echo 'rustc ?')"
} >"$out/BUILD_INFO"
cp scripts/gpu-run.sh "$out/run.sh"
cp scripts/gpu-checks.sh "$out/checks.sh"
chmod +x "$out/run.sh" "$out/checks.sh"
ls -l "$out/tests" "$out/bin"
du -sh "$out"

# xz's large window finds the code the binaries share.
if [ "${TANDEM_BUNDLE_PACK:-1}" = 1 ]; then
  tar -cf - -C "$out" bin tests | xz -9 -T1 >"$out/bundle.tar.xz.partial"
  mv "$out/bundle.tar.xz.partial" "$out/bundle.tar.xz"
  rm -rf "$out/bin" "$out/tests"
  ls -l "$out"
  du -sh "$out"
fi
