#!/usr/bin/env bash
# A = git archive 8cb5a5b (before), B = this change's package; alternating, one at a time.
set -u
cd "$(dirname "$0")/../../.."
out=benchmarks/results/step-replay-2026-11-27
for size in "16 30" "64 20"; do
  set -- $size
  for v in A B A B; do
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/$v .venv/bin/torchrun --nproc-per-node 2 benchmarks/hook_timing.py \
      --blocks $1 --steps $2 --rounds 5 >> $out/d$1_2ranks_$v.txt 2>&1
  done
done
OMP_NUM_THREADS=1 PYTHONPATH=/tmp/B .venv/bin/torchrun --nproc-per-node 2 benchmarks/overhead.py --rounds 5 --steps 20 \
  --models dispatch-16,dispatch-64,compute-4 --variants light > $out/overhead_B.txt 2>&1
echo done > $out/.done
