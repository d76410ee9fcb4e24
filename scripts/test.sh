#!/usr/bin/env bash
# Set up a virtual environment (torch pinned to the 2.13.0 CPU build) and run lint + the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
export OMP_NUM_THREADS=1
.venv/bin/ruff check fsdp_mem_otel tests benchmarks
.venv/bin/mypy fsdp_mem_otel
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
