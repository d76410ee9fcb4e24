#!/usr/bin/env bash
# The committed code (C = git archive 6197f17) against A again, then C's whole-run ratios.
set -u
cd "$(dirname "$0")/../../.."
out=benchmarks/results/step-replay-2026-11-27
for v in C A C; do
  OMP_NUM_THREADS=1 PYTHONPATH=/tmp/$v .venv/bin/torchrun --nproc-per-node 2 benchmarks/hook_timing.py \
    --blocks 16 --steps 30 --rounds 5 >> $out/d16_2ranks_${v}_final.txt 2>&1
done
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/C .venv/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --rounds 5 --steps 20 \
  --models dispatch-16,dispatch-64,compute-4 --variants light > $out/overhead_C.txt 2>&1
echo done > $out/.done2
