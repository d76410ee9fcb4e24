#!/usr/bin/env bash
# Build .gpu/ (ignored by git), what benchmarks/gpu_run.sh needs on a GPU machine that has torch,
# transformers and pytest but not the rest: this package's dependencies unpacked for that
# machine's Python (3.12, x86-64 Linux) into .gpu/site, and Debian's Prometheus server,
# compressed, as .gpu/prometheus.xz. Needs this machine's package index and Debian's prometheus.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu/site .gpu/wheels
mkdir -p .gpu/wheels
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform any)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .gpu/wheels \
  prometheus_client==0.26.0 orjson==3.13.0 "grafana_foundation_sdk==1769699379!11.6.0" promql-parser==0.12.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
  opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0 protobuf==7.36.2 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
"$PY" -m pip install -q --no-deps --no-compile --target .gpu/site --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --only-binary=:all: .gpu/wheels/*.whl
rm -rf .gpu/wheels .gpu/site/grafana_foundation_sdk-*.dist-info  # '!' in a name does not travel
xz -T2 -6 -c "$(command -v prometheus)" > .gpu/prometheus.xz
du -sh .gpu
