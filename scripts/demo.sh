#!/usr/bin/env bash
# The quickstart: set up one environment, .venv, with what the demo needs (torch 2.13.0's CPU build,
# pinned because a bare "torch" pulls a multi-GB CUDA build, and this package), then run a real
# 2-rank FSDP training on CPU with the tracker on. Extra arguments go to the demo
# (`fsdp-mem-otel demo --help`). A re-run with nothing changed skips the setup: .venv/.demo-setup
# records what was installed. The test setup is scripts/test.sh's (it adds to the same .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
STAMP=.venv/.demo-setup
wanted="$TORCH $(sha256sum pyproject.toml | cut -c1-16)"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ] || [ ! -x .venv/bin/fsdp-mem-otel ]; then
  start=$SECONDS
  echo "demo: setting up .venv, once (about a minute)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # -qq: errors only, so that what the user reads is the demo
  pip_install() { .venv/bin/python -m pip install -qq --disable-pip-version-check "$@"; }
  echo "demo: [1/2] $TORCH (CPU build)" >&2
  pip_install "$TORCH"
  echo "demo: [2/2] fsdp-mem-otel and its dependencies" >&2
  pip_install -e .
  echo "$wanted" >"$STAMP"
  echo "demo: set up in $((SECONDS - start)) s; a re-run starts at once" >&2
fi
OMP_NUM_THREADS=1 exec .venv/bin/fsdp-mem-otel demo "$@"
