#!/usr/bin/env bash
# tandem's GPU bundle runner (copied into the bundle as run.sh by scripts/gpu-bundle.sh). It runs
# from any folder, with the repository anywhere: the repository is the bundle's parent folder,
# and the programs find data/ and benches/peers/ at run time (see tandem::locate).
#
#   gpu-bundle/run.sh [OPTIONS] all    everything, in this order, in one report: the GPU
#                                      conformance suite; the training checks (MNIST on 1 rank,
#                                      MNIST on 2 NCCL ranks sharing the GPU, ResNet-20 on
#                                      MNIST-32); the timeline of a 2-rank run; the benchmarks
#                                      against PyTorch. The default command.
#   gpu-bundle/run.sh [OPTIONS] tests|train|timeline|bench   one part of it, with its report
#   gpu-bundle/run.sh env              only where the CUDA libraries were found
#   gpu-bundle/run.sh TEST [ARGS]      one test binary with test-harness arguments (a filter)
#
# Options (or their environment variables):
#   --report FILE      the report, Markdown (default: $OUT/report.md when OUT is set, else
#                      report.md in the bundle). Rewritten after every check, so a run cut
#                      short still leaves what it did and the check it was in.
#   --out DIR          traces and recordings (default: $OUT, else out/ in the bundle): only the
#                      2-rank timeline and the ResNet-50 recording; everything else, benchmark
#                      JSON included, is in the report.
#   --budget SECONDS   TANDEM_BUNDLE_BUDGET: the whole run's time (default 510, inside the 9
#                      minutes a GPU loan may last). Each check has a cap of its own, cut to
#                      what is left; once too little is left, the remaining checks are skipped
#                      and the report says so.
#   --device cpu|cuda  TANDEM_BUNDLE_DEVICE (default cuda). With cpu the training checks, the
#                      timeline and the CPU benchmarks run on the CPU, short (the first few
#                      thousand images), and the GPU tests skip (TANDEM_TEST_CUDA=skip):
#                      this checks the bundle itself (paths, reporting) on a machine without a
#                      GPU. With cuda a GPU test or benchmark that skips for want of a GPU fails.
#
# Exit status: 0 when every check passed; 1 when a check failed, timed out, or a benchmark's
# PyTorch comparison did not run (the benchmarks run with TANDEM_REQUIRE_PEER=1); 3 when none
# failed but some were skipped because the time budget ran out; 2 for a usage error.
#
# CUDA libraries: an existing TANDEM_CUDA_LIBS is kept; otherwise the runner collects
# $CUDA_HOME/lib64 and the nvidia/*/lib folders of python3's site-packages (NVIDIA's pip
# packages: cu13, cudnn, nccl, ...). The driver (libcuda.so.1) comes from the system loader path.
# Scratch files (logs, checkpoints, metrics) go to a fresh folder under TANDEM_SCRATCH_DIR (else
# TMPDIR, else /tmp), removed at the end.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
self="$here/$(basename "$0")"
root=$(cd "$here/.." && pwd)
bin="$here/bin"

# A packed bundle (scripts/gpu-bundle.sh) holds its binaries in bundle.tar.xz: unpack it once.
if [ -f "$here/bundle.tar.xz" ] && { [ ! -d "$here/bin" ] || [ ! -d "$here/tests" ] ||
  [ "$here/bundle.tar.xz" -nt "$here/tests/MANIFEST" ]; }; then
  echo "run.sh: unpacking $here/bundle.tar.xz" >&2
  rm -rf "$here/bin" "$here/tests"
  tar -xJf "$here/bundle.tar.xz" -C "$here" || {
    echo "run.sh: cannot unpack $here/bundle.tar.xz" >&2
    exit 1
  }
  touch "$here/tests/MANIFEST"
fi

