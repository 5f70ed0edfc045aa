#!/usr/bin/env bash
# tandem's GPU bundle runner (copied into the bundle as run.sh by scripts/gpu-bundle.sh).
#
# Run from the repository root on a machine with a CUDA GPU:
#   gpu-bundle/run.sh            the GPU conformance suite, then a summary
#   gpu-bundle/run.sh env        only print where the CUDA libraries were found
#   gpu-bundle/run.sh TEST ARGS  one test binary with test-harness arguments (a filter, say)
#
# CUDA libraries: an existing TANDEM_CUDA_LIBS is kept; otherwise the runner collects
# $CUDA_HOME/lib64 and the nvidia/*/lib folders of python3's site-packages (NVIDIA's pip packages:
# cu13, cudnn, nccl, ...). The driver (libcuda.so.1) comes from the system loader path.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)

if [ -z "${TANDEM_CUDA_LIBS:-}" ]; then
  dirs=()
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    [ -n "$home" ] && for d in "$home/lib64" "$home/lib"; do [ -d "$d" ] && dirs+=("$d"); done
  done
  if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r site; do
      for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && dirs+=("$d"); done
    done < <(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  fi
  TANDEM_CUDA_LIBS=$(IFS=:; echo "${dirs[*]:-}")
  export TANDEM_CUDA_LIBS
fi
echo "TANDEM_CUDA_LIBS=$TANDEM_CUDA_LIBS"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

[ "${1:-}" = env ] && exit 0

run_one() { # target, args...
  local target=$1; shift
  local dir
  dir=$(awk -v t="$target" '$1 == t { print $2 }' "$here/tests/MANIFEST")
  (cd "$root/${dir:-.}" && "$here/tests/$target" "$@")
}

if [ $# -gt 0 ]; then
  run_one "$@"
  exit $?
fi

passed=0 failed=0 skipped=0 status=0
summary=()
while read -r target _; do
  log=$(mktemp)
  run_one "$target" --test-threads=1 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  p=$(grep -Eo '[0-9]+ passed' "$log" | awk '{s+=$1} END {print s+0}')
  f=$(grep -Eo '[0-9]+ failed' "$log" | awk '{s+=$1} END {print s+0}')
  s=$(grep -c 'skipped: no CUDA device' "$log")
  passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
  [ "$rc" -ne 0 ] && status=1
  summary+=("$(printf '%-16s rc=%-3s passed=%-4s failed=%-4s skipped(no GPU)=%s' "$target" "$rc" "$p" "$f" "$s")")
  rm -f "$log"
done <"$here/tests/MANIFEST"

echo
echo "== tandem GPU conformance summary"
printf '%s\n' "${summary[@]}"
echo "gpu: $passed passed, $failed failed"
exit $status
