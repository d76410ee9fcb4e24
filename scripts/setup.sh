#!/usr/bin/env bash
# Create .venv with torch pinned to the 2.13.0 CPU build (a bare "torch" would pull a multi-GB
# CUDA build) and this package with its test extras. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
