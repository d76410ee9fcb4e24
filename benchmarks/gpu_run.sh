#!/usr/bin/env bash
# The GPU checks of benchmarks/README.md ("On a GPU"), as one script for a machine with one NVIDIA
# GPU whose python3 has torch (with CUDA), transformers and pytest. What that machine lacks of this
# package's dependencies travels in .gpu/ (not committed): .gpu/site (wheels unpacked for its
# Python: OpenTelemetry, orjson, prometheus_client, grafana-foundation-sdk, promql-parser,
# jsonschema) and .gpu/prometheus.xz (Debian's Prometheus server). Each part has its own time
# limit, so one that hangs leaves the others their figures; everything lands in $OUT. BATCH: the
# cost runs' sequences per step (default 4; larger is more GPU-bound).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/gpu-bin
export PYTHONPATH="$PWD/.gpu/site:$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -f .gpu/prometheus.xz ]; then xz -dc .gpu/prometheus.xz > /tmp/gpu-bin/prometheus && chmod +x /tmp/gpu-bin/prometheus; fi
export PATH="/tmp/gpu-bin:$PATH"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
PARTS=${PARTS:-tests eager compiled}
for part in $PARTS; do
  start=$(date +%s)
  case $part in
    tests)
      timeout "${TESTS_LIMIT:-300}" python3 -m pytest -p no:cacheprovider -v -s -rA --durations=0 \
        tests/training/test_cuda.py tests/training/test_allocator.py tests/training/test_cuda_llama.py \
        tests/dashboards/test_cuda_prometheus.py > "$OUT/pytest.log" 2>&1
      echo "tests: rc=$? in $(( $(date +%s) - start )) s"; grep -E "GPU-RESULT|PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest.log" | cut -c1-400 | tail -40 ;;
    eager)
      timeout "${EAGER_LIMIT:-150}" python3 benchmarks/gpu_cost.py --rounds 5 --steps 10 --batch "${BATCH:-4}" --reads \
        --json "$OUT/cost_eager.json" > "$OUT/cost_eager.log" 2>&1
      echo "eager: rc=$? in $(( $(date +%s) - start )) s"; tail -c 2500 "$OUT/cost_eager.log" ;;
    compiled)
      timeout "${COMPILED_LIMIT:-200}" python3 benchmarks/gpu_cost.py --rounds 3 --steps 10 --batch "${BATCH:-4}" --compile \
        --json "$OUT/cost_compiled.json" > "$OUT/cost_compiled.log" 2>&1
      echo "compiled: rc=$? in $(( $(date +%s) - start )) s"; tail -c 1500 "$OUT/cost_compiled.log" ;;
  esac
done
