#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
TORCH214_TESTS=(tests/training/test_tracking.py tests/training/test_light_misses.py tests/training/test_light_activations.py
                tests/training/test_parity.py tests/training/test_compile.py tests/training/test_errors.py
                tests/training/test_estimate.py tests/training/test_inplace_saved.py tests/training/test_light_steps.py
                tests/training/test_content_dependent.py tests/training/test_shadow_peaks.py)
.venv/bin/ruff check fsdp_mem_otel tests benchmarks
.venv/bin/mypy fsdp_mem_otel
# pytest's exit code 5 (no tests collected) fails too
run_pytest() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    rc=1
  fi
  return "$rc"
}
rc=0
run_pytest .venv/bin/python -m pytest "$@" || rc=$?
# the whole suite (no arguments): the FSDP tests again on torch 2.14.1, the other end of the
# supported range
if [ "$#" -eq 0 ]; then
  echo "== the FSDP tests on torch $(.venv-torch2.14/bin/python -c 'import torch; print(torch.__version__)')"
  run_pytest .venv-torch2.14/bin/python -m pytest -p no:cacheprovider "${TORCH214_TESTS[@]}" || rc=$?
fi
exit "$rc"