# Internal commands: run.sh re-executes itself under `timeout` for checks that are more than
# one program.
case "${1:-}" in
__in) # DIR PROGRAM ARGS…: run PROGRAM in DIR.
  cd "$2" || exit 1
  shift 2
  exec "$@"
  ;;
__ranks) # N PROGRAM ARGS…: N ranks of PROGRAM as one job on cuda:0, each with its own
  # NCCL_HOSTID (NCCL then takes the ranks for separate hosts and connects them over loopback
  # sockets: a test arrangement for one GPU). The first rank to fail stops the others.
  ranks=$2
  shift 2
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
    echo $((29500 + RANDOM % 1000)))
  pids=()
  for ((r = 0; r < ranks; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$ranks LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port TANDEM_JOB_SECRET=tandem-gpu-bundle-shared-secret \
      CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="tandem-bundle-rank-$r" NCCL_SOCKET_IFNAME=lo \
      NCCL_IB_DISABLE=1 "$@" &
    pids+=($!)
  done
  rc=0
  for ((r = 0; r < ranks; r++)); do
    wait -n
    status=$?
    if [ "$status" -ne 0 ]; then
      echo "run.sh: a rank exited with status $status; stopping the others" >&2
      rc=$status
      kill "${pids[@]}" 2>/dev/null
      wait
      break
    fi
  done
  exit "$rc"
  ;;
esac

usage() {
  sed -n '2,/^set -u/p' "$self" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

report=""
out_dir=""
budget=${TANDEM_BUNDLE_BUDGET:-510}
device=${TANDEM_BUNDLE_DEVICE:-cuda}
while [ $# -gt 0 ]; do
  case "$1" in
  --report) report=${2:?--report needs a file}; shift 2 ;;
  --out) out_dir=${2:?--out needs a folder}; shift 2 ;;
  --budget) budget=${2:?--budget needs seconds}; shift 2 ;;
  --device) device=${2:?--device needs cpu or cuda}; shift 2 ;;
  -h | --help) usage ;;
  *) break ;;
  esac
done
what=${1:-all}
[ $# -gt 0 ] && shift
case "$device" in cpu | cuda) ;; *) echo "run.sh: --device must be cpu or cuda, not $device" >&2; exit 2 ;; esac
case "$budget" in '' | *[!0-9]*) echo "run.sh: --budget must be whole seconds, not $budget" >&2; exit 2 ;; esac
# Where the GPU tests run (tandem-test-support's select_cuda): on a cuda run the real GPU, so a
# machine whose driver does not work fails them instead of emulating one; on a cpu run they skip,
# saying so (the bundle carries no CUDA emulator).
if [ "$device" = cuda ]; then
  export TANDEM_TEST_CUDA=${TANDEM_TEST_CUDA:-gpu}
else
  export TANDEM_TEST_CUDA=${TANDEM_TEST_CUDA:-skip}
fi

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
fi
export TANDEM_CUDA_LIBS
gpu_line=$(command -v nvidia-smi >/dev/null 2>&1 &&
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)

if [ "$what" = env ]; then
  echo "TANDEM_CUDA_LIBS=$TANDEM_CUDA_LIBS"
  [ -n "$gpu_line" ] && echo "$gpu_line"
  exit 0
fi

# The folder a GPU test binary runs in (its package's, as under cargo), from the MANIFEST.
test_dir() {
  local dir
  dir=$(awk -v t="$1" '$1 == t { print $2 }' "$here/tests/MANIFEST")
  if [ -n "$dir" ] && [ -d "$root/$dir" ]; then echo "$root/$dir"; else echo "$root"; fi
}

case "$what" in
all | tests | train | timeline | bench) ;;
*)
  if [ -f "$here/tests/$what" ]; then
    dir=$(test_dir "$what")
    cd "$dir" && exec "$here/tests/$what" "$@"
  fi
  echo "run.sh: unknown command or test binary: $what" >&2
  usage
  ;;
esac

# ---------------------------------------------------------------------------------------------
# The report and the checks.

