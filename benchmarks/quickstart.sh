#!/usr/bin/env bash
# The quickstart as a newcomer runs it: a fresh clone of this checkout's HEAD into a new folder,
# then `bash scripts/demo.sh` (set-up included) to its last table. With --rerun: the same command
# again in a clone whose quickstart already ran (nothing changed: the set-up is skipped).
#   farm-bench -n 3 --timeout 900 -- bash benchmarks/quickstart.sh
#   farm-bench -n 5 -- bash benchmarks/quickstart.sh --rerun
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = "--rerun" ]; then
  dir=${TMPDIR:-/tmp}/fsdp-mem-otel-quickstart-rerun
  [ -x "$dir/.venv/bin/fsdp-mem-otel" ] || { rm -rf "$dir"; git clone -q "$repo" "$dir"; bash "$dir/scripts/demo.sh" >/dev/null; }
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  git clone -q "$repo" "$dir"
fi
out=$(bash "$dir/scripts/demo.sh")
grep -q 'at step peak' <<<"$out" || { echo "quickstart: no table printed" >&2; exit 1; }
