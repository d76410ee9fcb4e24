#!/usr/bin/env bash
# Create .venv with torch pinned to the 2.13.0 CPU build (a bare "torch" would pull a multi-GB
# CUDA build) and this package with its test extras, .venv-torch2.14 and .venv-slim. Safe to
# re-run. The Debian packages, .venv and the other two environments are installed side by side
# (independent, each mostly waiting on unpacking: about two minutes less on two cores); a failure
# in any of them fails the setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Building this package writes into the checkout (egg-info, build/): one build at a time.
BUILD_LOCK=$(mktemp)
trap 'rm -f "$BUILD_LOCK"' EXIT

# Debian packages the tests use: prometheus (promtool and the server, for the exposition and
# live-Prometheus tests), openssl (TLS test certificates), chromium (renders the HTML report).
debian_packages() {
  if ! command -v promtool >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1 \
      || ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus openssl chromium fonts-dejavu-core >/dev/null
    else
      echo "setup: install Debian's prometheus, openssl and chromium packages for the tests" >&2
    fi
  fi
}

main_venv() {
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  flock "$BUILD_LOCK" .venv/bin/python -m pip install -q -e ".[test,docs]"
  # torchtitan's own classes for tests/training/test_torchtitan_harm.py (see the requirements
  # files for why without its declared dependencies)
  .venv/bin/python -m pip install -q --no-deps -r tests/requirements-torchtitan.txt
  .venv/bin/python -m pip install -q -r tests/requirements-torchtitan-deps.txt
  # What tests/user_scripts/torchtitan_llama3.py needs beyond the above (torchtitan trains
  # through its own Trainer: triton, tensorboard, datasets; see the file for why --no-deps)
  .venv/bin/python -m pip install -q --no-deps -r tests/user_scripts/requirements-torchtitan-extra.txt
}

other_venvs() {
  # .venv-torch2.14: the tracker's FSDP tests run a second time on torch 2.14.1 (a CUDA build
  # that also runs on CPU), the other end of the supported range; only what those tests import
  # (transformers: the light-activation tests train a Llama from config).
  [ -x .venv-torch2.14/bin/python ] || "$PY" -m venv .venv-torch2.14
  .venv-torch2.14/bin/python -m pip install -q --upgrade pip
  .venv-torch2.14/bin/python -m pip install -q "torch==2.14.1"
  flock "$BUILD_LOCK" .venv-torch2.14/bin/python -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3" "transformers==5.23.0"
  # .venv-slim: a plain, non-editable install without torch, as in the sidecar image: serve,
  # report, rules and dashboards must work there (tests/test_slim_install.py).
  [ -x .venv-slim/bin/python ] || "$PY" -m venv .venv-slim
  .venv-slim/bin/python -m pip install -q --upgrade pip
  flock "$BUILD_LOCK" .venv-slim/bin/python -m pip install -q .
  flock "$BUILD_LOCK" .venv-slim/bin/python -m pip install -q --force-reinstall --no-deps .  # this checkout's code
  # TypeScript and @grafana/schema (pinned in the lockfile) to type-check the dashboards.
  if command -v npm >/dev/null 2>&1; then
    npm ci --prefix tools/grafana-schema --no-audit --no-fund --silent
  else
    echo "setup: npm not found; the dashboard type-check test will fail (install Debian's nodejs and npm)" >&2
  fi
}

pids=()
debian_packages & pids+=($!)
main_venv & pids+=($!)
other_venvs & pids+=($!)
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
if [ "$failed" -ne 0 ]; then
  echo "setup: failed (see the errors above)" >&2
  exit 1
fi