[ -n "$report" ] || report=${OUT:+$OUT/report.md}
[ -n "$report" ] || report="$here/report.md"
[ -n "$out_dir" ] || out_dir=${OUT:-$here/out}
mkdir -p "$out_dir" "$(dirname "$report")" || exit 1
report=$(cd "$(dirname "$report")" && pwd)/$(basename "$report")
out_dir=$(cd "$out_dir" && pwd)
scratch_base=${TANDEM_SCRATCH_DIR:-${TMPDIR:-/tmp}}
mkdir -p "$scratch_base" || exit 1
scratch=$(mktemp -d "$scratch_base/tandem-bundle.XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/logs"
# The test binaries' scratch space (tandem::locate::scratch_dir) goes in here too.
export TANDEM_SCRATCH_DIR="$scratch"
# A benchmark whose PyTorch comparison does not run fails.
export TANDEM_REQUIRE_PEER=1

started=$(date +%s)
started_text=$(date -u +%Y-%m-%dT%H:%M:%SZ)
deadline=$((started + budget))
min_step=10 # fewer seconds left than this: the remaining checks are skipped
index=0 passed=0 failed=0 skipped=0
current=""
rows="$scratch/rows.md"
details="$scratch/details.md"
: >"$rows"
: >"$details"
# Asked in the background (importing torch takes seconds); the report shows it once known.
timeout 60 python3 -c 'import torch; print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")' \
  >"$scratch/torch.txt" 2>/dev/null &
torch_probe=$!
torch_said="" # set once the probe has ended (or was stopped)
torch_version() {
  if [ -n "$torch_said" ]; then
    echo "$torch_said"
  elif kill -0 "$torch_probe" 2>/dev/null; then
    echo "not known yet"
  else
    wait "$torch_probe" 2>/dev/null
    torch_said=$(cat "$scratch/torch.txt" 2>/dev/null)
    [ -n "$torch_said" ] || torch_said="not importable by python3"
    echo "$torch_said"
  fi
}
build_info=$(cat "$here/BUILD_INFO" 2>/dev/null || echo "unknown (no BUILD_INFO)")

write_report() { # [final status line]
  local state=${1:-"running: $current"}
  {
    echo "# tandem GPU bundle report: $what"
    echo
    echo "- result: $state"
    echo "- checks: $passed passed, $failed failed, $skipped skipped (time budget)"
    echo "- started $started_text on $(hostname 2>/dev/null || echo '?'); $(($(date +%s) - started)) s of the ${budget} s budget used"
    echo "- device mode: $device; GPU: ${gpu_line:-none seen by nvidia-smi}"
    echo "- PyTorch: $(torch_version)"
    echo "- TANDEM_CUDA_LIBS: ${TANDEM_CUDA_LIBS:-(empty)}"
    echo "- bundle: $build_info; repository at $root"
    echo
    echo "| # | part | check | status | seconds | note |"
    echo "|---|---|---|---|---|---|"
    cat "$rows"
    echo
    cat "$details"
  } >"$report.partial" && mv "$report.partial" "$report"
}

# Prints the last N lines of FILE in a fenced block (with a note when lines were left out).
tail_block() { # N FILE
  local n=$1 file=$2 total
  total=$(wc -l <"$file")
  [ "$total" -gt "$n" ] && echo "(last $n of $total lines)"
  echo '```text'
  tail -n "$n" "$file"
  echo '```'
}

# Runs one check: `step PART NAME CAP "CHECK ARGS…" COMMAND…`. COMMAND runs in the repository
# root with at most CAP seconds (less when the budget has less left), its output in a log;
# then, if it exited 0, CHECK ARGS… LOG decides (printing a note; non-zero fails the check).
step() {
  local part=$1 name=$2 cap=$3 check=$4
  shift 4
  index=$((index + 1))
  local now left limit log rc t0 secs status note="" chk_rc tail_lines=12
  now=$(date +%s)
  left=$((deadline - now))
  if [ "$left" -lt "$min_step" ]; then
    skipped=$((skipped + 1))
    echo "| $index | $part | $name | SKIPPED | 0 | not run: the ${budget} s budget was spent |" >>"$rows"
    echo "== [$part] $name: SKIPPED (the ${budget} s budget was spent)"
    write_report
    return
  fi
  limit=$((cap < left ? cap : left))
  log="$scratch/logs/$index-$name.log"
  current="[$part] $name (started $((now - started)) s in, up to $limit s)"
  write_report
  echo "== [$part] $name (up to $limit s)"
  t0=$(date +%s%N)
  (cd "$root" && timeout --kill-after=15 "$limit" "$@") >"$log" 2>&1 </dev/null
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$(($(date +%s) - now))" -ge "$limit" ]; }; then
    status=TIMEOUT
    if [ "$limit" -lt "$cap" ]; then
      note="stopped at the end of the time budget ($limit s of its $cap s cap)"
    else
      note="stopped after its cap of $cap s"
    fi
  else
    local -a chk
    read -r -a chk <<<"$check"
    note=$("${chk[@]}" "$log" 2>&1)
    chk_rc=$?
    if [ "$rc" -ne 0 ]; then
      status=FAIL
      local why="exit status $rc"
      [ "$rc" -gt 128 ] && why="$why (signal $((rc - 128)))"
      # The check's view adds to a failed run only for tests (their counts).
      if [ "$part" = tests ]; then
        note="$why; $note"
      else
        # The program's own last word on why, when it gave one.
        local said
        said=$(grep -h -E '^error|panicked' "$log" | tail -1 | cut -c1-300)
        note=$why${said:+; $said}
      fi
    elif [ "$chk_rc" -eq 0 ]; then
      status=PASS
    else
      status=FAIL
    fi
  fi
  # Whatever the program said, a GPU check that did not see a GPU did not check anything.
  if [ "$device" = cuda ] && [ "$status" = PASS ] &&
    seen=$(grep -m 1 -o -E 'skipped: no CUDA device|skipped: TANDEM_TEST_CUDA=skip|skipped on the CUDA emulator[^|]*' "$log"); then
    status=FAIL
    note="$note; no GPU was seen ($seen)"
  fi
  if [ "$status" = PASS ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  note=$(echo "$note" | tr '\n|' ' /' | sed 's/^; //; s/[; ]*$//')
  echo "| $index | $part | $name | $status | $secs | $note |" >>"$rows"
  [ "$status" != PASS ] && tail_lines=60
  [ "$part" = bench ] && tail_lines=60
  [ "$part" = tests ] && [ "$status" = PASS ] && tail_lines=3
  {
    echo "## $index. [$part] $name: $status ($secs s)"
    echo
    echo "\`$(echo "$*" | sed "s#$here/#gpu-bundle/#g; s#$scratch/#SCRATCH/#g; s#$root/#REPO/#g")\`"
    echo
    [ -n "$note" ] && echo "$note" && echo
    tail_block "$tail_lines" "$log"
    for json in $(grep -o "$scratch/[A-Za-z0-9_.-]*\.json" <<<"$*" | sort -u); do
      if [ -f "$json" ] && [ "$part" = bench ]; then
        echo
        echo "<details><summary>$(basename "$json")</summary>"
        echo
        echo '```json'
        cat "$json"
        echo '```'
        echo "</details>"
      fi
    done
    echo
  } >>"$details"
  echo "== [$part] $name: $status ($secs s) $note"
  if [ "$status" != PASS ]; then tail -n 20 "$log" | sed 's/^/   | /'; fi
  write_report
}

# Checks (each gets the log last).
check_ok() { :; }

check_tests() { # LOG: the counts of libtest's summary lines
  local log=$1 p f
  p=$(grep -Eo '[0-9]+ passed' "$log" | awk '{ s += $1 } END { print s + 0 }')
  f=$(grep -Eo '[0-9]+ failed' "$log" | awk '{ s += $1 } END { print s + 0 }')
  echo "$p passed, $f failed"
  [ "$f" -eq 0 ]
}

check_accuracy() { # METRICS MIN LOG: the run's final test accuracy is at least MIN
  local metrics=$1 min=$2
  python3 - "$metrics" "$min" <<'EOF'
import json, sys
path, least = sys.argv[1], float(sys.argv[2])
try:
    metrics = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"no metrics: {e}")
    sys.exit(1)
accuracy = metrics.get("test_accuracy")
if accuracy is None:
    print(f"no test accuracy in {path}")
    sys.exit(1)
print(f"test accuracy {100 * accuracy:.2f}% (at least {100 * least:.0f}% expected), "
      f"{metrics.get('images_per_sec', 0):.0f} images/s, {metrics.get('seconds', 0):.1f} s")
sys.exit(0 if accuracy >= least else 1)
EOF
}

check_trace() { # TRACE LOG: the timeline exists and holds events from both ranks
  local trace=$1 log=$2
  grep -h '^timeline:' "$log" | tail -1
  python3 - "$trace" <<'EOF'
import json, sys
try:
    trace = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print(f"no timeline: {e}")
    sys.exit(1)
events = trace["traceEvents"] if isinstance(trace, dict) else trace
pids = {e.get("pid") for e in events if e.get("ph") != "M"}
tracks = {(e.get("pid"), e.get("tid")) for e in events if e.get("ph") != "M"}
print(f"{len(events)} events on {len(tracks)} tracks of {len(pids)} ranks")
sys.exit(0 if len(events) > 0 and len(pids) >= 2 else 1)
EOF
}

check_peer() { # LOG: the PyTorch comparison ran
  local log=$1
  if grep -q 'not run:' "$log"; then
    grep -h 'not run:' "$log" | head -3
    return 1
  fi
  grep -h -m1 '^ratio\|^ddp / torch_ddp' "$log" || true
}

check_file() { # FILE LOG
  [ -s "$1" ] && echo "wrote $(basename "$1") ($(wc -c <"$1") bytes)"
}

# ---------------------------------------------------------------------------------------------
# The parts.

part_tests() {
  local target _
  [ -f "$here/tests/MANIFEST" ] || {
    step tests MANIFEST 5 check_ok false
    return
  }
  while read -r target _; do
    [ -n "$target" ] || continue
    step tests "$target" 150 check_tests "$self" __in "$(test_dir "$target")" \
      "$here/tests/$target" --test-threads=1
  done <"$here/tests/MANIFEST"
}

part_train() {
  if [ "$device" = cuda ]; then
    local dev=cuda limits=() resnet_limits=() least=0.97 resnet_least=0.97
  else
    # Short runs: 100 MNIST steps (~88% here), 40 ResNet-20 steps (~80%).
    local dev=cpu limits=(--train-limit 6400 --test-limit 1000)
    local resnet_limits=(--train-limit 5120 --test-limit 500) least=0.6 resnet_least=0.5
  fi
  step train mnist_1rank 60 "check_accuracy $scratch/mnist_1rank.json $least" \
    "$bin/mnist" --device "$dev" --epochs 1 "${limits[@]}" \
    --metrics-out "$scratch/mnist_1rank.json"
  step train mnist_2ranks 90 "check_accuracy $scratch/mnist_2ranks.json $least" \
    "$self" __ranks 2 "$bin/mnist" --device "$dev" --epochs 1 "${limits[@]}" \
    --metrics-out "$scratch/mnist_2ranks.json"
  step train resnet20_mnist32 120 "check_accuracy $scratch/resnet20_mnist32.json $resnet_least" \
    "$bin/cifar_resnet" --dataset mnist32 --epochs 1 --device "$dev" "${resnet_limits[@]}" \
    --checkpoint-dir "$scratch/ckpt-resnet20" --metrics-out "$scratch/resnet20_mnist32.json"
}

part_timeline() {
  local dev=cuda limits=(--train-limit 5120 --test-limit 1000)
  if [ "$device" = cpu ]; then
    dev=cpu
    limits=(--train-limit 512 --test-limit 200)
  fi
  rm -f "$out_dir/timeline_2ranks.json"
  step timeline resnet20_2ranks_trace 90 "check_trace $out_dir/timeline_2ranks.json" \
    "$self" __ranks 2 "$bin/cifar_resnet" --dataset mnist32 --epochs 1 --device "$dev" \
    "${limits[@]}" --checkpoint-dir "$scratch/ckpt-timeline" \
    --trace-out "$out_dir/timeline_2ranks.json"
}

part_bench() {
  local m
  if [ "$device" = cpu ]; then
    step bench train_step_lenet 90 check_peer \
      "$bin/train_step" --device cpu --model lenet --batch-size 64 --steps 5 --warmup 2 \
      --require-peer --json "$scratch/train_step_lenet.json"
    step bench ddp_step_lenet_2ranks 120 check_peer \
      "$bin/ddp_step" --device cpu --nproc 2 --model lenet --batch-size 32 --steps 5 \
      --warmup 2 --require-peer --json "$scratch/ddp_step_lenet.json"
    return
  fi
  for m in "lenet 256 30" "resnet20 128 40" "resnet56 128 50" "resnet50 64 70"; do
    set -- $m
    step bench "train_step_$1" "$3" check_peer \
      "$bin/train_step" --device cuda --model "$1" --batch-size "$2" --steps 30 --warmup 10 \
      --require-peer --json "$scratch/train_step_$1.json"
  done
  step bench cuda_kernels 40 check_peer "$bin/cuda_kernels" --require-peer
  step bench ddp_step_resnet20_2ranks 90 check_peer \
    "$bin/ddp_step" --device cuda --nproc 2 --model resnet20 --batch-size 128 --steps 30 \
    --require-peer --json "$scratch/ddp_step_resnet20.json"
  step bench train_step_resnet20_profile 30 check_ok \
    "$bin/train_step" --device cuda --model resnet20 --batch-size 128 --steps 10 --warmup 5 \
    --no-peer --profile 10
  rm -f "$out_dir/resnet50_recording.json"
  step bench ddp_step_resnet50_record 60 "check_file $out_dir/resnet50_recording.json" \
    "$bin/ddp_step" --device cuda --nproc 1 --model resnet50 --batch-size 64 --steps 20 \
    --no-peer --record "$out_dir/resnet50_recording.json"
  step bench tandem_project_resnet50 15 check_ok \
    "$bin/tandem-project" "$out_dir/resnet50_recording.json"
}

write_report
case "$what" in
all)
  part_tests
  part_train
  part_timeline
  part_bench
  ;;
tests) part_tests ;;
train) part_train ;;
timeline) part_timeline ;;
bench) part_bench ;;
esac

if [ "$failed" -gt 0 ]; then
  result="FAILED: $failed of $index checks failed"
  [ "$skipped" -gt 0 ] && result="$result, $skipped skipped (time budget)"
  code=1
elif [ "$skipped" -gt 0 ]; then
  result="INCOMPLETE: $skipped of $index checks skipped because the ${budget} s budget ran out"
  code=3
else
  result="PASSED: all $index checks"
  code=0
fi
current=""
if [ -z "$torch_said" ] && kill -0 "$torch_probe" 2>/dev/null; then
  kill "$torch_probe" 2>/dev/null
  wait "$torch_probe" 2>/dev/null
  torch_said="not known (python3 was still importing torch when the run ended)"
fi
write_report "$result (exit status $code, $(($(date +%s) - started)) s)"
echo
echo "== tandem GPU bundle: $result; report: $report"
cat "$rows"
exit "$code"
