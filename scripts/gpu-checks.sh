#!/usr/bin/env bash
# The GPU checks beyond the conformance suite, under their old name (copied into the GPU bundle
# as checks.sh by scripts/gpu-bundle.sh): `checks.sh train`, `checks.sh timeline` and
# `checks.sh bench` are `run.sh train`, `run.sh timeline` and `run.sh bench`, with the same
# options, report and exit status (see run.sh). `run.sh all` runs everything in one call.
set -u
if [ $# -eq 0 ]; then
  echo "usage: $0 [run.sh options] train|timeline|bench (see run.sh --help)" >&2
  exit 2
fi
exec "$(cd "$(dirname "$0")" && pwd)/run.sh" "$@"
