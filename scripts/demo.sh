#!/usr/bin/env bash
# Set up, then run a real 2-rank FSDP training on CPU with the tracker; extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 exec .venv/bin/fsdp-mem-otel demo "$@"
