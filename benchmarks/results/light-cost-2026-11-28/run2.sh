#!/usr/bin/env bash
# Deep mode again, 7 rounds, B then A (after run.sh; /tmp/A and /tmp/B as there).
set -u
cd "$(dirname "$0")/../../.."
out=benchmarks/results/light-cost-2026-11-28
run() { OMP_NUM_THREADS=1 PYTHONPATH=/tmp/$1 .venv/bin/torchrun --nproc-per-node 2 "${@:2}"; }
for v in B A; do
  run $v benchmarks/overhead.py --rounds 7 --steps 10 --models dispatch-16 --variants "deep,deep_every=100" \
    > $out/overhead_deep2_$v.txt 2>&1
done
